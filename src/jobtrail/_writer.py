"""The async front of :meth:`Store.apply`: one transaction per write, or group commit.

Flows write through a :class:`Writer`. The worker uses :class:`BatchWriter`:
every write requested in one turn of the event loop lands in one transaction
(one commit, one fsync), and each caller resumes only once its write is
durable, so "durable before the send" still holds for every create attempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from jobtrail._errors import StaleRecord
from jobtrail._evidence import Evidence
from jobtrail._record import Operation
from jobtrail._states import State
from jobtrail._store import Change, Observe, Release, Reschedule, Store, Write


class Writer:
    """Writes each item in its own transaction, at once."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def apply(self, item: Write) -> Any:
        return self.store.apply([item])[0]

    async def transition(
        self,
        op: Operation,
        to: State | None,
        evidence: Evidence,
        *,
        actor: str,
        changes: dict[str, Any] | None = None,
        request_ids: Sequence[str] = (),
    ) -> Operation:
        """Move ``op`` to ``to`` (None: stay, and only append the history entry)."""
        change = Change(op=op, to=to, evidence=evidence, actor=actor, changes=changes or {}, request_ids=request_ids)
        return _operation(await self.apply(change))

    async def record(
        self,
        op: Operation,
        evidence: Evidence,
        *,
        actor: str,
        changes: dict[str, Any] | None = None,
        request_ids: Sequence[str] = (),
    ) -> Operation:
        return await self.transition(op, None, evidence, actor=actor, changes=changes, request_ids=request_ids)

    async def reschedule(self, op: Operation, changes: dict[str, Any]) -> Operation:
        return _operation(await self.apply(Reschedule(op=op, changes=changes)))

    async def observe(self, operation_id: str, *, kind: str, raw: Any, **fields: Any) -> int:
        result: int = await self.apply(Observe(operation_id=operation_id, kind=kind, raw=raw, **fields))
        return result

    async def release(self, op: Operation) -> None:
        await self.apply(Release(operation_id=op.operation_id, epoch=op.lease_epoch))


class BatchWriter(Writer):
    """Group commit: all writes requested in one loop turn share one transaction."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self._pending: list[tuple[Write, asyncio.Future[Any]]] = []
        self._scheduled = False
        self.transactions = 0
        self.writes = 0

    async def apply(self, item: Write) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((item, future))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        self._scheduled = False
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            results = self.store.apply([item for item, _ in batch])
            self.transactions += 1
            self.writes += len(batch)
        except Exception:
            # one bad write (a refused transition, a storage error) must not fail its neighbours:
            # apply them one by one so each caller gets its own answer
            for item, future in batch:
                try:
                    result = self.store.apply([item])[0]
                    self.transactions += 1
                    self.writes += 1
                except Exception as exc:
                    if not future.done():
                        future.set_exception(exc)
                else:
                    if not future.done():
                        future.set_result(result)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)


def _operation(result: Any) -> Operation:
    if isinstance(result, StaleRecord):
        raise result
    assert isinstance(result, Operation)
    return result
