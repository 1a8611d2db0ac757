"""``kind = "anthropic-batch"``: Anthropic Message Batches (``/v1/messages/batches``).

The wire contract is fixed here; the operator's file holds only the credential
reference (sent as ``x-api-key``), the base URL, ``anthropic_version``,
time-outs, limits and polling. See ``examples/anthropic-batch.toml``.

What the API allows us to promise:

- **No at-most-once creation.** A create carries no idempotency key and the
  batch has no metadata field, so nothing ties a batch to the create that made
  it. After a lost answer the operation stops at ``needs_attention``; this
  adapter lists the batches created in that window (:meth:`candidates`) so the
  person deciding sees them. None is ever adopted, and no second create is sent.
- **Honest endings.** ``processing_status`` only says ``ended``; the ending is
  read from ``request_counts``: every item canceled is ``cancelled``, every
  item expired is ``expired``, canceled items beside finished ones are
  ``cancelled`` with partial output, anything else ``succeeded`` with per-item
  outcomes (``$.result.type``) in the stored results file.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from jobtrail.domain.errors import ConfigError
from jobtrail.domain.jsonpath import extract
from jobtrail.domain.record import Operation
from jobtrail.domain.states import RemoteState
from jobtrail.providers.contract import (
    LookupOutcome,
    NoAnswer,
    ReconcileMode,
    Response,
    StatusOutcome,
    lines_short,
)
from jobtrail.providers.http import HttpProvider, parse_config
from jobtrail.providers.kinds import operator_settings

DEFAULT_BASE_URL = "https://api.anthropic.com"
DEFAULT_VERSION = "2023-06-01"
BATCHES = "/v1/messages/batches"
#: the adapter's own keys, besides the ones every built-in adapter's file may set
ADAPTER_KEYS = ("anthropic_version", "max_result_bytes")
#: batches per list page (the API allows 1..1000); a page of this many stays well inside the read bound
LIST_PAGE = 100
#: pages read at most when listing candidates (newest first, so this covers the newest 2,000 batches)
LIST_PAGES = 20
#: leeway on each side of the window for the provider's timestamp rounding (the flow adds clock skew)
MARGIN_S = 2.0
#: an error type in an Anthropic error body that proves the create was refused as sent
_REFUSED = ["invalid_request_error", "authentication_error", "permission_error", "not_found_error", "billing_error"]

CONTRACT_NOTE = (
    "Anthropic Message Batches: a create carries no idempotency key and a batch no metadata, so a create "
    "whose answer is lost cannot be matched to its batch. jobtrail then stops at needs_attention and names "
    "the batches the API lists as created in that window with the same number of requests (never adopting "
    "one, never sending a second create). Endings come from request_counts: all canceled -> cancelled, all "
    "expired -> expired, canceled beside finished items -> cancelled with partial output, otherwise "
    "succeeded with each item's outcome ($.result.type) in the stored results JSONL. No webhooks for "
    "batches: polling only."
)


def contract(settings: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The declarative contract for Anthropic Message Batches, with the operator's settings in it."""
    data = dict(settings)
    version = data.pop("anthropic_version", DEFAULT_VERSION)
    if not isinstance(version, str) or not re.fullmatch(r"\d{4}-\d{2}-\d{2}", version):
        raise ConfigError(f'{source}: anthropic_version: expected a date such as "{DEFAULT_VERSION}", got {version!r}')
    max_bytes = data.pop("max_result_bytes", 256 * 1024 * 1024)
    if data.get("webhooks") is not None:
        raise ConfigError(
            f"{source}: webhooks: Anthropic sends no webhook events for message batches (polling is the only "
            "way to follow one); remove the [webhooks] table"
        )
    if data.get("credential") is None:
        raise ConfigError(
            f'{source}: credential is missing; expected a reference such as "env:ANTHROPIC_API_KEY" '
            "(sent as the x-api-key header, only to base_url's origin)"
        )
    declared: dict[str, Any] = {
        "name": "anthropic",
        "base_url": DEFAULT_BASE_URL,
        "poll": {"initial_s": 5.0, "factor": 1.5, "cap_s": 120.0},
        **data,
        "auth": "header:x-api-key",
        "headers": {"anthropic-version": version},
        "create": {
            "method": "POST",
            "path": BATCHES,
            # no idempotency key exists: nothing is sent, and nothing can be reconciled
            "token": {"in": "none"},
            "job_id": "$.id",
            "error_code": "$.error.type",
            "non_retryable": _REFUSED,
        },
        "status": {
            "path": BATCHES + "/{job_id}",
            "state": "$.processing_status",
            "result_ref": "$.results_url",
            "effects": "$.request_counts",
        },
        "states": {"running": ["in_progress"], "cancelling": ["canceling"]},
        "cancel": {"path": BATCHES + "/{job_id}/cancel", "idempotent": False},
        "result": {
            "kind": "safe_read",
            "max_bytes": max_bytes,
            "batch": {
                "format": "jsonl",
                "id": "$.custom_id",
                "error": "$.result.error",
                "outcome": "$.result.type",
                "succeeded": ["succeeded"],
            },
        },
    }
    return declared


def build(kind: str, data: Mapping[str, Any], source: str) -> HttpProvider:
    """``kind = "anthropic-batch"``: the operator's keys, the fixed contract around them."""
    settings = operator_settings(kind, data, source, also=ADAPTER_KEYS)
    provider = AnthropicBatchProvider(parse_config(contract(settings, source), source))
    return provider


class AnthropicBatchProvider(HttpProvider):
    """Message Batches over :class:`HttpProvider`'s plumbing; endings and candidates in code."""

    kind = "anthropic-batch"
    contract_note = CONTRACT_NOTE

    async def status(self, op: Operation) -> StatusOutcome:
        seen = await super().status(op)
        body = seen.response.body
        if seen.error_class or not isinstance(body, dict):
            return seen
        raw = seen.raw_state
        counts = _counts(body.get("request_counts"))
        total = sum(counts.values()) if counts else 0
        progress = None if not counts or not total else round((total - counts["processing"]) / total, 4)
        when = extract("$.ended_at", body, {}, self.redactor) or extract(
            "$.cancel_initiated_at", body, {}, self.redactor
        )
        if raw == "in_progress":
            return dataclasses.replace(
                seen, remote_state=RemoteState.RUNNING, progress=progress, result_ref=None, provider_time=when
            )
        if raw == "canceling":
            return dataclasses.replace(
                seen, remote_state=RemoteState.CANCELLING, progress=progress, result_ref=None, provider_time=when
            )
        if raw != "ended":
            # an undocumented word: recorded as it came, never taken for an ending
            return dataclasses.replace(seen, remote_state=RemoteState.UNKNOWN, progress=progress, result_ref=None)
        if counts is None or total == 0 or counts["processing"]:
            return dataclasses.replace(
                seen,
                remote_state=RemoteState.UNKNOWN,
                result_ref=None,
                error_class="ended_without_final_request_counts",
            )
        ended = _ending(counts, total)
        ran = counts["succeeded"] + counts["errored"]
        # results_url is set once a batch has ended; a cancelled or expired batch has output only if items ran
        ref = seen.result_ref if ended is RemoteState.SUCCEEDED or ran else None
        return dataclasses.replace(seen, remote_state=ended, progress=progress, result_ref=ref, provider_time=when)

    async def fetch_result(self, op: Operation, result_ref: str | None) -> Response | NoAnswer:
        """The results JSONL from ``results_url``, held to the batch's request counts: every request has a
        line (succeeded, errored, canceled or expired), so fewer lines is an incomplete file, not a result."""
        if result_ref is None:
            # the ending status gave no usable results_url: ask again (the reference stored then never changes)
            seen = await self.status(op)
            if seen.response.http_status is None:
                return NoAnswer(seen.error_class or "no_answer", "re-reading the batch for its results_url")
            if seen.response.http_status != 200:
                return seen.response
            if seen.result_ref is None:
                return NoAnswer(
                    "no_results_url",
                    f"the batch is {seen.raw_state or 'in an unknown state'} but gives no results_url that can "
                    "be used (null, or one that carries a credential or control characters): nothing to fetch "
                    "yet; it is read again later, and if that stays so, look at the batch in the Anthropic "
                    "console",
                )
            result_ref = seen.result_ref
        sent = await super().fetch_result(op, result_ref)
        fetched = sent.fetched if isinstance(sent, Response) and sent.http_status == 200 else None
        counts = _counts(op.partial_effects)
        if fetched is None or not counts:
            return sent
        total = sum(counts.values())
        lines = await lines_short(fetched, total)
        if lines is None:
            return sent
        return NoAnswer(
            "incomplete_result",
            f"the results file holds {lines} line(s), but the batch's request_counts say it has {total} "
            "request(s), each with a line: the file is incomplete (cut short on the way); nothing is stored, "
            "and it is read again later",
        )

    lists_candidates = True

    async def candidates(self, op: Operation, since_us: int, until_us: int) -> LookupOutcome:
        """The batches listed as created between ``since_us`` and ``until_us`` (a margin either side) with
        as many requests as ``op``'s body: newest first, page by page (``after_id`` = ``last_id``)."""
        mode = ReconcileMode.LIST_BY_REFERENCE
        since, until = since_us / 1e6 - MARGIN_S, until_us / 1e6 + MARGIN_S
        wanted = _request_count(op.request_body)
        found: list[str] = []
        ruled_out: list[str] = []
        listed: set[str] = set()
        cursors: set[str] = set()
        seen_total = pages = 0
        after: str | None = None
        last: Response | None = None
        while pages < LIST_PAGES:
            query = {"limit": str(LIST_PAGE), **({"after_id": after} if after else {})}
            url = f"{self.config.base_url}{BATCHES}?{urllib.parse.urlencode(query)}"
            sent = await self._send("GET", url, op)
            pages += 1
            if isinstance(sent, NoAnswer):
                return LookupOutcome(kind="unknown", path=mode, detail=f"listing batches: {sent}")
            last = sent
            body = sent.body
            if sent.http_status != 200 or not isinstance(body, dict) or not isinstance(body.get("data"), list):
                return LookupOutcome(
                    kind="unknown",
                    path=mode,
                    response=sent,
                    detail=f"listing batches: HTTP {sent.http_status} without a data list (page {pages})",
                )
            older = False
            for item in body["data"]:
                seen_total += 1
                job_id = extract("$.id", item, {}, self.redactor)
                created = _epoch(extract("$.created_at", item, {}, self.redactor))
                if job_id is None or created is None or job_id in listed:
                    continue  # (a page served twice must not make one batch two)
                listed.add(job_id)
                if created < since:
                    older = True  # newest first: every later batch is older still
                    continue
                if created > until:
                    continue
                counts = _counts(item.get("request_counts") if isinstance(item, dict) else None)
                if wanted is not None and counts is not None and sum(counts.values()) != wanted:
                    ruled_out.append(job_id)
                    continue
                found.append(job_id)
            if older or body.get("has_more") is not True:
                break
            after = extract("$.last_id", body, {}, self.redactor)
            if after is None:
                return LookupOutcome(
                    kind="unknown",
                    path=mode,
                    response=_summary(sent, pages, seen_total, found, ruled_out),
                    detail=f"listing batches: page {pages} says has_more without a usable last_id to page on",
                )
            if after in cursors:
                # a cursor handed out twice would be paged through until LIST_PAGES, and then be taken for
                # thousands of newer batches
                return LookupOutcome(
                    kind="unknown",
                    path=mode,
                    response=_summary(sent, pages, seen_total, found, ruled_out),
                    detail=f"listing batches: page {pages} points back to a page already read (last_id repeats); "
                    "the list cannot be read to its end",
                )
            cursors.add(after)
        else:
            assert last is not None
            return LookupOutcome(
                kind="unknown",
                path=mode,
                response=_summary(last, pages, seen_total, found, ruled_out),
                detail=f"more than {LIST_PAGES * LIST_PAGE} batches are newer than the window; not all were listed",
            )
        assert last is not None
        return LookupOutcome(
            kind="candidates",
            path=mode,
            response=_summary(last, pages, seen_total, found, ruled_out),
            remote_job_ids=tuple(found),
            detail=f"{len(found)} batch(es) created in the window"
            + (f" with {wanted} request(s)" if wanted is not None else "")
            + (f"; {len(ruled_out)} other(s) in the window have a different request count" if ruled_out else ""),
        )


def _ending(counts: Mapping[str, int], total: int) -> RemoteState:
    """How an ended batch ended, from its final request counts."""
    if counts["canceled"] == total:
        return RemoteState.CANCELLED
    if counts["expired"] == total:
        return RemoteState.EXPIRED
    if counts["canceled"]:
        # items are canceled only by a cancel: the batch was stopped, whatever ran before it stopped
        return RemoteState.CANCELLED
    # every item ran or expired: per-item outcomes in the results file say which failed
    return RemoteState.SUCCEEDED


_COUNT_KEYS = ("processing", "succeeded", "errored", "canceled", "expired")


def _counts(value: Any) -> dict[str, int] | None:
    """``request_counts`` if it has every documented count as a non-negative integer, else None."""
    if not isinstance(value, dict):
        return None
    counts = {key: value.get(key) for key in _COUNT_KEYS}
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts.values()):
        return None
    return {key: int(n) for key, n in counts.items() if n is not None}


def _request_count(body: Any) -> int | None:
    requests = body.get("requests") if isinstance(body, dict) else None
    return len(requests) if isinstance(requests, list) else None


def _epoch(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return None
    return when.timestamp() if when.tzinfo is not None else None


def _summary(last: Response, pages: int, seen: int, found: list[str], ruled_out: list[str]) -> Response:
    """What the listing showed, for the observation: the last page's status and headers, and the ids
    (not every listed batch: a workspace may have thousands)."""
    return Response(
        http_status=last.http_status,
        headers=last.headers,
        provider_request_id=last.provider_request_id,
        body={"pages": pages, "batches_listed": seen, "in_window": found, "other_request_count": ruled_out},
    )


__all__ = ["CONTRACT_NOTE", "AnthropicBatchProvider", "build", "contract"]
