"""A provider that echoes the credential back in every way it can, and results that look like secrets.

The hostile provider is a real HTTP server on 127.0.0.1 written here. It checks that the canary
credential arrives (so the credential really is in play), then hands it back: ``\\u``-escaped, percent-
encoded, base64, MIME base64 (wrapped in lines, a break inside the credential), split across JSON
strings, as a status string, as a JSON key, as a response-header name, in a problem body. What must
hold: the canary is found in no form in the ledger's files (SQLite incl. -wal/-shm, PostgreSQL rows,
result files), the logs, any CLI command's output or any MCP tool's answer; a result carrying it is
refused (``result_validation_failed``, check ``no_credentials``); and an honest result whose field
names merely sound secret is stored byte for byte, its sha256 matching the history.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import subprocess
import sys
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from jobtrail import AsyncJobtrail, State, Store
from jobtrail.domain.record import Operation
from jobtrail.domain.redact import WITHHELD_SPLIT_CREDENTIAL, Redactor, install_log_redaction
from jobtrail.interfaces.mcp import MAX_REQUEST_DEPTH, guard_request
from jobtrail.ledger.results import read_result
from jobtrail.runtime.worker import ACTIVE_STATES, Worker
from jobtrail.testing import FakeProvider, provider_toml

from helpers import canary_hits, free_port, ledger_bytes, wait_for_port

HONEST_RESULT = b'{"code": "x", "key": "y",  "session": "z", "tokens_used": 3}\n'
SYNC_RESULT = {"code": "x", "key": "y", "session": "z", "tokens_used": 3}
ENV = "HOSTILE_API_KEY"


def _u_escaped(text: str) -> str:
    return "".join(f"\\u{ord(c):04x}" for c in text)


def _mime(text: str) -> str:
    """``text`` as MIME base64 (RFC 2045): lines of 76 characters. For ``Authorization: Bearer <canary>`` the
    first ends inside the canary."""
    return base64.encodebytes(text.encode()).decode()


def _hits(canary: str, haystack: bytes | str) -> list[str]:
    """:func:`canary_hits`, also with every line break taken out (CR, LF and their JSON escapes): base64
    wrapped in lines as any decoder reads it."""
    data = haystack.encode() if isinstance(haystack, str) else haystack
    unwrapped = data
    for brk in (b"\\r", b"\\n", b"\r", b"\n"):
        unwrapped = unwrapped.replace(brk, b"")
    return canary_hits(canary, data) + [f"{hit} without line breaks" for hit in canary_hits(canary, unwrapped)]


class HostileProvider:
    """Every job's behaviour is chosen by the ``mode`` field of its create request."""

    def __init__(self, canary: str) -> None:
        self.canary = canary
        self.seen: Counter[str] = Counter()
        self.base_url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application(middlewares=[self._check_auth])
        app.router.add_post("/v1/jobs", self._create)
        app.router.add_get("/v1/jobs/{job_id}", self._status)
        app.router.add_get("/v1/jobs/{job_id}/result", self._result)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.base_url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _check_auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.seen[f"{request.method} {request.path}"] += 1
        if request.headers.get("Authorization") != f"Bearer {self.canary}":
            self.seen["unauthorized"] += 1
            return web.json_response({"title": "unauthorized"}, status=401)
        return await handler(request)

    async def _create(self, request: web.Request) -> web.StreamResponse:
        mode = (await request.json())["mode"]
        c = self.canary
        if mode == "sync_names":
            return web.json_response({"result": SYNC_RESULT})
        if mode == "sync_echo":  # the credential, \u-escaped inside the synchronous result
            body = '{"result": {"note": "' + _u_escaped(c) + '"}}'
            return web.Response(status=200, body=body.encode(), content_type="application/json")
        if mode == "reject":  # a problem body that echoes it percent-encoded and in base64; a header value too
            problem = {
                "title": "invalid key",
                "detail": f"the key {urllib.parse.quote(c, safe='')} is not valid",
                "echo": base64.b64encode(f"Bearer {c}".encode()).decode(),
            }
            return web.json_response(problem, status=400, headers={"X-Request-Id": urllib.parse.quote(c, safe="")})
        if mode == "huge_header" and not self.seen["huge header sent"]:
            # a header line past what a client reads: the client's error quotes the line's first 100 bytes,
            # which hold 30 of the credential's 38 characters
            self.seen["huge header sent"] += 1
            return web.json_response({"id": "job-x"}, status=202, headers={"X-Big": "a" * 63 + c + "a" * 60_000})
        return web.json_response({"id": f"job-{mode}", "status": "queued"}, status=202)

    async def _status(self, request: web.Request) -> web.StreamResponse:
        mode = request.match_info["job_id"].removeprefix("job-")
        polls = self.seen[f"status {mode}"] = self.seen[f"status {mode}"] + 1
        c = self.canary
        if mode == "state" and polls == 1:  # the credential as the job's state
            return web.json_response({"status": c})
        if mode == "key":  # the credential as a JSON key and as a response-header name
            return web.json_response({"status": "succeeded", c: "x", "detail": {c: 1}}, headers={c: "1"})
        if mode == "split":  # in thirds, none of which holds enough of it to be masked
            return web.json_response({"status": "succeeded", "note": [c[:13], c[13:26], c[26:]]})
        if mode == "mime":  # in MIME base64 in a status answer (which is kept, masked)
            return web.json_response({"status": "succeeded", "debug": _mime(f"Authorization: Bearer {c}")})
        return web.json_response({"status": "succeeded"})

    async def _result(self, request: web.Request) -> web.StreamResponse:
        mode = request.match_info["job_id"].removeprefix("job-")
        c = self.canary
        bodies = {
            "escaped": '{"output": "' + _u_escaped(c) + '"}',
            "percent": '{"link": "https://files.example/?k=' + urllib.parse.quote(c, safe="") + '"}',
            "base64": '{"auth": "' + base64.b64encode(f"Bearer {c}".encode()).decode() + '"}',
            "split": json.dumps({"parts": [c[:9], c[9:]]}),
            "mime": json.dumps({"attachment": _mime(f"Authorization: Bearer {c}")}),
        }
        headers = {c: "1"} if mode == "key" else {}
        body = bodies[mode].encode() if mode in bodies else HONEST_RESULT
        return web.Response(body=body, content_type="application/json", headers=headers)

    def config(self, **extra: Any) -> dict[str, Any]:
        return {
            "name": "hostile",
            "base_url": self.base_url,
            "credential": f"env:{ENV}",
            "timeout_s": 2.0,
            "connect_timeout_s": 1.0,
            "create": {"path": "/v1/jobs", "job_id": "$.id", "sync_result": "$.result", **extra},
            "status": {"path": "/v1/jobs/{job_id}", "state": "$.status"},
            "result": {"path": "/v1/jobs/{job_id}/result"},
            "retry": {"initial_s": 0.05, "factor": 2, "cap_s": 0.2},
            "poll": {"initial_s": 0.05, "factor": 1, "cap_s": 0.1},
        }


REFUSED_MODES = ("escaped", "percent", "base64", "mime", "split", "sync_echo")
STORED_MODES = ("honest", "state", "key", "sync_names")


@pytest.fixture
def canary(monkeypatch: pytest.MonkeyPatch) -> str:
    value = f"jtcanary_cred_{secrets.token_hex(12)}"
    monkeypatch.setenv(ENV, value)
    return value


def _run_hostile(db_url: str, canary: str, tmp_path: Path) -> tuple[dict[str, Any], HostileProvider, Path]:
    hostile = HostileProvider(canary)

    async def go() -> dict[str, Any]:
        await hostile.start()
        store = Store.open(db_url)
        jt = AsyncJobtrail(store=store, providers=[hostile.config(url_fields=["$.input.image"])])
        try:
            # the worker's writer process is up before anything is submitted: what the provider echoes is
            # masked there, by credentials it learns from the worker only once the provider resolves them
            worker = Worker(store, dict(jt.providers), worker_id="w1")
            running = asyncio.create_task(worker.run(timeout=60))
            while worker.writer.process_id is None:
                assert not running.done(), "the worker ended before its writer process started"
                await asyncio.sleep(0.01)
            ids = {}
            for mode in (*REFUSED_MODES, *STORED_MODES, "reject", "huge_header"):
                ids[mode] = (await jt.submit("hostile", {"mode": mode}, key=mode, caller="agent-a")).operation_id
            while await asyncio.to_thread(store.next_due_us, providers=("hostile",), states=ACTIVE_STATES):
                assert not running.done(), "the worker ended before the operations settled"
                await asyncio.sleep(0.02)
            worker.stop()
            await running
            for provider in jt.providers.values():
                await provider.aclose()
            return ids
        finally:
            store.close()
            await hostile.stop()

    ids = asyncio.run(go())
    provider_file = tmp_path / "hostile.toml"
    provider_file.write_text(provider_toml(hostile.config(url_fields=["$.input.image"])), encoding="utf-8")
    return ids, hostile, provider_file


def _cli(db_url: str, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "jobtrail", "--db", db_url, *args],
        capture_output=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "400"},
        check=False,
    )


def _cli_in_process(db_url: str, *args: str) -> bytes:
    """The same commands without a process per call (there are many): stdout and stderr together."""
    from click.testing import CliRunner

    from jobtrail.interfaces.cli import cli

    done = CliRunner().invoke(cli, ["--db", db_url, *args], catch_exceptions=False)
    assert b"Traceback" not in done.stdout_bytes + done.stderr_bytes, (args, done.output)
    return done.stdout_bytes + done.stderr_bytes


def _mcp_params(db_url: str, provider_file: Path, agent: str, *extra: str) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "jobtrail", "--db", db_url, "mcp", "--provider", str(provider_file), "--agent", agent, *extra],
        env={**os.environ},
    )


def _answer(raw: Any) -> Any:
    text = "".join(getattr(c, "text", "") for c in raw.content)
    if getattr(raw, "isError", False) or getattr(raw, "is_error", False):
        return {"error": text}
    structured = getattr(raw, "structuredContent", None) or getattr(raw, "structured_content", None)
    if isinstance(structured, dict) and set(structured) == {"result"}:
        return structured["result"]
    return structured if structured is not None else json.loads(text)


async def _session(params: StdioServerParameters, calls: list[tuple[str, dict[str, Any]]]) -> list[tuple[Any, str]]:
    """Each call's decoded answer and its raw text as the agent receives it."""
    out = []
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        for name, arguments in calls:
            raw = await session.call_tool(name, arguments)
            out.append((_answer(raw), raw.model_dump_json()))
    return out


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_a_hostile_provider_never_gets_the_credential_stored_shown_or_handed_to_an_agent(
    db_url: str, canary: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    install_log_redaction()
    caplog.set_level(logging.DEBUG)
    ids, hostile, provider_file = _run_hostile(db_url, canary, tmp_path)
    assert hostile.seen["unauthorized"] == 0 and hostile.seen["POST /v1/jobs"] == len(ids)
    assert hostile.seen["status state"] >= 2 and hostile.seen["status key"] >= 1

    with Store.open(db_url) as store:
        ops = {mode: store.get(op_id) for mode, op_id in ids.items()}
        for mode in REFUSED_MODES:
            op = ops[mode]
            assert op.state is State.RESULT_VALIDATION_FAILED, (mode, op.state, op.state_reason)
            assert "no_credentials" in (op.state_reason or "")
            assert store.history(op.operation_id)[-1].to_json()["evidence"]["check"] == "no_credentials"
            with pytest.raises(Exception, match="no result is stored"):
                read_result(store, op.operation_id)
        # a status answer that carries it in two strings is not kept at all: no masking could see it
        polls = [o for o in store.observations(ops["split"].operation_id) if o["kind"] == "status_poll"]
        assert polls and all(o["raw"] == {"withheld": WITHHELD_SPLIT_CREDENTIAL} for o in polls), polls
        assert ops["reject"].state is State.FAILED
        # an answer that is not readable HTTP: a doubtful create (this provider takes no token, so a person is
        # asked, and nothing is sent again); of its bytes, which the HTTP library's error quotes (the credential
        # cut short among them), only the kind of error is kept
        assert ops["huge_header"].state is State.NEEDS_ATTENTION, ops["huge_header"].state_reason
        said = [e.to_json()["evidence"] for e in store.history(ops["huge_header"].operation_id)]
        assert any("not readable HTTP (LineTooLong; its bytes are not kept)" in json.dumps(e) for e in said), said
        for mode in STORED_MODES:
            assert ops[mode].state is State.SUCCEEDED, (mode, ops[mode].state_reason)
        # an honest result whose field names sound secret: byte for byte, its sha256 the history's
        for mode in ("honest", "state", "key"):
            row, data = read_result(store, ops[mode].operation_id)
            assert data == HONEST_RESULT and not row["redacted"]
            assert row["sha256"] == hashlib.sha256(HONEST_RESULT).hexdigest()
            evidence = store.history(ops[mode].operation_id)[-1].to_json()["evidence"]
            assert evidence["sha256"] == row["sha256"]
        row, data = read_result(store, ops["sync_names"].operation_id)
        assert json.loads(data) == SYNC_RESULT
        history = [e.to_json()["evidence"] for e in store.history(ops["sync_names"].operation_id)]
        digest = hashlib.sha256(data).hexdigest()
        assert row["sha256"] == digest
        assert [e["result_sha256"] for e in history if "result_sha256" in e] == [digest]
        assert history[-1]["sha256"] == digest
        stored = ledger_bytes(store)
    assert b"[REDACTED]" not in data
    assert _hits(canary, stored) == []
    assert _hits(canary, caplog.text) == []

    # every read command's output, for every operation
    outputs: list[bytes] = []
    for args in (["ops", "list", "--json"], ["ops", "list"], ["audit", "verify"], ["audit", "verify", "--json"]):
        done = _cli(db_url, *args)
        outputs += [done.stdout, done.stderr]
    for op_id in ids.values():
        for args in (
            ["ops", "show", op_id, "--json"],
            ["ops", "show", op_id],
            ["ops", "history", op_id, "--json"],
            ["ops", "escalation", op_id, "--json"],
            ["ops", "escalation", op_id, "--markdown"],
            ["explain", op_id, "--json"],
            ["result", op_id, "--json"],
            ["result", op_id],
        ):
            outputs.append(_cli_in_process(db_url, *args))
    shown = _cli(db_url, "result", ids["honest"])
    assert shown.returncode == 0 and shown.stdout == HONEST_RESULT
    assert _hits(canary, b"\n".join(outputs)) == []

    # every MCP tool's answer, to the agent that submitted them
    calls: list[tuple[str, dict[str, Any]]] = [("list_jobs", {"limit": 1000}), ("jobs_needing_a_person", {})]
    for op_id in ids.values():
        calls += [("job_status", {"operation_id": op_id}), ("get_result", {"operation_id": op_id})]
        calls += [("wait_for_change", {"operation_id": op_id, "timeout_s": 0})]
    answers = asyncio.run(_session(_mcp_params(db_url, provider_file, "agent-a"), calls))
    assert _hits(canary, "\n".join(text for _, text in answers)) == []
    by_call = {
        (name, args.get("operation_id")): answer for (name, args), (answer, _) in zip(calls, answers, strict=True)
    }
    assert by_call[("get_result", ids["sync_names"])]["result"] == SYNC_RESULT
    assert by_call[("get_result", ids["honest"])]["result"] == json.loads(HONEST_RESULT)
    assert by_call[("get_result", ids["escaped"])]["result"] is None
    assert by_call[("list_jobs", None)]["count"] == by_call[("list_jobs", None)]["total"] == len(ids)


def test_the_null_redactor_proves_the_scan_would_see_a_leak(canary: str) -> None:
    """The scan is not vacuous: every form a hostile provider uses above is one it finds."""
    for leaked in (
        canary,
        _u_escaped(canary),
        urllib.parse.quote(canary, safe=""),
        "x" + base64.b64encode(f"Bearer {canary}".encode()).decode(),
        canary.encode().hex(),
    ):
        assert canary_hits(canary, f"before {leaked} after") != [], leaked
    # MIME base64 with a line break in the middle of the canary is seen once the breaks are taken out
    mime = _mime(f"Authorization: Bearer {'.' * 16}{canary}")
    for leaked in (mime, json.dumps(mime)):
        assert canary_hits(canary, leaked) == [] and _hits(canary, leaked) != [], leaked


@pytest.mark.parametrize(
    ("text", "carries"),
    [
        pytest.param(lambda c: c, True, id="raw"),
        pytest.param(lambda c: '{"a": "' + _u_escaped(c) + '"}', True, id="json-u-escapes"),
        pytest.param(lambda c: '{"a": "' + _u_escaped(c).upper().replace("\\U", "\\u") + '"}', True, id="u-upper"),
        pytest.param(lambda c: "k=" + urllib.parse.quote(c, safe=""), True, id="percent"),
        pytest.param(lambda c: "k=" + "".join(f"%{b:02x}" for b in c.encode()), True, id="percent-all"),
        pytest.param(lambda c: urllib.parse.quote(urllib.parse.quote(c, safe=""), safe=""), True, id="percent-twice"),
        pytest.param(lambda c: base64.b64encode(c.encode()).decode(), True, id="base64"),
        pytest.param(lambda c: "z" + base64.b64encode(b"Bearer " + c.encode()).decode(), True, id="base64-offset"),
        pytest.param(lambda c: base64.urlsafe_b64encode(b"xy" + c.encode()).decode(), True, id="base64url-offset2"),
        pytest.param(lambda c: c.encode().hex().upper(), True, id="hex"),
        pytest.param(lambda c: _mime(f"Authorization: Bearer {c}"), True, id="mime-base64"),
        pytest.param(lambda c: _mime(f"Authorization: Bearer {c}").replace("\n", "\r\n"), True, id="mime-base64-crlf"),
        pytest.param(
            lambda c: json.dumps({"a": _mime(f"Authorization: Bearer {c}")}), True, id="mime-base64-json-escaped"
        ),
        pytest.param(lambda c: json.dumps([c[:7], c[7:]]), True, id="split-across-strings"),
        pytest.param(lambda c: json.dumps({c[:7]: c[7:]}), True, id="split-key-value"),
        pytest.param(lambda c: "&#" + ";&#".join(str(ord(ch)) for ch in c) + ";", True, id="html-entities"),
        pytest.param(lambda c: base64.b64encode(_u_escaped(c).encode()).decode(), True, id="nested"),
        pytest.param(lambda c: json.dumps(SYNC_RESULT), False, id="secret-sounding-names"),
        # cut short by whoever quoted it (an HTTP library's error showing an answer's first bytes): still refused
        pytest.param(lambda c: f"b'{c[:-3]}...'", True, id="most-of-it-cut-short"),
        pytest.param(lambda c: c[5:], True, id="most-of-it-without-its-start"),
        pytest.param(lambda c: c[:9], False, id="a-short-prefix-only"),
        pytest.param(lambda c: json.dumps({"a": c[:18], "b": c[18:]}), True, id="split-across-values"),
        pytest.param(lambda c: c.encode("utf-16-le").decode(), True, id="utf-16-le"),
        pytest.param(lambda c: c.encode("utf-16-be").decode(), True, id="utf-16-be"),
    ],
)
def test_contains_secret_sees_through_encodings(text: Any, carries: bool) -> None:
    redactor = Redactor()
    canary = f"jtcanary_cred_{secrets.token_hex(12)}"
    redactor.register(canary)
    value = text(canary)
    assert redactor.contains_secret(value) is carries
    assert redactor.contains_secret(value.encode()) is carries
    if carries:  # and no text the redactor writes still holds it
        assert canary_hits(canary, json.dumps(redactor.value({"v": value, value[:40]: 1}))) == []


def test_field_names_mask_metadata_never_results() -> None:
    redactor = Redactor()
    canary = f"jtcanary_cred_{secrets.token_hex(12)}"
    redactor.register(canary)
    assert redactor.value(SYNC_RESULT)["key"] == "[REDACTED]"  # metadata: masked by name
    assert redactor.result_value({"result": SYNC_RESULT}) == {"result": SYNC_RESULT}  # a result: never
    withheld = redactor.result_value({"result": {"x": canary}})
    assert set(withheld) == {"withheld"} and canary not in json.dumps(withheld)
    headers = redactor.headers({canary: "v", "ETag": urllib.parse.quote(canary), "Content-Type": "a/b"})
    assert canary_hits(canary, json.dumps(headers)) == [] and headers["Content-Type"] == "a/b"


# -- MCP: an agent sees and acts on its own operations -----------------------------------------------


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_an_agent_cannot_see_or_touch_another_agents_operations(db_url: str, canary: str, tmp_path: Path) -> None:
    hostile = HostileProvider(canary)
    hostile.base_url = "http://127.0.0.1:9"  # nothing is sent in this test
    provider_file = tmp_path / "hostile.toml"
    provider_file.write_text(provider_toml(hostile.config()), encoding="utf-8")

    async def seed() -> str:
        with Store.open(db_url) as store:
            jt = AsyncJobtrail(store=store, providers=[hostile.config()])
            return (await jt.submit("hostile", {"mode": "honest"}, key="a-1", caller="agent-a")).operation_id

    a_op = asyncio.run(seed())
    missing = "op_01AAAAAAAAAAAAAAAAAAAAAAAA"
    probes: list[tuple[str, dict[str, Any]]] = []
    for op_id in (a_op, missing):
        probes += [
            ("job_status", {"operation_id": op_id}),
            ("get_result", {"operation_id": op_id}),
            ("wait_for_change", {"operation_id": op_id, "timeout_s": 0}),
            ("cancel_job", {"operation_id": op_id, "reason": "mine now"}),
        ]
    calls = [
        ("list_jobs", {}),
        ("jobs_needing_a_person", {}),
        *probes,
        ("job_status", {"operation_id": "a-1"}),  # agent a's key: b's own keys are b's alone
        ("list_jobs", {"limit": -1}),
        ("list_jobs", {"limit": 0}),
        ("list_jobs", {"limit": 1001}),
        # the same key as agent a's, the same request: a new operation of b's, nothing of a's
        (
            "submit_job",
            {"provider": "hostile", "request": {"mode": "honest"}, "operation_key": "a-1", "create_deadline_s": 1},
        ),
    ]
    b = asyncio.run(_session(_mcp_params(db_url, provider_file, "agent-b"), calls))
    answers = [answer for answer, _ in b]
    assert answers[0]["items"] == [] and answers[1]["items"] == [] and answers[0]["total"] == 0
    for i in range(4):  # another agent's operation answers exactly like a missing one
        theirs, nothing = answers[2 + i], answers[6 + i]
        assert "error" in theirs and theirs["error"].replace(a_op, "ID") == nothing["error"].replace(missing, "ID")
    assert answers[10]["error"].replace("a-1", "ID") == answers[6]["error"].replace(missing, "ID")
    bounds = ("greater than or equal to 1",) * 2 + ("less than or equal to 1000",)
    for limit_answer, bound in zip(answers[11:14], bounds, strict=True):  # the schema's bounds, named
        assert f"invalid arguments: limit: Input should be {bound}" in limit_answer["error"]
    own = answers[14]
    assert own["operation_id"] != a_op and own["operation_key"] == "a-1" and own["caller"] == "agent-b"
    with Store.open(db_url) as store:
        a = store.get(a_op)
        assert a.state is State.CREATE_PENDING and a.cancel_requested_by is None
        assert [e.cause for e in store.history(a_op)] == [store.history(a_op)[0].cause]  # untouched

    # a shared server (the operator's choice) sees both; agent a still sees only its own
    shared = asyncio.run(_session(_mcp_params(db_url, provider_file, "agent-b", "--shared"), [("list_jobs", {})]))
    assert shared[0][0]["count"] == 2
    mine = asyncio.run(_session(_mcp_params(db_url, provider_file, "agent-a"), [("list_jobs", {})]))
    assert [o["operation_id"] for o in mine[0][0]["items"]] == [a_op]
    helped = _cli(db_url, "mcp", "--help")
    assert b"--shared" in helped.stdout and b"only its own" in helped.stdout


# -- the request guard ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_body",
    [
        pytest.param({"input": {"url": "https://x.example/a"}}, id="nested-url"),
        pytest.param({"callback_url": "https://x.example/hook"}, id="callback_url"),
        pytest.param({"options": {"Headers": {"X-Thing": "1"}}}, id="nested-Headers"),
        pytest.param({"items": [{"Endpoint": "/v2/admin"}]}, id="endpoint-in-a-list"),
        pytest.param({"input": {"file": "https://x.example/steal"}}, id="a-URL-value"),
        pytest.param({"auth": base64.b64encode(b"Bearer sk-abcdefghijklmnop1234").decode()}, id="base64-bearer"),
        pytest.param({"note": "Bearer abcdef0123456789"}, id="bearer-in-a-value"),
        pytest.param({"Api-Key": "k-123"}, id="api-key-field"),
        pytest.param({"deep": {"deeper": {"Authorization": "x"}}}, id="nested-authorization"),
    ],
)
def test_the_guard_refuses_what_reaches_past_the_operator(request_body: dict[str, Any]) -> None:
    with pytest.raises(Exception, match="is refused") as caught:
        guard_request(request_body, url_fields=["$.input.image"], redactors=[Redactor()])
    assert "sk-abcdef" not in str(caught.value) and "abcdef0123" not in str(caught.value)


def test_the_guard_refuses_the_operators_own_credential_in_any_encoding(canary: str) -> None:
    redactor = Redactor()
    redactor.register(canary)
    for value in (canary, urllib.parse.quote(canary), base64.b64encode(canary.encode()).decode(), _u_escaped(canary)):
        with pytest.raises(Exception, match="is or encodes a credential") as caught:
            guard_request({"prompt": {"text": f"use {value}"}}, redactors=[redactor])
        assert canary_hits(canary, str(caught.value)) == []
    with pytest.raises(Exception, match="field name"):
        guard_request({"x": {canary: 1}}, redactors=[redactor])


def test_the_guard_lets_harmless_fields_and_declared_url_fields_through() -> None:
    guard_request(
        {
            "code": "print('hello')",
            "tokenizer": "cl100k_base",
            "max_tokens": 100,
            "key": "summary",
            "session": "s-1",
            "input": {"image": "https://images.example/cat.png", "prompt": "describe https://example.com briefly"},
            "images": [{"image": "x"}],
            "references": [{"url": "https://a.example/1"}, {"url": "https://a.example/2"}],
        },
        url_fields=["$.input.image", "$.references[*].url"],
        redactors=[Redactor()],
    )


def test_the_guard_limits_depth_and_size() -> None:
    deep: dict[str, Any] = {}
    cur = deep
    for _ in range(MAX_REQUEST_DEPTH + 1):
        cur["a"] = {}
        cur = cur["a"]
    with pytest.raises(Exception, match=f"deeper than {MAX_REQUEST_DEPTH} levels"):
        guard_request(deep)
    with pytest.raises(Exception, match="more than the 1048576 an agent may pass"):
        guard_request({"prompt": "x" * (1024 * 1024 + 1)})


def test_the_depth_limit_counts_objects_and_arrays_not_the_value_inside_the_deepest() -> None:
    def nested(levels: int, inside: Any) -> Any:
        for level in range(levels - 1):
            inside = {"a": inside} if level % 2 else [inside]
        return {"a": inside}  # (a request is an object)

    for inside in (1, "text", None, {}, []):
        guard_request(nested(MAX_REQUEST_DEPTH - (1 if inside in ({}, []) else 0), inside))  # 64 levels in all
    for inside in (1, {}):
        with pytest.raises(Exception, match=f"deeper than {MAX_REQUEST_DEPTH} levels"):
            guard_request(nested(MAX_REQUEST_DEPTH + (0 if inside == {} else 1), inside))  # 65 levels


def test_a_json_rpc_line_that_names_a_key_twice_is_refused_and_nothing_is_stored(tmp_path: Path, canary: str) -> None:
    """Which value such an object means is the reader's choice (the SDK keeps the last, other parsers the first):
    a proxy that approved one reading must never see the server act on the other."""
    db, proc = _mcp_server_over_stdio(tmp_path, canary)
    hello = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    lines = [
        json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello}).encode() + b"\n",
        b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n',
        b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"submit_job","arguments":'
        b'{"provider":"hostile","operation_key":"k1","request":{"x":1},"request":{"x":2},"create_deadline_s":1}}}\n',
        b'{"jsonrpc":"2.0","id":3,"method":"ping","method":"tools/list"}\n',
        b'{"jsonrpc":"2.0","id":5,"id":6,"method":"ping"}\n',  # which of the two ids it is is not ours to pick
        b'{"jsonrpc":"2.0","id":4,"method":"ping"}\n',
    ]
    answered, err = _replies(proc, lines)
    replies = {r.get("id"): r for r in answered}
    for refused in (2, 3):
        assert replies[refused]["error"]["code"] == -32600, replies
        assert "names the same key twice" in replies[refused]["error"]["message"]
    assert replies[None]["error"]["code"] == -32600 and 5 not in replies and 6 not in replies
    assert "result" in replies[4] and b"Traceback" not in err
    with Store.open(str(db)) as store:
        assert store.count() == 0


def test_the_guard_through_a_real_mcp_server(db_url: str, canary: str, tmp_path: Path) -> None:
    hostile = HostileProvider(canary)
    hostile.base_url = "http://127.0.0.1:9"  # refused connections: the create is not sent anywhere
    provider_file = tmp_path / "hostile.toml"
    provider_file.write_text(provider_toml(hostile.config(url_fields=["$.input.image"])), encoding="utf-8")

    def submit(request: Any, key: str) -> tuple[str, dict[str, Any]]:
        # a 1 s create deadline: nothing listens there, and submit_job drives the create to its end
        arguments = {"provider": "hostile", "request": request, "operation_key": key, "create_deadline_s": 1}
        return ("submit_job", arguments)

    calls = [
        submit({"input": {"url": "http://127.0.0.2/steal"}}, "k1"),
        submit({"prompt": canary}, "k2"),
        submit({"prompt": base64.b64encode(canary.encode()).decode()}, "k3"),
        submit({"code": "x = 1", "tokenizer": "t", "input": {"image": "https://img.example/1.png"}}, "k4"),
        submit({"code": "y = 1"}, f"bot/{canary}"),  # the key is stored and listed too
        ("job_status", {"operation_id": canary}),  # an error that quotes what the agent gave
    ]
    answers = asyncio.run(_session(_mcp_params(db_url, provider_file, "agent-a"), calls))
    assert "is refused" in answers[0][0]["error"]
    assert "is or encodes a credential" in answers[1][0]["error"]
    assert "is or encodes a credential" in answers[2][0]["error"]
    assert answers[3][0].get("operation_id", "").startswith("op_"), answers[3][0]
    assert "the operation key carries what looks like a credential" in answers[4][0]["error"]
    assert "no operation" in answers[5][0]["error"]
    assert canary_hits(canary, "\n".join(t for _, t in answers)) == []
    with Store.open(db_url) as store:
        assert store.count() == 1
        assert canary_hits(canary, ledger_bytes(store)) == []


def _mcp_server_over_stdio(tmp_path: Path, canary: str, *more: str) -> tuple[Path, subprocess.Popen[bytes]]:
    """`jobtrail mcp` on a new ledger, its provider one whose address answers nothing, spoken to on its pipes
    (``more``: its further arguments, ``--http PORT`` say)."""
    hostile = HostileProvider(canary)
    hostile.base_url = "http://127.0.0.1:9"
    provider_file = tmp_path / "hostile.toml"
    provider_file.write_text(provider_toml(hostile.config()), encoding="utf-8")
    db = tmp_path / "mcp.db"
    Store.open(str(db)).close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobtrail", "--db", str(db), "mcp", "--provider", str(provider_file), *more],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    return db, proc


def _replies(proc: subprocess.Popen[bytes], lines: list[bytes]) -> tuple[list[dict[str, Any]], bytes]:
    """Every line on the server's stdin, then its stdin closed: its replies, in order, and its stderr."""
    try:
        out, err = proc.communicate(b"".join(lines), timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return [json.loads(line) for line in out.splitlines() if line.strip()], err


def test_malformed_huge_and_deep_json_rpc_lines_get_an_error_reply(tmp_path: Path, canary: str) -> None:
    _, proc = _mcp_server_over_stdio(tmp_path, canary)
    lines = [
        b"{this is not json\n",
        b'{"jsonrpc": "2.0", "id": 7, "method": 5}\n',
        b"[" * 200_000 + b"]" * 200_000 + b"\n",
        b'{"jsonrpc": "2.0", "id": 8, "method": "x", "params": {"p": "' + b"y" * (3 * 1024 * 1024) + b'"}}\n',
        b'{"jsonrpc":"2.0","id":9,"method":"ping"}\n',
    ]
    replies, err = _replies(proc, lines)
    assert [r.get("id") for r in replies] == [None, 7, None, None, 9], (replies, err[-2000:])
    codes = [r.get("error", {}).get("code") for r in replies]
    assert codes[:4] == [-32700, -32600, -32600, -32600]
    assert "nests at most" in replies[2]["error"]["message"] and "at most" in replies[3]["error"]["message"]
    assert "result" in replies[4]  # the server is alive and answers the next good line
    assert b"Traceback" not in err


def test_an_mcp_servers_own_log_lines_are_masked_and_an_odd_id_is_answered(tmp_path: Path, canary: str) -> None:
    """The SDK logs a failed tool's message (here quoting an id the agent gave, the credential) and had a
    handler of its own on the root logger; and it took a message whose id is 1.5 or null for a notification."""
    db, proc = _mcp_server_over_stdio(tmp_path, canary)

    def line(doc: dict[str, Any]) -> bytes:
        return json.dumps(doc).encode() + b"\n"

    hello = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    status = {"name": "job_status", "arguments": {"operation_id": canary}}
    lines = [
        line({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello}),
        line({"jsonrpc": "2.0", "method": "notifications/initialized"}),
        line({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": status}),
        b'{"jsonrpc":"2.0","id":1.5,"method":"ping"}\n',
        b'{"jsonrpc":"2.0","id":null,"method":"ping"}\n',
        line({"jsonrpc": "2.0", "id": 3, "method": "ping"}),
        # a number JSON has no form for, as a client may still write it: refused with why, nothing stored
        b'{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"submit_job","arguments":'
        b'{"provider":"hostile","operation_key":"inf","request":{"x":Infinity}}}}\n',
    ]
    assert proc.stdin is not None and proc.stdout is not None
    replies: list[dict[str, Any]] = []
    try:
        for one in lines:
            proc.stdin.write(one)
            proc.stdin.flush()
            if b'"id"' in one:  # one reply each, in order (the next waits for it: the session answers in turn)
                replies.append(json.loads(proc.stdout.readline()))
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert [r.get("id") for r in replies] == [1, 2, None, None, 3, 4], replies
    refused = replies[5]["result"]
    assert refused["isError"] is True and "no NaN or infinity" in refused["content"][0]["text"], refused
    with Store.open(str(db)) as store:
        assert store.count() == 0
    assert replies[1]["result"]["isError"] is True and canary not in json.dumps(replies[1])
    assert [r["error"]["code"] for r in replies[2:4]] == [-32600, -32600]
    assert "a string or a whole number" in replies[2]["error"]["message"]
    assert "result" in replies[4]
    assert canary_hits(canary, err.decode("utf-8", "replace")) == [], err[-2000:]


def test_over_http_a_message_is_held_to_what_a_stdio_line_is(tmp_path: Path, canary: str) -> None:
    """`jobtrail mcp --http`: the SDK read every POSTed message as it came, so a request naming a key twice
    was stored with the last value (a proxy may have approved the first). Each message is now checked as a
    stdio line is, before the SDK reads it; a good one is served as before."""
    import http.client

    port = free_port()
    db, proc = _mcp_server_over_stdio(tmp_path, canary, "--http", str(port))
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}

    def post(body: bytes) -> tuple[int, str, str | None]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/mcp", body=body, headers=headers)
        answer = conn.getresponse()
        data, session = answer.read().decode(), answer.getheader("mcp-session-id")
        conn.close()
        return answer.status, data, session

    try:
        wait_for_port(port, proc)
        hello = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
        initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello}
        status, _, session = post(json.dumps(initialize).encode())
        assert status == 200 and session
        headers |= {"mcp-session-id": session, "mcp-protocol-version": "2025-06-18"}
        post(b'{"jsonrpc":"2.0","method":"notifications/initialized"}')
        twice = (
            b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"submit_job","arguments":'
            b'{"provider":"hostile","operation_key":"k1","request":{"amount":1},"request":{"amount":1000000}}}}'
        )
        deep = b'{"jsonrpc":"2.0","id":3,"method":"ping","params":{"a":' + b"[" * 100 + b"]" * 100 + b"}}"
        refusals = [post(twice), post(deep)]
        # a message over 2 MiB is refused by its Content-Length, and an error response may carry a null id
        too_big = post(b'{"jsonrpc":"2.0","id":5,"method":"ping","params":{"p":"' + b"y" * (3 << 20) + b'"}}')
        null_id = post(b'{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"unreadable"}}')
        listed = post(b'{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"list_providers"}}')
    finally:
        proc.terminate()
        err = proc.communicate(timeout=20)[1]
    # (a line nested too deep is refused before it is parsed: its id is not read)
    expected = ((2, "names the same key twice"), (None, "nests at most"))
    for (status, data, _), (request_id, says) in zip(refusals, expected, strict=True):
        reply = json.loads(data)
        assert status == 400 and reply["id"] == request_id and reply["error"]["code"] == -32600, data
        assert says in reply["error"]["message"]
    assert listed[0] == 200 and "hostile" in listed[1], listed
    assert too_big[0] == 413 and "at most" in json.loads(too_big[1])["error"]["message"], too_big
    assert null_id[0] < 400, null_id
    assert b"Traceback" not in err
    with Store.open(str(db)) as store:
        assert store.count() == 0


# -- bad local input loses nothing ------------------------------------------------------------------


@pytest.fixture
def ledger_with_result(tmp_path: Path) -> Iterator[tuple[str, str]]:
    from helpers import op_in, succeed

    db = str(tmp_path / "ledger.db")
    with Store.open(db) as store:
        op = op_in(store, State.RESULT_COLLECTING)
        succeed(store, op, HONEST_RESULT)
    yield db, op.operation_id


def test_result_out_refuses_to_overwrite_or_to_write_the_ledger(
    ledger_with_result: tuple[str, str], tmp_path: Path
) -> None:
    db, op_id = ledger_with_result
    existing = tmp_path / "mine.txt"
    existing.write_bytes(b"precious")
    refused = _cli(db, "result", op_id, "--out", str(existing))
    assert refused.returncode == 2 and b"--force" in refused.stderr and existing.read_bytes() == b"precious"

    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"do not follow me")
    link = tmp_path / "link.json"
    link.symlink_to(victim)
    assert _cli(db, "result", op_id, "--out", str(link)).returncode == 2
    assert _cli(db, "result", op_id, "--out", str(link), "--force").returncode == 0
    assert victim.read_bytes() == b"do not follow me" and not link.is_symlink()
    assert link.read_bytes() == HONEST_RESULT

    ledger = Path(db).read_bytes()
    for own in (db, f"{db}-wal", f"{db}-shm", f"{db}-results/ab"):
        done = _cli(db, "result", op_id, "--out", own, "--force")
        assert done.returncode == 2 and b"ledger's own files" in done.stderr, (own, done.stderr)
    ledger_link = tmp_path / "ledger-link.db"
    os.link(db, ledger_link)  # a hard link to the ledger is the ledger
    assert _cli(db, "result", op_id, "--out", str(ledger_link), "--force").returncode == 2
    assert Path(db).read_bytes()[:16] == ledger[:16] == b"SQLite format 3\x00"
    assert _cli(db, "audit", "verify").returncode == 0

    fresh = tmp_path / "fresh.json"
    written = _cli(db, "result", op_id, "--out", str(fresh))
    assert written.returncode == 0 and fresh.read_bytes() == HONEST_RESULT
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


@pytest.mark.parametrize(
    "command", [["ops", "list"], ["audit", "verify"], ["explain", "op_x"], ["result", "op_x"], ["ops", "show", "op_x"]]
)
def test_a_read_command_on_a_missing_database_says_so_and_creates_nothing(tmp_path: Path, command: list[str]) -> None:
    db = tmp_path / "typo.db"
    done = _cli(str(db), *command)
    assert done.returncode == 2
    assert str(db).encode() in done.stderr and b"--db" in done.stderr
    assert not db.exists() and list(tmp_path.iterdir()) == []


def test_text_that_is_not_unicode_gets_the_json_error_and_loses_nothing(
    ledger_with_result: tuple[str, str], tmp_path: Path
) -> None:
    """An argument that is not UTF-8 (Python reads it as lone surrogates) and a lone surrogate in the request's
    JSON: the documented error (one JSON line, its exit code), never a traceback; nothing written."""
    db, op_id = ledger_with_result
    hostile = HostileProvider("x")
    hostile.base_url = "http://127.0.0.1:9"  # nothing is sent: the request is refused first
    provider_file = tmp_path / "fake.toml"
    provider_file.write_text(provider_toml(hostile.config()), encoding="utf-8")
    runs = [
        _cli(db, "ops", "show", os.fsdecode(b"\xff"), "--json"),
        _cli(db, "ops", "list", "--caller", os.fsdecode(b"agent\xff"), "--json"),
        _cli(db, "submit", "--provider", str(provider_file), "--request", '{"x": "\\ud800"}', "--key", "a", "--json"),
    ]
    for done in runs:
        assert b"Traceback" not in done.stderr, done.stderr[-2000:]
        if done.returncode:  # an error: the documented one
            error = json.loads(done.stdout.decode("utf-8").splitlines()[0])["error"]
            assert error["exit_code"] == done.returncode and error["message"]
    assert runs[0].returncode == 2 and "not valid Unicode" in json.loads(runs[0].stdout)["error"]["message"]
    assert runs[2].returncode == 2 and "Unicode" in json.loads(runs[2].stdout)["error"]["message"]
    with Store.open(db) as store:
        assert [op.operation_id for op in store.list_operations()] == [op_id]


def test_audit_verify_errors_have_the_shape_of_every_commands_json_error(tmp_path: Path) -> None:
    db = str(tmp_path / "ledger.db")
    Store.open(db).close()
    done = _cli(db, "audit", "verify", "--anchor", str(tmp_path / "missing.json"), "--json")
    assert done.returncode == 2 and len(done.stdout.splitlines()) == 1
    error = json.loads(done.stdout)["error"]
    assert error["exit_code"] == 2 and error["message"].startswith("cannot verify:")
    assert b"cannot verify:" in done.stderr


def test_a_request_body_carrying_the_providers_own_credential_is_refused_before_the_first_send(
    tmp_path: Path, canary: str, fake: FakeProvider
) -> None:
    """Found by a probe: a submit whose body carried the value of the provider's configured credential (not of
    a known secret format) was stored in clear, then sent, because the credential is read at the first send and
    the ledger did not know it yet. Now it is read before the first submit, and such a body is refused."""
    from jobtrail.domain.errors import SecretInRequest

    db = str(tmp_path / "ledger.db")
    provider_file = fake.write_provider_file(tmp_path / "fake.toml", credential=f"env:{ENV}")
    body = json.dumps({"note": canary})
    done = _cli(db, "submit", "--provider", str(provider_file), "--key", "s-1", "--request", body)
    assert done.returncode != 0 and b"looks like a credential at $.note" in done.stderr, done.stderr

    async def library() -> None:
        async with AsyncJobtrail(db, providers=[fake.provider_config(credential=f"env:{ENV}")]) as jt:
            with pytest.raises(SecretInRequest, match=r"looks like a credential at \$\.note"):
                await jt.submit("fake", {"note": f"key {canary}"})
            with pytest.raises(SecretInRequest):
                await jt.submit_many("fake", [{"n": 1}, {"note": canary}])

        def slowly() -> str:  # a keyring, say: concurrent submits all wait for the one read
            time.sleep(0.3)
            return canary

        async with AsyncJobtrail(db, providers=[fake.provider_config(credential=slowly)]) as jt:
            together = [jt.submit("fake", {"note": canary, "n": i}) for i in range(3)]
            refused = await asyncio.gather(*together, return_exceptions=True)
            assert all(isinstance(r, SecretInRequest) for r in refused), refused

    asyncio.run(library())
    with Store.open(db) as store:
        assert store.count() == 0
    assert fake.counts["creates_received"] == 0
    assert _hits(canary, Path(db).read_bytes()) == []


def test_a_credential_in_the_key_caller_or_as_a_number_is_refused_before_anything_is_stored(tmp_path: Path) -> None:
    from jobtrail.domain.errors import SecretInRequest, UsageError

    from helpers import spec

    with Store.open(str(tmp_path / "l.db")) as store:
        store.redactor.register("sk-SUPERSECRET-abcdef1234567890XYZ")
        store.redactor.register("98765432109876543210")
        for made in (
            spec(operation_key="bot/sk-SUPERSECRET-abcdef1234567890XYZ"),
            spec(caller="agent sk-SUPERSECRET-abcdef1234567890XYZ"),
            spec(body={"n": 98765432109876543210}),
            spec(body={"api_key": 98765432109876543210}),
        ):
            with pytest.raises(SecretInRequest, match="looks like a credential"):
                store.create_operation(made)
        with pytest.raises(UsageError, match="no NaN or infinity"):
            store.create_operation(spec(body={"x": float("inf")}))
        assert store.count() == 0
        assert store.create_operation(spec(body={"n": 12345678901234567890}))[1]  # other numbers are no matter


def test_a_state_or_time_an_adapter_passes_on_as_it_came_is_not_kept_when_it_carries_the_credential(
    db_url: str, canary: str
) -> None:
    """Found by a probe: a built-in adapter took the provider's time (and state) as the answer gave them, and
    one that echoed the credential went into the ledger in clear (the declared providers drop such values as
    they read them). The observe flow now holds every adapter's words to the same rule: the credential in a
    state or a time is not kept, the state is unknown, and the job goes on being polled honestly."""
    from jobtrail.providers.contract import StatusOutcome
    from jobtrail.providers.http import HttpProvider, parse_config

    class Careless(HttpProvider):
        """An adapter that passes the provider's words on as they came (the state, after one honest read)."""

        reads = 0

        async def status(self, op: Operation) -> StatusOutcome:
            seen = await super().status(op)
            Careless.reads += 1
            echoed = f"Bearer {canary}"
            return dataclasses.replace(
                seen,
                provider_time=echoed,
                raw_state=echoed if Careless.reads == 1 else seen.raw_state,
            )

    fake = FakeProvider(job_duration_s=0.3, require_bearer=canary).start()
    try:
        config = fake.provider_config(credential=f"env:{ENV}", poll={"initial_s": 0.05, "factor": 1, "cap_s": 0.05})
        provider = Careless(parse_config(config))

        async def go() -> str:
            with Store.open(db_url) as store:
                jt = AsyncJobtrail(store=store, providers=[config])
                op = await jt.submit("fake", {"x": 1})
                await Worker(store, {"fake": provider}, worker_id="w", idle_s=0.01).run(until_settled=True, timeout=20)
                await provider.aclose()
                await jt.aclose()
                return op.operation_id

        op_id = asyncio.run(go())
        with Store.open(db_url) as store:
            op = store.get(op_id)
            assert op.state is State.SUCCEEDED, op.state_reason
            polls = [o for o in store.observations(op_id) if o["kind"] == "status_poll"]
            assert polls and all(o["provider_time"] is None for o in polls)
            assert polls[0]["raw_state"] is None and polls[0]["remote_state"] == "unknown"
            assert _hits(canary, ledger_bytes(store)) == []
        assert fake.counts["unauthorized"] == 0 and Careless.reads >= 2
    finally:
        fake.stop()
