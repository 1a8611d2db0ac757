"""Reading operations: ``ops list|show|history|escalation``, ``explain``, ``wait``."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape
from rich.table import Column, Table
from rich.text import Text

from jobtrail.domain.canonical import rfc3339
from jobtrail.domain.errors import OperationNotFound
from jobtrail.domain.explain import PERSON_DECIDES, next_action
from jobtrail.domain.states import FINAL_STATES, SETTLED_STATES, State

if TYPE_CHECKING:
    from jobtrail.domain.record import Operation
    from jobtrail.ledger.store import Store
from jobtrail.interfaces.cli.common import (
    EXIT_NEEDS_PERSON,
    EXIT_NEGATIVE,
    EXIT_OK,
    EXIT_STILL_RUNNING,
    cli,
    console,
    emit_json,
    existing_store,
    print_whole,
)


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
@click.option(
    "--json", "as_json", is_flag=True, help="Print {count, total, items}: the operation objects, and how many match."
)
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
    store = existing_store(ctx)
    filters: dict[str, Any] = {"state": states or None, "provider": provider, "caller": caller, "key": key}
    operations = store.list_operations(limit=limit, **filters)
    total = store.count_operations(**filters) if len(operations) == limit else len(operations)
    if total > limit:
        click.echo(f"showing the newest {limit} of {total} operations; raise --limit to see more", err=True)
    _say_when_no_worker_serves(store, operations)
    if not operations and provider:
        _say_which_providers(store, provider)
    if as_json:
        emit_json({"count": len(operations), "total": total, "items": [op.to_json() for op in operations]})
        return
    if not operations:  # (an empty table's header says nothing more)
        console.print("no operations" + (" match these filters" if any(filters.values()) else " in this ledger"))
        return
    _print_operations(operations)


def _say_which_providers(store: Store, asked: str) -> None:
    """An empty list filtered by a provider no operation uses: which names there are (the filter takes a
    provider's name, where every other --provider takes its file)."""
    from jobtrail.ledger.browse import providers_in_use

    names = providers_in_use(store)
    if asked in names:
        return
    hint = f"no operation in this ledger uses a provider named {asked!r}"
    hint += f" (the names in use: {', '.join(names)})" if names else ""
    if asked.endswith((".toml", ".json")) or os.sep in asked:
        hint += "; ops list --provider takes a provider's name (its file's `name`), not its file"
    click.echo(f"jobtrail: {hint}", err=True)


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

    store = existing_store(ctx)
    op = store.resolve(operation_id)  # an id, or the operation's key
    operation_id = op.operation_id
    result = stored_result(store, operation_id)
    doc = op.to_json()
    doc["result"] = None if result is None else describe(result)
    if as_json:
        emit_json(doc)
        return
    summary = result["summary"] if result else None
    if summary and summary.get("failed"):
        # the ids are the provider's: as Text, never read as Rich markup (a link, a colour, a closing tag)
        console.print(
            Text.assemble(
                ("partial failure:", "yellow"),
                f" {summary['failed']} of {summary['items']} items failed: "
                + ", ".join(str(i) for i in summary["failed_ids"][:20])
                + (" ..." if summary["failed"] > 20 else ""),
            )
        )
    # on a terminal a long value folds onto the next lines; it is never cut (a fingerprint, a reason)
    table = Table(Column(no_wrap=True), Column(overflow="fold"), show_header=False)
    for key, value in doc.items():
        # as Text: a provider's words or a caller's key in brackets are shown, never read as Rich markup
        table.add_row(key, Text(json.dumps(value) if isinstance(value, dict) else str(value)))
    print_whole(table)


@ops.command("history")
@click.argument("operation_id")
@click.option("--json", "as_json", is_flag=True, help="Print {count, total, items}: the history entries.")
@click.pass_context
def ops_history(ctx: click.Context, operation_id: str, as_json: bool) -> None:
    """Show every recorded transition and action of one operation, oldest first.

    \b
    Example:
      jobtrail ops history op_01J9Z3K8Q0W6S8V7D2M1X4C5B6
    """
    store = existing_store(ctx)
    operation_id = store.resolve(operation_id).operation_id  # an id, or the operation's key
    entries = store.history(operation_id)
    if as_json:
        emit_json({"count": len(entries), "total": len(entries), "items": [e.to_json() for e in entries]})
        return
    # on a narrow terminal: each state whole (the "from" of an entry is the "to" above it, so it goes),
    # the time of day, actor and cause cut to fit; wide, or into a pipe: everything
    wide = console.width >= 120 or not console.is_terminal
    if wide:
        table = Table("seq", "at", "actor", "from", "to", "cause", "hash")
        for e in entries:
            table.add_row(
                str(e.seq), rfc3339(e.at_us), Text(e.actor), e.from_state or "-", e.to_state, e.cause, e.entry_hash[:12]
            )
    else:
        to = max([2, *(len(e.to_state) for e in entries)])
        table = Table(
            Column("seq", no_wrap=True),
            Column("at", no_wrap=True),
            Column("actor", no_wrap=True, overflow="ellipsis", ratio=1),
            Column("to", no_wrap=True, min_width=to),
            Column("cause", no_wrap=True, overflow="ellipsis", ratio=2),
        )
        for e in entries:
            table.add_row(str(e.seq), (rfc3339(e.at_us) or "")[11:19], Text(e.actor), e.to_state, e.cause)
    print_whole(table)


@cli.command()
@click.argument("operation_id")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the operation with last_observed_at, progress, no_worker and cancel (a task: its steps).",
)
@click.pass_context
def explain(ctx: click.Context, operation_id: str, as_json: bool) -> None:
    """Say where an operation (or a task and each of its steps) stands, why, and the one next action.

    Exit 0 answered, 1 no such operation or task, 3 a person must decide (needs_attention,
    cancellation_unconfirmed, result_timed_out; for a task: any step unresolved or in one of those).

    \b
    Example:
      jobtrail explain op_01J9Z3K8Q0W6S8V7D2M1X4C5B6
    """
    store = existing_store(ctx)
    if not operation_id.startswith("op_") and _explain_task(store, operation_id, as_json):
        return
    try:
        op = store.resolve(operation_id)  # an id, or the operation's key
    except OperationNotFound:
        raise OperationNotFound(
            f"no operation or task {operation_id!r}; list operations with `jobtrail ops list`",
            operation_id=operation_id,
        ) from None
    from jobtrail.interfaces.answers import status_json

    doc = status_json(store, op)
    if as_json:
        emit_json(doc)
    else:
        click.echo(f"{op.operation_id} is {op.state.value}" + (f": {op.state_reason}" if op.state_reason else ""))
        if doc["progress"] is not None and op.state not in FINAL_STATES:
            click.echo(f"progress: {doc['progress']:.0%} (seen at {doc['last_observed_at']})")
        if doc["cancel"] is not None:
            click.echo(f"cancel: {doc['cancel']['says']}")
        click.echo(f"next: {doc['next_action']}" + (f" at {doc['next_action_at']}" if doc["next_action_at"] else ""))
        click.echo(f"advice: {doc['advice']}")
        if doc["no_worker"]:
            click.echo(f"warning: {doc['no_worker']}")
    sys.exit(EXIT_NEEDS_PERSON if op.state in PERSON_DECIDES else EXIT_OK)


def _explain_task(store: Store, task_id: str, as_json: bool) -> bool:
    """``explain TASK_ID``: False when there is no such task (then it may be an operation key)."""
    from jobtrail.runtime.client import AsyncJobtrail
    from jobtrail.runtime.tasks import Task

    explained = Task(AsyncJobtrail(store=store), task_id).explain()
    if not explained["steps"]:
        return False
    if as_json:
        emit_json(explained)
    else:
        click.echo(f"task {task_id}: next step {explained['next_step'] or '-'}: {explained['next_action']}")
        for step in explained["steps"]:
            ending = f", {step['operation_state']}" if step["operation_state"] else ""
            click.echo(
                f"  {step['name']}: {step['state']}{ending} ({step['operation_id'] or 'no operation yet'}): "
                f"{step['next_action']}"
            )
        for why in explained["no_worker"]:
            click.echo(f"warning: {why}")
    person = any(
        step["state"] == "unresolved" or step["operation_state"] in PERSON_DECIDES for step in explained["steps"]
    )
    sys.exit(EXIT_NEEDS_PERSON if person else EXIT_OK)


#: the columns that share what room is left on a terminal (the others are shown whole)
_SHARED = ("operation", "key", "next action")


def _print_operations(operations: list[Operation]) -> None:
    """The table of ``ops list``. On a terminal it fits its width: states whole, the key before the id
    (both are accepted cut short nowhere, so give them room first), the next action on one line, the
    remote job and the date only where there is room. Into a pipe or a file, everything is whole."""
    terminal = console.is_terminal
    wide = console.width >= 120 or not terminal
    rows = [
        (
            op.operation_id,
            op.operation_key or "-",
            op.state.value,
            *([op.remote_job_id or "-"] if wide else []),
            next_action(op),
            _when(op, wide),
        )
        for op in operations
    ]
    headers = ["operation", "key", "state", *(["remote job"] if wide else []), "next action", "at"]
    width = {h: max([len(h), *(len(row[n]) for row in rows)]) for n, h in enumerate(headers)}
    borders = 3 * len(headers) + 1
    if terminal:
        fitted = dict(width)
        if wide:
            width["remote job"] = min(fitted["remote job"], 24)
        room = console.width - borders - sum(w for h, w in width.items() if h not in _SHARED)
        width["key"] = min(fitted["key"], max(10, room - 10 - 5))
        width["operation"] = min(fitted["operation"], max(10, room - width["key"] - 5))
        width["next action"] = min(fitted["next action"], max(5, room - width["key"] - width["operation"]))
    table = Table(*(Column(h, width=width[h], no_wrap=True, overflow="ellipsis") for h in headers))
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    print_whole(table)  # as wide as the table is, whatever COLUMNS says: a pipe or a file gets every character


def _when(op: Operation, wide: bool) -> str:
    if op.state in FINAL_STATES:
        return "-"
    at = rfc3339(op.next_action_at_us)
    if at is None:
        return "a person"
    return at if wide else at[11:19]  # the time of day: the date when there is room


def _say_when_no_worker_serves(store: Store, operations: list[Operation]) -> None:
    """One stderr line per provider whose listed operations wait, overdue, for a worker that is not running."""
    from jobtrail.runtime.liveness import no_worker, overdue

    late: dict[str, list[Operation]] = {}
    for op in operations:
        if overdue(store, op):
            late.setdefault(op.provider, []).append(op)
    for provider, ops in late.items():
        if no_worker(store, ops[0]):
            click.echo(
                f"jobtrail: {len(ops)} listed operation(s) of provider {provider} are overdue and no worker is "
                f"running for it; start one: {store.command} worker --provider <its provider file>",
                err=True,
            )


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
@click.option(
    "--json", "as_json", is_flag=True, help="Print the final status (as explain --json) with changed and settled."
)
@click.pass_context
def wait(ctx: click.Context, operation_id: str, timeout: float, as_json: bool) -> None:
    """Wait until an operation ends or needs a person (a worker must be running).

    Exit 0 succeeded or cancelled, 1 failed, result unavailable or invalid, 3 a person must decide,
    4 still running at the time-out.

    \b
    Example:
      jobtrail wait op_01J9Z3K8Q0W6S8V7D2M1X4C5B6 --timeout 300 --json
    """
    import time

    store = existing_store(ctx)
    deadline = time.monotonic() + timeout
    op = store.resolve(operation_id)  # an id, or the operation's key
    operation_id, start = op.operation_id, op.state
    live = sys.stdout.isatty() and not as_json
    status = console.status(f"{op.operation_id}: {op.state.value}") if live else None
    if status is not None:
        status.start()
    from jobtrail.runtime.liveness import no_worker

    told = False  # that no worker serves it: said once, as soon as it is so, not after the whole time-out
    try:
        while op.state not in SETTLED_STATES and time.monotonic() < deadline:
            if not told and (missing := no_worker(store, op)):
                told = True
                if status is not None:
                    status.stop()
                click.echo(f"jobtrail: {missing}; still waiting (Ctrl-C stops)", err=True)
                if status is not None:
                    status.start()
            time.sleep(0.2)
            op = store.get(operation_id)
            if status is not None:
                status.update(escape(f"{op.operation_id}: {op.state.value} ({op.state_reason or next_action(op)})"))
    finally:
        if status is not None:
            status.stop()
    settled = op.state in SETTLED_STATES
    if as_json:
        from jobtrail.interfaces.answers import status_json, wait_json

        emit_json(wait_json(status_json(store, op), changed=op.state is not start, settled=settled))
    else:
        click.echo(f"{op.operation_id}: {op.state.value}" + (f": {op.state_reason}" if op.state_reason else ""))
    if not settled:
        if not as_json:
            click.echo(f"still {op.state.value} after {timeout:g} s; next: {next_action(op)}", err=True)
        missing = None if told else no_worker(store, op)  # (said already while it waited: not twice)
        if missing:
            click.echo(f"jobtrail: {missing}", err=True)
        sys.exit(EXIT_STILL_RUNNING)
    sys.exit(_WAIT_EXIT.get(op.state, EXIT_NEGATIVE))


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

    bundle = escalation_bundle(existing_store(ctx), operation_id)
    if as_json:
        emit_json(bundle)
    else:
        click.echo(bundle_markdown(bundle), nl=False)
