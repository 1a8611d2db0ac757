"""``result``: an operation's stored result, verified, to standard output or a file."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from jobtrail.domain.errors import OperationNotFound

if TYPE_CHECKING:  # the ledger (SQLAlchemy) is imported by the commands that use it: --help stays quick
    from jobtrail.ledger.store import Store
from jobtrail.interfaces.cli.common import EXIT_NEGATIVE, EXIT_USAGE, cli, emit_json, existing_store, fail


@cli.command()
@click.argument("operation_id")
@click.option("--out", type=click.Path(dir_okay=False), help="Write the result here (default: standard output).")
@click.option("--force", is_flag=True, help="Replace an existing --out file (never one of the ledger's own files).")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the record (sha256, size, checks, summary) and the content (result, result_text or "
    "result_base64; a note past 64 KiB), or {result: null, why}.",
)
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
    from jobtrail.domain.results import ResultMissing
    from jobtrail.interfaces.answers import result_found, result_missing
    from jobtrail.ledger.results import read_result

    store = existing_store(ctx)
    with contextlib.suppress(OperationNotFound):  # a missing one is read_result's to explain
        operation_id = store.resolve(operation_id).operation_id  # an id, or the operation's key
    try:
        row, data = read_result(store, operation_id)
    except ResultMissing as exc:
        if as_json:
            emit_json(result_missing(operation_id, str(exc)))
            sys.exit(EXIT_NEGATIVE)
        fail(str(exc), EXIT_NEGATIVE)
    if out:
        target = _result_target(store, out, force)
        _write_result(target, data, force)
        if not as_json:  # said where it went (stdout stays empty, as a script expects of --out)
            click.echo(f"wrote {len(data)} bytes (sha256 {row['sha256']}) to {target}", err=True)
    if as_json:
        emit_json(result_found(row, data, store.command, out=out))
    elif not out:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()


def _result_target(store: Store, out: str, force: bool) -> Path:
    """Where --out may write, checked before anything is read or written."""
    from jobtrail.ledger.files import ledger_files

    given = Path(out).expanduser()
    # the parent resolved, the name not: a symlink at the target is replaced, never followed
    target = given.absolute().parent.resolve() / given.name
    files, results_dir = ledger_files(store)
    own = target in files or target == results_dir or results_dir in target.parents
    if not own and os.path.lexists(target) and not target.is_symlink():
        own = any(f.exists() and os.path.samefile(target, f) for f in files)
    if own:
        fail(f"--out {out} is one of the ledger's own files; write the result somewhere else", EXIT_USAGE)
    if os.path.lexists(target) and not force:
        fail(f"--out {out} already exists; pass --force to replace it, or choose another path", EXIT_USAGE)
    if os.path.isdir(target) and not target.is_symlink():
        fail(f"--out {out} is a directory; name a file", EXIT_USAGE)
    if not target.parent.is_dir():
        fail(f"--out {out}: the directory {target.parent} does not exist", EXIT_USAGE)
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
                fail(f"--out {target} appeared while writing; pass --force to replace it", EXIT_USAGE)
    finally:
        Path(tmp).unlink(missing_ok=True)
