"""The async front of :meth:`Store.apply`: one transaction per write, or group commit.

Flows and the client write through a :class:`Writer`, and read through its
:attr:`Writer.io`, so no SQL runs on the event loop thread. The worker and the
client use :class:`BatchWriter`: every write requested within a short window
(or while the previous commit runs) lands in one transaction (one commit, one
fsync), whatever produced it (submits, transitions, observations, result saves,
releases) and however many HTTP connections the provider allows; each caller
resumes only once its own write is durable, so "durable before the send" holds
for every create attempt exactly as with one transaction per write.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any, NamedTuple

from jobtrail.domain.errors import StorageError
from jobtrail.domain.evidence import Evidence
from jobtrail.domain.record import Changes, Operation, OperationSpec
from jobtrail.domain.states import State
from jobtrail.ledger.offload import Offload, inline, threads
from jobtrail.ledger.store import (
    Applied,
    Change,
    Create,
    Created,
    FollowUp,
    Observe,
    Release,
    Reschedule,
    Store,
    StoredResult,
    Write,
    created,
    key_race,
    landed,
)
from jobtrail.ledger.writer_process import GROUP_MAX, Outcome, WriterProcess, apply_group

#: callers woken per loop turn after a commit (see BatchWriter._settle)
_WAKE_PER_TURN = 32
#: how long the first write of a group waits for others to join it: a few fsyncs' worth, so a busy
#: process commits a few hundred times a second at most, whatever its concurrency
GROUP_WINDOW_S = 0.002


#: set while a worker takes one step of an operation it holds (see :func:`stepping`)
_STEPPING: ContextVar[bool] = ContextVar("jobtrail_stepping", default=False)


@contextlib.contextmanager
def stepping() -> Iterator[None]:
    """Within this block (a worker's step under its lease), a transition or reschedule that moves the
    operation's next action ahead ends the lease in the same write, instead of a release of its own after
    it; one that leaves the next action where it was, or makes it due, keeps it, and the step goes on."""
    reset = _STEPPING.set(True)
    try:
        yield
    finally:
        _STEPPING.reset(reset)


class Writer:
    """Writes each item in its own transaction, at once, off the event loop."""

    def __init__(self, store: Store, *, io: Offload = threads) -> None:
        self.store = store
        #: where blocking reads and writes run (threads; inline only in the simulation)
        self.io = io

    async def apply(self, item: Write) -> Applied:
        return (await self.apply_all([item]))[0]

    async def apply_all(self, items: Sequence[Write]) -> list[Applied]:
        """Several writes in one transaction: all of them land, or none."""
        return await self.io(self.store.apply, list(items))

    async def create(self, specs: Sequence[OperationSpec], *, actor: str | None = None) -> list[Created]:
        """Make new records durable (each with its creation entry); a key that names a different request
        raises :class:`OperationKeyConflict` once the others are durable."""
        items = [Create(spec=spec, actor=actor) for spec in specs]
        try:
            outcomes = await self.apply_all(items)
        except StorageError as exc:
            if not key_race(exc):
                raise
            outcomes = await self.apply_all(items)  # another process took the same key just now: found this time
        return created(outcomes)

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
        observed: Observe | None = None,
        then: FollowUp | None = None,
    ) -> Operation:
        """Move ``op`` to ``to`` (None: stay, and only append the history entry); ``result`` lands with it,
        and so does ``observed``, the answer that caused it (its entry then covers it), and ``then``, a
        second transition that continues from this one in the same write."""
        change = Change(
            op=op,
            to=to,
            evidence=evidence,
            actor=actor,
            changes=changes or {},
            request_ids=request_ids,
            result=result,
            then=then,
            lease_ends_if_waiting=_STEPPING.get(),
        )
        return landed(await self._after(observed, change))

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

    async def reschedule(self, op: Operation, changes: Changes, *, observed: Observe | None = None) -> Operation:
        reschedule = Reschedule(op=op, changes=changes, lease_ends_if_waiting=_STEPPING.get())
        return landed(await self._after(observed, reschedule))

    async def _after(self, observed: Observe | None, item: Write) -> Applied:
        """``item``, in one transaction with the observation that led to it (one commit where there were two)."""
        if observed is None:
            return await self.apply(item)
        return (await self.apply_all([observed, item]))[1]

    async def observe(self, operation_id: str, *, kind: str, raw: Any, **fields: Any) -> int:
        observation_id = await self.apply(Observe(operation_id=operation_id, kind=kind, raw=raw, **fields))
        assert isinstance(observation_id, int)
        return observation_id

    async def release(self, op: Operation) -> None:
        await self.apply(Release(operation_id=op.operation_id, epoch=op.lease_epoch))


class BatchWriter(Writer):
    """Group commit by time and size: the first write of a group waits ``window_s`` for others (or
    until ``max_writes`` have come).

    In this process, one commit is in flight at a time and writes requested while
    it runs go in the next one, so a group grows with the load and the database's
    latency, not with how many answers arrive in one loop turn. ``window_s=0``
    waits one loop turn only (the default when the work runs inline, as in the
    simulation).

    ``apart`` (the worker's, by default) commits in a :class:`WriterProcess`, off
    the interpreter lock of the event loop's process. There a group goes on the pipe
    once its window closes, without waiting for the commit before it, and the child
    makes the transactions: one at a time, each of the groups that arrived while the
    last one ran; under load, at most one every 80 ms (a write waits that long at most
    for others to join it; a write that comes alone waits for nobody), so the child is
    not idle while this process prepares the next group and the commit rate still
    follows the load (two transactions in flight made twice the commits when few
    connections trickle answers in).
    """

    def __init__(
        self,
        store: Store,
        *,
        io: Offload = threads,
        window_s: float | None = None,
        max_writes: int = GROUP_MAX,
        apart: bool = False,
    ) -> None:
        super().__init__(store, io=io)
        #: the process that prepares and commits the groups (``apart``, where the store allows it)
        self._apart = WriterProcess.for_store(store) if apart and io is threads else None
        # inline work holds the loop while it commits, so nothing could join during a window: one turn is all
        self.window_s = (0.0 if io is inline else GROUP_WINDOW_S) if window_s is None else window_s
        self.max_writes = max_writes
        self._pending: list[_Queued] = []
        self._queued = 0  # writes in _pending
        self._committing = False
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commits: set[asyncio.Task[None]] = set()
        self._requests = 0
        self.transactions = 0
        self.writes = 0

    async def apply(self, item: Write) -> Applied:
        return (await self.apply_all([item]))[0]

    async def apply_all(self, items: Sequence[Write]) -> list[Applied]:
        """Queue writes for the next group commit; they land in the same transaction, together."""
        if not items:
            return []
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # a new loop (the sync client runs one per call): what a closed one left queued has no
            # caller left to answer, and its window's timer will never fire
            self._loop, self._pending, self._queued, self._committing, self._timer = loop, [], 0, False, None
        self._requests += 1
        # one future per request, answered with all of its writes' outcomes (or the first error among them:
        # a request's writes fail together)
        queued = _Queued(list(items), loop.create_future(), self._requests)
        self._pending.append(queued)
        self._queued += len(queued.items)
        if not self._committing:
            self._committing = True
            if self.window_s > 0 and self._queued < self.max_writes:
                self._timer = loop.call_later(self.window_s, self._start)
            else:
                loop.call_soon(self._start)
        elif self._timer is not None and self._queued >= self.max_writes:
            self._timer.cancel()  # full: no reason to wait out the window
            self._timer = None
            loop.call_soon(self._start)
        return await queued.future

    def _start(self) -> None:
        self._timer = None
        # whole requests, up to max_writes writes (at least one request): writes asked for together are never
        # split between two transactions
        cut = writes = 0
        while cut < len(self._pending) and (cut == 0 or writes + len(self._pending[cut].items) <= self.max_writes):
            writes += len(self._pending[cut].items)
            cut += 1
        batch, self._pending = self._pending[:cut], self._pending[cut:]
        self._queued -= writes
        task = asyncio.get_running_loop().create_task(self._commit(batch))
        self._commits.add(task)
        task.add_done_callback(self._commits.discard)

    async def _commit(self, batch: list[_Queued]) -> None:
        group = [(q.request, item) for q in batch for item in q.items]
        sent = False
        try:
            if self._apart_ready():
                assert self._apart is not None
                answer = self._apart.post(group)
                # on the pipe: the next group need not wait for this one's commit (while the child commits, the
                # groups that arrive meanwhile wait in its pipe, and it commits them together, in one transaction)
                sent = True
                self._next(window=True)
                outcomes, transactions = await answer
            else:
                outcomes, transactions = await self.io(apply_group, self.store, group)
            self.transactions += transactions
            self.writes += sum(not isinstance(o, Exception) for o in outcomes)
        except Exception as exc:  # the database itself failed: every caller hears it
            outcomes = [exc] * len(group)
        except BaseException:  # cancelled (the loop is closing): nobody may hang on a future
            for q in batch:
                q.future.cancel()
            if not sent:
                self._next()
            raise
        self._settle(batch, outcomes)
        if not sent:
            self._next()

    def _settle(self, batch: list[_Queued], outcomes: list[Outcome], start: int = 0, at: int = 0) -> None:
        """Wake the writers, a bounded number per loop turn (``at``: the first outcome of request ``start``).

        A commit that waited (on a lock held elsewhere, say) may complete hundreds of
        writes at once; waking every caller in one turn would hold the loop for all
        of their next steps, and timers (time-outs of calls in flight) would wait.
        """
        end = min(start + _WAKE_PER_TURN, len(batch))
        for i in range(start, end):
            queued = batch[i]
            mine = outcomes[at : at + len(queued.items)]
            at += len(queued.items)
            if queued.future.done():
                continue
            error = next((o for o in mine if isinstance(o, Exception)), None)
            if error is not None:
                queued.future.set_exception(error)
            else:
                queued.future.set_result(mine)  # type: ignore[arg-type]  # (no Exception among them)
        if end < len(batch):
            asyncio.get_running_loop().call_soon(self._settle, batch, outcomes, end, at)

    def _next(self, *, window: bool = False) -> None:
        """Start the next group: at once (what waited for a commit), or (``window``: what came in the loop turns
        since the last group was cut) after a window of its own, as any first write's."""
        if not self._pending:
            self._committing = False
        elif window and self.window_s > 0 and self._queued < self.max_writes:
            self._timer = asyncio.get_running_loop().call_later(self.window_s, self._start)
        else:
            asyncio.get_running_loop().call_soon(self._start)

    async def claim(self, worker_id: str, **kwargs: Any) -> list[Operation]:
        """:meth:`Store.claim`. On SQLite, where this writer's commits are made: a SQLite file has one
        writer at a time, so in the writer process a claim queues behind the commit in flight instead of
        polling for the file's lock against it. PostgreSQL claims here, beside the commits."""
        if self._apart_ready() and self.store.dialect == "sqlite":  # (asked first: a claim also has it started)
            assert self._apart is not None
            return await self._apart.claim(worker_id, **kwargs)
        return await self.io(functools.partial(self.store.claim, worker_id, **kwargs))

    def _apart_ready(self) -> bool:
        """Is the writer process there to take this write? (If not, have it started: meanwhile, here.)"""
        if self._apart is None:
            return False
        if self._apart.ready:
            return True
        self._apart.start_soon()
        return False

    @property
    def process_id(self) -> int | None:
        """The writer process's pid while it takes this writer's commits (None: they are made here)."""
        return self._apart.pid if self._apart is not None else None

    def start(self) -> None:
        """Start the writer process, if this writer has one, in the background (writes land here until then)."""
        if self._apart is not None:
            self._apart.start_soon()

    async def close(self) -> None:
        """Stop the writer process, if one runs (the next write starts it again)."""
        if self._apart is not None:
            await self._apart.close()


class _Queued(NamedTuple):
    """One request: the writes of one apply_all, which share one transaction and one future."""

    items: list[Write]
    future: asyncio.Future[list[Applied]]
    request: int
