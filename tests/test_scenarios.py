"""The failure scenarios, each with real worker processes and the fake provider over loopback.

Every scenario asserts what the provider actually saw (creates, jobs made,
cancels, result fetches), how the ledger ended and why, and that
``jobtrail audit verify``, run as its own process, finds every chain intact.
Each runs on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from jobtrail import AsyncJobtrail, Operation, State, Store
from jobtrail.testing import FakeProvider, Fault

from helpers import free_port
from processes import assert_audit_verifies, assert_one_worker_per_lease, finish, jobtrail, start_worker

S = State
#: fast polls so a scenario ends in seconds
FAST = {"poll": {"initial_s": 0.1, "factor": 1.5, "cap_s": 0.3}, "retry": {"initial_s": 0.1, "factor": 2, "cap_s": 0.5}}
#: a 5 s client time-out (a loaded machine never turns a slow answer into a lost one), so leases of 7 s
SETTLE = ("--until-settled", "--timeout", "90", "--lease", "7")


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    provider = FakeProvider(job_duration_s=0.3).start()
    yield provider
    provider.stop()


def submit(db_url: str, config: dict[str, Any], body: Any) -> str:
    """What an agent does: make the operation durable (nothing is sent by this)."""

    async def go() -> str:
        with Store.open(db_url) as store:
            return (await AsyncJobtrail(store=store, providers=[config]).submit("fake", body)).operation_id

    return asyncio.run(go())


def provider_file(tmp_path: Path, fake: FakeProvider, **overrides: Any) -> Path:
    settings = {"timeout_s": 5.0, "connect_timeout_s": 1.0, **FAST, **overrides}
    return fake.write_provider_file(tmp_path / "fake.toml", **settings)


def settle(db_url: str, provider: Path, name: str = "w1", env: dict[str, str] | None = None) -> None:
    code, _out, err = finish(start_worker(db_url, provider, name, *SETTLE, env=env))
    assert code == 0, err


def ledger(db_url: str, operation_id: str) -> tuple[Operation, list[str]]:
    """The record and the causes of its history, in order."""
    with Store.open(db_url) as store:
        return store.get(operation_id), [e.cause for e in store.history(operation_id)]


def wait_for(what: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def crashed_worker(
    db_url: str, tmp_path: Path, fake: FakeProvider, body: Any, point: str, name: str = "doomed", **overrides: Any
) -> tuple[str, Path]:
    """Submit one operation and run a worker that the failpoint kills at ``point`` (``overrides``: of the
    provider file)."""
    op_id = submit(db_url, fake.provider_config(), body)
    provider = provider_file(tmp_path, fake, **overrides)
    env = {"JOBTRAIL_FAILPOINTS": f"{point}=exit"}
    code, _, _ = finish(start_worker(db_url, provider, name, *SETTLE, env=env))
    assert code == 137, "the failpoint killed the worker"
    return op_id, provider


def test_1_the_provider_commits_the_create_but_the_response_is_dropped(
    db_url: str, tmp_path: Path, fake: FakeProvider
) -> None:
    fake.script(Fault.drop(commit=True))
    op_id = submit(db_url, fake.provider_config(), {"scenario": 1})
    settle(db_url, provider_file(tmp_path, fake))
    op, causes = ledger(db_url, op_id)
    assert op.state is S.SUCCEEDED, op.state_reason
    assert fake.counts["creates_received"] == 2, "the replay carried the same token"
    assert fake.counts["jobs_created"] == 1 and fake.jobs_for(op.idempotency_token) == [op.remote_job_id]
    assert fake.counts["results"] == 1
    assert causes.index("ambiguous_create") < causes.index("confirmed_create")
    assert_audit_verifies(db_url)


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_2_the_worker_dies_after_storing_the_job_id_before_the_first_poll(
    db_url: str, tmp_path: Path, fake: FakeProvider
) -> None:
    # the first poll 2 s after the create's answer (the lease is 7 s): the write that stores the job id lands
    # before it is due even on a loaded machine (a write that lands once it is due keeps the lease, by design:
    # the worker goes on to poll; CI saw that with the 0.1 s of FAST). Its cap and jitter too: FAST's cap
    # held it to 0.3 s, and full jitter (the default) to anywhere below that; CI saw the lease kept again.
    first_poll = {**FAST["poll"], "initial_s": 2.0, "cap_s": 2.0, "jitter": 0.1}
    op_id, provider = crashed_worker(db_url, tmp_path, fake, {"scenario": 2}, "create.after_job_id", poll=first_poll)
    op, _ = ledger(db_url, op_id)
    with Store.open(db_url) as store:  # (the story's premise: the first poll was put a second or more ahead)
        (confirmed,) = [e for e in store.history(op_id) if e.cause == "confirmed_create"]
    assert op.next_action_at_us is not None and op.next_action_at_us - confirmed.at_us > 1_000_000
    # the write that stored the job id left the first poll for later, so it ended the lease too: the next
    # worker polls when the poll is due, not when the dead worker's lease runs out
    assert op.state is S.ACCEPTED and op.lease_owner is None and op.lease_expires_at_us is None
    settle(db_url, provider, "w2")
    op, causes = ledger(db_url, op_id)
    assert op.state is S.SUCCEEDED, op.state_reason
    assert fake.counts["creates_received"] == 1 and fake.counts["jobs_created"] == 1
    assert fake.counts["results"] == 1
    assert causes.count("confirmed_create") == 1
    assert_audit_verifies(db_url)


def test_3_the_job_finishes_while_the_cancel_is_in_flight(db_url: str, tmp_path: Path, fake: FakeProvider) -> None:
    op_id = submit(db_url, fake.provider_config(), {"scenario": 3, "fake": {"duration": 30, "cancel": "finish_first"}})
    worker = start_worker(db_url, provider_file(tmp_path, fake), "w1", *SETTLE)
    try:
        wait_for(lambda: ledger(db_url, op_id)[0].state is S.OBSERVING)
        code, out, err = jobtrail(db_url, "cancel", op_id, "--by", "alice", "--reason", "wrong input")
        assert code == 0, out + err
        code, _, err = finish(worker)
        assert code == 0, err
    finally:
        worker.kill()
    op, causes = ledger(db_url, op_id)
    assert op.state is S.SUCCEEDED, "the job finished first: its result is collected, not called cancelled"
    assert fake.counts["cancels"] == 1 and fake.counts["jobs_created"] == 1 and fake.counts["results"] == 1
    assert causes.index("cancel_intent") < causes.index("cancel_attempt") < causes.index("validated_result")
    assert_audit_verifies(db_url)


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_4_the_same_webhook_arrives_twice_and_out_of_order(db_url: str, tmp_path: Path) -> None:
    port = free_port()
    secret = "whsec_" + "c2NlbmFyaW8tZm91ci13ZWJob29rLXNlY3JldCE="
    env = {"WHSEC_SCENARIO": secret}
    fake = FakeProvider(
        job_duration_s=1.0,
        webhook_url=f"http://127.0.0.1:{port}/webhooks/fake",
        webhook_secret=secret,
        webhook_faults={"duplicate", "reorder"},
    ).start()
    receiver = None
    try:
        # slow polls: what moves the operation along is mostly the webhooks
        overrides = {"webhooks": {"secrets": ["env:WHSEC_SCENARIO"]}, "poll": {"initial_s": 3, "factor": 1, "cap_s": 3}}
        provider = provider_file(tmp_path, fake, **overrides)
        receiver = start_cli(db_url, "webhooks", "serve", "--provider", str(provider), "--port", str(port), env=env)
        wait_for(lambda: port_open(port))
        ids = [submit(db_url, fake.provider_config(), {"scenario": 4, "n": n}) for n in range(3)]
        settle(db_url, provider, env=env)
        time.sleep(0.5)  # late duplicates
    finally:
        fake.stop()
        if receiver is not None:
            receiver.send_signal(signal.SIGTERM)
            receiver.communicate(timeout=10)
    for op_id in ids:
        op, causes = ledger(db_url, op_id)
        assert op.state is S.SUCCEEDED, op.state_reason
        assert causes[-1] == "validated_result"
        assert causes.count("status_observation") == 2, "webhooks never move the state: two polls did"
    assert fake.counts["jobs_created"] == 3 and fake.counts["creates_received"] == 3 and fake.counts["results"] == 3
    statuses = [status for _, status in fake.webhook_deliveries]
    events = [event for event, _ in fake.webhook_deliveries]
    assert 200 in statuses, "a duplicate was answered as already recorded"
    assert len(events) > len(set(events)), "the provider really delivered an event twice"
    with Store.open(db_url) as store, store.engine.connect() as conn:
        recorded = conn.execute(sa.text("SELECT event_id FROM webhook_events")).scalars().all()
    assert len(recorded) == len(set(recorded)) == len(set(events)), "each event recorded exactly once"
    assert_audit_verifies(db_url)


def start_cli(db_url: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "jobtrail", "--db", db_url, *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_5_a_worker_restarts_after_its_lease_expired_while_another_holds_a_new_one(
    db_url: str, tmp_path: Path, fake: FakeProvider
) -> None:
    op_id, provider = crashed_worker(db_url, tmp_path, fake, {"scenario": 5}, "create.after_attempt", name="a")
    dead, _ = ledger(db_url, op_id)
    assert dead.lease_owner == "a" and dead.attempts == 1
    # b's create is answered slowly, so b holds the new lease while a comes back
    fake.script(Fault.delay(1.5, commit=True))
    b = start_worker(db_url, provider, "b", *SETTLE)
    wait_for(lambda: ledger(db_url, op_id)[0].lease_owner == "b")
    held, _ = ledger(db_url, op_id)
    assert held.lease_epoch > dead.lease_epoch
    a = start_worker(db_url, provider, "a", *SETTLE)
    for proc in (a, b):
        code, _, err = finish(proc)
        assert code == 0, err
    op, causes = ledger(db_url, op_id)
    assert op.state is S.SUCCEEDED, op.state_reason
    assert fake.counts["creates_received"] == 1, "a never sent its recorded attempt; b sent once"
    assert fake.counts["jobs_created"] == 1 and fake.counts["results"] == 1
    assert causes.count("create_attempt") == 2
    assert_one_worker_per_lease(fake)
    assert_audit_verifies(db_url)


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_6_the_worker_dies_after_the_remote_commit_before_the_local_confirmation(
    db_url: str, tmp_path: Path, fake: FakeProvider
) -> None:
    op_id, provider = crashed_worker(db_url, tmp_path, fake, {"scenario": 6}, "create.after_response")
    assert fake.counts["jobs_created"] == 1
    before, _ = ledger(db_url, op_id)
    assert before.state is S.CREATE_PENDING and before.remote_job_id is None, "the commit never reached the ledger"
    settle(db_url, provider, "w2")
    op, causes = ledger(db_url, op_id)
    assert op.state is S.SUCCEEDED, op.state_reason
    assert fake.counts["creates_received"] == 2 and fake.counts["replayed"] == 1
    assert causes.index("ambiguous_create") < causes.index("confirmed_create"), "an unanswered attempt is doubtful"
    assert fake.counts["jobs_created"] == 1 and fake.jobs_for(op.idempotency_token) == [op.remote_job_id]
    assert fake.counts["results"] == 1
    assert_audit_verifies(db_url)


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_7_the_provider_is_down_for_a_while_then_back(db_url: str, tmp_path: Path) -> None:
    port = free_port()
    fake = FakeProvider(port=port, job_duration_s=0.3)
    fake.base_url = f"http://127.0.0.1:{port}"
    op_id = submit(db_url, fake.provider_config(), {"scenario": 7})
    worker = start_worker(db_url, provider_file(tmp_path, fake), "w1", *SETTLE)
    try:
        wait_for(lambda: ledger(db_url, op_id)[1].count("create_not_sent") >= 2)
        fake.start()
        code, _, err = finish(worker)
        assert code == 0, err
    finally:
        worker.kill()
        fake.stop()
    op, causes = ledger(db_url, op_id)
    assert op.state is S.SUCCEEDED, op.state_reason
    assert "ambiguous_create" not in causes, "a refused connection proves nothing was sent"
    assert fake.counts["creates_received"] == 1 and fake.counts["jobs_created"] == 1 and fake.counts["results"] == 1
    assert_audit_verifies(db_url)


def test_8_the_provider_answers_a_replay_with_a_new_job_id(db_url: str, tmp_path: Path, fake: FakeProvider) -> None:
    reconcile = {
        "modes": ["replay", "list_by_reference"],
        "list_path": "/v1/jobs?client_reference={token}",
        "items": "$.data",
        "reference": "$.client_reference",
    }
    fake.script(Fault.drop(commit=True), Fault.replay_new_id())
    op_id = submit(db_url, fake.provider_config(reconcile=reconcile), {"scenario": 8})
    settle(db_url, provider_file(tmp_path, fake, reconcile=reconcile))
    op, causes = ledger(db_url, op_id)
    assert op.state is S.NEEDS_ATTENTION
    assert causes[-1] == "conflicting_job_ids"
    jobs = fake.jobs_for(op.idempotency_token)
    assert len(jobs) == 2 and all(job in op.state_reason for job in jobs), op.state_reason
    assert fake.counts["creates_received"] == 2, "nothing more is sent once the contract is broken"
    assert fake.counts["cancels"] == 0 and fake.counts["results"] == 0
    assert_audit_verifies(db_url)


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
@pytest.mark.parametrize(
    ("mode", "state", "fetches", "reason"),
    [
        ({"result": "flaky", "flaky": 2}, S.SUCCEEDED, 3, "result stored"),
        ({"result": "bad_checksum"}, S.RESULT_VALIDATION_FAILED, 1, "checksum"),
    ],
    ids=["fails-twice-then-succeeds", "corrupted"],
)
def test_9_the_result_download_fails_twice_then_succeeds_and_a_corrupted_result(
    db_url: str, tmp_path: Path, fake: FakeProvider, mode: dict[str, Any], state: State, fetches: int, reason: str
) -> None:
    op_id = submit(db_url, fake.provider_config(), {"scenario": 9, "fake": mode})
    settle(db_url, provider_file(tmp_path, fake))
    op, _ = ledger(db_url, op_id)
    assert op.state is state
    assert reason in (op.state_reason or "")
    assert fake.counts["results"] == fetches and fake.counts["jobs_created"] == 1
    assert_audit_verifies(db_url)


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_a_cancel_recorded_between_a_crash_and_the_restart_never_causes_a_second_create(
    db_url: str, tmp_path: Path, fake: FakeProvider
) -> None:
    """Found by the simulation (seed 143): a person's cancel recorded after an attempt whose outcome was
    lost hid that attempt, and the next worker sent the create again; on a provider without tokens that
    is a second job."""
    tokenless = {"create": {"token": {"in": "none"}}, "reconcile": {"modes": []}}
    op_id = submit(db_url, fake.provider_config(**tokenless), {"scenario": "cancel-after-crash"})
    provider = provider_file(tmp_path, fake, **tokenless)
    env = {"JOBTRAIL_FAILPOINTS": "create.after_response=exit"}
    code, _, _ = finish(start_worker(db_url, provider, "doomed", *SETTLE, env=env))
    assert code == 137 and fake.counts["jobs_created"] == 1
    code, out, err = jobtrail(db_url, "cancel", op_id, "--by", "alice", "--reason", "changed my mind")
    assert code == 0, out + err
    settle(db_url, provider, "w2")
    op, causes = ledger(db_url, op_id)
    assert op.state is S.NEEDS_ATTENTION and "at-most-once" in (op.state_reason or "")
    assert fake.counts["creates_received"] == 1 and fake.counts["jobs_created"] == 1
    assert causes.count("create_attempt") == 1
    assert_audit_verifies(db_url)
