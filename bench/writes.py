"""The worker's writes alone, repeatably: record a real run's group commits, then replay them.

    python bench/writes.py --n 3000
    python bench/writes.py --n 3000 --replays 5 --profile      # and where the time goes (cProfile)
    python bench/writes.py --n 1000 --instructions             # instructions per write (valgrind)

A whole life cycle (``lifecycle.py``) on this shared machine varies by a tenth from
run to run, too much to see a change of a few percent. This runs one jobtrail worker
on SQLite against the fake provider (as ``lifecycle.py`` does), records every claim
and every group commit with the clock it read, and snapshots the ledger once the
submits are in. Then it replays the same claims and commits on copies of the snapshot,
with the same clocks, and reports the CPU ``Store.apply`` takes per write (the fastest
replay, with the median). A replay is exact: every write lands as it did (none is
refused as stale), so the same writes are measured on every run and every commit.

Even so its CPU clock drifts with whatever else the machine runs (a fifth from one hour to
the next, here). ``--instructions`` counts instead: it replays under valgrind's cachegrind,
once and twice, and reports the difference (instructions of one replay, claims included)
per write and per operation. It repeats to a hundredth of a percent, and sees a change of
one percent. valgrind makes a replay some fifty times slower: a thousand operations take a
minute or two.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

from lifecycle import _free_port, provider_config

from jobtrail.ledger.chain import _int_digest, _short_str_digest
from jobtrail.ledger.store import Create, Moved, Store


class _Recording(Store):
    """A store that remembers every claim and group commit it ran, and the clock each one read."""

    snapshot: str = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, int, Any]] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        real = self.clock

        def clock() -> int:  # the first reading of a claim or a commit is the one it decides by
            now = real()
            if getattr(self._local, "first", 0) is None:
                self._local.first = now
            return now

        self.clock = clock

    def _first_clock(self, call: Any) -> tuple[Any, int]:
        self._local.first = None
        try:
            return call(), self._local.first
        finally:
            self._local.first = 0

    def apply(self, batch: Any) -> Any:
        out, now = self._first_clock(lambda: super(_Recording, self).apply(batch))
        with self._lock:
            if all(isinstance(w, Create) for w in batch):  # the submits: the replay starts from what they made
                _copy(self.engine.url.database, self.snapshot)
                self.events.clear()
            else:
                self.events.append(("apply", now, list(batch)))
        return out

    def claim(self, worker: str, **kwargs: Any) -> Any:
        out, now = self._first_clock(lambda: super(_Recording, self).claim(worker, **kwargs))
        with self._lock:
            self.events.append(("claim", now, (worker, kwargs)))
        return out


def _copy(source: str | None, target: str) -> None:
    """A consistent copy of a SQLite ledger in WAL mode (the backup API, not the file alone)."""
    src, dst = sqlite3.connect(str(source)), sqlite3.connect(target)
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()


def record(base: str, n: int, folder: str) -> _Recording:
    from jobtrail import AsyncJobtrail
    from jobtrail.providers.http import load_provider
    from jobtrail.runtime.loop import run as run_loop
    from jobtrail.runtime.worker import Worker

    config = provider_config(base)
    _Recording.snapshot = os.path.join(folder, "snapshot.db")
    store = _Recording.open(os.path.join(folder, "recorded.db"))
    assert isinstance(store, _Recording)
    jt = AsyncJobtrail(store=store, providers=[config])

    async def run() -> None:
        for start in range(0, n, 500):
            await jt.submit_many("fake", [{"i": i} for i in range(start, min(n, start + 500))])
        worker = Worker(store, {"fake": load_provider(config)}, worker_id="bench", concurrency=2000, lease_s=120)
        await worker.run(until_settled=True)

    run_loop(run())
    store.close()
    return store


def replay(events: list[tuple[str, int, Any]], snapshot: str, folder: str) -> tuple[float, int, int]:
    """CPU seconds in Store.apply, writes, writes refused as stale."""
    path = os.path.join(folder, "replay.db")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    shutil.copy(snapshot, path)
    # each replay starts as a worker does: what an earlier replay of the same writes left in the process's
    # caches (digests of the very same integers) would make every replay after the first look cheaper
    _int_digest.cache_clear()
    _short_str_digest.cache_clear()
    store = Store.open(path)
    cpu = 0.0
    writes = moved = 0
    try:
        for kind, now, payload in events:
            store.clock = lambda now=now: now  # type: ignore[misc]
            if kind == "claim":
                worker, kwargs = payload
                store.claim(worker, **kwargs)
                continue
            started = time.process_time()
            out = store.apply(payload)
            cpu += time.process_time() - started
            writes += len(payload)
            moved += sum(isinstance(o, Moved) for o in out)
    finally:
        store.close()
    return cpu, writes, moved


def instructions(events: list[tuple[str, int, Any]], snapshot: str, folder: str) -> float:
    """Instructions of one whole replay (claims and commits): cachegrind's count of two minus one."""
    recording = os.path.join(folder, "events.pickle")
    with open(recording, "wb") as fh:
        pickle.dump((events, snapshot), fh)
    counts = []
    for replays in (1, 2):
        out = subprocess.run(
            [
                *("valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null"),
                *(sys.executable, __file__, "--replay-only", recording, "--replays", str(replays)),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        found = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
        if out.returncode != 0 or found is None:
            raise SystemExit(f"the replay under cachegrind failed (status {out.returncode}):\n{out.stderr[-2000:]}")
        counts.append(int(found.group(1).replace(",", "")))
    return float(counts[1] - counts[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile of one more replay")
    parser.add_argument("--instructions", action="store_true", help="count instructions under valgrind instead")
    parser.add_argument("--replay-only", help=argparse.SUPPRESS)  # (what --instructions runs under valgrind)
    args = parser.parse_args()
    if args.replay_only:
        with open(args.replay_only, "rb") as fh:
            events, snapshot = pickle.load(fh)  # our own recording, just made
        for _ in range(args.replays):
            replay(events, snapshot, os.path.dirname(args.replay_only))
        return
    if args.instructions and shutil.which("valgrind") is None:
        raise SystemExit("--instructions runs the replay under valgrind: install it (apt-get install valgrind)")
    fake = subprocess.Popen(
        [sys.executable, "-m", "jobtrail.testing.provider", "--port", str(_free_port()), "--job-duration", "1.0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert fake.stdout is not None
    folder = tempfile.mkdtemp()
    try:
        base = json.loads(fake.stdout.readline())["base_url"]
        recorded = record(base, args.n, folder)
    finally:
        fake.terminate()
        fake.wait(10)
    events = recorded.events
    kinds = Counter(type(w).__name__ for kind, _, batch in events if kind == "apply" for w in batch)
    commits = sum(kind == "apply" for kind, _, _ in events)
    print(
        f"recorded N = {args.n}: {commits} group commits, "
        + ", ".join(f"{count / args.n:.2f} {name}" for name, count in kinds.most_common())
        + " per operation"
    )
    if args.instructions:
        try:
            count = instructions(events, recorded.snapshot, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        writes = sum(len(batch) for kind, _, batch in events if kind == "apply")
        print(
            f"one replay (claims and group commits): {count / writes / 1000:.1f} k instructions per write, "
            f"{count / args.n / 1e6:.3f} M per operation (valgrind cachegrind, two replays minus one)"
        )
        return
    runs = [replay(events, recorded.snapshot, folder) for _ in range(args.replays)]
    per_write = [cpu / writes * 1e6 for cpu, writes, _ in runs]
    writes, moved = runs[0][1], runs[0][2]
    print(
        f"Store.apply: {min(per_write):.1f} us CPU per write at best, median {statistics.median(per_write):.1f} "
        f"({args.replays} replays of {writes} writes, {writes / args.n:.2f} per operation; "
        f"{moved} refused as stale, as recorded: 0)"
    )
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(replay, events, recorded.snapshot, folder)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        if os.environ.get("BENCH_PSTATS"):  # the whole profile, for pstats or snakeviz
            profiler.dump_stats(os.environ["BENCH_PSTATS"])
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
