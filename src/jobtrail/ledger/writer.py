"""The async front of :meth:`Store.apply`: one transaction per write, or group commit.

Flows write through a :class:`Writer`, and read through its :attr:`Writer.io`,
so no SQL runs on the event loop thread. The worker uses :class:`BatchWriter`:
every write requested while a commit is running (or in the loop turn that
started it) lands in the next transaction (one commit, one fsync), and each
caller resumes only once its own write is durable, so "durable before the
send" holds for every create attempt exactly as with one transaction per write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from jobtrail.domain.errors import StorageError
from jobtrail.domain.evidence import Evidence
from jobtrail.domain.record import Changes, Operation
from jobtrail.domain.states import State
from jobtrail.ledger.offload import Offload, threads
from jobtrail.ledger.store import (
    Applied,
    Change,
    Observe,
    Release,
    Reschedule,
    Store,
    StoredResult,
    Write,
    landed,
)

#: one write's outcome from a group commit: what it came to, or the error that refused it alone
Outcome = Applied | Exception

#: callers woken per loop turn after a commit (see BatchWriter._settle)
_WAKE_PER_TURN = 32


class Writer:
    """Writes each item in its own transaction, at once, off the event loop."""

    def __init__(self, store: Store, *, io: Offload = threads) -> None:
        self.store = store
        #: where blocking reads and writes run (threads; inline only in the simulation)
        self.io = io

    async def apply(self, item: Write) -> Applied:
        return (await self.io(self.store.apply, [item]))[0]

    async def transition(
        self,
        op: Operation,
        to: State | None,
        evidence: Evidence,
        *,
        actor: str,
        changes: Changes | None = None,
        request_ids: Sequence[str] = (),
        result: StoredResult | None = None,
    ) -> Operation:
        """Move ``op`` to ``to`` (None: stay, and only append the history entry); ``result`` lands with it."""
        change = Change(
            op=op, to=to, evidence=evidence, actor=actor, changes=changes or {}, request_ids=request_ids, result=result
        )
        return landed(await self.apply(change))

    async def record(
        self,
        op: Operation,
        evidence: Evidence,
        *,
        actor: str,
        changes: Changes | None = None,
        request_ids: Sequence[str] = (),
    ) -> Operation:
        return await self.transition(op, None, evidence, actor=actor, changes=changes, request_ids=request_ids)

    async def reschedule(self, op: Operation, changes: Changes) -> Operation:
        return landed(await self.apply(Reschedule(op=op, changes=changes)))

    async def observe(self, operation_id: str, *, kind: str, raw: Any, **fields: Any) -> int:
        observation_id = await self.apply(Observe(operation_id=operation_id, kind=kind, raw=raw, **fields))
        assert isinstance(observation_id, int)
        return observation_id

    async def release(self, op: Operation) -> None:
        await self.apply(Release(operation_id=op.operation_id, epoch=op.lease_epoch))


class BatchWriter(Writer):
    """Group commit: writes queue while a commit runs, and the next commit takes them all.

    One commit is in flight at a time, so the size of a group follows the load
    (and the database's latency), not how many answers happen to arrive in one
    loop turn.
    """

    def __init__(self, store: Store, *, io: Offload = threads) -> None:
        super().__init__(store, io=io)
        self._pending: list[tuple[Write, asyncio.Future[Applied]]] = []
        self._committing = False
        self._commits: set[asyncio.Task[None]] = set()
        self.transactions = 0
        self.writes = 0

    async def apply(self, item: Write) -> Applied:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Applied] = loop.create_future()
        self._pending.append((item, future))
        if not self._committing:
            self._committing = True
            # one loop turn first: every write this turn asks for joins the same transaction
            loop.call_soon(self._start)
        return await future

    def _start(self) -> None:
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._commit(batch))
        self._commits.add(task)
        task.add_done_callback(self._commits.discard)

    async def _commit(self, batch: list[tuple[Write, asyncio.Future[Applied]]]) -> None:
        try:
            outcomes: list[Outcome] = await self.io(self._apply_all, [item for item, _ in batch])
        except Exception as exc:  # the database itself failed: every caller hears it
            outcomes = [exc] * len(batch)
        except BaseException:  # cancelled (the loop is closing): nobody may hang on a future
            for _, future in batch:
                future.cancel()
            self._next()
            raise
        self._settle(batch, outcomes)
        self._next()

    def _settle(self, batch: list[tuple[Write, asyncio.Future[Applied]]], outcomes: list[Outcome]) -> None:
        """Wake the writers, a bounded number per loop turn.

        A commit that waited (on a lock held elsewhere, say) may complete hundreds of
        writes at once; waking every caller in one turn would hold the loop for all
        of their next steps, and timers (time-outs of calls in flight) would wait.
        """
        for (_, future), outcome in zip(batch[:_WAKE_PER_TURN], outcomes[:_WAKE_PER_TURN], strict=True):
            if future.done():
                continue
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        if len(batch) > _WAKE_PER_TURN:
            asyncio.get_running_loop().call_soon(self._settle, batch[_WAKE_PER_TURN:], outcomes[_WAKE_PER_TURN:])

    def _next(self) -> None:
        if self._pending:
            asyncio.get_running_loop().call_soon(self._start)
        else:
            self._committing = False

    def _apply_all(self, items: list[Write]) -> list[Outcome]:
        """One transaction for all; if it fails, each on its own so each caller gets its own answer."""
        try:
            results = self.store.apply(items)
        except StorageError:
            raise  # the database itself failed (locked past its time-out, gone): every caller hears it at once
        except Exception:
            # one refused write (a transition without its evidence) must not fail its neighbours
            if len(items) == 1:
                raise
        else:
            self.transactions += 1
            self.writes += len(items)
            return list(results)
        outcomes: list[Outcome] = []
        for item in items:
            try:
                outcomes.append(self.store.apply([item])[0])
                self.transactions += 1
                self.writes += 1
            except Exception as exc:
                outcomes.append(exc)
        return outcomes
