"""Group commit: durability costs one commit per group of writes, not one per write, whoever asks.

Every write requested within a short window joins one transaction: many
concurrent single submits, the worker's transitions, observations and result
saves alike. Each caller still resumes only once its own write is durable, and
each hears only its own refusal.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from jobtrail import AsyncJobtrail, JobIdTaken, Operation, OperationKeyConflict, State, Store, TransitionRefused
from jobtrail.domain.evidence import ConfirmedCreate, DefinitiveRejection
from jobtrail.ledger.store import Change, Moved, Observe
from jobtrail.ledger.writer import BatchWriter

from helpers import spec


class Commits:
    """Counts the transactions the ledger really commits (on the engine, not in jobtrail's own counters)."""

    def __init__(self, store: Store) -> None:
        self.n = 0
        self.engine = store.engine
        sa.event.listen(self.engine, "commit", self._count)

    def _count(self, conn: Any) -> None:
        self.n += 1

    def close(self) -> None:
        sa.event.remove(self.engine, "commit", self._count)


@pytest.fixture
def commits(store: Store) -> Iterator[Commits]:
    counter = Commits(store)
    yield counter
    counter.close()


def test_two_hundred_concurrent_submits_land_in_one_transaction(store: Store, fake: Any, commits: Commits) -> None:
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])

    async def burst() -> list[Any]:
        return await asyncio.gather(*(jt.submit("fake", {"input": f"n{i}"}, caller="agent") for i in range(200)))

    ops = asyncio.run(burst())

    # each submit returned a durable record with its creation entry; one commit made all of them durable
    assert len({op.operation_id for op in ops}) == 200
    for op in ops:
        assert store.get(op.operation_id).state is State.CREATE_PENDING
        assert [entry.to_state for entry in store.history(op.operation_id)] == [State.CREATE_PENDING]
    assert commits.n == 1
    assert jt.writer.transactions == 1 and jt.writer.writes == 200


def test_a_trickle_of_writes_shares_a_commit_within_the_window(store: Store, commits: Commits) -> None:
    """Answers that arrive one by one (a provider that allows few connections) still share commits."""
    op, _ = store.create_operation(spec())
    writer = BatchWriter(store, window_s=0.5)

    async def trickle() -> list[int]:
        async def observe_later(i: int) -> int:
            await asyncio.sleep(0.02 * i)
            return await writer.observe(op.operation_id, kind="status", raw={"n": i})

        return await asyncio.gather(*(observe_later(i) for i in range(5)))

    before = commits.n
    ids = asyncio.run(trickle())

    assert len(set(ids)) == 5
    assert [row["raw"] for row in store.observations(op.operation_id)][-5:] == [{"n": i} for i in range(5)]
    assert commits.n - before == 1


def test_a_key_conflict_in_a_group_fails_only_its_own_submit(store: Store, fake: Any, commits: Commits) -> None:
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])

    async def burst() -> list[Any]:
        first = jt.ensure("fake", {"input": "a"}, key="report-1")
        again = jt.ensure("fake", {"input": "a"}, key="report-1")
        changed = jt.ensure("fake", {"input": "b"}, key="report-1")
        others = [jt.ensure("fake", {"input": f"n{i}"}) for i in range(20)]
        return await asyncio.gather(first, again, changed, *others, return_exceptions=True)

    (first, again, changed, *others) = asyncio.run(burst())

    assert isinstance(changed, OperationKeyConflict)
    assert first[0].operation_id in str(changed)
    # the same key with the same request is the same operation, made once
    assert first[1] is True and again == (first[0], False)
    for op, new in others:
        assert new and store.get(op.operation_id).state is State.CREATE_PENDING
    assert store.find_by_key("fake", "report-1") == first[0]
    assert store.count() == 21
    assert commits.n == 1


def test_writes_asked_for_together_land_together_or_not_at_all(store: Store, commits: Commits) -> None:
    """A refused write fails its own request (and what was asked with it), never a neighbour's."""
    op_a, _ = store.create_operation(spec(body={"n": 1}))
    op_b, _ = store.create_operation(spec(body={"n": 2}))
    refused = Change(op=op_a, to=State.ACCEPTED, evidence=DefinitiveRejection(http_status=422), actor="w")
    writer = BatchWriter(store)

    async def group() -> list[Any]:
        together = writer.apply_all([Observe(operation_id=op_a.operation_id, kind="status", raw={"a": 1}), refused])
        neighbour = writer.observe(op_b.operation_id, kind="status", raw={"b": 1})
        return await asyncio.gather(together, neighbour, return_exceptions=True)

    together, neighbour = asyncio.run(group())

    assert isinstance(together, TransitionRefused)
    assert store.observations(op_a.operation_id) == []  # the observation asked with the refused change: not kept
    assert store.get(op_a.operation_id) == op_a
    assert isinstance(neighbour, int)
    assert [row["raw"] for row in store.observations(op_b.operation_id)] == [{"b": 1}]


def test_one_job_id_is_never_given_to_two_operations_in_one_group_or_later(store: Store) -> None:
    """A provider that names one job for two different requests lies about one of them. The first write that
    gives the job to an operation lands; another one comes back JobIdTaken naming both operations, in the
    same group or in a later one, and its neighbours land. Another provider's job of that name is its own."""
    a, b, c, d = (store.create_operation(spec(body={"n": n}))[0] for n in range(4))
    (elsewhere, _) = store.create_operation(spec(provider="other", body={"n": 4}))

    def confirm(op: Operation, job: str) -> Change:
        evidence = ConfirmedCreate(remote_job_id=job, http_status=201)
        return Change(op=op, to=State.ACCEPTED, evidence=evidence, actor="w", changes={"remote_job_id": job})

    first, second, neighbour = store.apply([confirm(a, "job-x"), confirm(b, "job-x"), confirm(c, "job-y")])
    assert isinstance(first, Operation) and first.remote_job_id == "job-x"
    assert isinstance(second, Moved) and isinstance(second.error, JobIdTaken)
    assert a.operation_id in str(second.error) and b.operation_id in str(second.error)
    assert isinstance(neighbour, Operation) and neighbour.remote_job_id == "job-y"
    assert store.get(b.operation_id) == b and [e.cause for e in store.history(b.operation_id)] == ["operation_created"]
    [later] = store.apply([confirm(d, "job-x")])
    assert isinstance(later, Moved) and isinstance(later.error, JobIdTaken)
    assert later.error.details == {"operation_id": d.operation_id, "holder": a.operation_id, "remote_job_id": "job-x"}
    [own] = store.apply([confirm(elsewhere, "job-x")])
    assert isinstance(own, Operation) and own.remote_job_id == "job-x"


def test_processes_racing_for_one_key_in_their_groups_all_get_the_one_operation(open_store: Any, fake: Any) -> None:
    """Each client's group holds the same key and its own submits: one record for the key, nobody's
    other submits lost to the race (on PostgreSQL the loser's whole group meets the unique key)."""
    stores = [open_store() for _ in range(4)]
    barrier = threading.Barrier(len(stores))
    got: list[tuple[str, list[str]]] = []

    def client(store: Store) -> None:
        jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])

        async def group() -> tuple[str, list[str]]:
            barrier.wait()
            keyed, *others = await asyncio.gather(
                jt.submit("fake", {"input": "same"}, key="race"),
                *(jt.submit("fake", {"input": f"{id(store)}-{i}"}) for i in range(10)),
            )
            return keyed.operation_id, [op.operation_id for op in others]

        got.append(asyncio.run(group()))

    threads = [threading.Thread(target=client, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(got) == 4
    assert len({keyed for keyed, _ in got}) == 1
    others = [op_id for _, ids in got for op_id in ids]
    assert len(set(others)) == 40
    assert stores[0].count() == 41
    assert all(stores[0].get(op_id).state is State.CREATE_PENDING for op_id in others)


def test_a_submit_abandoned_with_its_loop_does_not_stall_the_next_loop(store: Store, fake: Any) -> None:
    """The sync client runs one loop per call: a call interrupted while its write waited for the group's
    window (Ctrl-C) leaves a timer that will never fire; the next call still commits."""
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])

    async def interrupted() -> None:
        asyncio.create_task(jt.submit("fake", {"n": 1}))  # noqa: RUF006 - abandoned on purpose
        await asyncio.sleep(0)  # queued; the loop ends before its window does

    asyncio.run(interrupted())

    async def next_call() -> Any:
        return await asyncio.wait_for(jt.submit("fake", {"n": 2}), timeout=10)

    op = asyncio.run(next_call())
    assert store.get(op.operation_id).state is State.CREATE_PENDING
