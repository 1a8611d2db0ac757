"""What a valid result looks like, and the checks that decide it (pure: no storage).

Checks, each recorded with its outcome: declared content type, size limit,
checksum (sha256 from a response header), JSON Schema, record count, per-item
batch outcomes (JSONL keyed by an id), and a caller's own check. Storing a
result that passed is the ledger's (:mod:`jobtrail.ledger.results`).
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from jobtrail.domain.canonical import holds_lone_surrogate, names_a_key_twice, parse_json
from jobtrail.domain.errors import ConfigError, OperationalError
from jobtrail.domain.jsonpath import extract, extract_any

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
    """Per-item results: one JSON object per line, keyed by an id.

    An item failed when ``error_path`` is set, or when ``outcome_path`` is declared and its
    value is not one of ``succeeded`` (Anthropic: ``$.result.type`` other than ``succeeded``).
    """

    id_path: str = "$.custom_id"
    error_path: str = "$.error"
    outcome_path: str | None = None
    succeeded: tuple[str, ...] = ("succeeded",)

    def outcome(self, item: Any) -> str:
        """``succeeded``, ``failed``, or the item's own outcome word where ``outcome_path`` gives one."""
        if self.outcome_path is not None:
            # (no redactor: a result's own words, kept only with the result, which is refused whole if it
            # carries a credential: ledger.results.carries_secret)
            said = extract(self.outcome_path, item, {}, None)
            if said is not None and said not in self.succeeded:
                return str(said)
            if said is None:
                return "failed"
        return "failed" if extract_any(self.error_path, item) else "succeeded"


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


class ResultBytes(Protocol):
    """A fetched result's bytes, in memory (:class:`Buffer`) or spooled to a file as they arrived.

    Checks read only what they need: the size and sha256 (computed while the bytes arrived),
    lines for JSONL, the whole only to parse a JSON document.
    """

    @property
    def size(self) -> int: ...

    @property
    def sha256(self) -> str: ...

    def read(self) -> bytes: ...

    def lines(self) -> Iterator[bytes]: ...

    def windows(self, size: int, overlap: int) -> Iterator[bytes]:
        """Overlapping slices (for scanning): each starts ``overlap`` bytes before the last one ended."""
        ...


@dataclass(frozen=True, slots=True)
class Buffer:
    """Result bytes held in memory."""

    data: bytes

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def read(self) -> bytes:
        return self.data

    def lines(self) -> Iterator[bytes]:
        # as a file is read (Spooled.lines): lines end at \n, a \r before it goes
        return (line.removesuffix(b"\r") for line in self.data.split(b"\n"))

    def windows(self, size: int, overlap: int) -> Iterator[bytes]:
        yield self.data


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


def validate(  # noqa: PLR0911 - each check returns at its first failure
    data: bytes | ResultBytes,
    content_type: str | None,
    headers: Mapping[str, str],
    spec: ResultSpec,
    extra_check: Check | None = None,
) -> Validation:
    """Run every declared check on the fetched bytes; stop at the first failure."""
    view: ResultBytes = Buffer(data) if isinstance(data, bytes) else data
    v = Validation()
    seen_type = (content_type or "").split(";")[0].strip() or None
    if spec.content_type and not v.add("content_type", seen_type == spec.content_type, spec.content_type, seen_type):
        return v
    if not v.add("size", view.size <= spec.max_bytes, f"<= {spec.max_bytes} bytes", view.size):
        return v
    if spec.checksum_header:
        digest = view.sha256
        declared = extract(f"header:{spec.checksum_header}", None, headers, None)  # (compared, never kept)
        declared = (declared or "").removeprefix("sha256=").strip().lower() or None
        if not v.add("checksum", declared == digest, declared or "a sha256 header", digest):
            return v
    if spec.batch is not None:
        return _batch(view, spec, v, extra_check)
    if not (is_json(spec.content_type or seen_type) or spec.schema is not None or spec.records_path):
        # bytes are the result (a CSV, an image, a Parquet file): stored as they came, checked by size,
        # checksum and type only (never read whole here), and handed to a caller's check as bytes
        if extra_check is not None:
            _extra(v, extra_check, view.read())
        return v
    data = view.read()  # a JSON document is parsed whole
    if not data.strip() and (spec.content_type or seen_type or spec.schema is not None or spec.records_path):
        # a JSON type named (not only assumed, as for a result with no type at all): nothing is no document
        v.add("json", False, "a JSON document", "an empty body")
        return v
    try:
        v.document = parse_json(data) if data.strip() else None
        twice = names_a_key_twice(data)
    except ValueError as exc:
        v.add("json", False, "valid JSON", f"{exc}")
        return v
    if twice:
        v.add("json", False, "JSON whose objects name each key once", _KEY_TWICE)
        return v
    if b"\\u" in data and holds_lone_surrogate(v.document):
        v.add("json", False, "JSON whose strings are Unicode text", _LONE_SURROGATE)
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


#: why a document that names a key twice in one object fails (its values are not shown: the name may be anything)
_KEY_TWICE = "an object names the same key twice, and readers disagree on which of its values counts"
_LONE_SURROGATE = (
    "a lone surrogate (an escape \\ud800-\\udfff with no partner): no UTF-8 text holds it, and readers "
    "disagree on what it is (kept, replaced, refused)"
)

#: media types whose bytes are JSON (and so parsed, schema- and record-checked)
_JSON_TYPES = frozenset({"application/json", "text/json"})


def is_json(media_type: str | None) -> bool:
    """Whether a result of this type is parsed as JSON; no type at all is taken as JSON, as it always was."""
    if media_type is None:
        return True
    kind = media_type.split(";")[0].strip().lower()
    return kind in _JSON_TYPES or kind.endswith("+json")


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


def _batch(view: ResultBytes, spec: ResultSpec, v: Validation, extra_check: Check | None) -> Validation:
    """Per-item outcomes, read a line at a time: only a caller's own check makes the items be kept."""
    batch = spec.batch
    assert batch is not None
    kept: list[Any] | None = [] if extra_check is not None else None
    count = failures = 0
    failed: list[Any] = []
    by_outcome: dict[str, int] = {}
    for number, line in enumerate(view.lines(), start=1):
        if not line.strip():
            continue
        try:
            item = parse_json(line)
            twice = names_a_key_twice(line)
        except ValueError as exc:
            v.add("jsonl", False, "one JSON object per line", f"line {number} is not JSON ({exc})")
            return v
        if twice:
            v.add("jsonl", False, "one JSON object per line, each key once", f"line {number}: {_KEY_TWICE}")
            return v
        if b"\\u" in line and holds_lone_surrogate(item):
            v.add(
                "jsonl",
                False,
                "one JSON object per line, its strings Unicode text",
                f"line {number}: {_LONE_SURROGATE}",
            )
            return v
        count += 1
        outcome = batch.outcome(item)
        by_outcome[outcome] = by_outcome.get(outcome, 0) + 1
        if outcome != "succeeded":
            failures += 1
            if len(failed) < FAILED_IDS_LISTED:
                failed.append(extract(batch.id_path, item, {}, None) or f"line:{count}")
        if kept is not None:
            kept.append(item)
    v.summary = {
        "items": count,
        "succeeded": count - failures,
        "failed": failures,
        "failed_ids": failed,
        "by_outcome": dict(sorted(by_outcome.items())),
    }
    v.add("jsonl", True, None, f"{count} items")
    if spec.min_records and not v.add("record_count", count >= spec.min_records, f">= {spec.min_records} items", count):
        return v
    if kept is not None:
        v.document = kept
        _extra(v, extra_check, kept)
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
