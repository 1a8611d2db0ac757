"""The ``jobtrail`` command line. Every read command takes ``--json``.

Exit codes: 0 ok; 1 a negative answer (tampered history, operation not found,
operation failed); 2 usage, configuration or storage error (cannot answer);
3 a person must decide.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click
from rich.console import Console
from rich.table import Column, Table

from jobtrail.domain.canonical import parse_json, rfc3339
from jobtrail.domain.errors import ConfigError, JobtrailError, OperationalError, OperationNotFound, require_extra
from jobtrail.domain.explain import next_action
from jobtrail.domain.record import Operation
from jobtrail.domain.redact import Secret, install_log_redaction
from jobtrail.domain.states import FINAL_STATES, SETTLED_STATES, State

if TYPE_CHECKING:  # the ledger (SQLAlchemy) is imported by the commands that use it: --help stays quick
    from jobtrail.ledger.store import Store

EXIT_OK, EXIT_NEGATIVE, EXIT_USAGE, EXIT_NEEDS_PERSON = 0, 1, 2, 3

console = Console()


def _emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False))


def _fail(message: str, code: int) -> NoReturn:
    click.echo(f"jobtrail: {message}", err=True)
    sys.exit(code)


class _Group(click.Group):
    """Turns our errors into one line and an exit code (tracebacks only with --debug)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except JobtrailError as exc:
            if ctx.find_root().params.get("debug"):
                raise
            code = EXIT_NEGATIVE if isinstance(exc, OperationNotFound) else EXIT_USAGE
            _fail(str(exc), code)


def _store(ctx: click.Context) -> Store:
    obj: dict[str, Any] = ctx.ensure_object(dict)
    if "store" not in obj:
        from jobtrail.ledger.store import Store

        obj["store"] = Store.open(obj.get("db"))
        ctx.call_on_close(obj["store"].close)
    store: Store = obj["store"]
    return store


def _sqlite_file(db: str | None) -> Path | None:
    """The SQLite file ``--db`` (or its defaults) names, or None for a server URL or an in-memory one."""
    from jobtrail.ledger.store import DEFAULT_DB_ENV, default_db_path

    raw = db if db is not None else os.environ.get(DEFAULT_DB_ENV) or str(default_db_path())
    if raw.startswith("sqlite:///"):
        raw = raw[len("sqlite:///") :].split("?", 1)[0]
        return Path(raw).expanduser().absolute() if raw and raw != ":memory:" else None
    if "://" in raw:
        return None
    return Path(raw).expanduser().absolute()


def _existing_store(ctx: click.Context) -> Store:
    """For commands that only read: a missing SQLite file is an error, never a fresh empty ledger."""
    obj: dict[str, Any] = ctx.ensure_object(dict)
    if "store" not in obj:
        path = _sqlite_file(obj.get("db"))
        if path is not None and not path.exists():
            _fail(
                f"no database at {path}: there is nothing to read (none was created). "
                "Point --db (or JOBTRAIL_DB) at your ledger",
                EXIT_USAGE,
            )
    return _store(ctx)


@click.group(cls=_Group)
@click.option(
    "--db",
    envvar="JOBTRAIL_DB",
    metavar="PATH|URL",
    help="SQLite file or postgresql:// URL (default: $JOBTRAIL_DB, else ~/.local/share/jobtrail/jobtrail.db).",
)
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.version_option(package_name="jobtrail", prog_name="jobtrail", message="%(prog)s %(version)s")
@click.pass_context
def cli(ctx: click.Context, db: str | None, debug: bool) -> None:
    """jobtrail: durable, honest bookkeeping for long-running remote jobs.

    \b
    Example:
      jobtrail --db ./jobs.db ops list --state needs_attention --json
    """
    install_log_redaction()
    ctx.ensure_object(dict)["db"] = db


# -- ops ---------------------------------------------------------------------------


@cli.group()
def ops() -> None:
    """Read operation records and their history."""


@ops.command("list")
@click.option(
    "--state", "states", multiple=True, type=click.Choice([s.value for s in State]), help="Only these states (repeat)."
)
@click.option("--provider", help="Only this provider.")
@click.option("--caller", help="Only operations this caller submitted.")
@click.option("--key", help="Only the operation(s) with this key.")
@click.option("--limit", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of operation objects.")
@click.pass_context
def ops_list(
    ctx: click.Context,
    states: tuple[str, ...],
    provider: str | None,
    caller: str | None,
    key: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """List operations, newest first. A list cut at --limit says so (on stderr), with the total.

    \b
    Example:
      jobtrail ops list --state needs_attention --state cancellation_unconfirmed --json
    """
    store = _existing_store(ctx)
    filters: dict[str, Any] = {"state": states or None, "provider": provider, "caller": caller, "key": key}
    operations = store.list_operations(limit=limit, **filters)
    if len(operations) == limit:
        total = store.count_operations(**filters)
        if total > limit:
            click.echo(f"showing the newest {limit} of {total} operations; raise --limit to see more", err=True)
    if as_json:
        _emit_json([op.to_json() for op in operations])
        return
    table = Table(Column("operation", no_wrap=True), "key", "state", "remote job", "next action", "at")
    for op in operations:
        table.add_row(
            op.operation_id,
            op.operation_key or "-",
            op.state.value,
            op.remote_job_id or "-",
            next_action(op),
            "-" if op.state in FINAL_STATES else rfc3339(op.next_action_at_us) or "waits for a person",
        )
    console.print(table)
    if not operations:
        console.print("no operations")


@ops.command("show")
@click.argument("operation_id")
@click.option("--json", "as_json", is_flag=True, help="Print the operation object.")
@click.pass_context
def ops_show(ctx: click.Context, operation_id: str, as_json: bool) -> None:
    """Show one operation record (never its idempotency token).

    \b
    Example:
      jobtrail ops show op_01J9Z3K8Q0W6S8V7D2M1X4C5B6 --json
    """
    from jobtrail.domain.results import describe
    from jobtrail.ledger.results import stored_result

    store = _existing_store(ctx)
    op = store.resolve(operation_id)  # an id, or the operation's key
    operation_id = op.operation_id
    result = stored_result(store, operation_id)
    doc = op.to_json()
    doc["result"] = None if result is None else describe(result)
    if as_json:
        _emit_json(doc)
        return
    summary = result["summary"] if result else None
    if summary and summary.get("failed"):
        console.print(
            f"[yellow]partial failure:[/yellow] {summary['failed']} of {summary['items']} items failed: "
            + ", ".join(summary["failed_ids"][:20])
            + (" ..." if summary["failed"] > 20 else "")
        )
    table = Table(show_header=False)
    for key, value in doc.items():
        table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
    console.print(table)


@ops.command("history")
@click.argument("operation_id")
@click.option("--json", "as_json", is_flag=True, help="Print the list of history entries.")
@click.pass_context
def ops_history(ctx: click.Context, operation_id: str, as_json: bool) -> None:
    """Show every recorded transition and action of one operation, oldest first.

    \b
    Example:
      jobtrail ops history op_01J9Z3K8Q0W6S8V7D2M1X4C5B6
    """
    store = _existing_store(ctx)
    operation_id = store.resolve(operation_id).operation_id  # an id, or the operation's key
    entries = store.history(operation_id)
    if as_json:
        _emit_json([e.to_json() for e in entries])
        return
    table = Table("seq", "at", "actor", "from", "to", "cause", "hash")
    for e in entries:
        table.add_row(
            str(e.seq), rfc3339(e.at_us), e.actor, e.from_state or "-", e.to_state, e.cause, e.entry_hash[:12]
        )
    console.print(table)


# -- submit and providers -------------------------------------------------------------

_DURATION = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(value: str | None, option: str) -> timedelta | None:
    if value is None:
        return None
    text = value.strip().lower()
    unit = text[-1] if text and text[-1] in _DURATION else "s"
    number = text[:-1] if text and text[-1] in _DURATION else text
    try:
        seconds = float(number) * _DURATION[unit]
    except ValueError:
        raise ConfigError(f"{option} {value!r}: use a duration like 90s, 15m, 2h or 1d") from None
    if not seconds > 0:  # NaN too
        raise ConfigError(f"{option} {value!r}: a deadline must be in the future")
    try:
        return timedelta(seconds=seconds)
    except OverflowError:  # inf, 1e400
        raise ConfigError(f"{option} {value!r}: use a duration like 90s, 15m, 2h or 1d") from None


def _request(value: str) -> Any:
    text = value
    if value.startswith("@"):
        try:
            text = Path(value[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"--request {value}: cannot read the file ({exc.strerror})") from None
    try:
        return parse_json(text)
    except ValueError as exc:
        raise ConfigError(f"--request is not valid JSON ({exc}); pass JSON text or @path/to/file.json") from None


_EXIT_FOR_STATE = {State.FAILED: EXIT_NEGATIVE, State.NEEDS_ATTENTION: EXIT_NEEDS_PERSON}


@cli.command()
@click.option(
    "--provider",
    "provider_file",
    required=True,
    type=click.Path(dir_okay=False),
    help="Provider file (TOML).",
)
@click.option("--request", "request_text", required=True, metavar="JSON|@FILE", help="The request body.")
@click.option("--key", help="Operation key: the same key and request return the existing operation.")
@click.option("--target", help="What the job acts on (default: the provider's target).")
@click.option("--caller", default=lambda: os.environ.get("USER", "cli"), help="Who asks (default: $USER).")
@click.option("--approved-by", help="Who approved this operation.")
@click.option("--create-deadline", default="1h", show_default=True, help="e.g. 90s, 15m, 2h.")
@click.option("--result-deadline", default="24h", show_default=True)
@click.option("--cancel-deadline", default="30m", show_default=True)
@click.option("--no-send", is_flag=True, help="Only record the operation; a worker sends it later.")
@click.option(
    "--lease",
    "lease_s",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds this process holds the operation while it sends the create (default: the provider's "
    "slowest call plus time to record its outcome). A worker takes over only after it runs out.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="JSON lines: {event: submitted, ...} first, then {event: create_finished, ...}.",
)
@click.pass_context
def submit(
    ctx: click.Context,
    provider_file: str,
    request_text: str,
    key: str | None,
    target: str | None,
    caller: str,
    approved_by: str | None,
    create_deadline: str,
    result_deadline: str,
    cancel_deadline: str,
    no_send: bool,
    lease_s: float | None,
    as_json: bool,
) -> None:
    """Record an operation (durable before anything is sent), print its id, then drive its create.

    Exit 0 accepted (or result ready), 1 rejected, 3 a person must decide.

    \b
    Example:
      jobtrail submit --provider examples/fake.toml --request '{"prompt": "hi"}' --key demo-1
    """
    from jobtrail.runtime.client import AsyncJobtrail

    body = _request(request_text)
    jt = AsyncJobtrail(store=_store(ctx), providers=[provider_file], actor=f"cli:{caller}", lease_s=lease_s)
    provider = next(iter(jt.providers))

    async def run() -> Operation:
        try:
            op = await jt.submit(
                provider,
                body,
                key=key,
                target=target,
                caller=caller,
                approved_by=approved_by,
                create_deadline=_duration(create_deadline, "--create-deadline"),
                result_deadline=_duration(result_deadline, "--result-deadline"),
                cancel_deadline=_duration(cancel_deadline, "--cancel-deadline"),
            )
            if as_json:
                click.echo(json.dumps({"event": "submitted", "operation_id": op.operation_id, "state": op.state.value}))
            else:
                click.echo(op.operation_id)
            sys.stdout.flush()
            if not no_send:
                op = await jt.drive_create(op.operation_id)
            return op
        finally:
            for adapter in jt.providers.values():
                await adapter.aclose()

    op = asyncio.run(run())
    if as_json:
        click.echo(json.dumps({"event": "create_finished", **op.to_json()}, sort_keys=True))
    elif not no_send:
        line = f"{op.state.value}"
        if op.remote_job_id:
            line += f" remote job {op.remote_job_id}"
        if op.state_reason:
            line += f": {op.state_reason}"
        click.echo(line)
    sys.exit(_EXIT_FOR_STATE.get(op.state, EXIT_OK))


@cli.group()
def providers() -> None:
    """Inspect provider files."""


@providers.command("check")
@click.argument("provider_file", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the guarantees as an object.")
def providers_check(provider_file: str, as_json: bool) -> None:
    """Read a provider file and state which guarantees it allows.

    \b
    Example:
      jobtrail providers check examples/fake.toml --json
    """
    from jobtrail.providers.contract import guarantees
    from jobtrail.providers.http import load_provider

    report = guarantees(load_provider(provider_file))
    if as_json:
        _emit_json(report)
        return
    table = Table("guarantee", "verdict", "why")
    for name, item in report["guarantees"].items():
        table.add_row(name, item["verdict"], item["why"])
    console.print(f"provider {report['provider']} ({report['base_url']})")
    console.print(table)
    for warning in report["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}")


@cli.command()
@click.option(
    "--provider",
    "provider_files",
    multiple=True,
    envvar="JOBTRAIL_PROVIDERS",
    required=True,
    type=click.Path(dir_okay=False),
    help="Provider file (repeatable; or $JOBTRAIL_PROVIDERS).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1),
    default=1000,
    show_default=True,
    help="Operations in flight at once.",
)
@click.option(
    "--lease",
    "lease_s",
    type=click.FloatRange(min=1),
    default=60.0,
    show_default=True,
    help="Seconds a claim lasts; must exceed the slowest provider call.",
)
@click.option(
    "--until-settled",
    is_flag=True,
    help="Exit once every operation is settled: ended, waiting for a person, or escalated "
    "(cancellation_unconfirmed and result_timed_out are still polled slowly while the worker runs, "
    "but nothing automatic is expected to end them soon, so they do not keep it waiting).",
)
@click.option("--timeout", type=click.FloatRange(min=0), help="Exit after this many seconds.")
@click.option("--id", "worker_id", help="Worker identity on leases and observations (default host:pid).")
@click.option("--json", "as_json", is_flag=True, help="Print the run's statistics as an object at exit.")
@click.pass_context
def worker(
    ctx: click.Context,
    provider_files: tuple[str, ...],
    concurrency: int,
    lease_s: float,
    until_settled: bool,
    timeout: float | None,
    worker_id: str | None,
    as_json: bool,
) -> None:
    """Claim due operations under a lease and do each one's next action.

    SIGTERM or SIGINT: stop claiming, finish in-flight actions, release leases, exit 0.

    \b
    Example:
      jobtrail --db postgresql://jobs@db/jobs worker --provider openai.toml --concurrency 2000
    """
    import signal

    from jobtrail.providers.http import load_provider
    from jobtrail.runtime.worker import Worker

    adapters = {}
    for path in provider_files:
        adapter = load_provider(path)
        adapters[adapter.name] = adapter
    runner = Worker(_store(ctx), adapters, worker_id=worker_id, concurrency=concurrency, lease_s=lease_s)

    async def run() -> Any:
        from jobtrail.interfaces.early import early_signals

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runner.stop)
        if early_signals:  # asked to stop while still starting: claim nothing, exit cleanly
            runner.stop()
        return await runner.run(until_settled=until_settled, timeout=timeout)

    stats = asyncio.run(run())
    if as_json:
        _emit_json(
            {
                "worker": runner.worker_id,
                "claimed": stats.claimed,
                "actions": stats.actions,
                "stale": stats.stale,
                "errors": stats.errors,
                "transactions": stats.transactions,
                "writes": stats.writes,
                "settled": stats.settled,
            }
        )


@cli.command()
@click.argument("operation_id")
@click.option(
    "--to",
    "to_state",
    required=True,
    type=click.Choice(["accepted", "create_pending", "failed", "cancelled"]),
    help="What you decided: accepted (give --job-id), create_pending (send again with the same "
    "token), failed, cancelled.",
)
@click.option("--by", "decided_by", required=True, help="Who decided (kept in the history).")
@click.option("--reason", required=True, help="Why (kept in the history).")
@click.option("--job-id", help="The remote job id you confirmed (for --to accepted).")
@click.option("--json", "as_json", is_flag=True, help="Print the operation after the decision.")
@click.pass_context
def resolve(
    ctx: click.Context,
    operation_id: str,
    to_state: str,
    decided_by: str,
    reason: str,
    job_id: str | None,
    as_json: bool,
) -> None:
    """Record a person's decision on an operation that needs attention.

    \b
    Example:
      jobtrail resolve op_01J9... --to accepted --job-id batch_abc --by alice --reason "found it in the console"
    """
    from jobtrail.domain.evidence import HumanDecision

    store = _store(ctx)
    op = store.resolve(operation_id)  # an id, or the operation's key
    operation_id = op.operation_id
    changes: dict[str, Any] = {"state_reason": f"resolved by {decided_by}: {reason}"}
    if job_id:
        changes["remote_job_id"] = job_id
    moved = store.transition(
        op,
        State(to_state),
        HumanDecision(decided_by=decided_by, reason=reason, remote_job_id=job_id),
        actor=f"person:{decided_by}",
        changes=changes,
    )
    if as_json:
        _emit_json(moved.to_json())
    else:
        click.echo(f"{moved.operation_id}: {moved.state.value}; next: {next_action(moved)}")


@cli.command()
@click.argument("operation_id")
@click.option("--json", "as_json", is_flag=True, help="Print {state, reason, next_action, at}.")
@click.pass_context
def explain(ctx: click.Context, operation_id: str, as_json: bool) -> None:
    """Say where an operation (or a task and each of its steps) stands, why, and the one next action.

    Exit 0, or 3 when a person must decide.

    \b
    Example:
      jobtrail explain op_01J9Z3K8Q0W6S8V7D2M1X4C5B6
    """
    store = _existing_store(ctx)
    if not operation_id.startswith("op_"):
        from jobtrail.runtime.client import AsyncJobtrail
        from jobtrail.runtime.tasks import Task

        explained = Task(AsyncJobtrail(store=store), operation_id).explain()
        if explained["steps"]:
            if as_json:
                _emit_json(explained)
            else:
                next_step = explained["next_step"] or "-"
                click.echo(f"task {operation_id}: next step {next_step}: {explained['next_action']}")
                for step in explained["steps"]:
                    click.echo(
                        f"  {step['name']}: {step['state']} ({step['operation_id'] or 'no operation yet'}): "
                        f"{step['next_action']}"
                    )
            unresolved = any(step["state"] == "unresolved" for step in explained["steps"])
            sys.exit(EXIT_NEEDS_PERSON if unresolved else EXIT_OK)
    try:
        op = store.resolve(operation_id)  # an id, or the operation's key
    except OperationNotFound:
        raise ConfigError(f"no operation or task {operation_id!r}; list operations with `jobtrail ops list`") from None
    operation_id = op.operation_id
    doc = {
        "operation_id": op.operation_id,
        "state": op.state.value,
        "reason": op.state_reason,
        "next_action": next_action(op),
        "at": rfc3339(op.next_action_at_us),
        "remote_job_id": op.remote_job_id,
    }
    if as_json:
        _emit_json(doc)
    else:
        click.echo(f"{op.operation_id} is {op.state.value}" + (f": {op.state_reason}" if op.state_reason else ""))
        click.echo(f"next: {doc['next_action']}" + (f" at {doc['at']}" if doc["at"] else ""))
    sys.exit(EXIT_NEEDS_PERSON if op.state is State.NEEDS_ATTENTION else EXIT_OK)


#: states in which waiting is over: an ending, or a person must look
_WAIT_EXIT = {
    State.SUCCEEDED: EXIT_OK,
    State.CANCELLED: EXIT_OK,
    State.NEEDS_ATTENTION: EXIT_NEEDS_PERSON,
    State.CANCELLATION_UNCONFIRMED: EXIT_NEEDS_PERSON,
    State.RESULT_TIMED_OUT: EXIT_NEEDS_PERSON,
}


@cli.command()
@click.argument("operation_id")
@click.option("--timeout", type=click.FloatRange(min=0), default=600, show_default=True, help="Seconds to wait.")
@click.option("--json", "as_json", is_flag=True, help="Print only the final operation object.")
@click.pass_context
def wait(ctx: click.Context, operation_id: str, timeout: float, as_json: bool) -> None:
    """Wait until an operation ends or needs a person (a worker must be running).

    Exit 0 succeeded or cancelled, 1 failed, result unavailable or invalid, or still running at the
    time-out, 3 a person must decide.

    \b
    Example:
      jobtrail wait op_01J9Z3K8Q0W6S8V7D2M1X4C5B6 --timeout 300 --json
    """
    import time

    store = _existing_store(ctx)
    deadline = time.monotonic() + timeout
    op = store.resolve(operation_id)  # an id, or the operation's key
    operation_id = op.operation_id
    live = sys.stdout.isatty() and not as_json
    status = console.status(f"{op.operation_id}: {op.state.value}") if live else None
    if status is not None:
        status.start()
    try:
        while op.state not in SETTLED_STATES and time.monotonic() < deadline:
            time.sleep(0.2)
            op = store.get(operation_id)
            if status is not None:
                status.update(f"{op.operation_id}: {op.state.value} ({op.state_reason or next_action(op)})")
    finally:
        if status is not None:
            status.stop()
    settled = op.state in SETTLED_STATES
    if as_json:
        _emit_json({**op.to_json(), "settled": settled})
    else:
        click.echo(f"{op.operation_id}: {op.state.value}" + (f": {op.state_reason}" if op.state_reason else ""))
    if not settled:
        if not as_json:
            click.echo(f"still {op.state.value} after {timeout:g} s; next: {next_action(op)}", err=True)
        sys.exit(EXIT_NEGATIVE)
    sys.exit(_WAIT_EXIT.get(op.state, EXIT_NEGATIVE))


@cli.group()
def webhooks() -> None:
    """Receive provider webhooks (they only bring a poll forward)."""


@webhooks.command("serve")
@click.option(
    "--provider",
    "provider_files",
    multiple=True,
    envvar="JOBTRAIL_PROVIDERS",
    required=True,
    type=click.Path(dir_okay=False),
    help="Provider file with a [webhooks] table (repeatable).",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8787, show_default=True)
@click.pass_context
def webhooks_serve(ctx: click.Context, provider_files: tuple[str, ...], host: str, port: int) -> None:
    """Serve POST /webhooks/PROVIDER with Standard Webhooks verification.

    \b
    Example:
      jobtrail webhooks serve --provider openai.toml --host 127.0.0.1 --port 8787
    """
    require_extra("webhooks", "jobtrail webhooks serve", "uvicorn", "starlette", "standardwebhooks")
    import uvicorn

    from jobtrail.interfaces.webhooks import webhook_app
    from jobtrail.providers.http import load_provider

    configs = {}
    for path in provider_files:
        adapter = load_provider(path)
        if adapter.config.webhooks is not None:
            configs[adapter.name] = adapter.config.webhooks
    app = webhook_app(_store(ctx), configs)
    click.echo(f"receiving webhooks for {', '.join(sorted(configs))} on http://{host}:{port}/webhooks/<provider>")
    uvicorn.run(app, host=host, port=port, log_level="warning")


@cli.command()
@click.option(
    "--provider",
    "provider_files",
    multiple=True,
    envvar="JOBTRAIL_PROVIDERS",
    required=True,
    type=click.Path(dir_okay=False),
    help="Provider file the agent may use, by name (repeatable).",
)
@click.option("--agent", default="agent", show_default=True, help="Identity recorded as the caller of every job.")
@click.option("--approver", help="Identity recorded as approving every job this server submits.")
@click.option("--with-worker", is_flag=True, help="Also run a worker in this process.")
@click.option("--http", "http_port", type=int, help="Serve streamable HTTP on 127.0.0.1:PORT instead of stdio.")
@click.option(
    "--shared",
    is_flag=True,
    help="Let this agent see, wait on, fetch and cancel every agent's operations (default: only its own).",
)
@click.pass_context
def mcp(
    ctx: click.Context,
    provider_files: tuple[str, ...],
    agent: str,
    approver: str | None,
    with_worker: bool,
    http_port: int | None,
    shared: bool,
) -> None:
    """Serve jobtrail's tools to an agent over the Model Context Protocol (stdio by default).

    The server acts for --agent: its tools list, read, wait on, fetch the results of and cancel
    only the operations that agent submitted; another agent's operation answers like a missing
    one. Start it with --shared to let the agent act on all operations.

    \b
    Example:
      jobtrail --db jobs.db mcp --provider openai.toml --agent research-bot --approver alice --with-worker
    """
    from jobtrail.interfaces.mcp import build_server, serve_stdio
    from jobtrail.runtime.client import AsyncJobtrail
    from jobtrail.runtime.worker import Worker

    jt = AsyncJobtrail(store=_store(ctx), providers=list(provider_files), actor=f"mcp:{agent}")
    server = build_server(jt, agent=agent, approver=approver, shared=shared)

    async def run() -> None:
        runner = Worker(jt.store, dict(jt.providers), worker_id=f"mcp:{agent}") if with_worker else None
        task = asyncio.create_task(runner.run()) if runner else None
        try:
            if http_port is not None:
                await server.run_streamable_http_async(host="127.0.0.1", port=http_port)
            else:
                await serve_stdio(server)
        finally:
            if runner is not None and task is not None:
                runner.stop()
                await task

    asyncio.run(run())


@cli.command()
@click.pass_context
def demo(ctx: click.Context) -> None:
    """Run the classic create failures against a bundled fake provider; no configuration needed.

    The ledger goes to ./jobtrail-demo.db unless --db or JOBTRAIL_DB names one.

    \b
    Example:
      jobtrail demo && jobtrail --db jobtrail-demo.db ops list
    """
    from jobtrail.interfaces.demo import run_demo

    ok = run_demo(ctx.ensure_object(dict).get("db"), console)
    sys.exit(EXIT_OK if ok else EXIT_NEGATIVE)


@ops.command("escalation")
@click.argument("operation_id")
@click.option("--json", "as_json", is_flag=True, help="Print the bundle as an object.")
@click.option("--markdown", is_flag=True, help="Print the bundle as Markdown (for a ticket).")
@click.pass_context
def ops_escalation(ctx: click.Context, operation_id: str, as_json: bool, markdown: bool) -> None:
    """Everything a person needs to chase a job: ids, request history, cancel attempts and answers.

    \b
    Example:
      jobtrail ops escalation op_01J9Z3K8Q0W6S8V7D2M1X4C5B6 --markdown > ticket.md
    """
    from jobtrail.flows.escalation import bundle_markdown, escalation_bundle

    bundle = escalation_bundle(_existing_store(ctx), operation_id)
    if as_json:
        _emit_json(bundle)
    else:
        click.echo(bundle_markdown(bundle), nl=False)


@cli.command()
@click.argument("operation_id")
@click.option("--reason", required=True, help="Why (kept in the history).")
@click.option("--by", "requested_by", required=True, help="Who asks (kept in the history).")
@click.option("--expect", "expected_effect", default="", help="What you expect the cancel to achieve.")
@click.option("--json", "as_json", is_flag=True, help="Print {outcome, message, operation}.")
@click.pass_context
def cancel(
    ctx: click.Context, operation_id: str, reason: str, requested_by: str, expected_effect: str, as_json: bool
) -> None:
    """Ask to stop a job. The intent is recorded first; a worker sends the cancel once and confirms it.

    Exit 0 recorded, 1 the job had already ended.

    \b
    Example:
      jobtrail cancel op_01J9Z3K8Q0W6S8V7D2M1X4C5B6 --by alice --reason "wrong input file"
    """
    from jobtrail.flows.cancel import request_cancel

    store = _store(ctx)
    operation_id = store.resolve(operation_id).operation_id  # an id, or the operation's key
    done = request_cancel(
        store, operation_id, requested_by=requested_by, reason=reason, expected_effect=expected_effect
    )
    if as_json:
        _emit_json({"outcome": done.outcome, "message": done.message, "operation": done.operation.to_json()})
    else:
        click.echo(f"{done.operation.operation_id}: {done.message}")
    sys.exit(EXIT_NEGATIVE if done.outcome == "already_ended" else EXIT_OK)


@cli.command()
@click.argument("operation_id")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the result here (default: standard output).")
@click.option("--force", is_flag=True, help="Replace an existing --out file (never one of the ledger's own files).")
@click.option("--json", "as_json", is_flag=True, help="Print the result's record (sha256, size, checks, summary).")
@click.pass_context
def result(ctx: click.Context, operation_id: str, out: str | None, force: bool, as_json: bool) -> None:
    """Write an operation's stored result, verified against its sha256, or say why there is none.

    --out refuses an existing file unless --force, never writes the ledger's own files (database,
    -wal, -shm, results directory), writes atomically and replaces a symlink rather than following it.
    Exit 0 written, 1 no result (the reason is printed), 2 the --out target was refused.

    \b
    Example:
      jobtrail result op_01J9Z3K8Q0W6S8V7D2M1X4C5B6 --out result.json
    """
    from jobtrail.domain.results import ResultMissing, describe
    from jobtrail.ledger.results import read_result

    store = _existing_store(ctx)
    with contextlib.suppress(OperationNotFound):  # a missing one is read_result's to explain
        operation_id = store.resolve(operation_id).operation_id  # an id, or the operation's key
    try:
        row, data = read_result(store, operation_id)
    except ResultMissing as exc:
        if as_json:
            _emit_json({"operation_id": operation_id, "result": None, "why": str(exc)})
            sys.exit(EXIT_NEGATIVE)
        _fail(str(exc), EXIT_NEGATIVE)
    if out:
        _write_result(_result_target(store, out, force), data, force)
    if as_json:
        _emit_json(describe(row) | {"out": out})
    elif not out:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()


def _ledger_files(store: Store) -> tuple[list[Path], Path]:
    """The ledger's own files (a SQLite database and its journals) and its results directory."""
    from jobtrail.ledger.files import data_dir

    files: list[Path] = []
    database = store.engine.url.database if store.dialect == "sqlite" else None
    if database and database != ":memory:":
        db = Path(database).resolve()
        files = [db, *(db.with_name(db.name + suffix) for suffix in ("-wal", "-shm", "-journal"))]
    return files, data_dir(store).resolve()


def _result_target(store: Store, out: str, force: bool) -> Path:
    """Where --out may write, checked before anything is read or written."""
    given = Path(out).expanduser()
    # the parent resolved, the name not: a symlink at the target is replaced, never followed
    target = given.absolute().parent.resolve() / given.name
    files, results_dir = _ledger_files(store)
    own = target in files or target == results_dir or results_dir in target.parents
    if not own and os.path.lexists(target) and not target.is_symlink():
        own = any(f.exists() and os.path.samefile(target, f) for f in files)
    if own:
        _fail(f"--out {out} is one of the ledger's own files; write the result somewhere else", EXIT_USAGE)
    if os.path.lexists(target) and not force:
        _fail(f"--out {out} already exists; pass --force to replace it, or choose another path", EXIT_USAGE)
    if os.path.isdir(target) and not target.is_symlink():
        _fail(f"--out {out} is a directory; name a file", EXIT_USAGE)
    if not target.parent.is_dir():
        _fail(f"--out {out}: the directory {target.parent} does not exist", EXIT_USAGE)
    return target


def _write_result(target: Path, data: bytes, force: bool) -> None:
    """Atomically: a temporary file beside the target, then a rename (or a link that refuses to clobber)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if force:
            os.replace(tmp, target)  # replaces a symlink itself, not what it points at
        else:
            try:
                os.link(tmp, target)  # fails if something appeared there meanwhile
            except FileExistsError:
                _fail(f"--out {target} appeared while writing; pass --force to replace it", EXIT_USAGE)
    finally:
        Path(tmp).unlink(missing_ok=True)


# -- audit -------------------------------------------------------------------------


@cli.group()
def audit() -> None:
    """Check the tamper-evident history and export anchors."""


def _key_from_env(name: str | None) -> Secret | None:
    if name is None:
        return None
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"--key-env {name}: the environment variable {name} is not set")
    return Secret(value)


@audit.command("verify")
@click.option("--anchor", "anchor_path", type=click.Path(dir_okay=False), help="Anchor file to check against.")
@click.option("--key-env", metavar="NAME", help="Environment variable holding the anchor's HMAC key.")
@click.option("--json", "as_json", is_flag=True, help="Print {ok, checked, head, first_bad, findings}.")
@click.pass_context
def audit_verify(ctx: click.Context, anchor_path: str | None, key_env: str | None, as_json: bool) -> None:
    """Verify every history chain (and an anchor). Exit 0 ok, 1 tampered, 2 cannot verify.

    \b
    Example:
      jobtrail audit verify --anchor /safe/place/anchor.json --json
    """
    from jobtrail.ledger.audit import load_anchor, verify

    try:
        anchor = load_anchor(anchor_path) if anchor_path else None
        report = verify(_existing_store(ctx), anchor=anchor, key=_key_from_env(key_env))
    except JobtrailError as exc:
        if as_json:
            _emit_json({"ok": None, "error": str(exc)})
            sys.exit(EXIT_USAGE)
        _fail(f"cannot verify: {exc}", EXIT_USAGE)
    if as_json:
        _emit_json(report.to_json())
    elif report.ok:
        click.echo(
            f"OK {report.operations} operations, {report.entries} entries, head {report.root}"
            + (", anchor matches" if report.anchor_checked else "")
        )
    else:
        bad = report.first_bad
        assert bad is not None
        click.echo(f"TAMPERED {bad.kind} at {bad.operation_id} entry {bad.seq}: {bad.detail}")
        for more in report.findings[1:]:
            click.echo(f"  also {more.kind} at {more.operation_id} entry {more.seq}: {more.detail}")
    sys.exit(EXIT_OK if report.ok else EXIT_NEGATIVE)


@audit.command("anchor")
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False),
    required=True,
    help="Where to write the anchor (keep it outside the database's reach); - for stdout.",
)
@click.option("--key-env", metavar="NAME", help="Environment variable holding an HMAC key for the anchor.")
@click.option("--json", "as_json", is_flag=True, help="Print a summary object.")
@click.pass_context
def audit_anchor(ctx: click.Context, out: str, key_env: str | None, as_json: bool) -> None:
    """Export the heads of every chain and their Merkle root.

    \b
    Example:
      JOBTRAIL_ANCHOR_KEY=... jobtrail audit anchor --out /safe/anchor.json --key-env JOBTRAIL_ANCHOR_KEY
    """
    from jobtrail.ledger.audit import make_anchor

    anchor = make_anchor(_existing_store(ctx), key=_key_from_env(key_env), key_name=key_env)
    text = json.dumps(anchor, indent=1, sort_keys=True)
    if out == "-":
        click.echo(text)
    else:
        Path(out).write_text(text + "\n", encoding="utf-8")
    summary = {
        "path": out,
        "root": anchor["root"],
        "operations": anchor["operations"],
        "entries": anchor["entries"],
        "keyed": anchor["hmac"] is not None,
    }
    if as_json and out != "-":
        _emit_json(summary)
    elif out != "-":
        click.echo(f"anchor {anchor['root']} ({anchor['operations']} operations) written to {out}")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``jobtrail`` script."""
    try:
        cli.main(args=argv, prog_name="jobtrail", standalone_mode=True)
    except OperationalError as exc:  # raised while closing the context
        _fail(str(exc), EXIT_USAGE)
