"""A strict provider, on a real socket on 127.0.0.1, that keeps the IETF Idempotency-Key draft's and Stripe's
rules (a key reused with another body: 422; a key still in flight: 409; a completed key: its stored answer
replayed) and misbehaves as each test scripts it. Each test counts what the provider saw and reads what
the ledger says.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp import web

from jobtrail import AsyncJobtrail, Worker


class Strict:
    """Jobs that succeed ``duration`` seconds after their create; ``faults[endpoint]`` is popped per request."""

    def __init__(self) -> None:
        self.jobs: dict[str, float] = {}  # job id -> when it succeeds
        self.keys: dict[str, tuple[str, int, bytes]] = {}  # key -> (body sha256, status, stored answer)
        self.faults: dict[str, collections.deque[dict[str, Any]]] = collections.defaultdict(collections.deque)
        self.seen: collections.Counter[str] = collections.Counter()

    def fault(self, endpoint: str, **what: Any) -> None:
        self.faults[endpoint].append(what)

    def _fault(self, endpoint: str) -> dict[str, Any]:
        self.seen[endpoint] += 1
        queue = self.faults[endpoint]
        return queue.popleft() if queue else {}

    def _new_job(self, raw: bytes) -> bytes:
        job = f"job_{len(self.jobs) + 1}"
        self.jobs[job] = time.monotonic() + float(json.loads(raw or b"{}").get("duration", 0.2))
        self.seen["jobs_made"] += 1
        return json.dumps({"id": job, "status": "queued"}).encode()

    async def create(self, request: web.Request) -> web.StreamResponse:
        fault = self._fault("create")
        raw = await request.read()
        if "status" in fault:  # refused before the key is looked at (a rate limiter, a proxy)
            return web.json_response({"title": "refused"}, status=fault["status"])
        keys = request.headers.getall("Idempotency-Key", [])
        if not keys:  # a provider without idempotency: every request is a new job
            answer = self._new_job(raw)
        else:
            key, digest = keys[0].strip('"'), hashlib.sha256(raw).hexdigest()
            if key in self.keys and self.keys[key][0] != digest:
                return web.json_response({"title": "key reused with another request"}, status=422)
            if key not in self.keys:
                self.keys[key] = (digest, 201, self._new_job(raw))
            answer = self.keys[key][2]
        if fault.get("drop"):  # the job is made, the answer never arrives
            assert request.transport is not None
            request.transport.close()
        return web.Response(status=201, body=answer, content_type="application/json")

    async def status(self, request: web.Request) -> web.Response:
        fault = self._fault("status")
        job = request.match_info["job_id"]
        if job not in self.jobs:
            return web.json_response({"title": "no such job"}, status=404)
        body = {"id": job, "status": "succeeded" if time.monotonic() >= self.jobs[job] else "running"}
        return web.json_response(body | fault)

    async def result(self, request: web.Request) -> web.Response:
        self._fault("result")
        job = request.match_info["job_id"]
        if job not in self.jobs or time.monotonic() < self.jobs[job]:
            return web.json_response({"title": "not yet"}, status=404)
        return web.json_response({"job": job})


@asynccontextmanager
async def strict_provider() -> AsyncIterator[tuple[Strict, str]]:
    strict = Strict()
    app = web.Application()
    app.router.add_route("*", "/v1/jobs", strict.create)
    app.router.add_get("/v1/jobs/{job_id}", strict.status)
    app.router.add_get("/v1/jobs/{job_id}/result", strict.result)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield strict, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


def provider_file(base_url: str, **create: Any) -> dict[str, Any]:
    return {
        "name": "strict",
        "base_url": base_url,
        "timeout_s": 2,
        "connect_timeout_s": 1,
        "create": {"path": "/v1/jobs", "token_retention_s": 86400, **create},
        "status": {"path": "/v1/jobs/{job_id}"},
        "result": {"path": "/v1/jobs/{job_id}/result", "content_type": "application/json"},
        "reconcile": {"modes": ["replay"]},
        "retry": {"initial_s": 0.05, "cap_s": 0.2},
        "poll": {"initial_s": 0.05, "cap_s": 0.2},
    }


def test_a_create_declared_as_put_reaches_the_provider_once_per_recorded_attempt(tmp_path: Path) -> None:
    """A broken connection after a PUT create is a doubt to reconcile, never a re-send the ledger does not know
    of: the HTTP client re-sent "idempotent" methods by itself, and without a token that made a second job."""

    async def go() -> None:
        async with strict_provider() as (strict, base):
            strict.fault("create", drop=True)
            toml = provider_file(base, method="PUT", token={"in": "none"}) | {"reconcile": {"modes": []}}
            async with AsyncJobtrail(tmp_path / "jobs.db", providers=[toml]) as jt:
                op = await jt.submit("strict", {"duration": 5}, key="put-1", caller="test")
                op = await jt.advance_create(op.operation_id)
                assert strict.seen["create"] == op.attempts == 1
                assert strict.seen["jobs_made"] == 1
                assert op.state.value == "create_unknown" and "connection_reset" in (op.state_reason or "")

    asyncio.run(go())


def test_a_status_answer_about_another_job_never_ends_this_one(tmp_path: Path) -> None:
    """A status answer naming another job (a cache or proxy mixing answers up) says nothing of ours: a job
    still running is not ended failed on its word, and ends as its own answers say."""

    async def go() -> None:
        async with strict_provider() as (strict, base):
            strict.fault("status", id="job_999", status="failed")
            toml = provider_file(base, token={"in": "header", "name": "Idempotency-Key", "quoted": True})
            async with AsyncJobtrail(tmp_path / "jobs.db", providers=[toml]) as jt:
                op = await jt.submit("strict", {"duration": 1}, key="mixed-1", caller="test")
                op = await jt.drive_create(op.operation_id)
                await Worker(jt.store, jt.providers).run(until_settled=True, timeout=20)
                final = jt.store.get(op.operation_id)
                assert final.state.value == "succeeded", final.state_reason
                polls = [o for o in jt.store.observations(op.operation_id) if o["kind"] == "status_poll"]
                assert polls[0]["raw"]["error_class"] == "another_job"
                assert "failed" not in [e.to_state for e in jt.store.history(op.operation_id)]
                assert strict.seen["jobs_made"] == 1 and strict.seen["result"] >= 1

    asyncio.run(go())


def test_a_replay_refused_for_a_reused_token_stops_for_a_person_never_failed(tmp_path: Path) -> None:
    """A replay answered 422 (the IETF draft's "this key was used with another request") proves the token was
    used, not that the create was refused: the job the first attempt made may run, so the operation waits for
    a person, is never re-sent and never ends failed (whose advice, "submit a new operation", makes a second)."""

    async def go() -> None:
        async with strict_provider() as (strict, base):
            strict.fault("create", drop=True)  # the job is made; its answer is lost
            strict.fault("create", status=422)
            strict.fault("create", status=422)
            toml = provider_file(base, token={"in": "header", "name": "Idempotency-Key", "quoted": True})
            async with AsyncJobtrail(tmp_path / "jobs.db", providers=[toml]) as jt:
                op = await jt.submit("strict", {"duration": 5}, key="reused-1", caller="test")
                op = await jt.drive_create(op.operation_id)
                assert op.state.value == "needs_attention", op.state_reason
                assert "422" in (op.state_reason or "") and op.trace_id in (op.state_reason or "")
                assert strict.seen["create"] == 2 and strict.seen["jobs_made"] == 1
                history = [e.cause for e in jt.store.history(op.operation_id)]
                assert "definitive_rejection" not in history and "proved_absent" not in history

    asyncio.run(go())
