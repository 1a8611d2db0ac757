"""kind = "openai-batch" against its contract fake (real sockets), on SQLite and PostgreSQL.

The fake answers with the ``openai`` SDK's own types and checks our create requests against the
SDK's request type, so every test here also asserts ``fake.shape_errors == []``.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobtrail import AsyncJobtrail, State, Store
from jobtrail.domain.errors import ConfigError
from jobtrail.ledger.audit import verify
from jobtrail.providers.adapters.openai_batch import TOKEN_KEY, OpenAIBatchProvider
from jobtrail.providers.kinds import load_provider
from jobtrail.runtime.worker import Worker
from jobtrail.testing.fakes.openai_batch import BatchPlan, Fault, OpenAIBatchFake

from processes import cli, finish, start_worker

# an adapter speaks HTTP; the ledger behind it is proven on both engines by the ledger's own tests:
# each test's SQLite run is in the fast tier, its PostgreSQL run in the long tier
pytestmark = pytest.mark.long_on_postgres

S = State
NAME = "openai-batch"
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "openai-batch.toml"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[OpenAIBatchFake]:
    server = OpenAIBatchFake().start()
    assert server.api_key is not None
    monkeypatch.setenv("OPENAI_API_KEY", server.api_key)
    yield server
    server.stop()
    assert server.shape_errors == [], "a create request did not match openai.types.batch_create_params"
    assert server.counts["unauthorized"] == 0, "every request carried the API key"


def config(fake: OpenAIBatchFake, **overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "kind": NAME,
        "base_url": fake.base_url,
        "credential": "env:OPENAI_API_KEY",
        "timeout_s": 2,
        "connect_timeout_s": 1,
        "retry": {"initial_s": 0.05, "factor": 2, "cap_s": 0.3},
        "poll": {"initial_s": 0.1, "factor": 1.5, "cap_s": 0.3},
    }
    return base | overrides


def provider_file(path: Path, fake: OpenAIBatchFake) -> Path:
    cfg = config(fake)
    lines = [f"{k} = {json.dumps(v)}" for k, v in cfg.items() if not isinstance(v, dict)]
    for table in ("retry", "poll"):
        lines.append(f"[{table}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in cfg[table].items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def settle(db_url: str, fake: OpenAIBatchFake, request: dict[str, Any], *, timeout: float = 20) -> Any:
    """Submit ``request`` and run an in-process worker until nothing is left to do; the final record."""

    async def go() -> Any:
        store = Store.open(db_url)
        jt = AsyncJobtrail(store=store, providers=[config(fake)])
        op = await jt.submit(NAME, request, caller="test")
        await run_worker(store, fake, timeout=timeout)
        final = store.get(op.operation_id)
        await jt.aclose()
        return final

    return asyncio.run(go())


async def run_worker(store: Store, fake: OpenAIBatchFake, *, timeout: float = 20) -> None:
    worker = Worker(store, {NAME: load_provider(config(fake))}, worker_id="w", idle_s=0.01, lease_s=10)
    try:
        await worker.run(until_settled=True, timeout=timeout)
    finally:
        await worker.providers[NAME].aclose()


def stored(db_url: str, op_id: str) -> tuple[Any, list[Any], list[dict[str, Any]], tuple[dict[str, Any], bytes] | None]:
    """(record, history, observations, stored result or None) of one operation."""
    from jobtrail.domain.results import ResultMissing
    from jobtrail.ledger.results import read_result

    with Store.open(db_url) as store:
        try:
            result: tuple[dict[str, Any], bytes] | None = read_result(store, op_id)
        except ResultMissing:
            result = None
        assert verify(store).ok
        return store.get(op_id), store.history(op_id), store.observations(op_id), result


def assert_no_key_stored(fake: OpenAIBatchFake, history: list[Any], observations: list[dict[str, Any]]) -> None:
    assert fake.api_key is not None
    dumped = json.dumps([e.to_json() for e in history]) + json.dumps(observations, default=str)
    assert fake.api_key not in dumped


def expected_result(fake: OpenAIBatchFake, batch_id: str) -> bytes:
    doc = fake.batch(batch_id)
    parts = [fake.file_content(doc[k]) for k in ("output_file_id", "error_file_id") if doc[k]]
    return b"".join(parts)


# -- (1) end to end, through a kill -9 -----------------------------------------------------------------------


@pytest.mark.timeout(300)  # two worker processes, each with its writer process: slow on a slow, busy machine
def test_a_batch_survives_kill_9_of_its_worker(db_url: str, fake: OpenAIBatchFake, tmp_path: Path) -> None:
    """Submit, kill -9 the worker while it polls, restart: the operation ends as the fake says, with the
    combined result and per-item outcomes stored, and the fake saw exactly one batch."""
    file_id = fake.add_input_file(20, BatchPlan(duration_s=3.0, failed_items=3))
    with Store.open(db_url) as store:
        jt = AsyncJobtrail(store=store, providers=[config(fake)])
        op = asyncio.run(jt.submit(NAME, {"input_file_id": file_id}, caller="test"))
    provider = provider_file(tmp_path / "openai.toml", fake)
    env = {"OPENAI_API_KEY": str(fake.api_key)}
    doomed = start_worker(db_url, provider, "doomed", "--lease", "4", env=env)
    # (a worker's start, imports and writer process included, took over 30 s once in a CI run on a slow machine)
    deadline = time.monotonic() + 120
    # killed once it polls the batch (its job id known, a status read made)
    while fake.counts["status"] < 1 and time.monotonic() < deadline and doomed.poll() is None:
        time.sleep(0.02)
    doomed.send_signal(signal.SIGKILL)
    _out, err = doomed.communicate(timeout=30)
    assert doomed.returncode == -signal.SIGKILL, err
    assert fake.counts["batches_created"] == 1 and fake.counts["status"] >= 1, (dict(fake.counts), err)
    with Store.open(db_url) as store:
        assert store.get(op.operation_id).state in (S.ACCEPTED, S.OBSERVING)
    survivor = start_worker(db_url, provider, "survivor", "--until-settled", "--timeout", "40", "--lease", "4", env=env)
    code, _out, err = finish(survivor)
    assert code == 0, err
    record, history, observations, result = stored(db_url, op.operation_id)
    assert record.state is S.SUCCEEDED, record.state_reason
    assert fake.counts["creates_received"] == 1 and fake.counts["batches_created"] == 1
    assert fake.batches_with(TOKEN_KEY, record.idempotency_token) == [record.remote_job_id]
    assert result is not None
    row, data = result
    assert data == expected_result(fake, record.remote_job_id)
    assert row["summary"]["items"] == 20 and row["summary"]["failed"] == 3
    assert sorted(row["summary"]["failed_ids"]) == ["req-00000", "req-00006", "req-00013"]
    actors = {e.actor for e in history}
    assert {"worker:doomed", "worker:survivor"} <= actors
    assert_no_key_stored(fake, history, observations)


@pytest.mark.parametrize(
    ("point", "batches_seen"),
    [("create.after_attempt", 0), ("create.after_response", 1)],
    ids=["before-send", "after-commit"],
)
def test_a_worker_dying_around_the_create_leaves_one_batch(
    db_url: str, fake: OpenAIBatchFake, tmp_path: Path, point: str, batches_seen: int
) -> None:
    """The worker process dies (exit 137, like kill -9) with the attempt durable, before the send or after
    OpenAI committed the batch with nothing of the answer stored; the next worker finds the attempt open,
    lists batches for the token and either adopts the batch or proves there is none and sends once."""
    file_id = fake.add_input_file(5, BatchPlan(duration_s=0.5))
    with Store.open(db_url) as store:
        jt = AsyncJobtrail(store=store, providers=[config(fake)])
        op = asyncio.run(jt.submit(NAME, {"input_file_id": file_id}, caller="test"))
    provider = provider_file(tmp_path / "openai.toml", fake)
    env = {"OPENAI_API_KEY": str(fake.api_key)}
    died = start_worker(db_url, provider, "dies", "--lease", "4", env=env | {"JOBTRAIL_FAILPOINTS": f"{point}=exit"})
    assert finish(died, timeout=60)[0] == 137
    assert fake.counts["batches_created"] == batches_seen
    survivor = start_worker(db_url, provider, "next", "--until-settled", "--timeout", "40", "--lease", "4", env=env)
    code, _out, err = finish(survivor)
    assert code == 0, err
    record, history, _obs, result = stored(db_url, op.operation_id)
    assert record.state is S.SUCCEEDED, record.state_reason
    assert fake.counts["batches_created"] == 1
    assert fake.batches_with(TOKEN_KEY, record.idempotency_token) == [record.remote_job_id]
    causes = [e.cause for e in history]
    assert "ambiguous_create" in causes  # the open attempt was doubted, never assumed
    assert ("proved_absent" in causes) is (batches_seen == 0)
    assert fake.counts["creates_received"] == 1
    assert result is not None and result[0]["summary"]["items"] == 5


# -- (2) lost create responses and rate limits ------------------------------------------------------------


def test_a_lost_create_response_is_reconciled_by_listing_across_pages(db_url: str, fake: OpenAIBatchFake) -> None:
    """The batch is committed and the answer lost; 150 newer batches of someone else push ours to page 2;
    listing finds it there and stops at the first batch older than the operation: one batch, two lists."""
    fake.add_foreign_batches(5, age_s=7200)  # older than the operation: paging must stop at them
    fake.add_foreign_batches(150, age_s=-30)  # listed before ours (newest first)
    file_id = fake.add_input_file(4, BatchPlan(duration_s=0.4))
    fake.script("create", Fault.lost_response())
    op = settle(db_url, fake, {"input_file_id": file_id})
    record, history, observations, result = stored(db_url, op.operation_id)
    assert record.state is S.SUCCEEDED, record.state_reason
    assert fake.counts["creates_received"] == 1 and fake.counts["batches_created"] == 1
    assert fake.counts["lists"] == 2, "page 1 (100 newer batches), page 2 (ours, then older ones: stop)"
    assert [e.cause for e in history][:6] == [
        "operation_created",
        "create_attempt",
        "ambiguous_create",
        "reconciliation_started",
        "confirmed_create",
        "status_observation",
    ]
    lookup = next(o for o in observations if o["kind"] == "reconcile_lookup")
    assert lookup["raw"]["kind"] == "found"
    assert lookup["raw"]["body"]["pages"] == 2 and lookup["raw"]["body"]["matched"] == [record.remote_job_id]
    assert lookup["raw"]["body"]["stopped"] == "reached objects created before the operation"
    assert result is not None and result[0]["summary"]["items"] == 4
    assert_no_key_stored(fake, history, observations)


def test_candidates_are_the_untagged_batches_of_the_window(fake: OpenAIBatchFake, tmp_path: Path) -> None:
    """Where a person must decide: batches created around the create that carry no jobtrail token."""
    old = fake.add_foreign_batches(2, age_s=7200)
    near = fake.add_foreign_batches(3)
    file_id = fake.add_input_file(2, BatchPlan(duration_s=0.2))
    provider = load_provider(config(fake))

    async def go() -> Any:
        store = Store.open(str(tmp_path / "ledger.db"))
        jt = AsyncJobtrail(store=store, providers=[provider])
        op = await jt.drive_create((await jt.submit(NAME, {"input_file_id": file_id}, caller="test")).operation_id)
        found = await provider.candidates(op, op.created_at_us - 1_000_000, store.clock())
        await jt.aclose()
        return op, found

    op, found = asyncio.run(go())
    assert found.kind == "candidates" and sorted(found.remote_job_ids) == sorted(near)
    assert op.remote_job_id not in found.remote_job_ids and not set(old) & set(found.remote_job_ids)


@pytest.mark.parametrize("committed", [True, False], ids=["committed", "not-committed"])
def test_a_500_on_create_is_reconciled_never_duplicated(db_url: str, fake: OpenAIBatchFake, committed: bool) -> None:
    """500 after the commit: listing finds the batch. 500 before it: listing proves absence, the same token
    is sent again. Either way exactly one batch."""
    file_id = fake.add_input_file(3, BatchPlan(duration_s=0.3))
    fake.script("create", Fault.server_error(commit=committed))
    op = settle(db_url, fake, {"input_file_id": file_id})
    record, history, _obs, _result = stored(db_url, op.operation_id)
    assert record.state is S.SUCCEEDED, record.state_reason
    assert fake.counts["batches_created"] == 1
    assert fake.counts["creates_received"] == (1 if committed else 2)
    causes = [e.cause for e in history]
    assert ("proved_absent" in causes) is (not committed)
    tokens = {b["metadata"][TOKEN_KEY] for b in fake.create_bodies}
    assert tokens == {record.idempotency_token}, "a re-send carries the same token"


def test_429_waits_as_retry_after_ms_says(db_url: str, fake: OpenAIBatchFake) -> None:
    """429 with retry-after: 1 and retry-after-ms: 250: the wait recorded is OpenAI's precise 0.25 s."""
    file_id = fake.add_input_file(2, BatchPlan(duration_s=0.3))
    fake.script("create", Fault.rate_limited(retry_after_ms=250, retry_after=1))
    op = settle(db_url, fake, {"input_file_id": file_id})
    record, history, _obs, _result = stored(db_url, op.operation_id)
    assert record.state is S.SUCCEEDED, record.state_reason
    assert fake.counts["creates_received"] == 2 and fake.counts["batches_created"] == 1
    ambiguous = json.loads(next(e for e in history if e.cause == "ambiguous_create").evidence)
    assert ambiguous["http_status"] == 429 and ambiguous["retry_after_s"] == 0.25


def test_a_rate_limited_status_poll_waits_as_retry_after_ms_says(db_url: str, fake: OpenAIBatchFake) -> None:
    """429 on GET /v1/batches/{id} with retry-after: 5 and retry-after-ms: 700: the next poll is 0.7 s later."""
    file_id = fake.add_input_file(2, BatchPlan(duration_s=0.3))
    fake.script("retrieve", Fault.rate_limited(retry_after_ms=700, retry_after=5))
    op = settle(db_url, fake, {"input_file_id": file_id})
    record, _history, observations, _result = stored(db_url, op.operation_id)
    assert record.state is S.SUCCEEDED, record.state_reason
    polls = [o for o in observations if o["kind"] == "status_poll"]
    limited = polls[0]
    assert limited["http_status"] == 429 and limited["raw"]["error_class"] == "http_429"
    assert limited["next_action_at_us"] - limited["fetched_at_us"] == pytest.approx(700_000, abs=60_000)
    assert polls[1]["fetched_at_us"] >= limited["next_action_at_us"]


# -- (3) the caller's metadata ------------------------------------------------------------------------------


def test_the_callers_metadata_survives_merged_with_the_token(db_url: str, fake: OpenAIBatchFake) -> None:
    file_id = fake.add_input_file(2, BatchPlan(duration_s=0.3))
    mine = {"team": "search", "ticket": "T-42"}
    request = {"input_file_id": file_id, "endpoint": "/v1/embeddings", "metadata": mine}
    op = settle(db_url, fake, request)
    record, _history, _obs, _result = stored(db_url, op.operation_id)
    assert record.state is S.SUCCEEDED
    assert record.request_body == request, "the operation keeps the caller's request as submitted"
    sent = fake.create_bodies[0]
    assert sent["metadata"] == {**mine, TOKEN_KEY: record.idempotency_token}
    assert sent["endpoint"] == "/v1/embeddings" and sent["completion_window"] == "24h"
    assert fake.batch(record.remote_job_id)["metadata"] == {**mine, TOKEN_KEY: record.idempotency_token}


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        ({f"k{i}": "v" for i in range(16)}, "drop at least 1 of yours"),
        ({TOKEN_KEY: "mine"}, "jobtrail's own"),
        ({"n": 1}, "object of strings"),
    ],
    ids=["17-keys", "our-key", "not-strings"],
)
def test_metadata_openai_would_refuse_is_never_sent(
    db_url: str, fake: OpenAIBatchFake, metadata: dict[str, Any], says: str
) -> None:
    """Refused at submit, naming what is wrong: nothing is recorded, nothing leaves."""
    file_id = fake.add_input_file(2)

    async def go() -> list[Any]:
        store = Store.open(db_url)
        jt = AsyncJobtrail(store=store, providers=[config(fake)])
        try:
            with pytest.raises(ConfigError, match="refuses this request \\(nothing was recorded or sent\\)") as refused:
                await jt.submit(NAME, {"input_file_id": file_id, "metadata": metadata}, caller="test")
            assert says in str(refused.value)
            return store.list_operations(limit=None)
        finally:
            await jt.aclose()

    assert asyncio.run(go()) == []
    assert fake.counts["creates_received"] == 0
    provider = load_provider(config(fake))
    assert isinstance(provider, OpenAIBatchProvider)
    with pytest.raises(ConfigError, match=says.split(maxsplit=1)[0]):
        provider.check_request({"input_file_id": file_id, "metadata": metadata})


# -- (4) cancel racing completion --------------------------------------------------------------------------


def _submit_accepted(db_url: str, fake: OpenAIBatchFake, file_id: str) -> str:
    async def go() -> str:
        store = Store.open(db_url)
        jt = AsyncJobtrail(store=store, providers=[config(fake)])
        op = await jt.drive_create((await jt.submit(NAME, {"input_file_id": file_id}, caller="test")).operation_id)
        assert op.state is S.ACCEPTED
        await jt.aclose()
        return op.operation_id

    return asyncio.run(go())


def _cancel_and_settle(db_url: str, fake: OpenAIBatchFake, op_id: str) -> None:
    async def go() -> None:
        store = Store.open(db_url)
        jt = AsyncJobtrail(store=store, providers=[config(fake)])
        await jt.cancel(op_id, requested_by="alice", reason="not needed")
        await run_worker(store, fake)
        await jt.aclose()

    asyncio.run(go())


def test_a_batch_that_completes_while_cancelling_is_collected(db_url: str, fake: OpenAIBatchFake) -> None:
    """The cancel is acknowledged (cancelling), then the batch completes anyway: succeeded, not cancelled."""
    file_id = fake.add_input_file(6, BatchPlan(duration_s=0.8, cancel="finish_first"))
    op_id = _submit_accepted(db_url, fake, file_id)
    _cancel_and_settle(db_url, fake, op_id)
    record, history, _obs, result = stored(db_url, op_id)
    assert record.state is S.SUCCEEDED, record.state_reason
    causes = [e.cause for e in history]
    assert "cancel_acknowledged" in causes
    assert fake.counts["cancels"] == 1
    assert result is not None and result[0]["summary"]["items"] == 6


def test_a_cancel_arriving_after_completion_is_refused_and_the_result_collected(
    db_url: str, fake: OpenAIBatchFake
) -> None:
    """The batch completed before the cancel arrived: OpenAI answers 400; polling shows completed."""
    file_id = fake.add_input_file(4, BatchPlan(duration_s=0.2))
    op_id = _submit_accepted(db_url, fake, file_id)
    time.sleep(0.3)
    _cancel_and_settle(db_url, fake, op_id)
    record, _history, observations, result = stored(db_url, op_id)
    assert record.state is S.SUCCEEDED, record.state_reason
    answer = next(o for o in observations if o["kind"] == "cancel_response")
    assert answer["http_status"] == 400
    assert answer["raw"]["body"]["error"]["message"] == "Cannot cancel a batch with status 'completed'."
    assert fake.counts["cancels"] == 1
    assert result is not None


def test_a_cancelled_batch_ends_cancelled_with_its_partial_output_named(db_url: str, fake: OpenAIBatchFake) -> None:
    """A cancel that takes effect: cancelled (the provider says so), the output file id on record."""
    file_id = fake.add_input_file(10, BatchPlan(duration_s=2.0, cancel_s=0.2))
    op_id = _submit_accepted(db_url, fake, file_id)
    time.sleep(0.9)
    _cancel_and_settle(db_url, fake, op_id)
    record, _history, _obs, _result = stored(db_url, op_id)
    assert record.state is S.CANCELLED, record.state_reason
    assert record.result_ref is not None and "output=" in record.result_ref and "error=" in record.result_ref
    assert fake.counts["cancels"] == 1


@pytest.mark.parametrize("ending", ["expired", "cancelled"])
def test_partial_output_of_an_expired_or_cancelled_batch_is_stored(
    db_url: str, fake: OpenAIBatchFake, ending: str
) -> None:
    """The finished half of the items is stored with per-item outcomes; the rest are failed items."""
    file_id = fake.add_input_file(10, BatchPlan(ending=ending, duration_s=0.3, done_share=0.5))
    op = settle(db_url, fake, {"input_file_id": file_id})
    record, _history, _obs, result = stored(db_url, op.operation_id)
    assert record.state in (S.FAILED, S.CANCELLED)
    assert result is not None
    assert result[0]["summary"]["items"] == 10 and result[0]["summary"]["failed"] == 5


@pytest.mark.parametrize("ending", ["expired", "cancelled"])
def test_the_adapter_hands_over_partial_output_of_an_ended_batch(
    fake: OpenAIBatchFake, ending: str, tmp_path: Path
) -> None:
    """status() says expired/cancelled and names the files; fetch_result() returns their bytes."""
    from jobtrail.domain.states import RemoteState

    file_id = fake.add_input_file(10, BatchPlan(ending=ending, duration_s=0.1, done_share=0.5))
    provider = load_provider(config(fake))

    async def go() -> tuple[Any, Any]:
        store = Store.open(str(tmp_path / "ledger.db"))
        jt = AsyncJobtrail(store=store, providers=[provider])
        op = await jt.drive_create((await jt.submit(NAME, {"input_file_id": file_id}, caller="test")).operation_id)
        await asyncio.sleep(0.2)
        status = await provider.status(op)
        fetched = await provider.fetch_result(op, status.result_ref)
        await jt.aclose()
        return status, fetched

    status, fetched = asyncio.run(go())
    assert status.remote_state is (RemoteState.EXPIRED if ending == "expired" else RemoteState.CANCELLED)
    assert status.result_ref is not None and status.progress == 1.0
    assert status.effects == {"request_counts": {"total": 10, "completed": 5, "failed": 5}}
    assert fetched.http_status == 200 and fetched.raw is not None
    lines = [json.loads(line) for line in fetched.raw.splitlines()]
    assert len(lines) == 10
    code = "batch_expired" if ending == "expired" else "batch_cancelled"
    assert sum(1 for line in lines if (line["error"] or {}).get("code") == code) == 5


def test_a_batch_that_fails_validation_ends_failed_without_a_fetch(db_url: str, fake: OpenAIBatchFake) -> None:
    file_id = fake.add_input_file(3, BatchPlan(ending="failed", duration_s=0.2))
    op = settle(db_url, fake, {"input_file_id": file_id})
    record, _history, _obs, result = stored(db_url, op.operation_id)
    assert record.state is S.FAILED and "failed" in (record.state_reason or "")
    # why, in OpenAI's words: the batch's errors list (its first, here its only, entry)
    assert (record.state_reason or "").endswith(': "Invalid JSON"'), record.state_reason
    assert result is None and fake.counts["content_reads"] == 0


# -- (5) the result download -------------------------------------------------------------------------------


def test_a_failing_result_download_is_retried_until_it_succeeds(db_url: str, fake: OpenAIBatchFake) -> None:
    """The output file read gets 500, then 429 (retry-after-ms), then works; both files are stored together."""
    file_id = fake.add_input_file(8, BatchPlan(duration_s=0.3, failed_items=2))
    fake.script("content", Fault.server_error(), Fault.rate_limited(retry_after_ms=100))
    op = settle(db_url, fake, {"input_file_id": file_id})
    record, _history, observations, result = stored(db_url, op.operation_id)
    assert record.state is S.SUCCEEDED, record.state_reason
    fetches = [o for o in observations if o["kind"] == "result_fetch"]
    assert [o["http_status"] for o in fetches] == [500, 429, 200]
    assert fetches[0]["raw"]["error"]["answer"]["error"]["type"] == "server_error"
    assert fake.counts["content_faults"] == 2 and fake.counts["content_reads"] == 4  # 2 faults + output + error
    assert result is not None
    row, data = result
    assert data == expected_result(fake, record.remote_job_id)
    assert row["summary"] == {
        "items": 8,
        "succeeded": 6,
        "failed": 2,
        "failed_ids": ["req-00000", "req-00004"],
        "by_outcome": {"400": 2, "succeeded": 6},
    }


# -- (6) the operator's file ----------------------------------------------------------------------------------


def test_providers_check_states_the_guarantee() -> None:
    done = cli("providers", "check", str(EXAMPLE), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["kind"] == NAME and report["at_most_once"] is True
    assert report["reconcile"] == ["list_by_reference"]
    assert report["base_url"] == "https://api.openai.com" and report["credential"] == "env:OPENAI_API_KEY"
    assert f"metadata.{TOKEN_KEY}" in report["contract"]
    assert report["guarantees"]["at-most-once creation"]["verdict"] == "yes"
    assert report["guarantees"]["cancel"]["verdict"] == "yes"
    shown = cli("providers", "check", str(EXAMPLE))
    assert shown.returncode == 0 and "list_by_reference" in shown.stdout


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"create": {"path": "/v1/other"}}, "'create' is fixed by kind"),
        ({"base_url": "https://api.openai.com/v1"}, "without /v1"),
        ({"completion_window": "1h"}, '"24h"'),
        ({"endpoint": "/v1/unknown"}, "endpoint: expected one of"),
    ],
)
def test_the_operator_file_holds_only_operator_keys(extra: dict[str, Any], says: str) -> None:
    data = {"kind": NAME, "credential": "env:OPENAI_API_KEY"} | extra
    with pytest.raises(ConfigError, match=says):
        load_provider(data)


def test_a_file_without_a_credential_is_refused() -> None:
    with pytest.raises(ConfigError, match="credential is missing"):
        load_provider({"kind": NAME})


# -- the fake itself ---------------------------------------------------------------------------------------------


def test_the_sdk_reads_the_fake(fake: OpenAIBatchFake) -> None:
    """The openai SDK, pointed at the fake, creates, pages, retrieves and downloads without complaint."""
    import openai

    file_id = fake.add_input_file(3, BatchPlan(duration_s=0.1))
    fake.add_foreign_batches(3)
    client = openai.OpenAI(base_url=fake.base_url + "/v1", api_key=fake.api_key, max_retries=0)
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"a": "b"}
    )
    assert batch.status == "validating" and batch.metadata == {"a": "b"}
    ids = [b.id for b in client.batches.list(limit=2)]
    assert len(ids) == 4 and batch.id in ids and fake.counts["lists"] == 2
    time.sleep(0.15)
    done = client.batches.retrieve(batch.id)
    assert done.status == "completed" and done.output_file_id is not None
    assert client.files.content(done.output_file_id).content.count(b"\n") == 3
    with pytest.raises(openai.BadRequestError) as refused:
        client.batches.create(input_file_id=file_id, endpoint="/v1/nowhere", completion_window="24h")  # type: ignore[arg-type]
    assert refused.value.code is None and "endpoint" in str(refused.value)
    fake.shape_errors.clear()  # that refusal was the point
    client.close()


# -- openai-file: the input upload as its own recorded operation ----------------------------------------------

FILE_KIND = "openai-file"


def _input_file(path: Path, items: int) -> dict[str, Any]:
    import hashlib

    lines = [
        json.dumps({"custom_id": f"up-{n}", "method": "POST", "url": "/v1/chat/completions", "body": {"n": n}})
        for n in range(items)
    ]
    path.write_bytes(("\n".join(lines) + "\n").encode())
    return {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "purpose": "batch"}


def _run_both(db_url: str, fake: OpenAIBatchFake, kind: str, request: dict[str, Any]) -> Any:
    async def go() -> Any:
        store = Store.open(db_url)
        configs = {NAME: config(fake), FILE_KIND: config(fake, kind=FILE_KIND, name=FILE_KIND)}
        jt = AsyncJobtrail(store=store, providers=list(configs.values()))
        op = await jt.submit(kind, request, caller="test")
        worker = Worker(store, {k: load_provider(c) for k, c in configs.items()}, worker_id="w", idle_s=0.01)
        await worker.run(until_settled=True, timeout=20)
        for provider in worker.providers.values():
            await provider.aclose()
        final = store.get(op.operation_id)
        await jt.aclose()
        return final

    return asyncio.run(go())


def test_an_upload_is_an_operation_whose_file_a_batch_then_runs(
    db_url: str, fake: OpenAIBatchFake, tmp_path: Path
) -> None:
    request = _input_file(tmp_path / "input.jsonl", 3)
    upload = _run_both(db_url, fake, FILE_KIND, request)
    record, _history, _obs, result = stored(db_url, upload.operation_id)
    assert record.state is S.SUCCEEDED, record.state_reason
    assert result is not None
    file_object = json.loads(result[1])
    assert file_object["id"] == record.remote_job_id and file_object["purpose"] == "batch"
    assert file_object["filename"] == f"jobtrail-{record.idempotency_token}-input.jsonl"
    assert fake.file_content(file_object["id"]) == Path(request["path"]).read_bytes()
    assert fake.counts["uploads_received"] == 1 and fake.counts["files_created"] == 1
    batch = _run_both(db_url, fake, NAME, {"input_file_id": file_object["id"]})
    _record, _h, _o, batch_result = stored(db_url, batch.operation_id)
    assert batch.state is S.SUCCEEDED and batch_result is not None
    assert batch_result[0]["summary"]["items"] == 3


def test_a_lost_upload_response_is_reconciled_by_listing_files(
    db_url: str, fake: OpenAIBatchFake, tmp_path: Path
) -> None:
    """The upload is stored and its answer lost: the file named for our token is found, never re-uploaded."""
    for n in range(3):
        fake.add_input_file(1, filename=f"someone-else-{n}.jsonl")
    fake.script("upload", Fault.lost_response())
    op = _run_both(db_url, fake, FILE_KIND, _input_file(tmp_path / "in.jsonl", 2))
    record, history, observations, result = stored(db_url, op.operation_id)
    assert record.state is S.SUCCEEDED, record.state_reason
    assert fake.counts["uploads_received"] == 1 and fake.counts["files_created"] == 1
    assert fake.counts["file_lists"] == 1
    causes = [e.cause for e in history]
    assert "ambiguous_create" in causes and "confirmed_create" in causes
    lookup = next(o for o in observations if o["kind"] == "reconcile_lookup")
    assert lookup["raw"]["body"]["matched"] == [record.remote_job_id]
    assert result is not None and json.loads(result[1])["id"] == record.remote_job_id


def test_a_file_that_changed_since_submit_is_never_uploaded(db_url: str, fake: OpenAIBatchFake, tmp_path: Path) -> None:
    request = _input_file(tmp_path / "in.jsonl", 2)
    Path(request["path"]).write_bytes(b'{"custom_id": "changed"}\n')

    async def go() -> tuple[Any, list[Any]]:
        store = Store.open(db_url)
        jt = AsyncJobtrail(store=store, providers=[config(fake, kind=FILE_KIND, name=FILE_KIND)])
        op = await jt.submit(FILE_KIND, request, caller="test")
        after = await jt.advance_create(op.operation_id)
        history = store.history(op.operation_id)
        await jt.aclose()
        return after, history

    op, history = asyncio.run(go())
    assert op.state is S.CREATE_PENDING
    detail = json.loads(history[-1].evidence)["detail"]
    assert history[-1].cause == "create_not_sent" and "the file changed since" in detail
    assert fake.counts["uploads_received"] == 0


# -- a provider that lies (found by probing against a strict server) -----------------------------------------


def _settle_with(
    db_url: str, fake: OpenAIBatchFake, request: dict[str, Any], *, result_deadline_s: float, timeout: float = 10
) -> Any:
    """``settle`` with a short result deadline, so a result that is never good enough ends instead of
    being fetched again for RESULT_PATIENCE_S."""
    from datetime import timedelta

    async def go() -> Any:
        store = Store.open(db_url)
        jt = AsyncJobtrail(store=store, providers=[config(fake)])
        op = await jt.submit(NAME, request, caller="test", result_deadline=timedelta(seconds=result_deadline_s))
        await run_worker(store, fake, timeout=timeout)
        final = store.get(op.operation_id)
        await jt.aclose()
        return final

    return asyncio.run(go())


def test_file_ids_that_appear_after_completed_are_collected(db_url: str, fake: OpenAIBatchFake) -> None:
    """The status says completed before it names the output file (output_file_id null on that read): the
    collector reads the batch again for its files instead of fetching the stale "no files" for ever."""
    file_id = fake.add_input_file(4, BatchPlan(duration_s=0.2, failed_items=1, files_hidden_reads=1))
    op = settle(db_url, fake, {"input_file_id": file_id}, timeout=10)
    record, _history, observations, result = stored(db_url, op.operation_id)
    assert record.state is S.SUCCEEDED, record.state_reason
    assert result is not None and result[1] == expected_result(fake, record.remote_job_id)
    assert result[0]["summary"]["items"] == 4 and result[0]["summary"]["failed"] == 1
    fetches = [o for o in observations if o["kind"] == "result_fetch"]
    assert [o["http_status"] for o in fetches] == [200], "one fetch, after one more status read"
    assert fake.counts["content_reads"] == 2 and fake.counts["batches_created"] == 1


def test_a_timestamp_past_any_calendar_does_not_wedge_polling(db_url: str, fake: OpenAIBatchFake) -> None:
    """completed_at: 10**20 made every poll raise OverflowError (nothing recorded, the operation stuck in
    accepted); now the stamp is left out of the provider time and the batch is collected."""
    file_id = fake.add_input_file(3, BatchPlan(duration_s=0.2, completed_at=10**20))
    op = settle(db_url, fake, {"input_file_id": file_id}, timeout=10)
    record, _history, observations, result = stored(db_url, op.operation_id)
    assert record.state is S.SUCCEEDED, record.state_reason
    assert result is not None and result[0]["summary"]["items"] == 3
    completed = next(o for o in observations if o["kind"] == "status_poll" and o["raw_state"] == "completed")
    assert completed["provider_time"] is not None and completed["provider_time"] < "9999"


def test_a_listing_that_hands_out_the_same_cursor_again_is_read_once(db_url: str, fake: OpenAIBatchFake) -> None:
    """The create's answer is lost and every list page says has_more with the same last_id: the listing
    stops at the repeat (2 pages, not 100 per try), and the batch it found carrying our token is adopted."""
    fake.list_repeats = True
    file_id = fake.add_input_file(3, BatchPlan(duration_s=0.3))
    fake.script("create", Fault.lost_response())
    op = settle(db_url, fake, {"input_file_id": file_id}, timeout=10)
    record, history, observations, _result = stored(db_url, op.operation_id)
    assert record.state is S.SUCCEEDED, record.state_reason
    assert fake.counts["creates_received"] == 1 and fake.counts["batches_created"] == 1
    assert fake.counts["lists"] == 2
    lookup = next(o for o in observations if o["kind"] == "reconcile_lookup")
    assert lookup["raw"]["kind"] == "found" and lookup["raw"]["body"]["matched"] == [record.remote_job_id]
    assert lookup["raw"]["body"]["complete"] is False
    assert "confirmed_create" in [e.cause for e in history]


def test_a_repeating_listing_without_our_batch_proves_no_absence(fake: OpenAIBatchFake, tmp_path: Path) -> None:
    """The same repeating list, our batch not on it: "cannot tell", never "absent" (which would re-send)."""
    from jobtrail.providers.contract import ReconcileMode

    fake.add_foreign_batches(2)
    fake.list_repeats = True
    provider = load_provider(config(fake))

    async def go() -> Any:
        store = Store.open(str(tmp_path / "ledger.db"))
        jt = AsyncJobtrail(store=store, providers=[provider])
        op = await jt.submit(NAME, {"input_file_id": fake.add_input_file(1)}, caller="test")
        found = await provider.lookup(op, ReconcileMode.LIST_BY_REFERENCE)
        listed = await provider.candidates(op, op.created_at_us - 1_000_000, store.clock())
        await jt.aclose()
        return found, listed

    found, listed = asyncio.run(go())
    assert found.kind == "unknown" and "points back to a page already read" in found.detail
    assert listed.kind == "unknown"
    assert fake.counts["lists"] == 4 and fake.counts["creates_received"] == 0


def test_an_output_file_cut_short_at_a_line_is_not_stored_as_success(db_url: str, fake: OpenAIBatchFake) -> None:
    """The output file lost its last 2 lines (well-formed JSONL still): it was stored as a success with 2
    items silently missing. Now it is refused against request_counts, and the record says so."""
    file_id = fake.add_input_file(6, BatchPlan(duration_s=0.2, lines_lost=2))
    op = _settle_with(db_url, fake, {"input_file_id": file_id}, result_deadline_s=3)
    record, _history, observations, result = stored(db_url, op.operation_id)
    assert record.state is S.RESULT_UNAVAILABLE, record.state_reason
    assert "incomplete_result" in (record.state_reason or "") and "hold 4 line(s)" in (record.state_reason or "")
    assert result is None
    fetches = [o for o in observations if o["kind"] == "result_fetch"]
    assert fetches and all(o["raw"]["error"]["error"] == "incomplete_result" for o in fetches)
    assert fake.counts["content_reads"] >= 1 and fake.counts["batches_created"] == 1
