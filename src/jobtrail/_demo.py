"""``jobtrail demo``: the classic create failures against the bundled fake provider, on loopback.

No configuration: a SQLite file in the current directory and fake providers
on 127.0.0.1. Every scenario shows what jobtrail did, what the provider
actually saw, and why the record says what it says.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from jobtrail._audit import verify
from jobtrail._client import AsyncJobtrail
from jobtrail._states import State
from jobtrail._store import Store
from jobtrail.testing import FakeProvider, Fault

DEFAULT_DEMO_DB = "jobtrail-demo.db"


@dataclass(frozen=True)
class Scenario:
    title: str
    faults: tuple[Fault, ...]
    expected: State
    provider: str = "fake"


SCENARIOS = (
    Scenario("clean create", (), State.ACCEPTED),
    Scenario("response lost after commit", (Fault.drop(),), State.ACCEPTED),
    Scenario("503, Retry-After: 1", (Fault.http(503, retry_after="1"),), State.ACCEPTED),
    Scenario("slower than our time-out", (Fault.delay(2.0),), State.ACCEPTED),
    Scenario("synchronous result", (Fault.synchronous(),), State.RESULT_COLLECTING),
    Scenario("request refused (422)", (Fault.reject(422),), State.FAILED),
    Scenario("new job id on replay", (Fault.drop(), Fault.replay_new_id()), State.NEEDS_ATTENTION),
    Scenario(
        "no idempotency, response lost",
        (Fault.drop(),),
        State.NEEDS_ATTENTION,
        provider="fake-no-idempotency",
    ),
)


async def _run(db: str, console: Console) -> bool:
    good = FakeProvider(job_duration_s=1.0).start()
    careless = FakeProvider(job_duration_s=1.0, idempotency=False).start()
    store = Store.open(db)
    jt = AsyncJobtrail(store=store, actor="demo")
    jt.add_provider(
        good.provider_config(
            timeout_s=1.0,
            reconcile={
                "modes": ["replay", "list_by_reference"],
                "list_path": "/v1/jobs?client_reference={token}",
            },
        )
    )
    jt.add_provider(
        careless.provider_config(
            name="fake-no-idempotency", timeout_s=1.0, create={"token": {"in": "none"}}, reconcile=None
        )
    )
    fakes = {"fake": good, "fake-no-idempotency": careless}
    table = Table("#", "scenario", "state", "job", "sent", "jobs", title="creates sent / jobs the provider made")
    reasons: list[str] = []
    all_as_expected = True
    try:
        for number, scenario in enumerate(SCENARIOS, start=1):
            fake = fakes[scenario.provider]
            fake.script(*scenario.faults)
            received_before = fake.counts["creates_received"]
            jobs_before = fake.counts["jobs_created"]
            with console.status(f"[{number}/{len(SCENARIOS)}] {scenario.title}"):
                op = await jt.submit(
                    scenario.provider,
                    {"demo": number, "task": scenario.title},
                    caller="demo",
                    approved_by="demo",
                )
                op = await jt.drive_create(op.operation_id)
            ok = op.state is scenario.expected
            all_as_expected &= ok
            colour = {
                State.ACCEPTED: "green",
                State.RESULT_COLLECTING: "green",
                State.FAILED: "red",
                State.NEEDS_ATTENTION: "yellow",
            }.get(op.state, "white")
            table.add_row(
                str(number),
                scenario.title,
                f"[{colour}]{op.state.value}[/{colour}]",
                op.remote_job_id or "-",
                str(fake.counts["creates_received"] - received_before),
                str(fake.counts["jobs_created"] - jobs_before),
            )
            reasons.append(f"{number}. {op.state.value}: {op.state_reason or _why(op.state)}")
    finally:
        for provider in jt.providers.values():
            await provider.aclose()
        good.stop()
        careless.stop()
    console.print(table)
    console.print("\n".join(reasons), highlight=False)
    duplicates = good.counts["jobs_created"] - (len(SCENARIOS) - 2)
    console.print(
        f"\nidempotent provider: {good.counts['creates_received']} create requests, "
        f"{good.counts['replayed']} answered by replay, {good.counts['jobs_created']} jobs for "
        f"{len(SCENARIOS) - 2} operations that reached it: the one extra job is its own contract break "
        "(scenario 7), caught and flagged, never silently kept"
        if duplicates == 1
        else f"idempotent provider created {good.counts['jobs_created']} jobs"
    )
    report = verify(store)
    verdict = "[green]OK[/green]" if report.ok else "[red]TAMPERED[/red]"
    console.print(
        f"audit verify: {verdict} {report.operations} operations, {report.entries} history entries, "
        f"head {report.root[:16]}..."
    )
    store.close()
    return all_as_expected and report.ok


def _why(state: State) -> str:
    return {State.ACCEPTED: "job confirmed by the provider"}.get(state, "")


def run_demo(db: str | None, console: Console | None = None) -> bool:
    console = console or Console()
    path = db or str(Path.cwd() / DEFAULT_DEMO_DB)
    console.print(f"jobtrail demo: ledger at [bold]{path}[/bold], fake providers on 127.0.0.1\n")
    ok = asyncio.run(_run(path, console))
    console.print(f"\nLook around: jobtrail --db {path} ops list   |   jobtrail --db {path} audit verify")
    return ok
