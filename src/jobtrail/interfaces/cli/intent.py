"""What people ask of an operation: ``submit``, ``resolve``, ``cancel``."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import click

from jobtrail.domain.canonical import canonical_bytes, parse_json
from jobtrail.domain.errors import ConfigError, JobtrailError
from jobtrail.domain.explain import next_action
from jobtrail.domain.record import Operation
from jobtrail.domain.states import State
from jobtrail.interfaces.cli.common import (
    EXIT_NEEDS_PERSON,
    EXIT_NEGATIVE,
    EXIT_OK,
    cli,
    emit_json,
    existing_store,
    load_provider_file,
    open_store,
)
from jobtrail.runtime.loop import run as run_loop

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
        body = parse_json(text)
    except ValueError as exc:
        raise ConfigError(f"--request is not valid JSON ({exc}); pass JSON text or @path/to/file.json") from None
    try:
        canonical_bytes(body)  # (checked with the other arguments, before the provider's credential is looked at)
    except UnicodeEncodeError:
        raise ConfigError(
            "--request holds text that is not valid Unicode (an escape such as \\ud800, half of a character): "
            "nothing was recorded; fix the text and submit again"
        ) from None
    return body


_EXIT_FOR_STATE = {State.FAILED: EXIT_NEGATIVE, State.NEEDS_ATTENTION: EXIT_NEEDS_PERSON}


def _say_retrying(where: str) -> Callable[[Operation, float], None]:
    """A create that is being tried again (nothing answered: the provider is not running, say) is said on
    stderr at each attempt, not waited out in silence until its create deadline."""

    def say(op: Operation, _seconds: float) -> None:
        deadline = op.create_deadline
        until = f"until its create deadline ({deadline:%Y-%m-%d %H:%M:%S} UTC)" if deadline else "without end"
        click.echo(
            f"jobtrail: {op.operation_id}: {op.state_reason or 'not created yet'} (provider {where}). This waits "
            f"{until}; Ctrl-C stops waiting, and the operation stays recorded for `jobtrail worker` to send",
            err=True,
        )

    return say


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
    help="JSON lines: {event: submitted, operation_id, state, created} first, then {event: create_finished} "
    "with the operation and created.",
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
    from jobtrail.providers.http import HttpProvider
    from jobtrail.runtime.client import AsyncJobtrail

    body = _request(request_text)
    # the provider file is read before the ledger is opened: a typo in --provider leaves no new, empty ledger behind
    adapter = load_provider_file(provider_file)
    if not no_send and isinstance(adapter, HttpProvider) and adapter.config.credential is not None:
        # a credential that cannot be read fails the create before it leaves, yet after its attempt was
        # recorded: the worker then takes it for a create that may have arrived. Said before anything is recorded.
        try:
            adapter.config.credential.resolve(adapter.redactor)
        except JobtrailError as exc:
            raise ConfigError(
                f"{provider_file}: {exc}; nothing was recorded. Make the credential available and submit again, "
                "or give --no-send to record the operation for a worker that has it"
            ) from None
    jt = AsyncJobtrail(store=open_store(ctx), providers=[adapter], actor=f"cli:{caller}", lease_s=lease_s)
    provider = next(iter(jt.providers))

    async def run() -> tuple[Operation, bool]:
        try:
            op, created = await jt.ensure(
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
                submitted = {"event": "submitted", "operation_id": op.operation_id, "state": op.state.value}
                click.echo(json.dumps(submitted | {"created": created}))
            else:
                click.echo(op.operation_id)
                if not created:
                    click.echo(f"(already there: key {key!r} with this request; nothing new is created)", err=True)
            sys.stdout.flush()
            if not no_send:
                adapter = jt.providers[provider]
                where = f"{provider}, {adapter.config.base_url}" if isinstance(adapter, HttpProvider) else provider
                op = await jt.drive_create(op.operation_id, retrying=_say_retrying(where))
            return op, created
        finally:
            for adapter in jt.providers.values():
                await adapter.aclose()

    op, created = run_loop(run())  # (a Ctrl-C that a library swallowed still stops it)
    if as_json:
        click.echo(json.dumps({"event": "create_finished", **op.to_json(), "created": created}, sort_keys=True))
    elif not no_send:
        line = f"{op.state.value}"
        if op.remote_job_id:
            line += f" remote job {op.remote_job_id}"
        if op.state_reason:
            line += f": {op.state_reason}"
        click.echo(line)
    sys.exit(_EXIT_FOR_STATE.get(op.state, EXIT_OK))


@cli.command()
@click.argument("operation_id")
@click.option(
    "--to",
    "to_state",
    required=True,
    type=click.Choice(["accepted", "create_pending", "failed", "cancelled"]),  # flows.resolve.DECISIONS
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
    from jobtrail.flows.resolve import decide

    moved = decide(existing_store(ctx), operation_id, to_state, decided_by=decided_by, reason=reason, job_id=job_id)
    if as_json:
        emit_json(moved.to_json())
    else:
        click.echo(f"{moved.operation_id}: {moved.state.value}; next: {next_action(moved)}")


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

    Exit 0 recorded, 1 the job had already ended, 3 a person must decide (needs_attention,
    cancellation_unconfirmed, result_timed_out: the cancel is recorded, nothing is sent).

    \b
    Example:
      jobtrail cancel op_01J9Z3K8Q0W6S8V7D2M1X4C5B6 --by alice --reason "wrong input file"
    """
    from jobtrail.domain.explain import PERSON_DECIDES
    from jobtrail.flows.cancel import request_cancel

    store = existing_store(ctx)
    operation_id = store.resolve(operation_id).operation_id  # an id, or the operation's key
    done = request_cancel(
        store, operation_id, requested_by=requested_by, reason=reason, expected_effect=expected_effect
    )
    if as_json:
        emit_json({"outcome": done.outcome, "message": done.message, "operation": done.operation.to_json()})
    else:
        click.echo(f"{done.operation.operation_id}: {done.message}")
    if done.operation.state in PERSON_DECIDES:
        # not an ending: the remote job may still run, and only a person can settle it (exit 3, as explain)
        click.echo(
            f"jobtrail: {done.operation.operation_id} is {done.operation.state.value}: the cancel is recorded; "
            f"see `{store.command} ops escalation {done.operation.operation_id}` and decide with "
            f"`{store.command} resolve`",
            err=True,
        )
        sys.exit(EXIT_NEEDS_PERSON)
    sys.exit(EXIT_NEGATIVE if done.outcome == "already_ended" else EXIT_OK)
