"""More in flight than the provider's connections: waiting for a connection is not a create that may have
been sent. A request that never got a connection within the connect time-out was not sent, is recorded so,
and is sent again later; the provider sees each create once."""

from __future__ import annotations

import asyncio
from typing import Any

from jobtrail import AsyncJobtrail, State, Store, Worker
from jobtrail.flows.observe import MAX_RESULT_ATTEMPTS, CollectFlow, ObserveFlow
from jobtrail.ledger.writer import Writer
from jobtrail.providers.gate import ConnectionGate
from jobtrail.providers.http import load_provider
from jobtrail.testing import FakeProvider


def test_creates_queued_behind_busy_connections_are_not_sent_and_are_not_doubtful(store: Store) -> None:
    # every answer takes 0.6 s; two connections; a request may wait 0.2 s for one
    fake = FakeProvider(job_duration_s=0.5, latency_s=0.6).start()
    try:
        config = fake.provider_config(max_connections=2, connect_timeout_s=0.2, timeout_s=5)

        async def scenario() -> Any:
            jt = AsyncJobtrail(store=store, providers=[config])
            ops = [await jt.submit("fake", {"n": i}) for i in range(6)]
            worker = Worker(store, {"fake": load_provider(config)}, worker_id="w", idle_s=0.05, concurrency=6)
            stats = await worker.run(until_settled=True, timeout=60)
            return ops, stats

        ops, stats = asyncio.run(scenario())
    finally:
        fake.stop()

    assert stats.settled
    assert fake.counts["creates_received"] == 6  # each job created once, none sent twice
    for op in ops:
        history = store.history(op.operation_id)
        assert store.get(op.operation_id).state is State.SUCCEEDED
        # never doubtful: nothing waited out a reconciliation for a request that never left
        assert State.CREATE_UNKNOWN.value not in {entry.to_state for entry in history}
    not_sent = [e for op in ops for e in store.history(op.operation_id) if e.cause == "create_not_sent"]
    assert not_sent, "four of six creates had to wait for a connection"
    assert all("none of the 2 connections" in e.evidence for e in not_sent)


def test_a_result_fetch_that_finds_no_free_connection_spends_no_attempt(store: Store) -> None:
    """Five fetches that never left must not end a finished job as result_unavailable ("gave up after 5")."""
    fake = FakeProvider(job_duration_s=0.1).start()
    config = fake.provider_config(
        max_connections=1, connect_timeout_s=0.05, poll={"initial_s": 0.01, "factor": 1, "cap_s": 0.01}
    )
    try:

        async def scenario() -> tuple[list[Any], Any]:
            jt = AsyncJobtrail(store=store, providers=[config])
            provider = jt.provider("fake")
            op = await jt.drive_create((await jt.submit("fake", {"x": 1})).operation_id)
            while op.state is not State.RESULT_COLLECTING:
                await asyncio.sleep(0.05)
                op = await ObserveFlow(store, Writer(store), actor="t").advance(store.get(op.operation_id), provider)
            collect = CollectFlow(store, Writer(store), actor="t")
            provider._client()  # (the gate of this loop)
            assert await provider._gate.acquire()  # someone else holds the only connection
            tries = []
            for _ in range(MAX_RESULT_ATTEMPTS + 2):
                op = store.get(op.operation_id)
                await asyncio.sleep(max(0, (op.next_action_at_us or 0) - store.clock()) / 1e6)
                op = await collect.advance(op, provider)
                tries.append(op)
            provider._gate.release()
            await asyncio.sleep(max(0, (op.next_action_at_us or 0) - store.clock()) / 1e6)
            done = await collect.advance(store.get(op.operation_id), provider)
            await provider.aclose()
            return tries, done

        tries, done = asyncio.run(scenario())
    finally:
        fake.stop()

    for op in tries:
        assert op.state is State.RESULT_COLLECTING
        assert op.fetch_attempts == 0
        assert op.state_reason is not None and op.state_reason.startswith("result fetch not sent (none of the 1")
    kinds = [row["kind"] for row in store.observations(done.operation_id)]
    assert kinds.count("result_fetch_not_sent") == MAX_RESULT_ATTEMPTS + 2
    assert kinds.count("result_fetch") == 1
    assert done.state is State.SUCCEEDED
    assert fake.counts["results"] == 1


def test_the_connection_gate_serves_waiters_in_order_turns_away_late_ones_and_never_loses_a_slot() -> None:
    """Requests wait for a connection in the order they came, each at most its connect time-out; a waiter
    that is cancelled, even just after a slot was handed to it, leaves the slot for the next one."""

    async def scenario() -> None:
        gate = ConnectionGate(2, wait_s=0.2)
        assert await gate.acquire() and await gate.acquire()  # both connections busy
        assert gate.locked()
        order: list[int] = []

        async def waiter(i: int) -> bool:
            got = await gate.acquire()
            if got:
                order.append(i)
            return got

        tasks = [asyncio.create_task(waiter(i)) for i in range(4)]
        await asyncio.sleep(0.01)
        tasks[1].cancel()  # gave up while waiting: skipped, its place not kept
        gate.release()  # -> waiter 0
        gate.release()  # -> waiter 2 (1 was cancelled)
        await asyncio.sleep(0.01)
        assert order == [0, 2]
        late = await asyncio.wait_for(tasks[3], timeout=1)  # nobody released for 0.2 s: turned away
        assert late is False and order == [0, 2]

        # a slot handed to a waiter whose task is cancelled before it resumes goes on to the next waiter
        first, second = asyncio.create_task(gate.acquire()), asyncio.create_task(gate.acquire())
        await asyncio.sleep(0.01)
        gate.release()  # to `first` ...
        first.cancel()  # ... which is cancelled before it runs again
        assert await asyncio.wait_for(second, timeout=1) is True
        # `second` holds the slot `first` was handed, and waiter 0 or 2 the other: both given back, all free
        gate.release()
        gate.release()
        assert not gate.locked()
        assert await gate.acquire() and await gate.acquire()
        assert gate.locked()

    asyncio.run(scenario())
