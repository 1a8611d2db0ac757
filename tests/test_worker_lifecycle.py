"""A worker's life from the outside: stopped at any moment of its start it exits cleanly, and
``--until-settled`` does not wait on operations only a person can move on."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from jobtrail import AsyncJobtrail, State, Store
from jobtrail.testing import FakeProvider

from processes import finish, start_worker, write_provider


def _handles_sigterm(pid: int) -> bool:
    """Has the process installed a handler for SIGTERM yet (the SigCgt mask in /proc)?"""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


@pytest.mark.long  # a signal at each moment of the start, one process each
@pytest.mark.timeout(600)
def test_sigterm_at_any_moment_of_the_start_stops_the_worker_cleanly(tmp_path: Path) -> None:
    """SIGTERM while the worker is still importing, opening the ledger or loading its provider: exit 0.

    jobtrail's entry point takes the signal over within a few tens of milliseconds of the interpreter
    starting (before anything heavy is imported); from 0.5 s on, every signal must be a clean stop.
    """
    fake = FakeProvider().start()
    try:
        provider = write_provider(tmp_path / "fake.toml", fake)
        db = str(tmp_path / "jobs.db")
        Store.open(db).close()
        rng = random.Random(7)
        codes = []
        for _ in range(12):
            proc = start_worker(db, provider, "w")
            time.sleep(rng.uniform(0.5, 1.5))
            handled = _handles_sigterm(proc.pid)
            proc.send_signal(signal.SIGTERM)
            code, _out, err = finish(proc, timeout=60)
            codes.append((code, handled, err[-300:]))
    finally:
        fake.stop()
    assert [c for c in codes if c[0] != 0 or not c[1]] == []


def test_until_settled_does_not_wait_for_escalated_operations(tmp_path: Path) -> None:
    """A job past its result deadline is escalated (result_timed_out; still polled slowly while a worker runs):
    ``--until-settled`` exits, settled, instead of polling it forever."""
    fake = FakeProvider(job_duration_s=300).start()
    db = str(tmp_path / "jobs.db")
    try:
        provider = write_provider(tmp_path / "fake.toml", fake)

        async def submit() -> str:
            async with AsyncJobtrail(db, providers=[provider]) as jt:
                op = await jt.submit("fake", {"n": 1}, result_deadline=timedelta(seconds=1))
                return op.operation_id

        op_id = asyncio.run(submit())
        started = time.monotonic()
        code, out, err = finish(start_worker(db, provider, "w", "--until-settled", "--timeout", "120"), timeout=150)
        took = time.monotonic() - started
    finally:
        fake.stop()
    assert code == 0, err
    assert json.loads(out)["settled"] is True
    assert took < 60
    with Store.open(db) as store:
        assert store.get(op_id).state is State.RESULT_TIMED_OUT


def test_the_help_says_what_settled_means() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "jobtrail", "worker", "--help"], capture_output=True, text=True, timeout=60
    )
    assert "escalated" in done.stdout and "cancellation_unconfirmed" in done.stdout


def test_a_worker_whose_ledger_file_is_deleted_stops_with_a_clear_error(tmp_path: Path) -> None:
    """Deleting the SQLite file under a running worker: it stops (exit 2) naming the file, instead of going on
    writing into an unlinked file that the next process would never see."""
    fake = FakeProvider(job_duration_s=300).start()
    db = tmp_path / "jobs.db"
    try:
        provider = write_provider(tmp_path / "fake.toml", fake)

        async def submit() -> None:
            async with AsyncJobtrail(str(db), providers=[provider]) as jt:
                await jt.submit_many("fake", [{"n": i} for i in range(5)])

        asyncio.run(submit())
        proc = start_worker(str(db), provider, "w", "--timeout", "120")
        deadline = time.monotonic() + 60
        while fake.counts["status"] < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        for suffix in ("", "-wal", "-shm"):
            Path(f"{db}{suffix}").unlink(missing_ok=True)
        started = time.monotonic()
        code, _out, err = finish(proc, timeout=60)
    finally:
        fake.stop()
    assert code == 2, err
    assert time.monotonic() - started < 30
    assert str(db) in err and "deleted" in err
    assert not db.exists()
