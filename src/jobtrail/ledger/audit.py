"""Checking the history: every chain, every record, observation and result, and an anchor kept outside.

``verify`` walks each operation's chain and reports, per operation, the first
bad entry with its kind, and then every field the chain no longer covers
(``field`` names it: an operation column, ``observations``, ``observation N``
or ``result``):

``edited``
    an entry's stored fields no longer hash to its stored hash; or a column of
    the operation row, an observation or a stored result differs from the
    digest its history recorded; or an entry starts where the previous one did
    not end (its state, or a job id only a few causes may set: the row was
    changed between two transitions); or a stored value has a type the ledger
    never writes (a BLOB, an infinite number, text in an integer column);
``gap``
    a sequence number is missing: an entry was deleted from the middle;
``reordered``
    an authentic entry sits at another position than the one it was hashed at;
``inserted``
    an entry that is not part of the original chain (it does not link, or
    it lies beyond the head the operation row records), or observations
    the history never covered inside a covered range, or the anchor's
    record of a tail did not hold (see below);
``truncated``
    entries are missing from the end (against the row's head or the anchor);
``deleted``
    an operation the anchor knows is gone, or has no history at all; a
    covered (or anchored) observation or a recorded result that is gone;
``anchor_mismatch``
    the chain is internally consistent but differs from what the anchor
    recorded (a re-chained history), or the anchor's own HMAC does not match,
    or a key was given and the anchor carries no HMAC to check it against.

What each entry covers is described in :mod:`jobtrail.ledger.chain`. An anchor holds
every chain head and their Merkle root, optionally HMAC-keyed. Changes made
after the newest anchor, by someone able to rewrite a whole chain and its row
consistently, are not detectable: export anchors often and keep them where the
database's writers cannot reach.

An anchor (format ``jobtrail-anchor/v2``) also holds, per operation, its *tail*:
the observations stored after its last entry's coverage, which no entry covers
yet and whose own digest anyone can recompute. ``verify`` with that anchor
reports, as ``deleted``, ``inserted`` or ``edited`` with field
``observations``, a tail that no longer digests as anchored: the operation's
observations with ids above the anchored entry's coverage and up to the highest
id it had then. What it cannot cover:

- observations stored after the anchor (higher ids, on a running operation or
  an ended one): it does not cover them, and one forged there reads as a poll
  made since; the operation's next entry, or the next anchor, covers it as it
  finds it. Export anchors often;
- the row's seal (``row_seal``, the fields a reschedule writes without an entry:
  remote state, state reason, partial effects, next action time, polls,
  ``updated_at``): a reschedule after the anchor changes them legitimately,
  sometimes without storing any observation (a worker's back-off), so a seal
  that differs from an anchored one would prove nothing; the anchor does not
  hold it. Those fields, edited and resealed (the seal is unkeyed) while the
  operation is worked on, stay undetectable with or without an anchor; once it
  rests, its last entry covers them;
- an anchor in the earlier format (``jobtrail-anchor/v1``, heads only) is still
  read, and checked exactly as before: it holds no tails.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from jobtrail.domain.canonical import canonical_bytes, request_fingerprint, rfc3339
from jobtrail.domain.errors import ConfigError, JobtrailError
from jobtrail.domain.evidence import ConfirmedCreate, HumanDecision, SynchronousResult
from jobtrail.domain.redact import Secret
from jobtrail.domain.states import AUTOMATIC_STATES
from jobtrail.ledger import schema as t
from jobtrail.ledger.chain import (
    BEFORE_FIELDS,
    ENTRY_FIELDS,
    FIXED_FIELDS,
    GENESIS,
    OBSERVATION_FIELDS,
    SEALED_FIELDS,
    before_digest,
    entry_hash,
    field_digest,
    leaf_bytes,
    merkle_root,
    observation_digest,
    tail_digest,
    tail_leaf_bytes,
    window_digest,
)
from jobtrail.ledger.files import data_dir
from jobtrail.ledger.store import Store

#: what :func:`make_anchor` writes: each head also holds its operation's tail of observations
ANCHOR_FORMAT = "jobtrail-anchor/v2"
#: what it wrote before: chain heads only; still read and checked as it always was
ANCHOR_FORMAT_V1 = "jobtrail-anchor/v1"
#: rows per fetch while streaming; results carry their bytes, so fewer of them at once
_BATCH = 2000
_RESULT_BATCH = 16
#: the causes whose evidence names a job: only their entries may set or change an operation's job id
JOB_ID_CAUSES = frozenset({ConfirmedCreate.kind, SynchronousResult.kind, HumanDecision.kind})
#: what a value the ledger never wrote makes the checks raise: one more edit to report, not the end of the audit
_UNREADABLE = (TypeError, ValueError, KeyError, IndexError, AttributeError, JobtrailError)


@dataclass(slots=True)
class Finding:
    operation_id: str
    seq: int
    kind: str
    detail: str
    field: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "operation_id": self.operation_id,
            "seq": self.seq,
            "kind": self.kind,
            "field": self.field,
            "detail": self.detail,
        }


@dataclass(slots=True)
class VerifyReport:
    """Outcome of :func:`verify`. ``ok`` only when nothing at all was found."""

    operations: int = 0
    entries: int = 0
    observations: int = 0
    results: int = 0
    root: str = ""
    anchor_checked: bool = False
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.findings

    @property
    def first_bad(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    def to_json(self) -> dict[str, Any]:
        """The stable JSON shape of ``jobtrail audit verify --json``."""
        return {
            "ok": self.ok,
            "checked": {
                "operations": self.operations,
                "entries": self.entries,
                "observations": self.observations,
                "results": self.results,
            },
            "head": self.root,
            "anchor_checked": self.anchor_checked,
            "first_bad": None if self.first_bad is None else self.first_bad.to_json(),
            "findings": [f.to_json() for f in self.findings],
        }


@dataclass(slots=True)
class _Operation:
    """Everything stored about one operation, gathered for checking."""

    row: dict[str, Any] | None
    entries: list[dict[str, Any]] = field(default_factory=list)
    observations: list[dict[str, Any]] = field(default_factory=list)
    result: dict[str, Any] | None = None


def _stream(conn: Any, query: Any, batch: int) -> Iterator[dict[str, Any]]:
    for row in conn.execution_options(yield_per=batch).execute(query).mappings():
        yield dict(row)


def _order_key(op_id: Any) -> tuple[int, Any]:
    """The order SQLite sorts a key in: a BLOB put where an id goes comes after every text."""
    return (1, bytes(op_id)) if isinstance(op_id, (bytes, memoryview)) else (0, op_id)


def _gather(store: Store) -> Iterator[tuple[str, _Operation]]:
    """Each operation id with its row, history, observations and result, streamed in id order."""
    obs = t.observations.c
    with store._read() as conn:
        sources = {
            "row": _stream(conn, sa.select(t.operations).order_by(t.operations.c.operation_id), _BATCH),
            "entries": _stream(conn, sa.select(t.history).order_by(t.history.c.operation_id, t.history.c.seq), _BATCH),
            "observations": _stream(
                conn,
                sa.select(obs.observation_id, obs.digest, *(obs[name] for name in OBSERVATION_FIELDS)).order_by(
                    obs.operation_id, obs.observation_id
                ),
                _BATCH,
            ),
            "result": _stream(conn, sa.select(t.results).order_by(t.results.c.operation_id), _RESULT_BATCH),
        }
        heads = {name: next(source, None) for name, source in sources.items()}
        while True:
            pending = [h["operation_id"] for h in heads.values() if h is not None]
            if not pending:
                return
            op_id = min(pending, key=_order_key)
            gathered = _Operation(row=None)
            for name, source in sources.items():
                while heads[name] is not None and heads[name]["operation_id"] == op_id:  # type: ignore[index]
                    item = heads[name]
                    if name == "row":
                        gathered.row = item
                    elif name == "result":
                        gathered.result = item
                    else:
                        getattr(gathered, name).append(item)
                    heads[name] = next(source, None)
            # an id stored as a BLOB is named as such (the findings are JSON)
            yield (op_id if isinstance(op_id, str) else repr(op_id)), gathered


def _check_chain(op_id: str, op: dict[str, Any] | None, entries: list[dict[str, Any]]) -> Finding | None:  # noqa: PLR0911, PLR0912 - one finding per way a chain breaks
    if op is None:
        seq = entries[0]["seq"] if entries else 0
        return Finding(op_id, seq, "deleted", "history, observations or a result exist but the operation row is gone")
    if not entries:
        return Finding(op_id, 0, "deleted", "the operation has no history at all")
    by_hash = {e["entry_hash"]: e["seq"] for e in entries}
    prev = GENESIS
    newest_version = 0
    for position, entry in enumerate(entries, start=1):
        seq = entry["seq"]
        if seq != position:
            return Finding(op_id, position, "gap", f"entry {position} is missing (next found: {seq})")
        version = entry["hash_version"]
        if type(version) is int:  # anything else hashes as no version (below)
            if version < newest_version:
                # versions only ever rise: an older one after a newer one was rewritten to shed what it covered
                return Finding(op_id, seq, "edited", f"entry {seq} was downgraded to hash version {version}")
            newest_version = max(newest_version, version)
        if _hash(entry) != entry["entry_hash"]:
            for other in range(1, len(entries) + 2):
                if other != seq and _hash({**entry, "seq": other}) == entry["entry_hash"]:
                    return Finding(op_id, seq, "reordered", f"entry {seq} was written as entry {other}")
            return Finding(op_id, seq, "edited", "stored fields do not match the entry's hash")
        if entry["prev_hash"] != prev:
            if entry["prev_hash"] in by_hash:
                return Finding(
                    op_id,
                    seq,
                    "reordered",
                    f"entry {seq} follows entry {by_hash[entry['prev_hash']]}, not entry {seq - 1}",
                )
            return Finding(
                op_id,
                max(seq - 1, 1),
                "inserted",
                f"entry {seq - 1} is not the entry that entry {seq} was chained to",
            )
        for name in ("request_fingerprint", "trace_id"):
            if entry[name] != op[name]:
                return Finding(op_id, seq, "edited", f"{name}: the operation row's value was changed", name)
        prev = entry["entry_hash"]
    last = entries[-1]
    if last["seq"] > op["version"]:
        return Finding(
            op_id,
            op["version"] + 1,
            "inserted",
            f"entries beyond the operation's recorded head (version {op['version']})",
        )
    if last["seq"] < op["version"]:
        return Finding(
            op_id,
            last["seq"] + 1,
            "truncated",
            f"the operation's head is entry {op['version']}, history ends at {last['seq']}",
        )
    if last["entry_hash"] != op["history_head"]:
        return Finding(op_id, last["seq"], "edited", "history_head: does not match the last entry", "history_head")
    for column, name in (("to_state", "state"), ("remote_job_id", "remote_job_id")):
        if last[column] != op[name]:
            return Finding(
                op_id, last["seq"], "edited", f"{name}: differs from the operation's last history entry", name
            )
    return None


def _hash(entry: dict[str, Any]) -> str:
    try:
        return entry_hash(entry)
    except _UNREADABLE:  # an unknown hash version, or a value of a type never written, is an edit
        return ""


def _field_digest(value: Any) -> str | None:
    """A column's digest; None (matching no recorded digest) for a value of a type the ledger never writes."""
    try:
        return field_digest(value)
    except _UNREADABLE:
        return None


def _observation_digest(obs: dict[str, Any]) -> str | None:
    try:
        return observation_digest(obs)
    except _UNREADABLE:
        return None


def _check_seams(op_id: str, entries: list[dict[str, Any]]) -> list[Finding]:
    """Each entry starts where the one before it ended: its state, and its job id unless its cause sets one;
    and the columns only transitions write (:data:`BEFORE_FIELDS`) as the entry before left them.

    A writer builds each entry from the row as it reads it, so a column edited between two transitions is
    recorded by the next one as if it had been there all along; the seam it leaves is this.
    """
    findings: list[Finding] = []
    state, job = None, None  # the creation entry starts from no state and no job
    row: dict[str, str] | None = None  # the field digests of the row the entry before left
    for entry in entries:
        seq = entry["seq"]
        if entry["from_state"] != state:
            before = f"entry {seq - 1} ended in {state}" if seq > 1 else "a creation entry starts from no state"
            findings.append(
                Finding(
                    op_id,
                    seq,
                    "edited",
                    f"state: entry {seq} starts from {entry['from_state']}, but {before}: the row's state was "
                    f"changed outside any transition before entry {seq} was written",
                    "state",
                )
            )
        if entry["remote_job_id"] != job and entry["cause"] not in JOB_ID_CAUSES:
            findings.append(
                Finding(
                    op_id,
                    seq,
                    "edited",
                    f"remote_job_id: entry {seq} ({entry['cause']}) changed the job id, which only a confirmed "
                    "create, a synchronous result or a person's decision does: the row's job id was changed "
                    f"outside any transition before entry {seq} was written",
                    "remote_job_id",
                )
            )
        covers = _covers(entry)
        if row is not None and covers is not None and "before" in covers:
            found = before_digest([row.get(name) or "" for name in BEFORE_FIELDS])
            if covers["before"] != found:
                findings.append(
                    Finding(
                        op_id,
                        seq,
                        "edited",
                        f"{', '.join(BEFORE_FIELDS)}: entry {seq} found one of them other than entry {seq - 1} "
                        f"left it: it was changed outside any transition before entry {seq} was written",
                        "/".join(BEFORE_FIELDS),
                    )
                )
        row = None if covers is None else covers.get("row")
        state, job = entry["to_state"], entry["remote_job_id"]
    return findings


def _covers(entry: dict[str, Any]) -> dict[str, Any] | None:
    if entry["hash_version"] < 2 or entry.get("covers") is None:
        return None
    covers: dict[str, Any] = json.loads(entry["covers"])
    return covers


def _check_row(op_id: str, op: dict[str, Any], entries: list[dict[str, Any]]) -> list[Finding]:
    """Every column against the entry that covers it: the creation entry, the last entry, or the seal."""
    findings: list[Finding] = []
    first = _covers(entries[0])
    if first is not None:
        for name in FIXED_FIELDS:
            if _field_digest(op[name]) != first["fixed"][name]:
                findings.append(
                    Finding(op_id, 1, "edited", f"{name}: differs from what the creation entry covers", name)
                )
    else:  # created before 0006: the fingerprint still covers what we asked for
        body = json.loads(op["request_body"]) if _is_json(op["request_body"]) else None
        if request_fingerprint(op["provider"], op["target"], op["endpoint"], body) != op["request_fingerprint"]:
            findings.append(
                Finding(
                    op_id,
                    1,
                    "edited",
                    "request_body: provider, target, endpoint or body no longer match the request fingerprint",
                    "request_body",
                )
            )
    last = entries[-1]
    covers = _covers(last)
    if covers is None:
        return findings
    sealed: dict[str, Any] | None = None
    resting = op["state"] not in {s.value for s in AUTOMATIC_STATES}
    if not resting:
        try:
            sealed = json.loads(op["row_seal"]) if op["row_seal"] is not None else None
        except (TypeError, ValueError):
            sealed = None
        if not isinstance(sealed, dict):
            findings.append(Finding(op_id, last["seq"], "edited", "row_seal: missing or unreadable", "row_seal"))
            sealed = {}
    for name in ENTRY_FIELDS:
        seen = _field_digest(op[name])
        if sealed is not None and name in SEALED_FIELDS:
            # a reschedule may have written it since the last entry: the row's seal holds it
            if seen != sealed.get(name):
                findings.append(Finding(op_id, last["seq"], "edited", f"{name}: differs from the row's seal", name))
        elif seen != covers["row"][name]:
            findings.append(
                Finding(op_id, last["seq"], "edited", f"{name}: differs from what entry {last['seq']} covers", name)
            )
    return findings


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _check_observations(op_id: str, entries: list[dict[str, Any]], observations: list[dict[str, Any]]) -> list[Finding]:
    findings: list[Finding] = []
    floor: int | None = None  # ids at or below this predate 0006 and were never covered
    for obs in observations:
        if obs["digest"] is None:
            continue
        if _observation_digest(obs) != obs["digest"]:
            findings.append(
                Finding(
                    op_id,
                    0,
                    "edited",
                    f"observation {obs['observation_id']}: its stored fields do not match its digest",
                    f"observation {obs['observation_id']}",
                )
            )
    previous_upto: int | None = None
    for entry in entries:
        covers = _covers(entry)
        if covers is None:
            continue
        window = covers["obs"]
        after, upto = int(window["after"]), int(window["upto"])
        if floor is None:
            floor = after
        if (previous_upto is not None and after != previous_upto) or entry["obs_upto"] != upto:
            findings.append(
                Finding(op_id, entry["seq"], "edited", "observations: the covered ranges do not join", "observations")
            )
        previous_upto = upto
        items = [(o["observation_id"], o["digest"]) for o in observations if after < o["observation_id"] <= upto]
        if len(items) < window["count"]:
            kind, what = "deleted", f"{window['count'] - len(items)} of them are gone"
        elif len(items) > window["count"]:
            kind, what = "inserted", f"{len(items) - window['count']} more are there now"
        elif window_digest(items) != window["digest"]:
            kind, what = "edited", "they were altered"
        else:
            continue
        findings.append(
            Finding(
                op_id,
                entry["seq"],
                kind,
                f"observations: entry {entry['seq']} covers {window['count']} observations "
                f"(ids {after + 1}..{upto}); {what}",
                "observations",
            )
        )
    if floor is not None:
        for obs in observations:
            if obs["digest"] is None and obs["observation_id"] > floor:
                findings.append(
                    Finding(
                        op_id,
                        0,
                        "edited",
                        f"observation {obs['observation_id']}: its digest was removed",
                        f"observation {obs['observation_id']}",
                    )
                )
    return findings


def recorded_result(entries: list[dict[str, Any]]) -> tuple[int, str, dict[str, Any] | None] | None:
    """(seq, sha256, the digests of the rest of its row) of the newest entry that recorded a stored result;
    the digests are None for an entry written before they were (it covers the bytes only)."""
    for entry in reversed(entries):
        covers = _covers(entry)
        if covers is not None and covers.get("result"):
            return entry["seq"], str(covers["result"]), covers.get("result_record")
        if covers is None and entry["cause"] == "validated_result":
            digest = json.loads(entry["evidence"]).get("sha256")
            if isinstance(digest, str):
                return entry["seq"], digest, None
    return None


def edited_result_fields(record: dict[str, Any], stored: dict[str, Any]) -> list[str]:
    """The columns of a stored result row (as stored: JSON as its text) that differ from the digests an
    entry recorded of them."""
    return sorted(name for name, covered in record.items() if _field_digest(stored.get(name)) != covered)


def _check_result(
    op_id: str, entries: list[dict[str, Any]], stored: dict[str, Any] | None, results_dir: Path
) -> list[Finding]:
    recorded = recorded_result(entries)
    if recorded is None:
        # a result stored but never recorded (a crash between the two) is never served: nothing to protect
        return []
    seq, digest, record = recorded
    if stored is None:
        return [Finding(op_id, seq, "deleted", f"result: entry {seq} recorded a result; its row is gone", "result")]
    if isinstance(stored["body"], (bytes, memoryview)):
        data = bytes(stored["body"])
    elif stored["body"] is not None:  # text or a number where the bytes go
        return [
            Finding(op_id, seq, "edited", f"result: the stored body is {_kind(stored['body'])}, not bytes", "result")
        ]
    else:
        try:
            data = (results_dir / str(stored["path"])).read_bytes()
        except (OSError, TypeError):
            return [Finding(op_id, seq, "deleted", f"result: the file {stored['path']} cannot be read", "result")]
    findings = []
    if hashlib.sha256(data).hexdigest() != digest:
        findings.append(
            Finding(
                op_id,
                seq,
                "edited",
                f"result: the stored bytes do not hash to the sha256 entry {seq} recorded",
                "result",
            )
        )
    if stored["sha256"] != digest:
        findings.append(
            Finding(
                op_id, seq, "edited", f"result.sha256: differs from the sha256 entry {seq} recorded", "result.sha256"
            )
        )
    if record is not None:  # the rest of the row: its summary, checks, content type, size... as stored
        edited = edited_result_fields(record, stored)
        if edited:
            differ = "differs" if len(edited) == 1 else "differ"
            findings.append(
                Finding(
                    op_id,
                    seq,
                    "edited",
                    f"result: its {', '.join(edited)} {differ} from what entry {seq} recorded",
                    "result",
                )
            )
    return findings


def _python_types(table: sa.Table) -> dict[str, tuple[type, ...]]:
    """The Python types each column's values are read back as, whichever database holds them."""
    out: dict[str, tuple[type, ...]] = {}
    for column in table.columns:
        kind = column.type
        if isinstance(kind, sa.Boolean):
            out[column.name] = (bool, int)
        elif isinstance(kind, sa.Integer):
            out[column.name] = (int,)
        elif isinstance(kind, sa.Float):
            out[column.name] = (float, int)
        elif isinstance(kind, sa.LargeBinary):
            out[column.name] = (bytes, memoryview)
        elif isinstance(kind, sa.String):  # Text too
            out[column.name] = (str,)
    return out


_TYPES = {
    name: _python_types(table)
    for name, table in (
        ("operations", t.operations),
        ("history", t.history),
        ("observations", t.observations),
        ("results", t.results),
    )
}


def _kind(value: Any) -> str:
    if isinstance(value, (bytes, memoryview)):
        return "a BLOB"
    if isinstance(value, str):
        return "text"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a real number" if math.isfinite(value) else f"{value} (a number JSON has no form for)"
    return type(value).__name__


def _odd(value: Any, types: tuple[type, ...]) -> bool:
    """True for a value of a type the ledger never writes in this column (SQLite stores any type anywhere)."""
    if value is None:
        return False
    if isinstance(value, bool) and bool not in types:
        return True
    if isinstance(value, float):
        return float not in types or not math.isfinite(value)
    return not isinstance(value, types)


def _odd_cells(op_id: str, op: _Operation) -> list[Finding]:
    """An ``edited`` finding for each stored value of a type the ledger never writes, naming where it is."""
    findings: list[Finding] = []

    def scan(table: str, row: dict[str, Any], seq: int, where: str, field: str) -> None:
        # field: the finding's field, or (empty, or ending in ".") its prefix before the column's name
        for name, types in _TYPES[table].items():
            if name in row and _odd(row[name], types):
                detail = f"{where}{name}: holds {_kind(row[name])}, a type the ledger never writes there"
                findings.append(
                    Finding(op_id, seq, "edited", detail, field + name if not field or field.endswith(".") else field)
                )

    if op.row is not None:
        scan("operations", op.row, 0, "", "")
    for entry in op.entries:
        scan("history", entry, entry["seq"] if type(entry["seq"]) is int else 0, f"entry {entry['seq']}: ", "history.")
    for obs in op.observations:
        scan("observations", obs, 0, f"observation {obs['observation_id']}: ", f"observation {obs['observation_id']}")
    if op.result is not None:
        scan("results", op.result, 0, "result.", "result.")
    return findings


def _checked(op_id: str, odd: list[Finding], check: Callable[..., list[Finding]], *args: Any) -> list[Finding]:
    """Run one check; a value it cannot read is an edit (named by ``odd`` when it could be), never the end."""
    try:
        return check(*args)
    except _UNREADABLE:
        if odd:
            return []
        return [
            Finding(op_id, 0, "edited", "a stored value has a form the ledger never writes; it was put there by hand")
        ]


def _chain_findings(op_id: str, row: dict[str, Any] | None, entries: list[dict[str, Any]]) -> list[Finding]:
    finding = _check_chain(op_id, row, entries)
    return [] if finding is None else [finding]


def _check_operation(op_id: str, op: _Operation, results_dir: Path) -> list[Finding]:
    """Every check of one operation; the rest of its checks, and of the ledger, go on past a value never written."""
    odd = _odd_cells(op_id, op)
    chain = _checked(op_id, odd, _chain_findings, op_id, op.row, op.entries)
    for finding in chain:
        finding.field = finding.field or "history"
    findings = [*odd, *chain]
    if not chain and op.row is not None:
        findings += _checked(op_id, odd, _check_seams, op_id, op.entries)
        findings += _checked(op_id, odd, _check_row, op_id, op.row, op.entries)
        findings += _checked(op_id, odd, _check_observations, op_id, op.entries, op.observations)
        findings += _checked(op_id, odd, _check_result, op_id, op.entries, op.result, results_dir)
    return findings


#: an operation's tail as stored now: (where its entry's coverage ends, its highest id, count, digest); None where
#: an id or the coverage has a form the ledger never writes (named on its own), so it cannot be compared
_TailNow = tuple[int, int, int, str | None] | None
#: a tail's digest where one of its digests is a value of a form the ledger never writes (named on its own):
#: the anchor and the check agree on it, so that one edit is not reported twice
_UNDIGESTIBLE = ""


@dataclass(slots=True)
class _Current:
    """What the anchor check needs of one operation as the database holds it now."""

    seq: int
    entries: list[dict[str, Any]]
    #: per anchored (seq, upto) of a version-2 head: the observations of that range now
    tails: dict[tuple[int, int], _TailNow] = field(default_factory=dict)


def verify(store: Store, *, anchor: dict[str, Any] | None = None, key: Secret | None = None) -> VerifyReport:
    """Check every chain, every row, observation and result against its chain, and (optionally) an anchor."""
    # read first, so a file that is no anchor is said before the whole ledger is read through
    anchored = None if anchor is None else _anchor_heads(anchor)
    with_tails: dict[str, list[list[Any]]] = {}
    for head in anchored or ():
        if len(head) == _TAIL_HEAD_LEN:
            with_tails.setdefault(head[0], []).append(head)
    results_dir = data_dir(store)
    report = VerifyReport()
    heads: dict[str, _Current | None] = {}
    leaves: list[bytes] = []
    for op_id, op in _gather(store):
        report.operations += 0 if op.row is None else 1
        report.entries += len(op.entries)
        report.observations += len(op.observations)
        report.results += 0 if op.result is None else 1
        report.findings.extend(_check_operation(op_id, op, results_dir))
        if op.entries and op.row is not None:
            last = op.entries[-1]
            try:
                leaf = leaf_bytes(op_id, last["seq"], last["entry_hash"])
            except _UNREADABLE:  # named above; the anchor cannot be compared with what is not a head
                heads[op_id] = None
                continue
            current = heads[op_id] = _Current(last["seq"], op.entries)
            for _, seq, _, upto, _, _ in with_tails.get(op_id, ()):
                if seq <= len(op.entries):
                    current.tails[(seq, upto)] = _tail_now(op.entries[seq - 1], op.observations, upto)
            # the leaf an anchor taken now holds, so this report's head is that anchor's root (an id of a form
            # the ledger never writes, named above, leaves the head alone in it)
            now = _tail_now(last, op.observations)
            leaves.append(leaf if now is None else tail_leaf_bytes(op_id, last["seq"], last["entry_hash"], *now[1:]))
    report.root = merkle_root(leaves)
    if anchor is not None and anchored is not None:
        report.anchor_checked = True
        for finding in _check_anchor(anchor, anchored, heads, key):
            finding.field = finding.field or "history"
            report.findings.append(finding)
    return report


def _tail(entry: dict[str, Any], observations: list[dict[str, Any]], upto: int | None = None) -> tuple[int, list[Any]]:
    """Where ``entry``'s coverage of the operation's observations ends, and the (id, digest) of those after it
    (up to ``upto``, when given): what :func:`make_anchor` reads with SQL, read from what was gathered."""
    covered = entry["obs_upto"]
    if covered is not None and type(covered) is not int:
        raise TypeError(f"obs_upto holds {_kind(covered)}")
    floor = covered or 0  # a version-1 entry covers no observation: they all follow it
    items = [
        (obs["observation_id"], obs["digest"])
        for obs in observations
        if obs["observation_id"] > floor and (upto is None or obs["observation_id"] <= upto)
    ]
    return floor, items


def _tail_now(entry: dict[str, Any], observations: list[dict[str, Any]], upto: int | None = None) -> _TailNow:
    """The observations after ``entry``'s coverage (up to ``upto``, when given), as :func:`make_anchor` records
    them for the last entry."""
    try:
        floor, items = _tail(entry, observations, upto)
    except _UNREADABLE:  # an id or a coverage of a form never written: named on its own
        return None
    return floor, items[-1][0] if items else floor, len(items), _tail_digest(items)


def _tail_digest(items: list[tuple[Any, Any]]) -> str | None:
    try:
        return tail_digest(items)
    except _UNREADABLE:
        return _UNDIGESTIBLE


#: the length of a version-2 head: [operation id, seq, head, upto, count, digest]
_TAIL_HEAD_LEN = 6


def _is_head(item: Any) -> bool:
    return (
        isinstance(item, list)
        and len(item) == 3  # [operation id, seq, head]
        and isinstance(item[0], str)
        and type(item[1]) is int
        and item[1] >= 1
        and isinstance(item[2], str)
    )


def _is_tail_head(item: Any) -> bool:
    if not (isinstance(item, list) and len(item) == _TAIL_HEAD_LEN and _is_head(item[:3])):
        return False
    upto, count, digest = item[3:]
    return (
        type(upto) is int
        and upto >= 0
        and type(count) is int
        and count >= 0
        and (digest is None if count == 0 else isinstance(digest, str))
    )


def _anchor_heads(anchor: dict[str, Any]) -> list[list[Any]]:
    """The anchor's heads, each checked for its format's shape (not yet for its root or HMAC)."""
    shapes: dict[Any, Callable[[Any], bool]] = {ANCHOR_FORMAT: _is_tail_head, ANCHOR_FORMAT_V1: _is_head}
    shape = shapes.get(anchor.get("format"))
    heads = anchor.get("heads")
    if shape is None or not isinstance(heads, list) or not all(shape(h) for h in heads):
        raise ConfigError(
            f"not a jobtrail anchor (expected format {ANCHOR_FORMAT!r}, or the earlier {ANCHOR_FORMAT_V1!r}); "
            "give the file `jobtrail audit anchor --out` wrote"
        )
    return heads


def _check_anchor(
    anchor: dict[str, Any],
    anchored: list[list[Any]],
    heads: dict[str, _Current | None],
    key: Secret | None,
) -> list[Finding]:
    findings: list[Finding] = []
    if anchor.get("hmac") is None and key is not None:
        # fail closed: someone who rewrote the ledger can write a fresh unkeyed anchor of it, not a keyed one
        return [
            Finding(
                "*",
                0,
                "anchor_mismatch",
                "a key was given, but this anchor carries no HMAC, so nothing proves it was not rewritten along "
                "with the ledger; it was checked against nothing. If you made it without a key, verify it "
                "without one; if you made it with a key, this file was replaced: use your own copy of the keyed one",
            )
        ]
    if anchor.get("hmac") is not None:
        if key is None:
            raise ConfigError("the anchor is HMAC-keyed; pass the key's name with --key-env NAME")
        if not isinstance(anchor["hmac"], str) or not hmac.compare_digest(anchor["hmac"], _anchor_mac(anchor, key)):
            named = f" (it was made with the key in {anchor['hmac_key']})" if anchor.get("hmac_key") else ""
            return [
                Finding(
                    "*",
                    0,
                    "anchor_mismatch",
                    "the anchor's HMAC does not match: the key given is not the one it was made with"
                    f"{named}, or the anchor file was altered",
                )
            ]
    anchored_leaves = [tail_leaf_bytes(*h) if len(h) == _TAIL_HEAD_LEN else leaf_bytes(*h) for h in anchored]
    if merkle_root(anchored_leaves) != anchor.get("root"):
        findings.append(Finding("*", 0, "anchor_mismatch", "the anchor's heads do not hash to its root"))
    for op_id, seq, head, *tail in anchored:
        if op_id not in heads:
            findings.append(Finding(op_id, seq, "deleted", "the anchor knows this operation; the database does not"))
            continue
        current = heads[op_id]
        if current is None:  # its head is not one (a value of another type): already named
            continue
        if current.seq < seq:
            findings.append(
                Finding(
                    op_id,
                    current.seq + 1,
                    "truncated",
                    f"the anchor recorded {seq} entries, the database has {current.seq}",
                )
            )
        elif seq > len(current.entries) or current.entries[seq - 1]["entry_hash"] != head:
            findings.append(
                Finding(
                    op_id,
                    seq,
                    "anchor_mismatch",
                    f"entry {seq} differs from the anchored head: the history was rewritten",
                )
            )
        elif tail:  # the entry is the anchored one, so where its coverage ends is as it was
            finding = _check_tail(op_id, seq, tail, current.tails[(seq, tail[0])], anchor.get("created_at"))
            if finding is not None:
                findings.append(finding)
    gone = [f for f in findings if f.kind == "deleted"]
    if heads and gone and len(gone) == len(anchored):
        # every anchored operation is missing, and the ledger holds others: a wiped and refilled ledger
        # reads the same (the verdict stands), but so does another ledger's anchor, the likelier mistake
        gone[0].detail += (
            f" (none of the anchor's {len(gone)} operations is in this ledger, which holds {len(heads)} others: "
            "if the anchor is another ledger's, point --db at that one)"
        )
    return findings


def _check_tail(op_id: str, seq: int, tail: list[Any], now: _TailNow, taken: Any) -> Finding | None:
    """The observations no entry covered when the anchor was taken, against what it recorded of them."""
    upto, count, digest = tail
    floor, count_now, digest_now = (0, count, None) if now is None else (now[0], now[2], now[3])
    if now is not None and (count_now, digest_now) == (count, digest):
        return None
    if now is None:
        kind, what = "edited", "an id among them, or where the entry's coverage ends, holds a value never written"
    elif count_now < count:
        kind, what = "deleted", f"{count - count_now} of them are gone"
    elif count_now > count:
        kind, what = "inserted", f"{count_now - count} more are there now, with ids inside that range"
    else:
        kind, what = "edited", "they were rewritten (their own digests recomputed to match)"
    when = f" ({taken})" if isinstance(taken, str) else ""
    ids = f"ids {floor + 1}..{upto}" if now is not None else f"ids up to {upto}"
    return Finding(
        op_id,
        seq,
        kind,
        f"observations: when the anchor was taken{when}, {count} observations no entry covered yet followed "
        f"entry {seq} ({ids}); {what}. Someone with write access to the database changed "
        "this operation's polls after the anchor, so what `ops show` and `explain` say of them may be forged: "
        "restore its observations from a backup older than the anchor, and find out who can write to the database",
        "observations",
    )


def make_anchor(store: Store, *, key: Secret | None = None, key_name: str | None = None) -> dict[str, Any]:
    """Every chain head with its operation's tail of observations, and their Merkle root, to be kept outside
    the database. Observations stored after it are covered by the next entry of their operation, or the next
    anchor: export anchors often."""
    ops, hist, obs = t.operations.c, t.history.c, t.observations.c
    floor = sa.func.coalesce(hist.obs_upto, 0)  # a version-1 entry covers no observation: they all follow it
    # One statement, so one snapshot (PostgreSQL gives each statement of a transaction its own unless told
    # otherwise): every head and the tail its own entry leaves uncovered, as of one instant. Each operation
    # reaches its last entry by primary key and its tail by the (operation_id, observation_id) index; one
    # resting or unpolled operation is one row, so 10^6 of them are a streamed scan, not 10^6 queries.
    query = (
        sa.select(ops.operation_id, ops.version, ops.history_head, floor, obs.observation_id, obs.digest)
        .select_from(
            t.operations.outerjoin(
                t.history, sa.and_(hist.operation_id == ops.operation_id, hist.seq == ops.version)
            ).outerjoin(t.observations, sa.and_(obs.operation_id == ops.operation_id, obs.observation_id > floor))
        )
        .order_by(ops.operation_id, obs.observation_id)
    )
    heads: list[list[Any]] = []
    with store._read() as conn:
        rows = conn.execution_options(yield_per=_BATCH).execute(query)
        for op_id, group in itertools.groupby(rows, key=lambda row: row[0]):
            found = list(group)  # one row, or one per tail observation
            _, version, head, covered = found[0][:4]
            items = [(oid, digest) for *_, oid, digest in found if oid is not None]
            # (a coverage of a form the ledger never writes reads as none; the audit names it)
            upto = items[-1][0] if items else (covered if type(covered) is int else 0)
            heads.append([op_id, version, head, upto, len(items), _tail_digest(items)])
    anchor: dict[str, Any] = {
        "format": ANCHOR_FORMAT,
        "created_at": rfc3339(store.clock()),
        "operations": len(heads),
        "entries": sum(h[1] for h in heads),
        "root": merkle_root([tail_leaf_bytes(*h) for h in heads]),
        "heads": heads,
        "hmac_key": key_name,
        "hmac": None,
    }
    if key is not None:
        anchor["hmac"] = _anchor_mac(anchor, key)
    return anchor


def _anchor_mac(anchor: dict[str, Any], key: Secret) -> str:
    body = {k: v for k, v in anchor.items() if k != "hmac"}
    return hmac.new(key.reveal().encode(), canonical_bytes(body), hashlib.sha256).hexdigest()


def load_anchor(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read anchor {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} is not a jobtrail anchor")
    return data
