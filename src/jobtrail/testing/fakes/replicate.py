"""A contract fake of Replicate's predictions API, and of replicate.delivery, on loopback.

Two aiohttp servers in one background thread: the API (``base_url``) and a file "delivery"
server on another port, i.e. another origin, like ``replicate.delivery``. Shapes follow the
documented wire contract: predictions ``{id, model, version, input, output, data_removed, error, logs,
status, created_at, started_at, completed_at, urls}``, problem bodies ``{"title", "detail", "status"}``,
``Prefer: wait=N`` honoured on the create, cursor pages ``{next, previous, results}``. The create's
``version`` may be ``{owner}/{model}:{version_id}``, a bare version id or ``{owner}/{model}``; the
prediction carries the bare version id in ``version`` and the model in ``model``, as Replicate's do.

A prediction's ``input`` may script it: ``fake_output`` = ``"tokens"`` (a JSON list of strings,
the default), ``"json_file"`` (one URL of a JSON file), ``"png"`` (one URL of PNG bytes),
``"pngs"`` (a list of two PNG URLs), ``"png_echoing_token"`` (one URL that carries the API token, as a
hostile model's output could), ``"missing"`` (a lying answer: the succeeded prediction has no
``output`` field at all); ``fake_fail`` = true (ends ``failed``); ``fake_abort`` = true
(stays ``starting`` and ends ``aborted``: its deadline passed before it started); ``fake_duration``
(seconds). ``data_retention_s`` removes a finished prediction's input, output, logs and files that
many seconds after it ends (``data_removed`` true, ``output`` null), as Replicate does about an hour
after an API prediction ends. Create faults are :class:`jobtrail.testing.Fault` values (``drop``,
``http``), one per create, in order.

It counts what it saw (``counts``: creates_received, jobs_created, gets, lists, cancels, downloads,
unauthorized), the ``Prefer`` header of every request (``prefer_seen``) and the Authorization
header of every download (``delivery_auth``: it must stay empty).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from jobtrail.testing._fake_provider import Fault
from jobtrail.testing._served import ServedInThread

#: a valid 1x1 PNG, then padding that is not UTF-8 (a JSON parse of it must fail)
PNG_BYTES = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d49444154789c6360f8cfc0f01f0005000201a5e0e3d80000000049454e44ae426082"
) + bytes(range(256))
JSON_FILE = b'{"caption": "a fake caption", "score": 0.5}\n'


#: the model a bare version id belongs to
FAKE_MODEL = "fake-owner/fake-model"
#: the statuses a prediction ends in
FINISHED = ("succeeded", "failed", "canceled", "aborted")


@dataclass(slots=True)
class Prediction:
    id: str
    model: str
    version: str
    input: dict[str, Any]
    created: float
    created_at: str
    duration_s: float
    cancelled_at: float | None = None

    def status(self, now: float) -> str:
        finish = self.created + self.duration_s
        if self.cancelled_at is not None and self.cancelled_at < finish:
            return "canceled"
        aborting = bool(self.input.get("fake_abort"))
        if now >= finish:
            if aborting:
                return "aborted"
            return "failed" if self.input.get("fake_fail") else "succeeded"
        if aborting:  # never picked up before its deadline
            return "starting"
        return "starting" if now - self.created < self.duration_s * 0.1 else "processing"

    def ended(self) -> float:
        """When it ended (or will): its cancel, or the end of its run."""
        finish = self.created + self.duration_s
        return self.cancelled_at if self.cancelled_at is not None and self.cancelled_at < finish else finish


def _model_and_version(requested: str) -> tuple[str, str]:
    """The prediction's ``model`` and bare ``version`` for the create's ``version`` field."""
    model, colon, version_id = requested.rpartition(":")
    if colon:
        return model, version_id
    if "/" in requested:  # a model: its latest version
        return requested, hashlib.sha256(requested.encode()).hexdigest()
    return FAKE_MODEL, requested


def _stamp(at: float) -> str:
    # Replicate writes nanosecond fractions
    whole = datetime.fromtimestamp(at, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{whole}.{int((at % 1) * 1e9):09d}Z"


@dataclass
class ReplicateFake(ServedInThread):
    """``start()`` serves both origins from a thread; ``stop()`` ends it."""

    host: str = "127.0.0.1"
    prediction_s: float = 1.0
    #: the API token every API request must carry as ``Authorization: Bearer``
    token: str = "r8_fake_token_0123456789"  # noqa: S105 - a test value
    #: predictions per list page (small, so paging is exercised)
    page_size: int = 2
    #: added to the wall clock in ``created_at`` (back-date predictions to test time windows)
    clock_offset_s: float = 0.0
    #: seconds after a prediction ends before its data is removed (None: kept; Replicate: about 3600)
    data_retention_s: float | None = None
    counts: Counter[str] = field(default_factory=Counter)
    faults: list[Fault] = field(default_factory=list)
    predictions: dict[str, Prediction] = field(default_factory=dict)
    #: (method, path, Prefer header or None) of every API request
    prefer_seen: list[tuple[str, str, str | None]] = field(default_factory=list)
    #: monotonic time of every create received
    create_times: list[float] = field(default_factory=list)
    #: the Authorization header (None when absent) of every delivery request
    delivery_auth: list[str | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.base_url = ""
        self.delivery_url = ""

    # -- control ------------------------------------------------------------------------------

    def script(self, *faults: Fault) -> None:
        """Faults for the next creates, one each, in order (``Fault.drop()``, ``Fault.http(429, ...)``)."""
        with self._lock:
            self.faults.extend(faults)

    def provider_config(self, **overrides: Any) -> dict[str, Any]:
        """An operator's ``kind = "replicate"`` file for this fake (the delivery origin declared)."""
        config: dict[str, Any] = {
            "kind": "replicate",
            "name": "replicate",
            "base_url": self.base_url,
            "timeout_s": 5.0,
            "connect_timeout_s": 1.0,
            "wait_s": 1,
            "download_hosts": [self.delivery_url],
            "retry": {"initial_s": 0.05, "factor": 2, "cap_s": 0.5},
            "poll": {"initial_s": 0.1, "factor": 1.5, "cap_s": 0.5},
        }
        config.update(overrides)
        return {k: v for k, v in config.items() if v is not None}

    # -- life cycle -----------------------------------------------------------------------------

    def _api(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        app.router.add_post("/v1/predictions", self._create)
        app.router.add_get("/v1/predictions", self._list)
        app.router.add_get("/v1/predictions/{id}", self._get)
        app.router.add_post("/v1/predictions/{id}/cancel", self._cancel)
        return app

    def _delivery(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/pbxt/{id}/{file}", self._download)
        return app

    async def start_async(self) -> str:
        self.base_url, _ = await self.serve(self._api(), self.host)
        self.delivery_url, _ = await self.serve(self._delivery(), self.host)
        return self.base_url

    # -- the API ----------------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        with self._lock:
            self.prefer_seen.append((request.method, request.path, request.headers.get("Prefer")))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            with self._lock:
                self.counts["unauthorized"] += 1
            return _problem(401, "Unauthenticated", "You did not pass a valid authentication token")
        response: web.StreamResponse = await handler(request)
        return response

    def _removed(self, p: Prediction, now: float) -> bool:
        """Has the data retention removed this prediction's data?"""
        retention = self.data_retention_s
        return retention is not None and p.status(now) in FINISHED and now >= p.ended() + retention

    def _doc(self, p: Prediction) -> dict[str, Any]:
        now = time.monotonic()
        status = p.status(now)
        finished = status in FINISHED
        removed = self._removed(p, now)
        doc: dict[str, Any] = {
            "id": p.id,
            "model": p.model,
            "version": p.version,
            "input": {} if removed else p.input,
            "logs": None if removed else "",
            "output": None,
            "data_removed": removed,
            "error": "the model raised an error (fake)" if status == "failed" else None,
            "status": status,
            "created_at": p.created_at,
            "started_at": p.created_at if status not in ("starting", "aborted") else None,
            "completed_at": _stamp(time.time()) if finished else None,
            "urls": {
                "get": f"{self.base_url}/v1/predictions/{p.id}",
                "cancel": f"{self.base_url}/v1/predictions/{p.id}/cancel",
            },
            "metrics": {"predict_time": round(min(now - p.created, p.duration_s), 3)}
            if finished and status != "aborted"
            else {},
        }
        if status == "succeeded" and not removed:
            doc["output"] = self._output(p)
            if p.input.get("fake_output") == "missing":
                del doc["output"]
        return doc

    def _output(self, p: Prediction) -> Any:
        kind = p.input.get("fake_output", "tokens")
        files = f"{self.delivery_url}/pbxt/{p.id}"
        if kind == "json_file":
            return f"{files}/out-0.json"
        if kind == "png":
            return f"{files}/out-0.png"
        if kind == "pngs":
            return [f"{files}/out-0.png", f"{files}/out-1.png"]
        if kind == "png_echoing_token":
            return f"{files}/{self.token}.png"
        return ["Hello", ", ", "world"]

    async def _create(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError:
            return _problem(400, "Bad Request", "the request body is not JSON")
        with self._lock:
            self.counts["creates_received"] += 1
            self.create_times.append(time.monotonic())
            fault = self.faults.pop(0) if self.faults else None
        if not isinstance(body, dict) or not isinstance(body.get("version"), str):
            return _problem(422, "Invalid version or not permitted", "version is required")
        if not isinstance(body.get("input"), dict):
            return _problem(422, "Input validation failed", "input: Invalid type. Expected: object")
        if fault is not None and fault.kind == "http" and not fault.commit:
            return _fault(fault)
        if fault is not None and fault.kind == "drop" and not fault.commit:
            assert request.transport is not None
            request.transport.abort()
            raise asyncio.CancelledError
        now = time.monotonic()
        with self._lock:
            pid = f"fk{next(self._ids):04d}" + hashlib.sha256(str(now).encode()).hexdigest()[:20]
            model, version = _model_and_version(body["version"])
            prediction = Prediction(
                id=pid,
                model=model,
                version=version,
                input=body["input"],
                created=now,
                created_at=_stamp(time.time() + self.clock_offset_s),
                duration_s=float(body["input"].get("fake_duration", self.prediction_s)),
            )
            self.predictions[pid] = prediction
            self.counts["jobs_created"] += 1
        if fault is not None and fault.kind == "drop":  # committed; the answer is lost
            assert request.transport is not None
            request.transport.abort()
            raise asyncio.CancelledError
        if fault is not None and fault.kind == "http":
            return _fault(fault)
        wait = _prefer_wait(request.headers.get("Prefer"))
        if wait:
            # Prefer: wait=N holds the answer until the prediction finishes, at most N seconds
            until = now + wait
            while time.monotonic() < until and prediction.status(time.monotonic()) not in FINISHED:
                await asyncio.sleep(0.02)
        with self._lock:
            doc = self._doc(prediction)
        return web.json_response(doc, status=201, headers={"X-Request-Id": f"req_{pid}"})

    async def _get(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.counts["gets"] += 1
            p = self.predictions.get(request.match_info["id"])
            if p is None:
                return _problem(404, "Not found", "Not found.")
            return web.json_response(self._doc(p))

    async def _cancel(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.counts["cancels"] += 1
            p = self.predictions.get(request.match_info["id"])
            if p is None:
                return _problem(404, "Not found", "Not found.")
            if p.cancelled_at is None:
                p.cancelled_at = time.monotonic()
            return web.json_response(self._doc(p))

    async def _list(self, request: web.Request) -> web.StreamResponse:
        start = int(request.query.get("cursor", "0"))
        with self._lock:
            self.counts["lists"] += 1
            newest_first = sorted(self.predictions.values(), key=lambda p: p.created_at, reverse=True)
            page = newest_first[start : start + self.page_size]
            more = start + self.page_size < len(newest_first)
            results = [self._doc(p) for p in page]
        return web.json_response(
            {
                "next": f"{self.base_url}/v1/predictions?cursor={start + self.page_size}" if more else None,
                "previous": f"{self.base_url}/v1/predictions?cursor={max(0, start - self.page_size)}"
                if start
                else None,
                "results": results,
            }
        )

    # -- replicate.delivery --------------------------------------------------------------------------

    async def _download(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.counts["downloads"] += 1
            self.delivery_auth.append(request.headers.get("Authorization"))
            p = self.predictions.get(request.match_info["id"])
        name = request.match_info["file"]
        now = time.monotonic()
        if p is None or p.status(now) != "succeeded" or self._removed(p, now):
            return web.Response(status=404, text="Not Found")
        if name.endswith(".json"):
            return web.Response(body=JSON_FILE, content_type="application/json")
        return web.Response(body=PNG_BYTES + name.encode(), content_type="image/png")


def _prefer_wait(header: str | None) -> float:
    if not header:
        return 0.0
    for part in header.split(","):
        key, _, value = part.strip().partition("=")
        if key.strip().lower() == "wait":
            try:
                return min(60.0, float(value)) if value else 60.0
            except ValueError:
                return 0.0
    return 0.0


def _problem(status: int, title: str, detail: str) -> web.Response:
    return web.json_response(
        {"title": title, "detail": detail, "status": status}, status=status, content_type="application/problem+json"
    )


def _fault(fault: Fault) -> web.Response:
    headers = {"Retry-After": fault.retry_after} if fault.retry_after else {}
    title = "Too Many Requests" if fault.status == 429 else "Internal Server Error"
    detail = "Request was throttled." if fault.status == 429 else "an internal error (fake)"
    return web.json_response(
        {"title": title, "detail": detail, "status": fault.status},
        status=fault.status,
        headers=headers,
        content_type="application/problem+json",
    )
