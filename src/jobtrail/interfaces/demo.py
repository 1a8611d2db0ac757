"""``jobtrail demo``: the classic failures against the bundled fake provider, on loopback.

No configuration: a SQLite file in the current directory, two fake providers
on 127.0.0.1 (one honours idempotency keys and sends duplicated webhooks, one
does neither), a webhook receiver, a worker process that is killed with
``kill -9`` in the middle, and a worker in this process that finishes the job.
Every scenario shows what happened, what the provider actually saw, and why
the record says what it says.
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from jobtrail.domain.errors import UsageError, require_extra
from jobtrail.domain.states import State
from jobtrail.flows.cancel import request_cancel
from jobtrail.ledger.audit import verify
from jobtrail.ledger.store import Store, in_memory
from jobtrail.providers.http import load_provider
from jobtrail.runtime.client import AsyncJobtrail
from jobtrail.runtime.loop import run as run_loop
from jobtrail.runtime.worker import Worker
from jobtrail.testing import FakeProvider, Fault, provider_toml

DEFAULT_DEMO_DB = "jobtrail-demo.db"
_SECRET_ENV = "JOBTRAIL_DEMO_WEBHOOK_SECRET"  # noqa: S105 - the name of a variable, not a secret


@dataclass
class Scenario:
    title: str
    expected: State
    faults: tuple[Fault, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    provider: str = "fake"
    operation_id: str = ""
    creates: int = 0
    jobs: int = 0


def _scenarios() -> list[Scenario]:
    return [
        Scenario("clean run", State.SUCCEEDED),
        Scenario("create response lost after commit", State.SUCCEEDED, (Fault.drop(),)),
        Scenario("503 with Retry-After: 1", State.SUCCEEDED, (Fault.http(503, retry_after="1"),)),
        Scenario("worker killed mid-flight (kill -9)", State.SUCCEEDED, options={"duration": 2}),
        Scenario("cancel races a finishing job", State.SUCCEEDED, options={"cancel": "finish_first", "duration": 30}),
        Scenario("corrupted result (bad checksum)", State.RESULT_VALIDATION_FAILED, options={"result": "bad_checksum"}),
        Scenario("request refused (422)", State.FAILED, (Fault.reject(422),)),
        Scenario("provider breaks idempotency", State.NEEDS_ATTENTION, (Fault.drop(), Fault.replay_new_id())),
        Scenario(
            "no idempotency, response lost", State.NEEDS_ATTENTION, (Fault.drop(),), provider="fake-no-idempotency"
        ),
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_receiver(store: Store, config: dict[str, Any], port: int) -> tuple[Any, threading.Thread]:
    import uvicorn

    from jobtrail.interfaces.webhooks import webhook_app

    provider = load_provider(config)
    app = webhook_app(store, {provider.name: provider.config.webhooks})
    # asyncio's own loop in this thread: a uvloop left running in a thread when the interpreter exits can call
    # into it while it is torn down (and the thread is stopped and joined before the demo ends, see _stop)
    settings = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", loop="asyncio")
    server = uvicorn.Server(settings)
    thread = threading.Thread(target=server.run, name="demo-webhook-receiver", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    return server, thread


def _stop(receiver: Any, thread: threading.Thread) -> None:
    """Stop the webhook receiver and wait for its thread (its loop closed) before going on."""
    receiver.should_exit = True
    thread.join(timeout=10)


async def _run(db: str, console: Console) -> bool:
    os.environ[_SECRET_ENV] = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    port = _free_port()
    good = FakeProvider(
        job_duration_s=1.0,
        webhook_url=f"http://127.0.0.1:{port}/webhooks/fake",
        webhook_secret=os.environ[_SECRET_ENV],
        webhook_faults={"duplicate"},
    ).start()
    careless = FakeProvider(job_duration_s=1.0, idempotency=False).start()
    store = Store.open(db)
    fast = {
        "poll": {"initial_s": 0.5, "factor": 1, "cap_s": 0.5, "jitter": 0.2},
        "retry": {"initial_s": 0.1, "factor": 2, "cap_s": 1},
    }
    good_cfg = good.provider_config(
        timeout_s=1.0,
        connect_timeout_s=1.0,
        webhooks={"secrets": [f"env:{_SECRET_ENV}"]},
        reconcile={"modes": ["replay", "list_by_reference"], "list_path": "/v1/jobs?client_reference={token}"},
        **fast,
    )
    careless_cfg = careless.provider_config(
        name="fake-no-idempotency",
        timeout_s=1.0,
        connect_timeout_s=1.0,
        create={"token": {"in": "none"}},
        reconcile=None,
        **fast,
    )
    receiver, receiver_thread = _start_receiver(store, good_cfg, port)
    jt = AsyncJobtrail(store=store, actor="demo", providers=[good_cfg, careless_cfg])
    fakes = {"fake": good, "fake-no-idempotency": careless}
    scenarios = _scenarios()
    workdir = Path(tempfile.mkdtemp(prefix="jobtrail-demo-"))
    try:
        # 1. creates, one at a time, so each scenario meets its own scripted fault
        run = time.strftime("%H%M%S")  # each run's keys are its own: a second run adds a second set
        for number, sc in enumerate(scenarios, start=1):
            fake = fakes[sc.provider]
            fake.script(*sc.faults)
            before = (fake.counts["creates_received"], fake.counts["jobs_created"])
            with console.status(f"[{number}/{len(scenarios)}] creating: {sc.title}"):
                op = await jt.submit(
                    sc.provider,
                    {"demo": number, "run": run, "fake": sc.options},
                    key=f"demo-{run}-{number}",
                    caller="demo",
                    approved_by="demo",
                )
                op = await jt.drive_create(op.operation_id)
            sc.operation_id = op.operation_id
            sc.creates = fake.counts["creates_received"] - before[0]
            sc.jobs = fake.counts["jobs_created"] - before[1]
            console.print(f"  {number}. {sc.title}: {op.state.value}")
        for provider in jt.providers.values():
            await provider.aclose()

        # 2. a worker process takes over the polling, and is killed with kill -9 in the middle
        provider_file = workdir / "fake.toml"
        provider_file.write_text(provider_toml(good_cfg))
        doomed = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jobtrail",
                "--db",
                db,
                "worker",
                "--provider",
                str(provider_file),
                "--lease",
                "3",
                "--id",
                "demo-worker-1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        polls = good.counts["status"]

        async def held_by_doomed() -> int:
            leases = [(await jt.io(store.get, sc.operation_id)).lease_owner for sc in scenarios]
            return leases.count("demo-worker-1")

        with console.status("worker demo-worker-1 is polling; about to kill it with kill -9"):
            # in the middle of its work: a few polls made, and (if it comes within the time) while it holds
            # leases, each for the moment of a call and its write, so that the takeover has something to take
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                if good.counts["status"] >= polls + 3 and await held_by_doomed():
                    break
                await asyncio.sleep(0.005)
            doomed.send_signal(signal.SIGKILL)
            doomed.wait(10)
        held = await held_by_doomed()
        console.print(
            f"  killed demo-worker-1 (kill -9) after {good.counts['status'] - polls} polls, holding {held} "
            "lease(s); another worker continues from the record alone"
        )

        # 3. a person cancels a job that finishes at that very moment
        racing = next(sc for sc in scenarios if sc.options.get("cancel") == "finish_first")
        done = await jt.io(
            request_cancel,
            store,
            racing.operation_id,
            requested_by="demo-operator",
            reason="changed plans",
            expected_effect="no result needed",
        )
        console.print(f"  cancel requested for scenario 5: {done.outcome}")

        # 4. a fresh worker finishes everything, once the dead worker's leases have expired
        worker = Worker(
            store,
            {name: load_provider(cfg) for name, cfg in (("fake", good_cfg), ("fake-no-idempotency", careless_cfg))},
            worker_id="demo-worker-2",
            idle_s=0.1,
            lease_s=10,
        )
        task = asyncio.create_task(worker.run(until_settled=True, timeout=45))
        with console.status("") as status:
            while not task.done():
                ops = [await jt.io(store.get, sc.operation_id) for sc in scenarios]
                states = Counter(op.state.value for op in ops)
                status.update("demo-worker-2: " + ", ".join(f"{n} {s}" for s, n in sorted(states.items())))
                await asyncio.sleep(0.2)
        await task
        await asyncio.sleep(0.3)  # the last webhook deliveries
    finally:
        await asyncio.to_thread(_stop, receiver, receiver_thread)
        good.stop()
        careless.stop()

    return _report(store, scenarios, good, console)


def _report(store: Store, scenarios: list[Scenario], good: FakeProvider, console: Console) -> bool:
    table = Table("#", "scenario", "state", "job", "sent", "jobs", title="creates sent / jobs the provider made")
    reasons = []
    ok = True
    for number, sc in enumerate(scenarios, start=1):
        op = store.get(sc.operation_id)
        ok &= op.state is sc.expected
        colour = {State.SUCCEEDED: "green", State.FAILED: "red", State.RESULT_VALIDATION_FAILED: "red"}.get(
            op.state, "yellow"
        )
        table.add_row(
            str(number),
            sc.title,
            f"[{colour}]{op.state.value}[/{colour}]",
            op.remote_job_id or "-",
            str(sc.creates),
            str(sc.jobs),
        )
        why = op.state_reason or ""
        intents = [e for e in store.history(sc.operation_id) if e.cause == "cancel_intent"]
        if intents and op.state is State.SUCCEEDED:
            why += f" (a cancel was requested by {intents[0].actor}; the job finished first)"
        reasons.append(f"{number}. {op.operation_key} ({op.operation_id}) {op.state.value}: {why}")
    console.print(table)
    console.print("\n".join(reasons), highlight=False, markup=False)  # the providers' words, as they are
    deliveries = Counter(status for _, status in good.webhook_deliveries)
    reached = len([sc for sc in scenarios if sc.provider == "fake" and sc.jobs])
    console.print(
        f"\nidempotent provider: {good.counts['creates_received']} create requests, {good.counts['replayed']} "
        f"answered by replay, {good.counts['jobs_created']} jobs for {reached} operations that made one (the "
        f"extra job is scenario 8's contract break, caught and flagged); {good.counts['cancels']} cancel sent; "
        f"webhooks: {deliveries.get(202, 0)} accepted, {deliveries.get(200, 0)} duplicates recorded once",
        highlight=False,
    )
    report = verify(store)
    verdict = "[green]OK[/green]" if report.ok else "[red]TAMPERED[/red]"
    console.print(
        f"audit verify: {verdict} {report.operations} operations, {report.entries} history entries, "
        f"head {report.root[:16]}..."
    )
    store.close()
    return ok and report.ok


def _start_afresh(path: str, *, own: bool, console: Console) -> None:
    """The demo tells a story from an empty ledger: a second run on the first one's saw its webhooks as
    duplicates (the fake's job ids start again at job_00001) and its operations among the new ones. Its own
    file is made anew; a ledger someone named is never emptied: refused instead."""
    from jobtrail.ledger.files import ledger_files

    with Store.open(path) as store:
        held = store.count()
        files, results = ledger_files(store)
    if not held:  # (in memory, always: a new store is a new ledger)
        return
    if not own:
        raise UsageError(
            f"the demo needs an empty ledger: {path} holds {held} operation(s). Give --db a new path, or leave "
            f"it out (the demo's own {DEFAULT_DEMO_DB} is made anew at each run)"
        )
    console.print(f"(the last demo's ledger at {path} is replaced)\n", highlight=False)
    for file in files:
        file.unlink(missing_ok=True)
    if results == Path(f"{path}-results").resolve():  # its own, beside it (not a $JOBTRAIL_DATA_DIR shared by others)
        shutil.rmtree(results, ignore_errors=True)


def run_demo(db: str | None, console: Console | None = None) -> bool:
    # the demo shows webhooks arriving, so it runs the receiver
    require_extra("webhooks", "jobtrail demo", "uvicorn", "starlette", "standardwebhooks")
    console = console or Console()
    path = db or str(Path.cwd() / DEFAULT_DEMO_DB)
    _start_afresh(path, own=db is None, console=console)
    console.print(f"jobtrail demo: ledger at [bold]{path}[/bold], fake providers on 127.0.0.1\n")
    started = time.monotonic()
    ok = run_loop(_run(path, console))
    if in_memory(path):  # nothing to look around in afterwards: say so, rather than point at an empty ledger
        console.print(
            f"\nfinished in {time.monotonic() - started:.1f} s. Its ledger was in memory and went with it: "
            f"run `{_command()} demo --db FILE` to look around afterwards",
            highlight=False,
            soft_wrap=True,
        )
        return ok
    with Store.open(path) as store:
        last = store.list_operations(limit=1, caller="demo")
    key = last[0].operation_key if last else "OP_ID"
    me = f"{_command()} --db {shlex.quote(path)}"
    console.print(
        f"\nfinished in {time.monotonic() - started:.1f} s. Look around:\n  {me} ops list\n  {me} explain {key}\n"
        f"  {me} audit verify",
        highlight=False,
        soft_wrap=True,
    )
    return ok


def _command() -> str:
    """How to run jobtrail again as this shell can: ``jobtrail`` when it is on PATH, else as it was run."""
    program = sys.argv[0]
    if Path(program).name == "jobtrail":
        found = shutil.which("jobtrail")
        if found is not None and Path(found).resolve() == Path(program).resolve():
            return "jobtrail"
        return shlex.quote(program)
    return f"{shlex.quote(sys.executable)} -m jobtrail"
