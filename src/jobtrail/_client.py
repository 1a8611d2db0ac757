"""The Python API: submit an operation (durable before anything is sent), then drive its create.

``AsyncJobtrail`` is the core; ``Jobtrail`` is the small sync facade for scripts.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from jobtrail._cancel import CancelOutcome, request_cancel
from jobtrail._create import CreateFlow
from jobtrail._errors import ConfigError
from jobtrail._failpoints import failpoint
from jobtrail._http_provider import HttpProvider, load_provider
from jobtrail._provider import Provider
from jobtrail._record import (
    DEFAULT_CANCEL_DEADLINE,
    DEFAULT_CREATE_DEADLINE,
    DEFAULT_RESULT_DEADLINE,
    Operation,
    OperationSpec,
)
from jobtrail._results import read_result
from jobtrail._store import Store
from jobtrail._tasks import Task, open_task

log = logging.getLogger("jobtrail")


class AsyncJobtrail:
    """jobtrail for async code.

    Args:
        db: SQLite path or PostgreSQL URL (default: ``$JOBTRAIL_DB``, then the user data dir).
        providers: provider objects, or paths to provider TOML files.
        actor: who this process is, as recorded in the history.
        store: an already open :class:`Store` (instead of ``db``).
    """

    def __init__(
        self,
        db: str | os.PathLike[str] | None = None,
        *,
        providers: Iterable[Provider | str | os.PathLike[str] | Mapping[str, Any]] = (),
        actor: str = "jobtrail",
        store: Store | None = None,
        retention_policy: str = "warn",
    ) -> None:
        self.store = store or Store.open(db)
        self.actor = actor
        if retention_policy not in ("warn", "refuse"):
            raise ConfigError(f"retention_policy must be 'warn' or 'refuse', not {retention_policy!r}")
        self.retention_policy = retention_policy
        self.providers: dict[str, Provider] = {}
        for provider in providers:
            self.add_provider(provider)
        self._flow = CreateFlow(self.store, actor=actor)

    def add_provider(self, provider: Provider | str | os.PathLike[str] | Mapping[str, Any]) -> Provider:
        if isinstance(provider, str | os.PathLike | Mapping):
            provider = load_provider(provider)
        self.providers[provider.name] = provider
        return provider

    def provider(self, name: str) -> Provider:
        try:
            return self.providers[name]
        except KeyError:
            known = ", ".join(sorted(self.providers)) or "none"
            raise ConfigError(f"no provider named {name!r} is configured (configured: {known})") from None

    async def submit(
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
    ) -> Operation:
        """Make the operation durable and return it; nothing has been sent yet.

        The same ``key`` with the same request returns the existing operation;
        with a changed request it raises :class:`OperationKeyConflict`.
        """
        adapter = self.provider(provider)
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
        op, _ = self.store.create_operation(spec, actor=caller)
        failpoint("create.after_record")
        return op

    def _check_retention(self, adapter: Provider, create_deadline: timedelta | None) -> None:
        """A retry after the provider forgot the token could create a second job: say so before sending."""
        retention = adapter.capabilities.token_retention
        if retention is None or adapter.capabilities.token.where == "none":
            return
        if create_deadline is None or create_deadline > retention:
            message = (
                f"provider {adapter.name} keeps idempotency tokens for {retention}, but the create deadline is "
                f"{create_deadline or 'unlimited'}: a retry after the provider forgot the token could create a "
                f"second job; submit with a create deadline below {retention}"
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
        return OperationSpec(
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
        )

    async def submit_many(self, provider: str, requests: Iterable[Any], **options: Any) -> list[Operation]:
        """Submit many requests to one provider in one transaction (one commit); nothing is sent.

        Takes the options of :meth:`submit` except ``key`` (use :meth:`submit` for keyed requests).
        """
        adapter = self.provider(provider)
        specs = [self._spec(adapter, provider, request, None, **options) for request in requests]
        return [op for op, _ in self.store.create_operations(specs, actor=options.get("caller", "unknown"))]

    async def task(self, task_id: str, *, caller: str = "unknown") -> Task:
        """Open a task by id, or resume it after a restart (its steps are read back from the ledger)."""
        return open_task(self, task_id, caller)

    async def advance_create(self, operation_id: str) -> Operation:
        """Do the operation's next create-phase action if it is due (one step)."""
        op = self.store.get(operation_id)
        return await self._flow.advance(op, self.provider(op.provider))

    async def drive_create(self, operation_id: str) -> Operation:
        """Drive the create to its end: accepted, result_collecting, failed or needs_attention."""
        op = self.store.get(operation_id)
        return await self._flow.run(op, self.provider(op.provider))

    async def cancel(
        self, operation_id: str, *, requested_by: str, reason: str, expected_effect: str = ""
    ) -> CancelOutcome:
        """Record a cancel intent (durable before anything is sent); a worker sends it once."""
        return request_cancel(
            self.store, operation_id, requested_by=requested_by, reason=reason, expected_effect=expected_effect
        )

    async def result(self, operation_id: str) -> tuple[dict[str, Any], bytes]:
        """The stored result (verified against its sha256), or ResultMissing saying why there is none."""
        return read_result(self.store, operation_id)

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

    def drive_create(self, operation_id: str) -> Operation:
        async def run() -> Operation:
            try:
                return await self._async.drive_create(operation_id)
            finally:
                for provider in self._async.providers.values():
                    await provider.aclose()

        return asyncio.run(run())

    def get(self, operation_id: str) -> Operation:
        return self.store.get(operation_id)

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
