"""The Python API: submit an operation (durable before anything is sent), then drive its create.

``AsyncJobtrail`` is the core; ``Jobtrail`` is the small sync facade for scripts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, TypedDict, Unpack

from jobtrail.domain.canonical import span_text
from jobtrail.domain.errors import ConfigError, StaleRecord
from jobtrail.domain.failpoints import failpoint
from jobtrail.domain.record import (
    DEFAULT_CANCEL_DEADLINE,
    DEFAULT_CREATE_DEADLINE,
    DEFAULT_RESULT_DEADLINE,
    Operation,
    OperationSpec,
)
from jobtrail.domain.redact import install_log_redaction
from jobtrail.domain.states import CREATE_PHASE
from jobtrail.flows.cancel import CancelOutcome, request_cancel
from jobtrail.flows.create import CreateFlow
from jobtrail.flows.telemetry import action_kind, action_span, ambient_trace_id, finished
from jobtrail.ledger.offload import Offload, threads
from jobtrail.ledger.results import read_result
from jobtrail.ledger.store import EXPECTED_LOCK_WAIT_S, Store
from jobtrail.ledger.writer import BatchWriter
from jobtrail.providers.contract import Provider, ReconcileMode, slowest_call_s
from jobtrail.providers.http import HttpProvider, load_provider
from jobtrail.runtime.tasks import Task, open_task
from jobtrail.runtime.worker import default_worker_id

log = logging.getLogger("jobtrail")
#: how often a caller whose operation another owner is acting on looks again
_OWNER_POLL_S = 0.05
_US = 1_000_000


class SubmitOptions(TypedDict, total=False):
    """The options of :meth:`AsyncJobtrail.submit` (see :meth:`AsyncJobtrail.ensure` for their defaults)."""

    key: str | None
    target: str | None
    caller: str
    approved_by: str | None
    create_deadline: timedelta | None
    result_deadline: timedelta | None
    cancel_deadline: timedelta | None


class AsyncJobtrail:
    """jobtrail for async code.

    Args:
        db: SQLite path or PostgreSQL URL (default: ``$JOBTRAIL_DB``, then the user data dir).
        providers: provider objects, or paths to provider TOML files.
        actor: who this process is, as recorded in the history.
        store: an already open :class:`Store` (instead of ``db``).
        io: where database and file work runs (threads by default: never on the event loop).
        lease_s: how long this client holds an operation's lease while it sends a create itself
            (default: long enough for the provider's slowest call and the writes around it).
    """

    def __init__(
        self,
        db: str | os.PathLike[str] | None = None,
        *,
        providers: Iterable[Provider | str | os.PathLike[str] | Mapping[str, Any]] = (),
        actor: str = "jobtrail",
        store: Store | None = None,
        retention_policy: str = "warn",
        io: Offload = threads,
        lease_s: float | None = None,
    ) -> None:
        self.store = store or Store.open(db)
        self.lease_s = lease_s
        self.actor = actor
        self.io = io
        #: the lease owner this client records when it sends a create itself
        self.owner = f"client:{default_worker_id()}"
        if retention_policy not in ("warn", "refuse"):
            raise ConfigError(f"retention_policy must be 'warn' or 'refuse', not {retention_policy!r}")
        self.retention_policy = retention_policy
        self.providers: dict[str, Provider] = {}
        #: per provider, the read of its credential under way before a submit (see _learn_credential)
        self._credential_reads: dict[str, asyncio.Future[None]] = {}
        for provider in providers:
            self.add_provider(provider)
        #: every write of this client: concurrent submits (and the client's own creates) share group commits
        self.writer = BatchWriter(self.store, io=io)
        self._flow = CreateFlow(self.store, writer=self.writer, actor=actor)

    def add_provider(self, provider: Provider | str | os.PathLike[str] | Mapping[str, Any]) -> Provider:
        if isinstance(provider, str | os.PathLike | Mapping):
            provider = load_provider(provider)
        # whatever credential the provider resolves, this ledger masks in what it stores, and so do the logs
        provider.redactor.forward_to(self.store.redactor)
        install_log_redaction(self.store.redactor)
        self.providers[provider.name] = provider
        return provider

    def provider(self, name: str) -> Provider:
        try:
            return self.providers[name]
        except KeyError:
            known = ", ".join(sorted(self.providers)) or "none"
            raise ConfigError(f"no provider named {name!r} is configured (configured: {known})") from None

    async def submit(self, provider: str, request: Any, **options: Unpack[SubmitOptions]) -> Operation:
        """Make the operation durable and return it; nothing has been sent yet.

        Options as for :meth:`ensure`. The same ``key`` with the same request returns the
        existing operation; with a changed request it raises :class:`OperationKeyConflict`.
        :meth:`ensure` also says which of the two happened.
        """
        op, _ = await self.ensure(provider, request, **options)
        return op

    async def ensure(
        self,
        provider: str,
        request: Any,
        *,
        key: str | None = None,
        target: str | None = None,
        caller: str = "unknown",
        approved_by: str | None = None,
        create_deadline: timedelta | None = DEFAULT_CREATE_DEADLINE,
        result_deadline: timedelta | None = DEFAULT_RESULT_DEADLINE,
        cancel_deadline: timedelta | None = DEFAULT_CANCEL_DEADLINE,
    ) -> tuple[Operation, bool]:
        """:meth:`submit`, and whether the operation was created now (False: this key and request
        already had one, which is returned as it stands; nothing new will be sent for it)."""
        adapter = self.provider(provider)
        await self._learn_credential(adapter)
        self._check_retention(adapter, create_deadline)
        spec = self._spec(
            adapter,
            provider,
            request,
            key,
            target=target,
            caller=caller,
            approved_by=approved_by,
            create_deadline=create_deadline,
            result_deadline=result_deadline,
            cancel_deadline=cancel_deadline,
        )
        (made,) = await self.writer.create([spec], actor=caller)
        failpoint("create.after_record")
        return made.op, made.new

    async def _learn_credential(self, adapter: Provider) -> None:
        """Before a provider's first submit (and again once the read is older than the credential's time to
        live), its credential is read, off the loop, so the ledger knows its value and refuses a request body
        that carries it (it is never shown). Concurrent submits wait for the one read, in their order; a read
        that failed (a file not there yet) is tried again at the next submit."""
        if not isinstance(adapter, HttpProvider) or adapter.credential_known():
            return
        pending = self._credential_reads.get(adapter.name)
        if pending is None or pending.get_loop() is not asyncio.get_running_loop():
            pending = asyncio.ensure_future(self._read_credential(adapter))
            self._credential_reads[adapter.name] = pending
        await asyncio.shield(pending)

    async def _read_credential(self, adapter: HttpProvider) -> None:
        try:
            await self.io(adapter.read_credential)
        finally:
            self._credential_reads.pop(adapter.name, None)

    def _check_retention(self, adapter: Provider, create_deadline: timedelta | None) -> None:
        """A retry after the provider forgot the token could create a second job: say so before sending."""
        retention = adapter.capabilities.token_retention
        if retention is None or ReconcileMode.REPLAY not in adapter.capabilities.reconcile:
            return  # only a replay relies on the provider still knowing the token
        if create_deadline is None or create_deadline > retention:
            deadline = span_text(create_deadline) if create_deadline else "unlimited"
            message = (
                f"provider {adapter.name} keeps idempotency tokens for {span_text(retention)}, but the create "
                f"deadline is {deadline}: a retry after the provider forgot the token could create a "
                f"second job; submit with a create deadline below {span_text(retention)}"
            )
            if self.retention_policy == "refuse":
                raise ConfigError(message)
            log.warning("%s", message)

    @staticmethod
    def _spec(
        adapter: Provider,
        provider: str,
        request: Any,
        key: str | None,
        *,
        target: str | None = None,
        caller: str = "unknown",
        approved_by: str | None = None,
        create_deadline: timedelta | None = DEFAULT_CREATE_DEADLINE,
        result_deadline: timedelta | None = DEFAULT_RESULT_DEADLINE,
        cancel_deadline: timedelta | None = DEFAULT_CANCEL_DEADLINE,
    ) -> OperationSpec:
        spec = OperationSpec(
            provider=provider,
            target=target or adapter.target,
            endpoint=adapter.create_endpoint,
            body=request,
            operation_key=key,
            caller=caller,
            approved_by=approved_by,
            create_deadline=create_deadline,
            result_deadline=result_deadline,
            cancel_deadline=cancel_deadline,
            # inside the caller's span (an agent's own), the operation joins its trace
            trace_id=ambient_trace_id(),
        )
        spec.check_deadlines()
        if isinstance(adapter, HttpProvider):
            try:
                adapter.check_target(spec.target)
                adapter.check_request(request)
            except ConfigError as exc:
                raise ConfigError(
                    f"provider {provider} refuses this request (nothing was recorded or sent): {exc}"
                ) from None
        return spec

    async def submit_many(self, provider: str, requests: Iterable[Any], **options: Any) -> list[Operation]:
        """Submit many requests to one provider in one transaction (one commit); nothing is sent.

        Takes the options of :meth:`submit` except ``key`` (use :meth:`submit` for keyed requests).
        """
        adapter = self.provider(provider)
        await self._learn_credential(adapter)
        specs = [self._spec(adapter, provider, request, None, **options) for request in requests]
        made = await self.writer.create(specs, actor=options.get("caller", "unknown"))
        return [m.op for m in made]

    async def task(self, task_id: str, *, caller: str = "unknown") -> Task:
        """Open a task by id, or resume it after a restart (its steps are read back from the ledger)."""
        return await self.io(open_task, self, task_id, caller)

    async def advance_create(self, operation_id: str) -> Operation:
        """Do the operation's next create-phase action if it is due (one step), as its lease owner.

        If another owner (a worker) holds the operation's lease, nothing is done
        here and the record is returned as it stands: that owner acts.
        """
        op = await self.io(self.store.get, operation_id)
        provider = self.provider(op.provider)
        leased = await self.io(self.store.lease, operation_id, self.owner, lease_s=self._lease_s(provider))
        if leased is None:
            return op
        return await self._advance_leased(leased, provider)

    async def drive_create(
        self, operation_id: str, *, retrying: Callable[[Operation, float], None] | None = None
    ) -> Operation:
        """Drive the create to its end: accepted, result_collecting, failed or needs_attention.

        One owner at a time: each action is taken under the operation's lease
        (with a fencing epoch), from before its attempt is recorded until its
        outcome is. While a worker holds the lease, the worker acts and this
        waits for the outcome; a create is never sent by two processes at once.

        ``retrying(op, seconds)`` is told once per attempt that did not settle the create (nothing answered,
        a retryable answer), with the seconds until the next: without it, a provider that never answers
        keeps this call quietly busy until the create deadline.
        """
        op = await self.io(self.store.get, operation_id)
        provider = self.provider(op.provider)
        lease_s = self._lease_s(provider)
        told = -1  # the attempts last told of
        while op.state in CREATE_PHASE:
            now = self.store.clock()
            held = op.lease_owner is not None and (op.lease_expires_at_us or 0) > now
            due_in = ((op.next_action_at_us or now) - now) / _US
            # every attempt is told, also one whose next try is already due (a write that took longer
            # than the backoff): waiting for a positive wait skipped attempts on a busy machine
            if retrying is not None and not held and op.attempts and op.attempts != told:
                told = op.attempts
                retrying(op, max(due_in, 0.0))
            if held or due_in > 0:
                # another owner is acting (its outcome, not ours, comes next), or nothing is due yet:
                # look again by reading, never by taking write locks in a loop
                await asyncio.sleep(_OWNER_POLL_S if held else due_in)
                op = await self.io(self.store.get, operation_id)
                continue
            leased = await self.io(self.store.lease, operation_id, self.owner, lease_s=lease_s)
            if leased is None:  # taken between our read and our claim
                op = await self.io(self.store.get, operation_id)
                continue
            op = await self._advance_leased(leased, provider)
        return op

    async def _advance_leased(self, op: Operation, provider: Provider) -> Operation:
        """One create-phase action under the lease just taken; the lease is given back after it, whatever
        happens (the release is fenced by our epoch, so it never frees a successor's lease)."""
        try:
            with action_span(op, action_kind(op)) as span:
                new = await self._flow.advance(op, provider)
                finished(span, new)
        except StaleRecord:
            # someone changed the record (a person's cancel, a takeover after our lease lapsed): read it again
            new = await self.io(self.store.get, op.operation_id)
        finally:
            await self._flow.writer.release(op)
        if new.lease_epoch == op.lease_epoch:
            return dataclasses.replace(new, lease_owner=None, lease_expires_at_us=None)
        return new

    def _lease_s(self, provider: Provider) -> float:
        """Long enough for one create action: a send or replay, a cross-checking lookup, and the writes
        around them (each may wait out a busy database)."""
        slowest = slowest_call_s(provider)
        if self.lease_s is not None:
            if self.lease_s <= slowest:
                raise ConfigError(
                    f"a lease of {self.lease_s:g} s must exceed provider {provider.name}'s slowest call "
                    f"({slowest:g} s: timeout_s + connect_timeout_s)"
                )
            return self.lease_s
        return 2 * slowest + 3 * EXPECTED_LOCK_WAIT_S + 5

    async def cancel(
        self, operation_id: str, *, requested_by: str, reason: str, expected_effect: str = ""
    ) -> CancelOutcome:
        """Record a cancel intent (durable before anything is sent); a worker sends it once."""
        return await self.io(
            request_cancel,
            self.store,
            operation_id,
            requested_by=requested_by,
            reason=reason,
            expected_effect=expected_effect,
        )

    async def result(self, operation_id: str) -> tuple[dict[str, Any], bytes]:
        """The stored result (verified against its sha256), or ResultMissing saying why there is none."""
        return await self.io(read_result, self.store, operation_id)

    async def aclose(self) -> None:
        for provider in self.providers.values():
            await provider.aclose()
        self.store.close()

    async def __aenter__(self) -> AsyncJobtrail:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Jobtrail:
    """The sync facade for scripts: each call runs the async core to completion."""

    def __init__(self, db: str | os.PathLike[str] | None = None, **kwargs: Any) -> None:
        self._async = AsyncJobtrail(db, **kwargs)
        self.store = self._async.store

    def add_provider(self, provider: Provider | str | os.PathLike[str] | Mapping[str, Any]) -> Provider:
        return self._async.add_provider(provider)

    def submit(self, provider: str, request: Any, **kwargs: Any) -> Operation:
        return asyncio.run(self._async.submit(provider, request, **kwargs))

    def ensure(self, provider: str, request: Any, **kwargs: Any) -> tuple[Operation, bool]:
        return asyncio.run(self._async.ensure(provider, request, **kwargs))

    def drive_create(self, operation_id: str) -> Operation:
        async def run() -> Operation:
            try:
                return await self._async.drive_create(operation_id)
            finally:
                for provider in self._async.providers.values():
                    await provider.aclose()

        return asyncio.run(run())

    def get(self, operation_id: str) -> Operation:
        """The operation by its id, or by its operation key (see :meth:`Store.resolve`)."""
        return self.store.resolve(operation_id)

    def cancel(self, operation_id: str, *, requested_by: str, reason: str, expected_effect: str = "") -> CancelOutcome:
        return asyncio.run(
            self._async.cancel(operation_id, requested_by=requested_by, reason=reason, expected_effect=expected_effect)
        )

    def result(self, operation_id: str) -> tuple[dict[str, Any], bytes]:
        return asyncio.run(self._async.result(operation_id))

    def close(self) -> None:
        asyncio.run(self._async.aclose())

    def __enter__(self) -> Jobtrail:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["AsyncJobtrail", "HttpProvider", "Jobtrail"]
