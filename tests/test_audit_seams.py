"""A row edited between two transitions stays caught after the next one: each entry starts where the last ended.

A writer builds each entry from the row as it reads it, so the next honest transition records an edited
state or job id as if it had been there all along. The chain still shows the seam: the entry starts from
another state than the one before it ended in, or changes the job id with evidence that cannot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from jobtrail import AsyncJobtrail, Store
from jobtrail.domain.states import RemoteState, State
from jobtrail.ledger.audit import make_anchor, verify
from jobtrail.ledger.results import read_result
from jobtrail.providers.http import load_provider
from jobtrail.runtime.worker import Worker
from jobtrail.testing import FakeProvider

from helpers import S, drop_guards, obs, op_in, sql, succeed

FAST = {
    "poll": {"initial_s": 0.05, "factor": 1, "cap_s": 0.1},
    "retry": {"initial_s": 0.02, "factor": 1, "cap_s": 0.05},
}


def findings(store: Store, **kwargs: object) -> list[tuple[str, str, str]]:
    return [(f.operation_id, f.field or "", f.kind) for f in verify(store, **kwargs).findings]  # type: ignore[arg-type]


def test_a_state_edit_stays_caught_after_the_next_transition(store: Store) -> None:
    """A person's cancel request undone in the row, then the job collected: the skipped state is named."""
    op = op_in(store, S.CANCEL_REQUESTED)
    anchor = make_anchor(store)  # taken before the edit: it matches the chain, which the edit never touched
    drop_guards(store)
    sql(store, "UPDATE operations SET state = 'observing' WHERE operation_id = :i", i=op.operation_id)
    op = store.get(op.operation_id)
    op = store.transition(op, S.RESULT_COLLECTING, obs(RemoteState.SUCCEEDED), actor="worker")
    op = succeed(store, op)

    report = verify(store, anchor=anchor)
    assert [(f.operation_id, f.field, f.kind) for f in report.findings] == [(op.operation_id, "state", "edited")]
    seam = report.findings[0]
    assert seam.seq == 5 and "starts from observing, but entry 4 ended in cancel_requested" in seam.detail


def test_a_job_id_edit_stays_caught_after_the_next_status_observation(store: Store) -> None:
    op = op_in(store, S.OBSERVING)
    drop_guards(store)
    sql(store, "UPDATE operations SET remote_job_id = 'job-of-someone-else' WHERE operation_id = :i", i=op.operation_id)
    op = store.transition(store.get(op.operation_id), S.RESULT_COLLECTING, obs(RemoteState.SUCCEEDED), actor="worker")
    assert findings(store) == [(op.operation_id, "remote_job_id", "edited")]
    assert "(status_observation) changed the job id" in verify(store).findings[0].detail


def test_a_job_id_set_by_a_person_or_a_confirmed_create_is_no_seam(store: Store) -> None:
    """The causes that name a job may set or change it: a confirmed create, and a person's decision."""
    from jobtrail.domain.evidence import HumanDecision

    op = op_in(store, S.NEEDS_ATTENTION)
    op = store.transition(
        op,
        S.ACCEPTED,
        HumanDecision(decided_by="alice", reason="found it in the console", remote_job_id="job-from-console"),
        actor="person:alice",
        changes={"remote_job_id": "job-from-console"},
    )
    op = store.transition(op, S.OBSERVING, obs(RemoteState.RUNNING), actor="worker")
    jobs = [e.remote_job_id for e in store.history(op.operation_id)]
    assert jobs[-3:] == [None, "job-from-console", "job-from-console"]
    assert verify(store).ok


@pytest.fixture
def slow_fake() -> Iterator[FakeProvider]:
    """Jobs that run for 3 s: long enough to tamper with one while it is watched."""
    provider = FakeProvider(job_duration_s=3).start()
    yield provider
    provider.stop()


def test_another_jobs_result_collected_after_a_job_id_swap_is_named(db_url: str, slow_fake: FakeProvider) -> None:
    """End to end: A's job id set to B's while both run; A ends succeeded holding B's output, and verify says so."""
    store = Store.open(db_url)
    cfg = slow_fake.provider_config(**FAST)
    jt = AsyncJobtrail(store=store, providers=[cfg])

    async def submit() -> tuple[str, str]:
        return (await jt.submit("fake", {"who": "A"})).operation_id, (
            await jt.submit("fake", {"who": "B"})
        ).operation_id

    async def work(seconds: float) -> None:
        worker = Worker(store, {"fake": load_provider(cfg)}, worker_id="w", idle_s=0.02)
        await worker.run(until_settled=True, timeout=seconds)

    try:
        a, b = asyncio.run(submit())
        asyncio.run(work(1.0))
        assert store.get(a).state is State.OBSERVING and store.get(b).state is State.OBSERVING
        anchor = make_anchor(store)
        drop_guards(store)
        sql(
            store, "UPDATE operations SET remote_job_id = :j WHERE operation_id = :i", j=store.get(b).remote_job_id, i=a
        )
        asyncio.run(work(30))
        assert b'"who": "B"' in read_result(store, a)[1]  # what the edit achieved
        assert (a, "remote_job_id", "edited") in findings(store, anchor=anchor)
    finally:
        store.close()


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("attempts", "7"),
        ("result_ref", "'https://elsewhere.example/result.json'"),
        ("cancel_requested_by", "'mallory'"),
        ("cancel_deadline_us", "1"),
    ],
)
def test_a_column_only_transitions_write_edited_between_two_stays_caught_after_the_next(
    store: Store, column: str, value: str
) -> None:
    """Attempts, the result reference, the cancel's requester and deadline: the next entry records the row as it
    finds it, and also what it found, which is not what the entry before it left."""
    op = op_in(store, S.OBSERVING)
    anchor = make_anchor(store)
    drop_guards(store)
    sql(store, f"UPDATE operations SET {column} = {value} WHERE operation_id = :i", i=op.operation_id)
    op = store.transition(store.get(op.operation_id), S.RESULT_COLLECTING, obs(RemoteState.SUCCEEDED), actor="worker")
    assert getattr(op, column) is not None  # carried into the row the entry covers: only the seam shows it

    report = verify(store, anchor=anchor)
    assert [(f.operation_id, f.kind) for f in report.findings] == [(op.operation_id, "edited")]
    seam = report.findings[0]
    assert column in (seam.field or "") and seam.seq == op.version
    assert f"entry {op.version} found one of them other than entry {op.version - 1} left it" in seam.detail


def test_an_honest_life_with_attempts_a_cancel_and_a_result_shows_no_seam(store: Store) -> None:
    """What transitions write themselves (an attempt counted, a cancel requested, a result stored) is no seam."""
    op = op_in(store, S.CANCEL_REQUESTED)
    op = store.transition(op, S.RESULT_COLLECTING, obs(RemoteState.SUCCEEDED), actor="worker")
    succeed(store, op)
    assert verify(store).ok
    entries = store.history(op.operation_id)
    assert len(entries) >= 5 and all(e.cause for e in entries)
