"""``jobtrail mcp``: jobtrail's tools for agents over the Model Context Protocol.

Agents pick providers by name and pass request bodies; they never hold a
credential, never choose a URL and never set headers: the operator's provider
files and the worker keep all of that. The same operation key with the same
request returns the existing operation (no second job by rephrasing a retry);
with a changed request it is refused.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from jobtrail._cancel import request_cancel
from jobtrail._canonical import rfc3339
from jobtrail._client import AsyncJobtrail
from jobtrail._errors import JobtrailError, UsageError
from jobtrail._explain import next_action
from jobtrail._record import Operation
from jobtrail._redact import is_secret_name
from jobtrail._results import ResultMissing, describe, read_result
from jobtrail._states import SETTLED_STATES, State

#: request keys an agent may not use to reach past the operator's configuration
_FORBIDDEN_KEYS = {"headers", "base_url", "baseurl", "url", "endpoint", "host", "credential", "credentials"}
_RESULT_INLINE = 64 * 1024

INSTRUCTIONS = """jobtrail runs long jobs on remote APIs for you and keeps them safe across restarts.
Submit with an operation_key you will reuse if you retry: the same key and request never start a second job.
After any restart, call job_status to learn the one next action. Never pass credentials, headers or URLs:
providers are configured by the operator and chosen by name."""


def _brief(op: Operation) -> dict[str, Any]:
    return {
        "operation_id": op.operation_id,
        "provider": op.provider,
        "operation_key": op.operation_key,
        "state": op.state.value,
        "reason": op.state_reason,
        "remote_job_id": op.remote_job_id,
        "next_action": next_action(op),
        "next_action_at": rfc3339(op.next_action_at_us),
        "caller": op.caller,
        "approved_by": op.approved_by,
    }


def _guard(request: Any) -> None:
    if not isinstance(request, dict):
        raise UsageError("request must be a JSON object (the body the provider's create endpoint takes)")
    for key, value in request.items():
        norm = key.lower().replace("-", "").replace("_", "")
        if (
            norm in _FORBIDDEN_KEYS
            or norm in ("authorization", "cookie", "xapikey", "apikey")
            or (is_secret_name(key) and isinstance(value, str))
        ):
            raise UsageError(
                f"request field {key!r} is refused: agents cannot pass credentials, headers or URLs; "
                "the operator configures them on the provider, which you choose by name"
            )


def _explained(tool: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Our errors reach the agent as the tool's error message (what is wrong and what to do)."""

    @functools.wraps(tool)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await tool(*args, **kwargs)
        except JobtrailError as exc:
            raise ToolError(str(exc)) from None

    return wrapper


def build_server(jt: AsyncJobtrail, *, agent: str, approver: str | None) -> MCPServer:
    server = MCPServer(name="jobtrail", instructions=INSTRUCTIONS)
    store = jt.store

    @server.tool(
        description=(
            "Start a long-running job on a configured provider (by name). Returns the operation id, durable before "
            "anything is sent, and the next action. Reuse the same operation_key when you retry: the same key and "
            f"request return the existing operation, a changed request is refused. Providers: {', '.join(jt.providers)}"
        )
    )
    @_explained
    async def submit_job(
        provider: str,
        request: dict[str, Any],
        operation_key: str,
        create_deadline_s: int = 3600,
        result_deadline_s: int = 86400,
    ) -> dict[str, Any]:
        _guard(request)
        op = await jt.submit(
            provider,
            request,
            key=operation_key,
            caller=agent,
            approved_by=approver,
            create_deadline=timedelta(seconds=create_deadline_s),
            result_deadline=timedelta(seconds=result_deadline_s),
        )
        if op.state is State.CREATE_PENDING and op.attempts == 0:
            op = await jt.drive_create(op.operation_id)
        return _brief(op)

    @server.tool(description="Where an operation stands, why, and its one next action (use after any restart).")
    @_explained
    async def job_status(operation_id: str) -> dict[str, Any]:
        return _brief(await jt.io(store.get, operation_id))

    @server.tool(description="List operations, newest first; filter by state (e.g. needs_attention) or provider.")
    @_explained
    async def list_jobs(state: str | None = None, provider: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        ops = await jt.io(store.list_operations, state=state, provider=provider, limit=min(limit, 500))
        return [_brief(op) for op in ops]

    @server.tool(
        description="Wait (at most timeout_s seconds, up to 120) until the operation's state changes or "
        "it settles; returns its status. A worker must be running."
    )
    @_explained
    async def wait_for_change(operation_id: str, timeout_s: float = 30) -> dict[str, Any]:
        start = await jt.io(store.get, operation_id)
        deadline = time.monotonic() + min(max(timeout_s, 0), 120)
        op = start
        while op.state is start.state and op.state not in SETTLED_STATES and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            op = await jt.io(store.get, operation_id)
        return _brief(op) | {"changed": op.state is not start.state}

    @server.tool(
        description="Ask to cancel a job. The intent is recorded first; a worker sends the cancel once and "
        "only the provider's own status makes it cancelled."
    )
    @_explained
    async def cancel_job(operation_id: str, reason: str) -> dict[str, Any]:
        done = await jt.io(request_cancel, store, operation_id, requested_by=f"agent:{agent}", reason=reason)
        return {"outcome": done.outcome, "message": done.message, **_brief(done.operation)}

    @server.tool(description="The collected, validated result of a succeeded job (or why there is none).")
    @_explained
    async def get_result(operation_id: str) -> dict[str, Any]:
        try:
            row, data = await jt.io(read_result, store, operation_id)
        except ResultMissing as exc:
            return {"operation_id": operation_id, "result": None, "why": str(exc)}
        out = describe(row)
        if len(data) <= _RESULT_INLINE:
            try:
                out["result"] = json.loads(data)
            except ValueError:
                out["result_text"] = data.decode("utf-8", errors="replace")
        else:
            out["note"] = f"the result is {len(data)} bytes; fetch it with `jobtrail result {operation_id} --out FILE`"
        return out

    @server.tool(
        description="Operations that wait for a person (needs_attention, unconfirmed cancels, timed-out "
        "results), with what the person must decide."
    )
    @_explained
    async def jobs_needing_a_person() -> list[dict[str, Any]]:
        waiting = []
        for state in (State.NEEDS_ATTENTION, State.CANCELLATION_UNCONFIRMED, State.RESULT_TIMED_OUT):
            waiting += [_brief(op) for op in await jt.io(store.list_operations, state=state, limit=200)]
        return waiting

    return server
