"""A contract fake of a Google API whose create answers a long-running operation, on loopback.

One aiohttp server in a background thread. Two creates answer a ``google.longrunning.Operation``
``{name, metadata, done}``: ``POST /v1/projects/{project}/locations/{location}/instances`` (a typical
resource create) and Firestore Admin's ``POST /v1/projects/{project}/databases/{database}:exportDocuments``
(a custom method; its operations are named ``projects/{project}/databases/(default)/operations/...``,
parentheses included). The operations contract: ``GET /v1/{name}``, ``POST /v1/{name}:cancel``. Like
Google's front ends it routes on the raw path, so a name sent with encoded slashes
(``projects%2Fp%2F...``) is a 404, and decodes every other escape (``%28default%29`` is ``(default)``),
as google.api.http prescribes for a multi-segment variable.

AIP-155: the ``requestId`` query parameter (or body field of that name) must be a UUID other than
the all-zero one (else 400 INVALID_ARGUMENT); a known id answers with the operation it made first
(counted as ``replayed``). A create whose request message has no ``request_id`` field (the export
always; the instances create when ``declares_request_id`` is false, as Filestore's) refuses one with
400 INVALID_ARGUMENT, as Google's HTTP transcoding refuses a parameter it cannot bind (counted as
``unknown_parameter``). Errors are ``{"error": {"code", "message", "status"}}``. The body may
script the operation: ``"fake_outcome": "fail"`` ends with ``error`` (code 3), ``"null_response"``
ends ``done`` with ``"response": null`` (a lying answer: proto3 JSON's null is an absent field),
``"fake_duration"`` (seconds). With ``unique_instances``, an instances create naming an ``instanceId``
that exists answers 409 ALREADY_EXISTS (counted as ``already_exists``), as Google does once
``request_id_retention_s`` has passed for the requestId that made it (a known requestId is forgotten
after that long). Create faults are :class:`jobtrail.testing.Fault` values (``drop``, ``http``).

Bearer tokens: only those in ``valid_tokens`` are accepted (401 UNAUTHENTICATED otherwise), so a
test can rotate the token the way OAuth access tokens expire. ``counts``: creates_received,
jobs_created, replayed, gets, cancels, encoded_names, unauthorized, unknown_parameter.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import urllib.parse
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from jobtrail.testing._fake_provider import Fault
from jobtrail.testing._served import ServedInThread

PROJECT, LOCATION = "fake-project", "us-central1"


@dataclass(slots=True)
class LongRunning:
    name: str
    body: dict[str, Any]
    created: float
    duration_s: float
    resource: str
    cancelled_at: float | None = None
    #: what it makes: "instance" (the resource is its response) or "export" (Firestore's export response)
    kind: str = "instance"

    def outcome(self, now: float) -> str:
        finish = self.created + self.duration_s
        if self.cancelled_at is not None and self.cancelled_at < finish:
            return "cancelled" if now - self.cancelled_at >= 0.05 else "running"
        if now < finish:
            return "running"
        return "failed" if self.body.get("fake_outcome") == "fail" else "succeeded"


@dataclass
class GoogleLroFake(ServedInThread):
    """``start()`` serves from a thread; ``stop()`` ends it."""

    host: str = "127.0.0.1"
    operation_s: float = 1.0
    valid_tokens: set[str] = field(default_factory=lambda: {"ya29.fake-token-1"})
    #: does the instances create declare a request_id field? (False: Filestore's, which does not)
    declares_request_id: bool = True
    #: refuse a second instance of the same instanceId with 409 ALREADY_EXISTS (Google's answer)
    unique_instances: bool = False
    #: how long a requestId is honoured (None: for ever)
    request_id_retention_s: float | None = None
    counts: Counter[str] = field(default_factory=Counter)
    faults: list[Fault] = field(default_factory=list)
    operations: dict[str, LongRunning] = field(default_factory=dict)
    #: requestId -> operation name
    request_ids: dict[str, str] = field(default_factory=dict)
    #: raw paths of every operations.get
    get_paths: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._rid_at: dict[str, float] = {}
        self.base_url = ""

    @property
    def create_path(self) -> str:
        return f"/v1/projects/{PROJECT}/locations/{LOCATION}/instances"

    def script(self, *faults: Fault) -> None:
        with self._lock:
            self.faults.extend(faults)

    def provider_config(self, credential_file: str, **overrides: Any) -> dict[str, Any]:
        """An operator's ``kind = "google-lro"`` file for this fake."""
        config: dict[str, Any] = {
            "kind": "google-lro",
            "name": "gcp",
            "base_url": self.base_url,
            "credential": f"file:{credential_file}",
            "create_path": self.create_path + "?instanceId=fake-instance",
            "progress": "$.metadata.progressPercent",
            "timeout_s": 5.0,
            "connect_timeout_s": 1.0,
            "retry": {"initial_s": 0.05, "factor": 2, "cap_s": 0.5},
            "poll": {"initial_s": 0.1, "factor": 1.5, "cap_s": 0.5},
        }
        config.update(overrides)
        return {k: v for k, v in config.items() if v is not None}

    # -- life cycle ---------------------------------------------------------------------------------

    async def start_async(self) -> str:
        app = web.Application(middlewares=[self._guard])
        app.router.add_post("/v1/projects/{project}/locations/{location}/instances", self._create)
        app.router.add_post("/v1/projects/{project}/databases/{database}:exportDocuments", self._export)
        app.router.add_route("*", "/v1/{tail:.*}", self._operations)
        self.base_url, _ = await self.serve(app, self.host)
        return self.base_url

    # -- handlers -------------------------------------------------------------------------------------

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        with self._lock:
            valid = auth.startswith("Bearer ") and auth[7:] in self.valid_tokens
            if not valid:
                self.counts["unauthorized"] += 1
        if not valid:
            return _error(401, "UNAUTHENTICATED", "Request had invalid authentication credentials.")
        response: web.StreamResponse = await handler(request)
        return response

    def _doc(self, op: LongRunning) -> dict[str, Any]:
        now = time.monotonic()
        outcome = op.outcome(now)
        progress = 100 if outcome != "running" else int(min(99, (now - op.created) / op.duration_s * 100))
        doc: dict[str, Any] = {
            "name": op.name,
            "metadata": {
                "@type": "type.googleapis.com/google.cloud.common.OperationMetadata",
                "createTime": datetime.fromtimestamp(time.time() - (now - op.created), tz=UTC).isoformat(),
                "target": op.resource,
                "verb": "create",
                "requestedCancellation": op.cancelled_at is not None,
                "apiVersion": "v1",
                "progressPercent": progress,
            },
            "done": outcome != "running",
        }
        if outcome == "succeeded" and op.kind == "export":
            doc["response"] = {
                "@type": "type.googleapis.com/google.firestore.admin.v1.ExportDocumentsResponse",
                "outputUriPrefix": op.body.get("outputUriPrefix"),
            }
        elif outcome == "succeeded" and op.body.get("fake_outcome") == "null_response":
            doc["response"] = None
        elif outcome == "succeeded":
            doc["response"] = {
                "@type": "type.googleapis.com/fake.v1.Instance",
                "name": op.resource,
                "state": "READY",
                "labels": op.body.get("labels", {}),
            }
        elif outcome == "failed":
            doc["error"] = {"code": 3, "message": "the machine image is missing (fake)", "details": []}
        elif outcome == "cancelled":
            doc["error"] = {"code": 1, "message": "Operation was cancelled.", "details": []}
        return doc

    async def _create(self, request: web.Request) -> web.StreamResponse:
        project, location = request.match_info["project"], request.match_info["location"]
        return await self._start(
            request,
            parent=f"projects/{project}/locations/{location}",
            resource=f"projects/{project}/locations/{location}/instances/",
            kind="instance",
            declares_request_id=self.declares_request_id,
        )

    async def _export(self, request: web.Request) -> web.StreamResponse:
        # ExportDocumentsRequest has no request_id field
        project, database = request.match_info["project"], request.match_info["database"]
        parent = f"projects/{project}/databases/{database}"
        return await self._start(request, parent=parent, resource=parent, kind="export", declares_request_id=False)

    async def _start(  # noqa: PLR0912 - each of Google's answers to a create, in the order it checks them
        self, request: web.Request, *, parent: str, resource: str, kind: str, declares_request_id: bool
    ) -> web.StreamResponse:
        try:
            body = json.loads(await request.read() or b"{}")
        except ValueError:
            return _error(400, "INVALID_ARGUMENT", "Invalid JSON payload received.")
        with self._lock:
            self.counts["creates_received"] += 1
            fault = self.faults.pop(0) if self.faults else None
        if not isinstance(body, dict):
            return _error(400, "INVALID_ARGUMENT", "Invalid JSON payload received.")
        if not declares_request_id and ("requestId" in request.query or "requestId" in body):
            with self._lock:
                self.counts["unknown_parameter"] += 1
            why = (
                "Cannot bind query parameter. Field 'requestId' could not be found in request message."
                if "requestId" in request.query
                else "Cannot find field."
            )
            return _error(400, "INVALID_ARGUMENT", f'Invalid JSON payload received. Unknown name "requestId": {why}')
        rid = request.query.get("requestId") or body.get("requestId")
        if rid is not None:
            try:
                parsed = uuid.UUID(rid)
            except ValueError:
                parsed = None
            if parsed is None or parsed.int == 0 or str(parsed) != rid.lower():
                return _error(400, "INVALID_ARGUMENT", "request_id must be a valid UUID other than zero.")
        if fault is not None and fault.kind == "http" and not fault.commit:
            return _fault(fault)
        if fault is not None and fault.kind == "drop" and not fault.commit:
            assert request.transport is not None
            request.transport.abort()
            raise asyncio.CancelledError
        with self._lock:
            known = self._known(rid)
            taken = self._taken(known, kind, resource + request.query.get("instanceId", ""))
            if taken is not None:
                return taken
            if known is not None:
                self.counts["replayed"] += 1
                op = self.operations[known]
            else:
                n = next(self._ids)
                if kind == "export":  # Firestore names its operations with an opaque id
                    name = f"{parent}/operations/ASA{n:04d}{uuid.uuid4().hex[:20]}"
                else:
                    name = f"{parent}/operations/operation-{n:04d}-{uuid.uuid4().hex[:12]}"
                    resource += request.query.get("instanceId", f"instance-{n}")
                op = LongRunning(
                    name=name,
                    body=body,
                    created=time.monotonic(),
                    duration_s=float(body.get("fake_duration", self.operation_s)),
                    resource=resource,
                    kind=kind,
                )
                self.operations[name] = op
                self.counts["jobs_created"] += 1
                if rid:
                    self.request_ids[rid] = name
                    self._rid_at[rid] = time.monotonic()
            doc = self._doc(op)
        if fault is not None and fault.kind == "drop":
            assert request.transport is not None
            request.transport.abort()
            raise asyncio.CancelledError
        if fault is not None and fault.kind == "http":
            return _fault(fault)
        return web.json_response(doc)

    def _known(self, rid: str | None) -> str | None:
        """The operation a requestId made, while the service still honours it (call under the lock)."""
        known = self.request_ids.get(rid) if rid else None
        retention = self.request_id_retention_s
        if (
            known is not None
            and rid is not None
            and retention is not None
            and time.monotonic() - self._rid_at[rid] >= retention
        ):
            return None  # forgotten: the service treats it as a new request
        return known

    def _taken(self, known: str | None, kind: str, wanted: str) -> web.Response | None:
        """409 ALREADY_EXISTS for a new instances create naming one that exists (call under the lock)."""
        if known is not None or kind != "instance" or not self.unique_instances:
            return None
        if not any(o.resource == wanted for o in self.operations.values()):
            return None
        self.counts["already_exists"] += 1
        return _error(409, "ALREADY_EXISTS", f"Resource '{wanted}' already exists")

    async def _operations(self, request: web.Request) -> web.StreamResponse:
        raw = request.raw_path.split("?", 1)[0]
        if "%2f" in raw.lower():
            with self._lock:
                self.counts["encoded_names"] += 1
            return _error(404, "NOT_FOUND", f"The requested URL {raw} was not found on this server.")
        # the reverse of the client's encoding, except for the slashes refused above
        path = urllib.parse.unquote(raw[len("/v1/") :])
        cancel = path.endswith(":cancel")
        name = path[: -len(":cancel")] if cancel else path
        with self._lock:
            op = self.operations.get(name)
            if request.method == "GET" and not cancel:
                self.counts["gets"] += 1
                self.get_paths.append(raw)
                if op is None:
                    return _error(404, "NOT_FOUND", f"Operation {name} not found.")
                return web.json_response(self._doc(op))
            if request.method == "POST" and cancel:
                self.counts["cancels"] += 1
                if op is None:
                    return _error(404, "NOT_FOUND", f"Operation {name} not found.")
                if op.cancelled_at is None:
                    op.cancelled_at = time.monotonic()
                return web.json_response({})
        return _error(404, "NOT_FOUND", f"The requested URL {raw} was not found on this server.")


def _error(code: int, status: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(
        {"error": {"code": code, "message": message, "status": status}}, status=code, headers=headers
    )


def _fault(fault: Fault) -> web.Response:
    headers = {"Retry-After": fault.retry_after} if fault.retry_after else None
    status = {
        400: "INVALID_ARGUMENT",
        403: "PERMISSION_DENIED",
        404: "NOT_FOUND",
        429: "RESOURCE_EXHAUSTED",
        503: "UNAVAILABLE",
    }.get(fault.status, "INTERNAL")
    return _error(fault.status, status, f"fault {fault.status} (fake)", headers)
