"""A contract fake of the OpenAI Batch API: a real aiohttp server on 127.0.0.1.

It answers with the documented wire shapes; where the ``openai`` package is importable
(the test extra), every batch and file object goes through the SDK's own pydantic types
(``openai.types.Batch``, ``openai.types.FileObject``) and every create request is checked
against ``openai.types.batch_create_params.BatchCreateParams``, so a drift between the SDK
and this fake, or between the SDK and our adapter's requests, fails loudly (``counts["shape_errors"]``).

What a batch does is scripted by its input file (:meth:`OpenAIBatchFake.add_input_file` with a
:class:`BatchPlan`): how long it runs, how it ends (completed, failed, expired, cancelled), how many
items fail, how far it got before an expiry or cancel. Faults are queued per route
(:meth:`OpenAIBatchFake.script`): drop the connection after committing the batch, 429 with
``retry-after-ms``, 500. Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

It imports nothing of jobtrail: users can run it against their own code.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from jobtrail.testing._served import ServedInThread

#: what an upload's purpose may be (``openai.types.FilePurpose``)
_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
#: the routes faults can be scripted for
ROUTES = ("create", "list", "retrieve", "cancel", "content", "upload", "files")


@dataclass(slots=True)
class Fault:
    """What the fake does to one request of a route, instead of answering normally."""

    status: int = 0
    #: create: commit the batch before misbehaving (the lost-response case)
    commit: bool = False
    #: close the connection without answering
    drop: bool = False
    retry_after: str | None = None
    retry_after_ms: str | None = None

    @classmethod
    def lost_response(cls) -> Fault:
        """Commit the batch, then close the connection without answering."""
        return cls(drop=True, commit=True)

    @classmethod
    def rate_limited(cls, *, retry_after_ms: int = 200, retry_after: int = 1) -> Fault:
        """429 with ``retry-after-ms`` and ``retry-after`` (nothing committed)."""
        return cls(429, retry_after=str(retry_after), retry_after_ms=str(retry_after_ms))

    @classmethod
    def server_error(cls, *, commit: bool = False) -> Fault:
        """500 (optionally after committing the batch)."""
        return cls(500, commit=commit)


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """How a batch made from one input file behaves."""

    #: "completed", "failed" (validation), "expired", or "cancelled" (by someone else, at the end)
    ending: str = "completed"
    duration_s: float = 1.0
    #: items whose request fails (HTTP 400 in the error file)
    failed_items: int = 0
    #: for "expired"/"cancelled" endings: the share of items finished before the end
    done_share: float = 0.5
    #: "normal": a cancel leaves the batch cancelling for ``cancel_s``, then cancelled with partial output;
    #: "finish_first": the cancel is acknowledged but the batch completes anyway
    cancel: str = "normal"
    cancel_s: float = 0.2
    # -- lies, for testing a client against a provider that misbehaves --
    #: an ended batch's first this-many status reads show no output_file_id / error_file_id (set later)
    files_hidden_reads: int = 0
    #: a ``completed_at`` to report instead of the real one (e.g. ``10**20``, past any calendar)
    completed_at: int | None = None
    #: lines left out of the end of the output file (a file cut short at a line boundary)
    lines_lost: int = 0


@dataclass(slots=True)
class FakeFile:
    id: str
    purpose: str
    filename: str
    content: bytes
    created_at: int


@dataclass(slots=True)
class FakeBatch:
    id: str
    seq: int
    body: dict[str, Any]
    plan: BatchPlan
    items: list[str]
    started: float
    created_at: int
    cancel_requested_at: float | None = None
    foreign: bool = False
    #: status reads made once it had ended (see BatchPlan.files_hidden_reads)
    ended_reads: int = 0

    @property
    def end(self) -> float:
        return self.started + self.plan.duration_s

    def status(self, now: float) -> str:
        plan = self.plan
        if self.cancel_requested_at is not None and self.cancel_requested_at < self.end:
            if plan.cancel == "finish_first":
                return "completed" if now >= self.end else "cancelling"
            return "cancelled" if now - self.cancel_requested_at >= plan.cancel_s else "cancelling"
        elapsed = now - self.started
        if plan.ending == "failed":
            return "failed" if elapsed >= plan.duration_s else "validating"
        if elapsed >= plan.duration_s:
            return plan.ending
        if elapsed < 0.1 * plan.duration_s:
            return "validating"
        return "finalizing" if elapsed >= 0.8 * plan.duration_s else "in_progress"

    def finished_items(self, now: float) -> int:
        """How many items have an answer at ``now`` (frozen at a cancel or expiry)."""
        plan, total = self.plan, len(self.items)
        state = self.status(now)
        if state == "completed":
            return total
        if state == "failed":
            return 0
        if state == "expired" or (state == "cancelled" and self.cancel_requested_at is None):
            return math.floor(total * plan.done_share)
        at = now if self.cancel_requested_at is None else min(now, self.cancel_requested_at)
        work = plan.duration_s * 0.7  # in_progress is 10 % .. 80 % of the duration
        share = (at - self.started - 0.1 * plan.duration_s) / work if work else 1.0
        return max(0, min(total, math.floor(total * share)))

    def failed_ids(self) -> set[str]:
        n = min(self.plan.failed_items, len(self.items))
        return {self.items[i * len(self.items) // n] for i in range(n)} if n else set()


@dataclass
class OpenAIBatchFake(ServedInThread):
    """The fake. ``start()`` serves from a thread; ``stop()`` ends it. ``counts`` says what it saw."""

    host: str = "127.0.0.1"
    port: int = 0
    #: every /v1 request must carry ``Authorization: Bearer <this>`` (None: no check)
    api_key: str | None = "sk-test-fake-openai-key-0000"
    default_plan: BatchPlan = field(default_factory=BatchPlan)
    counts: Counter[str] = field(default_factory=Counter)
    #: the create bodies received, in order (as parsed JSON)
    create_bodies: list[Any] = field(default_factory=list)
    #: why a create request did not match the SDK's request type (should stay empty)
    shape_errors: list[str] = field(default_factory=list)
    #: a lie: every list page says has_more and hands out the same last_id, whatever ``after`` asks for
    list_repeats: bool = False

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count(1)
        self.batches: dict[str, FakeBatch] = {}
        self.files: dict[str, FakeFile] = {}
        self.plans: dict[str, BatchPlan] = {}
        self.faults: dict[str, list[Fault]] = {route: [] for route in ROUTES}
        self.base_url = ""

    # -- control ----------------------------------------------------------------------------

    def script(self, route: str, *faults: Fault) -> None:
        """Queue faults for the next requests of ``route`` (one of :data:`ROUTES`), one each, in order."""
        if route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}")
        with self._lock:
            self.faults[route].extend(faults)

    def add_input_file(self, items: int = 10, plan: BatchPlan | None = None, *, filename: str = "input.jsonl") -> str:
        """Upload (directly) a JSONL input file of ``items`` chat requests; batches made from it follow ``plan``."""
        lines = [
            json.dumps(
                {
                    "custom_id": f"req-{n:05d}",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"item {n}"}]},
                }
            )
            for n in range(items)
        ]
        content = ("\n".join(lines) + "\n").encode()
        with self._lock:
            file = self._add_file("batch", filename, content)
            if plan is not None:
                self.plans[file.id] = plan
        return file.id

    def add_foreign_batches(self, n: int, *, age_s: float = 0.0, items: int = 3) -> list[str]:
        """Batches someone else made (no jobtrail token), created ``age_s`` seconds ago."""
        file_id = self.add_input_file(items)
        made = []
        with self._lock:
            for _ in range(n):
                body = {
                    "input_file_id": file_id,
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                    "metadata": {"owner": "someone-else"},
                }
                batch = self._new_batch(body, created_at=int(time.time() - age_s))
                batch.foreign = True
                made.append(batch.id)
        return made

    def batches_with(self, key: str, value: str) -> list[str]:
        """Ids of the batches whose metadata has ``key`` = ``value`` (ours: the jobtrail token)."""
        with self._lock:
            return [b.id for b in self.batches.values() if b.body.get("metadata", {}).get(key) == value]

    def batch(self, batch_id: str) -> dict[str, Any]:
        """A batch as the API would show it now."""
        with self._lock:
            return self._batch_doc(self.batches[batch_id])

    def file_content(self, file_id: str) -> bytes:
        with self._lock:
            return self._content(file_id)

    # -- life cycle ----------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        app.router.add_post("/v1/batches", self._create)
        app.router.add_get("/v1/batches", self._list)
        app.router.add_get("/v1/batches/{id}", self._retrieve)
        app.router.add_post("/v1/batches/{id}/cancel", self._cancel)
        app.router.add_post("/v1/files", self._upload)
        app.router.add_get("/v1/files", self._list_files)
        app.router.add_get("/v1/files/{id}/content", self._file_content)
        app.router.add_get("/v1/files/{id}", self._file)
        return app

    async def start_async(self) -> str:
        self.base_url, self.port = await self.serve(self._app(), self.host, self.port)
        return self.base_url

    # -- the model ---------------------------------------------------------------------------------

    def _add_file(self, purpose: str, filename: str, content: bytes) -> FakeFile:
        prefix = "file-in" if purpose == "batch" else "file-x"
        file = FakeFile(f"{prefix}{next(self._seq):05d}", purpose, filename, content, int(time.time()))
        self.files[file.id] = file
        return file

    def _new_batch(self, body: dict[str, Any], *, created_at: int | None = None) -> FakeBatch:
        seq = next(self._seq)
        file_id = body["input_file_id"]
        items = [
            json.loads(line)["custom_id"] for line in self.files[file_id].content.decode().splitlines() if line.strip()
        ]
        batch = FakeBatch(
            id=f"batch_{seq:06d}",
            seq=seq,
            body=body,
            plan=self.plans.get(file_id, self.default_plan),
            items=items,
            started=time.monotonic(),
            created_at=int(time.time()) if created_at is None else created_at,
        )
        self.batches[batch.id] = batch
        return batch

    def _output_lines(self, batch: FakeBatch) -> tuple[list[str], list[str]]:
        """(output file lines, error file lines) of an ended batch."""
        now = time.monotonic()
        state = batch.status(now)
        done = batch.finished_items(now)
        failed = batch.failed_ids()
        out, err = [], []
        for n, custom_id in enumerate(batch.items):
            req = f"req_{batch.seq:06d}{n:05d}"
            line: dict[str, Any] = {"id": f"batch_req_{batch.seq:06d}{n:05d}", "custom_id": custom_id}
            if n >= done:
                code = "batch_expired" if state == "expired" else "batch_cancelled"
                line |= {"response": None, "error": {"code": code, "message": f"This request was not run ({code})."}}
                err.append(json.dumps(line))
            elif custom_id in failed:
                error = {"message": "Invalid 'messages'", "type": "invalid_request_error", "param": None, "code": None}
                line |= {"response": {"status_code": 400, "request_id": req, "body": {"error": error}}, "error": None}
                err.append(json.dumps(line))
            else:
                body = {"id": f"chatcmpl-{n}", "object": "chat.completion", "choices": [{"index": 0}]}
                line |= {"response": {"status_code": 200, "request_id": req, "body": body}, "error": None}
                out.append(json.dumps(line))
        return out, err

    def _batch_doc(self, batch: FakeBatch) -> dict[str, Any]:
        now = time.monotonic()
        state = batch.status(now)
        total = len(batch.items)
        failed_ids = batch.failed_ids()
        done = batch.finished_items(now)
        failed = sum(1 for i in batch.items[:done] if i in failed_ids)
        wall = time.time() - now  # monotonic -> wall clock
        doc: dict[str, Any] = {
            "id": batch.id,
            "object": "batch",
            "endpoint": batch.body.get("endpoint"),
            "input_file_id": batch.body["input_file_id"],
            "completion_window": batch.body.get("completion_window"),
            "status": state,
            "created_at": batch.created_at,
            "expires_at": batch.created_at + 86400,
            "metadata": batch.body.get("metadata"),
            "request_counts": {"total": total, "completed": done - failed, "failed": failed},
            "output_file_id": None,
            "error_file_id": None,
            "errors": None,
        }
        if state != "validating":
            doc["in_progress_at"] = batch.created_at + 1
        if batch.cancel_requested_at is not None:
            doc["cancelling_at"] = int(batch.cancel_requested_at + wall)
        terminal = state in ("completed", "failed", "expired", "cancelled")
        if terminal:
            ended = batch.end  # a cancel that took effect ended the batch cancel_s after it was asked for
            if state == "cancelled" and batch.cancel_requested_at is not None:
                ended = min(batch.end, batch.cancel_requested_at) + batch.plan.cancel_s
            doc[f"{state}_at"] = int(ended + wall)
        if state == "failed":
            doc["request_counts"] = {"total": 0, "completed": 0, "failed": 0}
            doc["errors"] = {
                "object": "list",
                "data": [{"code": "invalid_json_line", "line": 1, "message": "Invalid JSON", "param": None}],
            }
        elif terminal:
            out, err = self._output_lines(batch)
            if state != "completed":  # the unfinished items count as failed once the batch has ended
                doc["request_counts"] = {"total": total, "completed": len(out), "failed": len(err)}
            if out:
                doc["output_file_id"] = f"file-out{batch.seq:06d}"
            if err:
                doc["error_file_id"] = f"file-err{batch.seq:06d}"
            if batch.ended_reads <= batch.plan.files_hidden_reads:
                doc["output_file_id"] = doc["error_file_id"] = None
            if batch.plan.completed_at is not None and state == "completed":
                doc["completed_at"] = batch.plan.completed_at
        return _sdk_batch(doc)

    def _content(self, file_id: str) -> bytes:
        if file_id in self.files:
            return self.files[file_id].content
        for prefix, which in (("file-out", 0), ("file-err", 1)):
            if file_id.startswith(prefix):
                batch = next((b for b in self.batches.values() if file_id == f"{prefix}{b.seq:06d}"), None)
                if batch is None:
                    break
                lines = self._output_lines(batch)[which]
                if which == 0 and batch.plan.lines_lost:
                    lines = lines[: max(0, len(lines) - batch.plan.lines_lost)]
                if not lines:
                    break
                return ("\n".join(lines) + "\n").encode()
        raise KeyError(file_id)

    # -- handlers ------------------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        with self._lock:
            self.counts["requests"] += 1
            request_id = f"req_{next(self._seq):08d}"
        if self.api_key is not None and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            with self._lock:
                self.counts["unauthorized"] += 1
            return _error(
                401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key", request_id=request_id
            )
        response: web.StreamResponse = await handler(request)
        response.headers["x-request-id"] = request_id
        return response

    def _fault(self, route: str) -> Fault | None:
        faults = self.faults[route]
        return faults.pop(0) if faults else None

    async def _create(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return _error(400, "We could not parse the JSON body of your request.", "invalid_request_error")
        with self._lock:
            self.counts["creates_received"] += 1
            self.create_bodies.append(body)
            fault = self._fault("create")
            problem = _check_create(body)
            if problem is None and body["input_file_id"] not in self.files:
                problem = f"Invalid input_file_id: no such file {body['input_file_id']!r}"
            if problem is not None:
                self.shape_errors.append(problem)
                self.counts["shape_errors"] += 1
                return _error(400, problem, "invalid_request_error")
            if fault is not None and not fault.commit:
                if fault.drop:
                    assert request.transport is not None
                    request.transport.abort()
                    raise asyncio.CancelledError
                return _fault_response(fault)
            batch = self._new_batch(body)
            self.counts["batches_created"] += 1
            doc = self._batch_doc(batch)
        if fault is not None and fault.drop:  # committed, and the answer never arrives
            assert request.transport is not None
            request.transport.abort()
            raise asyncio.CancelledError
        if fault is not None:
            return _fault_response(fault)
        return web.json_response(doc)

    async def _list(self, request: web.Request) -> web.StreamResponse:
        try:
            limit = int(request.query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            return _error(400, "limit must be between 1 and 100", "invalid_request_error", param="limit")
        after = request.query.get("after")
        with self._lock:
            self.counts["lists"] += 1
            fault = self._fault("list")
            if fault is not None:
                return _fault_response(fault)
            ordered = sorted(self.batches.values(), key=lambda b: (b.created_at, b.seq), reverse=True)
            if self.list_repeats:
                data = [self._batch_doc(b) for b in ordered[:limit]]
                last = data[-1]["id"] if data else None
                return web.json_response(
                    {"object": "list", "data": data, "first_id": last, "last_id": last, "has_more": True}
                )
            if after is not None:
                at = next((n for n, b in enumerate(ordered) if b.id == after), None)
                if at is None:
                    return _error(404, f"No batch found with id '{after}'.", "invalid_request_error", param="after")
                ordered = ordered[at + 1 :]
            page = ordered[:limit]
            data = [self._batch_doc(b) for b in page]
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": len(ordered) > limit,
            }
        )

    async def _retrieve(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.counts["status"] += 1
            fault = self._fault("retrieve")
            if fault is not None:
                return _fault_response(fault)
            batch = self.batches.get(request.match_info["id"])
            if batch is None:
                return _error(404, f"No batch found with id '{request.match_info['id']}'.", "invalid_request_error")
            if batch.status(time.monotonic()) in ("completed", "failed", "expired", "cancelled"):
                batch.ended_reads += 1
            return web.json_response(self._batch_doc(batch))

    async def _cancel(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self.counts["cancels"] += 1
            fault = self._fault("cancel")
            if fault is not None:
                return _fault_response(fault)
            batch = self.batches.get(request.match_info["id"])
            if batch is None:
                return _error(404, f"No batch found with id '{request.match_info['id']}'.", "invalid_request_error")
            state = batch.status(time.monotonic())
            if state in ("completed", "failed", "expired"):
                return _error(400, f"Cannot cancel a batch with status '{state}'.", "invalid_request_error")
            if batch.cancel_requested_at is None:
                batch.cancel_requested_at = time.monotonic()
            return web.json_response(self._batch_doc(batch))

    async def _upload(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        purpose, upload = form.get("purpose"), form.get("file")
        content, filename = b"", ""
        if isinstance(upload, web.FileField):
            with upload.file:  # a spooled temporary file: closed whatever happens next
                content, filename = upload.file.read(), upload.filename
        with self._lock:
            self.counts["uploads_received"] += 1
            fault = self._fault("upload")
            if not isinstance(purpose, str) or purpose not in _PURPOSES or not isinstance(upload, web.FileField):
                problem = f"Invalid upload: purpose {purpose!r} must be one of {', '.join(_PURPOSES)}, with a file"
                self.shape_errors.append(problem)
                self.counts["shape_errors"] += 1
                return _error(400, problem, "invalid_request_error", param="purpose")
            if fault is not None and not fault.commit:
                if fault.drop:
                    assert request.transport is not None
                    request.transport.abort()
                    raise asyncio.CancelledError
                return _fault_response(fault)
            file = self._add_file(purpose, filename, content)
            self.counts["files_created"] += 1
            doc = self._file_doc(file.id)
        if fault is not None and fault.drop:
            assert request.transport is not None
            request.transport.abort()
            raise asyncio.CancelledError
        if fault is not None:
            return _fault_response(fault)
        return web.json_response(doc)

    async def _list_files(self, request: web.Request) -> web.StreamResponse:
        try:
            limit = int(request.query.get("limit", "10000"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 10000:
            return _error(400, "limit must be between 1 and 10000", "invalid_request_error", param="limit")
        purpose, after = request.query.get("purpose"), request.query.get("after")
        with self._lock:
            self.counts["file_lists"] += 1
            fault = self._fault("files")
            if fault is not None:
                return _fault_response(fault)
            ordered = sorted(
                (f for f in self.files.values() if purpose is None or f.purpose == purpose),
                key=lambda f: (f.created_at, f.id),
                reverse=request.query.get("order", "desc") == "desc",
            )
            if after is not None:
                at = next((n for n, f in enumerate(ordered) if f.id == after), None)
                ordered = [] if at is None else ordered[at + 1 :]
            data = [self._file_doc(f.id) for f in ordered[:limit]]
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": len(ordered) > limit,
            }
        )

    def _file_doc(self, file_id: str) -> dict[str, Any]:
        content = self._content(file_id)
        known = self.files.get(file_id)
        doc = {
            "id": file_id,
            "object": "file",
            "bytes": len(content),
            "created_at": known.created_at if known else int(time.time()),
            "filename": known.filename if known else f"{file_id}.jsonl",
            "purpose": known.purpose if known else "batch_output",
            "status": "processed",
            "expires_at": (known.created_at if known else int(time.time())) + 30 * 86400,
        }
        return _sdk_file(doc)

    async def _file(self, request: web.Request) -> web.StreamResponse:
        file_id = request.match_info["id"]
        with self._lock:
            self.counts["file_reads"] += 1
            try:
                doc = self._file_doc(file_id)
            except KeyError:
                return _error(404, f"No such File object: {file_id}", "invalid_request_error", param="id")
        return web.json_response(doc)

    async def _file_content(self, request: web.Request) -> web.StreamResponse:
        file_id = request.match_info["id"]
        with self._lock:
            self.counts["content_reads"] += 1
            fault = self._fault("content")
            if fault is not None:
                self.counts["content_faults"] += 1
                return _fault_response(fault)
            try:
                content = self._content(file_id)
            except KeyError:
                return _error(404, f"No such File object: {file_id}", "invalid_request_error", param="id")
        return web.Response(body=content, content_type="application/octet-stream")


def _check_create(body: Any) -> str | None:
    """Why a create body does not match the SDK's request type and OpenAI's metadata limits (None: it does)."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    try:
        from openai.types import batch_create_params
        from pydantic import TypeAdapter, ValidationError
    except ImportError:  # without the SDK: the documented required fields only
        missing = [k for k in ("input_file_id", "endpoint", "completion_window") if k not in body]
        return f"Missing required parameter: '{missing[0]}'." if missing else _check_metadata(body)
    params = batch_create_params.BatchCreateParams
    known = set(params.__annotations__)
    unknown = sorted(set(body) - known)
    if unknown:
        return f"Unrecognized request argument supplied: {unknown[0]}"
    try:
        TypeAdapter(params).validate_python(body, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        return f"Invalid parameter {'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return _check_metadata(body)


def _check_metadata(body: dict[str, Any]) -> str | None:
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict):
        return "metadata must be an object"
    if len(metadata) > 16:
        return f"Invalid 'metadata': too many properties. Expected at most 16, got {len(metadata)}."
    for key, value in metadata.items():
        if not isinstance(value, str) or len(key) > 64 or len(value) > 512:
            return f"Invalid 'metadata.{key[:64]}': keys are at most 64 and values at most 512 characters (strings)."
    return None


def _sdk_batch(doc: dict[str, Any]) -> dict[str, Any]:
    """The batch as ``openai.types.Batch`` serialises it (its own validation checks the shape)."""
    try:
        from openai.types import Batch
    except ImportError:
        return doc
    dumped: dict[str, Any] = Batch.model_validate(doc).model_dump(mode="json")
    return dumped


def _sdk_file(doc: dict[str, Any]) -> dict[str, Any]:
    try:
        from openai.types import FileObject
    except ImportError:
        return doc
    dumped: dict[str, Any] = FileObject.model_validate(doc).model_dump(mode="json")
    return dumped


def _error(
    status: int,
    message: str,
    type_: str,
    code: str | None = None,
    *,
    param: str | None = None,
    request_id: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    extra = dict(headers or {})
    if request_id:
        extra["x-request-id"] = request_id
    return web.json_response(body, status=status, headers=extra)


def _fault_response(fault: Fault) -> web.Response:
    headers = {}
    if fault.retry_after is not None:
        headers["retry-after"] = fault.retry_after
    if fault.retry_after_ms is not None:
        headers["retry-after-ms"] = fault.retry_after_ms
    if fault.status == 429:
        return _error(429, "Rate limit reached for requests.", "requests", "rate_limit_exceeded", headers=headers)
    return _error(
        fault.status or 500, "The server had an error while processing your request.", "server_error", headers=headers
    )


__all__ = ["BatchPlan", "FakeBatch", "FakeFile", "Fault", "OpenAIBatchFake"]
