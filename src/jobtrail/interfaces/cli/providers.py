"""``providers check``: what a provider file guarantees."""

from __future__ import annotations

import click
from rich.table import Table

from jobtrail.interfaces.cli.common import cli, console, emit_json, load_provider_file


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

    report = guarantees(load_provider_file(provider_file))
    if as_json:
        emit_json(report)
        return
    table = Table("guarantee", "verdict", "why")
    for name, item in report["guarantees"].items():
        table.add_row(name, item["verdict"], item["why"])
    console.print(f"provider {report['provider']} (kind {report['kind']}, {report['base_url']})")
    if report["contract"]:
        console.print(report["contract"])
    console.print(table)
    for warning in report["warnings"]:
        console.print(f"[yellow]warning:[/yellow] {warning}")
