"""``kind = "google-lro"``: a Google API whose create answers a long-running operation.

The create is the service's own (the operator declares ``create_path``, e.g.
``/v1/projects/p/locations/l/instances`` or a custom-method path ending ``:import``); what
follows is the generic ``google.longrunning.Operations`` contract (AIP-151):

* the create answers an ``Operation`` ``{name, metadata, done, error?, response?}``; the job id is
  ``name`` (``projects/p/locations/l/operations/op-1``), sent back with its slashes as they are
  (``/v1/projects%2Fp%2F...`` is a 404); Google decodes any other escape, so Firestore's
  ``projects/p/databases/(default)/operations/x`` arrives as itself however its parentheses travel;
* status ``GET /v1/{name}``: ``done`` false is running; ``done`` with ``error`` is failed, or
  cancelled when ``error.code`` is 1 (CANCELLED); ``done`` with ``response`` is succeeded and the
  result is that ``response`` (no separate result endpoint);
* cancel ``POST /v1/{name}:cancel`` (best effort: the status read afterwards decides).

Idempotency (AIP-155): the token travels as a UUID ``requestId`` query parameter by default
(``[request_id]`` moves it to a body field or header, or turns it off); a create whose answer was
lost is reconciled by sending it again with the same ``requestId``. Not every create has a
``request_id`` field (Filestore's ``instances.create`` and Firestore's ``exportDocuments`` do not), and
Google refuses a parameter the method cannot bind with 400 INVALID_ARGUMENT: check the service's
request message and set ``in = "none"`` where it has none (the refusal says so). OAuth access tokens expire:
the credential reference is read when a request is sent (again after ``CREDENTIAL_TTL_S`` and at
once on a 401), so a token file a sidecar rewrites is picked up.

No SDK: the Google client libraries are per service and would hide the wire (their own retries
and request ids); the operations contract is four small HTTP calls.
"""

from __future__ import annotations

import re
import urllib.parse
import uuid
from collections.abc import Mapping
from typing import Any

from jobtrail.domain.canonical import canonical_bytes
from jobtrail.domain.errors import ConfigError
from jobtrail.domain.jsonpath import extract, parse_path, unusable
from jobtrail.domain.record import Operation
from jobtrail.domain.redact import Redactor
from jobtrail.domain.states import RemoteState, State
from jobtrail.domain.words import their_words
from jobtrail.providers.contract import CreateOutcome, NoAnswer, Response, StatusOutcome
from jobtrail.providers.http import HttpProvider, parse_config
from jobtrail.providers.kinds import operator_settings

#: AIP-155 practice: request ids are honoured for at least an hour
DEFAULT_RETENTION_S = 3600
#: a uuid5 namespace for tokens that are not 32 hex digits (the token itself is never changed)
_NAMESPACE = uuid.UUID("6f1c2a3e-9a0b-4c1d-8e2f-3a4b5c6d7e8f")
#: one segment of an operation name: the characters a path segment holds literally (RFC 3986 pchar:
#: unreserved and sub-delims, which Google's resource names use, e.g. Firestore's "(default)" database
#: and "@" in service account names), never starting with "." (no dot segments, nothing a client or
#: proxy would normalise away). Refused: ":" (Google's custom-method separator, as in "{name}:cancel"),
#: ";" (path parameters, which some front ends strip), "%" (an escape would reach the server decoded as
#: something else), "?" and "#" (they end the path), "/" within a segment (so no empty segment), and
#: spaces, controls and anything outside ASCII. The URL is still built by escaping ({+job_id}); this
#: decides which answers are names at all.
_SEGMENT = re.compile(r"[A-Za-z0-9_~\-!$&'()*+,=@][A-Za-z0-9._~\-!$&'()*+,=@]*")
_API = re.compile(r"^v\d+[a-z0-9]*$")


def build(kind: str, data: Mapping[str, Any], source: str) -> HttpProvider:
    """The Google LRO adapter for an operator's file (see ``examples/google-lro.toml``)."""
    settings = operator_settings(kind, data, source, also=("create_path", "request_id", "progress", "api_version"))
    create_path = settings.pop("create_path", None)
    if not isinstance(create_path, str) or not create_path.startswith("/"):
        raise ConfigError(
            f"{source}: create_path: expected the service's create path below base_url, e.g. "
            f'"/v1/projects/p/locations/l/instances?instanceId=x" or "/v1/projects/p/datasets/d:import", '
            f"got {create_path!r}"
        )
    if settings.get("credential") is None:
        raise ConfigError(
            f"{source}: credential is missing; expected a reference to an OAuth access token, e.g. "
            '"file:/run/secrets/google-token" (rewritten by a refresher; read again on every expiry)'
        )
    api = settings.pop("api_version", "v1")
    if not isinstance(api, str) or not _API.match(api):
        raise ConfigError(f'{source}: api_version: expected a version such as "v1" or "v1beta1", got {api!r}')
    progress = settings.pop("progress", None)
    if progress is not None:
        if not isinstance(progress, str):
            raise ConfigError(f'{source}: progress: expected a JSON path such as "$.metadata.progressPercent"')
        try:
            parse_path(progress)
        except ConfigError as exc:
            raise ConfigError(f"{source}: progress: expected a JSON path into the Operation ({exc})") from None
    where, name, retention = _request_id(settings.pop("request_id", {}), source)
    token: dict[str, Any]
    if where == "none":
        token = {"in": "none"}
    elif where == "header":
        token = {"in": "header", "name": name, "quoted": False}
    else:  # query or body; the value sent is the token as a UUID (see create())
        token = {"in": where, "name": name}
    contract: dict[str, Any] = {
        **settings,
        "auth": "bearer",
        "create": {"path": create_path, "token": token, "token_retention_s": retention, "job_id": "$.name"},
        "status": {"path": f"/{api}/{{job_id}}", "state": "$.done"},
        "cancel": {"path": f"/{api}/{{job_id}}:cancel", "idempotent": True},
        "result": {"kind": "safe_read", "content_type": "application/json"},
        "reconcile": {"modes": [] if where == "none" else ["replay"]},
    }
    provider = GoogleLroProvider(parse_config(contract, source))
    provider.api_version = api
    provider.request_id_in = where
    provider.request_id_name = name
    provider.progress_path = progress
    return provider


def _request_id(value: Any, source: str) -> tuple[str, str, float]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source}: request_id: expected a table, got {value!r}")
    unknown = sorted(set(value) - {"in", "name", "retention_s"})
    if unknown:
        raise ConfigError(f"{source}: unknown key {unknown[0]!r} in [request_id]; known keys: in, name, retention_s")
    where = value.get("in", "query")
    if where not in ("query", "body", "header", "none"):
        raise ConfigError(f"{source}: request_id.in: expected one of query, body, header, none, got {where!r}")
    name = value.get("name", "requestId")
    if not isinstance(name, str) or not re.match(r"^[A-Za-z][A-Za-z0-9_\-]*$", name):
        raise ConfigError(f'{source}: request_id.name: expected a parameter name such as "requestId", got {name!r}')
    retention = value.get("retention_s", DEFAULT_RETENTION_S)
    if isinstance(retention, bool) or not isinstance(retention, int | float) or retention <= 0:
        raise ConfigError(f"{source}: request_id.retention_s: expected seconds > 0, got {retention!r}")
    return where, name, float(retention)


def request_id(token: str) -> str:
    """The stored token as the UUID Google request ids must be (the same token gives the same UUID)."""
    try:
        return str(uuid.UUID(hex=token, version=4)) if len(token) == 32 else str(uuid.uuid5(_NAMESPACE, token))
    except ValueError:
        return str(uuid.uuid5(_NAMESPACE, token))


def usable_name(name: str | None) -> bool:
    """An operation name we may put into a path: non-empty segments of path characters, no dot segments."""
    return bool(name) and all(_SEGMENT.fullmatch(part) for part in str(name).split("/"))


class GoogleLroProvider(HttpProvider):
    """google.longrunning operations; see the module docstring for the contract."""

    kind = "google-lro"
    contract_note = (
        "AIP-155 requestId (a UUID made from the stored token) on every create and replay; a create whose "
        "answer was lost is sent again with the same requestId, which the service answers with the first "
        "operation. done+response is success and the response is the result; done+error is failure "
        "(code 1: cancelled). Operation names are sent with their slashes."
    )
    api_version = "v1"
    request_id_in = "query"
    request_id_name = "requestId"
    progress_path: str | None = None

    async def create(self, op: Operation) -> CreateOutcome:
        cfg = self.config
        body = op.request_body
        url = self._url(cfg.create.path, op)
        headers: dict[str, str] = {}
        rid = request_id(op.idempotency_token)
        if self.request_id_in == "query":
            url += ("&" if "?" in url else "?") + urllib.parse.urlencode({self.request_id_name: rid})
        elif self.request_id_in == "header":
            headers[self.request_id_name] = rid
        elif self.request_id_in == "body":
            if not isinstance(body, dict):
                raise ConfigError(
                    f"provider {self.name} puts the request id in the body field {self.request_id_name!r}, "
                    "so the request body must be a JSON object"
                )
            body = {**body, self.request_id_name: rid}
        sent = await self._send(cfg.create.method, url, op, body=body, extra_headers=headers)
        if isinstance(sent, NoAnswer):
            return sent.create_outcome()
        outcome = self.classify_create(sent)
        if (
            op.state is State.RECONCILIATION
            and outcome.kind == "rejected"
            and _error(sent.body).get("status") not in ("INVALID_ARGUMENT",)
        ):
            # AIP-155 is not an IETF replay of the stored answer: a replay refused now (permission since
            # revoked, the parent gone, a precondition the lost create itself changed) says nothing about
            # whether the lost attempt made an operation. Only the same bytes refused as invalid prove it.
            return CreateOutcome(
                kind="ambiguous",
                response=sent,
                error_class=outcome.error_class,
                detail=f"{outcome.detail}; a refused replay says nothing about whether the lost create started "
                "an operation",
            )
        return outcome

    def classify_create(self, resp: Response) -> CreateOutcome:
        status = resp.http_status or 0
        error = _error(resp.body)
        if status == 409 and error.get("status") == "ALREADY_EXISTS":
            # the resource exists: made by someone else, or by a create of ours whose answer was lost and
            # whose requestId the service no longer honours (or never did). Re-sending only repeats the 409,
            # and a 409 proves no refusal (the state machine refuses "failed" on it): a person decides
            return CreateOutcome(
                kind="ambiguous",
                response=resp,
                person_must_decide=True,
                error_class="already_exists",
                detail=f"HTTP 409: {_describe(error, self.redactor)}; the resource this create names exists "
                "already. If it is this operation's (look for its trace id or labels in the console), `jobtrail "
                "resolve OP --to accepted --job-id <its long-running operation's name>`; if it is not, `jobtrail "
                "resolve OP --to failed` and submit again under another resource id",
            )
        if 200 <= status < 300 and isinstance(resp.body, dict) and not isinstance(resp.body.get("name"), str | None):
            return CreateOutcome(
                kind="ambiguous",
                response=resp,
                error_class="malformed_response",
                detail=f"HTTP {status} with an operation name that is not a string (not used); the operation may exist",
            )
        outcome = super().classify_create(resp)
        if outcome.kind == "confirmed" and not usable_name(outcome.remote_job_id):
            return CreateOutcome(
                kind="ambiguous",
                response=resp,
                error_class="malformed_response",
                detail=f"HTTP {status} with an operation name that is not a path of plain segments (not used); "
                "the operation may exist",
            )
        if outcome.kind == "rejected" and error:
            return CreateOutcome(
                kind="rejected",
                response=resp,
                error_class=outcome.error_class,
                detail=f"HTTP {status}: {_describe(error, self.redactor)}{self._no_request_id_hint(status, error)}",
                declared_non_retryable=outcome.declared_non_retryable,
            )
        return outcome

    def _no_request_id_hint(self, status: int, error: Mapping[str, Any]) -> str:
        """What to change when the service refused the request id itself: its create has no such field."""
        message = error.get("message")
        if (
            status != 400
            or self.request_id_in not in ("query", "body")
            or not isinstance(message, str)
            or f'Unknown name "{self.request_id_name}"' not in message
        ):
            return ""
        return (
            f"; this create has no {self.request_id_name!r} field (not every Google API's create has one: see its "
            'request message): set [request_id] in = "none" in the provider file (a create whose answer is lost '
            "then stops for a person, as nothing can be replayed)"
        )

    def _operation_url(self, op: Operation, verb: str = "") -> str | None:
        name = op.remote_job_id
        if name is None or not usable_name(name):
            return None
        # {+job_id}: slashes stay, they are the resource path (an encoded %2F is a different, unknown resource)
        return self._url(f"/{self.api_version}/{{+job_id}}{verb}", op)

    async def status(self, op: Operation) -> StatusOutcome:
        url = self._operation_url(op)
        if url is None:
            return StatusOutcome(remote_state=RemoteState.UNKNOWN, raw_state=None, error_class="unusable_name")
        sent = await self._send("GET", url, op)
        if isinstance(sent, NoAnswer):
            return StatusOutcome(remote_state=RemoteState.UNKNOWN, raw_state=None, error_class=sent.error_class)
        if sent.http_status != 200 or not isinstance(sent.body, dict):
            return StatusOutcome(
                remote_state=RemoteState.UNKNOWN, raw_state=None, response=sent, error_class=f"http_{sent.http_status}"
            )
        body = sent.body
        if body.get("name") not in (None, op.remote_job_id):
            return StatusOutcome(
                remote_state=RemoteState.UNKNOWN, raw_state=None, response=sent, error_class="another_operation"
            )
        state, raw = _state(body)
        progress = None
        if self.progress_path is not None:
            try:
                value = extract(self.progress_path, body, {}, self.redactor)
                progress = float(value) if value is not None else None
            except ValueError:
                progress = None
        return StatusOutcome(
            remote_state=state,
            raw_state=raw,
            response=sent,
            failure=their_words(body.get("error"), self.redactor) if state is RemoteState.FAILED else "",
            progress=progress,
            provider_time=extract("$.metadata.endTime", body, {}, self.redactor)
            or extract("$.metadata.updateTime", body, {}, self.redactor),
        )

    async def cancel(self, op: Operation) -> Response | NoAnswer:
        url = self._operation_url(op, ":cancel")
        if url is None:
            return NoAnswer("refused", "no usable operation name to cancel")
        sent = await self._send("POST", url, op, body={})
        return sent

    async def fetch_result(self, op: Operation, result_ref: str | None) -> Response | NoAnswer:
        """The finished operation's ``response``, read again from operations.get, as JSON bytes."""
        url = self._operation_url(op)
        if url is None:
            return NoAnswer("refused", "no usable operation name")
        sent = await self._send("GET", url, op)
        if isinstance(sent, NoAnswer):
            return sent
        body = sent.body if isinstance(sent.body, dict) else {}
        if sent.http_status != 200 or body.get("done") is not True or body.get("response") is None:
            return Response(
                http_status=sent.http_status,
                headers=sent.headers,
                provider_request_id=sent.provider_request_id,
                body={"error": "no_response", "detail": "the operation is not done with a response"},
            )
        return Response(
            http_status=200,
            headers={"Content-Type": "application/json"},
            provider_request_id=sent.provider_request_id,
            raw=canonical_bytes(body["response"]),
        )


def _state(body: Mapping[str, Any]) -> tuple[RemoteState, str]:
    if body.get("done") is not True:
        return RemoteState.RUNNING, "RUNNING"
    error = body.get("error")
    if isinstance(error, Mapping):
        if error.get("code") == 1:
            return RemoteState.CANCELLED, "CANCELLED"
        return RemoteState.FAILED, "FAILED"
    if body.get("response") is not None:  # proto3 JSON: a null message field is an absent one, not a result
        return RemoteState.SUCCEEDED, "SUCCEEDED"
    # done, but neither outcome: success is not assumed
    return RemoteState.UNKNOWN, "DONE_WITHOUT_OUTCOME"


def _error(body: Any) -> dict[str, Any]:
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else {}


def _describe(error: Mapping[str, Any], redactor: Redactor) -> str:
    message = error.get("message")
    text = f"{error.get('status') or error.get('code')}: {str(message)[:300] if message else 'no message'}"
    return text if unusable(text, redactor) is None else f"{error.get('status') or error.get('code')}"
