"""Stored results: a checked result lands with the transition that records it, and is served only verified.

Small results are stored in the database; large ones as content-addressed files
under the data directory (:mod:`jobtrail.ledger.files`), verified on every read
against the sha256 the operation's history recorded. The checks that decide
whether a result is valid are the domain's (:mod:`jobtrail.domain.results`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import sqlalchemy as sa

from jobtrail.domain.results import Buffer, ResultBytes, ResultCarriesCredential, ResultCorrupted, ResultMissing
from jobtrail.ledger import schema as t
from jobtrail.ledger.audit import edited_result_fields, recorded_result
from jobtrail.ledger.chain import entry_hash
from jobtrail.ledger.files import data_dir, write_atomically
from jobtrail.ledger.store import Store, StoredResult

#: results up to this size live in the database; larger ones are files
INLINE_MAX_BYTES = 256 * 1024
#: a spooled result is scanned for credentials this much at a time, each window overlapping the last
_SCAN_WINDOW, _SCAN_OVERLAP = 4 * 1024 * 1024, 64 * 1024


def prepare_result(
    store: Store,
    operation_id: str,
    data: bytes | ResultBytes,
    *,
    content_type: str | None,
    checks: list[dict[str, Any]],
    summary: dict[str, Any] | None,
) -> StoredResult:
    """Make a validated result ready to store with the transition that records it.

    A result is the user's data: nothing in it is masked or rewritten, so its sha256 is the
    one the history records. A large one is written now to its content-addressed file (a
    file no row names yet is harmless: the same bytes reuse it), streamed from wherever it
    was spooled; the row lands with the transition (:attr:`Change.result`), in the same
    transaction and under the same fence. One that carries a configured credential (in any
    encoding) is refused (:class:`ResultCarriesCredential`), never stored.
    """
    view: ResultBytes = Buffer(data) if isinstance(data, bytes) else data
    if carries_secret(store, view):
        raise ResultCarriesCredential(
            f"the result of {operation_id} carries a configured credential; it was not stored",
            operation_id=operation_id,
        )
    digest, size = view.sha256, view.size
    body: bytes | None = None
    path: str | None = None
    if size > INLINE_MAX_BYTES:
        directory = data_dir(store)
        path = str(write_atomically(directory, digest, view).relative_to(directory))
    else:
        body = view.read()
    return StoredResult(
        sha256=digest, size=size, content_type=content_type, body=body, path=path, checks=checks, summary=summary
    )


def carries_secret(store: Store, view: ResultBytes) -> bool:
    """Whether the bytes hold a configured credential, scanned a window at a time (the windows overlap
    by more than any encoded form of a credential is long)."""
    return any(store.redactor.contains_secret(window) for window in view.windows(_SCAN_WINDOW, _SCAN_OVERLAP))


def stored_result(store: Store, operation_id: str) -> dict[str, Any] | None:
    row = _stored_row(store, operation_id)
    return None if row is None else _decoded(row)


def _stored_row(store: Store, operation_id: str) -> dict[str, Any] | None:
    with store._read() as conn:
        row = conn.execute(sa.select(t.results).where(t.results.c.operation_id == operation_id)).mappings().first()
    return None if row is None else dict(row)


def _decoded(row: dict[str, Any]) -> dict[str, Any]:
    out = dict(row)
    out["checks"] = json.loads(out["checks"])
    out["summary"] = None if out["summary"] is None else json.loads(out["summary"])
    return out


def recorded_digest(store: Store, operation_id: str) -> tuple[int, str, dict[str, Any] | None] | None:
    """(seq, sha256, the digests of the rest of its row) the operation's own history recorded for its stored
    result (None for an entry written before it covered the rest), or None.

    Each history entry read here must still hash to its stored hash; the full
    chain, row and anchor checks are ``jobtrail audit verify``'s.
    """

    with store._read() as conn:
        entries = [
            dict(r)
            for r in conn.execute(
                sa.select(t.history).where(t.history.c.operation_id == operation_id).order_by(t.history.c.seq)
            ).mappings()
        ]
    for entry in entries:
        try:
            intact = entry_hash(entry) == entry["entry_hash"]
        except ValueError:
            intact = False
        if not intact:
            raise ResultCorrupted(
                f"history entry {entry['seq']} of {operation_id} no longer matches its hash, so the result's "
                "recorded sha256 cannot be trusted; run `jobtrail audit verify`",
                operation_id=operation_id,
            )
    return recorded_result(entries)


def read_result(store: Store, operation_id: str) -> tuple[dict[str, Any], bytes]:
    """The stored result and its bytes, verified against the sha256 its history recorded.

    The digest comes from the hash chain, never from the results table: bytes
    and ``results.sha256`` edited together are refused all the same.
    """
    stored = _stored_row(store, operation_id)
    if stored is None:
        op = store.get(operation_id)
        raise ResultMissing(
            f"no result is stored for {operation_id}: it is {op.state.value}"
            + (f" ({op.state_reason})" if op.state_reason else ""),
            operation_id=operation_id,
        )
    recorded = recorded_digest(store, operation_id)
    if recorded is None:
        raise ResultMissing(
            f"a result is stored for {operation_id} but its history never recorded it (storing was "
            "interrupted before it was recorded, or the row was added later); it is not served: "
            "a worker collects the result again while the operation is result_collecting",
            operation_id=operation_id,
        )
    seq, digest, record = recorded
    row = _decoded(stored)
    if row["body"] is not None:
        data = bytes(row["body"])
    else:
        path = data_dir(store) / row["path"]
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ResultMissing(
                f"the result file {path} of {operation_id} cannot be read ({exc.strerror}); "
                "restore it from a backup or point JOBTRAIL_DATA_DIR at it",
                operation_id=operation_id,
            ) from None
    if hashlib.sha256(data).hexdigest() != digest or row["sha256"] != digest:
        raise ResultCorrupted(
            f"the stored result of {operation_id} does not match its sha256 {digest}, as its history "
            f"recorded it (entry {seq}): it was altered or damaged after it was stored; it is not served "
            "(run `jobtrail audit verify`)",
            operation_id=operation_id,
        )
    edited = [] if record is None else edited_result_fields(record, stored)
    if edited:  # what `result --json`, MCP and the dashboard show beside the bytes (a failure count, say)
        raise ResultCorrupted(
            f"the stored result of {operation_id} has its {', '.join(edited)} changed since its history recorded "
            f"it (entry {seq}); it is not served (run `jobtrail audit verify`)",
            operation_id=operation_id,
        )
    row.pop("body", None)
    return row, data
