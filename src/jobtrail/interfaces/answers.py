"""The answers the command line and the MCP tools share, built in one place (shapes: :mod:`.shapes`)."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from jobtrail.domain.canonical import nesting, rfc3339
from jobtrail.domain.explain import cancel_story
from jobtrail.domain.results import describe, is_json
from jobtrail.interfaces.shapes import OperationListJson, ResultJson, StatusJson, WaitJson

if TYPE_CHECKING:
    from jobtrail.domain.record import Operation
    from jobtrail.ledger.store import Store

#: a result up to this size is inlined in ``result --json`` and ``get_result``; a larger one is named
RESULT_INLINE_BYTES = 64 * 1024


def status_json(store: Store, op: Operation) -> StatusJson:
    """The operation, what the last status read saw (when, the provider's progress 0..1), whether it
    waits for a worker that is not running, and the story of a cancel if one was asked for."""
    from jobtrail.runtime.liveness import no_worker

    seen = store.last_seen(op.operation_id)
    missing = no_worker(store, op)
    doc = op.to_json() | {
        "last_observed_at": None if seen is None else rfc3339(seen[0]),
        "progress": None if seen is None else seen[1],
        "no_worker": missing,
        "cancel": cancel_story(op, store.history(op.operation_id)),
    }
    if missing:  # waiting for a worker that is not there would be for ever: the advice says what moves it
        doc["advice"] = f"{missing}; then wait (wait_for_change, or jobtrail wait)"
    return cast(StatusJson, doc)


def wait_json(status: StatusJson, *, changed: bool, settled: bool) -> WaitJson:
    return cast(WaitJson, {**status, "changed": changed, "settled": settled})


def listing(items: list[Any], total: int) -> OperationListJson:
    """Every list: one object (never a bare list), with how many there are in all."""
    return {"count": len(items), "total": total, "items": items}


_NO_RECORD = dict.fromkeys(("sha256", "size", "content_type", "checks", "summary", "redacted", "stored"))


def result_missing(operation_id: str, why: str) -> ResultJson:
    return cast(
        ResultJson,
        {"operation_id": operation_id, "why": why, **_NO_RECORD, "result": None}
        | dict.fromkeys(("result_text", "result_base64", "note", "out")),
    )


def result_found(
    row: Mapping[str, Any], data: bytes, jobtrail: str, *, out: str | None = None, max_depth: int | None = None
) -> ResultJson:
    """A stored result's record and its content: JSON parsed, other text as text, other bytes in base64;
    larger than :data:`RESULT_INLINE_BYTES`, a note says how to fetch it instead (``jobtrail``: how that
    command reaches the ledger, :attr:`Store.command`).

    ``max_depth``: JSON nested deeper than this is given unparsed (its exact text, or base64), with a note
    saying so: where the answer goes on as structure that its reader cannot take that deep (an MCP
    client's structured output stops short of what the ledger stores and ``jobtrail result`` hands out).
    """
    doc: dict[str, Any] = describe(row) | {
        "why": None,
        "result": None,
        "result_text": None,
        "result_base64": None,
        "note": None,
        "out": out,
    }
    if len(data) > RESULT_INLINE_BYTES:
        doc["note"] = (
            f"the result is {len(data)} bytes (sha256 {row['sha256']}), more than the {RESULT_INLINE_BYTES} "
            f"shown inline; write it to a file with `{jobtrail} result {row['operation_id']} --out FILE`"
        )
        return cast(ResultJson, doc)
    parsed = None
    depth = nesting(data) if max_depth is not None and is_json(row["content_type"]) else 0
    too_deep = max_depth is not None and depth > max_depth
    if is_json(row["content_type"]) and not too_deep:
        try:
            parsed = json.loads(data)
        except (ValueError, RecursionError):
            parsed = None
    if parsed is not None:
        doc["result"] = parsed
    else:
        try:  # a CSV, a text file: as text; an image or an archive: its exact bytes, in base64
            doc["result_text"] = data.decode("utf-8")
        except UnicodeDecodeError:
            doc["result_base64"] = base64.b64encode(data).decode("ascii")
    if too_deep:
        given = "result_text" if doc["result_text"] is not None else "result_base64"
        doc["note"] = (
            f"the result is JSON nested {depth} levels deep, more than the {max_depth} this answer carries as "
            f"structure: {given} holds it exactly as stored (sha256 {row['sha256']}), for you to parse; or write it "
            f"to a file with `{jobtrail} result {row['operation_id']} --out FILE`"
        )
    return cast(ResultJson, doc)
