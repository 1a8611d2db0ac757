"""``kind = "replicate"``: Replicate predictions (``POST /v1/predictions``), spoken over plain HTTP.

The wire contract (fixed here, not in the operator's file):

* create ``POST /v1/predictions`` with ``{version, input, webhook?, ...}`` (the request body as
  submitted), ``Authorization: Bearer``, and ``Prefer: wait=N`` on the create only; the answer is
  201 with the prediction, which may already be finished when the wait was long enough;
* status ``GET /v1/predictions/{id}``: ``starting`` / ``processing`` / ``succeeded`` / ``failed`` /
  ``canceled`` / ``aborted`` (its deadline passed before it started: it never ran, and is not
  billed); ``output`` is a file URL, a list of file URLs, or any JSON;
* cancel ``POST /v1/predictions/{id}/cancel``;
* errors are ``{"detail": ..., "status": ...}`` problem bodies; 429 carries ``Retry-After``.

Replicate documents no idempotency key, so no token is sent and a create whose answer was lost
cannot be reconciled: the operation stops at ``needs_attention``, and :meth:`candidates` lists the
predictions of the same version created in the create's window (cursor paging over
``GET /v1/predictions``) for the person who decides. They are never adopted.

Results: a single file URL (or a list holding one) is downloaded from ``replicate.delivery``
WITHOUT the credential and stored byte for byte with its served content type; several file URLs
are all downloaded and stored as one JSON bundle (the delivery links expire after about an hour,
so storing only the links would lose the files); any other output is stored as its JSON.
Replicate removes an API prediction's input, output and files about an hour after it ends and says
so with ``data_removed``: a prediction collected after that ends ``result_unavailable`` naming the
cause, never with its emptied ``output`` as the result.

No SDK: the ``replicate`` package would hide the wire (retries we do not control, no hook for
the credential-free download or the create's ``Prefer`` header); the contract is small HTTP.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from jobtrail.domain.canonical import canonical_bytes
from jobtrail.domain.errors import ConfigError
from jobtrail.domain.jsonpath import unusable
from jobtrail.domain.record import Operation
from jobtrail.domain.redact import Redactor
from jobtrail.domain.states import RemoteState
from jobtrail.providers.contract import CreateOutcome, LookupOutcome, NoAnswer, ReconcileMode, Response, StatusOutcome
from jobtrail.providers.egress import UrlRefused
from jobtrail.providers.http import HttpProvider, parse_config
from jobtrail.providers.kinds import operator_settings

DEFAULT_BASE_URL = "https://api.replicate.com"
#: where Replicate serves output files (fetched without the credential)
DELIVERY_HOSTS = ("replicate.delivery", "*.replicate.delivery")
#: Replicate holds a ``Prefer: wait`` create for at most 60 s
MAX_WAIT_S = 60
#: the list is newest first, 100 a page: this many pages bound one candidates search
MAX_PAGES = 20
#: provider and local clocks may differ: the candidates window is widened by this much each side
CLOCK_SKEW_S = 60

STATES = {
    "queued": ["starting"],
    "running": ["processing"],
    "succeeded": ["succeeded"],
    "failed": ["failed"],
    "cancelling": [],
    "cancelled": ["canceled"],
    # "aborted": the prediction's deadline passed before it started, so it never ran (and is not billed).
    # Expired, not failed: the job's time ran out, as an expired batch's did; the state machine ends both
    # in failed, and the reason keeps the raw "aborted". Not cancelled either: Replicate says "canceled"
    # for a deadline that passes once it runs, and cancelled here means a cancel took effect
    "expired": ["aborted"],
}

_US = 1_000_000
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$")


def build(kind: str, data: Mapping[str, Any], source: str) -> HttpProvider:
    """The Replicate adapter for an operator's file (see ``examples/replicate.toml``)."""
    settings = operator_settings(kind, data, source, also=("download_hosts", "wait_s", "max_result_bytes"))
    wait_s = settings.pop("wait_s", 10)
    timeout_s = settings.get("timeout_s", 30.0)
    if isinstance(wait_s, bool) or not isinstance(wait_s, int) or not 0 <= wait_s <= MAX_WAIT_S:
        raise ConfigError(
            f"{source}: wait_s: expected whole seconds 0..{MAX_WAIT_S} (0: no Prefer: wait), got {wait_s!r}"
        )
    if isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool) and wait_s >= timeout_s:
        raise ConfigError(
            f"{source}: wait_s ({wait_s}) must be below timeout_s ({timeout_s}): a create Replicate holds for "
            "wait_s would otherwise time out and become a doubt; lower wait_s or raise timeout_s"
        )
    extra_hosts = settings.pop("download_hosts", [])
    if isinstance(extra_hosts, str):
        extra_hosts = [extra_hosts]
    result: dict[str, Any] = {"kind": "safe_read", "download_hosts": [*DELIVERY_HOSTS, *extra_hosts]}
    if "max_result_bytes" in settings:
        result["max_bytes"] = settings.pop("max_result_bytes")
    contract: dict[str, Any] = {
        "name": "replicate",
        "base_url": DEFAULT_BASE_URL,
        "credential": "env:REPLICATE_API_TOKEN",
        **settings,
        "auth": "bearer",
        "create": {"path": "/v1/predictions", "token": {"in": "none"}, "job_id": "$.id"},
        "status": {
            "path": "/v1/predictions/{job_id}",
            "state": "$.status",
            "time": "$.completed_at",
            "error": "$.error",  # a failed prediction's message (the model's exception)
        },
        "states": STATES,
        "cancel": {"path": "/v1/predictions/{job_id}/cancel", "idempotent": True},
        "result": result,
    }
    provider = ReplicateProvider(parse_config(contract, source))
    provider.wait_s = wait_s
    return provider


class ReplicateProvider(HttpProvider):
    """Replicate's predictions API; see the module docstring for the contract."""

    kind = "replicate"
    contract_note = (
        "Replicate documents no idempotency key: no token is sent, and a create whose answer was lost "
        "stops at needs_attention with the predictions of the same version created in its window named "
        "as candidates (never adopted). A 429 on a create is a refusal before processing and is retried. "
        "Output files are fetched from replicate.delivery without the credential."
    )
    #: seconds of ``Prefer: wait`` on the create (0: none)
    wait_s: int = 10

    async def create(self, op: Operation) -> CreateOutcome:
        # Prefer: wait belongs to the create alone: a GET carrying it would be held by Replicate
        headers = {"Prefer": f"wait={self.wait_s}"} if self.wait_s else {}
        cfg = self.config
        sent = await self._send("POST", self._url(cfg.create.path, op), op, body=op.request_body, extra_headers=headers)
        if isinstance(sent, NoAnswer):
            return sent.create_outcome()
        return self.classify_create(sent)

    def classify_create(self, resp: Response) -> CreateOutcome:
        status = resp.http_status or 0
        body = resp.body if isinstance(resp.body, dict) else {}
        if status == 429:
            # the rate limiter refuses before a prediction is made; without a token, calling this a
            # doubt would stop the operation for a person although nothing can exist
            return CreateOutcome(
                kind="not_sent",
                response=resp,
                error_class="rate_limited",
                detail=f"HTTP 429 from Replicate's rate limiter (no prediction is made); {_problem(body)}",
            )
        if 200 <= status < 300 and body.get("status") == "succeeded" and body.get("output") is not None:
            job_id = _usable(body.get("id"), self.redactor)
            # finished within Prefer: wait (any 2xx, not only 200): a JSON output is the result itself;
            # file outputs still have to be downloaded, so the job is confirmed and collected as usual
            if job_id is not None and _file_urls(body["output"], self.redactor) is None:
                return CreateOutcome(kind="synchronous", response=resp, remote_job_id=job_id, result=body["output"])
        outcome = super().classify_create(resp)
        if outcome.kind == "rejected" and body:
            return dataclasses.replace(outcome, detail=f"HTTP {status}: {_problem(body)}")
        return outcome

    async def status(self, op: Operation) -> StatusOutcome:
        outcome = await super().status(op)
        body = outcome.response.body
        ref = None
        if outcome.remote_state is RemoteState.SUCCEEDED and isinstance(body, dict):
            files = _file_urls(body.get("output"), self.redactor)
            if files is not None and len(files) == 1:
                ref = files[0]
        # the declared path reads no reference: only a single file URL is one; JSON and several
        # files are read from the prediction again when the result is collected
        return dataclasses.replace(outcome, result_ref=ref)

    async def fetch_result(self, op: Operation, result_ref: str | None) -> Response | NoAnswer:
        if result_ref is not None:
            return await super().fetch_result(op, result_ref)
        cfg = self.config
        assert cfg.status is not None
        sent = await self._send("GET", self._url(cfg.status.path, op), op)
        if isinstance(sent, NoAnswer):
            return sent
        body = sent.body if isinstance(sent.body, dict) else {}
        if sent.http_status != 200 or body.get("status") != "succeeded":
            # no bytes handed over (raw stays None): the collect flow retries, or says why not
            return dataclasses.replace(
                sent, body={"error": "not_succeeded", "detail": f"the prediction is {body.get('status')!r}"}
            )
        if body.get("data_removed") is True:
            # Replicate's data retention removed the output (API predictions, about an hour after they end):
            # the emptied output is not the result, and asking again cannot bring it back
            return NoAnswer(
                "refused",
                "the output was removed by Replicate's data retention (data_removed: true; API predictions "
                "keep their output about an hour after they end); it can no longer be fetched",
                # "refused" ends the collect at once (result_unavailable); the prediction read that proves it
                # is named in the fetch's observation
                {"http_status": "200", "data_removed": "true", "provider_request_id": sent.provider_request_id or ""},
            )
        if "output" not in body:
            # an answer without the field is not a prediction whose output is null: storing "null" as the
            # result would claim one nobody sent (no bytes handed over: the collect flow asks again)
            return dataclasses.replace(
                sent, body={"error": "no_output", "detail": "the succeeded prediction's answer has no output field"}
            )
        output = body.get("output")
        files = _file_urls(output, self.redactor)
        if files is None:
            return _json_result(sent, canonical_bytes(output))
        if len(files) == 1:
            return await super().fetch_result(op, files[0])
        return await self._bundle(op, sent, files)

    async def _bundle(self, op: Operation, prediction: Response, urls: list[str]) -> Response | NoAnswer:
        """Every file of a several-file output, as one JSON document (each file base64, with its sha256)."""
        files = []
        total = 0
        for url in urls:
            got = await super().fetch_result(op, url)
            if isinstance(got, NoAnswer):
                return got  # nothing stored; the collect flow retries or says why not
            raw = await asyncio.to_thread(got.content)  # a bundle is one JSON document: in memory by nature
            if got.http_status != 200 or raw is None:
                return got  # nothing stored; the collect flow retries or says why not
            total += len(raw)
            if total > self.result_spec.max_bytes:
                return Response(
                    http_status=got.http_status,
                    body={
                        "error": "too_large",
                        "detail": f"the output files exceed {self.result_spec.max_bytes} bytes",
                    },
                )
            content_type = next((v for k, v in got.headers.items() if k.lower() == "content-type"), None)
            files.append(
                {
                    "url": url,
                    "content_type": content_type,
                    "size": len(raw),
                    "sha256": hashlib.sha256(raw).hexdigest(),
                    "base64": base64.b64encode(raw).decode("ascii"),
                }
            )
        return _json_result(prediction, canonical_bytes({"output": urls, "files": files}))

    lists_candidates = True

    async def candidates(self, op: Operation, since_us: int, until_us: int) -> LookupOutcome:
        """The predictions of the same version created in the window (newest-first cursor pages)."""
        mode = ReconcileMode.LIST_BY_REFERENCE
        body = op.request_body if isinstance(op.request_body, dict) else {}
        version = body.get("version")
        low, high = since_us - CLOCK_SKEW_S * _US, until_us + CLOCK_SKEW_S * _US
        url: str | None = self.config.base_url + "/v1/predictions"
        found: list[str] = []
        last = Response()
        pages = 0
        while url is not None:
            if pages == MAX_PAGES:
                return LookupOutcome(
                    kind="candidates",
                    path=mode,
                    response=last,
                    remote_job_ids=tuple(found),
                    detail=f"incomplete: stopped after {MAX_PAGES} pages of predictions; older ones were not read",
                )
            sent = await self._send("GET", url, op)
            pages += 1
            if isinstance(sent, NoAnswer):
                return LookupOutcome(kind="unknown", path=mode, remote_job_ids=tuple(found), detail=str(sent))
            last = sent
            page = sent.body if isinstance(sent.body, dict) else {}
            results = page.get("results")
            if sent.http_status != 200 or not isinstance(results, list):
                return LookupOutcome(
                    kind="unknown", path=mode, response=sent, detail=f"HTTP {sent.http_status} without a results list"
                )
            older = False
            for item in results:
                if not isinstance(item, dict):
                    continue
                created = _epoch_us(item.get("created_at"))
                job_id = _usable(item.get("id"), self.redactor)
                if job_id is None or (version is not None and not _same_version(version, item)):
                    continue
                if created is None:
                    found.append(job_id)  # cannot be ruled out by time
                elif created < low:
                    older = True
                elif created <= high:
                    found.append(job_id)
            following = page.get("next")
            if older or not isinstance(following, str) or not following:
                break
            try:
                home = self.egress.judge(self.egress.resolve_reference(following)).home
            except UrlRefused:
                home = False
            if not home:
                return LookupOutcome(
                    kind="unknown",
                    path=mode,
                    response=sent,
                    remote_job_ids=tuple(found),
                    detail="the next page link points away from the API origin; not followed",
                )
            url = self.egress.resolve_reference(following)
        what = f"version {version}" if version else "any version"
        return LookupOutcome(
            kind="candidates",
            path=mode,
            response=last,
            remote_job_ids=tuple(found),
            detail=f"{len(found)} prediction(s) of {what} created within {CLOCK_SKEW_S} s of the create's window",
        )


def _same_version(requested: Any, prediction: Mapping[str, Any]) -> bool:
    """Is ``prediction`` (as listed) of the version the create asked for?

    The create takes ``{owner}/{model}:{version_id}``, a bare version id, or ``{owner}/{model}`` (the
    model's latest version), while a listed prediction carries the bare id in ``version`` and
    ``{owner}/{model}`` in ``model``: compared as strings, the first form would rule out the very
    prediction a lost create made.
    """
    if not isinstance(requested, str):
        return False
    _, colon, version_id = requested.rpartition(":")
    if colon:
        return prediction.get("version") == version_id
    if "/" in requested:  # a model, not a version: whichever version it ran
        return prediction.get("model") == requested
    return prediction.get("version") == requested


def _file_urls(output: Any, redactor: Redactor) -> list[str] | None:
    """The output's file URLs when it is one URL or a list of nothing but URLs; None for other JSON."""
    if isinstance(output, str):
        return [output] if _is_url(output, redactor) else None
    if isinstance(output, list) and output and all(isinstance(v, str) and _is_url(v, redactor) for v in output):
        return list(output)
    return None


def _is_url(text: str, redactor: Redactor) -> bool:
    return text.startswith(("https://", "http://")) and unusable(text, redactor) is None


def _usable(value: Any, redactor: Redactor) -> str | None:
    return value if isinstance(value, str) and value and unusable(value, redactor) is None else None


def _problem(body: Mapping[str, Any]) -> str:
    detail = body.get("detail") or body.get("title")
    return str(detail)[:300] if detail else "no detail given"


def _json_result(source: Response, data: bytes) -> Response:
    return Response(
        http_status=200,
        headers={"Content-Type": "application/json"},
        provider_request_id=source.provider_request_id,
        raw=data,
    )


def _epoch_us(stamp: Any) -> int | None:
    """Replicate's RFC 3339 times (nanosecond fractions included) in epoch microseconds."""
    if not isinstance(stamp, str):
        return None
    match = _STAMP.match(stamp)
    if match is None:
        return None
    whole, fraction, zone = match.groups()
    try:
        at = datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone))
    except ValueError:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return int(at.timestamp()) * _US + int((fraction or "0")[:6].ljust(6, "0"))
