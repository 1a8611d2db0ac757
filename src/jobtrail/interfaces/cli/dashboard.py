"""``dashboard``: the web pages over the ledger (the ``dashboard`` extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from jobtrail.domain.errors import require_extra
from jobtrail.interfaces.cli.common import cli, existing_store, log_options, secret_from_env

if TYPE_CHECKING:
    pass


@cli.command()
@log_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (keep it local).")
@click.option("--port", type=click.IntRange(1, 65535), default=8790, show_default=True)
@click.option(
    "--token-env",
    metavar="NAME",
    help="Environment variable holding the access token. Without it the pages only read; with it a person "
    "signs in with the token and may record decisions.",
)
@click.option(
    "--provider",
    "provider_files",
    multiple=True,
    envvar="JOBTRAIL_PROVIDERS",
    type=click.Path(dir_okay=False),
    help="Provider file whose guarantees the providers page shows (repeatable).",
)
@click.option(
    "--origin",
    "public_origin",
    metavar="URL",
    help="The origin people use (https://host[:port]) when a TLS proxy in front forwards plain HTTP; "
    "forms from it are accepted.",
)
@click.option("--anchor", "anchor_path", type=click.Path(dir_okay=False), help="Anchor the audit page checks against.")
@click.option("--anchor-key-env", metavar="NAME", help="Environment variable holding the anchor's HMAC key.")
@click.pass_context
def dashboard(
    ctx: click.Context,
    host: str,
    port: int,
    token_env: str | None,
    provider_files: tuple[str, ...],
    anchor_path: str | None,
    anchor_key_env: str | None,
    public_origin: str | None,
) -> None:
    """Serve the dashboard: operations, timelines, the needs-a-person queue, workers, providers, audit.

    \b
    Example:
      jobtrail --db jobs.db dashboard                                        # read-only
      jobtrail --db jobs.db dashboard --token-env JOBTRAIL_DASHBOARD_TOKEN   # people may decide
    """
    require_extra("dashboard", "jobtrail dashboard", "uvicorn", "starlette", "jinja2", "python_multipart")
    from jobtrail.interfaces.dashboard import dashboard_app
    from jobtrail.interfaces.served import serve

    store = existing_store(ctx)
    token = secret_from_env(token_env, "--token-env", store.redactor)
    app = dashboard_app(
        store,
        token=token,
        provider_files=provider_files,
        anchor_path=anchor_path,
        anchor_key=secret_from_env(anchor_key_env, "--anchor-key-env", store.redactor),
        public_origin=public_origin,
    )
    mode = (
        "sign in with the token to record decisions"
        if token is not None
        else "read-only: give --token-env to let people decide"
    )
    click.echo(f"dashboard on http://{host}:{port}/ ({mode})")
    # uvicorn's access log would print every URL; the pages' URLs carry no secret, but its noise helps no one
    # log_config None: uvicorn's lines go through our handler (redacted, as --log-format asks)
    serve(app, host=host, port=port, log_level="warning", access_log=False, log_config=None)
