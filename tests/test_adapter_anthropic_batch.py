"""kind = "anthropic-batch": Anthropic Message Batches against its contract fake, with real sockets and workers."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jobtrail import AsyncJobtrail, State, Store
from jobtrail.domain.errors import ConfigError
from jobtrail.domain.states import RemoteState
from jobtrail.flows.cancel import request_cancel
from jobtrail.ledger.audit import verify
from jobtrail.ledger.results import read_result, stored_result
from jobtrail.providers.adapters.anthropic_batch import AnthropicBatchProvider, _ending
from jobtrail.providers.kinds import load_provider
from jobtrail.runtime.worker import Worker
from jobtrail.testing import provider_toml
from jobtrail.testing.fakes.anthropic_batch import AnthropicBatchFake, BatchPlan, CreateFault, check_create

from helpers import canary_hits, ledger_bytes
from processes import cli, finish, start_worker

# an adapter speaks HTTP; the ledger behind it is proven on both engines by the ledger's own tests:
# each test's SQLite run is in the fast tier, its PostgreSQL run in the long tier
pytestmark = pytest.mark.long_on_postgres

S = State
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "anthropic-batch.toml"


def batch_body(n: int, prefix: str = "q") -> dict[str, Any]:
    return {
        "requests": [
            {
                "custom_id": f"{prefix}-{i}",
                "params": {
                    "model": "claude-haiku-4-5",
                    "max_tokens": 64,
                    "messages": [{"role": "user", "content": f"question {i}"}],
                },
            }
            for i in range(n)
        ]
    }


@pytest.fixture
def api_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """A canary credential: any form of it in the ledger is a leak."""
    key = f"sk-ant-api03-{secrets.token_hex(20)}-CANARY"
    monkeypatch.setenv("ANTHROPIC_API_KEY", key)
    return key


@pytest.fixture
def fake(api_key: str) -> Iterator[AnthropicBatchFake]:
    server = AnthropicBatchFake(api_key=api_key, batch_duration_s=0.4).start()
    yield server
    server.stop()


def config(fake: AnthropicBatchFake, **overrides: Any) -> dict[str, Any]:
    return fake.provider_config(credential="env:ANTHROPIC_API_KEY", **overrides)


def provider_file(tmp_path: Path, fake: AnthropicBatchFake, **overrides: Any) -> Path:
    path = tmp_path / "anthropic.toml"
    path.write_text(provider_toml(config(fake, **overrides)), encoding="utf-8")
    return path


def submit(db_url: str, cfg: dict[str, Any], body: Any) -> str:
    async def go() -> str:
        with Store.open(db_url) as store:
            jt = AsyncJobtrail(store=store, providers=[cfg])
            op = await jt.submit("anthropic", body)
            for provider in jt.providers.values():
                await provider.aclose()
            return op.operation_id

    return asyncio.run(go())


def run_worker(db_url: str, provider: Path, api_key: str, name: str = "w1", *extra: str) -> None:
    proc = start_worker(
        db_url, provider, name, "--until-settled", "--timeout", "40", *extra, env={"ANTHROPIC_API_KEY": api_key}
    )
    code, _out, err = finish(proc, timeout=60)
    assert code == 0, err


def work(store: Store, cfg: dict[str, Any], until: Callable[[], bool], seconds: float = 20) -> None:
    """An in-process worker until ``until()`` holds (for steps a test must take between polls)."""

    async def go() -> None:
        worker = Worker(store, {"anthropic": load_provider(cfg)}, worker_id="inproc", idle_s=0.02)
        task = asyncio.create_task(worker.run(timeout=seconds))
        deadline = time.monotonic() + seconds
        while not until() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        worker.stop()
        await task
        for provider in worker.providers.values():
            await provider.aclose()

    asyncio.run(go())


def by_outcome(store: Store, op_id: str) -> dict[str, int]:
    row = stored_result(store, op_id)
    assert row is not None, f"no result stored for {op_id}: {store.get(op_id).state_reason}"
    summary: dict[str, int] = row["summary"]["by_outcome"]
    return summary


# -- (1) the whole story, with a worker killed mid-flight -------------------------------------------


def test_a_batch_survives_kill_9_of_its_worker_and_ends_as_the_api_says(
    db_url: str, tmp_path: Path, fake: AnthropicBatchFake, api_key: str
) -> None:
    """Submit, kill -9 the worker while the batch runs, restart: one batch, its results JSONL stored
    byte for byte, each item's outcome counted as the API reported it."""
    fake.plan(BatchPlan(outcomes=("succeeded", "errored", "succeeded", "expired"), duration_s=2.0))
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, config(fake), batch_body(8))
    doomed = start_worker(db_url, provider, "doomed", "--lease", "8", env={"ANTHROPIC_API_KEY": api_key})
    deadline = time.monotonic() + 20
    while fake.counts["status"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    doomed.send_signal(signal.SIGKILL)
    doomed.communicate(timeout=30)
    assert doomed.returncode == -signal.SIGKILL
    with Store.open(db_url) as store:
        mid = store.get(op_id)
        assert mid.state in (S.ACCEPTED, S.OBSERVING), mid.state_reason
        assert mid.remote_job_id in fake.batches

    run_worker(db_url, provider, api_key, "survivor", "--lease", "8")

    batch = fake.batches[mid.remote_job_id]
    with Store.open(db_url) as store:
        op = store.get(op_id)
        assert op.state is S.SUCCEEDED, op.state_reason
        assert "4 of 8 items failed" in (op.state_reason or "")
        assert by_outcome(store, op_id) == {"errored": 2, "expired": 2, "succeeded": 4}
        row = stored_result(store, op_id)
        assert row is not None and sorted(row["summary"]["failed_ids"]) == ["q-1", "q-3", "q-5", "q-7"]
        _, data = read_result(store, op_id)
        assert data == batch.results()
        assert row["sha256"] == hashlib.sha256(batch.results()).hexdigest()
        actors = {e.actor for e in store.history(op_id)}
        assert {"worker:doomed", "worker:survivor"} <= actors, actors
        assert verify(store).ok
        assert not canary_hits(api_key, ledger_bytes(store))
    assert fake.counts["creates_received"] == 1 and fake.counts["batches_created"] == 1, fake.counts
    assert fake.counts["unauthorized"] == 0 and fake.counts["bad_version"] == 0
    assert fake.counts["auth_bearer"] == 0, "the adapter sends the documented x-api-key header"
    assert fake.counts["results"] >= 1


# -- (2) endings that must not be called success ------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "state", "remote"),
    [("canceled", S.CANCELLED, RemoteState.CANCELLED), ("expired", S.FAILED, RemoteState.EXPIRED)],
)
def test_a_batch_whose_every_item_was_canceled_or_expired_is_not_a_success(
    db_url: str,
    tmp_path: Path,
    fake: AnthropicBatchFake,
    api_key: str,
    outcome: str,
    state: State,
    remote: RemoteState,
) -> None:
    """The finding: an all-canceled batch ended `succeeded` ("succeeded 2, failed 0")."""
    fake.plan(BatchPlan(outcomes=(outcome,)))
    op_id = submit(db_url, config(fake), batch_body(2))
    run_worker(db_url, provider_file(tmp_path, fake), api_key)
    with Store.open(db_url) as store:
        op = store.get(op_id)
        assert op.state is state, op.state_reason
        assert "succeeded" not in (op.state_reason or "")
        ending = store.history(op_id)[-1]
        assert ending.to_state == state.value
        assert ending.to_json()["evidence"]["remote_state"] == remote.value
        assert stored_result(store, op_id) is None  # nothing ran: no output to keep
    assert fake.counts["batches_created"] == 1 and fake.counts["results"] == 0


def test_a_cancel_that_lands_after_the_batch_finished_is_a_success(
    db_url: str, fake: AnthropicBatchFake, api_key: str
) -> None:
    """A batch ended with nothing canceled although a cancel was sent: it finished first, its result is collected."""
    fake.plan(BatchPlan(outcomes=("succeeded",), duration_s=1.0))
    cfg = config(fake)
    op_id = submit(db_url, cfg, batch_body(3))
    with Store.open(db_url) as store:
        work(store, cfg, until=lambda: store.get(op_id).state is S.OBSERVING)
        batch = fake.batches[store.get(op_id).remote_job_id or ""]
        batch.duration_s = 0.0  # it finishes now, before the cancel arrives
        request_cancel(store, op_id, requested_by="alice", reason="changed my mind")
        work(store, cfg, until=lambda: store.get(op_id).state in (S.SUCCEEDED, S.CANCELLED, S.FAILED))
        op = store.get(op_id)
        assert op.state is S.SUCCEEDED, op.state_reason
        assert by_outcome(store, op_id) == {"succeeded": 3}
    assert fake.counts["cancels"] <= 1


def test_a_cancelled_batch_keeps_the_items_that_ran(db_url: str, fake: AnthropicBatchFake, api_key: str) -> None:
    """Cancelled after half the items ran: `cancelled`, with the results JSONL of what ran stored."""
    fake.plan(BatchPlan(outcomes=("succeeded", "errored"), duration_s=30.0, done_before_cancel=0.5))
    cfg = config(fake)
    op_id = submit(db_url, cfg, batch_body(4))
    with Store.open(db_url) as store:
        work(store, cfg, until=lambda: store.get(op_id).state is S.OBSERVING)
        request_cancel(store, op_id, requested_by="alice", reason="enough", expected_effect="keep what ran")
        work(store, cfg, until=lambda: store.get(op_id).state in (S.CANCELLED, S.SUCCEEDED, S.FAILED))
        op = store.get(op_id)
        assert fake.counts["cancels"] == 1
        assert op.state is S.CANCELLED, op.state_reason
        ending = store.history(op_id)[-1].to_json()
        assert ending["evidence"]["result_ref"] == f"{fake.base_url}/v1/messages/batches/{op.remote_job_id}/results"
        assert by_outcome(store, op_id) == {"canceled": 2, "errored": 1, "succeeded": 1}
        assert verify(store).ok


# -- (3) a create whose answer is lost --------------------------------------------------------------


def _lost_create(db_url: str, tmp_path: Path, fake: AnthropicBatchFake, api_key: str) -> tuple[str, str, list[str]]:
    others = [
        fake.add_batch(3, age_s=3600),  # long before the create: outside the window
        fake.add_batch(5, age_s=1),  # in the window, but not our request count
    ]
    fake.script(CreateFault.drop())
    op_id = submit(db_url, config(fake), batch_body(3))
    run_worker(db_url, provider_file(tmp_path, fake), api_key)
    ours = [b for b in fake.batches if b not in others]
    assert len(ours) == 1
    return op_id, ours[0], others


def test_a_lost_create_response_stops_at_needs_attention_with_exactly_one_batch(
    db_url: str, tmp_path: Path, fake: AnthropicBatchFake, api_key: str
) -> None:
    """The batch was committed and its answer lost: no second create, ever; a person decides."""
    op_id, _ours, _ = _lost_create(db_url, tmp_path, fake, api_key)
    with Store.open(db_url) as store:
        op = store.get(op_id)
        assert op.state is S.NEEDS_ATTENTION, op.state_reason
        assert op.remote_job_id is None, "nothing ties a batch to us: none is adopted"
        assert "at-most-once not guaranteed" in (op.state_reason or "")
        assert op.attempts == 1
    assert fake.counts["creates_received"] == 1 and fake.counts["batches_created"] == 1, fake.counts


def test_needs_attention_names_the_batches_created_in_the_window(
    db_url: str, tmp_path: Path, fake: AnthropicBatchFake, api_key: str
) -> None:
    """The reason and the evidence name our batch (never an older one, never one of another size)."""
    op_id, ours, others = _lost_create(db_url, tmp_path, fake, api_key)
    with Store.open(db_url) as store:
        op = store.get(op_id)
        assert op.state is S.NEEDS_ATTENTION
        assert ours in (op.state_reason or "")
        assert not any(other in (op.state_reason or "") for other in others)
        evidence = store.history(op_id)[-1].to_json()["evidence"]
        assert list(evidence["candidates"]) == [ours]
        assert op.remote_job_id is None
    assert fake.counts["lists"] >= 1 and fake.counts["batches_created"] == 1


def test_candidates_pages_through_the_listing_and_keeps_only_the_window(
    db_url: str, fake: AnthropicBatchFake, api_key: str
) -> None:
    """The adapter's listing: newest first, page by page by after_id, stopping at the window's start."""
    fake.page_size = 2
    old = [fake.add_batch(3, age_s=7200 + i) for i in range(3)]
    other_size = fake.add_batch(4, age_s=5)
    in_window = [fake.add_batch(3, age_s=10 - i) for i in range(3)]
    with Store.open(db_url) as store:
        jt = AsyncJobtrail(store=store, providers=[config(fake)])

        async def go() -> Any:
            record = await jt.submit("anthropic", batch_body(3))
            provider = jt.providers["anthropic"]
            assert isinstance(provider, AnthropicBatchProvider)
            now_us = time.time_ns() // 1000
            listed = await provider.candidates(record, now_us - 60_000_000, now_us)
            await provider.aclose()
            return listed

        listed = asyncio.run(go())
    assert listed.kind == "candidates", listed.detail
    assert sorted(listed.remote_job_ids) == sorted(in_window)
    assert other_size in listed.response.body["other_request_count"]
    assert not set(old) & set(listed.remote_job_ids)
    # 4 in the window and the first older one: 3 pages of 2, and no page beyond the window's start
    assert fake.counts["lists"] == 3
    assert fake.counts["creates_received"] == 0


def test_a_listing_that_fails_names_no_candidates_and_says_why(
    db_url: str, tmp_path: Path, fake: AnthropicBatchFake, api_key: str
) -> None:
    """The list endpoint answers 500: still needs_attention, still one batch, and the reason says the list failed."""
    fake.script(CreateFault.drop())
    fake.script_list(CreateFault.http(500))
    op_id = submit(db_url, config(fake), batch_body(2))
    run_worker(db_url, provider_file(tmp_path, fake), api_key)
    with Store.open(db_url) as store:
        op = store.get(op_id)
        assert op.state is S.NEEDS_ATTENTION
        assert "could not be listed (listing batches: HTTP 500" in (op.state_reason or "")
        assert not store.history(op_id)[-1].to_json()["evidence"].get("candidates")
    assert fake.counts["creates_received"] == 1 and fake.counts["batches_created"] == 1


@pytest.mark.parametrize("fault", [CreateFault.rate_limited("1"), CreateFault.overloaded()], ids=["429", "529"])
def test_a_create_answered_429_or_529_is_not_resent(
    db_url: str, tmp_path: Path, fake: AnthropicBatchFake, api_key: str, fault: CreateFault
) -> None:
    """Without an idempotency key a doubtful create is never re-sent: it waits for a person."""
    fake.script(fault)
    op_id = submit(db_url, config(fake), batch_body(2))
    run_worker(db_url, provider_file(tmp_path, fake), api_key)
    with Store.open(db_url) as store:
        op = store.get(op_id)
        assert op.state is S.NEEDS_ATTENTION, op.state_reason
        doubt = next(e for e in store.history(op_id) if e.cause == "ambiguous_create").to_json()["evidence"]
        assert doubt["http_status"] == fault.status and doubt["error_class"] == f"http_{fault.status}"
        if fault.retry_after:
            assert doubt["retry_after_s"] == 1.0
    assert fake.counts["creates_received"] == 1 and fake.counts["batches_created"] == 0


def test_status_reads_honour_retry_after_and_ride_out_529(db_url: str, fake: AnthropicBatchFake, api_key: str) -> None:
    """A 429 on a status read puts the next read retry-after seconds later; a 529 is one failed poll, not an ending."""
    fake.plan(BatchPlan(outcomes=("succeeded",), duration_s=0.2))
    fake.script_status(CreateFault.rate_limited("2"), CreateFault.overloaded())
    cfg = config(fake)
    op_id = submit(db_url, cfg, batch_body(2))
    with Store.open(db_url) as store:
        work(store, cfg, until=lambda: store.get(op_id).state is S.SUCCEEDED)
        assert store.get(op_id).state is S.SUCCEEDED
        polls = [o for o in store.observations(op_id) if o["kind"] == "status_poll"]
        assert [o["http_status"] for o in polls[:3]] == [429, 529, 200]
    reads = [(at, status) for at, method, path, status in fake.requests if method == "GET" and "results" not in path]
    assert [status for _, status in reads[:3]] == [429, 529, 200]
    assert reads[1][0] - reads[0][0] >= 2.0, "the read after the 429 came before its retry-after"
    assert fake.counts["batches_created"] == 1


def test_a_refused_create_fails_with_the_api_s_error_type(
    db_url: str, tmp_path: Path, fake: AnthropicBatchFake, api_key: str
) -> None:
    """A body the SDK's request types refuse (max_tokens missing) is refused by the fake: failed, not retried."""
    body = batch_body(1)
    del body["requests"][0]["params"]["max_tokens"]
    op_id = submit(db_url, config(fake), body)
    run_worker(db_url, provider_file(tmp_path, fake), api_key)
    with Store.open(db_url) as store:
        op = store.get(op_id)
        assert op.state is S.FAILED
        assert "invalid_request_error" in (op.state_reason or "")
    assert fake.counts["creates_received"] == 1 and fake.counts["bad_request"] == 1


# -- (4) the credential ------------------------------------------------------------------------------


def test_the_api_key_never_reaches_the_ledger(
    db_url: str, tmp_path: Path, fake: AnthropicBatchFake, api_key: str
) -> None:
    """Create, polls, results, a lost create and a rate limit: the x-api-key value is nowhere in the database."""
    fake.plan(BatchPlan(outcomes=("succeeded", "errored")))
    done = submit(db_url, config(fake), batch_body(2))
    run_worker(db_url, provider_file(tmp_path, fake), api_key)
    fake.script(CreateFault.drop(), CreateFault.rate_limited("0"))
    lost = submit(db_url, config(fake), batch_body(2, "lost"))
    limited = submit(db_url, config(fake), batch_body(2, "limited"))
    run_worker(db_url, provider_file(tmp_path, fake), api_key, "w2", "--concurrency", "1")
    with Store.open(db_url) as store:
        assert store.get(done).state is S.SUCCEEDED
        assert {store.get(lost).state, store.get(limited).state} == {S.NEEDS_ATTENTION}
        assert canary_hits(api_key, ledger_bytes(store)) == []
    assert all(h.get("x-api-key") == api_key for h in fake.create_headers), "sent on every create"
    assert not any(k.lower() == "idempotency-key" for h in fake.create_headers for k in h)
    assert fake.counts["unauthorized"] == 0 and fake.counts["auth_bearer"] == 0


def test_a_wrong_key_is_refused_and_never_creates(db_url: str, tmp_path: Path, api_key: str) -> None:
    """The fake insists on x-api-key: the adapter's create with another key fails on 401."""
    with AnthropicBatchFake(api_key="sk-ant-the-right-one") as other:
        op_id = submit(db_url, config(other), batch_body(1))
        run_worker(db_url, provider_file(tmp_path, other), api_key)
        with Store.open(db_url) as store:
            op = store.get(op_id)
            assert op.state is S.FAILED and "authentication_error" in (op.state_reason or "")
        assert other.counts["unauthorized"] >= 1 and other.counts["batches_created"] == 0


# -- (5) what the operator is told ---------------------------------------------------------------


def test_providers_check_says_at_most_once_is_not_guaranteed_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)  # a reference is checked, never resolved
    done = cli("providers", "check", str(EXAMPLE), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["kind"] == "anthropic-batch" and report["at_most_once"] is False
    assert report["base_url"] == "https://api.anthropic.com"
    assert report["credential"] == "env:ANTHROPIC_API_KEY"
    once = report["guarantees"]["at-most-once creation"]
    assert once["verdict"] == "no" and "no idempotency token" in once["why"]
    assert "no idempotency key" in report["contract"] and "needs_attention" in report["contract"]
    text = cli("providers", "check", str(EXAMPLE))
    assert text.returncode == 0 and "at-most-once creation" in text.stdout and "no idempotency" in text.stdout


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"create": {"path": "/v1/other"}}, "'create' is fixed by kind = 'anthropic-batch'"),
        ({"auth": "bearer"}, "'auth' is fixed"),
        ({"credential": None}, "credential is missing"),
        ({"anthropic_version": "latest"}, "anthropic_version: expected a date"),
        ({"webhooks": {"secrets": ["env:X"]}}, "no webhook events for message batches"),
    ],
)
def test_the_operator_file_may_set_only_what_the_operator_decides(extra: dict[str, Any], named: str) -> None:
    data: dict[str, Any] = {"kind": "anthropic-batch", "credential": "env:ANTHROPIC_API_KEY", **extra}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        load_provider(data)


def test_the_example_file_loads_the_adapter_with_its_defaults() -> None:
    provider = load_provider(EXAMPLE)
    assert isinstance(provider, AnthropicBatchProvider)
    assert provider.config.headers == {"anthropic-version": "2023-06-01"}
    assert provider.config.credential is not None and provider.config.credential.scheme == "header:x-api-key"
    assert provider.create_endpoint == "POST /v1/messages/batches"
    assert provider.capabilities.token.where == "none" and provider.capabilities.reconcile == ()
    assert provider.poll_backoff.initial_s == 30


# -- the ending rule and the fake's own contract -------------------------------------------------------


@pytest.mark.parametrize(
    ("counts", "ending"),
    [
        ({"succeeded": 3}, RemoteState.SUCCEEDED),
        ({"errored": 3}, RemoteState.SUCCEEDED),  # it ran: per-item outcomes say every item failed
        ({"succeeded": 2, "expired": 1}, RemoteState.SUCCEEDED),
        ({"canceled": 3}, RemoteState.CANCELLED),
        ({"expired": 3}, RemoteState.EXPIRED),
        ({"succeeded": 1, "canceled": 2}, RemoteState.CANCELLED),
        ({"expired": 1, "canceled": 2}, RemoteState.CANCELLED),
    ],
)
def test_an_ended_batch_ends_as_its_request_counts_say(counts: dict[str, int], ending: RemoteState) -> None:
    full = {"processing": 0, "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0, **counts}
    assert _ending(full, sum(full.values())) is ending


def test_the_fake_answers_in_the_sdk_s_own_shapes(fake: AnthropicBatchFake, api_key: str) -> None:
    """The SDK itself, pointed at the fake, reads every answer (create, retrieve, list pages, cancel, results)."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(api_key=api_key, base_url=fake.base_url, max_retries=0)
    created = client.messages.batches.create(requests=batch_body(2)["requests"])  # type: ignore[arg-type]
    assert created.processing_status == "in_progress" and created.request_counts.processing == 2
    older = fake.add_batch(1, age_s=100)
    fake.page_size = 1
    assert [b.id for b in client.messages.batches.list(limit=1)] == [created.id, older]  # newest first, 2 pages
    assert fake.counts["lists"] == 2 and fake.counts["auth_bearer"] > 0
    time.sleep(0.5)
    ended = client.messages.batches.retrieve(created.id)
    assert ended.processing_status == "ended" and ended.request_counts.succeeded == 2
    assert ended.results_url == f"{fake.base_url}/v1/messages/batches/{created.id}/results"
    lines = list(client.messages.batches.results(created.id))
    assert sorted(line.custom_id for line in lines) == ["q-0", "q-1"]
    assert {line.result.type for line in lines} == {"succeeded"}
    bad = anthropic.Anthropic(api_key="sk-ant-wrong", base_url=fake.base_url, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.batches.retrieve(created.id)
    client.close()
    bad.close()


def test_the_fake_checks_create_bodies_against_the_sdk_request_types() -> None:
    assert check_create(batch_body(2)) is None
    assert "custom_id" in (check_create({"requests": [{"custom_id": "a b", "params": {}}]}) or "")
    dup = batch_body(2)
    dup["requests"][1]["custom_id"] = "q-0"
    assert "not unique" in (check_create(dup) or "")
    pytest.importorskip("anthropic")
    wrong = batch_body(1)
    wrong["requests"][0]["params"]["messages"] = [{"role": "robot", "content": "x"}]
    assert "role" in (check_create(wrong) or "")


# -- a provider that lies (found by probing against a strict server) --------------------------------------


def _settle(db_url: str, cfg: dict[str, Any], body: Any, *, result_deadline_s: float = 600) -> str:
    """Submit and run an in-process worker until nothing is left to do (a short result deadline ends a
    result that is never good enough instead of fetching it again for RESULT_PATIENCE_S)."""
    from datetime import timedelta

    async def go() -> str:
        with Store.open(db_url) as store:
            jt = AsyncJobtrail(store=store, providers=[cfg])
            op = await jt.submit("anthropic", body, result_deadline=timedelta(seconds=result_deadline_s))
            worker = Worker(store, {"anthropic": load_provider(cfg)}, worker_id="w", idle_s=0.02)
            await worker.run(until_settled=True, timeout=15)
            for provider in [*worker.providers.values(), *jt.providers.values()]:
                await provider.aclose()
            return op.operation_id

    return asyncio.run(go())


def test_a_results_url_that_appears_after_ended_is_collected(db_url: str, fake: AnthropicBatchFake) -> None:
    """The first status read says ended with results_url null: the collector reads the batch again for it
    (it ended result_unavailable, blaming a [result] path the operator may not even set)."""
    fake.plan(BatchPlan(outcomes=("succeeded", "errored"), duration_s=0.1, results_url_hidden_reads=1))
    op_id = _settle(db_url, config(fake), batch_body(4))
    with Store.open(db_url) as store:
        op = store.get(op_id)
        assert op.state is S.SUCCEEDED, op.state_reason
        assert by_outcome(store, op_id) == {"errored": 2, "succeeded": 2}
        assert [o["http_status"] for o in store.observations(op_id) if o["kind"] == "result_fetch"] == [200]
        assert verify(store).ok
    assert fake.counts["results"] == 1 and fake.counts["batches_created"] == 1


def test_a_results_file_cut_short_at_a_line_is_not_stored_as_success(db_url: str, fake: AnthropicBatchFake) -> None:
    """The results JSONL lost its last line (still well-formed): stored as success with an item missing.
    Every request has a line, so fewer lines than request_counts is refused, and the record says why."""
    fake.plan(BatchPlan(outcomes=("succeeded",), duration_s=0.1, lines_lost=1))
    op_id = _settle(db_url, config(fake), batch_body(3), result_deadline_s=3)
    with Store.open(db_url) as store:
        op = store.get(op_id)
        assert op.state is S.RESULT_UNAVAILABLE, op.state_reason
        assert "incomplete_result" in (op.state_reason or "") and "holds 2 line(s)" in (op.state_reason or "")
        assert stored_result(store, op_id) is None
        assert verify(store).ok
    assert fake.counts["results"] >= 1 and fake.counts["batches_created"] == 1


def test_a_listing_that_repeats_its_cursor_is_named_as_such(
    db_url: str, tmp_path: Path, fake: AnthropicBatchFake, api_key: str
) -> None:
    """A lost create, then every list page says has_more with the same last_id: the listing stops at the
    repeat (2 requests, not LIST_PAGES) and says so, instead of "more than 2000 batches are newer"."""
    fake.list_repeats = True
    fake.script(CreateFault.drop())
    op_id = _settle(db_url, config(fake), batch_body(2))
    with Store.open(db_url) as store:
        op = store.get(op_id)
        assert op.state is S.NEEDS_ATTENTION, op.state_reason
        assert "last_id repeats" in (op.state_reason or "")
        assert op.remote_job_id is None
    assert fake.counts["lists"] == 2
    assert fake.counts["creates_received"] == 1 and fake.counts["batches_created"] == 1
