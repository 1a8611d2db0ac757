"""A fault-injecting fake async-job provider: a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from jobtrail.testing._served import ServedInThread


@dataclass(slots=True)
class Fault:
    """What the fake does to one create request (consumed in order, one per create).

    Build them with the class methods; each says whether the job is committed.
    """

    kind: str
    commit: bool = True
    status: int = 0
    retry_after: str | None = None
    delay_s: float = 0.0
    echo_auth: bool = False

    @classmethod
    def drop(cls, *, commit: bool = True) -> Fault:
        """Commit the job (or not), then close the connection without answering."""
        return cls("drop", commit=commit)

    @classmethod
    def delay(cls, seconds: float, *, commit: bool = True) -> Fault:
        """Commit the job, then answer only after ``seconds`` (past the client's time-out)."""
        return cls("delay", commit=commit, delay_s=seconds)

    @classmethod
    def http(cls, status: int, *, retry_after: str | None = None, commit: bool = False) -> Fault:
        """Answer ``status`` (500, 503, 429, ...), optionally after committing the job."""
        return cls("http", commit=commit, status=status, retry_after=retry_after)

    @classmethod
    def stored_error(cls, status: int = 500) -> Fault:
        """Commit the job, answer ``status``, and keep that answer as the key's outcome: every replay gets it
        again, as Stripe replays a stored 500 (the request had begun executing)."""
        return cls("stored_error", commit=True, status=status)

    @classmethod
    def reject(cls, status: int = 400, *, echo_auth: bool = False) -> Fault:
        """Refuse the request (nothing committed); optionally echo the credential back, as bad APIs do."""
        return cls("reject", commit=False, status=status, echo_auth=echo_auth)

    @classmethod
    def replay_new_id(cls) -> Fault:
        """Break the idempotency contract: treat this request as new even if its key is known."""
        return cls("replay_new_id")

    @classmethod
    def previous_job(cls) -> Fault:
        """Lie: make no job and answer 201 with the job of the create before this one, as a provider that
        mixes up two requests (or takes two different ones for one) would."""
        return cls("previous_job", commit=False)

    @classmethod
    def synchronous(cls) -> Fault:
        """Finish at once and answer 200 with the result itself."""
        return cls("sync")

    @classmethod
    def malformed(cls) -> Fault:
        """Commit the job, answer 201 with a body that has no job id."""
        return cls("malformed")


#: the options a request body's ``{"fake": {...}}`` may carry (name, values, default, what it scripts);
#: the README's table is generated from this, and a create with any other option is refused (400)
FAKE_OPTIONS: tuple[tuple[str, str, str, str], ...] = (
    ("duration", "seconds", "the provider's (`--job-duration`, 1 s)", "how long the job runs"),
    (
        "cancel",
        "normal, finish_first, ignore",
        "normal",
        "normal: takes effect after 50 ms; finish_first: the job finishes the moment the cancel arrives "
        "(the cancel loses the race); ignore: acknowledged, never takes effect",
    ),
    (
        "result",
        "ok, bad_checksum, missing, one_time, batch, large, flaky, schema_bad, binary, csv, large_binary, empty, "
        "key_twice, past_float",
        "ok",
        "what a result fetch gets (one_time: a second fetch gets 410; flaky: the first fetches get 503; "
        "empty: no bytes, typed as JSON; key_twice: a JSON object that names `items` twice; past_float: a "
        "JSON object with a number past a 64-bit float's range, `1e999`)",
    ),
    ("items", "count", "10", "a batch result's lines"),
    ("failed_items", "count", "0", "how many of a batch's lines failed"),
    ("item_id", "text", "item", "what a batch's item ids start with (`item-00000`, `item-00001`, ...)"),
    ("size", "bytes", "1000000", "the size of a large or large_binary result"),
    ("flaky", "count", "2", "how many fetches of a flaky result get 503"),
    ("effects", "bool", "false", "every status reports partial effects (items processed)"),
    ("ending", "expired", "succeeded", "expired: the job expires instead of finishing"),
    ("partial", "bool", "false", "a cancelled or expired batch serves the half of its items it finished"),
    ("failure", "text", "the job failed", 'a failed job\'s `error.message`; `"fail": true` beside `fake` fails it'),
)


@dataclass(slots=True)
class FakeJob:
    """One job. Its request body may carry ``{"fake": {...}}`` options that script its behaviour
    (:data:`FAKE_OPTIONS`, the README's table):

    ``cancel``: ``"normal"`` (takes effect after 50 ms), ``"finish_first"`` (the job finishes at
    the moment the cancel arrives), ``"ignore"`` (acknowledged, never takes effect);
    ``result``: ``"ok"``, ``"bad_checksum"``, ``"missing"``, ``"one_time"`` (a second fetch gets 410),
    ``"batch"`` (JSONL with ``items`` lines of which ``failed_items`` failed), ``"large"`` (``size``
    bytes), ``"flaky"`` (the first ``flaky`` fetches get 503), ``"schema_bad"``, ``"binary"`` (PNG
    bytes), ``"csv"``, ``"large_binary"`` (``size`` bytes), ``"empty"`` (no bytes, typed as JSON),
    ``"key_twice"`` (an object that names ``items`` twice, with two values), ``"past_float"`` (an object
    with the number ``1e999``, past a 64-bit float's range);
    ``effects``: report partial effects (items processed) on every status;
    ``ending``: ``"expired"`` (the job expires instead of finishing);
    ``partial``: a cancelled or expired batch serves the half of its items it finished (``result_url``).
    """

    id: str
    key: str | None
    reference: str | None
    body: Any
    created: float
    duration_s: float
    cancel_requested_at: float | None = None
    fail: bool = False
    fetches: int = 0
    #: wall-clock creation time (epoch seconds), as providers list it
    created_at: float = field(default_factory=time.time)

    @property
    def options(self) -> dict[str, Any]:
        fake = self.body.get("fake") if isinstance(self.body, dict) else None
        return fake if isinstance(fake, dict) else {}

    def state(self, now: float) -> str:
        finish = self.created + self.duration_s
        cancel = self.options.get("cancel", "normal")
        if self.cancel_requested_at is not None and cancel != "ignore":
            if cancel == "finish_first" or self.cancel_requested_at >= finish:
                return "failed" if self.fail else "succeeded"
            return "cancelled" if now - self.cancel_requested_at >= 0.05 else "cancelling"
        if now >= finish:
            return "failed" if self.fail else self.options.get("ending", "succeeded")
        return "queued" if now - self.created < self.duration_s * 0.1 else "running"

    def progress(self, now: float) -> float:
        return round(min(1.0, (now - self.created) / self.duration_s), 3) if self.duration_s else 1.0

    def result(self) -> dict[str, Any]:
        return {"job_id": self.id, "output": {"echo": self.body}, "items": 3}

    def has_result(self, state: str) -> bool:
        return state == "succeeded" or (state in ("cancelled", "expired") and bool(self.options.get("partial")))

    def result_bytes(self, state: str = "succeeded") -> tuple[bytes, str]:
        opts = self.options
        mode = opts.get("result", "ok")
        if mode == "batch":
            total, failed = int(opts.get("items", 10)), int(opts.get("failed_items", 0))
            if state != "succeeded":
                total //= 2  # what it had finished when it stopped
            refused = {n * total // failed for n in range(failed)} if failed else set()
            lines = []
            prefix = str(opts.get("item_id", "item"))  # what the items' ids start with (any text a provider writes)
            for n in range(total):
                item: dict[str, Any] = {"custom_id": f"{prefix}-{n:05d}"}
                if n in refused:
                    item["error"] = {"code": "invalid_request", "message": "item refused"}
                else:
                    item["response"] = {"status_code": 200, "body": {"n": n}}
                lines.append(json.dumps(item))
            return ("\n".join(lines) + "\n").encode(), "application/x-ndjson"
        if mode == "large_binary":  # ``size`` bytes of an archive, say: never JSON
            block = hashlib.sha256(self.id.encode()).digest() * 32768  # 1 MiB
            size = int(opts.get("size", 1_000_000))
            return (block * (size // len(block) + 1))[:size], "application/octet-stream"
        if mode == "binary":  # an image: not JSON, not even UTF-8
            return b"\x89PNG\r\n\x1a\n" + hashlib.sha256(self.id.encode()).digest() * 64, "image/png"
        if mode == "csv":
            return b'id,value\r\n1,caf\xc3\xa9\r\n2,"a,b"\r\n', "text/csv"
        if mode == "empty":  # a provider that answers a finished job's result with nothing at all
            return b"", "application/json"
        doc: dict[str, Any] = self.result()
        if mode == "large":
            doc["padding"] = "x" * int(opts.get("size", 1_000_000))
        if mode == "schema_bad":
            doc.pop("items")
        if mode == "key_twice":  # which count is it? this parser reads the last, others the first
            return json.dumps(doc).removesuffix("}").encode() + b', "items": 0}', "application/json"
        if mode == "past_float":  # Python reads infinity, orjson and Go refuse it, JavaScript reads Infinity
            return json.dumps(doc).removesuffix("}").encode() + b', "score": 1e999}', "application/json"
        return json.dumps(doc).encode(), "application/json"


@dataclass(slots=True)
class _KeyRecord:
    fingerprint: str
    in_flight: bool
    status: int = 0
    body: Any = None


@dataclass
class FakeProvider(ServedInThread):
    """The fake. ``start()`` runs it in a thread; ``await start_async()`` in the running loop."""

    host: str = "127.0.0.1"
    port: int = 0
    job_duration_s: float = 1.0
    #: honour Idempotency-Key (IETF semantics); False ignores keys entirely
    idempotency: bool = True
    #: when set, every request must carry ``Authorization: Bearer <this>``
    require_bearer: str | None = None
    #: a fixed cost of every API answer (seconds), as a remote provider's round trip; slept, so
    #: requests are still served concurrently (the ``/_fake`` control routes answer at once)
    latency_s: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)
    jobs: dict[str, FakeJob] = field(default_factory=dict)
    faults: list[Fault] = field(default_factory=list)
    requests: list[tuple[float, str, str]] = field(default_factory=list)
    #: headers of every create request received, in order
    create_headers: list[dict[str, str]] = field(default_factory=list)
    #: (method, path, traceparent header) of every request received, in order
    traceparents: list[tuple[str, str, str | None]] = field(default_factory=list)
    #: (job id, X-Jobtrail-Lease header, time) of every status poll
    status_leases: list[tuple[str, str | None, float]] = field(default_factory=list)
    #: the lease (X-Jobtrail-Lease) each job listing was asked under
    list_leases: list[str | None] = field(default_factory=list)
    #: the next this many cancels are answered 503 with ``Retry-After: busy_retry_after`` (shedding load)
    busy_cancels: int = 0
    busy_retry_after: str = "1"
    #: where to deliver signed Standard Webhooks events on every job state change (None: no webhooks)
    webhook_url: str | None = None
    webhook_secret: str | None = None
    #: misbehaviour of deliveries: "duplicate", "reorder", "wrong_signature", "delay"
    webhook_faults: set[str] = field(default_factory=set)
    #: (event id, HTTP status) of every delivery attempt
    webhook_deliveries: list[tuple[str, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._keys: dict[str, _KeyRecord] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.base_url = ""

    # -- control -----------------------------------------------------------------------

    def script(self, *faults: Fault) -> None:
        """Queue faults for the next create requests, one each, in order."""
        with self._lock:
            self.faults.extend(faults)

    def jobs_for(self, key: str) -> list[str]:
        """Every job id created for this idempotency key or client reference."""
        with self._lock:
            return [j.id for j in self.jobs.values() if key in (j.key, j.reference)]

    def provider_config(self, **overrides: Any) -> dict[str, Any]:
        """An HttpProvider declaration that speaks to this fake (override any key)."""
        config: dict[str, Any] = {
            "name": "fake",
            "base_url": self.base_url,
            "timeout_s": 2.0,
            "connect_timeout_s": 0.5,  # loopback: a connection is made at once or never
            "create": {
                "path": "/v1/jobs",
                "job_id": "$.id",
                "status_url": "header:Location",
                "sync_result": "$.result",
                "token_retention_s": 86400,
            },
            "status": {
                "path": "/v1/jobs/{job_id}",
                "state": "$.status",
                "time": "$.updated_at",
                "effects": "$.effects",
                "progress": "$.progress",
                "result_ref": "$.result_url",
                "error": "$.error",
            },
            "cancel": {"path": "/v1/jobs/{job_id}/cancel", "idempotent": True},
            "result": {"path": "/v1/jobs/{job_id}/result", "checksum": "header:X-Result-SHA256"},
            "reconcile": {"modes": ["replay"]},
            "retry": {"initial_s": 0.05, "factor": 2, "cap_s": 0.5},
            "poll": {"initial_s": 0.1, "factor": 1.5, "cap_s": 0.5},
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(config.get(key), dict):
                config[key] = {**config[key], **value}
            elif value is None:
                config.pop(key, None)
            else:
                config[key] = value
        return config

    def write_provider_file(self, path: str | os.PathLike[str], **overrides: Any) -> Path:
        """Write :meth:`provider_config` (with ``overrides``) as a TOML provider file; returns its path."""
        target = Path(path)
        target.write_text(provider_toml(self.provider_config(**overrides)), encoding="utf-8")
        return target

    # -- life cycle ------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._count])
        app.router.add_post("/v1/jobs", self._create)
        app.router.add_get("/v1/jobs", self._list)
        app.router.add_get("/v1/jobs/by-client-id/{key}", self._by_client_id)
        app.router.add_get("/v1/jobs/{id}", self._status)
        app.router.add_post("/v1/jobs/{id}/cancel", self._cancel)
        app.router.add_get("/v1/jobs/{id}/result", self._result)
        app.router.add_get("/_fake/counts", self._counts)
        return app

    async def start_async(self) -> str:
        self.base_url, self.port = await self.serve(self._app(), self.host, self.port)
        self._watcher = asyncio.create_task(self._watch()) if self.webhook_url and self.webhook_secret else None
        return self.base_url

    async def _watch(self) -> None:
        """Deliver a webhook whenever a job's state changes (as real providers do)."""
        import aiohttp

        seen: dict[str, str] = {}
        held: list[tuple[str, int, bytes]] = []
        async with aiohttp.ClientSession() as session:
            while True:
                await asyncio.sleep(0.02)
                with self._lock:
                    changes = []
                    for job in self.jobs.values():
                        state = job.state(time.monotonic())
                        if seen.get(job.id) != state:
                            seen[job.id] = state
                            changes.append((job.id, state))
                for job_id, state in changes:
                    event_id = f"evt_{job_id}_{state}"
                    body = json.dumps({"type": f"job.{state}", "data": {"id": job_id, "status": state}}).encode()
                    deliveries = [(event_id, int(time.time()), body)]
                    if "reorder" in self.webhook_faults and not held:
                        held.append(deliveries.pop())  # the first event is sent after a later one
                    elif held:
                        deliveries += held
                        held.clear()
                    if "duplicate" in self.webhook_faults:
                        deliveries += deliveries
                    for delivery in deliveries:
                        if "delay" in self.webhook_faults:
                            await asyncio.sleep(0.3)
                        await self._deliver(session, *delivery)

    async def _deliver(self, session: Any, event_id: str, timestamp: int, body: bytes) -> None:
        assert self.webhook_url is not None and self.webhook_secret is not None
        secret = self.webhook_secret
        if "wrong_signature" in self.webhook_faults:
            secret = "whsec_" + base64.b64encode(b"not-the-shared-secret-000000").decode()
        headers = signed_headers(secret, event_id, timestamp, body)
        try:
            async with session.post(self.webhook_url, data=body, headers=headers) as resp:
                status = resp.status
        except Exception:
            status = 0
        with self._lock:
            self.webhook_deliveries.append((event_id, status))

    async def stop_async(self) -> None:
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            watcher.cancel()
        await super().stop_async()

    # -- handlers ------------------------------------------------------------------------------

    @web.middleware
    async def _count(self, request: web.Request, handler: Any) -> web.StreamResponse:
        with self._lock:
            self.requests.append((time.time(), request.method, request.path))
            self.traceparents.append((request.method, request.path, request.headers.get("traceparent")))
        guarded = self.require_bearer is not None and not request.path.startswith("/_fake")
        if guarded and request.headers.get("Authorization") != f"Bearer {self.require_bearer}":
            with self._lock:
                self.counts["unauthorized"] += 1
            return web.json_response({"error": "unauthorized"}, status=401)
        if self.latency_s > 0 and not request.path.startswith("/_fake"):
            await asyncio.sleep(self.latency_s)
        response: web.StreamResponse = await handler(request)
        return response

    def _new_job(self, key: str | None, reference: str | None, body: Any) -> FakeJob:
        options: dict[str, Any] = {}
        if isinstance(body, dict) and isinstance(body.get("fake"), dict):
            options = body["fake"]
        job = FakeJob(
            id=f"job_{next(self._ids):05d}",
            key=key,
            reference=reference,
            body=body,
            created=time.monotonic(),
            duration_s=float(options.get("duration", self.job_duration_s)),
            fail=isinstance(body, dict) and body.get("fail") is True,
        )
        self.jobs[job.id] = job
        self.counts["jobs_created"] += 1
        return job

    def _job_doc(self, job: FakeJob) -> dict[str, Any]:
        now = time.monotonic()
        state = job.state(now)
        doc: dict[str, Any] = {
            "id": job.id,
            "status": state,
            "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "progress": job.progress(now),
            "client_reference": job.reference,
            "created_at": round(job.created_at, 3),
        }
        if job.has_result(state):
            doc["result_url"] = f"/v1/jobs/{job.id}/result"
        if state in ("failed", "expired"):  # why, as providers say it: an error object with a message
            said = "the job failed" if state == "failed" else "the job expired before it finished"
            doc["error"] = {"code": f"job_{state}", "message": job.options.get("failure", said)}
        if job.options.get("effects"):
            doc["effects"] = {"items_processed": int(job.progress(now) * 100)}
        return doc

    async def _create(self, request: web.Request) -> web.StreamResponse:  # noqa: PLR0911, PLR0912, PLR0915 - every scripted fault
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return web.json_response({"type": "about:blank", "title": "invalid JSON", "status": 400}, status=400)
        scripted = body.get("fake") if isinstance(body, dict) else None
        unknown = sorted(set(scripted) - {name for name, *_ in FAKE_OPTIONS}) if isinstance(scripted, dict) else []
        if unknown:  # a typo would script nothing, silently
            options = ", ".join(name for name, *_ in FAKE_OPTIONS)
            return _problem(400, f"unknown fake option {unknown[0]!r}; the options are: {options}")
        key_header = request.headers.get("Idempotency-Key")
        key = key_header.strip('"') if key_header else None
        reference = body.get("client_reference") if isinstance(body, dict) else None
        fingerprint = hashlib.sha256(raw).hexdigest()
        with self._lock:
            self.counts["creates_received"] += 1
            self.create_headers.append(dict(request.headers))
            fault = self.faults.pop(0) if self.faults else None
            if key and self.idempotency and (fault is None or fault.kind != "replay_new_id"):
                known = self._keys.get(key)
                if known is not None:
                    if known.fingerprint != fingerprint:
                        self.counts["key_mismatch"] += 1
                        return _problem(422, "Idempotency-Key reused with a different request")
                    if known.in_flight:
                        self.counts["key_in_flight"] += 1
                        return _problem(409, "a request with this Idempotency-Key is in flight")
                    self.counts["replayed"] += 1
                    return web.json_response(known.body, status=known.status, headers={"Idempotent-Replayed": "true"})
            if fault is not None and fault.kind == "reject":
                detail: dict[str, Any] = {"type": "about:blank", "title": "rejected", "status": fault.status}
                headers = {}
                if fault.echo_auth:
                    auth = request.headers.get("Authorization", "")
                    detail["detail"] = f"rejected credential {auth}"
                    detail["received_authorization"] = auth
                    headers["X-Debug-Authorization"] = auth
                    headers["X-Request-Id"] = auth.removeprefix("Bearer ")  # (a request id is put on every span)
                return web.json_response(
                    detail, status=fault.status, headers=headers, content_type="application/problem+json"
                )
            if fault is not None and fault.kind == "http" and not fault.commit:
                return _http_fault(fault)
            drop_now = fault is not None and fault.kind in ("drop", "delay") and not fault.commit
            if fault is not None and fault.kind == "previous_job":
                job = next(reversed(self.jobs.values()))
            elif not drop_now:
                job = self._new_job(key, reference or key, body)
        if drop_now:
            # the request arrived and was not processed: the connection just ends
            assert request.transport is not None
            request.transport.abort()
            raise asyncio.CancelledError
        doc: dict[str, Any]
        with self._lock:
            if fault is not None and fault.kind == "sync":
                job.duration_s = 0
                status, doc = 200, {"id": job.id, "status": "succeeded", "result": job.result()}
            elif fault is not None and fault.kind == "malformed":
                status, doc = 201, {"status": "queued"}
            elif fault is not None and fault.kind == "stored_error":
                status, doc = fault.status, {"type": "about:blank", "title": "internal error", "status": fault.status}
            else:
                status, doc = 201, self._job_doc(job)
            if key and self.idempotency:
                self._keys[key] = _KeyRecord(
                    fingerprint,
                    in_flight=fault is not None and fault.kind == "delay",
                    status=status,
                    body=doc,
                )
        if fault is not None and fault.kind == "drop":
            assert request.transport is not None
            request.transport.abort()
            raise asyncio.CancelledError
        if fault is not None and fault.kind == "http":
            return _http_fault(fault)
        if fault is not None and fault.kind == "delay":
            await asyncio.sleep(fault.delay_s)
            with self._lock:
                if key and key in self._keys:
                    self._keys[key].in_flight = False
        if status >= 400:  # (a stored error names no job)
            return web.json_response(doc, status=status, content_type="application/problem+json")
        return web.json_response(
            doc, status=status, headers={"Location": f"/v1/jobs/{job.id}", "X-Request-Id": f"req_{job.id}"}
        )

    async def _status(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.counts["status"] += 1
            self.status_leases.append(
                (request.match_info["id"], request.headers.get("X-Jobtrail-Lease"), time.monotonic())
            )
            job = self.jobs.get(request.match_info["id"])
            if job is None:
                return _problem(404, "no such job")
            return web.json_response(self._job_doc(job))

    async def _cancel(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.counts["cancels"] += 1
            if self.busy_cancels > 0:
                self.busy_cancels -= 1
                return web.json_response(
                    {"type": "about:blank", "title": "busy", "status": 503},
                    status=503,
                    headers={"Retry-After": self.busy_retry_after},
                    content_type="application/problem+json",
                )
            job = self.jobs.get(request.match_info["id"])
            if job is None:
                return _problem(404, "no such job")
            if job.cancel_requested_at is None:
                job.cancel_requested_at = time.monotonic()
            return web.json_response(self._job_doc(job), status=202)

    async def _result(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.counts["results"] += 1
            job = self.jobs.get(request.match_info["id"])
            state = "" if job is None else job.state(time.monotonic())
            if job is None or not job.has_result(state):
                return _problem(404, "no result")
            job.fetches += 1
            mode = job.options.get("result", "ok")
            if mode == "missing":
                return _problem(404, "the result is gone")
            if mode == "flaky" and job.fetches <= int(job.options.get("flaky", 2)):
                return _problem(503, "result store unavailable")
            if mode == "one_time" and job.fetches > 1:
                return _problem(410, "this result was already downloaded")
            data, content_type = job.result_bytes(state)
            digest = hashlib.sha256(data).hexdigest()
            if mode == "bad_checksum":
                digest = hashlib.sha256(data + b"corrupted").hexdigest()
        return web.Response(body=data, content_type=content_type, headers={"X-Result-SHA256": digest})

    async def _list(self, request: web.Request) -> web.StreamResponse:
        reference = request.query.get("client_reference")
        with self._lock:
            self.counts["lists"] += 1
            self.list_leases.append(request.headers.get("X-Jobtrail-Lease"))
            data = [self._job_doc(j) for j in self.jobs.values() if reference is None or j.reference == reference]
        if "limit" not in request.query:
            return web.json_response({"data": data})
        # paged like OpenAI's lists: ?limit=N&after=<last id of the previous page>
        after = request.query.get("after", "")
        rest = [doc for doc in sorted(data, key=lambda d: d["id"]) if doc["id"] > after]
        page = rest[: int(request.query["limit"])]
        return web.json_response(
            {"data": page, "has_more": len(rest) > len(page), "last_id": page[-1]["id"] if page else None}
        )

    async def _by_client_id(self, request: web.Request) -> web.StreamResponse:
        key = request.match_info["key"]
        with self._lock:
            self.counts["lookups"] += 1
            for job in self.jobs.values():
                if key in (job.key, job.reference):
                    return web.json_response(self._job_doc(job))
        return _problem(404, "no job for this client id")

    async def _counts(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            return web.json_response(dict(self.counts))


def _problem(status: int, title: str) -> web.Response:
    return web.json_response(
        {"type": "about:blank", "title": title, "status": status},
        status=status,
        content_type="application/problem+json",
    )


def _http_fault(fault: Fault) -> web.Response:
    headers = {"Retry-After": fault.retry_after} if fault.retry_after else {}
    return web.json_response(
        {"type": "about:blank", "title": f"fault {fault.status}", "status": fault.status},
        status=fault.status,
        headers=headers,
        content_type="application/problem+json",
    )


def signed_headers(secret: str, event_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """Standard Webhooks headers for ``body``, signed with ``secret`` (a ``whsec_...`` string)."""
    from datetime import UTC, datetime

    from standardwebhooks import Webhook

    signature = Webhook(secret).sign(event_id, datetime.fromtimestamp(timestamp, tz=UTC), body.decode())
    return {
        "webhook-id": event_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature,
        "content-type": "application/json",
    }


def send_webhook(
    url: str, secret: str, event: Any, *, event_id: str, timestamp: int | None = None, body: bytes | None = None
) -> tuple[int, Any]:
    """Deliver one signed event (for tests of a receiver); returns (HTTP status, parsed answer)."""
    import urllib.error
    import urllib.request

    if not url.startswith(("http://", "https://")):
        raise ValueError(f"not an HTTP URL: {url}")
    data = body if body is not None else json.dumps(event).encode()
    stamp = int(time.time()) if timestamp is None else timestamp
    request = urllib.request.Request(  # noqa: S310 - checked to be http(s) above
        url, data=data, method="POST", headers=signed_headers(secret, event_id, stamp, data)
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:  # noqa: S310
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def provider_toml(config: dict[str, Any]) -> str:
    """A provider declaration (a dict, as :meth:`FakeProvider.provider_config` returns) as TOML text."""
    lines = [f"{key} = {json.dumps(value)}" for key, value in config.items() if not isinstance(value, dict)]
    for name, table in config.items():
        if not isinstance(table, dict):
            continue
        lines.append(f"[{name}]")
        for key, value in table.items():
            if isinstance(value, dict):
                inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
                lines.append(f"{key} = {{ {inner} }}")
            else:
                lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"
