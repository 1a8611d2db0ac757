"""``kind = "openai-batch"``: the OpenAI Batch API (``/v1/batches``), its contract fixed in code.

The wire contract (OpenAI API reference; the ``openai`` SDK's ``types/batch*.py`` and
``types/file_object.py``), and how jobtrail keeps its promises on it:

- **Create** ``POST /v1/batches`` ``{input_file_id, endpoint, completion_window, metadata}``.
  OpenAI has no idempotency header for batches. jobtrail's token travels in
  ``metadata["jobtrail_token"]``, merged with the caller's own metadata (never replacing it;
  OpenAI allows 16 string pairs, keys <= 64 characters, values <= 512).
- **Reconcile** a create whose answer was lost: list ``GET /v1/batches?limit=100&after=<last_id>``
  page by page, newest first, and match our metadata key. Paging stops at the first batch
  created well before the operation was (``LIST_MARGIN_S``), so only recent batches are read.
- **Status** ``GET /v1/batches/{id}``: ``validating``, ``in_progress``, ``finalizing``,
  ``completed``, ``failed``, ``expired``, ``cancelling``, ``cancelled``; progress is
  ``(completed + failed) / total`` of ``request_counts``, which is also the job's reported effects.
- **Result**: ``output_file_id`` and ``error_file_id``, each read by ``GET /v1/files/{id}/content``
  (JSONL keyed by ``custom_id``). The stored result is the output file's bytes followed by the
  error file's, unchanged. An item failed when its ``error`` is set or its
  ``response.status_code`` is 400 or more. An expired or cancelled batch keeps the output it
  made: its status carries the file ids, and :meth:`fetch_result` returns them.
- **Cancel** ``POST /v1/batches/{id}/cancel`` (the batch sits in ``cancelling`` up to 10 minutes).
- **Rate limits**: 429 with ``Retry-After`` and ``retry-after-ms``; the millisecond header wins.

The operator's file sets only the credential, the base URL, time-outs, limits and polling,
plus ``endpoint`` and ``completion_window`` (the defaults of requests that name neither),
``organization``/``project`` (the ``OpenAI-Organization``/``OpenAI-Project`` headers) and
``max_result_bytes``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import re
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from jobtrail.domain.canonical import parse_answer
from jobtrail.domain.errors import ConfigError
from jobtrail.domain.jsonpath import unusable
from jobtrail.domain.record import Operation
from jobtrail.domain.redact import Redactor
from jobtrail.providers.contract import (
    CreateOutcome,
    LookupOutcome,
    NoAnswer,
    ReconcileMode,
    Response,
    Spooled,
    StatusOutcome,
    WireAnswer,
    join_bodies,
    lines_short,
)
from jobtrail.providers.http import SPOOL_OVER_BYTES, HttpProvider, parse_config
from jobtrail.providers.kinds import operator_settings

#: the metadata key our idempotency token travels in
TOKEN_KEY = "jobtrail_token"  # noqa: S105 - a metadata key, not a password
#: OpenAI's metadata limits (``openai.types.shared.Metadata``)
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
#: the documented endpoints a batch may run (``batch_create_params.BatchCreateParams.endpoint``)
ENDPOINTS = (
    "/v1/responses",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/completions",
    "/v1/moderations",
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/videos",
)
#: batches created this long before the operation still count when listing (clock skew, seconds)
LIST_MARGIN_S = 600
#: listing gives up (cannot tell) after this many pages of 100
MAX_LIST_PAGES = 100
#: the last second a provider's Unix timestamp may name (9999-12-31T23:59:59Z): past it, or before 1970,
#: a ``*_at`` field is a lie that ``time.gmtime`` cannot even format, so it is left out of the provider time
_LATEST_STAMP = 253402300799
#: a file or batch id we put into a URL: OpenAI's are like ``file-abc123`` and ``batch_abc123``
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,199}")
#: the result reference the status hands the collector: both file ids
_REF_PREFIX = "openai-files:"
#: an item succeeded unless its HTTP status is 400 or more (or its ``error`` is set)
_OK_STATUS = tuple(str(code) for code in range(100, 400))

_STATES = {
    "queued": ["validating"],
    "running": ["in_progress", "finalizing"],
    "succeeded": ["completed"],
    "failed": ["failed"],
    "cancelling": ["cancelling"],
    "cancelled": ["cancelled"],
    "expired": ["expired"],
}

#: the operator's keys besides :data:`jobtrail.providers.kinds.OPERATOR_KEYS`
_OWN_KEYS = ("endpoint", "completion_window", "organization", "project", "max_result_bytes")


def _common(settings: Mapping[str, Any], source: str, name: str) -> dict[str, Any]:
    """What every OpenAI kind takes from the operator: origin, credential, headers, time-outs, limits."""
    base_url = settings.get("base_url", "https://api.openai.com")
    if isinstance(base_url, str) and urllib.parse.urlsplit(base_url).path.rstrip("/").endswith("/v1"):
        raise ConfigError(
            f"{source}: base_url: expected the origin without /v1 (the adapter's paths start with /v1), "
            f"got {base_url!r}"
        )
    if "credential" not in settings:
        raise ConfigError(
            f'{source}: credential is missing; expected a reference such as credential = "env:OPENAI_API_KEY" '
            "(OpenAI refuses requests without an API key)"
        )
    headers: dict[str, str] = {}
    for key, header in (("organization", "OpenAI-Organization"), ("project", "OpenAI-Project")):
        value = settings.get(key)
        if value is not None:
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{source}: {key}: expected an id such as org-... / proj-..., got {value!r}")
            headers[header] = value
    return {
        "name": settings.get("name", name),
        "base_url": base_url,
        **{k: settings[k] for k in ("target", "credential", "timeout_s", "connect_timeout_s") if k in settings},
        **{k: settings[k] for k in ("max_connections", "trace_header", "webhooks") if k in settings},
        "auth": "bearer",
        "headers": headers,
        "retry": settings.get("retry", {"initial_s": 1.0, "factor": 2.0, "cap_s": 60.0}),
    }


def contract(settings: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``openai-batch``'s fixed declarative contract, with the operator's settings filled in."""
    return _common(settings, source, "openai-batch") | {
        "create": {
            "path": "/v1/batches",
            "job_id": "$.id",
            # documentation only: create() puts it there (the declarative form sets top-level fields)
            "token": {"in": "body", "name": f"metadata.{TOKEN_KEY}"},
        },
        # a failed batch says why in its errors list (the input file's lines it refused)
        "status": {"path": "/v1/batches/{job_id}", "state": "$.status", "error": "$.errors.data"},
        "states": _STATES,
        "cancel": {"path": "/v1/batches/{job_id}/cancel", "idempotent": True},
        "result": {
            "kind": "safe_read",
            "max_bytes": settings.get("max_result_bytes", 256 * 1024 * 1024),
            "batch": {
                "format": "jsonl",
                "id": "$.custom_id",
                "error": "$.error",
                "outcome": "$.response.status_code",
                "succeeded": list(_OK_STATUS),
            },
        },
        "reconcile": {
            "modes": ["list_by_reference"],
            "list_path": "/v1/batches?limit=100",
            "items": "$.data",
            "reference": f"$.metadata.{TOKEN_KEY}",
        },
        "poll": settings.get("poll", {"initial_s": 10.0, "factor": 1.5, "cap_s": 300.0}),
    }


def file_contract(settings: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``openai-file``'s fixed declarative contract (an upload, ``POST /v1/files``)."""
    none: list[str] = []
    return _common(settings, source, "openai-file") | {
        "create": {
            "path": "/v1/files",
            "job_id": "$.id",
            # documentation only: create() names the uploaded file jobtrail-<token>-<name>
            "token": {"in": "body", "name": "filename"},
        },
        "status": {"path": "/v1/files/{job_id}", "state": "$.status"},
        "states": {
            "queued": none,
            "running": none,
            "succeeded": ["uploaded", "processed"],
            "failed": ["error"],
            "cancelling": none,
            "cancelled": none,
            "expired": none,
        },
        "result": {"path": "/v1/files/{job_id}", "kind": "safe_read", "max_bytes": 1024 * 1024},
        "reconcile": {
            "modes": ["list_by_reference"],
            "list_path": "/v1/files?order=desc&limit=100",
            "items": "$.data",
            "reference": "$.filename",
        },
        "poll": settings.get("poll", {"initial_s": 1.0, "factor": 2.0, "cap_s": 30.0}),
    }


def build(kind: str, data: Mapping[str, Any], source: str) -> HttpProvider:
    """``kind = "openai-batch"`` (or ``"openai-file"``): the operator's file holds only the operator's keys."""
    if kind == "openai-file":
        settings = operator_settings(kind, data, source, also=("organization", "project"))
        return OpenAIFileProvider(parse_config(file_contract(settings, source), source))
    settings = operator_settings(kind, data, source, also=_OWN_KEYS)
    endpoint = settings.get("endpoint", "/v1/chat/completions")
    if endpoint not in ENDPOINTS:
        raise ConfigError(f"{source}: endpoint: expected one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    window = settings.get("completion_window", "24h")
    if window != "24h":
        raise ConfigError(
            f'{source}: completion_window: expected "24h" (the only window OpenAI offers), got {window!r}'
        )
    provider = OpenAIBatchProvider(parse_config(contract(settings, source), source))
    provider.default_endpoint = endpoint
    provider.default_window = window
    return provider


class _OpenAIProvider(HttpProvider):
    """What every OpenAI adapter shares: newest-first cursor paging (``retry-after-ms`` is read by every
    provider, see :func:`jobtrail.providers.http._retry_after`)."""

    async def _list_recent(
        self, op: Operation, path: str, since_s: float
    ) -> tuple[list[dict[str, Any]], dict[str, Any], Response] | LookupOutcome:
        """Every object created since ``since_s`` (newest first), page by page, within one call's time-out."""
        mode = ReconcileMode.LIST_BY_REFERENCE
        batches: list[dict[str, Any]] = []
        listed: set[str] = set()
        cursors: set[str] = set()
        after: str | None = None
        pages = 0
        last = Response()
        stopped = "the list ended"
        # False once the list could not be read to its end: what was found still counts, absence does not
        complete = True
        try:
            async with asyncio.timeout(self.config.timeout_s):
                while True:
                    if pages >= MAX_LIST_PAGES:
                        complete = False
                        stopped = (
                            f"{pages} pages ({len(batches)} objects) listed without reaching any older than the "
                            "operation; cannot tell"
                        )
                        break
                    url = self._url(path, op)
                    if after is not None:
                        url += "&after=" + urllib.parse.quote(after, safe="")
                    sent = await self._send("GET", url, op)
                    pages += 1
                    if isinstance(sent, NoAnswer):
                        return LookupOutcome(kind="unknown", path=mode, detail=f"page {pages}: {sent}")
                    last = sent
                    body = sent.body
                    data = body.get("data") if isinstance(body, dict) else None
                    if sent.http_status != 200 or not isinstance(data, list):
                        return LookupOutcome(
                            kind="unknown",
                            path=mode,
                            response=sent,
                            detail=f"page {pages}: HTTP {sent.http_status}"
                            + ("" if isinstance(data, list) else ", no list at $.data"),
                        )
                    older = False
                    for item in data:
                        if not isinstance(item, dict) or not isinstance(item.get("id"), str):
                            continue
                        created = item.get("created_at")
                        if isinstance(created, int | float) and created < since_s:
                            older = True  # newest first: everything after this is older still
                            break
                        if item["id"] in listed:  # a page served again must not make one batch two
                            continue
                        listed.add(item["id"])
                        batches.append(item)
                    if older:
                        stopped = "reached objects created before the operation"
                        break
                    assert isinstance(body, dict)
                    cursor = body.get("last_id") or (
                        data[-1].get("id") if data and isinstance(data[-1], dict) else None
                    )
                    if body.get("has_more") is not True:
                        break
                    if not isinstance(cursor, str) or not data:  # more follow, and no way to them
                        return LookupOutcome(
                            kind="unknown",
                            path=mode,
                            detail="the list says more pages follow but gives no cursor to them; absence is not proven",
                        )
                    if cursor in cursors:
                        # a provider that hands out a cursor it gave before would be paged through forever
                        complete = False
                        stopped = (
                            f"page {pages} says more pages follow but points back to a page already read; the "
                            "list cannot be read to its end"
                        )
                        break
                    cursors.add(cursor)
                    after = cursor
        except TimeoutError:
            return LookupOutcome(
                kind="unknown",
                path=mode,
                detail=f"listing took longer than timeout_s ({self.config.timeout_s:g} s) after {pages} pages; "
                "raise timeout_s if the account has many recent batches or files",
            )
        summary: dict[str, Any] = {
            "pages": pages,
            "scanned": len(batches),
            "stopped": stopped,
            "since": int(since_s),
            "complete": complete,
        }
        return batches, summary, last


class OpenAIBatchProvider(_OpenAIProvider):
    """The OpenAI Batch API: token in metadata, reconciliation by listing, two result files."""

    kind = "openai-batch"
    contract_note = (
        f"OpenAI has no idempotency key for batches: jobtrail's token travels in metadata.{TOKEN_KEY} "
        "(merged with the caller's metadata), and a create whose answer was lost is reconciled by listing "
        "GET /v1/batches page by page (newest first, back to the operation's creation) for that token; "
        "found: adopted, absent: re-sent with the same token, cannot tell: retried until the create deadline, "
        "then needs_attention. The result is the output file followed by the error file (JSONL by custom_id)."
    )
    default_endpoint = "/v1/chat/completions"
    default_window = "24h"

    # -- the request ---------------------------------------------------------------------------

    def request_body(self, op: Operation) -> dict[str, Any]:
        """The body sent for ``op``: the caller's request, defaults filled in, our token merged into metadata.

        Raises ConfigError naming what is wrong (nothing is sent then).
        """
        return self.check_request(op.request_body, op.idempotency_token)

    def check_request(self, request: Any, token: str = "0" * 32) -> dict[str, Any]:
        """Check a caller's request before it becomes an operation (and again before it is sent)."""
        if not isinstance(request, Mapping):
            raise ConfigError(
                "an openai-batch request is a JSON object such as "
                '{"input_file_id": "file-...", "endpoint": "/v1/chat/completions"}'
            )
        file_id = request.get("input_file_id")
        if not isinstance(file_id, str) or not file_id:
            raise ConfigError(
                "an openai-batch request needs input_file_id: the id of a JSONL file uploaded with purpose "
                '"batch" (POST /v1/files)'
            )
        metadata = request.get("metadata") or {}
        if not isinstance(metadata, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise ConfigError("metadata must be an object of strings (OpenAI metadata values are strings)")
        if TOKEN_KEY in metadata and metadata[TOKEN_KEY] != token:
            raise ConfigError(
                f"metadata key {TOKEN_KEY!r} is jobtrail's own (it carries the idempotency token); use another key"
            )
        merged = {**metadata, TOKEN_KEY: token}
        if len(merged) > MAX_METADATA_KEYS:
            raise ConfigError(
                f"metadata has {len(metadata)} keys; OpenAI allows {MAX_METADATA_KEYS} and jobtrail adds one of "
                f"its own (the key {TOKEN_KEY}); drop at least {len(merged) - MAX_METADATA_KEYS} of yours"
            )
        for key, value in merged.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ConfigError(
                    f"metadata {key[:70]!r}: OpenAI allows keys of {MAX_METADATA_KEY} and values of "
                    f"{MAX_METADATA_VALUE} characters"
                )
        body = dict(request)
        body.setdefault("endpoint", self.default_endpoint)
        body.setdefault("completion_window", self.default_window)
        body["metadata"] = merged
        return body

    async def create(self, op: Operation) -> CreateOutcome:
        try:
            body = self.request_body(op)
        except ConfigError as exc:
            # refused here, before anything left: the record says why, and nothing is retried into a job
            return CreateOutcome(kind="not_sent", error_class="invalid_request", detail=str(exc))
        sent = await self._send("POST", self._url("/v1/batches", op), op, body=body)
        if isinstance(sent, NoAnswer):
            return sent.create_outcome()
        return self.classify_create(sent)

    # -- reconciliation ----------------------------------------------------------------------------

    async def lookup(self, op: Operation, mode: ReconcileMode) -> LookupOutcome:
        if mode is not ReconcileMode.LIST_BY_REFERENCE:
            return LookupOutcome(kind="unknown", path=mode, detail=f"{mode.value} is not offered by OpenAI")
        since_s = op.created_at_us / 1_000_000 - LIST_MARGIN_S
        listed = await self._list_recent(op, "/v1/batches?limit=100", since_s)
        if isinstance(listed, LookupOutcome):
            return listed
        batches, summary, last = listed
        ids = tuple(
            str(b["id"])
            for b in batches
            if isinstance(b.get("metadata"), dict) and b["metadata"].get(TOKEN_KEY) == op.idempotency_token
        )
        return _matched(
            mode,
            last,
            summary,
            ids,
            f"no batch among the {summary['scanned']} created since the operation carries our token",
        )

    lists_candidates = True

    async def candidates(self, op: Operation, since_us: int, until_us: int) -> LookupOutcome:
        """Batches created in the window that carry no jobtrail token (a person decides; never adopted)."""
        listed = await self._list_recent(op, "/v1/batches?limit=100", since_us / 1_000_000 - LIST_MARGIN_S)
        if isinstance(listed, LookupOutcome):
            return listed
        batches, summary, last = listed
        until_s = until_us / 1_000_000 + LIST_MARGIN_S
        ids = tuple(
            str(b["id"])
            for b in batches
            if isinstance(b.get("created_at"), int)
            and b["created_at"] <= until_s
            and not (isinstance(b.get("metadata"), dict) and TOKEN_KEY in b["metadata"])
        )
        response = dataclasses.replace(last, body={**summary, "candidates": list(ids)})
        if not summary["complete"]:
            # not every one in the window was seen, but those that were are still the person's to look at
            among = f"; among the pages read: {', '.join(ids)}" if ids else ""
            return LookupOutcome(
                kind="unknown",
                path=ReconcileMode.LIST_BY_REFERENCE,
                response=response,
                detail=summary["stopped"] + among,
            )
        return LookupOutcome(
            kind="candidates", path=ReconcileMode.LIST_BY_REFERENCE, response=response, remote_job_ids=ids
        )

    # -- status, cancel, result -------------------------------------------------------------------

    async def status(self, op: Operation) -> StatusOutcome:
        outcome = await super().status(op)
        body = outcome.response.body
        if outcome.response.http_status != 200 or not isinstance(body, dict):
            return outcome
        counts = body.get("request_counts")
        progress = None
        if isinstance(counts, dict):
            total, done, failed = (counts.get(k) for k in ("total", "completed", "failed"))
            if isinstance(total, int) and isinstance(done, int) and isinstance(failed, int) and total > 0:
                progress = round(min(1.0, (done + failed) / total), 4)
        stamps = [
            v
            for k, v in body.items()
            if k.endswith("_at")
            and k != "expires_at"
            and isinstance(v, int)
            and not isinstance(v, bool)
            and 0 <= v <= _LATEST_STAMP
        ]
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(max(stamps))) if stamps else None
        return dataclasses.replace(
            outcome,
            progress=progress,
            result_ref=_result_ref(body, self.redactor),
            provider_time=when,
            effects={"request_counts": counts} if isinstance(counts, dict) else None,
        )

    async def fetch_result(self, op: Operation, result_ref: str | None) -> Response | NoAnswer:
        files = _parse_ref(result_ref)
        if not files:
            # the status that ended the batch named no usable file: ask again, since OpenAI may set the file
            # ids after the status says completed, and the reference stored then would never change
            again = await self._files_now(op)
            if not isinstance(again, list):
                return again
            files = again
        budget = self.config.result_spec.max_bytes
        parts: list[bytes | Spooled] = []
        last: Response | None = None
        joined = False
        try:
            for role, file_id in files:
                url = self._url("/v1/files/{job_id}/content", op, job_id=file_id)
                sent = await self._send("GET", url, op, keep_raw=True, max_bytes=max(budget, 0))
                if isinstance(sent, NoAnswer):
                    return NoAnswer(sent.error_class, f"{role} file {file_id}: {sent.detail}")
                fetched = sent.fetched
                if sent.http_status != 200 or fetched is None:
                    return _error_response(sent, f"{role} file {file_id}")
                last = sent
                parts.append(fetched)
                budget -= fetched.size if isinstance(fetched, Spooled) else len(fetched)
            assert last is not None
            joined = True  # from here join_bodies owns the parts' files (and discards them)
            data = await asyncio.to_thread(join_bodies, parts, spool_over=SPOOL_OVER_BYTES)
        finally:
            if not joined:  # a later file failed: the ones fetched before it are not kept
                for part in parts:
                    if isinstance(part, Spooled):
                        part.discard()
        answered = _answered(op.partial_effects)
        lines = await lines_short(data, answered)
        if lines is not None:
            return NoAnswer(
                "incomplete_result",
                f"the output and error files hold {lines} line(s), but the batch's request_counts say "
                f"{answered} request(s) were answered: the files are incomplete (cut short on the way, or not "
                "all written yet); nothing is stored, and they are read again later",
            )
        return Response(
            http_status=200,
            headers={"Content-Type": "application/jsonl"},
            provider_request_id=last.provider_request_id,
            raw=data if isinstance(data, bytes) else None,
            spooled=data if isinstance(data, Spooled) else None,
        )

    async def _files_now(self, op: Operation) -> list[tuple[str, str]] | Response | NoAnswer:
        """The batch's output and error files as a status read gives them now, or why there are none."""
        seen = await self.status(op)
        resp = seen.response
        if resp.http_status is None:
            return NoAnswer(seen.error_class or "no_answer", "re-reading the batch for its output and error files")
        if resp.http_status != 200:
            return dataclasses.replace(resp, body={"batch": "re-read for its file ids", "answer": resp.body})
        files = _parse_ref(seen.result_ref)
        if files:
            return files
        return NoAnswer(
            "no_result_file",
            f"the batch is {seen.raw_state or 'in an unknown state'} but names no output_file_id or error_file_id "
            "that can be used (null, or not a plain file id): nothing to fetch yet; it is read again later, and "
            "if that stays so, look at the batch in OpenAI's dashboard",
        )


#: the purposes an upload may name (``openai.types.file_create_params.FilePurpose``)
FILE_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class _Upload:
    """A multipart body (built afresh for every send: a re-send after a rotated credential reads it again)."""

    purpose: str
    filename: str
    content: bytes


class OpenAIFileProvider(_OpenAIProvider):
    """``POST /v1/files`` as its own recorded operation: the upload a batch's ``input_file_id`` names.

    A request is ``{"path": "/abs/input.jsonl", "sha256": "<hex>", "purpose": "batch"}``: the digest puts
    the content into the request fingerprint, and the file is sent only if it still has it. The uploaded
    file is named ``jobtrail-<token>-<name>``, so a lost answer is reconciled by listing
    ``GET /v1/files?purpose=...`` for that prefix. The file object is the operation's result.
    """

    kind = "openai-file"
    contract_note = (
        "OpenAI has no idempotency key for uploads: the file is named jobtrail-<token>-<name>, and an upload "
        "whose answer was lost is reconciled by listing GET /v1/files?purpose=... (newest first, back to the "
        "operation's creation) for that name. The file is sent only if its sha256 is the one submitted. "
        "The result is the file object (its id is a batch's input_file_id)."
    )

    def check_request(self, request: Any) -> tuple[Path, str, str, str]:
        """(path, sha256, purpose, name) of a valid upload request; ConfigError naming what is wrong."""
        if not isinstance(request, Mapping):
            raise ConfigError('an openai-file request is {"path": "/abs/file.jsonl", "sha256": "<hex>"}')
        path, digest = request.get("path"), request.get("sha256")
        if not isinstance(path, str) or not Path(path).is_absolute():
            raise ConfigError("an openai-file request needs path: the absolute path of the file to upload")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ConfigError(
                "an openai-file request needs sha256: the file's digest (64 lowercase hex), so the request "
                "fingerprint covers its content"
            )
        purpose = request.get("purpose", "batch")
        if purpose not in FILE_PURPOSES:
            raise ConfigError(f"purpose: expected one of {', '.join(FILE_PURPOSES)}, got {purpose!r}")
        name = request.get("filename", Path(path).name)
        if not isinstance(name, str) or not name or "/" in name or unusable(name, None) is not None:
            raise ConfigError("filename: expected a plain file name")
        unknown = sorted(set(request) - {"path", "sha256", "purpose", "filename"})
        if unknown:
            raise ConfigError(f"unknown key {unknown[0]!r} in an openai-file request")
        return Path(path), digest, purpose, name[-100:]

    async def create(self, op: Operation) -> CreateOutcome:
        try:
            path, digest, purpose, name = self.check_request(op.request_body)
            content = await asyncio.to_thread(_read, path)
        except (ConfigError, OSError) as exc:
            detail = str(exc) if isinstance(exc, ConfigError) else f"cannot read {exc.filename}: {exc.strerror}"
            return CreateOutcome(kind="not_sent", error_class="invalid_request", detail=detail)
        seen = hashlib.sha256(content).hexdigest()
        if seen != digest:
            return CreateOutcome(
                kind="not_sent",
                error_class="content_changed",
                detail=f"{path} has sha256 {seen}, not the {digest} submitted: the file changed since; "
                "submit it again (a new operation)",
            )
        upload = _Upload(purpose, f"jobtrail-{op.idempotency_token}-{name}", content)
        sent = await self._send("POST", self._url("/v1/files", op), op, body=upload)
        if isinstance(sent, NoAnswer):
            return sent.create_outcome()
        outcome = self.classify_create(sent)
        if outcome.kind == "confirmed" and isinstance(sent.body, dict):
            # the upload is done when it is answered: the file object is the result
            return dataclasses.replace(outcome, kind="synchronous", result=sent.body)
        return outcome

    async def lookup(self, op: Operation, mode: ReconcileMode) -> LookupOutcome:
        if mode is not ReconcileMode.LIST_BY_REFERENCE:
            return LookupOutcome(kind="unknown", path=mode, detail=f"{mode.value} is not offered by OpenAI")
        try:
            _path, _digest, purpose, _name = self.check_request(op.request_body)
        except ConfigError as exc:
            return LookupOutcome(kind="unknown", path=mode, detail=str(exc))
        since_s = op.created_at_us / 1_000_000 - LIST_MARGIN_S
        listed = await self._list_recent(op, f"/v1/files?purpose={purpose}&order=desc&limit=100", since_s)
        if isinstance(listed, LookupOutcome):
            return listed
        files, summary, last = listed
        prefix = f"jobtrail-{op.idempotency_token}-"
        ids = tuple(str(f["id"]) for f in files if str(f.get("filename", "")).startswith(prefix))
        return _matched(
            mode,
            last,
            summary,
            ids,
            f"no file among the {summary['scanned']} uploaded since the operation carries our name",
        )

    async def _transport(
        self, method: str, url: str, headers: Mapping[str, str], body: Any, max_bytes: int
    ) -> WireAnswer | NoAnswer:
        if not isinstance(body, _Upload):
            return await super()._transport(method, url, headers, body, max_bytes)
        form = aiohttp.FormData()
        form.add_field("purpose", body.purpose)
        form.add_field("file", body.content, filename=body.filename, content_type="application/octet-stream")
        return await self._exchange(method, url, max_bytes, headers=headers, data=form)


def _read(path: Path) -> bytes:
    return path.read_bytes()


def _result_ref(batch: Mapping[str, Any], redactor: Redactor) -> str | None:
    """``openai-files:output=<id>,error=<id>`` for the files a batch has (None: neither is usable)."""
    parts = []
    for role in ("output", "error"):
        file_id = batch.get(f"{role}_file_id")
        if isinstance(file_id, str) and _ID.fullmatch(file_id) and unusable(file_id, redactor) is None:
            parts.append(f"{role}={file_id}")
    return _REF_PREFIX + ",".join(parts) if parts else None


def _answered(effects: Any) -> int | None:
    """How many requests the last status read counted as done (completed + failed): each has a line in the
    output or error file. None when no usable counts were seen (nothing to hold the files to)."""
    counts = effects.get("request_counts") if isinstance(effects, dict) else None
    if not isinstance(counts, dict):
        return None
    done, failed = counts.get("completed"), counts.get("failed")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (done, failed)):
        return None
    assert isinstance(done, int) and isinstance(failed, int)
    return done + failed


def _parse_ref(ref: str | None) -> list[tuple[str, str]]:
    if ref is None or not ref.startswith(_REF_PREFIX):
        return []
    files = []
    for part in ref[len(_REF_PREFIX) :].split(","):
        role, _, file_id = part.partition("=")
        if role in ("output", "error") and _ID.fullmatch(file_id):
            files.append((role, file_id))
    return files


def _error_response(sent: Response, what: str) -> Response:
    """A failed file read, its error body parsed for the observation (never the raw bytes)."""
    raw = sent.content() or b""
    try:
        body: Any = parse_answer(raw[:65536].decode("utf-8", errors="replace")) if raw.strip() else None
    except ValueError:
        body = {"_jobtrail_unparsed": raw[:2000].decode("utf-8", errors="replace")}
    return Response(
        http_status=sent.http_status,
        headers=sent.headers,
        body={"file": what, "answer": body},
        provider_request_id=sent.provider_request_id,
        retry_after_s=sent.retry_after_s,
    )


__all__ = ["TOKEN_KEY", "OpenAIBatchProvider", "OpenAIFileProvider", "build", "contract", "file_contract"]


def _matched(
    mode: ReconcileMode, last: Response, summary: dict[str, Any], ids: tuple[str, ...], absent: str
) -> LookupOutcome:
    """What a listing proved: the jobs that carry our reference (found), or that none does (absent)."""
    summary["matched"] = list(ids)
    response = dataclasses.replace(last, body=summary)
    if ids:
        return LookupOutcome(kind="found", path=mode, response=response, remote_job_ids=ids)
    if not summary.get("complete", True):  # a list not read to its end proves no absence
        return LookupOutcome(kind="unknown", path=mode, response=response, detail=summary["stopped"])
    return LookupOutcome(kind="absent", path=mode, response=response, detail=absent)
