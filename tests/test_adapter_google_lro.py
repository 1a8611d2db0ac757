"""kind = "google-lro": real worker processes against the Google long-running-operations fake."""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobtrail import Jobtrail, State, Store
from jobtrail.domain.canonical import parse_json
from jobtrail.domain.errors import ConfigError
from jobtrail.ledger.audit import verify
from jobtrail.providers.adapters.google_lro import request_id, usable_name
from jobtrail.providers.contract import guarantees
from jobtrail.providers.kinds import load_provider
from jobtrail.testing import Fault, provider_toml
from jobtrail.testing.fakes.google_lro import GoogleLroFake

from processes import finish, start_worker

# an adapter speaks HTTP; the ledger behind it is proven on both engines by the ledger's own tests:
# each test's SQLite run is in the fast tier, its PostgreSQL run in the long tier
pytestmark = pytest.mark.long_on_postgres

TOKEN = "ya29.fake-token-1"


@pytest.fixture
def fake() -> Iterator[GoogleLroFake]:
    server = GoogleLroFake(operation_s=0.5, valid_tokens={TOKEN}).start()
    yield server
    server.stop()


def provider_file(tmp_path: Path, fake: GoogleLroFake, **overrides: Any) -> Path:
    token = tmp_path / "google-token"
    if not token.exists():
        token.write_text(TOKEN + "\n", encoding="utf-8")
    path = tmp_path / "gcp.toml"
    path.write_text(provider_toml(fake.provider_config(str(token), timeout_s=2.0, **overrides)), encoding="utf-8")
    return path


def submit(db_url: str, provider: Path, **body: Any) -> str:
    with Jobtrail(db_url, providers=[provider]) as jt:
        return jt.submit("gcp", {"machineType": "e2-small", "labels": {"team": "a"}, **body}).operation_id


def run_worker(db_url: str, provider: Path, name: str = "w") -> None:
    code, out, err = finish(start_worker(db_url, provider, name, "--until-settled", "--timeout", "30", "--lease", "4"))
    assert code == 0, err
    assert json.loads(out)["settled"] is True, out


def get(db_url: str, op_id: str) -> Any:
    with Store.open(db_url) as store:
        return store.get(op_id)


def result(db_url: str, op_id: str) -> Any:
    with Jobtrail(db_url) as jt:
        return parse_json(jt.result(op_id)[1])


def test_kill_9_mid_flight_then_restart_ends_as_the_fake_says(db_url: str, tmp_path: Path, fake: GoogleLroFake) -> None:
    """A worker killed while the operation runs; the next finishes it: one operation, its response stored."""
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider, fake_duration=3)
    doomed = start_worker(db_url, provider, "doomed", "--lease", "4")
    deadline = time.monotonic() + 20
    while fake.counts["gets"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    doomed.send_signal(signal.SIGKILL)
    doomed.communicate(timeout=30)
    assert doomed.returncode == -signal.SIGKILL
    assert get(db_url, op_id).state in (State.ACCEPTED, State.OBSERVING)
    run_worker(db_url, provider, "survivor")
    op = get(db_url, op_id)
    assert op.state is State.SUCCEEDED, op.state_reason
    (name,) = fake.operations
    assert op.remote_job_id == name and name.startswith("projects/fake-project/locations/us-central1/operations/")
    assert result(db_url, op_id) == {
        "@type": "type.googleapis.com/fake.v1.Instance",
        "name": "projects/fake-project/locations/us-central1/instances/fake-instance",
        "state": "READY",
        "labels": {"team": "a"},
    }
    assert fake.counts["creates_received"] == 1 and fake.counts["jobs_created"] == 1, fake.counts
    with Store.open(db_url) as store:
        assert verify(store).ok
        polls = [o for o in store.observations(op_id) if o["kind"] == "status_poll"]
    # progress read from the Operation's metadata (the declared path)
    assert polls[-1]["progress"] == 100 and all(o["progress"] is not None for o in polls)


def test_a_lost_create_response_is_replayed_with_the_same_request_id(
    db_url: str, tmp_path: Path, fake: GoogleLroFake
) -> None:
    """The operation was made but its answer lost: the same requestId again gets the same operation."""
    fake.script(Fault.drop(commit=True))
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider)
    run_worker(db_url, provider)
    op = get(db_url, op_id)
    assert op.state is State.SUCCEEDED, op.state_reason
    assert fake.counts["creates_received"] == 2 and fake.counts["replayed"] == 1, fake.counts
    assert fake.counts["jobs_created"] == 1
    assert list(fake.request_ids) == [request_id(op.idempotency_token)]
    assert uuid.UUID(request_id(op.idempotency_token)).version == 4


def test_a_429_is_replayed_after_retry_after_with_the_same_request_id(
    db_url: str, tmp_path: Path, fake: GoogleLroFake
) -> None:
    """RESOURCE_EXHAUSTED with Retry-After, then a 500 after commit: still one operation."""
    fake.script(Fault.http(429, retry_after="1"), Fault.http(500, commit=True))
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider)
    run_worker(db_url, provider)
    assert get(db_url, op_id).state is State.SUCCEEDED
    assert fake.counts["creates_received"] == 3 and fake.counts["jobs_created"] == 1, fake.counts


def test_the_name_is_polled_with_its_slashes(db_url: str, tmp_path: Path, fake: GoogleLroFake) -> None:
    """GET /v1/projects/p/locations/l/operations/x: never %2F (a 404 at Google)."""
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider)
    run_worker(db_url, provider)
    op = get(db_url, op_id)
    assert op.state is State.SUCCEEDED
    assert fake.counts["encoded_names"] == 0
    assert fake.get_paths and set(fake.get_paths) == {f"/v1/{op.remote_job_id}"}
    # the fake tells the two apart, as Google does: the encoded form is a 404
    encoded = urllib.parse.quote(op.remote_job_id, safe="")
    request = urllib.request.Request(f"{fake.base_url}/v1/{encoded}", headers={"Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    refused.value.close()
    assert refused.value.code == 404 and fake.counts["encoded_names"] == 1


def test_a_firestore_operation_named_under_default_in_parentheses_is_followed_to_its_end(
    db_url: str, tmp_path: Path, fake: GoogleLroFake
) -> None:
    """Firestore names its operations projects/p/databases/(default)/operations/x: the name is polled (its
    slashes kept) until the export ends, and the export's response is stored."""
    provider = provider_file(
        tmp_path,
        fake,
        create_path="/v1/projects/fake-project/databases/(default):exportDocuments",
        request_id={"in": "none"},  # ExportDocumentsRequest has no request_id field
    )
    with Jobtrail(db_url, providers=[provider]) as jt:
        op_id = jt.submit("gcp", {"outputUriPrefix": "gs://fake-bucket/export-1"}).operation_id
    run_worker(db_url, provider)
    op = get(db_url, op_id)
    assert op.state is State.SUCCEEDED, op.state_reason
    (name,) = fake.operations
    assert op.remote_job_id == name and name.startswith("projects/fake-project/databases/(default)/operations/")
    assert {urllib.parse.unquote(path) for path in fake.get_paths} == {f"/v1/{name}"}
    assert result(db_url, op_id) == {
        "@type": "type.googleapis.com/google.firestore.admin.v1.ExportDocumentsResponse",
        "outputUriPrefix": "gs://fake-bucket/export-1",
    }
    assert fake.counts["jobs_created"] == 1 and fake.counts["encoded_names"] == 0, fake.counts


def test_an_operation_name_that_could_change_its_path_is_still_refused() -> None:
    """Google's resource-name characters pass; dot or empty segments, escapes, '?', '#', ':', ';', spaces,
    controls and non-ASCII do not (the name goes into a request path)."""
    for name in (
        "projects/p/databases/(default)/operations/ASA1MDEw",
        "projects/p/locations/us-central1/operations/operation-1_~x",
        "projects/p/serviceAccounts/sa@p.iam.gserviceaccount.com/operations/x=",
    ):
        assert usable_name(name), name
    for name in (
        "",
        "operations//x",
        "/operations/x",
        "operations/x/",
        "operations/./x",
        "operations/../x",
        ".well-known/x",
        "operations/x?alt=media",
        "operations/x#y",
        "operations/%2e%2e",
        "operations/x:cancel",
        "operations/x;v=1",
        "operations/x y",
        "operations/x\n",
        "operations/\u00e9",
        "operations\\x",
    ):
        assert not usable_name(name), name


def test_a_create_without_a_request_id_field_is_refused_naming_the_fix(
    db_url: str, tmp_path: Path, fake: GoogleLroFake
) -> None:
    """A create whose request message has no request_id (Filestore's) refuses ?requestId= with 400: the
    operation fails saying to set [request_id] in = "none", and with that set the create goes through."""
    fake.declares_request_id = False
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider)
    run_worker(db_url, provider)
    op = get(db_url, op_id)
    assert op.state is State.FAILED, op.state_reason
    assert (op.state_reason or "").count('Unknown name "requestId"') == 1  # Google's words, said once
    assert '[request_id] in = "none"' in (op.state_reason or "")
    assert fake.counts["unknown_parameter"] == 1 and fake.counts["jobs_created"] == 0, fake.counts
    provider = provider_file(tmp_path, fake, request_id={"in": "none"})
    op_id = submit(db_url, provider)
    run_worker(db_url, provider)
    assert get(db_url, op_id).state is State.SUCCEEDED
    assert fake.counts["unknown_parameter"] == 1 and fake.counts["jobs_created"] == 1, fake.counts


def test_done_with_an_error_ends_failed_with_the_error_recorded(
    db_url: str, tmp_path: Path, fake: GoogleLroFake
) -> None:
    """done + error (code 3) is failed, and the observation keeps the google.rpc.Status."""
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider, fake_outcome="fail")
    run_worker(db_url, provider)
    op = get(db_url, op_id)
    assert op.state is State.FAILED and op.remote_state == "FAILED", op.state_reason
    assert op.state_reason == 'the provider reports the job FAILED: "the machine image is missing (fake)"'
    with Store.open(db_url) as store:
        last = [o for o in store.observations(op_id) if o["kind"] == "status_poll"][-1]
    assert last["raw"]["body"]["error"] == {"code": 3, "message": "the machine image is missing (fake)", "details": []}


def test_a_cancel_ends_cancelled_on_error_code_1(db_url: str, tmp_path: Path, fake: GoogleLroFake) -> None:
    """POST {name}:cancel, then done + error code 1 (CANCELLED) is the evidence for cancelled."""
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider, fake_duration=30)
    worker = start_worker(db_url, provider, "w", "--until-settled", "--timeout", "30", "--lease", "4")
    deadline = time.monotonic() + 20
    while fake.counts["gets"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    with Jobtrail(db_url, providers=[provider]) as jt:
        jt.cancel(op_id, requested_by="alice", reason="not needed")
    code, _, err = finish(worker)
    assert code == 0, err
    op = get(db_url, op_id)
    assert op.state is State.CANCELLED, op.state_reason
    assert fake.counts["cancels"] == 1 and fake.counts["jobs_created"] == 1


def test_a_rotated_token_is_read_again_when_the_old_one_is_refused(
    db_url: str, tmp_path: Path, fake: GoogleLroFake
) -> None:
    """The access token file is rewritten mid-flight and the old token refused: the worker reads the new one."""
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider, fake_duration=2)
    worker = start_worker(db_url, provider, "w", "--until-settled", "--timeout", "30", "--lease", "4")
    deadline = time.monotonic() + 20
    while fake.counts["jobs_created"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    (tmp_path / "google-token").write_text("ya29.fake-token-2\n", encoding="utf-8")
    fake.valid_tokens = {"ya29.fake-token-2"}  # the old token has expired
    code, _, err = finish(worker)
    assert code == 0, err
    op = get(db_url, op_id)
    assert op.state is State.SUCCEEDED, op.state_reason
    assert fake.counts["unauthorized"] >= 1 and fake.counts["jobs_created"] == 1, fake.counts
    with Store.open(db_url) as store:
        stored = json.dumps([o["raw"] for o in store.observations(op_id)])
    assert "fake-token" not in stored


def test_the_file_fixes_the_contract_and_check_states_the_guarantees(tmp_path: Path, fake: GoogleLroFake) -> None:
    """Operator keys only; `providers check` names the requestId in the query and replay."""
    config = fake.provider_config(str(tmp_path / "t"))
    with pytest.raises(ConfigError, match="'status' is fixed by kind = 'google-lro'"):
        load_provider({**config, "status": {"path": "/x"}})
    with pytest.raises(ConfigError, match="create_path"):
        load_provider({k: v for k, v in config.items() if k != "create_path"})
    with pytest.raises(ConfigError, match=r"request_id\.in"):
        load_provider({**config, "request_id": {"in": "cookie"}})
    report = guarantees(load_provider(config))
    assert report["kind"] == "google-lro" and report["at_most_once"] is True and report["reconcile"] == ["replay"]
    assert "token in query 'requestId'" in report["guarantees"]["at-most-once creation"]["why"]
    assert report["token_retention_s"] == 3600 and report["warnings"] == []
    off = guarantees(load_provider({**config, "request_id": {"in": "none"}}))
    assert off["at_most_once"] is False


def test_the_example_file_loads() -> None:
    """examples/google-lro.toml is a valid operator file (its create, AlloyDB's, has a request_id to replay)."""
    provider = load_provider(Path(__file__).parent.parent / "examples" / "google-lro.toml")
    assert provider.name == "gcp-alloydb" and provider.capabilities.reconcile


def test_a_replay_answered_already_exists_stops_for_a_person_never_proves_absence(db_url: str, tmp_path: Path) -> None:
    """The create made the instance but its answer was lost, and the service no longer honours the requestId:
    the replay is answered 409 ALREADY_EXISTS. That is not a proof that nothing was made (it used to be read as
    one: the create was sent a third time, and then "failed" was refused for a 409 on every try): it stops at
    needs_attention, one instance, the 409 kept."""
    fake = GoogleLroFake(operation_s=0.5, valid_tokens={TOKEN}, unique_instances=True, request_id_retention_s=0)
    fake.start()
    try:
        fake.script(Fault.drop(commit=True))
        provider = provider_file(tmp_path, fake)
        op_id = submit(db_url, provider)
        run_worker(db_url, provider)
        op = get(db_url, op_id)
        assert op.state is State.NEEDS_ATTENTION, op.state_reason
        assert "ALREADY_EXISTS" in (op.state_reason or "")
        assert fake.counts["jobs_created"] == 1 and fake.counts["creates_received"] == 2, fake.counts
        assert fake.counts["already_exists"] == 1
        with Store.open(db_url) as store:
            history = [e.cause for e in store.history(op_id)]
        assert "proved_absent" not in history and "definitive_rejection" not in history
    finally:
        fake.stop()


def test_a_create_answered_already_exists_stops_for_a_person_not_a_refused_transition_loop(
    db_url: str, tmp_path: Path
) -> None:
    """The instance exists already (someone else's): the first create is answered 409 ALREADY_EXISTS. It
    stops at needs_attention naming the fix, after one create (it used to retry the refused transition
    to failed for ever)."""
    fake = GoogleLroFake(operation_s=0.5, valid_tokens={TOKEN}, unique_instances=True)
    fake.start()
    try:
        provider = provider_file(tmp_path, fake)
        first = submit(db_url, provider)
        run_worker(db_url, provider)
        assert get(db_url, first).state is State.SUCCEEDED
        second = submit(db_url, provider, attempt=2)  # another request naming the same instanceId
        run_worker(db_url, provider)
        op = get(db_url, second)
        assert op.state is State.NEEDS_ATTENTION, op.state_reason
        assert "another resource id" in (op.state_reason or "")
        assert fake.counts["creates_received"] == 2 and fake.counts["jobs_created"] == 1, fake.counts
    finally:
        fake.stop()


def test_a_replay_refused_for_permission_does_not_prove_the_lost_create_made_nothing(
    db_url: str, tmp_path: Path, fake: GoogleLroFake
) -> None:
    """The lost create made the operation; the first replay is refused 403 PERMISSION_DENIED. AIP-155 does not
    replay stored answers, so the refusal says nothing about the lost attempt: still a doubt (no
    "proved_absent"), and the next replay with the same requestId finds the one operation."""
    fake.script(Fault.drop(commit=True), Fault.http(403))
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider)
    run_worker(db_url, provider)
    op = get(db_url, op_id)
    assert op.state is State.SUCCEEDED, op.state_reason
    assert fake.counts["jobs_created"] == 1 and fake.counts["replayed"] == 1, fake.counts
    with Store.open(db_url) as store:
        history = [e.cause for e in store.history(op_id)]
    assert "proved_absent" not in history


def test_done_with_a_null_response_is_not_a_success(db_url: str, tmp_path: Path, fake: GoogleLroFake) -> None:
    """done: true with "response": null (proto3 JSON: the field is absent) is neither outcome: never succeeded
    with "null" stored as the result."""
    provider = provider_file(tmp_path, fake)
    op_id = submit(db_url, provider, fake_outcome="null_response", fake_duration=0)
    finish(start_worker(db_url, provider, "w", "--until-settled", "--timeout", "3", "--lease", "4"))
    op = get(db_url, op_id)
    assert op.state is State.OBSERVING, op.state_reason
    assert op.remote_state == "DONE_WITHOUT_OUTCOME"
    assert fake.counts["gets"] >= 2
    with Store.open(db_url) as store:
        assert "validated_result" not in [e.cause for e in store.history(op_id)]
