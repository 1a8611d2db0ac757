"""Endings: a sent cancel is not a cancellation, and a finished job is not a collected result."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from html import escape
from pathlib import Path
from typing import Any

import pytest

from jobtrail import AsyncJobtrail, State, Store
from jobtrail.domain.explain import advice as explain_advice
from jobtrail.domain.results import ResultCorrupted
from jobtrail.flows import observe
from jobtrail.flows.cancel import request_cancel
from jobtrail.flows.escalation import bundle_markdown, escalation_bundle
from jobtrail.flows.observe import MAX_RESULT_ATTEMPTS
from jobtrail.ledger.audit import verify
from jobtrail.ledger.files import data_dir
from jobtrail.ledger.results import INLINE_MAX_BYTES, read_result, stored_result
from jobtrail.providers.http import load_provider
from jobtrail.runtime.worker import Worker
from jobtrail.testing import FakeProvider, Fault

from processes import cli, pipe_capacity, stop_midway_through_a_write

S = State
FAST = {
    "poll": {"initial_s": 0.05, "factor": 1, "cap_s": 0.2},
    "retry": {"initial_s": 0.02, "factor": 1, "cap_s": 0.05},
}


def config(fake: FakeProvider, **overrides: Any) -> dict[str, Any]:
    return fake.provider_config(**{**FAST, **overrides})


def submit(store: Store, cfg: dict[str, Any], body: Any, **kwargs: Any) -> str:
    return asyncio.run(AsyncJobtrail(store=store, providers=[cfg]).submit("fake", body, **kwargs)).operation_id


def work(
    store: Store,
    cfg: dict[str, Any],
    *,
    until: Callable[[], bool] | None = None,
    seconds: float = 20,
    workers: int = 1,
    **kwargs: Any,
) -> None:
    """Run worker(s) in this process until ``until()`` holds (or nothing is due, or time is up)."""

    async def go() -> None:
        runners = [
            Worker(store, {"fake": load_provider(cfg)}, worker_id=f"w{i}", idle_s=0.02, **kwargs)
            for i in range(workers)
        ]
        tasks = [asyncio.create_task(r.run(until_settled=until is None, timeout=seconds)) for r in runners]
        if until is not None:
            deadline = time.monotonic() + seconds
            while not until() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            for r in runners:
                r.stop()
        await asyncio.gather(*tasks)

    asyncio.run(go())


def state_is(store: Store, op_id: str, *states: State) -> Callable[[], bool]:
    return lambda: store.get(op_id).state in states


def causes(store: Store, op_id: str) -> list[str]:
    return [e.cause for e in store.history(op_id)]


# -- cancellation --------------------------------------------------------------------------------


def test_cancel_is_recorded_first_sent_once_and_confirmed_by_the_provider(ledger: Store, fake: FakeProvider) -> None:
    cfg = config(fake, status={"effects": "$.effects"})
    op_id = submit(ledger, cfg, {"task": "long", "fake": {"effects": True}})
    fake.job_duration_s = 30
    work(ledger, cfg, until=state_is(ledger, op_id, S.OBSERVING))
    done = request_cancel(ledger, op_id, requested_by="alice", reason="wrong input", expected_effect="no charge")
    assert done.outcome == "requested" and done.operation.state is S.CANCEL_REQUESTED
    assert fake.counts["cancels"] == 0  # recording the intent sends nothing
    work(ledger, cfg, until=state_is(ledger, op_id, S.CANCELLED))
    op = ledger.get(op_id)
    assert op.state is S.CANCELLED and "provider reports the job cancelled" in (op.state_reason or "")
    assert fake.counts["cancels"] == 1
    history = causes(ledger, op_id)
    assert history.index("cancel_intent") < history.index("cancel_attempt") < history.index("cancel_acknowledged")
    intent = next(e for e in ledger.history(op_id) if e.cause == "cancel_intent").to_json()
    assert intent["actor"] == "person:alice"
    wanted = {"requested_by": "alice", "reason": "wrong input", "expected_effect": "no charge"}
    assert {k: intent["evidence"][k] for k in wanted} == wanted
    assert isinstance(op.partial_effects, dict) and "items_processed" in op.partial_effects
    assert verify(ledger).ok


def test_a_cancel_answered_not_now_is_sent_again_after_retry_after_and_nothing_comes_sooner(
    ledger: Store, fake: FakeProvider
) -> None:
    """An idempotent cancel answered 503 with Retry-After: 2 is sent again once those seconds have passed, and
    no request about the job (no poll either) goes out before then. Before, the next poll went out at once,
    the cancel was never sent again, and the job ran on to cancellation_unconfirmed."""
    fake.job_duration_s = 30
    cfg = config(fake)
    op_id = submit(ledger, cfg, {"task": "long"})
    work(ledger, cfg, until=state_is(ledger, op_id, S.OBSERVING))
    fake.busy_cancels, fake.busy_retry_after = 1, "2"
    request_cancel(ledger, op_id, requested_by="alice", reason="wrong input")
    work(ledger, cfg, until=state_is(ledger, op_id, S.CANCELLED))
    assert ledger.get(op_id).state is S.CANCELLED and fake.counts["cancels"] == 2
    job = ledger.get(op_id).remote_job_id
    about_it = [(at, method) for at, method, path in fake.requests if job and job in path]
    refused = next(at for at, method in about_it if method == "POST")
    after = [(round(at - refused, 2), method) for at, method in about_it if at > refused]
    assert after and all(gap >= 2 for gap, _ in after), after
    assert after[0][1] == "POST"  # the cancel again, first


def test_concurrent_cancels_and_several_workers_send_one_cancel(ledger: Store, fake: FakeProvider) -> None:
    fake.job_duration_s = 30
    cfg = config(fake)
    op_id = submit(ledger, cfg, {"task": "contested"})
    work(ledger, cfg, until=state_is(ledger, op_id, S.OBSERVING))
    outcomes: list[str] = []
    barrier = threading.Barrier(8)

    def ask(i: int) -> None:
        barrier.wait()
        outcomes.append(request_cancel(ledger, op_id, requested_by=f"person{i}", reason="stop").outcome)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(outcomes) == ["already_requested"] * 7 + ["requested"]
    work(ledger, cfg, until=state_is(ledger, op_id, S.CANCELLED), workers=3)
    assert ledger.get(op_id).state is S.CANCELLED
    assert fake.counts["cancels"] == 1
    assert causes(ledger, op_id).count("cancel_intent") == 8  # every request is in the history
    assert verify(ledger).ok


def test_a_job_that_finishes_as_the_cancel_arrives_is_reported_as_finished(ledger: Store, fake: FakeProvider) -> None:
    fake.job_duration_s = 30
    cfg = config(fake)
    op_id = submit(ledger, cfg, {"task": "racing", "fake": {"cancel": "finish_first"}})
    work(ledger, cfg, until=state_is(ledger, op_id, S.OBSERVING))
    request_cancel(ledger, op_id, requested_by="bob", reason="too slow")
    work(ledger, cfg, until=state_is(ledger, op_id, S.SUCCEEDED, S.CANCELLED))
    op = ledger.get(op_id)
    assert op.state is S.SUCCEEDED and fake.counts["cancels"] == 1
    history = causes(ledger, op_id)
    assert "cancel_intent" in history and history[-1] == "validated_result"
    finished = next(e for e in ledger.history(op_id) if e.to_state == "result_collecting")
    assert finished.from_state in ("cancel_requested", "cancelling")
    assert stored_result(ledger, op_id) is not None


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_an_ignored_cancel_becomes_unconfirmed_with_a_complete_bundle(
    ledger: Store, fake: FakeProvider, db_url: str
) -> None:
    fake.job_duration_s = 4.0
    cfg = config(fake)
    op_id = submit(
        ledger, cfg, {"task": "stubborn", "fake": {"cancel": "ignore"}}, cancel_deadline=timedelta(seconds=1)
    )
    work(ledger, cfg, until=state_is(ledger, op_id, S.OBSERVING))
    request_cancel(ledger, op_id, requested_by="carol", reason="budget", expected_effect="no further charge")
    work(ledger, cfg, until=state_is(ledger, op_id, S.CANCELLATION_UNCONFIRMED))
    op = ledger.get(op_id)
    assert op.state is S.CANCELLATION_UNCONFIRMED and fake.counts["cancels"] == 1
    bundle = escalation_bundle(ledger, op_id)
    assert bundle["remote_job_id"] == op.remote_job_id and bundle["trace_id"] == op.trace_id
    assert [c["what"] for c in bundle["cancel_attempts"]][:1] == ["cancel_intent"]
    answers = [c for c in bundle["cancel_attempts"] if c["what"] == "cancel_response"]
    assert len(answers) == 1 and answers[0]["http_status"] == 202
    assert f"req_{op.remote_job_id}" in bundle["provider_request_ids"]
    assert any(r["kind"] == "status_poll" for r in bundle["requests"])
    assert [h["to"] for h in bundle["history"]][-1] == "cancellation_unconfirmed"
    markdown = bundle_markdown(bundle)
    assert op.remote_job_id in markdown and op.trace_id in markdown
    # it ends with the decision a person faces, each answer with what to do, and the --expect of the cancel
    assert bundle["decision"]["question"] == (
        f"Is job {op.remote_job_id} stopped? The cancel was sent; the provider has not confirmed it."
    )
    assert "## The decision" in markdown and "stop it in provider fake's console" in markdown
    assert "budget (expecting: no further charge)" in markdown
    # a request that got no answer has no HTTP status: a dash in its row, not Python's None
    unanswered = {**bundle["requests"][0], "http_status": None, "kind": "status_poll"}
    rows = bundle_markdown({**bundle, "requests": [unanswered]}).split("## Requests")[1]
    assert "None" not in rows and "| status_poll | - |" in rows
    shown = subprocess.run(
        [sys.executable, "-m", "jobtrail", "--db", db_url, "ops", "escalation", op_id, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert json.loads(shown.stdout)["state"] == "cancellation_unconfirmed"
    # a later observation still settles it: the job ends on its own, and its result is collected
    work(ledger, cfg, until=state_is(ledger, op_id, S.SUCCEEDED), seconds=20)
    assert ledger.get(op_id).state is S.SUCCEEDED
    assert verify(ledger).ok


def _sent_without_an_answer(ledger: Store, op_id: str) -> None:
    """A create attempt on the record and no answer (a worker that sent it and died): a job may exist."""
    from jobtrail.domain.evidence import CreateAttempt

    op = ledger.get(op_id)
    ledger.record(op, CreateAttempt(attempt=1, reason="first send"), actor="worker:gone", changes={"attempts": 1})


def test_a_cancel_before_the_job_id_is_known_is_carried_out_when_it_is(ledger: Store, fake: FakeProvider) -> None:
    fake.job_duration_s = 30
    cfg = config(fake)
    op_id = submit(ledger, cfg, {"task": "early"})
    _sent_without_an_answer(ledger, op_id)
    done = request_cancel(ledger, op_id, requested_by="dave", reason="changed my mind")
    assert done.outcome == "deferred" and ledger.get(op_id).cancel_requested_by == "dave"
    work(ledger, cfg, until=state_is(ledger, op_id, S.CANCELLED))
    op = ledger.get(op_id)
    assert op.state is S.CANCELLED and fake.counts["jobs_created"] == 1 and fake.counts["cancels"] == 1
    assert op.cancel_requested_by == "dave"  # who asked stays on the record, whatever the ending


def test_a_cancel_before_a_create_that_never_confirms_says_so(ledger: Store, fake: FakeProvider) -> None:
    fake.script(*[Fault.http(503)] * 50)
    cfg = config(fake)
    op_id = submit(ledger, cfg, {"task": "never"}, create_deadline=timedelta(seconds=0.5))
    _sent_without_an_answer(ledger, op_id)
    assert request_cancel(ledger, op_id, requested_by="erin", reason="not needed").outcome == "deferred"
    work(ledger, cfg, until=state_is(ledger, op_id, S.NEEDS_ATTENTION))
    reason = ledger.get(op_id).state_reason or ""
    assert reason.startswith("create_unresolved") and "erin asked to cancel it" in reason
    assert fake.counts["cancels"] == 0


def test_cancel_cli_on_an_ended_job(db_url: str, ledger: Store, fake: FakeProvider) -> None:
    cfg = config(fake)
    op_id = submit(ledger, cfg, {"task": "short"})
    work(ledger, cfg)
    assert ledger.get(op_id).state is S.SUCCEEDED
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobtrail",
            "--db",
            db_url,
            "cancel",
            op_id,
            "--by",
            "frank",
            "--reason",
            "late",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and json.loads(out.stdout)["outcome"] == "already_ended"
    assert causes(ledger, op_id)[-1] == "cancel_intent" and fake.counts["cancels"] == 0


def test_a_cancel_past_the_result_deadline_says_what_a_person_does_not_that_the_job_ended(
    db_url: str, fake: FakeProvider
) -> None:
    """Found by a review: past its result deadline an operation is not ended (its job is NOT assumed stopped),
    yet a cancel was answered already_ended, and the escalation bundle told the person to run `jobtrail cancel`,
    which sends nothing from result_timed_out. Both now say what a person does: stop it in the provider's
    console; the CLI exits 3, as for every state a person decides."""
    fake.job_duration_s = 60
    store = Store.open(db_url)
    config = fake.provider_config(poll={"initial_s": 0.05, "factor": 1, "cap_s": 0.05})
    jt = AsyncJobtrail(store=store, providers=[config])
    op_id = asyncio.run(jt.submit("fake", {"x": 2}, result_deadline=timedelta(seconds=0.5))).operation_id
    worker = Worker(store, {"fake": load_provider(config)}, worker_id="w", idle_s=0.02)

    async def until_timed_out() -> None:
        running = asyncio.create_task(worker.run(timeout=20))
        while (await asyncio.to_thread(store.get, op_id)).state is not State.RESULT_TIMED_OUT:
            assert not running.done()
            await asyncio.sleep(0.05)
        worker.stop()
        await running

    asyncio.run(until_timed_out())
    options = escalation_bundle(store, op_id)["decision"]["options"]
    assert not any("cancel" in option["then"] for option in options), options
    assert any("console" in option["then"] for option in options), options
    done = request_cancel(store, op_id, requested_by="frank", reason="too slow")
    assert done.outcome == "person_decides" and "console" in done.message
    assert done.operation.state is State.RESULT_TIMED_OUT and fake.counts["cancels"] == 0
    out = cli("--db", db_url, "cancel", op_id, "--by", "frank", "--reason", "late", "--json")
    assert out.returncode == 3 and json.loads(out.stdout)["outcome"] == "person_decides", out.stderr
    assert fake.counts["cancels"] == 0
    store.close()


def test_a_cancel_that_lands_while_a_worker_holds_the_planned_operation_means_nothing_is_sent(
    db_url: str, fake: FakeProvider
) -> None:
    """A worker has claimed a planned operation and is about to record its attempt when a person's cancel
    withdraws it: the attempt's write is conditional on the record it read, so it is refused, and the
    worker (and any later one) sends nothing. Had the attempt landed first, the cancel would have waited
    for the create's outcome instead (a job may exist once an attempt is recorded)."""
    from jobtrail.domain.errors import StaleRecord
    from jobtrail.domain.evidence import CreateAttempt

    store = Store.open(db_url)
    config = fake.provider_config()
    jt = AsyncJobtrail(store=store, providers=[config])
    op = asyncio.run(jt.submit("fake", {"x": 9}))
    (held,) = store.claim("w1", limit=10, lease_s=30)
    assert held.operation_id == op.operation_id and held.attempts == 0
    done = request_cancel(store, op.operation_id, requested_by="alice", reason="not needed")
    assert done.outcome == "withdrawn" and done.operation.state is State.CANCELLED
    with pytest.raises(StaleRecord):
        store.record(held, CreateAttempt(attempt=1, reason="first send"), actor="worker:w1", changes={"attempts": 1})
    asyncio.run(Worker(store, {"fake": load_provider(config)}, worker_id="w2", idle_s=0.02).run(timeout=1.5))
    after = store.get(op.operation_id)
    assert after.state is State.CANCELLED and after.attempts == 0
    assert fake.counts["creates_received"] == 0 and fake.counts["cancels"] == 0
    # once an attempt is recorded, the same cancel waits for the create's outcome: it is never withdrawn
    sent = asyncio.run(jt.submit("fake", {"x": 10}))
    (claimed,) = store.claim("w1", limit=10, lease_s=30)
    store.record(claimed, CreateAttempt(attempt=1, reason="first send"), actor="worker:w1", changes={"attempts": 1})
    later = request_cancel(store, sent.operation_id, requested_by="alice", reason="not needed")
    assert later.outcome == "deferred" and later.operation.state is State.CREATE_PENDING
    assert verify(store).ok
    store.close()


# -- result collection -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "result_cfg", "check", "seen"),
    [
        ({"fake": {"result": "bad_checksum"}}, {}, "checksum", None),
        ({}, {"content_type": "text/csv"}, "content_type", "application/json"),
        (
            {"fake": {"result": "schema_bad"}},
            {"schema": {"type": "object", "required": ["items"]}},
            "json_schema",
            "'items' is a required property",
        ),
        ({}, {"records": "$.output.echo.rows", "min_records": 1}, "record_count", None),
        ({}, {"max_bytes": 10}, "size", None),
        ({"fake": {"result": "empty"}}, {}, "json", "an empty body"),  # nothing at all is no JSON document
        # {"items": 3, ..., "items": 0}: a check here would read one count, the agent's parser maybe the other
        ({"fake": {"result": "key_twice"}}, {}, "json", "names the same key twice"),
        # {"score": 1e999}: infinity to one reader, an error to another, the decimal to a third
        ({"fake": {"result": "past_float"}}, {}, "json", "the number 1e999 is past a 64-bit float's range"),
    ],
    ids=["checksum", "content-type", "schema", "record-count", "size", "empty", "key-twice", "past-float"],
)
def test_each_validation_failure_is_named(
    ledger: Store, fake: FakeProvider, body: dict[str, Any], result_cfg: dict[str, Any], check: str, seen: str | None
) -> None:
    cfg = config(fake, result=result_cfg)
    op_id = submit(ledger, cfg, body)
    work(ledger, cfg)
    op = ledger.get(op_id)
    assert op.state is S.RESULT_VALIDATION_FAILED
    evidence = ledger.history(op_id)[-1].to_json()["evidence"]
    assert evidence["check"] == check and "expected" in evidence["reason"]
    if seen:
        assert seen in evidence["reason"]
    assert "the remote job finished" in (op.state_reason or "")
    assert stored_result(ledger, op_id) is None and fake.counts["results"] == 1


@pytest.mark.parametrize(
    "lines",
    [
        [b'{"custom_id": "a", "error": null}', b'{"custom_id": "b", "error": null, "custom_id": "c"}'],
        [b'{"custom_id": "a", "error": null}', b'{"custom_id": "b", "error": null, "response": {"n": 1, "n": 2}}'],
    ],
    ids=["top-level", "nested"],
)
def test_a_batch_line_that_names_a_key_twice_fails_at_that_line(lines: list[bytes]) -> None:
    """Which id is line 2's, b or c? A batch's per-item outcomes must not rest on a parser's choice."""
    from jobtrail.domain.results import BatchFormat, ResultSpec, validate

    spec = ResultSpec(batch=BatchFormat())
    assert validate(lines[0] + b"\n", "application/x-ndjson", {}, spec).failed is None
    failed = validate(b"\n".join(lines) + b"\n", "application/x-ndjson", {}, spec).failed
    assert failed is not None and failed["check"] == "jsonl"
    assert failed["seen"].startswith("line 2: an object names the same key twice")


@pytest.mark.parametrize("depth", [900, 1010, 1100])
def test_a_result_nested_too_deep_to_read_whole_fails_and_hides_no_key_named_twice(depth: int) -> None:
    """Nesting a value a thousand levels deep must not carry a key named twice past the check (orjson reads
    deeper than Python's parser can check), nor crash the validation instead of failing it."""
    from jobtrail.domain.results import BatchFormat, ResultSpec, validate

    pad = b"[" * depth + b"]" * depth
    document = b'{"items": 3, "pad": ' + pad + b', "items": 0}'
    failed = validate(document, "application/json", {}, ResultSpec()).failed
    assert failed is not None and failed["check"] == "json"
    assert "names the same key twice" in failed["seen"] or "nested too deep" in failed["seen"]
    line = b'{"custom_id": "a", "error": null, "pad": ' + pad + b', "custom_id": "b"}\n'
    failed = validate(line, "application/x-ndjson", {}, ResultSpec(batch=BatchFormat())).failed
    assert failed is not None and failed["check"] == "jsonl" and failed["seen"].startswith("line 1")
    assert "names the same key twice" in failed["seen"] or "nested too deep" in failed["seen"]


def test_the_callers_own_check_decides_too(ledger: Store, fake: FakeProvider) -> None:
    cfg = config(fake)
    op_id = submit(ledger, cfg, {"want": 4})
    work(ledger, cfg, checks={"fake": lambda doc: doc["items"] == 4 or f"expected 4 items, got {doc['items']}"})
    op = ledger.get(op_id)
    assert op.state is S.RESULT_VALIDATION_FAILED and "expected 4 items, got 3" in (op.state_reason or "")


def test_a_named_check_from_the_provider_file(
    ledger: Store, fake: FakeProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mychecks.py").write_text("def three_items(doc):\n    return doc['items'] == 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config(fake, result={"check": "mychecks:three_items"})
    op_id = submit(ledger, cfg, {"x": 1})
    work(ledger, cfg)
    assert ledger.get(op_id).state is S.SUCCEEDED
    checks = {c["check"]: c["ok"] for c in stored_result(ledger, op_id)["checks"]}
    assert checks == {"size": True, "checksum": True, "caller_check": True}


def test_a_missing_result_is_fetched_again_until_the_result_deadline(ledger: Store, fake: FakeProvider) -> None:
    """A finished job whose result the provider does not serve (404) is fetched again with back-off until the
    result deadline, however many attempts that takes: a provider may serve it only a while after its status
    says succeeded. Before, five fetches in about three seconds ended it, with a result deadline a day away,
    and the advice was to submit it again, which runs the job a second time."""
    cfg = config(fake)
    op_id = submit(ledger, cfg, {"fake": {"result": "missing"}}, result_deadline=timedelta(seconds=4))
    work(ledger, cfg)
    op = ledger.get(op_id)
    reason = op.state_reason or ""
    assert op.state is S.RESULT_UNAVAILABLE and "the result deadline" in reason
    assert "comes before the next try" in reason
    assert "the remote job finished" in reason and fake.counts["results"] > MAX_RESULT_ATTEMPTS
    fetched = [e.at_us for e in ledger.history(op_id)]
    assert (fetched[-1] - op.created_at_us) / 1e6 > 2  # tried for as long as the deadline allowed, not 5 times
    advice = explain_advice(op)
    assert op.remote_job_id in advice and "rather than submitting again" in advice


def test_a_result_the_provider_serves_late_is_collected(ledger: Store) -> None:
    """The status says succeeded, the result endpoint answers 404 for a while, then serves it: collected."""
    late = FakeProvider(job_duration_s=0.2).start()
    try:
        cfg = config(late)
        op_id = submit(ledger, cfg, {"fake": {"result": "flaky", "flaky": MAX_RESULT_ATTEMPTS + 3}})
        work(ledger, cfg)
        op = ledger.get(op_id)
        assert op.state is S.SUCCEEDED, op.state_reason
        assert late.counts["results"] == MAX_RESULT_ATTEMPTS + 4
    finally:
        late.stop()


def test_a_result_that_fails_twice_then_arrives(ledger: Store, fake: FakeProvider) -> None:
    cfg = config(fake)
    op_id = submit(ledger, cfg, {"fake": {"result": "flaky", "flaky": 2}})
    work(ledger, cfg)
    assert ledger.get(op_id).state is S.SUCCEEDED and fake.counts["results"] == 3
    assert [o["http_status"] for o in ledger.observations(op_id) if o["kind"] == "result_fetch"] == [503, 503, 200]


def test_a_one_time_result_is_fetched_once_and_kept(db_url: str, ledger: Store, fake: FakeProvider) -> None:
    cfg = config(fake, result={"kind": "one_time"})
    op_id = submit(ledger, cfg, {"fake": {"result": "one_time"}})
    work(ledger, cfg)
    assert ledger.get(op_id).state is S.SUCCEEDED and fake.counts["results"] == 1
    first = subprocess.run(
        [sys.executable, "-m", "jobtrail", "--db", db_url, "result", op_id], capture_output=True, timeout=60
    )
    second = subprocess.run(
        [sys.executable, "-m", "jobtrail", "--db", db_url, "result", op_id], capture_output=True, timeout=60
    )
    assert first.returncode == 0 and first.stdout == second.stdout and json.loads(first.stdout)["items"] == 3
    assert fake.counts["results"] == 1  # reading the stored result never goes back to the provider


def test_a_crash_between_fetching_and_storing_a_one_time_result_is_reported(
    ledger: Store, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fetch marker is durable before the fetch; after a failure between fetch and store the next
    worker finds it and does not fetch a one-time result again."""
    cfg = config(fake, result={"kind": "one_time"})
    op_id = submit(ledger, cfg, {"fake": {"result": "one_time"}})
    monkeypatch.setenv("JOBTRAIL_FAILPOINTS", "collect.after_fetch=raise")
    work(ledger, cfg, until=lambda: fake.counts["results"] == 1, seconds=20)
    monkeypatch.delenv("JOBTRAIL_FAILPOINTS")
    assert ledger.get(op_id).state is S.RESULT_COLLECTING and ledger.get(op_id).polls == 1
    work(ledger, cfg)
    op = ledger.get(op_id)
    assert op.state is S.RESULT_UNAVAILABLE and "may be lost" in (op.state_reason or "")
    assert fake.counts["results"] == 1


def test_a_one_time_result_refused_with_an_error_is_fetched_again(ledger: Store, fake: FakeProvider) -> None:
    """A 503 hands nothing over, so fetching a one-time result again is safe (found by the simulation)."""
    cfg = config(fake, result={"kind": "one_time"})
    op_id = submit(ledger, cfg, {"fake": {"result": "flaky", "flaky": 1}})
    work(ledger, cfg)
    assert ledger.get(op_id).state is S.SUCCEEDED and fake.counts["results"] == 2
    assert [o["http_status"] for o in ledger.observations(op_id) if o["kind"] == "result_fetch"] == [503, 200]


def test_the_escalation_markdown_shows_what_came_from_outside_as_text_and_commands_whole() -> None:
    """Found by a probe: a provider's words pasted into the ticket became a tracking image, links, bold fake
    approvals and raw HTML, and a job id with a backtick ended the code span of the command to copy, so the
    command shown was the provider's. Rendered as CommonMark (with tables), none of that is made."""
    from markdown_it import MarkdownIt

    words = "OOM ![p](https://attacker.example/p.png) <img src=x onerror=alert(1)> **APPROVED** __too__ "
    words += "[login](https://x.example) WWW.attacker.example $\\text{approved}$ `"
    job = "j1`: **DONE - ops approved** `x\n\n<img src=x onerror=alert(1)>"
    command = f"jobtrail resolve a-2 --by YOUR_NAME --reason '...' --to accepted --job-id {shlex.quote(job)}"
    bundle = {
        "operation_id": "op_1",
        "provider": "fake",
        "target": "127.0.0.1",
        "remote_job_id": job,
        "trace_id": "ab" * 16,
        "state": "needs_attention",
        "reason": f"the provider reports the job failed: {json.dumps(words)}",
        "next_action": "a person decides",
        "last_remote_state": "<b>running</b>",
        "partial_effects": {"note": "<script>x</script>"},
        "provider_request_ids": ["req|1"],
        "decision": {"question": f"Which job? {job}", "options": [{"if": f"job {job} is it", "then": command}]},
        "cancel_attempts": [],
        "requests": [
            {
                "at": "t",
                "kind": "status_poll",
                "http_status": 200,
                "raw_state": "a|b",
                "remote_state": None,
                "provider_request_id": "r|2",
            }
        ],
        "history": [{"seq": 1, "at": "t", "actor": "**bob**", "from": None, "to": "failed", "cause": "c"}],
    }
    html = MarkdownIt("commonmark").enable("table").render(bundle_markdown(bundle))
    for made in ("<img", "<a ", "<script", "<b>", "<em>"):
        assert made not in html, made
    assert html.count("<strong>") == 1  # the state's own
    assert re.findall(r"<code>(.*?)</code>", html) == [escape(" ".join(command.splitlines()), quote=False)]
    assert "**APPROVED**" in html and escape("<img src=x onerror=alert(1)>", quote=False) in html
    # each table keeps its columns (a | from outside is no cell border)
    assert [row.count("<td>") for row in re.findall(r"<tr>\s*<td>.*?</tr>", html, re.S)] == [5, 6]
    # what GitHub reads beyond CommonMark: an autolink from www. in any case, and math between dollars
    shown = bundle_markdown(bundle)
    assert "WWW\\.attacker" in shown and "$" not in shown.replace("\\$", ""), shown


def test_failed_item_ids_are_shown_as_written_never_read_as_markup(
    db_url: str, ledger: Store, fake: FakeProvider
) -> None:
    """Found by a probe: a provider naming its failed items ``[/yellow]`` made ``ops show`` exit with Rich's
    MarkupError (the operation could not be looked at), and ``[link=...]`` put the provider's link on screen."""
    cfg = config(
        fake, result={"content_type": "application/x-ndjson", "batch": {"id": "$.custom_id", "error": "$.error"}}
    )
    named = "[/yellow][link=https://evil.example]ok[/link]"
    op_id = submit(ledger, cfg, {"fake": {"result": "batch", "items": 4, "failed_items": 1, "item_id": named}})
    work(ledger, cfg)
    assert ledger.get(op_id).state is S.SUCCEEDED, ledger.get(op_id).state_reason
    assert stored_result(ledger, op_id)["summary"]["failed_ids"] == [f"{named}-00000"]
    shown = subprocess.run(
        [sys.executable, "-m", "jobtrail", "--db", db_url, "ops", "show", op_id],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200", "FORCE_COLOR": "1"},
    )
    assert shown.returncode == 0, shown.stderr
    assert "partial failure: 1 of 4 items failed: " in _plain(shown.stdout)
    assert f"{named}-00000" in _plain(shown.stdout) and "\x1b]8;" not in shown.stdout  # (no hyperlink escape)


def _plain(text: str) -> str:
    """``text`` without its colour escapes."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_a_batch_with_two_failed_items_out_of_500(db_url: str, ledger: Store, fake: FakeProvider) -> None:
    cfg = config(
        fake, result={"content_type": "application/x-ndjson", "batch": {"id": "$.custom_id", "error": "$.error"}}
    )
    op_id = submit(ledger, cfg, {"fake": {"result": "batch", "items": 500, "failed_items": 2}})
    work(ledger, cfg)
    op = ledger.get(op_id)
    assert op.state is S.SUCCEEDED
    assert (op.state_reason or "").startswith("succeeded with partial failures: 2 of 500 items failed")
    summary = stored_result(ledger, op_id)["summary"]
    assert summary == {
        "items": 500,
        "succeeded": 498,
        "failed": 2,
        "failed_ids": ["item-00000", "item-00250"],
        "by_outcome": {"failed": 2, "succeeded": 498},
    }
    shown = subprocess.run(
        [sys.executable, "-m", "jobtrail", "--db", db_url, "ops", "show", op_id],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert shown.stdout.startswith("partial failure: 2 of 500 items failed: item-00000, item-00250")


def test_large_results_are_files_verified_on_read(
    db_url: str, ledger: Store, fake: FakeProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOBTRAIL_DATA_DIR", str(tmp_path / "results"))
    cfg = config(fake)
    op_id = submit(ledger, cfg, {"fake": {"result": "large", "size": 3 * INLINE_MAX_BYTES}})
    work(ledger, cfg)
    assert ledger.get(op_id).state is S.SUCCEEDED
    row, data = read_result(ledger, op_id)
    assert row["path"] and row["size"] == len(data) > INLINE_MAX_BYTES
    path = data_dir(ledger) / row["path"]
    assert path.name == row["sha256"] and path.read_bytes() == data
    out = tmp_path / "copy.json"

    def fetch(*extra: str) -> subprocess.CompletedProcess[str]:
        return cli("--db", db_url, "result", op_id, "--out", str(out), *extra, env=results, timeout=60)

    results = {"JOBTRAIL_DATA_DIR": str(tmp_path / "results")}
    got = fetch("--json")
    assert got.returncode == 0 and json.loads(got.stdout)["stored"] == "file" and out.read_bytes() == data
    # too large to inline: the answer says how to fetch it, with the command that reaches this ledger
    assert f"`{ledger.command} result {op_id} --out FILE`" in json.loads(got.stdout)["note"]
    plain = fetch("--force")
    # nothing on stdout (a script's), and a line on stderr that says what went where
    assert plain.returncode == 0 and plain.stdout == "" and out.read_bytes() == data
    assert f"wrote {len(data)} bytes (sha256 {row['sha256']}) to {out}" in plain.stderr
    path.write_bytes(data[:-10] + b"tampered!!")
    with pytest.raises(ResultCorrupted, match="does not match its sha256"):
        read_result(ledger, op_id)
    bad = fetch()
    assert bad.returncode == 2 and "altered or damaged" in bad.stderr


@pytest.mark.skipif(not os.path.exists("/proc/self/wchan"), reason="needs Linux's /proc/<pid>/wchan")
def test_a_result_on_standard_output_arrives_whole_when_the_command_is_stopped_midway(
    db_url: str, ledger: Store, fake: FakeProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``jobtrail result`` into a pipe, under PYTHONUNBUFFERED=1 (which many container images set), stopped
    and continued while the pipe is full (^Z in a pipeline, a debugger attaching): the reader still gets
    every byte. Python's unbuffered standard output dropped what one interrupted write left, silently."""
    monkeypatch.setenv("JOBTRAIL_DATA_DIR", str(tmp_path / "results"))
    cfg = config(fake)
    size = max(3 * INLINE_MAX_BYTES, 4 * pipe_capacity())  # a result four times what the pipe holds, at least
    op_id = submit(ledger, cfg, {"fake": {"result": "large", "size": size}})
    work(ledger, cfg)
    _, data = read_result(ledger, op_id)
    with subprocess.Popen(
        [sys.executable, "-m", "jobtrail", "--db", db_url, "result", op_id],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) as command:
        stop_midway_through_a_write(command.pid)
        assert command.stdout is not None
        out = command.stdout.read()
        assert command.wait(60) == 0
    assert len(out) == len(data) and out == data, f"{len(out)} of {len(data)} bytes"


@pytest.fixture
def impatient(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker in this process that gives a result up after a second of fetching, not ten minutes."""
    monkeypatch.setattr(observe, "RESULT_PATIENCE_S", 1)


def test_a_result_never_served_is_given_up_after_its_patience(
    ledger: Store, fake: FakeProvider, impatient: None
) -> None:
    cfg = config(fake)
    op_id = submit(ledger, cfg, {"fake": {"result": "missing"}})
    work(ledger, cfg)
    op = ledger.get(op_id)
    assert op.state is S.RESULT_UNAVAILABLE and "gave up after" in (op.state_reason or "")
    assert fake.counts["results"] >= MAX_RESULT_ATTEMPTS
    fetches = [e.at_us for e in ledger.history(op_id) if e.to_state == S.RESULT_COLLECTING.value]
    assert (ledger.history(op_id)[-1].at_us - fetches[-1]) / 1e6 >= 1  # fetched for its patience, not 5 quick times


def test_no_result_says_why(db_url: str, ledger: Store, fake: FakeProvider, impatient: None) -> None:
    cfg = config(fake)
    op_id = submit(ledger, cfg, {"fake": {"result": "missing"}})
    work(ledger, cfg)
    out = subprocess.run(
        [sys.executable, "-m", "jobtrail", "--db", db_url, "result", op_id], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1 and "result_unavailable" in out.stderr and "gave up" in out.stderr


def test_a_synchronous_result_is_checked_and_stored_too(ledger: Store, fake: FakeProvider) -> None:
    fake.script(Fault.synchronous())
    cfg = config(fake)
    op_id = submit(ledger, cfg, {"quick": True})
    work(ledger, cfg)
    assert ledger.get(op_id).state is S.SUCCEEDED and fake.counts["results"] == 0
    _row, data = read_result(ledger, op_id)
    assert json.loads(data)["output"] == {"echo": {"quick": True}}


def test_a_fetch_whose_ending_did_not_land_is_still_recorded(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small result's fetch lands with its ending; when checking it fails unexpectedly, the fetch that
    reached the provider is recorded all the same, and the next try collects the result."""
    import jobtrail.flows.observe as observe_flow

    fake = FakeProvider(job_duration_s=0.0).start()
    real = observe_flow.check_and_prepare
    calls = {"n": 0}

    def fails_once(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("the check broke")
        return real(*args, **kwargs)

    monkeypatch.setattr(observe_flow, "check_and_prepare", fails_once)
    try:
        store = Store.open(db_url)
        provider = fake.provider_config()
        op_id = asyncio.run(AsyncJobtrail(store=store, providers=[provider]).submit("fake", {"x": 1})).operation_id
        worker = Worker(store, {"fake": load_provider(provider)}, worker_id="w", idle_s=0.01)
        asyncio.run(worker.run(until_settled=True, timeout=30))
        assert store.get(op_id).state is State.SUCCEEDED
        fetches = [o for o in store.observations(op_id) if o["kind"] == "result_fetch"]
        assert fake.counts["results"] == 2 and len(fetches) == 2
        assert calls["n"] == 2 and worker.stats.errors == 1
        assert verify(store).ok
        store.close()
    finally:
        fake.stop()


@pytest.mark.parametrize(
    ("data", "content_type", "check"),
    [
        (b'{"text": "caf\\ud800"}', "application/json", "json"),
        (
            b'{"custom_id": "a", "error": null}\n{"custom_id": "b", "error": null, "t": "\\udc00"}\n',
            "x-ndjson",
            "jsonl",
        ),
    ],
    ids=["json", "jsonl"],
)
def test_a_result_holding_a_lone_surrogate_fails_its_check(data: bytes, content_type: str, check: str) -> None:
    """Python keeps "\\ud800", Go reads U+FFFD, a strict reader refuses it, and no UTF-8 text can hold it."""
    from jobtrail.domain.results import BatchFormat, ResultSpec, validate

    spec = ResultSpec(batch=BatchFormat()) if check == "jsonl" else ResultSpec()
    failed = validate(data, f"application/{content_type.removeprefix('application/')}", {}, spec).failed
    assert failed is not None and failed["check"] == check and "lone surrogate" in failed["seen"]
    assert validate(b'{"text": "\\ud83d\\ude00"}', "application/json", {}, ResultSpec()).failed is None  # a pair
