"""Long-running processes: ``worker``, ``webhooks serve``, ``mcp``, ``demo``."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import click

from jobtrail.domain.errors import require_extra
from jobtrail.interfaces.cli.common import (
    EXIT_NEGATIVE,
    EXIT_OK,
    EXIT_STILL_RUNNING,
    cli,
    console,
    emit_json,
    load_provider_file,
    log_options,
    notice,
    open_store,
)
from jobtrail.runtime.loop import run as run_loop

#: past a webhook body's read_timeout_s, how long its 408 has to be read before the connection is closed
_ANSWER_READ_S = 5.0


@cli.command()
@log_options
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
    default=None,
    help="Seconds a claim lasts; must exceed the slowest provider call (default: 60, or twice the slowest "
    "call when that is longer).",
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
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Serve Prometheus metrics on http://HOST:PORT/metrics (needs the otel extra).",
)
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Address of --metrics-port.")
@click.option(
    "--writes-in-process",
    is_flag=True,
    help="Prepare and commit writes in this process, not in a writer process beside it: less CPU per "
    "operation, fewer a second; for hosts that run several workers per core.",
)
@click.pass_context
def worker(
    ctx: click.Context,
    provider_files: tuple[str, ...],
    concurrency: int,
    lease_s: float | None,
    until_settled: bool,
    timeout: float | None,
    worker_id: str | None,
    as_json: bool,
    metrics_port: int | None,
    metrics_host: str,
    writes_in_process: bool,
) -> None:
    """Claim due operations under a lease and do each one's next action.

    SIGTERM or SIGINT: stop claiming, finish in-flight actions, release leases, exit 0.
    On a terminal it shows operations by state and actions per second; it prints a summary at exit.

    \b
    Example:
      jobtrail --db postgresql://jobs@db/jobs worker --provider examples/openai-batch.toml --concurrency 2000
    """
    import signal

    from rich.console import Console

    from jobtrail.interfaces.progress import WorkerProgress
    from jobtrail.runtime.worker import Worker

    metrics_server = None
    if metrics_port is not None:
        from jobtrail.interfaces.prometheus import serve_metrics

        metrics_server = serve_metrics(metrics_host, metrics_port)
    adapters = {}
    for path in provider_files:
        adapter = load_provider_file(path)
        adapters[adapter.name] = adapter
    runner = Worker(
        open_store(ctx),
        adapters,
        worker_id=worker_id,
        concurrency=concurrency,
        lease_s=lease_s,
        writer_process=not writes_in_process,
    )
    progress = WorkerProgress(runner, Console(stderr=True))

    async def run() -> Any:
        from jobtrail.interfaces.early import early_signals

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runner.stop)
        if early_signals:  # asked to stop while still starting: claim nothing, exit cleanly
            runner.stop()
        display = asyncio.create_task(progress.watch())
        try:
            return await runner.run(until_settled=until_settled, timeout=timeout)
        finally:
            display.cancel()
            await asyncio.gather(display, return_exceptions=True)

    try:
        stats = run_loop(run())
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
    progress.summary(stats)
    if as_json:
        emit_json(
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
    if until_settled and not stats.settled and not runner.stopped:
        notice(
            f"--timeout {timeout or 0:g} s ran out with operations still to act on; run the worker "
            "again (or longer), and see `jobtrail ops list` for what is left"
        )
        sys.exit(EXIT_STILL_RUNNING)


@cli.group()
def webhooks() -> None:
    """Receive provider webhooks (they only bring a poll forward)."""


@webhooks.command("serve")
@log_options
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
      jobtrail webhooks serve --provider my-api.toml --host 127.0.0.1 --port 8787
    """
    require_extra("webhooks", "jobtrail webhooks serve", "uvicorn", "starlette", "standardwebhooks")
    from jobtrail.interfaces.served import serve
    from jobtrail.interfaces.webhooks import webhook_app

    configs = {}
    for path in provider_files:
        adapter = load_provider_file(path)
        if adapter.config.webhooks is not None:
            configs[adapter.name] = adapter.config.webhooks
    app = webhook_app(open_store(ctx), configs)
    click.echo(f"receiving webhooks for {', '.join(sorted(configs))} on http://{host}:{port}/webhooks/<provider>")
    # log_config None: uvicorn's lines go through our handler (redacted, as --log-format asks)
    # a delivery's body within the provider's read_timeout_s of its headers (the receiver answers 408 then), and a
    # few seconds for that answer to be read before a body still coming has its connection closed
    body_s = max((c.read_timeout_s for c in configs.values()), default=0.0) + _ANSWER_READ_S
    serve(app, host=host, port=port, body_s=body_s, log_level="warning", log_config=None)


@cli.command()
@log_options
@click.option(
    "--provider",
    "provider_files",
    multiple=True,
    envvar="JOBTRAIL_PROVIDERS",
    required=True,
    type=click.Path(dir_okay=False),
    help="Provider file the agent may use, by name (repeatable).",
)
@click.option(
    "--agent",
    default="agent",
    show_default=True,
    help="Identity recorded as the caller of every job (no '/': it keeps each agent's operation keys apart).",
)
@click.option("--approver", help="Identity recorded as approving every job this server submits.")
@click.option("--with-worker", is_flag=True, help="Also run a worker in this process.")
@click.option(
    "--http",
    "http_port",
    type=int,
    help="Serve streamable HTTP on 127.0.0.1:PORT instead of stdio. It has no authentication: every local "
    "process and user can call the tools as --agent (see the README).",
)
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
      jobtrail --db jobs.db mcp --provider examples/openai-batch.toml --agent bot --approver alice --with-worker
    """
    import logging

    from jobtrail.interfaces.logs import json_lines
    from jobtrail.interfaces.mcp import build_server, check_agent, guarded_http_app, serve_stdio
    from jobtrail.runtime.client import AsyncJobtrail
    from jobtrail.runtime.worker import Worker

    check_agent(agent, approver)  # before the ledger is opened (or made) for a server that cannot start
    adapters = [load_provider_file(path) for path in provider_files]  # (a typo in one makes no ledger either)
    jt = AsyncJobtrail(store=open_store(ctx), providers=adapters, actor=f"mcp:{agent}")
    server = build_server(jt, agent=agent, approver=approver, shared=shared)

    async def run() -> None:
        runner = Worker(jt.store, dict(jt.providers), worker_id=f"mcp:{agent}") if with_worker else None
        task = asyncio.create_task(runner.run()) if runner else None
        try:
            if http_port is not None:
                from jobtrail.interfaces.served import serve_async

                # log_config None: uvicorn's lines go through our handler (redacted, as --log-format asks)
                app = guarded_http_app(server)
                where = f"MCP over streamable HTTP on http://127.0.0.1:{http_port}/mcp"
                if json_lines():  # stderr holds JSON lines only
                    logging.getLogger("jobtrail").info(where)
                else:
                    click.echo(where, err=True)
                await serve_async(app, host="127.0.0.1", port=http_port, log_level="warning", log_config=None)
            else:
                await serve_stdio(server)
        finally:
            if runner is not None and task is not None:
                runner.stop()
                await task
            # the providers' HTTP sessions (a create this server sent itself opened one), closed on this
            # loop: left to the garbage collector, each was an "Unclosed client session" error at exit
            await jt.aclose()

    run_loop(run())


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
