"""Memory of one worker process with N operations in flight (accepted by the provider, not yet ended).

    python bench/memory.py --n 10000
    python bench/memory.py --n 100000 --db postgresql://postgres@127.0.0.1:5432/test

The fake provider runs in its own process; each job succeeds --job-duration seconds after its
create. N operations are submitted (submit_many, 1000 a transaction), then one Worker runs in a
child process with its default concurrency (1,000 actions at once: an operation in flight is a
row in the ledger between its polls, not a task in memory), polling every --poll-s seconds,
until all N are in flight at once (accepted, not ended) and then --hold-s longer; then it is
stopped with SIGTERM and reports its own peak. The parent reads the VmRSS and VmHWM of the child
(and of its writer process, summed) from
/proc every 0.5 s and counts states in the ledger. A baseline child runs the same Worker on the
same ledger before anything is submitted (0 operations) for a few seconds. On PostgreSQL the run
uses a database of its own (jobtrail_mem), created and dropped here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from typing import Any

MEM_DB = "jobtrail_mem"
#: states whose operation has a job at the provider that has not ended
IN_FLIGHT = ("accepted", "observing", "result_collecting")
#: states reached only after the provider accepted the create
PAST_CREATE = (*IN_FLIGHT, "succeeded", "failed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(base: str, poll_s: float, max_connections: int, timeout_s: float) -> dict[str, Any]:
    return {
        "name": "fake",
        "base_url": base,
        "timeout_s": timeout_s,
        "connect_timeout_s": 10,
        "create": {"path": "/v1/jobs", "job_id": "$.id"},
        "status": {"path": "/v1/jobs/{job_id}", "state": "$.status", "result_ref": "$.result_url"},
        "result": {"path": "/v1/jobs/{job_id}/result"},
        "reconcile": {"modes": ["replay"]},
        "poll": {"initial_s": poll_s, "factor": 1, "cap_s": poll_s},
        "max_connections": max_connections,
    }


def child(db: str, config: dict[str, Any], concurrency: int, batch: int, max_s: float, settle: bool) -> None:
    """The measured process: one Worker, then its own peak RSS and stats as one JSON line."""
    from jobtrail import Store
    from jobtrail.providers.http import load_provider
    from jobtrail.runtime.loop import run as run_loop
    from jobtrail.runtime.worker import Worker

    store = Store.open(db)
    worker = Worker(
        store,
        {"fake": load_provider(config)},
        worker_id="bench-memory",
        concurrency=concurrency,
        lease_s=max(120, 2 * (config["timeout_s"] + config["connect_timeout_s"]) + 10),
        batch=batch,
    )

    async def run() -> Any:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, worker.stop)
        return await worker.run(until_settled=settle, timeout=max_s)

    stats = run_loop(run())  # as `jobtrail worker` runs it
    store.close()
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = {
        "ru_maxrss_mb": me.ru_maxrss / 1024,
        "writer_maxrss_mb": kids.ru_maxrss / 1024,  # the writer process, ended with the run
        "cpu_s": me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime,
    }
    out |= {k: getattr(stats, k) for k in ("claimed", "claims", "actions", "stale", "lease_too_short", "errors")}
    print(json.dumps(out), flush=True)


def _rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB of the worker and its writer process, summed; VmHWM is the kernel's own peak,
    so nothing between samples is missed (the sum of two peaks: at most what both held at once)."""
    rss = hwm = 0.0
    for one in (pid, *_children(pid)):
        fields: dict[str, float] = {}
        try:
            with open(f"/proc/{one}/status") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key in ("VmRSS", "VmHWM"):
                        fields[key] = int(value.split()[0]) / 1024
        except FileNotFoundError:
            if one == pid:
                raise
            continue
        rss, hwm = rss + fields.get("VmRSS", 0.0), hwm + fields.get("VmHWM", 0.0)
    return rss, hwm


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except FileNotFoundError:
        return []


def _states(engine: Any) -> dict[str, int]:
    import sqlalchemy as sa

    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT state, count(*) FROM operations GROUP BY state")).all()
    return {str(state): int(count) for state, count in rows}


def _spawn(args: argparse.Namespace, db: str, config: dict[str, Any], max_s: float, settle: bool) -> Any:
    cmd = [sys.executable, __file__, "--child", db, "--config", json.dumps(config)]
    cmd += ["--concurrency", str(args.concurrency)]
    cmd += ["--batch", str(args.batch), "--max-s", str(max_s), *(["--settle"] if settle else [])]
    # the worker logs every failed action: to a file, so a bad run cannot flood the terminal
    log = tempfile.NamedTemporaryFile("w+", prefix="memory-worker-", suffix=".log", delete=False)  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True), log.name


def _finish(proc: Any, log: str, grace_s: float) -> dict[str, Any]:
    try:
        out, _ = proc.communicate(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()  # past the limit: the worker is killed and cannot report its own figures
        proc.communicate()
        return {"killed": True, "log": log}
    lines = (out or "").strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"worker exited {proc.returncode}; see {log}")
    return {**json.loads(lines[-1]), "log": log}


def baseline(args: argparse.Namespace, db: str, config: dict[str, Any]) -> float:
    """RSS of a worker that has been idle on an empty ledger for a few seconds."""
    proc, log = _spawn(args, db, config, max_s=4.0, settle=False)
    rss = 0.0
    while proc.poll() is None:
        try:
            rss = _rss_mb(proc.pid)[0]
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(0.5)
    _finish(proc, log, 30)
    return rss


def measure(args: argparse.Namespace, db: str, config: dict[str, Any], engine: Any) -> dict[str, Any]:
    n = args.n
    proc, log = _spawn(args, db, config, max_s=args.max_s, settle=True)
    t0 = time.monotonic()
    peak = hwm = peak_in_flight = 0.0
    all_accepted: tuple[float, float] | None = None  # (seconds, RSS MB) when every create was accepted
    all_in_flight: tuple[float, float] | None = None  # the same, when all N were in flight at once
    states: dict[str, int] = {}
    while proc.poll() is None and time.monotonic() - t0 < args.max_s + 5:
        try:
            rss, hwm = _rss_mb(proc.pid)
        except (FileNotFoundError, ProcessLookupError):
            break
        peak = max(peak, rss)
        states = _states(engine)
        elapsed = time.monotonic() - t0
        in_flight = sum(states.get(s, 0) for s in IN_FLIGHT)
        peak_in_flight = max(peak_in_flight, in_flight)
        if all_in_flight is None and in_flight >= n:
            all_in_flight = (elapsed, rss)
        if all_accepted is None and sum(states.get(s, 0) for s in PAST_CREATE) >= n:
            all_accepted = (elapsed, rss)
        if states.get("succeeded", 0) >= n:
            break
        if all_in_flight is not None and elapsed >= all_in_flight[0] + args.hold_s:
            proc.send_signal(signal.SIGTERM)  # stop claiming, finish what is in flight, report
            break
        time.sleep(0.5)
    wall = time.monotonic() - t0
    result = _finish(proc, log, grace_s=60)
    return {
        **result,
        "wall_s": wall,
        "peak_sampled_mb": peak,
        "hwm_mb": hwm,
        "all_accepted": all_accepted,
        "all_in_flight": all_in_flight,
        "peak_in_flight": peak_in_flight,
        "states": _states(engine) or states,
    }


def _pg_database(url: str, create: bool) -> str:
    """Create (or drop) this bench's own database next to the one ``url`` names; return its URL."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {MEM_DB} WITH (FORCE)")
        if create:
            conn.execute(f"CREATE DATABASE {MEM_DB}")
    return urllib.parse.urlparse(url)._replace(path=f"/{MEM_DB}").geturl()


async def _submit(db: str, config: dict[str, Any], n: int) -> None:
    from jobtrail import AsyncJobtrail, Store

    jt = AsyncJobtrail(store=Store.open(db), providers=[config])
    for start in range(0, n, 1000):
        await jt.submit_many("fake", [{"i": i} for i in range(start, min(n, start + 1000))])
    await jt.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000, help="operations")
    parser.add_argument("--concurrency", type=int, default=1000, help="the worker's (default: its own default)")
    parser.add_argument("--hold-s", type=float, default=30, help="how long to go on once all N are in flight")
    parser.add_argument("--db", default="", help="PostgreSQL URL (default: a temp SQLite file)")
    parser.add_argument("--max-s", type=float, default=300, help="longest worker run (default 300)")
    parser.add_argument("--job-duration", type=float, default=900, help="seconds until a job succeeds")
    parser.add_argument("--poll-s", type=float, default=60, help="poll interval (default 60)")
    parser.add_argument("--max-connections", type=int, default=256, help="HTTP connections (jobtrail's default)")
    parser.add_argument("--timeout-s", type=float, default=30, help="provider call timeout (default 30)")
    parser.add_argument("--batch", type=int, default=1000, help="operations claimed per query")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--settle", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, json.loads(args.config), args.concurrency, args.batch, args.max_s, args.settle)
        return

    port = _free_port()
    fake = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jobtrail.testing.provider",
            *("--port", str(port)),
            "--job-duration",
            str(args.job_duration),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert fake.stdout is not None
    config = _config(json.loads(fake.stdout.readline())["base_url"], args.poll_s, args.max_connections, args.timeout_s)
    db = _pg_database(args.db, create=True) if args.db else os.path.join(tempfile.mkdtemp(), "memory.db")
    try:
        from jobtrail import Store

        store = Store.open(db)  # migrated before the baseline, so the baseline worker does no schema work
        idle = baseline(args, db, config)
        t0 = time.monotonic()
        asyncio.run(_submit(db, config, args.n))
        submit_s = time.monotonic() - t0
        r = measure(args, db, config, store.engine)
        store.close()
    finally:
        fake.terminate()
        fake.wait(10)
        if args.db:
            _pg_database(args.db, create=False)

    engine = "postgresql" if args.db else "sqlite"
    print(
        f"N = {args.n}, {engine}, worker concurrency {args.concurrency}, claim batch {args.batch}, "
        f"{args.max_connections} HTTP connections, timeout {args.timeout_s:g} s, polls every {args.poll_s:g} s, "
        f"jobs succeed {args.job_duration:g} s after create"
    )
    print(f"submit: {submit_s:.1f} s ({args.n / submit_s:.0f} ops/s)")
    print(f"idle worker, 0 operations:        RSS {idle:7.1f} MB")
    for label, seen in (
        ("all N accepted by the provider", r["all_accepted"]),
        ("all N in flight at once", r["all_in_flight"]),
    ):
        text = f"after {seen[0]:6.1f} s, RSS {seen[1]:7.1f} MB" if seen else "never reached"
        print(f"{label + ':':<33} {text}")
    print(f"most in flight at once (sampled): {r['peak_in_flight']:.0f}")
    print(f"peak RSS: sampled {r['peak_sampled_mb']:.1f} MB, VmHWM {r['hwm_mb']:.1f} MB", end="")
    if r.get("killed"):
        print(f"; worker killed at the limit (no ru_maxrss), log {r['log']}")
    else:
        print(
            f", ru_maxrss {r['ru_maxrss_mb']:.1f} MB + writer process {r['writer_maxrss_mb']:.1f} MB "
            f"({r['cpu_s']:.0f} CPU s)"
        )
        stats = ", ".join(f"{k} {r[k]}" for k in ("claimed", "claims", "actions", "stale", "lease_too_short", "errors"))
        print(f"worker: {stats}; log {r['log']}")
    print(f"run {r['wall_s']:.1f} s, final states: {json.dumps(r['states'], sort_keys=True)}")


if __name__ == "__main__":
    main()
