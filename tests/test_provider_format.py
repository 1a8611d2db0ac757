"""The declarative format says what real APIs need: ids with slashes, headers per endpoint, finer Retry-After."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from jobtrail import AsyncJobtrail, ConfigError, State, Store, Worker
from jobtrail.domain.jsonpath import extract_any
from jobtrail.domain.record import Operation
from jobtrail.ledger.results import read_result
from jobtrail.providers.contract import NoAnswer, ReconcileMode, Response, guarantees
from jobtrail.providers.http import HttpProvider, _retry_after, parse_config
from jobtrail.testing import FakeProvider, Fault

from helpers import spec


def provider(fake: FakeProvider, **overrides: Any) -> HttpProvider:
    return HttpProvider(parse_config(fake.provider_config(**overrides)))


def with_job(op: Operation, job_id: str) -> Operation:
    return dataclasses.replace(op, remote_job_id=job_id)


def test_an_id_with_slashes_keeps_them_only_where_the_file_asks(ledger: Store, fake: FakeProvider) -> None:
    op, _ = ledger.create_operation(spec())  # any operation: only its job id matters here
    named = with_job(op, "projects/p 1/locations/l/operations/op-1")
    google = provider(fake, status={"path": "/v1/{+job_id}"})
    assert (
        google._url("/v1/{+job_id}", named) == f"{google.config.base_url}/v1/projects/p%201/locations/l/operations/op-1"
    )
    assert google._url("/v1/jobs/{job_id}", named).endswith(
        "/v1/jobs/projects%2Fp%201%2Flocations%2Fl%2Foperations%2Fop-1"
    )
    # a provider's id never adds a query, and one that would climb out of its path is refused on arrival
    assert google._url("/v1/{+job_id}", with_job(op, "a/b?all=1#x")).endswith("/v1/a/b%3Fall%3D1%23x")
    for hostile in ("../../admin/keys", "projects/p/operations/..", "."):
        said = google.classify_create(Response(http_status=201, body={"id": hostile}))
        assert said.kind == "ambiguous" and said.remote_job_id is None
        assert "unusable job id at $.id (a . or .. path segment; not stored)" in said.detail


def test_an_unknown_placeholder_names_the_reserved_form(fake: FakeProvider) -> None:
    with pytest.raises(ConfigError, match=r"write \{\+job_id\} to keep the slashes"):
        parse_config(fake.provider_config(status={"path": "/v1/{+name}"}))


def test_headers_declared_for_the_create_go_with_the_create_only(ledger: Store, fake: FakeProvider) -> None:
    cfg = fake.provider_config(create={"headers": {"Prefer": "wait"}})

    async def go() -> None:
        async with AsyncJobtrail(store=ledger, providers=[cfg]) as jt:
            op = await jt.submit("fake", {"prompt": "x"})
            await jt.drive_create(op.operation_id)

    asyncio.run(go())
    assert fake.create_headers[0]["Prefer"] == "wait"
    status = parse_config(cfg).status
    assert status is not None and "Prefer" not in status.headers


def test_a_credential_cannot_hide_in_an_endpoints_headers(fake: FakeProvider) -> None:
    with pytest.raises(ConfigError, match=r"create\.headers\.Authorization: expected no credentials in headers"):
        parse_config(fake.provider_config(create={"headers": {"Authorization": "Bearer sk-live"}}))


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"retry-after-ms": "250", "Retry-After": "3"}, 0.25),
        ({"Retry-After": "3"}, 3.0),
        ({"retry-after-ms": "soon", "Retry-After": "2"}, 2.0),
        ({"retry-after-ms": "nan"}, None),
        ({"retry-after-ms": "-5", "retry-after": "1"}, 1.0),
    ],
)
def test_retry_after_ms_is_read_before_retry_after(headers: dict[str, str], seconds: float | None) -> None:
    assert _retry_after(headers) == seconds


def test_json_paths_are_rfc_9535() -> None:
    body = {"a.b": {"items": [{"id": "x"}, {"id": "y"}]}, "data": [1, 2, 3], "n": None}
    assert extract_any("$['a.b'].items[-1].id", body) == "y"
    assert extract_any("$.data[-1]", body) == 3
    assert extract_any("$.data[7]", body) is None and extract_any("$.n", body) is None
    assert extract_any("$['a.b'].items[*].id", body) == ["x", "y"]
    assert extract_any("$..id", body) == ["x", "y"]
    assert extract_any("$['a.b'].items[?@.id == 'y'].id", body) == ["y"]


def test_a_list_path_may_select_many_and_a_value_path_may_not(fake: FakeProvider) -> None:
    cfg = fake.provider_config(reconcile={"modes": ["list_by_reference"], "list_path": "/v1/jobs?r={token}"})
    cfg["reconcile"]["items"] = "$.data[*]"
    assert parse_config(cfg).list_items == "$.data[*]"
    cfg["reconcile"]["reference"] = "$..client_reference"
    with pytest.raises(ConfigError, match=r"reconcile\.reference: expected .*one value"):
        parse_config(cfg)


# -- what the five real APIs needed, end to end against the fake ---------------------------------


def run_to_end(ledger: Store, cfg: dict[str, Any], body: Any) -> Operation:
    async def go() -> Operation:
        async with AsyncJobtrail(store=ledger, providers=[cfg]) as jt:
            op = await jt.submit("fake", body)
            await jt.drive_create(op.operation_id)
            await Worker(ledger, {"fake": jt.providers["fake"]}, idle_s=0.02).run(until_settled=True, timeout=30)
            return ledger.get(op.operation_id)

    return asyncio.run(go())


def test_the_token_joins_the_callers_metadata_without_replacing_it(ledger: Store, fake: FakeProvider) -> None:
    cfg = fake.provider_config(create={"token": {"in": "body", "name": "metadata.jobtrail_ref"}})
    op = run_to_end(ledger, cfg, {"prompt": "x", "metadata": {"owner": "ana"}})
    (job,) = fake.jobs.values()
    assert job.body == {"prompt": "x", "metadata": {"owner": "ana", "jobtrail_ref": op.idempotency_token}}
    assert op.request_body == {"prompt": "x", "metadata": {"owner": "ana"}}  # the record keeps the caller's intent


def test_a_state_no_single_field_holds_is_derived_by_rules(ledger: Store, fake: FakeProvider) -> None:
    rules = [{"if": "$.result_url", "state": "succeeded"}, {"if": "$.status", "equals": "failed", "state": "failed"}]
    cfg = fake.provider_config(status={"state": "$.no_such_field", "rules": rules})
    op = run_to_end(ledger, cfg, {"prompt": "x"})
    assert op.state is State.SUCCEEDED, op.state_reason


@pytest.mark.parametrize(
    ("result", "status", "expected"),
    [
        ({"path": None, "checksum": None, "from_status": "$.id"}, {}, b'"job_00001"'),
        ({"path": "/v1/jobs/{result_ref}/result"}, {"result_ref": "$.id"}, None),
    ],
    ids=["from the status body", "a path templated with the reference"],
)
def test_a_result_where_the_api_puts_it(
    ledger: Store, fake: FakeProvider, result: dict[str, Any], status: dict[str, Any], expected: bytes | None
) -> None:
    cfg = fake.provider_config(result=result, status=status)
    cfg["result"] = {k: v for k, v in cfg["result"].items() if v is not None}
    op = run_to_end(ledger, cfg, {"prompt": "x"})
    assert op.state is State.SUCCEEDED, op.state_reason
    _, kept = read_result(ledger, op.operation_id)
    assert kept == (expected or next(iter(fake.jobs.values())).result_bytes()[0])


def test_a_result_path_that_can_never_resolve_is_refused_at_load(fake: FakeProvider) -> None:
    cfg = fake.provider_config(result={"path": "/v1/files/{result_ref}/content"}, status={"result_ref": None})
    cfg["status"] = {k: v for k, v in cfg["status"].items() if v is not None}
    with pytest.raises(ConfigError, match=r"result\.path: expected a path that can resolve"):
        parse_config(cfg)


def test_a_lost_create_is_found_on_the_third_page_of_the_list(ledger: Store) -> None:
    fake = FakeProvider(idempotency=False, job_duration_s=0.2).start()
    try:
        cfg = fake.provider_config(
            create={"token": {"in": "body", "name": "client_reference"}},
            reconcile={
                "modes": ["list_by_reference"],
                "list_path": "/v1/jobs?limit=2",
                "cursor": "$.last_id",
                "has_more": "$.has_more",
            },
        )

        async def go() -> Operation:
            async with AsyncJobtrail(store=ledger, providers=[cfg]) as jt:
                for n in range(4):  # four jobs of others first: ours is on page 3
                    await jt.drive_create((await jt.submit("fake", {"n": n})).operation_id)
                fake.script(Fault.drop())
                op = await jt.submit("fake", {"n": "ours"})
                return await jt.drive_create(op.operation_id)

        op = asyncio.run(go())
        assert op.state is State.ACCEPTED, op.state_reason
        assert op.remote_job_id == fake.jobs_for(op.idempotency_token)[0]
        assert fake.counts["lists"] == 3 and fake.counts["jobs_created"] == 5
    finally:
        fake.stop()


def test_a_request_the_contract_cannot_carry_is_refused_at_submit(ledger: Store, fake: FakeProvider) -> None:
    cfg = fake.provider_config(create={"token": {"in": "body", "name": "metadata.jobtrail_ref"}})

    async def go(body: Any) -> None:
        async with AsyncJobtrail(store=ledger, providers=[cfg]) as jt:
            await jt.submit("fake", body)

    for body, why in (([1, 2], "must be a JSON object"), ({"metadata": "mine"}, "'metadata' is not a JSON object")):
        with pytest.raises(ConfigError, match=f"refuses this request \\(nothing was recorded or sent\\): .*{why}"):
            asyncio.run(go(body))
    assert ledger.list_operations(limit=None) == [] and fake.counts["creates_received"] == 0


def test_providers_check_warns_when_a_finished_jobs_result_has_nowhere_to_come_from(fake: FakeProvider) -> None:
    cfg = fake.provider_config(result=None)
    cfg["status"] = {k: v for k, v in cfg["status"].items() if k != "result_ref"}
    (warning,) = guarantees(HttpProvider(parse_config(cfg)))["warnings"]
    assert warning.startswith("no [result] path, [result] from_status or [status] result_ref")
    assert guarantees(HttpProvider(parse_config(fake.provider_config())))["warnings"] == []


def test_a_list_that_says_more_pages_follow_but_gives_no_way_to_them_proves_nothing(
    ledger: Store, fake: FakeProvider
) -> None:
    cfg = fake.provider_config(
        create={"token": {"in": "body", "name": "client_reference"}},
        reconcile={
            "modes": ["list_by_reference"],
            "list_path": "/v1/jobs?limit=2",
            "cursor": "$.no_such_cursor",  # the answer has has_more, but no cursor where the file says
            "has_more": "$.has_more",
        },
    )

    async def go() -> tuple[Any, Any]:
        async with AsyncJobtrail(store=ledger, providers=[cfg]) as jt:
            for n in range(3):
                await jt.drive_create((await jt.submit("fake", {"n": n})).operation_id)
            mine = await jt.submit("fake", {"n": "mine"})
            await jt.drive_create(mine.operation_id)
            provider = jt.providers["fake"]
            return await provider.lookup(ledger.get(mine.operation_id), ReconcileMode.LIST_BY_REFERENCE), mine

    found, mine = asyncio.run(go())
    assert found.kind == "unknown" and "more pages follow, but the answer gives no usable cursor" in found.detail
    assert fake.jobs_for(mine.idempotency_token)  # it exists, on a page the list could not reach


def test_a_result_reference_cannot_move_the_credentialed_fetch_to_another_path(
    ledger: Store, fake: FakeProvider
) -> None:
    cfg = fake.provider_config(result={"path": "/v1/jobs/{job_id}/files/{result_ref}"}, status={"result_ref": "$.id"})
    provider = HttpProvider(parse_config(cfg))
    op, _ = ledger.create_operation(spec())
    for hostile in ("..", "../../admin/keys", "a/./b"):
        got = asyncio.run(provider.fetch_result(with_job(op, "job_1"), hostile))
        assert isinstance(got, NoAnswer) and got.refused and "a . or .. path segment" in got.detail
    assert fake.counts["results"] == 0 and not any("admin" in path for _, _, path in fake.requests)
