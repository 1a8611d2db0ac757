"""A contract fake of Anthropic Message Batches: a real aiohttp server on 127.0.0.1, in a thread.

It speaks the documented wire contract of ``/v1/messages/batches`` (create, retrieve,
list with ``limit``/``after_id``/``before_id`` paging newest first, cancel, results
JSONL) and misbehaves on request. Where the ``anthropic`` SDK is importable, every
answer is built from the SDK's own response types (``MessageBatch``,
``MessageBatchIndividualResponse``, ``ErrorResponse``; ``model_dump(mode="json")``)
and every create body is checked against its request types (``BatchCreateParams``),
so a drift between this fake and the SDK fails loudly.

Every request must carry the key, as ``x-api-key`` (the documented header, which the
adapter sends) or ``Authorization: Bearer`` (what SDK 2.x sends), else 401
``authentication_error``; and ``anthropic-version`` (400 ``invalid_request_error``
otherwise, as the API answers). ``counts`` tells which form each request used.

Usage::

    fake = AnthropicBatchFake(api_key="sk-ant-test").start()
    fake.script(CreateFault.drop())                    # commit the batch, lose the answer
    fake.plan(BatchPlan(outcomes=("succeeded", "errored")))
    ...
    assert fake.counts["batches_created"] == 1
    fake.stop()
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import cache
from typing import Any

from aiohttp import web

from jobtrail.testing._served import ServedInThread

#: the outcome words of one item in a results file
OUTCOMES = ("succeeded", "errored", "canceled", "expired")
#: ``anthropic-version`` values the fake accepts
VERSIONS = ("2023-06-01", "2023-01-01")
_CUSTOM_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
#: how long a cancel stays ``canceling`` before the batch ends
CANCELING_S = 0.05


@dataclass(slots=True, frozen=True)
class CreateFault:
    """What the fake does to one create (or, via :meth:`AnthropicBatchFake.script_status`, one status read)."""

    kind: str
    commit: bool = False
    status: int = 0
    error_type: str = ""
    retry_after: str | None = None

    @classmethod
    def drop(cls, *, commit: bool = True) -> CreateFault:
        """Commit the batch (or not), then close the connection without an answer: a lost create response."""
        return cls("drop", commit=commit)

    @classmethod
    def rate_limited(cls, retry_after: str = "1") -> CreateFault:
        """429 ``rate_limit_error`` with ``retry-after`` (nothing committed)."""
        return cls("http", status=429, error_type="rate_limit_error", retry_after=retry_after)

    @classmethod
    def overloaded(cls, *, commit: bool = False) -> CreateFault:
        """529 ``overloaded_error`` (nothing committed, unless ``commit``)."""
        return cls("http", commit=commit, status=529, error_type="overloaded_error")

    @classmethod
    def http(cls, status: int, error_type: str = "api_error", *, commit: bool = False) -> CreateFault:
        """Any status with Anthropic's error body, optionally after committing the batch."""
        return cls("http", commit=commit, status=status, error_type=error_type)


@dataclass(slots=True, frozen=True)
class BatchPlan:
    """How the next created batch behaves.

    ``outcomes`` are the items' outcomes in request order, cycled over the items:
    ``succeeded``, ``errored``, ``canceled`` (the batch was canceled by someone else,
    e.g. in the console) or ``expired`` (it ran past its 24 hours). A cancel sent
    before the batch ends keeps the first ``done_before_cancel`` share of the items
    as planned and cancels the rest.
    """

    outcomes: tuple[str, ...] = ("succeeded",)
    duration_s: float | None = None
    done_before_cancel: float = 0.5
    # -- lies, for testing a client against a provider that misbehaves --
    #: an ended batch's first this-many status reads show ``results_url: null`` (set later)
    results_url_hidden_reads: int = 0
    #: lines left out of the end of the results file (a file cut short at a line boundary)
    lines_lost: int = 0

    def __post_init__(self) -> None:
        if not self.outcomes or any(o not in OUTCOMES for o in self.outcomes):
            raise ValueError(f"outcomes must be a non-empty tuple of {', '.join(OUTCOMES)}")


@dataclass(slots=True)
class FakeBatch:
    """One batch, on the fake's monotonic clock."""

    id: str
    requests: list[dict[str, Any]]
    created_wall: float
    started: float
    duration_s: float
    plan: BatchPlan
    cancel_at: float | None = None
    results_read: int = 0
    #: status reads made once it had ended (see BatchPlan.results_url_hidden_reads)
    ended_reads: int = 0

    def _wall(self, mono: float) -> datetime:
        return datetime.fromtimestamp(self.created_wall + (mono - self.started), tz=UTC)

    def ends_at(self) -> float:
        finish = self.started + self.duration_s
        if self.cancel_at is not None and self.cancel_at < finish:
            return self.cancel_at + CANCELING_S
        return finish

    def status(self, now: float) -> str:
        if now >= self.ends_at():
            return "ended"
        return "canceling" if self.cancel_at is not None else "in_progress"

    def outcomes(self) -> list[str]:
        """Each item's final outcome (request order)."""
        planned = [self.plan.outcomes[n % len(self.plan.outcomes)] for n in range(len(self.requests))]
        if self.cancel_at is not None and self.cancel_at < self.started + self.duration_s:
            kept = int(len(planned) * self.plan.done_before_cancel)
            planned = planned[:kept] + ["canceled"] * (len(planned) - kept)
        return planned

    def document(self, now: float, base_url: str) -> dict[str, Any]:
        ended = self.status(now) == "ended"
        counts = dict.fromkeys(("processing", "succeeded", "errored", "canceled", "expired"), 0)
        if ended:
            for outcome in self.outcomes():
                counts[outcome] += 1
        else:
            counts["processing"] = len(self.requests)
        cancel_initiated = None
        if self.cancel_at is not None:
            cancel_initiated = self._wall(self.cancel_at)
        elif ended and "canceled" in self.outcomes():  # canceled by someone else, just before it ended
            cancel_initiated = self._wall(self.ends_at() - CANCELING_S)
        created = datetime.fromtimestamp(self.created_wall, tz=UTC)
        doc = {
            "id": self.id,
            "type": "message_batch",
            "processing_status": self.status(now),
            "request_counts": counts,
            "created_at": _iso(created),
            "expires_at": _iso(created + timedelta(hours=24)),
            "ended_at": _iso(self._wall(self.ends_at())) if ended else None,
            "cancel_initiated_at": None if cancel_initiated is None else _iso(cancel_initiated),
            "archived_at": None,
            "results_url": f"{base_url}/v1/messages/batches/{self.id}/results" if ended else None,
        }
        if ended and self.ended_reads <= self.plan.results_url_hidden_reads:
            doc["results_url"] = None
        return _sdk_dump("MessageBatch", doc)

    def results(self) -> bytes:
        lines = []
        for n, (request, outcome) in reversed(list(enumerate(zip(self.requests, self.outcomes(), strict=True)))):
            result: dict[str, Any] = {"type": outcome}
            if outcome == "succeeded":
                params = request.get("params") or {}
                result["message"] = {
                    "id": f"msg_{self.id[-8:]}_{n:05d}",
                    "type": "message",
                    "role": "assistant",
                    "model": str(params.get("model", "claude-fake")),
                    "content": [{"type": "text", "text": f"answer to {request['custom_id']}"}],
                    "stop_reason": "end_turn",
                    "stop_sequence": None,
                    "usage": {"input_tokens": 10, "output_tokens": 5},
                }
            elif outcome == "errored":
                result["error"] = _error_doc("invalid_request_error", f"item {request['custom_id']} refused", None)
            item = {"custom_id": request["custom_id"], "result": result}
            lines.append(json.dumps(_sdk_dump("MessageBatchIndividualResponse", item), separators=(",", ":")))
        if self.plan.lines_lost:
            lines = lines[: max(0, len(lines) - self.plan.lines_lost)]
        return ("\n".join(lines) + "\n").encode()


@dataclass
class AnthropicBatchFake(ServedInThread):
    """The fake. ``start()`` runs it in a thread (free port on 127.0.0.1); ``stop()`` ends it."""

    api_key: str = "sk-ant-fake-key"
    host: str = "127.0.0.1"
    port: int = 0
    batch_duration_s: float = 0.5
    #: at most this many batches per list page, whatever ``limit`` asks (None: ``limit`` decides)
    page_size: int | None = None
    counts: Counter[str] = field(default_factory=Counter)
    batches: dict[str, FakeBatch] = field(default_factory=dict)
    #: headers of every create received, in order
    create_headers: list[dict[str, str]] = field(default_factory=list)
    #: (monotonic time, method, path, HTTP status answered) of every request, in order
    requests: list[tuple[float, str, str, int]] = field(default_factory=list)
    #: a lie: every list page says has_more and hands out the same last_id, whatever ``after_id`` asks for
    list_repeats: bool = False

    def __post_init__(self) -> None:
        self._ids = itertools.count(1)
        self._requests = itertools.count(1)
        self._lock = threading.Lock()
        self._faults: list[CreateFault] = []
        self._status_faults: list[CreateFault] = []
        self._list_faults: list[CreateFault] = []
        self._plans: list[BatchPlan] = []
        self.default_plan = BatchPlan()
        self.base_url = ""

    # -- control -----------------------------------------------------------------------

    def script(self, *faults: CreateFault) -> None:
        """Faults for the next creates, one each, in order."""
        with self._lock:
            self._faults.extend(faults)

    def script_status(self, *faults: CreateFault) -> None:
        """Faults (``http`` kinds) for the next status reads, one each, in order."""
        with self._lock:
            self._status_faults.extend(faults)

    def script_list(self, *faults: CreateFault) -> None:
        """Faults (``http`` kinds) for the next list reads, one each, in order."""
        with self._lock:
            self._list_faults.extend(faults)

    def plan(self, *plans: BatchPlan) -> None:
        """Plans for the next created batches, one each, in order (then :attr:`default_plan`)."""
        with self._lock:
            self._plans.extend(plans)

    def add_batch(self, n_requests: int, *, age_s: float = 0.0, plan: BatchPlan | None = None) -> str:
        """A batch someone else created ``age_s`` seconds ago (for listings); returns its id."""
        requests = [{"custom_id": f"other-{i}", "params": {}} for i in range(n_requests)]
        with self._lock:
            batch = self._new_batch(requests, plan or self.default_plan, age_s=age_s)
            self.counts["batches_created"] -= 1  # counts what creates made; these are someone else's
            self.counts["batches_added"] += 1
            return batch.id

    def provider_config(self, **overrides: Any) -> dict[str, Any]:
        """An ``anthropic-batch`` provider file (as a dict) for this fake; ``credential`` must be given."""
        config: dict[str, Any] = {
            "kind": "anthropic-batch",
            "name": "anthropic",
            "base_url": self.base_url,
            "timeout_s": 5.0,  # its SDK-typed checks are slow on a loaded machine
            "connect_timeout_s": 1.0,
            "poll": {"initial_s": 0.1, "factor": 1.5, "cap_s": 0.3},
            "retry": {"initial_s": 0.05, "factor": 2, "cap_s": 0.2},
        }
        for key, value in overrides.items():
            if value is None:
                config.pop(key, None)
            else:
                config[key] = value
        return config

    # -- life cycle ------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        app.router.add_post("/v1/messages/batches", self._create)
        app.router.add_get("/v1/messages/batches", self._list)
        app.router.add_get("/v1/messages/batches/{id}", self._retrieve)
        app.router.add_post("/v1/messages/batches/{id}/cancel", self._cancel)
        app.router.add_get("/v1/messages/batches/{id}/results", self._results)
        return app

    async def start_async(self) -> str:
        # the SDK's types are imported and compiled now, not inside the first request's time-out
        for warm in (_create_params_adapter, _sdk_types, _versions):
            warm()
        self.base_url, self.port = await self.serve(self._app(), self.host, self.port)
        return self.base_url

    # -- handlers ------------------------------------------------------------------------------

    def _error(self, status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
        request_id = f"req_fake_{next(self._requests):06d}"
        return web.json_response(
            _error_doc(error_type, message, request_id),
            status=status,
            headers={"request-id": request_id, **(headers or {})},
        )

    def _ok(self, doc: Any) -> web.Response:
        return web.json_response(doc, headers={"request-id": f"req_fake_{next(self._requests):06d}"})

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        response = await self._checked(request, handler)
        with self._lock:
            self.requests.append((time.monotonic(), request.method, request.path, response.status))
        return response

    async def _checked(self, request: web.Request, handler: Any) -> web.StreamResponse:
        by_header = request.headers.get("x-api-key") == self.api_key
        by_bearer = request.headers.get("Authorization") == f"Bearer {self.api_key}"
        if not (by_header or by_bearer):
            with self._lock:
                self.counts["unauthorized"] += 1
            return self._error(401, "authentication_error", "invalid x-api-key")
        with self._lock:
            self.counts["auth_x_api_key" if by_header else "auth_bearer"] += 1
        version = request.headers.get("anthropic-version")
        if version is None:
            with self._lock:
                self.counts["bad_version"] += 1
            return self._error(400, "invalid_request_error", "anthropic-version: header is required")
        if version not in _versions():
            with self._lock:
                self.counts["bad_version"] += 1
            return self._error(400, "invalid_request_error", f"anthropic-version: unknown version {version!r}")
        response: web.StreamResponse = await handler(request)
        return response

    def _new_batch(self, requests: list[dict[str, Any]], plan: BatchPlan, *, age_s: float = 0.0) -> FakeBatch:
        now = time.monotonic()
        batch = FakeBatch(
            id=f"msgbatch_fake{next(self._ids):012d}",
            requests=requests,
            created_wall=time.time() - age_s,
            started=now - age_s,
            duration_s=self.batch_duration_s if plan.duration_s is None else plan.duration_s,
            plan=plan,
        )
        self.batches[batch.id] = batch
        self.counts["batches_created"] += 1
        return batch

    async def _create(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        with self._lock:
            self.counts["creates_received"] += 1
            self.create_headers.append(dict(request.headers))
            fault = self._faults.pop(0) if self._faults else None
        try:
            body = json.loads(raw)
        except ValueError:
            return self._error(400, "invalid_request_error", "the request body is not valid JSON")
        problem = check_create(body)
        if problem is not None:
            with self._lock:
                self.counts["bad_request"] += 1
            return self._error(400, "invalid_request_error", problem)
        batch = None
        with self._lock:
            if fault is None or fault.commit:
                plan = self._plans.pop(0) if self._plans else self.default_plan
                batch = self._new_batch(list(body["requests"]), plan)
                doc = batch.document(time.monotonic(), self.base_url)
        if fault is not None and fault.kind == "drop":
            assert request.transport is not None
            request.transport.abort()  # the batch (if committed) exists; its answer is lost
            raise asyncio.CancelledError
        if fault is not None:
            headers = {"retry-after": fault.retry_after} if fault.retry_after else {}
            message = {429: "rate limit exceeded", 529: "Overloaded"}.get(fault.status, "internal error")
            return self._error(fault.status, fault.error_type, message, headers)
        assert batch is not None
        return self._ok(doc)

    async def _retrieve(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.counts["status"] += 1
            fault = self._status_faults.pop(0) if self._status_faults else None
            batch = self.batches.get(request.match_info["id"])
            if batch is not None and batch.status(time.monotonic()) == "ended":
                batch.ended_reads += 1
            doc = None if batch is None else batch.document(time.monotonic(), self.base_url)
        if fault is not None:
            headers = {"retry-after": fault.retry_after} if fault.retry_after else {}
            return self._error(fault.status, fault.error_type, f"fault {fault.status}", headers)
        if doc is None:
            return self._error(404, "not_found_error", "no such message batch")
        return self._ok(doc)

    async def _cancel(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.counts["cancels"] += 1
            batch = self.batches.get(request.match_info["id"])
            if batch is None:
                return self._error(404, "not_found_error", "no such message batch")
            now = time.monotonic()
            if batch.cancel_at is None and batch.status(now) == "in_progress":
                batch.cancel_at = now
            doc = batch.document(now, self.base_url)
        return self._ok(doc)

    async def _results(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.counts["results"] += 1
            batch = self.batches.get(request.match_info["id"])
            if batch is None:
                return self._error(404, "not_found_error", "no such message batch")
            if batch.status(time.monotonic()) != "ended":
                return self._error(400, "invalid_request_error", "results are available once the batch has ended")
            batch.results_read += 1
            data = batch.results()
        return web.Response(
            body=data,
            content_type="application/x-jsonl",
            headers={"request-id": f"req_fake_{next(self._requests):06d}"},
        )

    async def _list(self, request: web.Request) -> web.StreamResponse:
        query = request.query
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 1000:
            return self._error(400, "invalid_request_error", "limit: must be between 1 and 1000")
        with self._lock:
            self.counts["lists"] += 1
            fault = self._list_faults.pop(0) if self._list_faults else None
        if fault is not None:
            headers = {"retry-after": fault.retry_after} if fault.retry_after else {}
            return self._error(fault.status, fault.error_type, f"fault {fault.status}", headers)
        with self._lock:
            now = time.monotonic()
            ordered = sorted(self.batches.values(), key=lambda b: (b.created_wall, b.id), reverse=True)
            ids = [b.id for b in ordered]
            after, before = query.get("after_id"), query.get("before_id")
            if self.list_repeats:
                after = before = None
            for cursor in (after, before):
                if cursor is not None and cursor not in ids:
                    return self._error(404, "not_found_error", f"no such message batch {cursor}")
            if after is not None:
                window = ordered[ids.index(after) + 1 :]
                page = window[: min(limit, self.page_size or limit)]
                has_more = len(window) > len(page)
            elif before is not None:
                window = ordered[: ids.index(before)]
                page = window[-min(limit, self.page_size or limit) :] if window else []
                has_more = len(window) > len(page)
            else:
                page = ordered[: min(limit, self.page_size or limit)]
                has_more = len(ordered) > len(page)
            data = [b.document(now, self.base_url) for b in page]
        return self._ok(
            {
                "data": data,
                "has_more": has_more or self.list_repeats,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
            }
        )


def check_create(body: Any) -> str | None:
    """Why a create body is refused (None: it is valid), checked by the SDK's request types when present."""
    if not isinstance(body, dict) or not isinstance(body.get("requests"), list):
        return "requests: Field required (a list of {custom_id, params})"
    requests = body["requests"]
    if not 1 <= len(requests) <= 100_000:
        return "requests: between 1 and 100,000 requests"
    seen: set[str] = set()
    for n, item in enumerate(requests):
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        if not isinstance(custom_id, str) or not _CUSTOM_ID.match(custom_id):
            return f"requests.{n}.custom_id: 1 to 64 letters, digits, '-' or '_'"
        if custom_id in seen:
            return f"requests.{n}.custom_id: {custom_id!r} is not unique within the batch"
        seen.add(custom_id)
    adapter = _create_params_adapter()
    if adapter is not None:
        from pydantic import ValidationError

        try:
            _force(adapter.validate_python(body))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return f"{where}: {first['msg']}"
    elif not all(isinstance(r.get("params"), dict) for r in requests):
        return "requests.params: Field required"
    return None


@cache
def _create_params_adapter() -> Any:
    try:
        from anthropic.types.messages.batch_create_params import BatchCreateParams
        from pydantic import TypeAdapter
    except ImportError:
        return None
    return TypeAdapter(BatchCreateParams)


def _force(value: Any) -> Any:
    """Walk a validated value: pydantic validates ``Iterable`` fields lazily, item by item as they are read."""
    if isinstance(value, dict):
        return {k: _force(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_force(v) for v in value]
    if hasattr(value, "__next__"):
        return [_force(v) for v in value]
    return value


@cache
def _versions() -> tuple[str, ...]:
    try:
        from anthropic._constants import ANTHROPIC_API_VERSION
    except ImportError:
        return VERSIONS
    return (*VERSIONS, ANTHROPIC_API_VERSION)


@cache
def _sdk_types() -> dict[str, Any] | None:
    try:
        from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse
        from anthropic.types.shared import ErrorResponse
    except ImportError:
        return None
    return {
        "MessageBatch": MessageBatch,
        "MessageBatchIndividualResponse": MessageBatchIndividualResponse,
        "ErrorResponse": ErrorResponse,
    }


def _sdk_dump(name: str, doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` through the SDK's own type (validated, then dumped as JSON), or as is without the SDK."""
    types = _sdk_types()
    if types is None:
        return doc
    dumped: dict[str, Any] = types[name].model_validate(doc).model_dump(mode="json")
    return dumped


def _error_doc(error_type: str, message: str, request_id: str | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"type": "error", "error": {"type": error_type, "message": message}}
    if request_id is not None:
        doc["request_id"] = request_id
    return _sdk_dump("ErrorResponse", doc)


def _iso(when: datetime) -> str:
    return when.isoformat().replace("+00:00", "Z")


__all__ = ["OUTCOMES", "AnthropicBatchFake", "BatchPlan", "CreateFault", "FakeBatch", "check_create"]
