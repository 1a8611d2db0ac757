"""The worker: lease-owned actions, a persisted schedule, and several real processes on one database."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeClock

from jobtrail import AsyncJobtrail, CreateAttempt, StaleRecord, State, Store
from jobtrail.ledger.audit import verify
from jobtrail.ledger.store import Reschedule
from jobtrail.providers.http import load_provider
from jobtrail.runtime.worker import Worker
from jobtrail.testing import FakeProvider

from processes import assert_one_worker_per_lease, finish, start_worker, submit_many, write_provider

S = State


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_three_worker_processes_finish_500_operations(db_url: str, tmp_path: Path) -> None:
    """Every operation succeeds, the provider saw exactly one create each, leases never overlap."""
    fake = FakeProvider(job_duration_s=0.5).start()
    try:
        ids = submit_many(db_url, fake, 500)
        provider = write_provider(tmp_path / "fake.toml", fake)
        workers = [
            # at most 50 in flight each: no worker can take all 500 before the others have started
            start_worker(
                db_url, provider, f"w{i}", "--until-settled", "--timeout", "150", "--lease", "20", "--concurrency", "50"
            )
            for i in range(3)
        ]
        results = [finish(p) for p in workers]
        for code, _out, err in results:
            assert code == 0, err
        stats = [json.loads(out) for _, out, _ in results]
        assert sum(s["actions"] for s in stats) >= 1500
        assert sum(1 for s in stats if s["actions"] > 0) >= 2, "the work was not shared"
        with Store.open(db_url) as store:
            states = {store.get(i).state for i in ids}
            assert states == {S.SUCCEEDED}
            assert verify(store).ok
        assert fake.counts["jobs_created"] == 500, fake.counts
        # a create that timed out on a loaded machine is replayed with its token: never a new job
        resent = fake.counts["creates_received"] - 500
        assert resent == fake.counts["replayed"] + fake.counts["key_in_flight"], fake.counts
        assert fake.counts["results"] == 500
        assert_one_worker_per_lease(fake)
    finally:
        fake.stop()


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_a_killed_worker_s_operations_are_finished_after_its_leases_expire(db_url: str, tmp_path: Path) -> None:
    """kill -9 in the middle of the run; another worker finishes everything, one job per operation."""
    fake = FakeProvider(job_duration_s=2.0).start()
    try:
        ids = submit_many(db_url, fake, 100)
        provider = write_provider(tmp_path / "fake.toml", fake)
        doomed = start_worker(db_url, provider, "doomed", "--lease", "4")
        deadline = time.monotonic() + 60
        while fake.counts["status"] < 20 and time.monotonic() < deadline:
            time.sleep(0.02)
        doomed.send_signal(signal.SIGKILL)
        doomed.communicate(timeout=30)
        assert doomed.returncode == -signal.SIGKILL
        survivor = start_worker(db_url, provider, "survivor", "--until-settled", "--timeout", "120", "--lease", "4")
        code, _out, err = finish(survivor)
        assert code == 0, err
        with Store.open(db_url) as store:
            assert {store.get(i).state for i in ids} == {S.SUCCEEDED}
            assert verify(store).ok
            for op_id in ids:
                op = store.get(op_id)
                assert fake.jobs_for(op.idempotency_token) == [op.remote_job_id]
        assert fake.counts["jobs_created"] == 100
        assert_one_worker_per_lease(fake)
    finally:
        fake.stop()


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_a_worker_dying_between_attempt_and_send_leaves_nothing_duplicated(db_url: str, tmp_path: Path) -> None:
    """Leases held by a dead worker expire; the next worker reconciles the unrecorded attempts."""
    fake = FakeProvider(job_duration_s=0.2).start()
    try:
        ids = submit_many(db_url, fake, 30)
        provider = write_provider(tmp_path / "fake.toml", fake)
        died = start_worker(
            db_url, provider, "dies", "--lease", "4", env={"JOBTRAIL_FAILPOINTS": "create.after_attempt=exit"}
        )
        assert finish(died)[0] == 137
        with Store.open(db_url) as store:
            held = [store.get(i) for i in ids if store.get(i).lease_owner == "dies"]
            assert held and all(op.attempts == 1 for op in held)
        code, _out, err = finish(
            start_worker(db_url, provider, "next", "--until-settled", "--timeout", "60", "--lease", "4")
        )
        assert code == 0, err
        with Store.open(db_url) as store:
            for op_id in ids:
                op = store.get(op_id)
                assert op.state is S.SUCCEEDED
                assert fake.jobs_for(op.idempotency_token) == [op.remote_job_id]
            for op in held:
                causes = [e.cause for e in store.history(op.operation_id)]
                assert "ambiguous_create" in causes  # the unsent attempt was doubted, not assumed
        assert fake.counts["jobs_created"] == 30
    finally:
        fake.stop()


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    provider = FakeProvider(job_duration_s=0.3).start()
    yield provider
    provider.stop()


def test_a_worker_whose_lease_expired_cannot_write(db_url: str, fake: FakeProvider) -> None:
    clock = FakeClock()
    store = Store.open(db_url, clock=clock)
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])
    op = asyncio.run(jt.submit("fake", {"x": 1}))
    asyncio.run(jt.providers["fake"].aclose())
    slow = Worker(store, {"fake": load_provider(fake.provider_config())}, worker_id="slow", lease_s=20)
    claimed = store.claim("slow", limit=10, lease_s=20)
    assert [c.operation_id for c in claimed] == [op.operation_id]
    clock.advance(21)  # the slow worker was paused past its lease
    taken = store.claim("fast", limit=10, lease_s=20)
    assert taken[0].lease_epoch == claimed[0].lease_epoch + 1

    async def late() -> None:
        await slow._handle(claimed[0])
        await slow.providers["fake"].aclose()

    asyncio.run(late())
    assert slow.stats.lease_too_short == 1 and slow.stats.actions == 0, "a lapsed lease starts nothing"
    current = store.get(op.operation_id)
    assert current.lease_owner == "fast" and current.state is S.CREATE_PENDING and current.attempts == 0
    assert fake.counts["creates_received"] == 0
    # and had it started, its write would have been refused: the claim raised the fencing epoch
    with pytest.raises(StaleRecord):
        store.record(claimed[0], CreateAttempt(attempt=1), actor="worker:slow", changes={"attempts": 1})
    store.close()


def test_an_action_is_not_started_without_enough_lease_left_for_a_provider_call(
    db_url: str, fake: FakeProvider
) -> None:
    """Found by the simulation: a worker resumed late (or deep in a chain of actions) began a one-time
    result fetch after its lease had lapsed; another worker took over and the fetched result was lost."""
    clock = FakeClock()
    store = Store.open(db_url, clock=clock)
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])
    op = asyncio.run(jt.submit("fake", {"x": 2}))
    asyncio.run(jt.providers["fake"].aclose())
    config = fake.provider_config(timeout_s=5, connect_timeout_s=1)
    late = Worker(store, {"fake": load_provider(config)}, worker_id="late", lease_s=10)
    claimed = store.claim("late", limit=1, lease_s=10)
    clock.advance(4.5)  # 5.5 s of lease left, a call may take 6 s

    async def go() -> None:
        await late._handle(claimed[0])
        await late.providers["fake"].aclose()

    asyncio.run(go())
    assert late.stats.lease_too_short == 1 and fake.counts["creates_received"] == 0
    current = store.get(op.operation_id)
    assert current.attempts == 0 and current.lease_owner is None, "the lease is handed back at once"
    store.close()


def test_an_idle_worker_waits_for_another_workers_lease_instead_of_querying_in_a_loop(
    db_url: str, fake: FakeProvider
) -> None:
    """Found measuring: an operation due under another worker's live lease made an idle worker sleep 1 ms
    and query again, about a thousand claims a second for as long as that lease lasted."""
    store = Store.open(db_url)
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])
    op = asyncio.run(jt.submit("fake", {"x": 3}))
    asyncio.run(jt.providers["fake"].aclose())
    (held,) = store.claim("busy", limit=10, lease_s=60)  # another worker, in the middle of its create
    idle = Worker(store, {"fake": load_provider(fake.provider_config())}, worker_id="idle", idle_s=0.25)
    asyncio.run(idle.run(timeout=1.5))
    assert idle.stats.claims <= 12, f"{idle.stats.claims} claims in 1.5 s: the idle worker polled in a loop"
    current = store.get(op.operation_id)
    assert current.lease_owner == "busy" and current.lease_epoch == held.lease_epoch
    assert fake.counts["creates_received"] == 0
    assert store.next_claimable_us(providers=["fake"]) == held.lease_expires_at_us
    store.close()


def test_claims_a_locked_database_refuses_are_tried_again_with_back_off_and_one_warning(
    tmp_path: Path, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by a probe: with the ledger refusing writes (locked, read-only), a worker retried its claim every
    1-4 ms and logged each refusal, some 350 warnings a second. Now each refusal doubles the wait before the
    next claim (0.1 s, 0.2 s, ... 5 s), the log says it once, and says so again when claims work again."""
    import sqlite3

    import jobtrail.ledger.store as store_module

    monkeypatch.setattr(store_module, "SQLITE_BUSY_TIMEOUT_MS", 50)  # (a real lock: only the wait is shorter)
    path = tmp_path / "jobs.db"
    store = Store.open(path)
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])
    ids = [asyncio.run(jt.submit("fake", {"x": i})).operation_id for i in range(5)]
    asyncio.run(jt.providers["fake"].aclose())
    # the claims run here, in this process, under the shorter wait (a writer process would wait 30 s)
    worker = Worker(store, {"fake": load_provider(fake.provider_config())}, idle_s=0.05, writer_process=False)
    locker = sqlite3.connect(path, isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")  # another process holds the file's write lock

    async def run() -> int:
        work = asyncio.create_task(worker.run(until_settled=True, timeout=60))
        await asyncio.sleep(2.5)
        refused = worker.stats.claims_refused
        locker.execute("ROLLBACK")
        await work
        return refused

    with caplog.at_level("INFO", logger="jobtrail"):
        refused_while_locked = asyncio.run(run())
    locker.close()
    assert 1 <= refused_while_locked <= 8, f"{refused_while_locked} claims in 2.5 s against a locked database"
    warnings = [r.getMessage() for r in caplog.records if "could not claim" in r.getMessage()]
    assert len(warnings) == 1 and "write lock" in warnings[0] and "next try in 0.1 s" in warnings[0], warnings
    assert any("claims again" in r.getMessage() for r in caplog.records)
    assert worker.stats.settled and {store.get(i).state for i in ids} == {S.SUCCEEDED}
    assert fake.counts["jobs_created"] == 5
    assert verify(store).ok
    store.close()


def test_a_restarted_worker_resumes_the_stored_schedule(db_url: str) -> None:
    """The next poll time is on the record; a new worker waits for it, with a controllable clock."""
    # the job outlives the test whatever the load: each poll must find it running
    fake = FakeProvider(job_duration_s=600).start()
    clock = FakeClock()
    store = Store.open(db_url, clock=clock)
    config = fake.provider_config(poll={"initial_s": 30, "factor": 1, "cap_s": 30})
    jt = AsyncJobtrail(store=store, providers=[config])

    async def create() -> Any:
        op = await jt.drive_create((await jt.submit("fake", {"x": 2})).operation_id)
        await jt.providers["fake"].aclose()
        return op

    op = asyncio.run(create())
    assert op.state is S.ACCEPTED

    def one_pass(name: str) -> Worker:
        worker = Worker(store, {"fake": load_provider(config)}, worker_id=name, idle_s=0.01)
        asyncio.run(worker.run(timeout=0.5))
        return worker

    assert op.next_action_at_us is not None and op.next_action_at_us > clock.now_us  # first poll waits
    clock.now_us = op.next_action_at_us
    one_pass("first")  # polls once: running, next poll within 30 s
    after_first = store.get(op.operation_id)
    assert after_first.state is S.OBSERVING and after_first.polls == 1
    due = after_first.next_action_at_us
    assert due is not None and clock.now_us < due <= clock.now_us + 30_000_000
    polls = fake.counts["status"]

    one_pass("restarted")  # same instant: nothing is due, nothing is sent
    assert fake.counts["status"] == polls and store.get(op.operation_id).polls == 1
    clock.now_us = due
    one_pass("restarted")
    assert fake.counts["status"] == polls + 1
    observations = [o for o in store.observations(op.operation_id) if o["kind"] == "status_poll"]
    assert observations[-1]["worker"] == "restarted" and observations[0]["worker"] == "first"
    store.close()
    fake.stop()


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_after_a_mass_restart_the_polls_are_spread(db_url: str) -> None:
    """Full jitter: 100 operations polled at once get 100 different next poll times."""
    fake = FakeProvider(job_duration_s=120).start()
    clock = FakeClock()
    store = Store.open(db_url, clock=clock)
    config = fake.provider_config(poll={"initial_s": 10, "factor": 1, "cap_s": 10})
    jt = AsyncJobtrail(store=store, providers=[config])

    async def go() -> None:
        for i in range(100):
            await jt.drive_create((await jt.submit("fake", {"i": i})).operation_id)
        await jt.providers["fake"].aclose()

    asyncio.run(go())
    clock.advance(10)  # every operation's first poll is due
    worker = Worker(store, {"fake": load_provider(config)}, worker_id="w", idle_s=0.01)
    # the clock stands still, so each operation is due once: run until all are polled, however slow the machine
    for _ in range(30):
        asyncio.run(worker.run(timeout=1.0))
        if all(op.polls >= 1 for op in store.list_operations(limit=None)):
            break
    assert all(op.polls == 1 for op in store.list_operations(limit=None))
    due = sorted(op.next_action_at_us for op in store.list_operations(limit=None))
    assert len(set(due)) == 100
    spread_s = (due[-1] - due[0]) / 1e6
    assert spread_s > 5, f"polls bunched within {spread_s:.2f} s"
    store.close()
    fake.stop()


def test_sigterm_finishes_in_flight_work_and_releases_leases(db_url: str, tmp_path: Path) -> None:
    fake = FakeProvider(job_duration_s=5.0).start()
    try:
        ids = submit_many(db_url, fake, 50)
        provider = write_provider(tmp_path / "fake.toml", fake)
        proc = start_worker(db_url, provider, "polite", "--lease", "30")
        deadline = time.monotonic() + 30
        while fake.counts["jobs_created"] < 50 and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        code, out, err = finish(proc, timeout=30)
        assert code == 0, err
        assert json.loads(out)["worker"] == "polite"
        assert "worker polite asked to stop: it claims nothing more, and finishes what is in flight" in err
        with Store.open(db_url) as store:
            assert all(store.get(i).lease_owner is None for i in ids)
            assert verify(store).ok
    finally:
        fake.stop()


def test_worker_refuses_a_lease_shorter_than_a_provider_call(db_url: str, tmp_path: Path, fake: FakeProvider) -> None:
    provider = write_provider(tmp_path / "fake.toml", fake)
    proc = start_worker(db_url, provider, "x", "--lease", "2")
    code, _out, err = finish(proc, timeout=30)
    assert code == 2 and "must exceed provider fake's slowest call" in err


def _run_worker(store: Store, config: dict[str, Any], seconds: float) -> Worker:
    worker = Worker(store, {"fake": load_provider(config)}, worker_id="w", idle_s=0.01)
    asyncio.run(worker.run(timeout=seconds))
    return worker


def test_an_unknown_remote_state_is_recorded_and_polling_goes_on(db_url: str) -> None:
    """The provider says "running" but this file does not map it: unknown, never terminal."""
    fake = FakeProvider(job_duration_s=60).start()
    try:
        store = Store.open(db_url)
        config = fake.provider_config(
            states={"running": ["in_progress"], "queued": ["pending"]},
            poll={"initial_s": 0.05, "factor": 1, "cap_s": 0.05},
        )
        op_id = asyncio.run(AsyncJobtrail(store=store, providers=[config]).submit("fake", {"x": 1})).operation_id
        _run_worker(store, config, 1.5)
        op = store.get(op_id)
        assert op.state is S.OBSERVING and op.remote_state in ("queued", "running")
        assert op.polls >= 3 and "unknown state, still polling" in (op.state_reason or "")
        polls = [o for o in store.observations(op_id) if o["kind"] == "status_poll"]
        assert {o["remote_state"] for o in polls} == {"unknown"}
        assert {o["raw_state"] for o in polls} <= {"queued", "running"}
        assert all(o["provider_time"] and o["progress"] is not None and o["next_action_at_us"] for o in polls)
        store.close()
    finally:
        fake.stop()


def test_the_result_deadline_times_out_without_assuming_the_job_stopped(db_url: str) -> None:
    from datetime import timedelta

    fake = FakeProvider(job_duration_s=60).start()
    try:
        store = Store.open(db_url)
        config = fake.provider_config(poll={"initial_s": 0.05, "factor": 1, "cap_s": 0.05})
        jt = AsyncJobtrail(store=store, providers=[config])
        op_id = asyncio.run(jt.submit("fake", {"x": 2}, result_deadline=timedelta(seconds=0.6))).operation_id
        _run_worker(store, config, 2.0)
        op = store.get(op_id)
        assert op.state is S.RESULT_TIMED_OUT
        assert op.next_action_at_us is not None  # still watched, at the slow pace: a later finish is collected
        assert "NOT assumed stopped" in (op.state_reason or "")
        assert store.history(op_id)[-1].to_json()["evidence"]["deadline"] == "result"
        assert fake.counts["cancels"] == 0
        assert any(o["kind"] == "status_poll" for o in store.observations(op_id))
        store.close()
    finally:
        fake.stop()


def test_ops_list_shows_the_next_action_and_when(db_url: str, fake: FakeProvider) -> None:
    store = Store.open(db_url)
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])
    op = asyncio.run(jt.submit("fake", {"x": 3}))
    store.close()
    out = subprocess.run(
        [sys.executable, "-m", "jobtrail", "--db", db_url, "ops", "show", op.operation_id, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    shown = json.loads(out.stdout)
    assert shown["next_action"] == "send the create with the stored token"
    assert shown["next_action_at"] is not None


def test_a_first_answer_that_is_already_the_ending_lands_in_one_write(db_url: str) -> None:
    """A job that finished before its first poll: accepted -> observing -> result_collecting in one
    transaction (one conditional UPDATE, two chained entries), and the audit still verifies every link."""
    fake = FakeProvider(job_duration_s=0.0).start()
    try:
        store = Store.open(db_url)
        config = fake.provider_config(poll={"initial_s": 0.2, "factor": 1, "cap_s": 0.2})
        op_id = asyncio.run(AsyncJobtrail(store=store, providers=[config]).submit("fake", {"x": 1})).operation_id
        worker = Worker(store, {"fake": load_provider(config)}, worker_id="w", idle_s=0.01)
        asyncio.run(worker.run(until_settled=True, timeout=30))
        op = store.get(op_id)
        assert op.state is S.SUCCEEDED
        entries = store.history(op_id)
        assert [e.to_state for e in entries] == [
            S.CREATE_PENDING,
            S.CREATE_PENDING,
            S.ACCEPTED,
            S.OBSERVING,
            S.RESULT_COLLECTING,
            S.SUCCEEDED,
        ]
        observing, collecting = entries[3], entries[4]
        # written together: the same time, the second linked to the first, both for the one status answer
        assert observing.at_us == collecting.at_us
        assert collecting.prev_hash == observing.entry_hash
        assert observing.cause == collecting.cause == "status_observation"
        polls = [o for o in store.observations(op_id) if o["kind"] == "status_poll"]
        assert len(polls) == 1 and fake.counts["status"] == 1
        assert op.version == len(entries) and op.history_head == entries[-1].entry_hash
        assert verify(store).ok
        store.close()
    finally:
        fake.stop()


class _CountingStore(Store):
    """A store that counts the kinds of writes it is asked for (its own apply keeps them in this process)."""

    kinds: list[str]

    def apply(self, batch: Any) -> Any:
        self.kinds.extend(type(item).__name__ for item in batch)
        return super().apply(batch)


def test_a_worker_gives_a_lease_back_with_the_step_that_leaves_nothing_due(db_url: str) -> None:
    """Found measuring: after each create and each poll that found the job running, the worker released its
    lease in a write of its own, one more UPDATE of the row a life cycle (on PostgreSQL a new version in
    every index). The step's own write ends the lease when it leaves the next action for later; and the
    next claim still finds the operation when it is due."""
    fake = FakeProvider(job_duration_s=0.6).start()
    try:
        store = _CountingStore.open(db_url)
        store.kinds = []
        config = fake.provider_config(poll={"initial_s": 0.2, "factor": 1, "cap_s": 0.2})
        jt = AsyncJobtrail(store=store, providers=[config])
        ids = [asyncio.run(jt.submit("fake", {"x": i})).operation_id for i in range(3)]
        worker = Worker(store, {"fake": load_provider(config)}, worker_id="w", idle_s=0.01)
        asyncio.run(worker.run(until_settled=True, timeout=30))
        ops = [store.get(i) for i in ids]
        assert all(op.state is S.SUCCEEDED and op.lease_owner is None for op in ops)
        assert fake.counts["status"] >= 3 * 2, "each job was polled while running, then when done"
        assert "Release" not in store.kinds, store.kinds
        assert worker.stats.claimed >= fake.counts["status"], "each poll's operation was claimed when due"
        assert verify(store).ok
        store.close()
    finally:
        fake.stop()


def test_a_step_that_hands_back_a_record_another_claim_holds_ends_the_workers_part(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: a webhook provider's confirmed create ends the lease with its write (the first poll
    is for later), then reads the record again after adopting early events, which make the poll due now. A
    claim in between (another worker's, or this worker's next) holds the record it hands back; the worker
    must neither poll under that lease nor give it back."""
    import jobtrail.flows.create as create_flow

    monkeypatch.setenv("WHSEC_TEST", "whsec_" + base64.b64encode(b"a-shared-secret-of-24-bytes").decode())
    fake = FakeProvider(job_duration_s=60).start()
    try:
        store = Store.open(db_url)
        config = fake.provider_config(
            webhooks={"secrets": ["env:WHSEC_TEST"]}, poll={"initial_s": 30, "factor": 1, "cap_s": 30}
        )
        op_id = asyncio.run(AsyncJobtrail(store=store, providers=[config]).submit("fake", {"x": 1})).operation_id
        other: dict[str, Any] = {}

        def early_events_then_a_claim(store_: Store, provider: str, job_id: str, operation_id: str) -> int:
            op = store_.get(operation_id)  # what adopting an early event does: the poll is due now
            store_.apply([Reschedule(op=op, changes={"next_action_at_us": store_.clock()})])
            (other["op"],) = store_.claim("w2", limit=1, lease_s=600)
            return 1

        monkeypatch.setattr(create_flow, "adopt_orphans", early_events_then_a_claim)
        worker = Worker(store, {"fake": load_provider(config)}, worker_id="w1", writer_process=False)

        async def go() -> None:
            (op,) = await worker._claim(1)
            await worker._handle(op)
            await worker.writer.close()
            await worker.providers["fake"].aclose()

        asyncio.run(go())
        current = store.get(op_id)
        assert current.state is S.ACCEPTED and fake.counts["status"] == 0, "w1 polled under w2's lease"
        assert (current.lease_owner, current.lease_epoch) == ("w2", other["op"].lease_epoch), "w2's lease was ended"
        assert worker.stats.actions == 1
        store.close()
    finally:
        fake.stop()


def test_a_long_running_process_runs_on_uvloop_where_it_is_installed() -> None:
    from jobtrail.runtime.loop import loop_name, run

    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    expected = loop_name()
    assert run(which()) == expected
    if sys.platform != "win32":  # a core dependency wherever it is built
        assert expected == "uvloop"


def test_without_uvloop_a_long_running_process_runs_on_asyncios_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    from jobtrail.runtime.loop import loop_name, run

    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError, as where it is not built

    async def which() -> str:
        return type(asyncio.get_running_loop()).__module__.split(".")[0]

    assert loop_name() == "asyncio"
    assert run(which()) == "asyncio"
