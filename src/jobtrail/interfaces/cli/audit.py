"""``audit verify|anchor``: the tamper-evident history."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from jobtrail.domain.errors import JobtrailError
from jobtrail.interfaces.cli.common import (
    EXIT_NEGATIVE,
    EXIT_OK,
    EXIT_USAGE,
    cli,
    emit_json,
    existing_store,
    fail,
    secret_from_env,
)


@cli.group()
def audit() -> None:
    """Check the tamper-evident history and export anchors."""


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
        store = existing_store(ctx)
        report = verify(store, anchor=anchor, key=secret_from_env(key_env, "--key-env", store.redactor))
    except JobtrailError as exc:  # (under --json, the one error shape every command prints)
        fail(f"cannot verify: {exc}", EXIT_USAGE)
    if as_json:
        emit_json(report.to_json())
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
@click.option("--force", is_flag=True, help="Replace an anchor already at --out.")
@click.option("--json", "as_json", is_flag=True, help="Print a summary object.")
@click.pass_context
def audit_anchor(ctx: click.Context, out: str, key_env: str | None, force: bool, as_json: bool) -> None:
    """Export the heads of every chain and their Merkle root.

    \b
    Example:
      JOBTRAIL_ANCHOR_KEY=... jobtrail audit anchor --out /safe/anchor.json --key-env JOBTRAIL_ANCHOR_KEY
    """
    from jobtrail.ledger.audit import make_anchor

    if out != "-" and not Path(out).absolute().parent.is_dir():  # said before the ledger is read through
        fail(f"--out {out}: the directory {Path(out).absolute().parent} does not exist; create it first", EXIT_USAGE)
    if out != "-" and Path(out).exists() and not force:
        # an anchor is the evidence of what the ledger held then: a new one beside it, never over it by accident
        fail(
            f"--out {out}: an anchor is already there (the evidence of an earlier state); write the new one "
            "beside it (a name per day, say), or give --force to replace it",
            EXIT_USAGE,
        )
    store = existing_store(ctx)
    anchor = make_anchor(store, key=secret_from_env(key_env, "--key-env", store.redactor), key_name=key_env)
    text = json.dumps(anchor, indent=1, sort_keys=True)
    if out == "-":
        click.echo(text)
    else:
        try:
            Path(out).write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            fail(f"--out {out}: the anchor could not be written ({exc.strerror or exc})", EXIT_USAGE)
    summary = {
        "path": out,
        "root": anchor["root"],
        "operations": anchor["operations"],
        "entries": anchor["entries"],
        "keyed": anchor["hmac"] is not None,
    }
    if as_json and out != "-":
        emit_json(summary)
    elif out != "-":
        click.echo(f"anchor {anchor['root']} ({anchor['operations']} operations) written to {out}")
