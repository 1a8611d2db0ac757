"""Builders shared by tests: specs, valid evidence per arrow, and walking to a state."""

from __future__ import annotations

import math
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from jobtrail import (
    AmbiguousCreate,
    CancelAcknowledged,
    CancelIntent,
    CannotTell,
    ConfirmedCreate,
    ConflictingJobIds,
    CreateAttempt,
    DeadlinePassed,
    DefinitiveRejection,
    Evidence,
    HumanDecision,
    Operation,
    OperationSpec,
    ProvedAbsent,
    ReconciliationStarted,
    RemoteState,
    ResultUnavailable,
    ResumeRequested,
    State,
    StatusObservation,
    Store,
    SynchronousResult,
    ValidatedResult,
    ValidationFailure,
)
from jobtrail.domain.machine import RULES

S = State


def spec(**overrides: Any) -> OperationSpec:
    base: dict[str, Any] = {
        "provider": "fake",
        "target": "acct-1",
        "endpoint": "POST /v1/jobs",
        "body": {"input": "hello", "n": 3},
        "caller": "agent-7",
        "approved_by": "ops@example.com",
        # deadlines in the past, so DeadlinePassed evidence can be real
        "create_deadline": timedelta(seconds=-1),
        "result_deadline": timedelta(seconds=-1),
        "cancel_deadline": timedelta(seconds=-1),
    }
    base.update(overrides)
    return OperationSpec(**base)


def obs(state: RemoteState) -> StatusObservation:
    return StatusObservation(remote_state=state, raw_state=state.value, http_status=200)


def job_of(op: Operation) -> str:
    """The remote job id a test's provider gives ``op``: its own, as a real provider's are (the ledger never
    gives one job to two operations)."""
    return f"job-{op.operation_id[-10:].lower()}"


def valid_evidence(frm: State, to: State, op: Operation) -> Evidence:
    """Evidence that satisfies the rule for frm -> to on this record."""
    now = op.updated_at_us + 10**12
    if to in (S.FAILED,) and frm is S.CREATE_PENDING:
        return DefinitiveRejection(http_status=422, problem={"title": "bad input"})
    if frm is S.NEEDS_ATTENTION:
        return HumanDecision(decided_by="alice", reason="checked the console", remote_job_id=job_of(op))
    if frm is S.FAILED:
        return ResumeRequested(requested_by="alice", reason="transient", provider_supports_resume=True)
    if to is S.ACCEPTED:
        return ConfirmedCreate(remote_job_id=job_of(op), http_status=201, provider_request_id="req-1")
    if to is S.CREATE_UNKNOWN:
        return AmbiguousCreate(error_class="timeout", attempt=op.attempts)
    if to is S.RECONCILIATION:
        return ReconciliationStarted(path="replay")
    if to is S.CREATE_PENDING:
        return ProvedAbsent(path="status_by_client_id", http_status=404)
    if to is S.NEEDS_ATTENTION:
        if frm is S.RECONCILIATION:
            return CannotTell(reason="no_reconciliation_path")
        return ConflictingJobIds(first_job_id="job-1", second_job_id="job-2")
    if to is S.RESULT_COLLECTING and frm in (S.CREATE_PENDING, S.RECONCILIATION):
        return SynchronousResult(http_status=200)
    if to is S.RESULT_COLLECTING:
        return obs(RemoteState.SUCCEEDED)
    if to is S.OBSERVING:
        return obs(RemoteState.RUNNING)
    if to is S.FAILED:
        return obs(RemoteState.FAILED)
    if to is S.CANCELLED and frm is S.CREATE_PENDING:
        return CancelIntent(requested_by="bob", reason="not needed after all")
    if to is S.CANCELLED:
        return obs(RemoteState.CANCELLED)
    if to is S.CANCEL_REQUESTED:
        return CancelIntent(requested_by="bob", reason="wrong input", expected_effect="no charge")
    if to is S.CANCELLING:
        return CancelAcknowledged(http_status=202)
    if to is S.CANCELLATION_UNCONFIRMED:
        return DeadlinePassed(deadline="cancel", observed_at_us=now)
    if to is S.RESULT_TIMED_OUT:
        return DeadlinePassed(deadline="result", observed_at_us=now)
    if to is S.SUCCEEDED:
        return ValidatedResult(sha256="ab" * 32, size=10, content_type="application/json")
    if to is S.RESULT_UNAVAILABLE:
        return ResultUnavailable(reason="expired", http_status=410)
    if to is S.RESULT_VALIDATION_FAILED:
        return ValidationFailure(check="sha256", reason="checksum differs")
    raise AssertionError(f"no evidence builder for {frm} -> {to}")


def succeed(store: Store, op: Operation, data: bytes = b'{"ok": true}') -> Operation:
    """Store a result as the collector does: with the transition to succeeded that records its sha256."""
    from jobtrail.ledger.results import prepare_result

    stored = prepare_result(store, op.operation_id, data, content_type="application/json", checks=[], summary=None)
    evidence = ValidatedResult(sha256=stored.sha256, size=stored.size, content_type="application/json")
    return store.transition(op, S.SUCCEEDED, evidence, actor="worker", result=stored)


def path_to(state: State) -> list[State]:
    """Shortest list of states from create_pending to ``state`` through the table, by way of a job (a cancel
    that withdraws a create never sent is a path of its own, which the tests that need it take themselves)."""
    prev: dict[State, State | None] = {S.CREATE_PENDING: None}
    queue = deque([S.CREATE_PENDING])
    while queue:
        cur = queue.popleft()
        for frm, to in RULES:
            if (frm, to) == (S.CREATE_PENDING, S.CANCELLED):
                continue
            if frm is cur and to not in prev:
                prev[to] = cur
                queue.append(to)
    out = [state]
    while prev[out[-1]] is not None:
        out.append(prev[out[-1]])  # type: ignore[arg-type]
    return out[::-1]


def drive(store: Store, op: Operation, to: State) -> Operation:
    """Walk ``op`` from its state to ``to`` with valid evidence at each step."""
    for nxt in path_to(to)[1:]:
        if op.state is nxt:
            continue
        if op.state is S.CREATE_PENDING and op.attempts == 0:
            op = store.record(op, CreateAttempt(attempt=1), actor="worker", changes={"attempts": 1})
        if nxt is S.SUCCEEDED:
            op = succeed(store, op)
            continue
        changes = {"remote_job_id": job_of(op)} if nxt is S.ACCEPTED else {}
        op = store.transition(op, nxt, valid_evidence(op.state, nxt, op), actor="worker", changes=changes)
    return op


def op_in(store: Store, state: State, **overrides: Any) -> Operation:
    op, _ = store.create_operation(spec(**overrides))
    op = store.record(op, CreateAttempt(attempt=1), actor="worker", changes={"attempts": 1})
    return drive(store, op, state)


# -- what an attacker with database access does ---------------------------------------------------


def drop_guards(store: Store) -> None:
    """What an attacker with database access does first: the triggers only refuse, they prove nothing."""
    with store.engine.begin() as conn:
        if store.dialect == "postgresql":
            conn.execute(sa.text("DROP TRIGGER history_no_update_delete ON history"))
        else:
            conn.execute(sa.text("DROP TRIGGER history_no_update"))
            conn.execute(sa.text("DROP TRIGGER history_no_delete"))


def sql(store: Store, statement: str, **params: Any) -> None:
    with store.engine.begin() as conn:
        conn.execute(sa.text(statement), params)


# -- the canary scan ------------------------------------------------------------------------------


def canary_forms(canary: str) -> dict[str, bytes]:
    """The canary as it could leak: raw, JSON ``\\u``-escaped, percent-encoded, base64 at any alignment, hex."""
    import base64
    import json as _json
    import urllib.parse

    raw = canary.encode()
    forms = {
        "raw": raw,
        "json_u_escaped": "".join(f"\\u{ord(c):04x}" for c in canary).encode(),
        "json_u_escaped_upper": "".join(f"\\u{ord(c):04X}" for c in canary).encode(),
        "json_dumps_ascii": _json.dumps(canary, ensure_ascii=True).encode()[1:-1],
        "percent": urllib.parse.quote(canary, safe="").encode(),
        "percent_all": "".join(f"%{b:02X}" for b in raw).encode(),
        "hex": raw.hex().encode(),
        "hex_upper": raw.hex().upper().encode(),
    }
    # cut short by whoever quoted it (an HTTP library's error showing an answer's first bytes): two thirds of
    # it or more, from its start or up to its end, is a leak too (the redactor masks that much)
    most = max(12, 2 * len(raw) // 3)
    forms["raw_start"], forms["raw_end"] = raw[:most], raw[-most:]
    forms["utf16"] = "\0".join(canary).encode()  # its UTF-16 bytes, either byte order
    for shift in range(3):
        # whatever precedes it, the middle of its base64 is fixed for each of the three alignments
        for name, encode in (("base64", base64.b64encode), ("base64url", base64.urlsafe_b64encode)):
            encoded = encode(b"\0" * shift + raw)
            forms[f"{name}_{shift}"] = encoded[4 : len(encoded) - 4]
    return forms


def canary_hits(canary: str, haystack: bytes | str) -> list[str]:
    """Which forms of the canary occur in ``haystack`` (case-insensitively for the hex and escapes)."""
    data = haystack.encode() if isinstance(haystack, str) else haystack
    lowered = data.lower()
    hits = []
    for name, form in canary_forms(canary).items():
        if form in data or (name.startswith(("hex", "json_u", "percent_all")) and form.lower() in lowered):
            hits.append(name)
    return hits


def ledger_bytes(store: Store) -> bytes:
    """Everything the ledger holds: SQLite files as they are on disk (database, -wal, -shm, journal) and
    result files; on PostgreSQL every row of every table as text (bytea as hex) plus result files."""
    from pathlib import Path

    import sqlalchemy as sa

    from jobtrail.ledger.files import data_dir

    chunks: list[bytes] = []
    if store.dialect == "sqlite":
        path = Path(str(store.engine.url.database))
        chunks += [
            p.read_bytes() for p in (path, *(Path(f"{path}{s}") for s in ("-wal", "-shm", "-journal"))) if p.exists()
        ]
    else:
        with store.engine.connect() as conn:
            names = [
                r[0]
                for r in conn.execute(
                    sa.text("SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()")
                )
            ]
            for name in names:
                chunks += [str(r[0]).encode() for r in conn.execute(sa.text(f'SELECT x::text FROM "{name}" x'))]
    results = data_dir(store)
    if results.exists():
        chunks += [p.read_bytes() for p in results.rglob("*") if p.is_file()]
    return b"\n".join(chunks)


def tiered(values: Iterable[Any], fast: int) -> list[Any]:
    """Parameters for a family of like cases: ``fast`` of them, spread evenly, run in the fast tier and
    the rest only in the long tier (``pytest --long``), so each case still runs once in CI."""
    values = list(values)
    step = max(1, math.ceil(len(values) / fast))
    return [v if i % step == 0 else pytest.param(v, marks=pytest.mark.long) for i, v in enumerate(values)]


def ctrl_c_as_from_a_terminal() -> None:
    """A ``preexec_fn``: SIGINT's default disposition, as a command started from a terminal has it. Tests
    run in the background (``nohup``, ``&`` in a script) ignore SIGINT, and their children inherit that:
    Python then installs no KeyboardInterrupt handler, and the Ctrl-C a test sends does nothing."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, proc: Any, timeout: float = 30.0) -> None:
    """Return once 127.0.0.1:``port`` accepts connections; raise if ``proc`` (a Popen) ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.1)


@contextmanager
def serve_asgi(app: Any, port: int | None = None) -> Iterator[str]:
    """``app`` on a real uvicorn server on 127.0.0.1 (at ``port``, or a free one); yields its base URL."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    )  # its lifespan runs: apps write at shutdown
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@asynccontextmanager
async def provider_of_our_own(*routes: tuple[str, str, Callable[[Any], Awaitable[Any]]]) -> AsyncIterator[str]:
    """A provider that answers as a test scripts it (each route: method, path, aiohttp handler), on a real
    socket on 127.0.0.1, for the life of the block: its base URL."""
    from aiohttp import web

    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()
