"""Checking the history: every chain, every record, and an anchor kept outside the database.

``verify`` walks each operation's chain and reports the first bad entry with
its kind:

``edited``
    an entry's stored fields no longer hash to its stored hash, or the
    operation row disagrees with its own history (state, head, fingerprint);
``gap``
    a sequence number is missing: an entry was deleted from the middle;
``reordered``
    an authentic entry sits at another position than the one it was hashed at;
``inserted``
    an entry that is not part of the original chain (it does not link, or
    it lies beyond the head the operation row records);
``truncated``
    entries are missing from the end (against the row's head or the anchor);
``deleted``
    an operation the anchor knows is gone, or has no history at all;
``anchor_mismatch``
    the chain is internally consistent but differs from what the anchor
    recorded (a re-chained history), or the anchor's own HMAC does not match.

An anchor holds every chain head and their Merkle root, optionally HMAC-keyed.
Changes made after the newest anchor, by someone able to rewrite a whole chain
and its row consistently, are not detectable: export anchors often and keep
them where the database's writers cannot reach.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from jobtrail import _schema as t
from jobtrail._canonical import canonical_bytes, rfc3339
from jobtrail._chain import GENESIS, entry_hash, leaf_bytes, merkle_root
from jobtrail._errors import ConfigError
from jobtrail._redact import Secret
from jobtrail._store import Store

ANCHOR_FORMAT = "jobtrail-anchor/v1"


@dataclass(slots=True)
class Finding:
    operation_id: str
    seq: int
    kind: str
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"operation_id": self.operation_id, "seq": self.seq, "kind": self.kind, "detail": self.detail}


@dataclass(slots=True)
class VerifyReport:
    """Outcome of :func:`verify`. ``ok`` only when nothing at all was found."""

    operations: int = 0
    entries: int = 0
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
            "checked": {"operations": self.operations, "entries": self.entries},
            "head": self.root,
            "anchor_checked": self.anchor_checked,
            "first_bad": None if self.first_bad is None else self.first_bad.to_json(),
            "findings": [f.to_json() for f in self.findings],
        }


def _chains(store: Store) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Yield (operation row, its history rows by seq), streaming, one operation at a time."""
    ops = t.operations.c
    with store._read() as conn:
        op_rows = (
            conn.execute(
                sa.select(
                    ops.operation_id,
                    ops.state,
                    ops.version,
                    ops.history_head,
                    ops.request_fingerprint,
                    ops.remote_job_id,
                    ops.trace_id,
                ).order_by(ops.operation_id)
            )
            .mappings()
            .all()
        )
        hist = (
            conn.execution_options(yield_per=2000)
            .execute(sa.select(t.history).order_by(t.history.c.operation_id, t.history.c.seq))
            .mappings()
        )
        pending: Any = next(hist, None)
        for op in op_rows:
            entries: list[dict[str, Any]] = []
            while pending is not None and pending["operation_id"] < op["operation_id"]:
                # history of an operation row that no longer exists
                yield ({"operation_id": pending["operation_id"], "missing": True}, [dict(pending)])
                pending = next(hist, None)
            while pending is not None and pending["operation_id"] == op["operation_id"]:
                entries.append(dict(pending))
                pending = next(hist, None)
            yield dict(op), entries
        while pending is not None:
            yield ({"operation_id": pending["operation_id"], "missing": True}, [dict(pending)])
            pending = next(hist, None)


def _check_chain(op: dict[str, Any], entries: list[dict[str, Any]]) -> Finding | None:
    op_id = op["operation_id"]
    if op.get("missing"):
        return Finding(op_id, entries[0]["seq"], "deleted", "history exists but the operation row is gone")
    if not entries:
        return Finding(op_id, 0, "deleted", "the operation has no history at all")
    by_hash = {e["entry_hash"]: e["seq"] for e in entries}
    prev = GENESIS
    for position, entry in enumerate(entries, start=1):
        seq = entry["seq"]
        if seq != position:
            return Finding(op_id, position, "gap", f"entry {position} is missing (next found: {seq})")
        if entry_hash(entry) != entry["entry_hash"]:
            for other in range(1, len(entries) + 2):
                if other != seq and entry_hash({**entry, "seq": other}) == entry["entry_hash"]:
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
        if entry["request_fingerprint"] != op["request_fingerprint"] or entry["trace_id"] != op["trace_id"]:
            return Finding(op_id, seq, "edited", "the operation row's fingerprint or trace id was changed")
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
        return Finding(op_id, last["seq"], "edited", "the operation row's head hash does not match")
    if last["to_state"] != op["state"] or last["remote_job_id"] != op["remote_job_id"]:
        return Finding(
            op_id,
            last["seq"],
            "edited",
            "the operation row's state or remote job id differs from its last history entry",
        )
    return None


def verify(store: Store, *, anchor: dict[str, Any] | None = None, key: Secret | None = None) -> VerifyReport:
    """Check every chain, every row against its chain, and (optionally) an anchor."""
    report = VerifyReport()
    heads: dict[str, tuple[int, str, list[dict[str, Any]]]] = {}
    leaves: list[bytes] = []
    for op, entries in _chains(store):
        report.operations += 0 if op.get("missing") else 1
        report.entries += len(entries)
        finding = _check_chain(op, entries)
        if finding:
            report.findings.append(finding)
        if entries and not op.get("missing"):
            heads[op["operation_id"]] = (entries[-1]["seq"], entries[-1]["entry_hash"], entries)
            leaves.append(leaf_bytes(op["operation_id"], entries[-1]["seq"], entries[-1]["entry_hash"]))
    report.root = merkle_root(leaves)
    if anchor is not None:
        report.anchor_checked = True
        report.findings.extend(_check_anchor(anchor, heads, key))
    return report


def _check_anchor(
    anchor: dict[str, Any],
    heads: dict[str, tuple[int, str, list[dict[str, Any]]]],
    key: Secret | None,
) -> list[Finding]:
    if anchor.get("format") != ANCHOR_FORMAT or not isinstance(anchor.get("heads"), list):
        raise ConfigError(f"not a jobtrail anchor (expected format {ANCHOR_FORMAT!r})")
    findings: list[Finding] = []
    if anchor.get("hmac") is not None:
        if key is None:
            raise ConfigError("the anchor is HMAC-keyed; pass the key's name with --key-env NAME")
        if not hmac.compare_digest(anchor["hmac"], _anchor_mac(anchor, key)):
            return [Finding("*", 0, "anchor_mismatch", "the anchor's HMAC does not match: the anchor file was altered")]
    anchored_leaves = [leaf_bytes(h[0], h[1], h[2]) for h in anchor["heads"]]
    if merkle_root(anchored_leaves) != anchor.get("root"):
        findings.append(Finding("*", 0, "anchor_mismatch", "the anchor's heads do not hash to its root"))
    for op_id, seq, head in anchor["heads"]:
        current = heads.get(op_id)
        if current is None:
            findings.append(Finding(op_id, seq, "deleted", "the anchor knows this operation; the database does not"))
            continue
        cur_seq, _cur_head, entries = current
        if cur_seq < seq:
            findings.append(
                Finding(
                    op_id,
                    cur_seq + 1,
                    "truncated",
                    f"the anchor recorded {seq} entries, the database has {cur_seq}",
                )
            )
        elif entries[seq - 1]["entry_hash"] != head:
            findings.append(
                Finding(
                    op_id,
                    seq,
                    "anchor_mismatch",
                    f"entry {seq} differs from the anchored head: the history was rewritten",
                )
            )
    return findings


def make_anchor(store: Store, *, key: Secret | None = None, key_name: str | None = None) -> dict[str, Any]:
    """Every chain head and their Merkle root, to be stored outside the database."""
    heads: list[list[Any]] = []
    ops = t.operations.c
    with store._read() as conn:
        for row in conn.execute(sa.select(ops.operation_id, ops.version, ops.history_head).order_by(ops.operation_id)):
            heads.append([row.operation_id, row.version, row.history_head])
    anchor: dict[str, Any] = {
        "format": ANCHOR_FORMAT,
        "created_at": rfc3339(store.clock()),
        "operations": len(heads),
        "entries": sum(h[1] for h in heads),
        "root": merkle_root([leaf_bytes(*h) for h in heads]),
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
