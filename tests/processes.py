"""Real processes for tests: worker and CLI subprocesses, and what to assert about them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jobtrail import AsyncJobtrail, Store
from jobtrail.testing import FakeProvider


def write_provider(path: Path, fake: FakeProvider, **overrides: Any) -> Path:
    return fake.write_provider_file(path, connect_timeout_s=1.0, **overrides)


def submit_many(db_url: str, fake: FakeProvider, n: int) -> list[str]:
    store = Store.open(db_url)
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])

    async def go() -> list[str]:
        return [(await jt.submit("fake", {"i": i})).operation_id for i in range(n)]

    ids = asyncio.run(go())
    store.close()
    return ids


def start_worker(
    db_url: str, provider: Path, name: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jobtrail",
            "--db",
            db_url,
            "worker",
            "--provider",
            str(provider),
            "--id",
            name,
            "--json",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def finish(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def assert_one_worker_per_lease(fake: FakeProvider) -> None:
    """Every status poll of a job names its lease; one epoch never belongs to two workers, and
    epochs never interleave in time."""
    by_job: dict[str, list[tuple[float, str, int]]] = defaultdict(list)
    for job, lease, at in fake.status_leases:
        assert lease is not None, "a status poll was made without a lease"
        owner, epoch = lease.rsplit("/", 1)
        by_job[job].append((at, owner, int(epoch)))
    for job, polls in by_job.items():
        owners: dict[int, str] = {}
        for _, owner, epoch in polls:
            assert owners.setdefault(epoch, owner) == owner, f"{job}: epoch {epoch} polled by two workers"
        epochs = [epoch for _, _, epoch in sorted(polls)]
        assert epochs == sorted(epochs), f"{job}: polls under an older lease after a newer one"


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``jobtrail ARGS...`` in a new process, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "jobtrail", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def jobtrail(db_url: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, str, str]:
    """Run ``jobtrail --db DB ARGS...``; returns (exit code, stdout, stderr)."""
    done = cli("--db", db_url, *args, env=env, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def assert_audit_verifies(db_url: str) -> None:
    """``jobtrail audit verify`` (a separate process) finds every history chain intact."""
    code, out, err = jobtrail(db_url, "audit", "verify", "--json")
    assert code == 0, f"audit verify exited {code}: {out}{err}"
    assert json.loads(out)["ok"] is True


@contextlib.contextmanager
def write_lock_held_elsewhere(db_path: str, seconds: float) -> Iterator[subprocess.Popen[str]]:
    """Another process takes SQLite's write lock and keeps it for ``seconds``."""
    code = (
        "import sqlite3, sys, time\n"
        "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('BEGIN IMMEDIATE')\n"
        "print('locked', flush=True)\n"
        "time.sleep(float(sys.argv[2]))\n"
        "c.execute('COMMIT')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, db_path, str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    try:
        yield proc
    finally:
        proc.wait(30)
        proc.stdout.close()


def pipe_capacity() -> int:
    """How many bytes a new pipe holds: 64 KiB on most Linux machines, 1 MiB where pages are 64 KiB."""
    import fcntl

    read, write = os.pipe()
    try:
        return int(fcntl.fcntl(read, fcntl.F_GETPIPE_SZ))
    finally:
        os.close(read)
        os.close(write)


def stop_midway_through_a_write(pid: int, times: int = 3, timeout: float = 60.0) -> None:
    """Once process ``pid`` waits for room in a full pipe, in the middle of a write (Linux), SIGSTOP and
    SIGCONT it ``times`` times: each stop interrupts that write. It is never left stopped."""
    import signal
    import time

    deadline = time.monotonic() + timeout
    while True:
        with open(f"/proc/{pid}/wchan") as fh:
            if "pipe_write" in fh.read():
                break
        assert time.monotonic() < deadline, f"process {pid} never blocked writing to a full pipe"
        time.sleep(0.01)
    try:
        for _ in range(times):
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.1)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.05)
    finally:
        os.kill(pid, signal.SIGCONT)
