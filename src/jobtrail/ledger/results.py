"""Results: what a finished job produced, checked and stored, or the exact reason it was not.

Checks, each recorded with its outcome: declared content type, size limit,
checksum (sha256 from a response header), JSON Schema, record count, per-item
batch outcomes (JSONL keyed by an id), and a caller's own check. Small results
are stored in the database; large ones as content-addressed files under the
data directory, written atomically and verified on every read.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from jobtrail.domain.canonical import parse_json
from jobtrail.domain.errors import ConfigError, OperationalError
from jobtrail.domain.jsonpath import extract, extract_any
from jobtrail.ledger import schema as t
from jobtrail.ledger.store import Store, StoredResult

#: results up to this size live in the database; larger ones are files
INLINE_MAX_BYTES = 256 * 1024
#: at most this many failed item ids are listed in a batch summary
FAILED_IDS_LISTED = 1000

Check = Callable[[Any], Any]


class ResultMissing(OperationalError):
    """No result is stored for this operation (the message says why)."""


class ResultCarriesCredential(OperationalError):
    """A result holds a configured credential: it is refused, never stored or handed out."""


#: the check a credential-carrying result fails, as recorded in the state and the history
NO_CREDENTIALS_CHECK = "no_credentials"
NO_CREDENTIALS_REASON = (
    "no_credentials: the result carries a credential configured for this provider (the provider echoed it, "
    "possibly encoded); it was neither stored nor handed out. Ask the provider why, and rotate the credential"
)


class ResultCorrupted(OperationalError):
    """A stored result no longer matches the sha256 its history recorded."""


@dataclass(frozen=True, slots=True)
class BatchFormat:
    """Per-item results: one JSON object per line, keyed by an id, failed when ``error`` is set."""

    id_path: str = "$.custom_id"
    error_path: str = "$.error"


@dataclass(frozen=True, slots=True)
class ResultSpec:
    """What a valid result looks like (the ``[result]`` table of a provider file)."""

    content_type: str | None = None
    max_bytes: int = 256 * 1024 * 1024
    checksum_header: str | None = None
    schema: Mapping[str, Any] | None = None
    records_path: str | None = None
    min_records: int | None = None
    batch: BatchFormat | None = None
    check: str | None = None


@dataclass(slots=True)
class Validation:
    """Every check's outcome; ``failed`` is the first that did not pass."""

    checks: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    document: Any = None

    def add(self, name: str, ok: bool, expected: Any = None, seen: Any = None) -> bool:
        self.checks.append({"check": name, "ok": ok, "expected": expected, "seen": seen})
        return ok

    @property
    def failed(self) -> dict[str, Any] | None:
        return next((c for c in self.checks if not c["ok"]), None)


def load_check(name: str) -> Check:
    """Resolve a named check ``package.module:function`` from a provider file."""
    module, _, attr = name.partition(":")
    try:
        found = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"result check {name!r} cannot be imported ({exc}); use package.module:function") from None
    if not callable(found):
        raise ConfigError(f"result check {name!r} is not callable")
    check: Check = found
    return check


def validate(
    data: bytes,
    content_type: str | None,
    headers: Mapping[str, str],
    spec: ResultSpec,
    extra_check: Check | None = None,
) -> Validation:
    """Run every declared check on the fetched bytes; stop at the first failure."""
    v = Validation()
    seen_type = (content_type or "").split(";")[0].strip() or None
    if spec.content_type and not v.add("content_type", seen_type == spec.content_type, spec.content_type, seen_type):
        return v
    if not v.add("size", len(data) <= spec.max_bytes, f"<= {spec.max_bytes} bytes", len(data)):
        return v
    digest = hashlib.sha256(data).hexdigest()
    if spec.checksum_header:
        declared = extract(f"header:{spec.checksum_header}", None, headers)
        declared = (declared or "").removeprefix("sha256=").strip().lower() or None
        if not v.add("checksum", declared == digest, declared or "a sha256 header", digest):
            return v
    if spec.batch is not None:
        return _batch(data, spec, v, extra_check)
    try:
        v.document = parse_json(data) if data.strip() else None
    except ValueError as exc:
        v.add("json", False, "valid JSON", f"{exc}")
        return v
    if spec.schema is not None and not _schema(v, spec.schema):
        return v
    if spec.records_path:
        records = extract_any(spec.records_path, v.document)
        count = len(records) if isinstance(records, list) else None
        wanted = f">= {spec.min_records} records at {spec.records_path}" if spec.min_records else spec.records_path
        if not v.add("record_count", count is not None and count >= (spec.min_records or 0), wanted, count):
            return v
    _extra(v, extra_check, v.document)
    return v


def _schema(v: Validation, schema: Mapping[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(v.document, schema)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        return v.add("json_schema", False, "the declared schema", f"at {where}: {exc.message}")
    except jsonschema.SchemaError as exc:
        raise ConfigError(f"the provider's result schema is not a valid JSON Schema: {exc.message}") from None
    return v.add("json_schema", True)


def _batch(data: bytes, spec: ResultSpec, v: Validation, extra_check: Check | None) -> Validation:
    assert spec.batch is not None
    items: list[Any] = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            items.append(parse_json(line))
        except ValueError:
            v.add("jsonl", False, "one JSON object per line", f"line {number} is not JSON")
            return v
    failed = [
        extract(spec.batch.id_path, item, {}) or f"line:{n}"
        for n, item in enumerate(items, start=1)
        if extract_any(spec.batch.error_path, item)
    ]
    v.summary = {
        "items": len(items),
        "succeeded": len(items) - len(failed),
        "failed": len(failed),
        "failed_ids": failed[:FAILED_IDS_LISTED],
    }
    v.add("jsonl", True, None, f"{len(items)} items")
    if spec.min_records and not v.add(
        "record_count", len(items) >= spec.min_records, f">= {spec.min_records} items", len(items)
    ):
        return v
    v.document = items
    _extra(v, extra_check, items)
    return v


def _extra(v: Validation, check: Check | None, document: Any) -> None:
    if check is None:
        return
    try:
        verdict = check(document)
    except Exception as exc:
        v.add("caller_check", False, "the caller's check to pass", f"{type(exc).__name__}: {exc}")
        return
    ok = verdict is None or verdict is True
    v.add("caller_check", ok, "the caller's check to pass", None if ok else str(verdict))


# -- storage ------------------------------------------------------------------------------------------


def data_dir(store: Store) -> Path:
    """Where large results live: beside a SQLite file, else $JOBTRAIL_DATA_DIR or the user data dir."""
    configured = os.environ.get("JOBTRAIL_DATA_DIR")
    if configured:
        return Path(configured)
    if store.dialect == "sqlite" and store.engine.url.database:
        return Path(f"{store.engine.url.database}-results")
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "jobtrail" / "results"


def _write_atomically(directory: Path, digest: str, data: bytes) -> Path:
    final = directory / digest[:2] / digest
    if final.exists() and hashlib.sha256(final.read_bytes()).hexdigest() == digest:
        return final  # content-addressed: the same bytes are already there
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=".incoming-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return final


def prepare_result(
    store: Store,
    operation_id: str,
    data: bytes,
    *,
    content_type: str | None,
    checks: list[dict[str, Any]],
    summary: dict[str, Any] | None,
) -> StoredResult:
    """Make a validated result ready to store with the transition that records it.

    A result is the user's data: nothing in it is masked or rewritten, so its sha256 is the
    one the history records. A large one is written now to its content-addressed file (a
    file no row names yet is harmless: the same bytes reuse it); the row lands with the
    transition (:attr:`Change.result`), in the same transaction and under the same fence.
    One that carries a configured credential (in any encoding) is refused
    (:class:`ResultCarriesCredential`), never stored.
    """
    if store.redactor.contains_secret(data):
        raise ResultCarriesCredential(
            f"the result of {operation_id} carries a configured credential; it was not stored",
            operation_id=operation_id,
        )
    digest = hashlib.sha256(data).hexdigest()
    body: bytes | None = data
    path: str | None = None
    if len(data) > INLINE_MAX_BYTES:
        directory = data_dir(store)
        body, path = None, str(_write_atomically(directory, digest, data).relative_to(directory))
    return StoredResult(
        sha256=digest, size=len(data), content_type=content_type, body=body, path=path, checks=checks, summary=summary
    )


def stored_result(store: Store, operation_id: str) -> dict[str, Any] | None:
    with store._read() as conn:
        row = conn.execute(sa.select(t.results).where(t.results.c.operation_id == operation_id)).mappings().first()
    if row is None:
        return None
    out = dict(row)
    out["checks"] = json.loads(out["checks"])
    out["summary"] = None if out["summary"] is None else json.loads(out["summary"])
    return out


def describe(row: Mapping[str, Any]) -> dict[str, Any]:
    """The stable JSON shape of a stored result's record (``result --json``, ``ops show --json``, MCP)."""
    return {
        "operation_id": row["operation_id"],
        "sha256": row["sha256"],
        "size": row["size"],
        "content_type": row["content_type"],
        "checks": row["checks"],
        "summary": row["summary"],
        "redacted": row["redacted"],
        "stored": "file" if row["path"] else "database",
    }


def recorded_digest(store: Store, operation_id: str) -> tuple[int, str] | None:
    """(seq, sha256) the operation's own history recorded for its stored result, or None.

    Each history entry read here must still hash to its stored hash; the full
    chain, row and anchor checks are ``jobtrail audit verify``'s.
    """
    from jobtrail.ledger.audit import recorded_result_digest
    from jobtrail.ledger.chain import entry_hash

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
    return recorded_result_digest(entries)


def read_result(store: Store, operation_id: str) -> tuple[dict[str, Any], bytes]:
    """The stored result and its bytes, verified against the sha256 its history recorded.

    The digest comes from the hash chain, never from the results table: bytes
    and ``results.sha256`` edited together are refused all the same.
    """
    row = stored_result(store, operation_id)
    if row is None:
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
    seq, digest = recorded
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
    row.pop("body", None)
    return row, data
