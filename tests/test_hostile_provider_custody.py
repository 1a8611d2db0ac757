"""A provider that lies about where things are: the credential stays home, nothing undeclared is fetched.

The hostile provider is a real aiohttp server on 127.0.0.1. Its status answers hand out
``result_url`` values that point elsewhere: another port on 127.0.0.1, a second loopback
address (127.0.0.2) where a *side listener* counts every connection it receives, a
userinfo trick, a link-local address, a declared host name that resolves to loopback. A
declared download host on 127.0.0.3 is the one place a result may come from besides the
provider, and it must never see the credential or the provider file's headers.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp.abc
import pytest
import sqlalchemy as sa
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from jobtrail import AsyncJobtrail, State, Store
from jobtrail.domain.errors import ConfigError
from jobtrail.domain.jsonpath import extract
from jobtrail.domain.redact import Redactor, Secret
from jobtrail.flows import observe
from jobtrail.ledger.audit import verify
from jobtrail.ledger.results import read_result
from jobtrail.ledger.store import MAX_OBSERVED_CHARS
from jobtrail.providers.contract import NoAnswer, guarantees
from jobtrail.providers.egress import (
    AddressRefused,
    EgressPolicy,
    PublicOnlyResolver,
    UrlRefused,
    is_special,
    origin_of,
    parse_host_rule,
)
from jobtrail.providers.http import HttpProvider, load_provider, parse_config
from jobtrail.runtime.worker import Worker
from jobtrail.testing._fake_provider import provider_toml

CANARY_ENV = "JT_HOSTILE_API_KEY"
FAST = {
    "retry": {"initial_s": 0.02, "factor": 1, "cap_s": 0.05},
    "poll": {"initial_s": 0.02, "factor": 1, "cap_s": 0.05},
}


def _loopback_alias_available(host: str) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, 0))
        except OSError:
            return False
    return True


pytestmark = pytest.mark.skipif(
    not (_loopback_alias_available("127.0.0.2") and _loopback_alias_available("127.0.0.3")),
    reason="needs the 127.0.0.0/8 loopback aliases 127.0.0.2 and 127.0.0.3 (Linux has them)",
)


@pytest.fixture
def canary(monkeypatch: pytest.MonkeyPatch) -> str:
    value = "canary-" + secrets.token_hex(16)
    monkeypatch.setenv(CANARY_ENV, value)
    return value


# -- the servers ------------------------------------------------------------------------------------


class SideListener:
    """A raw TCP listener that records every connection and every byte (it should get none)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.port = 0
        self.connections = 0
        self.received = b""
        self._server: asyncio.Server | None = None

    async def start(self) -> SideListener:
        self._server = await asyncio.start_server(self._on_connect, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            self.received += await asyncio.wait_for(reader.read(65536), 1.0)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\nConnection: close\r\n\r\nstolen")
            await writer.drain()
        except (TimeoutError, OSError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class HttpListener:
    """A small aiohttp server that records each request's method, path and headers."""

    def __init__(self, host: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
        self.host = host
        self.port = 0
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self._handler = handler
        self._runner: web.AppRunner | None = None

    @property
    def origin(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> HttpListener:
        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            self.requests.append((request.method, request.raw_path, dict(request.headers)))
            return await handler(request)

        app = web.Application(middlewares=[record])
        app.router.add_route("*", "/{tail:.*}", self._handler)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class Hostile:
    """The provider: creates jobs, then points their results wherever it likes."""

    def __init__(self) -> None:
        self.result_url = "/v1/jobs/job-1/result"
        self.create_status = 201
        self.location = ""
        self.job_id = "job-1"
        self.state = "succeeded"
        self.redirect_to = ""
        self.status_padding = 0  # characters of filler in each status answer
        self.server = HttpListener("127.0.0.1", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if request.method == "POST" and path == "/v1/jobs":
            if 300 <= self.create_status < 400:
                return web.Response(status=self.create_status, headers={"Location": self.location})
            return web.json_response({"id": self.job_id, "status": "queued"}, status=self.create_status)
        if request.method == "GET" and path == f"/v1/jobs/{self.job_id}":
            status = {"id": self.job_id, "status": self.state, "result_url": self.result_url}
            return web.json_response(status | ({"filler": "x" * self.status_padding} if self.status_padding else {}))
        if request.method == "GET" and path == "/v1/redirect":
            return web.Response(status=302, headers={"Location": self.redirect_to})
        if request.method == "GET" and path == f"/v1/jobs/{self.job_id}/result":
            return web.json_response({"from": "provider"})
        return web.json_response({"error": "not found"}, status=404)

    def posts(self) -> int:
        return sum(1 for method, path, _ in self.server.requests if method == "POST")


async def _blob(request: web.Request) -> web.StreamResponse:
    return web.Response(body=b'{"answer": 42, "from": "storage"}', content_type="application/json")


class World:
    def __init__(self) -> None:
        self.hostile = Hostile()
        self.side = SideListener("127.0.0.2")  # another loopback address
        self.other_port = SideListener("127.0.0.1")  # the provider's host, another port
        self.storage = HttpListener("127.0.0.3", _blob)  # the declared download host
        self.storage_by_name = SideListener("127.0.0.1")  # reached only through "localhost"

    def config(self, **overrides: Any) -> dict[str, Any]:
        config: dict[str, Any] = {
            "name": "hostile",
            "base_url": self.hostile.server.origin,
            "credential": f"env:{CANARY_ENV}",
            "auth": "header:X-Api-Key",
            "headers": {"X-Tenant": "tenant-7"},
            "timeout_s": 2.0,
            "connect_timeout_s": 1.0,
            "create": {"path": "/v1/jobs", "job_id": "$.id", "token_retention_s": 86400},
            "status": {"path": "/v1/jobs/{job_id}", "state": "$.status", "result_ref": "$.result_url"},
            "result": {
                "path": "/v1/jobs/{job_id}/result",
                "download_hosts": [self.storage.origin, f"http://localhost:{self.storage_by_name.port}"],
            },
            "reconcile": {"modes": ["replay"]},
            **FAST,
        }
        config.update(overrides)
        return config

    def leaked_elsewhere(self, canary: str) -> list[str]:
        """Every place other than the provider's origin that saw the credential or a provider header."""
        found = []
        for name, listener in (("side", self.side), ("other_port", self.other_port), ("by_name", self.storage_by_name)):
            if canary.encode() in listener.received or b"tenant-7" in listener.received:
                found.append(name)
        for _, _, headers in self.storage.requests:
            lowered = {k.lower(): v for k, v in headers.items()}
            if canary in json.dumps(headers) or "x-api-key" in lowered or "x-tenant" in lowered:
                found.append("storage")
        return found


@asynccontextmanager
async def world() -> AsyncIterator[World]:
    w = World()
    for server in (w.hostile.server, w.side, w.other_port, w.storage, w.storage_by_name):
        await server.start()
    try:
        yield w
    finally:
        for server in (w.hostile.server, w.side, w.other_port, w.storage, w.storage_by_name):
            await server.stop()


async def run_one(store: Store, config: dict[str, Any], *, seconds: float = 10) -> str:
    jt = AsyncJobtrail(store=store, providers=[config])
    op = await jt.submit("hostile", {"input": "x"})
    await jt.aclose()
    worker = Worker(store, {"hostile": load_provider(config)}, worker_id="w1", idle_s=0.02)
    await worker.run(until_settled=True, timeout=seconds)
    return op.operation_id


def fetches(store: Store, op_id: str) -> list[dict[str, Any]]:
    return [o["raw"] for o in store.observations(op_id) if o["kind"] == "result_fetch"]


# -- provider-chosen result URLs ------------------------------------------------------------------------


REFUSED_CASES = {
    # name: (result_url given the world, the host the reason must name)
    "other_port": (lambda w: f"http://127.0.0.1:{w.other_port.port}/steal", "127.0.0.1"),
    "second_loopback": (lambda w: f"http://127.0.0.2:{w.side.port}/steal", "127.0.0.2"),
    "network_path": (lambda w: f"//127.0.0.2:{w.side.port}/steal", "127.0.0.2"),
    "link_local": (lambda w: "http://169.254.169.254/latest/meta-data/", "169.254.169.254"),
    "suffix_trick": (lambda w: f"http://127.0.0.1.nip.io:{w.hostile.server.port}/x", "127.0.0.1.nip.io"),
    "declared_name_resolving_to_loopback": (lambda w: f"http://localhost:{w.storage_by_name.port}/blob", "localhost"),
}


@pytest.mark.parametrize("case", sorted(REFUSED_CASES))
def test_a_result_url_the_operator_did_not_declare_is_refused_without_a_request(
    store: Store, canary: str, case: str
) -> None:
    make_url, host = REFUSED_CASES[case]

    async def go() -> tuple[str, World]:
        async with world() as w:
            w.hostile.result_url = make_url(w)
            return await run_one(store, w.config()), w

    op_id, w = asyncio.run(go())
    op = store.get(op_id)
    # the ending says why, naming the host and the key that would allow it
    assert op.state is State.RESULT_UNAVAILABLE, op.state_reason
    assert host in (op.state_reason or "")
    assert "result.download_hosts" in (op.state_reason or "")
    # recorded once as an observation, and never asked again (a refusal cannot change by waiting)
    seen = fetches(store, op_id)
    assert len(seen) == 1 and seen[0]["error"]["error"] == "refused"
    assert "no request made" in seen[0]["error"]["detail"]
    # nobody but the provider saw anything; the provider did see the credential (it was in play)
    assert (w.side.connections, w.other_port.connections, w.storage_by_name.connections) == (0, 0, 0)
    assert w.storage.requests == []
    assert w.leaked_elsewhere(canary) == []
    assert all(h.get("X-Api-Key") == canary for _, _, h in w.hostile.server.requests)
    assert read_result_or_none(store, op_id) is None


def read_result_or_none(store: Store, op_id: str) -> bytes | None:
    try:
        return read_result(store, op_id)[1]
    except Exception:
        return None


def test_a_userinfo_reference_stays_on_the_providers_host(
    store: Store, canary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``@127.0.0.2:PORT/steal`` joined onto base_url once moved the request (and X-Api-Key) there."""
    monkeypatch.setattr(observe, "RESULT_PATIENCE_S", 0)  # a 404 is fetched again only its five times

    async def go() -> tuple[str, World]:
        async with world() as w:
            w.hostile.result_url = f"@127.0.0.2:{w.side.port}/steal"
            return await run_one(store, w.config()), w

    op_id, w = asyncio.run(go())
    assert w.side.connections == 0 and w.leaked_elsewhere(canary) == []
    # it was read as a path on the provider's own origin, which answers 404: a bounded number of tries
    paths = [p for m, p, _ in w.hostile.server.requests if m == "GET" and "steal" in p]
    assert paths and all(p == f"/@127.0.0.2:{w.side.port}/steal" for p in paths)
    assert len(paths) == len(fetches(store, op_id)) <= 5
    op = store.get(op_id)
    assert op.state is State.RESULT_UNAVAILABLE and "gave up" in (op.state_reason or "")


def test_a_declared_download_host_is_fetched_without_the_credential_and_stored_byte_exact(
    store: Store, canary: str
) -> None:
    async def go() -> tuple[str, World]:
        async with world() as w:
            w.hostile.result_url = f"{w.storage.origin}/blob?X-Signature=abc123"
            return await run_one(store, w.config()), w

    op_id, w = asyncio.run(go())
    op = store.get(op_id)
    assert op.state is State.SUCCEEDED, op.state_reason
    assert [(m, p) for m, p, _ in w.storage.requests] == [("GET", "/blob?X-Signature=abc123")]
    headers = {k.lower() for k in w.storage.requests[0][2]}
    assert not headers & {"x-api-key", "authorization", "x-tenant", "traceparent", "x-trace-id"}
    assert w.leaked_elsewhere(canary) == []
    assert read_result(store, op_id)[1] == b'{"answer": 42, "from": "storage"}'
    assert w.side.connections == 0


def test_a_worker_whose_first_request_is_a_download_knows_the_credential_already(store: Store, canary: str) -> None:
    """A worker restarted with a result to collect sends nothing to the provider before its download: the
    reference it is handed (here, one that carries the credential) is still judged against the credential,
    and the download host never sees it."""

    async def go() -> tuple[Any, World]:
        async with world() as w:
            config = w.config()
            jt = AsyncJobtrail(store=store, providers=[config])
            op = await jt.submit("hostile", {"input": "x"})
            await jt.aclose()
            fresh = load_provider(config)  # nothing resolved its credential yet
            return await fresh.fetch_result(op, f"{w.storage.origin}/blob/{canary}"), w

    answer, w = asyncio.run(go())
    assert isinstance(answer, NoAnswer) and answer.error_class == "refused", answer
    assert "carries a credential" in answer.detail
    assert w.storage.requests == [] and w.hostile.server.requests == []


def test_without_a_credential_the_provider_still_cannot_pick_an_address(store: Store) -> None:
    async def go() -> tuple[str, World]:
        async with world() as w:
            w.hostile.result_url = f"http://127.0.0.2:{w.side.port}/steal"
            config = w.config()
            del config["credential"], config["auth"]
            return await run_one(store, config), w

    op_id, w = asyncio.run(go())
    assert store.get(op_id).state is State.RESULT_UNAVAILABLE
    assert w.side.connections == 0 and len(fetches(store, op_id)) == 1


def test_a_redirect_on_a_result_fetch_is_not_followed(store: Store, canary: str) -> None:
    async def go() -> tuple[str, World]:
        async with world() as w:
            w.hostile.result_url = "/v1/redirect"
            w.hostile.redirect_to = f"http://127.0.0.2:{w.side.port}/steal"
            return await run_one(store, w.config()), w

    op_id, w = asyncio.run(go())
    assert w.side.connections == 0 and w.leaked_elsewhere(canary) == []
    seen = fetches(store, op_id)
    assert 1 <= len(seen) <= 5 and all(f["error"]["error"] == "redirect" for f in seen)
    assert f"127.0.0.2:{w.side.port}" in seen[0]["error"]["detail"]
    assert store.get(op_id).state is State.RESULT_UNAVAILABLE


# -- a create answered with a redirect ------------------------------------------------------------------


@pytest.mark.parametrize("status", [302, 307, 308])
def test_a_redirected_create_is_neither_followed_nor_resent(store: Store, canary: str, status: int) -> None:
    async def go() -> tuple[str, World]:
        async with world() as w:
            w.hostile.create_status = status
            w.hostile.location = f"http://127.0.0.2:{w.side.port}/v1/jobs"
            # the worker gets time for many retries; none may happen
            return await run_one(store, w.config(), seconds=1.5), w

    op_id, w = asyncio.run(go())
    op = store.get(op_id)
    assert w.hostile.posts() == 1
    assert w.side.connections == 0 and w.leaked_elsewhere(canary) == []
    # a POST answered with a redirect may or may not have made a job: a person decides, nothing is resent
    assert op.state is State.NEEDS_ATTENTION
    assert f"127.0.0.2:{w.side.port}" in (op.state_reason or "") and f"HTTP {status}" in (op.state_reason or "")
    assert op.remote_job_id is None and op.attempts == 1


# -- a provider echoing the credential as a job id or state ------------------------------------------------


def test_a_job_id_carrying_the_credential_is_unusable_and_never_stored(store: Store, canary: str) -> None:
    async def go() -> tuple[str, World]:
        async with world() as w:
            w.hostile.job_id = f"job-{canary}"
            return await run_one(store, w.config(), seconds=1.5), w

    op_id, w = asyncio.run(go())
    op = store.get(op_id)
    assert op.remote_job_id is None
    assert op.state is State.NEEDS_ATTENTION
    assert "unusable job id" in (op.state_reason or "") and "carries a credential" in (op.state_reason or "")
    assert canary not in (op.state_reason or "")
    # the create, then one replay of the same token: the same unusable answer stops it
    assert w.hostile.posts() == 2


@pytest.mark.parametrize("shown_as_other", ["job-\u202e7654-lave", "job\u200b-1", "job-\u2066x"])
def test_a_job_id_that_would_show_as_other_text_is_unusable(store: Store, canary: str, shown_as_other: str) -> None:
    """Found by a probe: a job id with a right-to-left override or a zero-width space was stored and shown as
    it came, so a listing showed another id than the one kept (an operation key with one is refused)."""

    async def go() -> tuple[str, World]:
        async with world() as w:
            w.hostile.job_id = shown_as_other
            return await run_one(store, w.config(), seconds=1.5), w

    op_id, _ = asyncio.run(go())
    op = store.get(op_id)
    reason = op.state_reason or ""
    assert op.remote_job_id is None and op.state is State.NEEDS_ATTENTION, reason
    assert "unusable job id" in reason and "which shows as nothing or turns the text around" in reason, reason
    assert shown_as_other not in reason


def test_a_state_carrying_the_credential_is_not_stored(store: Store, canary: str) -> None:
    async def go() -> tuple[str, World]:
        async with world() as w:
            w.hostile.state = f"running {canary}"
            jt = AsyncJobtrail(store=store, providers=[w.config()])
            op = await jt.submit("hostile", {"input": "x"})
            await jt.aclose()
            worker = Worker(store, {"hostile": load_provider(w.config())}, worker_id="w1", idle_s=0.02)
            await worker.run(timeout=1.0)
            return op.operation_id, w

    op_id, w = asyncio.run(go())
    op = store.get(op_id)
    polls = [o for o in store.observations(op_id) if o["kind"] == "status_poll"]
    assert polls and op.state is State.OBSERVING and op.remote_state is None
    assert all(o["remote_state"] == "unknown" and o["raw_state"] is None for o in polls)
    assert len([m for m, _, _ in w.hostile.server.requests if m == "GET"]) == len(polls)


def test_a_status_answer_of_megabytes_is_kept_as_its_size_and_digest_and_polling_goes_on(
    store: Store, canary: str
) -> None:
    """A provider that answers every status read with megabytes (2 MiB of JSON here, the job running): each
    poll's observation keeps the answer's small parts and its body as the body's size and sha256, so the ledger
    grows by kilobytes a poll. Before, each poll stored the whole body (15 MB a poll, in a probe)."""

    async def go() -> str:
        async with world() as w:
            w.hostile.state, w.hostile.status_padding = "running", 2 * 1024 * 1024
            jt = AsyncJobtrail(store=store, providers=[w.config()])
            op = await jt.submit("hostile", {"input": "x"})
            await jt.aclose()
            worker = Worker(store, {"hostile": load_provider(w.config())}, worker_id="w1", idle_s=0.02)
            await worker.run(timeout=1.5)
            return op.operation_id

    op_id = asyncio.run(go())
    op = store.get(op_id)
    polls = [o for o in store.observations(op_id) if o["kind"] == "status_poll"]
    assert len(polls) >= 2 and op.state is State.OBSERVING and op.remote_state == "running"
    for poll in polls:
        body = poll["raw"]["body"]
        assert body["withheld"].startswith("too large to keep") and body["bytes"] > 2 * 1024 * 1024
        assert len(body["sha256"]) == 64 and poll["raw"]["http_status"] == 200 and poll["raw"]["headers"]
    with store.engine.connect() as conn:
        largest = conn.execute(sa.text("SELECT max(length(raw)) FROM observations")).scalar_one()
    assert largest <= MAX_OBSERVED_CHARS
    assert verify(store).ok


def test_extract_refuses_values_carrying_a_registered_credential() -> None:
    value = "echo-" + secrets.token_hex(12)
    providers = Redactor()
    Secret(value, redactor=providers)  # registers it, as the provider resolving its credential does
    body = {"id": f"job_{value}", "status": value, "ok": "job_1"}
    assert extract("$.id", body, {}, providers) is None
    assert extract("$.status", body, {}, providers) is None
    assert extract("header:X-Job", None, {"X-Job": value}, providers) is None
    assert extract("$.ok", body, {}, providers) == "job_1"
    # a ledger that the provider forwards to learns the value, and masks it in what it stores
    ledger = Redactor()
    providers.forward_to(ledger)
    assert value not in ledger.text(f"job {value}")
    late = "late-" + secrets.token_hex(12)
    Secret(late, redactor=providers)  # resolved after the link (a rotated credential): forwarded too
    assert late not in ledger.text(f"job {late}")


# -- configuration errors at load time -------------------------------------------------------------------


def _base(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "name": "p",
        "base_url": "https://api.example.com",
        "create": {"path": "/v1/jobs"},
        "status": {"path": "/v1/jobs/{job_id}"},
    }
    for key, value in overrides.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        ({"status": {"path": "/v1/jobs/{jobid}"}}, "status.path", "placeholders"),
        ({"cancel": {"path": "/v1/jobs/{job_id.__class__}"}}, "cancel.path", "placeholders"),
        ({"create": {"path": "/v1/jobs/{"}}, "create.path", "braces"),
        ({"result": {"path": "/r/{job_id!r}"}}, "result.path", "placeholders"),
        ({"status": {"path": "v1/jobs/{job_id}"}}, "status.path", "starting with /"),
        ({"status": {"path": "https://api.example.com.evil.net/v1/{job_id}"}}, "status.path", "origin"),
        ({"status": {"path": "http://api.example.com/v1/{job_id}"}}, "status.path", "origin"),
        ({"status": {"state": "$.data["}}, "status.state", "not RFC 9535 JSONPath"),
        ({"status": {"result_ref": "$..url"}}, "status.result_ref", "one value, so names and indexes only"),
        ({"create": {"job_id": "$.data[*].id"}}, "create.job_id", "one value, so names and indexes only"),
        ({"status": {"state": "$.data[?@.x == ]"}}, "status.state", "not RFC 9535 JSONPath"),
        ({"create": {"status_url": "Location"}}, "create.status_url", "must start with"),
        ({"result": {"download_hosts": ["https://s.example.com/path"]}}, "result.download_hosts", "a host"),
        ({"result": {"download_hosts": ["user@s.example.com"]}}, "result.download_hosts", "userinfo"),
        ({"result": {"download_hosts": ["*.com"]}}, "result.download_hosts", "two labels"),
        (
            {"reconcile": {"modes": ["status_by_client_id"], "status_path": "/by/{client}"}},
            "reconcile.status_path",
            "placeholders",
        ),
        (
            {"webhooks": {"secrets": ["env:WH"], "tolerance_s": 300, "retention_days": 0.001}},
            "webhooks.retention_days",
            "twice tolerance_s",
        ),
    ],
)
def test_provider_file_mistakes_are_load_time_errors_naming_file_and_key(
    tmp_path: Path, overrides: dict[str, Any], key: str, words: str
) -> None:
    path = tmp_path / "provider.toml"
    path.write_text(provider_toml(_base(**overrides)), encoding="utf-8")
    with pytest.raises(ConfigError) as caught:
        load_provider(path)
    message = str(caught.value)
    assert str(path) in message and key in message and words in message, message


def test_a_valid_file_with_every_new_key_loads() -> None:
    config = parse_config(
        _base(
            result={"path": "/r/{job_id}", "download_hosts": ["storage.example.com", "*.s3.amazonaws.com"]},
            webhooks={"secrets": ["env:WH"], "tolerance_s": 300, "retention_days": 1},
        )
    )
    assert [(r.host, r.wildcard) for r in config.download_hosts] == [
        ("storage.example.com", False),
        ("s3.amazonaws.com", True),
    ]
    # `jobtrail providers check` tells the operator where result links may lead
    assert guarantees(HttpProvider(config))["download_hosts"] == [
        "https://storage.example.com",
        "https://*.s3.amazonaws.com",
    ]


def test_the_example_provider_file_loads() -> None:
    load_provider(Path(__file__).parent.parent / "examples" / "fake.toml")


# -- origin comparison (pure logic) --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("HTTPS://API.Example.COM.:443/x", "https://api.example.com"),
        ("http://api.example.com:80", "http://api.example.com/"),
        ("https://bücher.de/x", "https://xn--bcher-kva.de"),
        ("http://[0:0:0:0:0:0:0:1]:8080/", "http://[::1]:8080"),
    ],
)
def test_the_same_origin_however_spelled(a: str, b: str) -> None:
    assert origin_of(a) == origin_of(b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("http://127.0.0.1:18001", "http://127.0.0.1:1800"),
        ("https://api.example.com.evil.net", "https://api.example.com"),
        ("http://api.example.com", "https://api.example.com"),
        ("https://api.example.com:8443", "https://api.example.com"),
        ("https://evil.net/api.example.com", "https://api.example.com"),
    ],
)
def test_different_origins_that_share_a_prefix(a: str, b: str) -> None:
    assert origin_of(a) != origin_of(b)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:1800@127.0.0.2:9911/steal",
        "http://user@api.example.com/",
        "http://:pw@api.example.com/",
        "http://api.example.com\\@evil.net/",
        "http://api.example.com /x",
        "http://2130706433/",
        "http://0x7f.1/",
        "http://127.1/",
        "ftp://api.example.com/",
        "http:///nohost",
        "http://api.example.com:99999/",
        "http://[fe80::1%25eth0]/",
    ],
)
def test_urls_that_are_refused_outright(url: str) -> None:
    with pytest.raises(UrlRefused):
        origin_of(url)


def test_relative_references_never_change_the_host() -> None:
    policy = EgressPolicy("http://127.0.0.1:1800")
    for ref in ("@127.0.0.2:9911/steal", "/v1/x", "x/y?z=1", ":9911/x", "%40127.0.0.2/x"):
        target = policy.judge(policy.resolve_reference(ref))
        assert target.home and target.origin == origin_of("http://127.0.0.1:1800"), ref
    for ref in ("//evil.net/x", "http://127.0.0.1:18001/x", "https://127.0.0.1:1800/x"):
        with pytest.raises(UrlRefused):
            policy.judge(policy.resolve_reference(ref))


_HOME_BASES = ("http://127.0.0.1:1800", "https://api.example.com/v1", "HTTPS://API.Example.COM:443")


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:1800/v1/jobs/abc",
        "http://127.0.0.1:1800/@127.0.0.2:9911/steal",
        "http://127.0.0.1:18001/x",
        "http://127.0.0.1:1800@127.0.0.2:9911/steal",
        "http://127.0.0.1:1800\\@evil.net/",
        "http://127.0.0.1:1800/x y",
        "https://127.0.0.1:1800/x",
        "http://[::ffff:127.0.0.1]:1800/x",
        "https://api.example.com/v1/batches/b_1",
        "https://api.example.com/v2",
        "https://api.example.com.evil.net/v1/x",
        "https://api.example.com/v1@evil.net/x",
        "https://API.EXAMPLE.com/other",
    ],
)
@pytest.mark.parametrize("base", _HOME_BASES)
def test_the_quick_home_check_agrees_with_the_origin_judge(base: str, url: str) -> None:
    policy = EgressPolicy(base)
    try:
        expected = policy.judge(url).home
    except UrlRefused:
        expected = False
    assert policy.is_home(url) is expected


@given(suffix=st.text(max_size=40), base=st.sampled_from(_HOME_BASES))
def test_whatever_follows_base_url_the_quick_home_check_agrees_with_the_origin_judge(suffix: str, base: str) -> None:
    policy = EgressPolicy(base)
    url = policy.base_url + "/" + suffix
    try:
        expected = policy.judge(url).home
    except UrlRefused:
        expected = False
    assert policy.is_home(url) is expected


def test_declared_hosts_match_exactly() -> None:
    policy = EgressPolicy(
        "https://api.example.com",
        (parse_host_rule("*.s3.amazonaws.com"), parse_host_rule("storage.example.com")),
    )
    assert not policy.judge("https://bucket.s3.amazonaws.com/k?sig=1").home
    assert not policy.judge("https://STORAGE.example.com./k").home
    assert policy.judge("https://api.example.com/v1").home
    for url in (
        "https://s3.amazonaws.com.evil.net/k",
        "https://evils3.amazonaws.com/k",
        "http://bucket.s3.amazonaws.com/k",  # a declared host without a scheme is https only
        "https://bucket.s3.amazonaws.com:8443/k",
        "https://storage.example.com.evil.net/k",
        "https://169.254.169.254/latest",
    ):
        with pytest.raises(UrlRefused):
            policy.judge(url)


def test_a_declared_host_on_another_port_or_scheme_is_refused_with_the_entry_that_would_allow_it() -> None:
    """Found by a probe: ``download_hosts = ["127.0.0.1"]`` (https, port 443) refused http://127.0.0.1:8123/x
    telling the operator to add the host they had added. The refusal now names the entry it has and the one
    the URL needs."""
    policy = EgressPolicy("https://api.example.com", (parse_host_rule("127.0.0.1"),))
    with pytest.raises(UrlRefused) as refused:
        policy.judge("http://127.0.0.1:8123/out.png")
    assert "has https://127.0.0.1, another scheme or port: add 'http://127.0.0.1:8123'" in refused.value.reason
    allowed = EgressPolicy("https://api.example.com", (parse_host_rule("http://127.0.0.1:8123"),))
    assert not allowed.judge("http://127.0.0.1:8123/out.png").home
    wildcard = EgressPolicy("https://api.example.com", (parse_host_rule("*.example.org"),))
    with pytest.raises(UrlRefused) as refused:
        wildcard.judge("https://files.example.org:8443/out.png")
    assert "has https://*.example.org, another scheme or port" in refused.value.reason


@pytest.mark.parametrize(
    ("address", "special"),
    [
        ("127.0.0.2", True),
        ("10.1.2.3", True),
        ("172.16.0.1", True),
        ("192.168.1.1", True),
        ("169.254.169.254", True),
        ("100.64.0.1", True),
        ("224.0.0.1", True),
        ("0.0.0.0", True),
        ("240.0.0.1", True),
        ("::1", True),
        ("fe80::1", True),
        ("fc00::1", True),
        ("::ffff:127.0.0.1", True),
        ("::ffff:10.0.0.1", True),
        ("ff02::1", True),
        # an IPv6 address that a translator or relay carries to an internal IPv4 one
        ("2002:7f00:1::1", True),  # 6to4 of 127.0.0.1
        ("2002:a9fe:a9fe::", True),  # 6to4 of 169.254.169.254
        ("64:ff9b::7f00:1", True),  # NAT64 of 127.0.0.1
        ("64:ff9b::a00:1", True),  # NAT64 of 10.0.0.1
        ("64:ff9b:1::a00:1", True),  # a NAT64 prefix for local use
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", True),  # Teredo
        ("8.8.8.8", False),
        ("2606:4700:4700::1111", False),
        ("2002:808:808::1", False),  # 6to4 of a public address
        ("64:ff9b::808:808", False),  # NAT64 of a public address (an IPv6-only network's DNS64 answers so)
    ],
)
def test_special_addresses(address: str, special: bool) -> None:
    import ipaddress

    assert is_special(ipaddress.ip_address(address)) is special


class _FixedAnswers(aiohttp.abc.AbstractResolver):
    """A resolver whose answers are set by the test: one name, several addresses (as DNS may give)."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list[Any]:
        return [
            {"hostname": host, "host": a, "port": port, "family": family, "proto": 0, "flags": 0}
            for a in self.addresses
        ]

    async def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("addresses", "refused"),
    [
        (["93.184.216.34"], False),
        (["93.184.216.34", "127.0.0.1"], True),  # one bad address among good ones refuses the name
        (["10.0.0.7"], True),
        (["::ffff:169.254.169.254"], True),
        (["2606:4700:4700::1111", "fd00::1"], True),
        (["64:ff9b::a9fe:a9fe"], True),  # the metadata service, through NAT64
    ],
)
def test_every_resolved_address_is_checked(addresses: list[str], refused: bool) -> None:
    async def go() -> list[Any]:
        resolver = PublicOnlyResolver()
        await resolver.close()
        resolver._inner = _FixedAnswers(addresses)  # type: ignore[assignment]
        return await resolver.resolve("storage.example.com", 443)

    if refused:
        with pytest.raises(AddressRefused, match=r"storage\.example\.com"):
            asyncio.run(go())
    else:
        assert [a["host"] for a in asyncio.run(go())] == addresses
