"""kind = "replicate": real worker processes against the Replicate contract fake on loopback."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobtrail import Jobtrail, State, Store
from jobtrail.domain.errors import ConfigError
from jobtrail.ledger.audit import verify
from jobtrail.providers.contract import guarantees
from jobtrail.providers.kinds import load_provider
from jobtrail.testing import Fault, provider_toml
from jobtrail.testing.fakes.replicate import JSON_FILE, PNG_BYTES, ReplicateFake

from helpers import canary_hits, ledger_bytes
from processes import finish, start_worker

# an adapter speaks HTTP; the ledger behind it is proven on both engines by the ledger's own tests:
# each test's SQLite run is in the fast tier, its PostgreSQL run in the long tier
pytestmark = pytest.mark.long_on_postgres

VERSION = "5c7d5dc6dd8bf75c1acaa8565735e7986bc5b66206b55cca93cb72c9bf15ccaa"


@pytest.fixture
def fake() -> Iterator[ReplicateFake]:
    server = ReplicateFake(prediction_s=0.5).start()
    yield server
    server.stop()


def provider_file(tmp_path: Path, fake: ReplicateFake, **overrides: Any) -> Path:
    token = tmp_path / "replicate-token"
    token.write_text(fake.token + "\n", encoding="utf-8")
    config = fake.provider_config(credential=f"file:{token}", timeout_s=2.0, **overrides)
    path = tmp_path / "replicate.toml"
    path.write_text(provider_toml(config), encoding="utf-8")
    return path


def submit(db_url: str, provider: Path, version: str = VERSION, **inputs: Any) -> str:
    with Jobtrail(db_url, providers=[provider]) as jt:
        return jt.submit("replicate", {"version": version, "input": {"prompt": "a fake", **inputs}}).operation_id


def run_worker(db_url: str, provider: Path, name: str = "w", timeout: str = "30") -> None:
    code, out, err = finish(
        start_worker(db_url, provider, name, "--until-settled", "--timeout", timeout, "--lease", "4")
    )
    assert code == 0, err
    assert json.loads(out)["settled"] is True, out


def stored(db_url: str, op_id: str) -> tuple[Any, dict[str, Any], bytes]:
    with Jobtrail(db_url) as jt:
        op = jt.get(op_id)
        meta, data = jt.result(op_id) if op.state is State.SUCCEEDED else ({}, b"")
        return op, meta, data


def test_kill_9_mid_flight_then_restart_ends_as_the_fake_says(db_url: str, tmp_path: Path, fake: ReplicateFake) -> None:
    """A worker killed while the prediction runs; the next one finishes it: one prediction, file stored."""
    provider = provider_file(tmp_path, fake, wait_s=0)
    op_id = submit(db_url, provider, fake_output="json_file", fake_duration=3)
    doomed = start_worker(db_url, provider, "doomed", "--lease", "4")
    deadline = time.monotonic() + 20
    while fake.counts["gets"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    doomed.send_signal(signal.SIGKILL)
    doomed.communicate(timeout=30)
    assert doomed.returncode == -signal.SIGKILL
    with Store.open(db_url) as store:
        assert store.get(op_id).state in (State.ACCEPTED, State.OBSERVING)
    run_worker(db_url, provider, "survivor")
    op, meta, data = stored(db_url, op_id)
    assert op.state is State.SUCCEEDED, op.state_reason
    assert data == JSON_FILE  # the file at the output URL, byte for byte
    assert meta["content_type"] == "application/json"
    assert fake.counts["creates_received"] == 1 and fake.counts["jobs_created"] == 1, fake.counts
    assert op.remote_job_id in fake.predictions
    assert fake.delivery_auth == [None] * fake.counts["downloads"]
    with Store.open(db_url) as store:
        assert verify(store).ok
        assert fake.token not in json.dumps([o["raw"] for o in store.observations(op_id)], default=str)


def test_a_lost_create_response_stops_at_needs_attention_with_one_prediction(
    db_url: str, tmp_path: Path, fake: ReplicateFake
) -> None:
    """No idempotency key at Replicate: a create whose answer was lost is never re-sent."""
    fake.script(Fault.drop(commit=True))
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider)
    run_worker(db_url, provider)
    op, _, _ = stored(db_url, op_id)
    assert op.state is State.NEEDS_ATTENTION
    assert "at-most-once not guaranteed" in (op.state_reason or "")
    assert fake.counts["creates_received"] == 1 and fake.counts["jobs_created"] == 1, fake.counts


def test_a_lost_create_names_the_candidate_predictions(db_url: str, tmp_path: Path, fake: ReplicateFake) -> None:
    """The needs_attention record names the prediction made in the create's window (never adopts it)."""
    fake.script(Fault.drop(commit=True))
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider)
    run_worker(db_url, provider)
    op, _, _ = stored(db_url, op_id)
    (made,) = fake.predictions
    assert op.state is State.NEEDS_ATTENTION and op.remote_job_id is None  # named, never adopted
    assert "1 job(s) created between" in (op.state_reason or "") and made in (op.state_reason or "")
    with Store.open(db_url) as store:
        evidence = store.history(op_id)[-1].to_json()["evidence"]
    assert evidence["reason"] == "no_reconciliation_path" and evidence["candidates"] == [made]


@pytest.mark.parametrize(
    "version",
    [f"fake-owner/fake-model:{VERSION}", VERSION, "fake-owner/fake-model"],
    ids=["owner/model:version_id", "version_id", "owner/model"],
)
def test_a_lost_create_names_its_prediction_whichever_form_the_version_took(
    db_url: str, tmp_path: Path, fake: ReplicateFake, version: str
) -> None:
    """The create may name owner/model:version_id, the bare id or the model; a listed prediction carries the
    bare id (and the model): the prediction the lost create made is named as a candidate all the same."""
    fake.script(Fault.drop(commit=True))
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider, version=version)
    run_worker(db_url, provider)
    (made,) = fake.predictions
    with Store.open(db_url) as store:
        assert store.get(op_id).state is State.NEEDS_ATTENTION
        evidence = store.history(op_id)[-1].to_json()["evidence"]
    assert evidence["candidates"] == [made]


def create_directly(fake: ReplicateFake, version: str = VERSION) -> str:
    """A prediction made by someone else (a plain HTTP create, as another client would)."""
    request = urllib.request.Request(
        f"{fake.base_url}/v1/predictions",
        data=json.dumps({"version": version, "input": {"prompt": "x"}}).encode(),
        headers={"Authorization": f"Bearer {fake.token}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        return str(json.loads(resp.read())["id"])


def test_candidates_are_the_window_s_predictions_of_the_same_version(
    db_url: str, tmp_path: Path, fake: ReplicateFake
) -> None:
    """candidates(): cursor pages on the API origin, filtered by created_at (the window) and version."""
    provider_path = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider_path)
    fake.clock_offset_s = -3600  # made an hour before the window
    create_directly(fake)
    create_directly(fake)
    fake.clock_offset_s = 0
    since_us = time.time_ns() // 1000
    mine = [create_directly(fake), create_directly(fake)]
    create_directly(fake, version="0" * 64)
    until_us = time.time_ns() // 1000
    provider = load_provider(provider_path)
    with Store.open(db_url) as store:
        op = store.get(op_id)

    async def ask() -> Any:
        try:
            return await provider.candidates(op, since_us, until_us)
        finally:
            await provider.aclose()

    found = asyncio.run(ask())
    assert found.kind == "candidates"
    assert sorted(found.remote_job_ids) == sorted(mine)
    assert 2 <= fake.counts["lists"] <= 3  # paged (2 a page) and stopped at the first older prediction
    assert fake.counts["creates_received"] == 5


def test_a_png_output_is_fetched_from_the_delivery_origin_without_the_credential(
    db_url: str, tmp_path: Path, fake: ReplicateFake
) -> None:
    """The output file lives on another origin: it is fetched there, and the API token never goes along."""
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider, fake_output="png")
    run_worker(db_url, provider)
    assert fake.counts["downloads"] >= 1
    assert fake.delivery_auth == [None] * fake.counts["downloads"]
    # Prefer: wait went with the create only
    prefers = {(method, path.startswith("/v1/predictions/")): prefer for method, path, prefer in fake.prefer_seen}
    assert prefers[("POST", False)] == "wait=1"
    assert all(p is None for m, p_path, p in fake.prefer_seen if m == "GET"), fake.prefer_seen
    assert fake.counts["jobs_created"] == 1
    with Store.open(db_url) as store:
        assert store.get(op_id).state in (State.SUCCEEDED, State.RESULT_VALIDATION_FAILED)


def test_an_output_url_that_carries_the_token_is_neither_fetched_nor_stored(
    db_url: str, tmp_path: Path, fake: ReplicateFake
) -> None:
    """A model's output may be anything, an URL that echoes the API token included: such a reference never
    goes into a request line to the delivery host, and the token is nowhere in the ledger."""
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider, fake_output="png_echoing_token")
    run_worker(db_url, provider)
    assert fake.counts["downloads"] == 0
    with Store.open(db_url) as store:
        op = store.get(op_id)
        assert op.state is not State.SUCCEEDED, op.state_reason
        assert fake.token not in (op.result_ref or "")
        assert canary_hits(fake.token, ledger_bytes(store)) == []


def test_a_png_output_is_stored_byte_for_byte(db_url: str, tmp_path: Path, fake: ReplicateFake) -> None:
    """PNG bytes (not JSON, not UTF-8) are stored exactly as served, with their content type."""
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider, fake_output="png")
    run_worker(db_url, provider)
    op, meta, data = stored(db_url, op_id)
    assert op.state is State.SUCCEEDED, op.state_reason
    assert data == PNG_BYTES + b"out-0.png"
    assert meta["content_type"] == "image/png"


def test_a_json_output_finished_within_prefer_wait_is_a_synchronous_result(
    db_url: str, tmp_path: Path, fake: ReplicateFake
) -> None:
    """Replicate answers 201 with a finished prediction: its JSON output is stored from the create."""
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider, fake_duration=0.1)
    run_worker(db_url, provider)
    op, _, data = stored(db_url, op_id)
    assert op.state is State.SUCCEEDED, op.state_reason
    assert json.loads(data) == ["Hello", ", ", "world"]
    assert "synchronous" in (op.state_reason or "")
    assert fake.counts["gets"] == 0 and fake.counts["jobs_created"] == 1, fake.counts


def test_several_output_files_are_all_stored_in_one_bundle(db_url: str, tmp_path: Path, fake: ReplicateFake) -> None:
    """A list of file URLs: every file is downloaded (the links expire) and stored with its sha256."""
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider, fake_output="pngs")
    run_worker(db_url, provider)
    op, _, data = stored(db_url, op_id)
    assert op.state is State.SUCCEEDED, op.state_reason
    bundle = json.loads(data)
    assert [f["content_type"] for f in bundle["files"]] == ["image/png", "image/png"]
    for n, item in enumerate(bundle["files"]):
        raw = base64.b64decode(item["base64"])
        assert raw == PNG_BYTES + f"out-{n}.png".encode()
        assert item["sha256"] == hashlib.sha256(raw).hexdigest()
    assert fake.delivery_auth == [None, None]


def test_a_429_on_create_is_retried_and_a_failed_prediction_ends_failed(
    db_url: str, tmp_path: Path, fake: ReplicateFake
) -> None:
    """429 (Retry-After) makes no prediction: the create goes again; the prediction's failure is the ending."""
    fake.script(Fault.http(429, retry_after="1"))
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider, fake_fail=True)
    run_worker(db_url, provider)
    op, _, _ = stored(db_url, op_id)
    assert op.state is State.FAILED, op.state_reason
    assert op.state_reason == 'the provider reports the job failed: "the model raised an error (fake)"'
    assert fake.counts["creates_received"] == 2 and fake.counts["jobs_created"] == 1, fake.counts


def test_a_429_s_retry_after_is_honoured(db_url: str, tmp_path: Path, fake: ReplicateFake) -> None:
    """The create after a 429 waits Retry-After (1 s), not the shorter back-off (0.05 s)."""
    fake.script(Fault.http(429, retry_after="1"))
    provider = provider_file(tmp_path, fake)
    submit(db_url, provider)
    run_worker(db_url, provider)
    first, second = fake.create_times
    assert second - first >= 0.9


def test_an_aborted_prediction_ends_failed_at_once(db_url: str, tmp_path: Path, fake: ReplicateFake) -> None:
    """Replicate's "aborted" (its deadline passed before it started) is final: the job never ran, so it ends
    failed, saying so, instead of being polled until the result deadline."""
    provider = provider_file(tmp_path, fake, wait_s=0)
    op_id = submit(db_url, provider, fake_abort=True)
    run_worker(db_url, provider, timeout="20")
    op, _, _ = stored(db_url, op_id)
    assert op.state is State.FAILED and op.remote_state == "aborted", op.state_reason
    assert "aborted" in (op.state_reason or "")
    assert op.result_ref is None
    assert fake.counts["jobs_created"] == 1 and fake.counts["cancels"] == 0, fake.counts


def test_an_output_removed_by_data_retention_is_result_unavailable_not_a_null_result(
    db_url: str, tmp_path: Path, fake: ReplicateFake
) -> None:
    """Collected after Replicate's data retention removed it (data_removed, output null), the result is
    unavailable and the record says why; the emptied output is never stored as the result."""
    fake.data_retention_s = 0  # removed as soon as it ends: the worker came back after the hour
    provider = provider_file(tmp_path, fake, wait_s=0)
    op_id = submit(db_url, provider)
    run_worker(db_url, provider)
    op, _, _ = stored(db_url, op_id)
    assert op.state is State.RESULT_UNAVAILABLE, op.state_reason
    assert "removed by Replicate's data retention" in (op.state_reason or "")
    with Store.open(db_url) as store:
        fetches = [o for o in store.observations(op_id) if o["kind"] == "result_fetch"]
    assert fetches and fetches[-1]["raw"]["error"]["data_removed"] == "true"


def test_a_cancel_ends_cancelled(db_url: str, tmp_path: Path, fake: ReplicateFake) -> None:
    """POST /v1/predictions/{id}/cancel once; the prediction's "canceled" is the evidence."""
    provider = provider_file(tmp_path, fake, wait_s=0)
    op_id = submit(db_url, provider, fake_duration=30)
    worker = start_worker(db_url, provider, "w", "--until-settled", "--timeout", "30", "--lease", "4")
    deadline = time.monotonic() + 20
    while fake.counts["gets"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    with Jobtrail(db_url, providers=[provider]) as jt:
        jt.cancel(op_id, requested_by="alice", reason="not needed")
    code, _, err = finish(worker)
    assert code == 0, err
    op, _, _ = stored(db_url, op_id)
    assert op.state is State.CANCELLED and op.remote_state == "canceled", op.state_reason
    assert fake.counts["cancels"] == 1 and fake.counts["jobs_created"] == 1


def test_a_500_after_commit_is_a_doubt_never_a_second_prediction(
    db_url: str, tmp_path: Path, fake: ReplicateFake
) -> None:
    """500 may have made a prediction: without a key it is not re-sent."""
    fake.script(Fault.http(500, commit=True))
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider)
    run_worker(db_url, provider)
    op, _, _ = stored(db_url, op_id)
    assert op.state is State.NEEDS_ATTENTION
    assert fake.counts["creates_received"] == 1 and fake.counts["jobs_created"] == 1, fake.counts


def test_the_file_fixes_the_contract_and_check_states_the_guarantees(tmp_path: Path, fake: ReplicateFake) -> None:
    """Operator keys only; `providers check` says at-most-once is not guaranteed, and why."""
    with pytest.raises(ConfigError, match="'create' is fixed by kind = 'replicate'"):
        load_provider({**fake.provider_config(), "create": {"path": "/x"}})
    with pytest.raises(ConfigError, match="wait_s"):
        load_provider(fake.provider_config(wait_s=30, timeout_s=10))
    report = guarantees(load_provider(provider_file(tmp_path, fake)))
    assert report["kind"] == "replicate" and report["at_most_once"] is False
    assert {"https://replicate.delivery", "https://*.replicate.delivery"} <= set(report["download_hosts"])
    assert "no idempotency key" in report["contract"]


def test_the_example_file_loads() -> None:
    """examples/replicate.toml is a valid operator file."""
    provider = load_provider(Path(__file__).parent.parent / "examples" / "replicate.toml")
    assert provider.name == "replicate" and provider.create_endpoint == "POST /v1/predictions"


def test_a_succeeded_prediction_without_an_output_field_is_not_a_null_result(
    db_url: str, tmp_path: Path, fake: ReplicateFake
) -> None:
    """A lying answer: status succeeded and no ``output`` field at all. Nothing is stored as the result (it used
    to store "null", a result nobody sent); the collect asks again and says why."""
    provider = provider_file(tmp_path, fake, wait_s=0)
    op_id = submit(db_url, provider, fake_output="missing", fake_duration=0)
    finish(start_worker(db_url, provider, "w", "--until-settled", "--timeout", "3", "--lease", "4"))
    op, _, _ = stored(db_url, op_id)
    assert op.state is State.RESULT_COLLECTING, op.state_reason
    with Store.open(db_url) as store:
        fetches = [o for o in store.observations(op_id) if o["kind"] == "result_fetch"]
        assert "validated_result" not in [e.cause for e in store.history(op_id)]
    assert fetches and "no output field" in json.dumps(fetches[-1]["raw"])
    assert fake.counts["jobs_created"] == 1
