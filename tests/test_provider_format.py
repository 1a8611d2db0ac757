"""The declarative format says what real APIs need: ids with slashes, headers per endpoint, finer Retry-After."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from jobtrail import AsyncJobtrail, ConfigError, Store
from jobtrail.domain.jsonpath import extract_any
from jobtrail.domain.record import Operation
from jobtrail.providers.contract import Response
from jobtrail.providers.http import HttpProvider, _retry_after, parse_config
from jobtrail.testing import FakeProvider

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
