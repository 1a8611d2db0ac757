"""Traces and metrics: the spans of whole life cycles against the fake provider over real sockets, in the
operation's own trace (the one sent in ``traceparent``), never holding a credential; the metrics as an
in-memory reader and a Prometheus scrape see them; and the worker's progress display and summary."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from jobtrail import AsyncJobtrail, State, Store
from jobtrail.providers.http import load_provider
from jobtrail.runtime.gauges import ledger_gauges
from jobtrail.runtime.worker import Worker
from jobtrail.testing import FakeProvider, Fault, send_webhook

from processes import finish, start_worker, submit_many, write_provider


@dataclass
class Sdk:
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader


_SDK: Sdk | None = None


@pytest.fixture
def sdk() -> Iterator[Sdk]:
    """The OpenTelemetry SDK with in-memory exporters, installed once per process (the API allows one)."""
    global _SDK
    if _SDK is None:
        spans, reader = InMemorySpanExporter(), InMemoryMetricReader()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(spans))
        trace.set_tracer_provider(provider)
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        _SDK = Sdk(spans, reader)
    _SDK.spans.clear()
    yield _SDK


def _of(sdk: Sdk, trace_id: str) -> list[ReadableSpan]:
    return [
        s for s in sdk.spans.get_finished_spans() if s.context is not None and s.context.trace_id == int(trace_id, 16)
    ]


def _texts(span: ReadableSpan) -> list[str]:
    """Everything a span would export as text: name, attribute and event values, status."""
    out = [span.name, span.status.description or ""]
    out += [str(v) for v in (span.attributes or {}).values()]
    for event in span.events:
        out += [event.name, *(str(v) for v in (event.attributes or {}).values())]
    return out


def _points(sdk: Sdk, name: str) -> dict[frozenset[tuple[str, Any]], float]:
    data = sdk.metrics.get_metrics_data()
    out: dict[frozenset[tuple[str, Any]], float] = {}
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name != name:
                    continue
                for point in metric.data.data_points:
                    key = frozenset((point.attributes or {}).items())
                    out[key] = float(getattr(point, "value", None) or getattr(point, "count", 0))
    return out


def test_a_whole_life_cycle_is_one_trace_of_action_spans(
    sdk: Sdk, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Create (lost answer), reconcile, polls, collection, and a cancel: each a span in the operation's trace,
    child of one parent standing for the operation, with its attributes; each request's traceparent names
    the span it was sent from; no span holds the credential or the request body."""
    canary = f"jtcanary_{secrets.token_hex(8)}"
    marker = f"bodymarker_{secrets.token_hex(8)}"
    monkeypatch.setenv("JT_TELEMETRY_KEY", canary)
    fake = FakeProvider(job_duration_s=0.3, require_bearer=canary).start()
    store = Store.open(db_url)
    try:
        config = fake.provider_config(credential="env:JT_TELEMETRY_KEY")
        jt = AsyncJobtrail(store=store, providers=[config])

        async def go() -> tuple[Any, Any]:
            op = await jt.submit("fake", {"doc": marker})
            long = await jt.submit("fake", {"doc": marker, "fake": {"duration": 30}})
            long = await jt.drive_create(long.operation_id)  # the client's own create action
            await jt.cancel(long.operation_id, requested_by="t", reason="not needed")
            fake.script(Fault.drop(commit=True))  # the worker's create loses its answer: a reconciliation follows
            worker = Worker(store, {"fake": load_provider(config)}, worker_id="w", idle_s=0.01)
            await worker.run(until_settled=True, timeout=30)
            for provider in jt.providers.values():
                await provider.aclose()
            return await asyncio.to_thread(store.get, op.operation_id), await asyncio.to_thread(
                store.get, long.operation_id
            )

        op, long = asyncio.run(go())
        assert op.state is State.SUCCEEDED and long.state is State.CANCELLED, (op.state, long.state)

        spans = sorted(_of(sdk, op.trace_id), key=lambda s: s.start_time or 0)
        names = [s.name for s in spans]
        assert names[0] == "jobtrail.create" and "jobtrail.reconcile" in names, names
        assert "jobtrail.poll" in names and names[-1] == "jobtrail.collect", names
        parents = {s.parent.span_id for s in spans if s.parent is not None}
        assert len(parents) == 1 and all(s.parent is not None and s.parent.is_remote for s in spans)
        assert not parents & {s.context.span_id for s in spans if s.context}, "the operation's parent is not exported"
        for s in spans:
            attrs = s.attributes or {}
            assert attrs["jobtrail.operation_id"] == op.operation_id and attrs["jobtrail.provider"] == "fake"
            assert attrs["jobtrail.state.before"] and attrs["jobtrail.state.after"]
        create, collect = spans[0], spans[-1]
        assert (create.attributes or {})["jobtrail.state.before"] == "create_pending"
        assert (collect.attributes or {})["jobtrail.state.after"] == "succeeded"
        polled = [s for s in spans if s.name == "jobtrail.poll" and "http.response.status_code" in (s.attributes or {})]
        assert polled and all((s.attributes or {})["http.response.status_code"] == 200 for s in polled)
        replay = next(
            s
            for s in spans
            if s.name == "jobtrail.reconcile" and s.attributes and "jobtrail.remote_job_id" in s.attributes
        )
        job = (replay.attributes or {})["jobtrail.remote_job_id"]
        assert (replay.attributes or {})["http.response.status_code"] == 201

        # the traceparent of every request: the operation's trace id, the span it was sent from
        ids = {f"{s.context.span_id:016x}": s for s in spans if s.context}
        sent = [
            tp for method, path, tp in fake.traceparents if job in path or (method == "POST" and path == "/v1/jobs")
        ]
        ours = [tp for tp in sent if tp and tp.split("-")[1] == op.trace_id]
        assert len(ours) >= 4, sent
        for header in ours:
            version, trace_id, span_id, flags = header.split("-")
            assert (version, trace_id, flags) == ("00", op.trace_id, "01")
            assert span_id in ids, f"{header} names no span of the operation"

        # the cancelled operation: the client's create, then the worker's cancel, in its own trace
        other = sorted(_of(sdk, long.trace_id), key=lambda s: s.start_time or 0)
        assert other[0].name == "jobtrail.create" and "jobtrail.cancel" in [s.name for s in other], other
        # the provider's request id of the create's answer (the fake's replays carry none)
        assert (other[0].attributes or {})["jobtrail.provider_request_id"] == f"req_{long.remote_job_id}"

        for s in sdk.spans.get_finished_spans():
            for text in _texts(s):
                assert canary not in text and marker not in text, (s.name, text)
    finally:
        store.close()
        fake.stop()


def test_a_request_id_carrying_the_credential_reaches_no_span(
    sdk: Sdk, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a probe: a provider that echoed the bearer token as its X-Request-Id had it put on every span
    of the operation in clear (the ledger masked it). A request id is held to what a job id is: one carrying
    the credential names no request, on a span or anywhere."""
    canary = f"jtcanary_{secrets.token_hex(8)}"
    monkeypatch.setenv("JT_TELEMETRY_KEY", canary)
    fake = FakeProvider(require_bearer=canary).start()
    store = Store.open(db_url)
    try:
        config = fake.provider_config(credential="env:JT_TELEMETRY_KEY")
        jt = AsyncJobtrail(store=store, providers=[config])
        fake.script(Fault.reject(400, echo_auth=True))

        async def go() -> Any:
            op = await jt.drive_create((await jt.submit("fake", {"x": 1})).operation_id)
            for provider in jt.providers.values():
                await provider.aclose()
            return op

        op = asyncio.run(go())
        assert op.state is State.FAILED and fake.counts["creates_received"] == 1
        spans = _of(sdk, op.trace_id)
        assert spans and all("jobtrail.provider_request_id" not in (s.attributes or {}) for s in spans)
        for s in spans:
            for text in _texts(s):
                assert canary not in text, (s.name, text)
        (answer,) = store.observations(op.operation_id)
        assert answer["provider_request_id"] is None and canary not in json.dumps(answer)
    finally:
        store.close()
        fake.stop()


def test_a_submit_inside_an_agent_s_span_joins_its_trace(sdk: Sdk, db_url: str, fake: FakeProvider) -> None:
    """The operation takes the ambient trace id; the create sent inside the agent's span is its child,
    and the worker's later actions (outside it) stay in that trace."""
    store = Store.open(db_url)
    try:
        config = fake.provider_config()
        jt = AsyncJobtrail(store=store, providers=[config])
        agent_tracer = trace.get_tracer("agent")

        async def go() -> tuple[Any, Any]:
            with agent_tracer.start_as_current_span("agent.step") as agent:
                op = await jt.submit("fake", {"x": 1})
                await jt.drive_create(op.operation_id)
            worker = Worker(store, {"fake": load_provider(config)}, worker_id="w", idle_s=0.01)
            await worker.run(until_settled=True, timeout=30)
            for provider in jt.providers.values():
                await provider.aclose()
            return op, agent.get_span_context()

        op, agent = asyncio.run(go())
        assert op.trace_id == f"{agent.trace_id:032x}"
        spans = {s.name: s for s in _of(sdk, op.trace_id)}
        create = spans["jobtrail.create"]
        assert create.parent is not None and create.parent.span_id == agent.span_id and not create.parent.is_remote
        poll = spans["jobtrail.poll"]
        assert poll.parent is not None and poll.parent.is_remote
        assert store.get(op.operation_id).state is State.SUCCEEDED
    finally:
        store.close()


def test_actions_provider_calls_and_ledger_gauges_are_measured(sdk: Sdk, db_url: str, fake: FakeProvider) -> None:
    """Actions by kind, provider latency by call, errors by status; operations by state and the due backlog."""
    before_actions = _points(sdk, "jobtrail.actions")
    before_calls = _points(sdk, "jobtrail.provider.duration")
    before_errors = _points(sdk, "jobtrail.provider.errors")
    store = Store.open(db_url)
    try:
        config = fake.provider_config()
        jt = AsyncJobtrail(store=store, providers=[config])
        fake.script(Fault.http(503))

        async def go() -> None:
            await jt.submit("fake", {"x": 1})
            worker = Worker(store, {"fake": load_provider(config)}, worker_id="w", idle_s=0.01)
            await worker.run(until_settled=True, timeout=30)
            await jt.submit("fake", {"x": 2})  # due, and no worker: the backlog

        asyncio.run(go())

        def delta(after: dict[Any, float], before: dict[Any, float], **attrs: str) -> float:
            key = frozenset(attrs.items())
            return after.get(key, 0) - before.get(key, 0)

        actions = _points(sdk, "jobtrail.actions")
        assert delta(actions, before_actions, kind="create", provider="fake") == 1  # answered 503: maybe created
        assert delta(actions, before_actions, kind="reconcile", provider="fake") >= 1  # so it is replayed
        assert delta(actions, before_actions, kind="poll", provider="fake") >= 1
        assert delta(actions, before_actions, kind="collect", provider="fake") == 1
        calls = _points(sdk, "jobtrail.provider.duration")
        assert delta(calls, before_calls, provider="fake", call="create") >= 2  # the send and the replay
        assert delta(calls, before_calls, provider="fake", call="status") >= 1
        errors = _points(sdk, "jobtrail.provider.errors")
        assert delta(errors, before_errors, provider="fake", call="create", error="503") == 1

        with ledger_gauges(store, ("fake",)):
            by_state = _points(sdk, "jobtrail.operations")
            backlog = _points(sdk, "jobtrail.due.backlog")
            age = _points(sdk, "jobtrail.due.age")
        assert by_state[frozenset({("provider", "fake"), ("state", "succeeded")})] == 1
        assert by_state[frozenset({("provider", "fake"), ("state", "create_pending")})] == 1
        assert backlog[frozenset()] == 1 and age[frozenset()] >= 0
        with ledger_gauges(store, ("fake",)):
            pass
        assert _points(sdk, "jobtrail.operations") == {}, "a ledger no worker watches is not reported"
    finally:
        store.close()


def test_the_ledger_gauges_give_up_on_a_locked_table_rather_than_hold_the_scrape(
    sdk: Sdk, db_url: str, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a probe: with another PostgreSQL session holding the operations table, every scrape of
    ``worker --metrics-port`` hung on the gauges' counts and timed out (72 of 80), tracebacks in the worker's
    stderr. A gauge's count now waits for a lock a second at most (here 0.2 s), and the scrape goes without it."""
    if not db_url.startswith("postgresql"):
        pytest.skip("a SQLite reader never waits on a writer's lock (WAL): nothing to give up on")
    import sqlalchemy as sa

    import jobtrail.ledger.store as store_module

    monkeypatch.setattr(store_module, "GLANCE_LOCK_TIMEOUT_MS", 200)
    store = Store.open(db_url)
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])
    asyncio.run(jt.submit("fake", {"x": 1}))
    asyncio.run(jt.providers["fake"].aclose())
    engine = sa.create_engine(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    locker = engine.connect()
    locker.execute(sa.text("LOCK TABLE operations IN ACCESS EXCLUSIVE MODE"))
    try:
        with ledger_gauges(store, ("fake",)):
            started = time.monotonic()
            while_locked = _points(sdk, "jobtrail.operations")
            took = time.monotonic() - started
    finally:
        locker.close()
        engine.dispose()
    # (without the short wait, the count waits out the store's lock_timeout of 30 s)
    assert while_locked == {} and took < 15, (while_locked, took)
    with ledger_gauges(store, ("fake",)):
        assert _points(sdk, "jobtrail.operations") == {
            frozenset({("provider", "fake"), ("state", "create_pending")}): 1
        }
    store.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The samples of a real GET /metrics, by name and labels (the scope's own labels left out)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    samples = {}
    for line in text.splitlines():
        found = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if found is None or line.startswith("#"):
            continue
        name, labels, value = found.groups()
        pairs = frozenset((k, v) for k, v in re.findall(r'(\w+)="([^"]*)"', labels or "") if not k.startswith("otel_"))
        samples[(name, pairs)] = float(value)
    return samples


def test_worker_serves_prometheus_metrics_and_prints_a_summary_line(tmp_path: Path) -> None:
    """``worker --metrics-port``: a real GET of /metrics shows the actions and the ledger gauges; off a
    terminal, the worker prints one summary line at exit."""
    db_url = str(tmp_path / "jobs.db")  # one engine: what is tested here does not depend on it
    fake = FakeProvider(job_duration_s=0.2).start()
    try:
        submit_many(db_url, fake, 3)
        port = _free_port()
        env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
        proc = start_worker(
            db_url,
            write_provider(tmp_path / "fake.toml", fake),
            "prom",
            "--timeout",
            "60",
            "--metrics-port",
            str(port),
            env=env,
        )
        succeeded = ("jobtrail_operations", frozenset({("provider", "fake"), ("state", "succeeded")}))
        samples: dict[Any, float] = {}
        deadline = time.monotonic() + 45
        backlog = ("jobtrail_due_backlog", frozenset())
        # the backlog is read at most once a second: it may lag the states by one scrape
        while time.monotonic() < deadline and (samples.get(succeeded) != 3 or samples.get(backlog) != 0):
            time.sleep(0.2)
            with contextlib.suppress(OSError):
                samples = _scrape(port)
        proc.send_signal(signal.SIGTERM)
        code, out, err = finish(proc)
        assert code == 0, err
        assert samples.get(succeeded) == 3, samples
        assert samples[("jobtrail_actions_total", frozenset({("kind", "create"), ("provider", "fake")}))] == 3
        assert (
            samples[("jobtrail_provider_duration_seconds_count", frozenset({("call", "create"), ("provider", "fake")}))]
            == 3
        )
        assert samples[backlog] == 0
        assert json.loads(out)["actions"] >= 9
        summary = [line for line in err.splitlines() if line.startswith("jobtrail worker prom:")]
        assert len(summary) == 1 and "succeeded 3" in summary[0], err
    finally:
        fake.stop()


def test_worker_on_a_terminal_shows_progress_and_a_summary_table(tmp_path: Path) -> None:
    """With a terminal on stderr (rich is told so), the worker draws its table and ends with a summary table."""
    db_url = str(tmp_path / "jobs.db")  # one engine: what is tested here does not depend on it
    fake = FakeProvider(job_duration_s=0.2).start()
    try:
        submit_many(db_url, fake, 2)
        proc = start_worker(
            db_url,
            write_provider(tmp_path / "fake.toml", fake),
            "tty",
            "--until-settled",
            "--timeout",
            "60",
            env={"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "80"},
        )
        code, _out, drawn = finish(proc)
        assert code == 0, drawn
        assert "\x1b[" in drawn, "drawn for a terminal"
        err = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn)
        summary = err[err.index("jobtrail worker finished: tty") :].splitlines()
        assert re.search(r"succeeded +2", "\n".join(summary)), err
        assert re.search(r"\d+ actions, [\d.]+/s; 0 errors", "\n".join(summary)), err
    finally:
        fake.stop()


def test_a_webhook_receipt_is_a_span_in_the_operation_s_trace_and_counted(
    sdk: Sdk, ledger: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verified delivery matched to an operation: a span in its trace; receipts counted by outcome and
    refusals by reason."""
    from test_webhooks import accepted_op, cfg_for, event, new_secret, serve

    secret = new_secret()
    monkeypatch.setenv("WHSEC_CURRENT", secret)
    before = _points(sdk, "jobtrail.webhook.receipts")
    fake = FakeProvider(job_duration_s=60).start()
    try:
        cfg = cfg_for(fake)
        op = accepted_op(ledger, cfg)
        with serve(ledger, cfg) as url:
            assert send_webhook(url, secret, event(op.remote_job_id), event_id="evt_1")[0] == 202
            assert send_webhook(url, secret, event(op.remote_job_id), event_id="evt_1")[0] == 200
            assert send_webhook(url, new_secret(), event(op.remote_job_id), event_id="evt_2")[0] == 401
    finally:
        fake.stop()
    spans = [s for s in _of(sdk, op.trace_id) if s.name == "jobtrail.webhook"]
    outcomes = sorted(str((s.attributes or {})["jobtrail.webhook.outcome"]) for s in spans)
    assert outcomes == ["accepted", "duplicate"], outcomes
    assert all((s.attributes or {})["jobtrail.operation_id"] == op.operation_id for s in spans)
    after = _points(sdk, "jobtrail.webhook.receipts")
    for outcome in ("accepted", "duplicate", "refused"):
        key = frozenset({("provider", "fake"), ("outcome", outcome)})
        assert after.get(key, 0) - before.get(key, 0) == 1, (outcome, after)
    assert any(dict(k).get("reason") for k in _points(sdk, "jobtrail.webhook.refusals"))
