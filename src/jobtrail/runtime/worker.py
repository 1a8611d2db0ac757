"""``jobtrail worker``: claims due operations under a lease and does each one's next action.

One loop per process. It claims due operations in batches (next action due,
lease free or expired; the claim raises each one's fencing epoch), runs their
next actions concurrently, and writes through a group-committing
:class:`BatchWriter`. Every write is conditional on the epoch of the claim,
so a worker that lost its lease (paused, partitioned, slow) has its write
refused and drops the operation. Nothing is kept in memory between actions:
the next action and its time are on the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import random
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from jobtrail.domain.canonical import rfc3339
from jobtrail.domain.errors import ConfigError, JobtrailError, StaleRecord, StorageError
from jobtrail.domain.record import BODY_NOT_LOADED, Operation, body_needed
from jobtrail.domain.redact import install_log_redaction
from jobtrail.domain.results import Check
from jobtrail.domain.states import AUTOMATIC_STATES, ESCALATED_STATES
from jobtrail.domain.steps import Step, next_step
from jobtrail.flows.cancel import CancelFlow
from jobtrail.flows.create import CreateFlow
from jobtrail.flows.observe import CollectFlow, ObserveFlow
from jobtrail.flows.telemetry import action_kind, action_span, finished, lease_taken_over, operation_context
from jobtrail.ledger.offload import Offload, threads
from jobtrail.ledger.store import Store
from jobtrail.ledger.writer import BatchWriter, stepping
from jobtrail.providers.contract import Provider, slowest_call_s
from jobtrail.runtime.gauges import ledger_gauges
from jobtrail.runtime.liveness import HEARTBEAT_S

log = logging.getLogger("jobtrail")
_US = 1_000_000


@functools.cache
def _tune_collector() -> None:
    """Keep the garbage collector to a small share of a worker's time.

    A worker allocates and frees a few hundred objects per write and per answer; with the
    default thresholds the collector ran about 3,000 passes per 10,000 operations and took a fifth
    of the CPU, and each full pass (every object of the process: SQLAlchemy, aiohttp and
    OpenTelemetry loaded) stalled the loop 60-110 ms, as long as every call in flight waited.
    So: fewer young-generation passes (thresholds only ever raised, never lowered), and what
    exists before the first worker runs (modules, configuration: alive until the process exits)
    is collected once and frozen out of the full passes (:func:`gc.freeze`).
    """
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, 50_000), max(middle, 20), max(old, 10))
    gc.collect()
    gc.freeze()


#: actions started per loop turn after a claim (see _run)
_START_PER_TURN = 32
#: how long a claim lasts unless a provider's slowest call needs longer
DEFAULT_LEASE_S = 60.0
#: every state with an automatic next action
WORKED_STATES = tuple(AUTOMATIC_STATES)
#: states whose next action can settle the operation soon; the escalated ones (a person has been told;
#: slow polls go on, but nothing automatic is expected to end them) do not keep ``until_settled`` waiting
ACTIVE_STATES = tuple(s for s in AUTOMATIC_STATES if s not in ESCALATED_STATES)
#: most actions one claim may chain
_CHAIN = 4
#: while actions are in flight, how long a worker waits before claiming less than a share of its room
_CLAIM_PAUSE_S = 0.1
#: how often the worker makes sure its SQLite file is still the one it opened
_FILE_CHECK_S = 1.0
#: after a claim the database refused (locked, read-only, gone away), the next one waits this long,
#: twice as long after each further refusal, up to _CLAIM_RETRY_MAX_S: a database that is away costs a
#: few attempts a minute, not hundreds a second (what is due is still due when it answers again)
_CLAIM_RETRY_S = 0.1
_CLAIM_RETRY_MAX_S = 5.0
#: while claims keep being refused, the warning is repeated at most this often (with how long it has lasted)
_CLAIM_WARN_EVERY_S = 60.0


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(slots=True)
class WorkerStats:
    claimed: int = 0
    #: claim queries run (each one short transaction)
    claims: int = 0
    actions: int = 0
    stale: int = 0
    #: actions not started because too little of the lease was left to finish a provider call
    lease_too_short: int = 0
    errors: int = 0
    #: claims the database refused (each retried later, see _CLAIM_RETRY_S)
    claims_refused: int = 0
    transactions: int = 0
    writes: int = 0
    settled: bool = False
    by_state: dict[str, int] = field(default_factory=dict)


class Worker:
    """The reference loop of DESIGN.md.

    Args:
        store: the ledger.
        providers: adapters by name; only their operations are claimed.
        worker_id: recorded on every lease and observation (default host:pid).
        concurrency: operations in flight at once.
        lease_s: how long a claim lasts; must exceed the slowest provider call (default:
            :data:`DEFAULT_LEASE_S`, or twice the slowest call when that is longer).
        batch: most operations claimed per query.
        idle_s: longest sleep when nothing is due.
        checks: per provider name, the caller's own check of a result (return None/True to accept,
            False or a message to refuse, or raise).
        io: where database and file work runs (threads, never the event loop; the simulation runs it inline).
        writer_process: prepare and commit writes in a process of its own (see :class:`WriterProcess`):
            more operations a second from one worker where a second core is free, at some more CPU per
            operation (the messages between the two); False where cores are the scarce thing (several
            workers per core).
    """

    def __init__(
        self,
        store: Store,
        providers: Mapping[str, Provider],
        *,
        worker_id: str | None = None,
        concurrency: int = 1000,
        lease_s: float | None = None,
        batch: int = 200,
        idle_s: float = 0.5,
        rng: random.Random | None = None,
        checks: Mapping[str, Check] | None = None,
        io: Offload = threads,
        writer_process: bool = True,
    ) -> None:
        self.store = store
        self.providers = dict(providers)
        for provider in self.providers.values():
            # whatever credential a provider resolves, the ledger masks in what it stores, and so do the logs
            provider.redactor.forward_to(store.redactor)
        install_log_redaction(store.redactor)
        self.worker_id = worker_id or default_worker_id()
        self.concurrency = concurrency
        slowest_anywhere = max((slowest_call_s(p) for p in self.providers.values()), default=0.0)
        if lease_s is None:  # long enough for a few calls of the slowest provider
            lease_s = max(DEFAULT_LEASE_S, 2 * slowest_anywhere + 10)
        self.lease_s = lease_s
        self.batch = batch
        self.idle_s = idle_s
        self._slowest_us = {}
        for name, provider in self.providers.items():
            slowest = slowest_call_s(provider)
            if lease_s <= slowest:
                raise ConfigError(
                    f"--lease {lease_s:g} must exceed provider {name}'s slowest call "
                    f"({slowest:g} s: timeout_s + connect_timeout_s)"
                )
            self._slowest_us[name] = int(slowest * _US)
        self.io = io
        # the commits' Python runs in a process of its own, not against the loop's interpreter lock
        self.writer = BatchWriter(store, io=io, apart=writer_process)
        rng = rng or random.Random()  # noqa: S311 - jitter, not secrecy
        actor = f"worker:{self.worker_id}"
        self.create = CreateFlow(store, writer=self.writer, actor=actor, rng=rng)
        self.observe = ObserveFlow(store, self.writer, actor=actor, rng=rng)
        self.collect = CollectFlow(store, self.writer, actor=actor, rng=rng, checks=checks)
        self.cancel = CancelFlow(store, self.writer, actor=actor, rng=rng)
        self.stats = WorkerStats()
        self._claim_share = max(1, min(batch, concurrency) // 8)
        self._claimed_at = 0.0
        self._refusals = _Refusals()
        self._stopping = asyncio.Event()

    @property
    def stopped(self) -> bool:
        """Asked to stop (a signal, or :meth:`stop`), rather than out of time or settled."""
        return self._stopping.is_set()

    def stop(self) -> None:
        """Stop claiming; in-flight actions finish and release their leases."""
        if not self._stopping.is_set():
            log.info("worker %s asked to stop: it claims nothing more, and finishes what is in flight", self.worker_id)
        self._stopping.set()

    async def run(self, *, until_settled: bool = False, timeout: float | None = None) -> WorkerStats:
        """Work until stopped, or (``until_settled``) until every operation is settled.

        Settled: ended, waiting for a person, or escalated (``cancellation_unconfirmed``,
        ``result_timed_out``: still polled slowly, but nothing automatic is expected to end them).

        The first worker to run in a process tunes the garbage collector for a long-running worker:
        fewer young-generation passes, and what the process holds by then frozen out of the full
        passes (see :func:`_tune_collector`).
        """
        _tune_collector()
        with ledger_gauges(self.store, tuple(self.providers)):
            return await self._run(until_settled=until_settled, timeout=timeout)

    async def _run(self, *, until_settled: bool, timeout: float | None) -> WorkerStats:
        deadline = None if timeout is None else time.monotonic() + timeout
        inflight: set[asyncio.Task[None]] = set()
        checked = beat = 0.0
        self.writer.start()
        try:
            while not self._stopping.is_set():
                if deadline is not None and time.monotonic() >= deadline:
                    break
                if time.monotonic() - checked >= _FILE_CHECK_S:  # a deleted ledger stops the worker
                    await self.io(self.store.check_file)
                    checked = time.monotonic()
                if time.monotonic() - beat >= HEARTBEAT_S:  # readers can tell "no worker runs" from "waiting"
                    await self._heartbeat()
                    beat = time.monotonic()
                capacity = self.concurrency - len(inflight)
                claimed = await self._claim(capacity) if self._claim_worth_it(capacity, bool(inflight)) else []
                for started, op in enumerate(claimed):
                    if started and started % _START_PER_TURN == 0:
                        # each action runs until its request is on the wire: hundreds started in one loop
                        # turn would hold the loop (and the time-outs of the calls in flight) that long
                        await asyncio.sleep(0)
                    task = asyncio.create_task(self._handle(op))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
                if claimed:
                    await asyncio.sleep(0)
                    continue
                if until_settled and not inflight and await self._settled():
                    self.stats.settled = True
                    break
                await self._idle(bool(inflight))
        finally:
            if inflight:
                # each may wait on the database (up to its lock time-out) before its lease is given back
                log.info("worker %s: waiting for %d actions in flight to finish", self.worker_id, len(inflight))
                await asyncio.gather(*inflight, return_exceptions=True)
            await self._heartbeat(stopped=True)
            await self.writer.close()
            self.stats.transactions = self.writer.transactions
            self.stats.writes = self.writer.writes
            for provider in self.providers.values():
                await provider.aclose()
        return self.stats

    async def _heartbeat(self, *, stopped: bool = False) -> None:
        try:
            await self.io(self.store.heartbeat, self.worker_id, tuple(self.providers), stopped=stopped)
        except JobtrailError as exc:  # liveness is for readers: a failed beat must not stop the work
            log.warning("worker %s could not record its heartbeat: %s", self.worker_id, exc)

    def _claim_worth_it(self, capacity: int, busy: bool) -> bool:
        """A claim is a transaction (and on SQLite the file's one write lock): while actions are in flight,
        claiming a few operations every few milliseconds costs more than acting on them a little later
        gains. So a busy worker claims once a good share of its room is free, or after a short pause."""
        if capacity <= 0 or time.monotonic() < self._refusals.retry_at:
            return False
        if not busy or capacity >= self._claim_share:
            return True
        return time.monotonic() - self._claimed_at >= _CLAIM_PAUSE_S

    async def _claim(self, capacity: int) -> list[Operation]:
        self._claimed_at = time.monotonic()
        try:
            claimed = await self.writer.claim(
                self.worker_id,
                limit=min(self.batch, capacity),
                lease_s=self.lease_s,
                providers=tuple(self.providers),
                states=WORKED_STATES,
            )
        except JobtrailError as exc:
            self.stats.claims_refused += 1
            self._refusals.refused(self.worker_id, exc)
            return []
        self._refusals.answered(self.worker_id)
        self.stats.claims += 1
        self.stats.claimed += len(claimed)
        return claimed

    async def _settled(self) -> bool:
        due = await self.io(self.store.next_due_us, providers=tuple(self.providers), states=ACTIVE_STATES)
        return due is None

    async def _idle(self, busy: bool) -> None:
        wait = self.idle_s
        if busy:
            wait = 0.005
        else:
            due = await self.io(self.store.next_claimable_us, providers=tuple(self.providers), states=WORKED_STATES)
            if due is not None:
                wait = min(wait, max(0.001, (due - self.store.clock()) / _US))
            wait = max(wait, self._refusals.retry_at - time.monotonic())  # what is due waits for the next claim
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), timeout=wait)

    async def _handle(self, op: Operation) -> None:
        with operation_context(op):
            await self._handle_leased(op)

    async def _handle_leased(self, op: Operation) -> None:
        provider = self.providers[op.provider]
        epoch = op.lease_epoch  # the lease this task holds: it acts, and gives back, under no other
        try:
            # an action that leaves the next one due at once (accepted after a replay, the job
            # finished at this poll) continues under the same lease instead of a new claim
            for _ in range(_CHAIN):
                if not self._lease_covers_a_call(op):
                    # paused, or a long chain: too little lease left to finish a provider call, so the
                    # action is not started (it could outlive the lease while another worker takes over)
                    self.stats.lease_too_short += 1
                    break
                new = await self._step(op, provider)
                self.stats.actions += 1
                self.stats.by_state[new.state.value] = self.stats.by_state.get(new.state.value, 0) + 1
                due = new.next_action_at_us
                stop = (
                    new is op
                    # the step's write ended the lease (it put the next action off), or the step handed back a
                    # record read since, which another claim may hold: nothing more is done under it
                    or not self._holds(new, epoch)
                    or new.state not in WORKED_STATES
                    or due is None
                    or due > self.store.clock()
                )
                op = new
                if stop:
                    break
            if self._holds(op, epoch):  # not ended by the step's write (nor by entering a resting state)
                await self.writer.release(op)
        except StaleRecord as exc:
            # our lease was taken over, or someone (a person's cancel) changed the record: drop the operation,
            # and give the lease back so the next claim acts at once (fenced: a successor's lease stays)
            self.stats.stale += 1
            if exc.details.get("epoch") is not None:  # refused for a newer lease, not a person's change
                lease_taken_over(op)
            log.info("worker %s dropped %s: %s", self.worker_id, op.operation_id, exc)
            if self._holds(op, epoch):
                with contextlib.suppress(Exception):
                    await self.writer.release(op)
        except Exception as exc:
            self.stats.errors += 1
            log.error(
                "operation %s: its %s action failed in state %s (%s: %s); worker %s retries it later",
                op.operation_id,
                action_kind(op),
                op.state.value,
                type(exc).__name__,
                exc,
                self.worker_id,
            )
            await self._back_off(op, exc)

    def _holds(self, op: Operation, epoch: int) -> bool:
        """Is ``op`` (as this task last wrote or read it) still under the lease this task claimed?"""
        return op.lease_owner == self.worker_id and op.lease_epoch == epoch

    def _lease_covers_a_call(self, op: Operation) -> bool:
        if op.lease_expires_at_us is None:
            return True
        return op.lease_expires_at_us - self.store.clock() > self._slowest_us[op.provider]

    async def _step(self, op: Operation, provider: Provider) -> Operation:
        with action_span(op, action_kind(op)) as span, stepping():
            new = await self._act(op, provider)
            finished(span, new)
        return new

    async def _act(self, op: Operation, provider: Provider) -> Operation:
        step = next_step(op)
        if op.request_body is BODY_NOT_LOADED and body_needed(op.state, op.remote_job_id):
            # claimed past its create and moved back within this lease: the next claim reads the body
            raise StorageError(f"{op.operation_id}: its request body was not read with it; it is acted on again")
        if step is Step.CREATE:
            return await self.create.advance(op, provider)
        if step is Step.COLLECT:
            return await self.collect.advance(op, provider)
        if step is Step.SEND_CANCEL:
            return await self.cancel.advance(op, provider)
        return await self.observe.advance(op, provider)

    async def _back_off(self, op: Operation, exc: Exception) -> None:
        """An unexpected error: keep the record as it is, try again later, say why on the record."""
        try:
            current = await self.io(self.store.get, op.operation_id)
            if not self._holds(current, op.lease_epoch):
                # taken over, or the step's own write ended the lease (it landed, and set the next action):
                # a write now would not be fenced by a lease of ours
                return
            if current.state not in AUTOMATIC_STATES:  # the step's own write landed: nothing to retry
                await self.writer.release(current)
                return
            delay = self.providers[op.provider].backoff.after(None, max(current.attempts, 1))
            at = self.store.clock() + int(max(delay, 1.0) * _US)
            current = await self.writer.reschedule(
                current,
                {
                    "next_action_at_us": at,
                    "state_reason": f"{type(exc).__name__}: {exc}; retrying at {rfc3339(at)}",
                },
            )
            await self.writer.release(current)
        except Exception as again:  # the database itself may be the problem; the lease will expire
            log.error("worker %s could not reschedule %s: %s", self.worker_id, op.operation_id, again)


class _Refusals:
    """Claims the database refused in a row: when the next may be tried, and what the log has been told."""

    def __init__(self) -> None:
        self.count = 0
        self.retry_at = 0.0
        self._since = 0.0
        self._warned_at = 0.0

    def refused(self, worker_id: str, exc: JobtrailError) -> None:
        now = time.monotonic()
        self.count += 1
        if self.count == 1:
            self._since = now
        wait = min(_CLAIM_RETRY_MAX_S, _CLAIM_RETRY_S * 2 ** min(self.count - 1, 16))
        self.retry_at = now + wait
        if self.count == 1 or now - self._warned_at >= _CLAIM_WARN_EVERY_S:
            self._warned_at = now
            log.warning(
                "worker %s could not claim: %s (%s; next try in %.1f s)",
                worker_id,
                exc,
                "first refusal" if self.count == 1 else f"{self.count} refusals in {now - self._since:.0f} s",
                wait,
            )

    def answered(self, worker_id: str) -> None:
        if self.count:
            log.info(
                "worker %s claims again, after %d refused claims in %.1f s",
                worker_id,
                self.count,
                time.monotonic() - self._since,
            )
        self.count = 0
        self.retry_at = 0.0
