"""What every command of the ``jobtrail`` command line shares: the root group, exit codes, the store,
one-line errors. Every read command takes ``--json``.

Exit codes: :data:`EXIT_CODES`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import click
from rich.console import Console
from rich.table import Table

from jobtrail.domain.errors import ConfigError, JobtrailError, NoDecisionAwaited, OperationNotFound
from jobtrail.domain.redact import Redactor, Secret, install_log_redaction
from jobtrail.interfaces.argv import hoist_global_options

if TYPE_CHECKING:  # the ledger (SQLAlchemy) is imported by the commands that use it: --help stays quick
    from jobtrail.ledger.store import Store
    from jobtrail.providers.http import HttpProvider


EXIT_OK, EXIT_NEGATIVE, EXIT_USAGE, EXIT_NEEDS_PERSON = 0, 1, 2, 3
#: waiting ran out while the operation (or a worker's operations) still had automatic work ahead
EXIT_STILL_RUNNING = 4
#: stopped by Ctrl-C (SIGINT), as shells count it (128 + 2)
EXIT_INTERRUPTED = 130

#: every exit code and what it means (the README's table is generated from this)
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "ok: the command did what was asked, or answered (explain answers with 0 unless a person must decide)"),
    (
        EXIT_NEGATIVE,
        "a negative answer: not found, rejected or failed, no result, tampered history, the job had already ended",
    ),
    (EXIT_USAGE, "cannot answer: a usage, configuration or storage error (the message says what to fix)"),
    (
        EXIT_NEEDS_PERSON,
        "a person must decide: needs_attention, cancellation_unconfirmed or result_timed_out "
        "(explain, wait, submit; a task with such a step or an unresolved one)",
    ),
    (EXIT_STILL_RUNNING, "still running when the time ran out (wait --timeout, worker --until-settled --timeout)"),
    (
        EXIT_INTERRUPTED,
        "stopped by Ctrl-C: what was recorded stays, and an operation left unfinished is a worker's to carry on",
    ),
)

console = Console()


def print_whole(table: Table) -> None:
    """``table`` on the terminal as it fits there; into a pipe or a file as wide as it needs, so that no
    value is cut short with an ellipsis and each row stays on one line (Rich takes 80 columns there)."""
    if console.is_terminal:
        console.print(table)
        return
    natural = Console(width=1_000_000, highlight=False).measure(table).maximum
    Console(width=natural, highlight=False).print(table)


def _printable(text: str) -> str:
    """``text`` as UTF-8 can carry it: a lone surrogate (an argument that was not UTF-8, a ``\\ud800`` in
    JSON given) as its escape, which JSON reads back as the same character."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def emit_json(doc: Any) -> None:
    click.echo(_printable(json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False)))


def notice(message: str, level: int = logging.WARNING) -> None:
    """One line on stderr, ``jobtrail: message``; under ``--log-format json`` a JSON log line like the others
    (at ``level``): a log read as JSON lines holds nothing else."""
    from jobtrail.interfaces.logs import json_lines, say

    if json_lines():
        say(message, level)
    else:
        click.echo(f"jobtrail: {message}", err=True)


def fail(message: str, code: int) -> NoReturn:
    """One line on stderr and the exit code; under ``--json`` also ``{"error": {...}}`` on stdout."""
    message = _printable(message)
    ctx = click.get_current_context(silent=True)
    if ctx is not None and ctx.find_root().meta.get("jobtrail.json"):
        # one line: a command that prints JSON lines (submit) stays JSON lines when it fails
        click.echo(json.dumps({"error": {"message": message, "exit_code": code}}, ensure_ascii=False))
    notice(message, logging.ERROR)
    sys.exit(code)


class Group(click.Group):
    """Turns our errors into one line and an exit code (tracebacks only with --debug)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if ctx.parent is None:  # the root: global options work after the command too
            args = hoist_global_options(args)
            # an error is JSON too when the command was asked for JSON (its own option is parsed later)
            ctx.meta["jobtrail.json"] = "--json" in args
            ctx.meta["jobtrail.args"] = list(args)
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except JobtrailError as exc:
            if ctx.find_root().params.get("debug"):
                raise
            code = EXIT_NEGATIVE if isinstance(exc, OperationNotFound | NoDecisionAwaited) else EXIT_USAGE
            fail(str(exc), code)
        except UnicodeError:
            if ctx.find_root().params.get("debug"):
                raise
            fail(
                "an argument or the request holds text that is not valid Unicode (bytes that are not UTF-8, or a "
                "lone surrogate such as \\ud800 in JSON): give it as UTF-8 text",
                EXIT_USAGE,
            )
        except click.UsageError as exc:  # a bad option or value: the same one line (and JSON) as ours
            json_logs = _json_logs_asked(exc, ctx.find_root().meta.get("jobtrail.args", []))
            if not ctx.find_root().meta.get("jobtrail.json") and not json_logs:
                raise
            if json_logs:
                # the command never ran, so its logging is not set up yet: a reader of JSON lines on stderr
                # (--log-format json) would otherwise get click's three lines of text
                from jobtrail.interfaces.logs import configure_logging

                configure_logging("info", "json")
            fail(exc.format_message(), EXIT_USAGE)
        except KeyboardInterrupt:
            # (click's own answer is "Aborted!" and exit 1, which the table keeps for a negative answer)
            if ctx.find_root().params.get("debug"):
                raise
            fail(
                "stopped by Ctrl-C. Whatever was recorded stays in the ledger: an operation left unfinished is "
                "carried on by `jobtrail worker`, and `jobtrail ops list` shows where each one is",
                EXIT_INTERRUPTED,
            )
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise  # click's own endings, which it says and exits with itself
        except Exception as exc:
            # a value nothing refused earlier (timeout_s = inf in a provider file, say) or a bug: still one line
            # with the way on, never a traceback the user did not ask for. Masked by the ledger's redactor (it
            # knows the providers' credentials once a command loaded them): an exception's text is foreign
            if ctx.find_root().params.get("debug"):
                raise
            store = ctx.find_root().ensure_object(dict).get("store")
            redactor = store.redactor if store is not None else Redactor()
            fail(
                f"unexpected error ({redactor.text(f'{type(exc).__name__}: {exc}')}). Whatever was recorded stays "
                "in the ledger; check the values given (a provider file's numbers, say), and run the command again "
                "with --debug for the traceback to report",
                EXIT_USAGE,
            )


def _json_logs_asked(exc: click.UsageError, args: list[str]) -> bool:
    """Whether the command a usage error is about writes its log lines as JSON (``--log-format json``, or
    ``JOBTRAIL_LOG_FORMAT=json`` for a command that takes ``--log-format``)."""
    command = exc.ctx.command if exc.ctx is not None else None
    if command is None or not any(param.name == "log_format" for param in command.params):
        return False
    for i, arg in enumerate(args):
        if arg == "--log-format=json" or (arg == "--log-format" and args[i + 1 : i + 2] == ["json"]):
            return True
    given = any(arg.startswith("--log-format") for arg in args)
    return not given and os.environ.get("JOBTRAIL_LOG_FORMAT") == "json"


def open_store(ctx: click.Context, *, create: bool = True) -> Store:
    obj: dict[str, Any] = ctx.ensure_object(dict)
    if "store" not in obj:
        from jobtrail.ledger.store import Store, in_memory

        if in_memory(obj.get("db")):
            # one command is one process: what it recorded would end with it, a job it sent included
            fail(
                "a ledger in memory ends with the command that opened it: nothing it recorded (a job it sent "
                "included) could be followed afterwards. Give --db (or JOBTRAIL_DB) a file or a postgresql:// URL "
                "(`jobtrail demo --db :memory:` alone runs in memory)",
                EXIT_USAGE,
            )
        obj["store"] = Store.open(obj.get("db"), create=create)
        ctx.call_on_close(obj["store"].close)
        if obj["store"].made:
            # a typo in --db makes a new ledger instead of finding the one meant: say so, once, where it is
            from jobtrail.ledger.store import shown_url

            notice(
                f"made a new, empty ledger in {shown_url(obj['store'].engine.url)} (there was none); "
                "if you meant another, check --db or JOBTRAIL_DB"
            )
    store: Store = obj["store"]
    return store


def existing_store(ctx: click.Context) -> Store:
    """For commands that read, or act on an operation already recorded (resolve, cancel): a missing SQLite
    file, or a database without a ledger, is an error, never a fresh empty ledger (where no operation could
    be found anyway); an existing one of an older revision is upgraded, as every command does."""
    return open_store(ctx, create=False)


@click.group(cls=Group)
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
    if db is not None and not db.strip():
        # `--db "$LEDGER"` with the variable unset: silently taking the default ledger would read (or write)
        # one the script never meant
        raise click.BadParameter(
            "it is empty; give a SQLite file path or a postgresql:// URL, or leave --db out for the default "
            "(~/.local/share/jobtrail/jobtrail.db)",
            param_hint="--db",
        )
    ctx.ensure_object(dict)["db"] = db


def log_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--log-level`` and ``--log-format`` for a long-running command (put it under ``@cli.command()``):
    its log lines go to stderr, redacted, each naming the operation and trace it is about."""

    @functools.wraps(command)
    def configured(*args: Any, log_level: str, log_format: str, **kwargs: Any) -> Any:
        from jobtrail.interfaces.logs import configure_logging

        configure_logging(log_level, log_format)
        return command(*args, **kwargs)

    with_format = click.option(
        "--log-format",
        type=click.Choice(["text", "json"]),
        default="text",
        envvar="JOBTRAIL_LOG_FORMAT",
        show_default=True,
        help="Log lines as text, or one JSON object a line (with operation_id and trace_id).",
    )(configured)
    return click.option(
        "--log-level",
        type=click.Choice(["debug", "info", "warning", "error"]),
        default="info",
        envvar="JOBTRAIL_LOG_LEVEL",
        show_default=True,
        help="Least severe log lines written to stderr.",
    )(with_format)


def load_provider_file(path: str) -> HttpProvider:
    """The provider a file declares; a file that is not UTF-8 text (a binary, a file saved as UTF-16) is named
    as the problem, not reported as a bad argument."""
    from jobtrail.providers.http import load_provider

    try:
        return load_provider(path)
    except UnicodeDecodeError:
        raise ConfigError(
            f"{path}: not UTF-8 text; a provider file is TOML saved as UTF-8 (check that --provider names the "
            "provider file, e.g. examples/fake.toml)"
        ) from None


def secret_from_env(name: str | None, option: str, redactor: Redactor) -> Secret | None:
    """The value of environment variable ``name`` (given as ``option NAME``), masked by ``redactor`` (the
    ledger's) from now on; None when no name is given. A secret never goes on a command line."""
    if name is None:
        return None
    value = os.environ.get(name)
    if not value:
        raise ConfigError(f"{option} {name}: the environment variable {name} is not set (or empty)")
    return Secret(value, redactor=redactor)
