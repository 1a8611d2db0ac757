"""The create path over real HTTP: for every fault, exactly one remote job or an honest needs_attention."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator
from datetime import timedelta
from email.utils import format_datetime
from typing import Any

import pytest
from conftest import FakeClock

from jobtrail import AsyncJobtrail, OperationKeyConflict, State, Store
from jobtrail.domain.evidence import DefinitiveRejection
from jobtrail.domain.redact import Redactor
from jobtrail.domain.words import in_their_words
from jobtrail.ledger.audit import verify
from jobtrail.testing import FakeProvider, Fault

from helpers import op_in, provider_of_our_own

S = State


@pytest.fixture
def make_client(db_url: str) -> Iterator[Callable[..., AsyncJobtrail]]:
    """Factory: a client on this test's database speaking to a fake; closed at teardown."""
    stores: list[Store] = []

    def factory(fake: FakeProvider, clock: Callable[[], int] | None = None, **provider: Any) -> AsyncJobtrail:
        store = Store.open(db_url, clock=clock) if clock else Store.open(db_url)
        stores.append(store)
        return AsyncJobtrail(store=store, providers=[fake.provider_config(**provider)])

    yield factory
    for store in stores:
        store.close()


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def submit_and_drive(jt: AsyncJobtrail, body: Any = None, **kwargs: Any) -> Any:
    async def go() -> Any:
        try:
            op = await jt.submit("fake", body or {"prompt": "summarise"}, **kwargs)
            return await jt.drive_create(op.operation_id)
        finally:
            await jt.providers["fake"].aclose()

    return run(go())


def causes(jt: AsyncJobtrail, op_id: str) -> list[str]:
    return [f"{e.to_state}:{e.cause}" for e in jt.store.history(op_id)]


def test_happy_path_sends_once_with_the_stored_token_and_trace(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider
) -> None:
    jt = make_client(fake)
    op = submit_and_drive(jt)
    assert op.state is S.ACCEPTED and op.remote_job_id == "job_00001"
    assert fake.counts["creates_received"] == 1 and fake.counts["jobs_created"] == 1
    sent = fake.create_headers[0]
    assert sent["Idempotency-Key"] == f'"{op.idempotency_token}"'  # an RFC 8941 sf-string
    assert sent["X-Trace-ID"] == op.trace_id
    assert sent["traceparent"].startswith(f"00-{op.trace_id}-")
    assert causes(jt, op.operation_id) == [
        "create_pending:operation_created",
        "create_pending:create_attempt",
        "accepted:confirmed_create",
    ]
    assert jt.store.history(op.operation_id)[-1].to_json()["provider_request_ids"] == ["req_job_00001"]
    observed = jt.store.observations(op.operation_id)
    assert observed[0]["kind"] == "create_response" and observed[0]["http_status"] == 201
    assert verify(jt.store).ok


def test_the_record_is_durable_before_anything_is_sent(
    make_client: Callable[..., AsyncJobtrail], db_url: str, fake: FakeProvider
) -> None:
    """submit() returns a durable operation id and sends nothing."""
    jt = make_client(fake)
    op = run(jt.submit("fake", {"prompt": "x"}))
    with Store.open(db_url) as fresh:
        assert fresh.get(op.operation_id).state is S.CREATE_PENDING
    assert fake.counts["creates_received"] == 0


@pytest.mark.parametrize(
    ("fault", "ambiguity"),
    [
        (Fault.drop(), "connection_reset"),
        (Fault.delay(3.0), "timeout"),
        (Fault.http(500, commit=True), "http_500"),
        (Fault.http(503), "http_503"),
        (Fault.http(429, retry_after="0"), "http_429"),
        (Fault.drop(commit=False), "connection_reset"),
    ],
    ids=[
        "dropped-after-commit",
        "delayed-past-timeout",
        "500-after-commit",
        "503",
        "429",
        "dropped-no-commit",
    ],
)
def test_ambiguous_creates_are_reconciled_to_exactly_one_job(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider, fault: Fault, ambiguity: str
) -> None:
    fake.script(fault)
    jt = make_client(fake, timeout_s=1.0)
    op = submit_and_drive(jt)
    assert op.state is S.ACCEPTED
    assert fake.jobs_for(op.idempotency_token) == [op.remote_job_id]
    assert fake.counts["jobs_created"] == 1
    history = jt.store.history(op.operation_id)
    unknown = next(e for e in history if e.to_state == "create_unknown")
    assert unknown.to_json()["evidence"]["error_class"] == ambiguity
    assert [e.to_state for e in history][-2:] == ["reconciliation", "accepted"] or history[-1].to_json()["evidence"][
        "via"
    ] == "replay"
    # every re-send carried the same token
    assert {h["Idempotency-Key"] for h in fake.create_headers} == {f'"{op.idempotency_token}"'}
    assert verify(jt.store).ok


def test_retry_after_seconds_is_honoured_on_a_controllable_clock(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider
) -> None:
    clock = FakeClock()
    fake.script(Fault.http(503, retry_after="120"))
    jt = make_client(fake, clock=clock)

    async def go() -> None:
        op = await jt.submit("fake", {"p": 1})
        op = await jt.advance_create(op.operation_id)  # send: 503
        assert op.state is S.CREATE_UNKNOWN
        assert op.next_action_at_us == clock.now_us + 120_000_000
        op = await jt.advance_create(op.operation_id)  # not due: nothing happens
        assert op.state is S.CREATE_UNKNOWN and fake.counts["creates_received"] == 1
        clock.advance(119)
        op = await jt.advance_create(op.operation_id)
        assert fake.counts["creates_received"] == 1
        clock.advance(1)
        while op.state is not S.ACCEPTED:
            op = await jt.advance_create(op.operation_id)
        assert fake.counts["creates_received"] == 2 and fake.counts["jobs_created"] == 1
        await jt.providers["fake"].aclose()

    run(go())


def test_retry_after_http_date_is_honoured(make_client: Callable[..., AsyncJobtrail], fake: FakeProvider) -> None:
    import time
    from datetime import UTC, datetime

    clock = FakeClock()
    when = datetime.fromtimestamp(int(time.time()) + 3600, tz=UTC)
    fake.script(Fault.http(429, retry_after=format_datetime(when, usegmt=True)))
    jt = make_client(fake, clock=clock)

    async def go() -> None:
        op = await jt.submit("fake", {"p": 2})
        op = await jt.advance_create(op.operation_id)
        wait_s = (op.next_action_at_us - clock.now_us) / 1e6
        assert 3590 <= wait_s <= 3600
        evidence = jt.store.history(op.operation_id)[-1].to_json()["evidence"]
        assert 3590 <= evidence["retry_after_s"] <= 3600
        await jt.providers["fake"].aclose()

    run(go())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_connection_refused_is_not_ambiguous_and_resends_with_the_same_token(
    make_client: Callable[..., AsyncJobtrail],
) -> None:
    """Nothing left the machine: the record says so, and the retry carries the same token."""
    port = _free_port()
    fake = FakeProvider(port=port, job_duration_s=0.3)
    fake.base_url = f"http://127.0.0.1:{port}"
    clock = FakeClock()
    jt = make_client(fake, clock=clock)

    async def go() -> Any:
        op = await jt.submit("fake", {"p": 3})
        op = await jt.advance_create(op.operation_id)
        assert op.state is S.CREATE_PENDING and op.attempts == 1
        last = jt.store.history(op.operation_id)[-1]
        assert last.cause == "create_not_sent"
        fake.start()
        clock.advance(5)
        op = await jt.advance_create(op.operation_id)
        await jt.providers["fake"].aclose()
        return op

    op = run(go())
    try:
        assert op.state is S.ACCEPTED and op.attempts == 2
        assert fake.counts["jobs_created"] == 1
        assert "create_unknown" not in [e.to_state for e in jt.store.history(op.operation_id)]
    finally:
        fake.stop()


def test_a_new_job_id_for_the_same_token_stops_everything(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider
) -> None:
    """The provider breaks its contract on the replay; an independent lookup exposes it."""
    fake.script(Fault.drop(), Fault.replay_new_id())
    jt = make_client(
        fake,
        reconcile={
            "modes": ["replay", "list_by_reference"],
            "list_path": "/v1/jobs?client_reference={token}",
        },
    )
    op = submit_and_drive(jt)
    assert op.state is S.NEEDS_ATTENTION
    assert "broke its idempotency contract" in (op.state_reason or "")
    evidence = jt.store.history(op.operation_id)[-1].to_json()["evidence"]
    assert evidence["kind"] == "conflicting_job_ids"
    assert {evidence["first_job_id"], evidence["second_job_id"]} == set(fake.jobs_for(op.idempotency_token))
    assert evidence["second_response"]["body"]["id"] == evidence["second_job_id"]
    creates = fake.counts["creates_received"]
    again = run(jt.advance_create(op.operation_id))  # no further automatic action
    assert again == jt.store.get(op.operation_id) and again.state is S.NEEDS_ATTENTION
    assert fake.counts["creates_received"] == creates


def test_a_replay_that_keeps_answering_a_stored_500_is_settled_by_the_other_declared_path(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider
) -> None:
    """Stripe stores a create's outcome once it began executing and replays it, a 500 included: every replay
    answers the same. A listing by the token finds the job the first create made, at the first replay that
    settles nothing, instead of replaying until the create deadline and then asking a person."""
    fake.script(Fault.stored_error(500))
    jt = make_client(
        fake,
        reconcile={"modes": ["replay", "list_by_reference"], "list_path": "/v1/jobs?client_reference={token}"},
    )
    op = submit_and_drive(jt)
    assert op.state is S.ACCEPTED and op.remote_job_id == fake.jobs_for(op.idempotency_token)[0]
    assert fake.counts["creates_received"] == 2 and fake.counts["jobs_created"] == 1
    assert fake.counts["replayed"] == 1 and fake.counts["lists"] == 1
    # the replay's answer settled nothing; the listing, asked under the same lease, found the job
    assert causes(jt, op.operation_id)[-2:] == ["reconciliation:create_attempt", "accepted:confirmed_create"]
    assert jt.store.history(op.operation_id)[-1].to_json()["evidence"]["via"] == "list_by_reference"
    assert verify(jt.store).ok


def test_a_replay_that_settles_nothing_is_tried_again_when_the_other_path_finds_no_job(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider
) -> None:
    """An absence proves nothing here (the first create may still run at the provider): the replay is tried
    again, under the same token, and settles it."""
    fake.script(Fault.http(500), Fault.http(500))
    jt = make_client(
        fake,
        reconcile={"modes": ["replay", "list_by_reference"], "list_path": "/v1/jobs?client_reference={token}"},
    )
    op = submit_and_drive(jt)
    assert op.state is S.ACCEPTED and fake.counts["jobs_created"] == 1
    # one listing after the 503 (no job yet), one to cross-check the replay that confirmed it
    assert fake.counts["creates_received"] == 3 and fake.counts["lists"] == 2
    assert jt.store.history(op.operation_id)[-1].to_json()["evidence"]["via"] == "replay"


def test_a_replay_answered_later_please_is_not_taken_for_a_stored_outcome(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider
) -> None:
    """A 503 with Retry-After (shed load), a 429, a time-out: no outcome the provider could have stored, so
    nothing else is asked before the replay goes again once Retry-After has passed."""
    fake.script(Fault.http(500), Fault.http(503, retry_after="0"), Fault.drop(commit=False))
    jt = make_client(
        fake,
        reconcile={"modes": ["replay", "list_by_reference"], "list_path": "/v1/jobs?client_reference={token}"},
    )
    op = submit_and_drive(jt)
    assert op.state is S.ACCEPTED and fake.counts["jobs_created"] == 1
    assert fake.counts["creates_received"] == 4 and fake.counts["lists"] == 1  # the replay's cross-check only


def test_a_job_id_another_operation_holds_is_never_given_to_a_second_one(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider
) -> None:
    """The provider answers a second, different request with the first one's job id (it mixed the two up):
    the second request may never have run, and one remote job cannot be two operations'. Before, both were
    accepted and both ended succeeded with the one job's result; nothing asked for a person."""
    jt = make_client(fake)
    first = submit_and_drive(jt, {"prompt": "translate the report"})
    fake.script(Fault.previous_job())
    second = submit_and_drive(jt, {"prompt": "delete the account"})
    assert first.state is S.ACCEPTED and second.state is S.NEEDS_ATTENTION
    assert second.remote_job_id is None and jt.store.get(first.operation_id).remote_job_id == first.remote_job_id
    reason = second.state_reason or ""
    assert first.operation_id in reason and first.remote_job_id in reason and "a person decides" in reason
    evidence = jt.store.history(second.operation_id)[-1].to_json()["evidence"]
    assert evidence["kind"] == "cannot_tell" and evidence["reason"] == "job_id_taken"
    assert evidence["candidates"] == [first.remote_job_id]
    assert fake.counts["creates_received"] == 2 and fake.counts["jobs_created"] == 1
    again = run(jt.advance_create(second.operation_id))  # no further automatic action
    assert again.state is S.NEEDS_ATTENTION and fake.counts["creates_received"] == 2


def test_no_reconciliation_path_says_so_plainly_and_never_resends(
    make_client: Callable[..., AsyncJobtrail],
) -> None:
    fake = FakeProvider(idempotency=False, job_duration_s=0.3).start()
    try:
        fake.script(Fault.drop())
        jt = make_client(fake, create={"token": {"in": "none"}}, reconcile=None)
        op = submit_and_drive(jt)
        assert op.state is S.NEEDS_ATTENTION
        assert "at-most-once not guaranteed" in (op.state_reason or "")
        assert op.trace_id in (op.state_reason or "")
        assert fake.counts["creates_received"] == 1 and fake.counts["jobs_created"] == 1
        assert "Idempotency-Key" not in fake.create_headers[0]
    finally:
        fake.stop()


def test_synchronous_success_is_stored_under_the_same_operation(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider
) -> None:
    fake.script(Fault.synchronous())
    jt = make_client(fake)
    op = submit_and_drive(jt, {"prompt": "quick"})
    assert op.state is S.RESULT_COLLECTING
    assert "synchronous result stored" in (op.state_reason or "")
    result = [o for o in jt.store.observations(op.operation_id) if o["kind"] == "synchronous_result"]
    assert result[0]["raw"]["result"]["output"] == {"echo": {"prompt": "quick"}}
    assert jt.store.history(op.operation_id)[-1].cause == "synchronous_result"
    assert fake.counts["jobs_created"] == 1


@pytest.mark.parametrize("status", [400, 401, 404, 422])
def test_definitive_rejection_fails_with_the_problem_kept(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider, status: int
) -> None:
    fake.script(Fault.reject(status))
    jt = make_client(fake)
    op = submit_and_drive(jt)
    assert op.state is S.FAILED and fake.counts["creates_received"] == 1
    evidence = jt.store.history(op.operation_id)[-1].to_json()["evidence"]
    assert evidence["http_status"] == status and evidence["problem"]["title"] == "rejected"


def test_a_rejection_says_why_in_the_providers_own_words(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reason that said only "HTTP 400" sent a person to the raw answer to learn that a field was
    misspelled: the provider's own sentence comes into the reason (bounded, and masked like all of it)."""
    op = submit_and_drive(make_client(fake), {"fake": {"duraton": 1}})  # a typo the fake refuses by name
    assert op.state is S.FAILED
    assert "HTTP 400" in op.state_reason and "unknown fake option 'duraton'" in op.state_reason

    monkeypatch.setenv("FAKE_API_KEY", "sk-live-0123456789abcdefXYZ")
    fake.script(Fault.reject(401, echo_auth=True))  # a provider that repeats the credential in its refusal
    op = submit_and_drive(make_client(fake, credential="env:FAKE_API_KEY"), {"p": 2})
    assert op.state is S.FAILED and "rejected credential" in op.state_reason
    assert "0123456789abcdef" not in op.state_reason


def test_declared_non_retryable_error_code_fails_even_on_5xx(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider
) -> None:
    fake.script(Fault.http(500))  # body {"title": "fault 500"}
    jt = make_client(fake, create={"error_code": "$.title", "non_retryable": ["fault 500"]})
    op = submit_and_drive(jt)
    assert op.state is S.FAILED and fake.counts["creates_received"] == 1


def test_create_deadline_without_a_job_id_needs_a_person_never_failed(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider
) -> None:
    clock = FakeClock()
    fake.script(*[Fault.http(503, retry_after="30")] * 10)
    jt = make_client(fake, clock=clock)

    async def go() -> Any:
        op = await jt.submit("fake", {"p": 4}, create_deadline=timedelta(minutes=2))
        while op.state not in (S.NEEDS_ATTENTION, S.ACCEPTED):
            op = await jt.advance_create(op.operation_id)
            clock.advance(30)
        await jt.providers["fake"].aclose()
        return op

    op = run(go())
    assert op.state is S.NEEDS_ATTENTION
    assert (op.state_reason or "").startswith("create_unresolved")
    assert jt.store.history(op.operation_id)[-1].to_json()["evidence"]["deadline"] == "create"
    assert fake.counts["creates_received"] <= 5 and fake.counts["jobs_created"] == 0


@pytest.mark.parametrize("commit", [True, False], ids=["job-exists", "no-job"])
def test_status_by_client_id_reconciles_both_ways(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider, commit: bool
) -> None:
    fake.script(Fault.drop(commit=commit))
    jt = make_client(fake, reconcile={"modes": ["status_by_client_id"], "status_path": "/v1/jobs/by-client-id/{token}"})
    op = submit_and_drive(jt)
    assert op.state is S.ACCEPTED
    assert fake.jobs_for(op.idempotency_token) == [op.remote_job_id]
    assert fake.counts["lookups"] == 1
    kinds = [e.cause for e in jt.store.history(op.operation_id)]
    if commit:
        assert kinds[-1] == "confirmed_create" and fake.counts["creates_received"] == 1
    else:
        assert "proved_absent" in kinds and fake.counts["creates_received"] == 2


def test_list_by_reference_with_the_token_in_the_body(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider
) -> None:
    fake.script(Fault.drop())
    jt = make_client(
        fake,
        create={"token": {"in": "body", "name": "client_reference"}},
        reconcile={"modes": ["list_by_reference"], "list_path": "/v1/jobs?client_reference={token}"},
    )
    op = submit_and_drive(jt, {"prompt": "body token"})
    assert op.state is S.ACCEPTED and fake.counts["jobs_created"] == 1 and fake.counts["lists"] == 1
    assert op.request_body == {"prompt": "body token"}  # the token is added on the wire, not stored in the body


def test_malformed_success_is_never_taken_for_a_job(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider
) -> None:
    fake.script(Fault.malformed())
    jt = make_client(fake)
    op = submit_and_drive(jt)
    assert op.state is S.NEEDS_ATTENTION and "create.job_id" in (op.state_reason or "")
    assert fake.counts["jobs_created"] == 1


def test_operation_key_guards_the_fingerprint(make_client: Callable[..., AsyncJobtrail], fake: FakeProvider) -> None:
    jt = make_client(fake)
    first = submit_and_drive(jt, {"report": "2026-11"}, key="monthly-report")
    again = submit_and_drive(jt, {"report": "2026-11"}, key="monthly-report")
    assert again.operation_id == first.operation_id and again.state is S.ACCEPTED
    with pytest.raises(OperationKeyConflict, match="a changed request is a new operation"):
        submit_and_drive(jt, {"report": "2026-12"}, key="monthly-report")
    assert fake.counts["creates_received"] == 1


def test_expired_token_is_not_replayed(make_client: Callable[..., AsyncJobtrail], fake: FakeProvider) -> None:
    clock = FakeClock()
    fake.script(Fault.drop())
    jt = make_client(fake, clock=clock, create={"token_retention_s": 60})

    async def go() -> Any:
        op = await jt.submit("fake", {"p": 5})
        op = await jt.advance_create(op.operation_id)  # dropped -> create_unknown
        clock.advance(61)
        for _ in range(3):  # -> reconciliation -> (token expired) needs_attention
            op = await jt.advance_create(op.operation_id)
        await jt.providers["fake"].aclose()
        return op

    op = run(go())
    assert op.state is S.NEEDS_ATTENTION and "expired" in (op.state_reason or "")
    assert fake.counts["creates_received"] == 1


def test_bare_token_header_for_stripe_style_providers(
    make_client: Callable[..., AsyncJobtrail], fake: FakeProvider
) -> None:
    jt = make_client(fake, create={"token": {"in": "header", "name": "Idempotency-Key", "quoted": False}})
    op = submit_and_drive(jt)
    assert fake.create_headers[0]["Idempotency-Key"] == op.idempotency_token


def test_sync_facade_for_scripts(db_url: str, fake: FakeProvider) -> None:
    """Jobtrail wraps the async core for scripts: submit, drive, read back."""
    from jobtrail import Jobtrail

    fake.script(Fault.drop())
    with Jobtrail(db_url, providers=[fake.provider_config()]) as jt:
        op = jt.submit("fake", {"script": True}, key="nightly")
        assert jt.get(op.operation_id).state is S.CREATE_PENDING
        done = jt.drive_create(op.operation_id)
        assert done.state is S.ACCEPTED
        assert jt.submit("fake", {"script": True}, key="nightly").operation_id == op.operation_id
    assert fake.counts["jobs_created"] == 1


def test_a_refusals_words_that_no_database_takes_are_made_plain(store: Store) -> None:
    """A lying provider's sentence may carry NULs, control characters and megabytes: the reason keeps
    printable words, bounded, and both databases store it (PostgreSQL refuses a NUL in text outright)."""
    said = in_their_words({"error": {"message": "bad\x00field\r\n\tname\x1b[31m" + "x" * 10_000}}, Redactor())
    assert said.startswith(': "bad field name [31mxxx') and said.endswith('..."') and len(said) < 320
    assert all(c.isprintable() for c in said)
    nothing = [in_their_words(value, Redactor()) for value in ({"detail": "\x00\n"}, [1, 2], None)]
    assert nothing == ["", "", ""]
    op = op_in(store, S.CREATE_PENDING)
    failed = store.transition(
        op,
        S.FAILED,
        DefinitiveRejection(http_status=400, problem={}),
        actor="w",
        changes={"state_reason": f"rejected by the provider: HTTP 400{said}"},
    )
    assert store.get(op.operation_id).state_reason == failed.state_reason


def test_job_ids_a_listing_names_are_held_to_the_rule_of_a_creates_answer() -> None:
    """Found by a review: ids an adapter read from a provider's list (OpenAI's batches) were adopted as they
    came, a line break and HTML in one included, where an id in a create's answer is refused for less."""
    from types import SimpleNamespace

    from jobtrail.domain.redact import Redactor
    from jobtrail.flows.create import _usable
    from jobtrail.providers.contract import LookupOutcome, ReconcileMode

    provider: Any = SimpleNamespace(redactor=Redactor())
    lying = ("batch_1 \n\n<img src=x onerror=alert(1)>", "batch_\u202eelif")
    found = _usable(LookupOutcome(kind="found", path=ReconcileMode.LIST_BY_REFERENCE, remote_job_ids=lying), provider)
    assert found.kind == "unknown" and found.remote_job_ids == () and "2 job id(s)" in found.detail
    listed = LookupOutcome(kind="candidates", path=ReconcileMode.LIST_BY_REFERENCE, remote_job_ids=("batch_ok", *lying))
    assert _usable(listed, provider).remote_job_ids == ("batch_ok",)


def test_a_request_id_that_would_show_as_other_text_names_no_request(db_url: str) -> None:
    """Found by a probe: a provider's X-Request-Id holding a right-to-left override was quoted in the history,
    the timeline and the escalation bundle, where it read as another id. Such an id names no request (as a
    job id holding one is unusable); the header itself is kept with the answer."""
    from aiohttp import web

    turned = "req_\u202e1234_DI\u202c"

    async def create(_request: web.Request) -> web.StreamResponse:
        return web.json_response({"id": "job-1"}, status=201, headers={"X-Request-Id": turned})

    async def go() -> tuple[Any, list[dict[str, Any]], Any]:
        async with provider_of_our_own(("POST", "/v1/jobs", create)) as base:
            config = {
                "name": "turned",
                "base_url": base,
                "create": {"path": "/v1/jobs", "job_id": "$.id"},
                "status": {"path": "/v1/jobs/{job_id}", "state": "$.status"},
                "result": {"path": "/v1/jobs/{job_id}/result"},
            }
            with Store.open(db_url) as store:
                jt = AsyncJobtrail(store=store, providers=[config])
                try:
                    op = await jt.drive_create((await jt.submit("turned", {"prompt": "x"})).operation_id)
                    return op, store.observations(op.operation_id), store.history(op.operation_id)[-1]
                finally:
                    await jt.providers["turned"].aclose()

    op, observed, last = run(go())
    assert op.state is S.ACCEPTED and op.remote_job_id == "job-1"
    assert last.to_json()["provider_request_ids"] == [] and observed[0]["provider_request_id"] is None
    kept = {name.lower(): value for name, value in observed[0]["raw"]["headers"].items()}
    assert kept["x-request-id"] == turned  # what it sent is still on record, as it sent it
