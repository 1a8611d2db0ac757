"""The bytes we hash: history entries (a per-operation chain) and the anchor's Merkle tree.

Entry hash, version 1::

    sha256(b"jobtrail/history/v1\\0" + canonical_json(every stored column but the hash))

Merkle tree over chain heads: RFC 9162 (leaf = sha256(0x00 || leaf), node =
sha256(0x01 || left || right)), leaves sorted by operation id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from jobtrail._canonical import canonical_bytes, compact_json, rfc3339

HASH_VERSION = 1
GENESIS = "0" * 64
_PREFIX = b"jobtrail/history/v1\0"

#: The stored columns an entry hash covers, in the order a reader expects them.
HASHED_COLUMNS = (
    "operation_id",
    "seq",
    "at_us",
    "actor",
    "from_state",
    "to_state",
    "cause",
    "evidence",
    "remote_job_id",
    "trace_id",
    "request_ids",
    "request_fingerprint",
    "prev_hash",
    "hash_version",
)


def entry_hash(row: Mapping[str, Any]) -> str:
    """The hash of one history entry, from its stored column values."""
    doc = {name: row[name] for name in HASHED_COLUMNS}
    doc["at"] = rfc3339(doc.pop("at_us"))
    if doc["hash_version"] != HASH_VERSION:
        raise ValueError(f"unknown history hash version {doc['hash_version']}")
    # every value here is a string, an integer or null, so compact_json is the canonical encoding
    return hashlib.sha256(_PREFIX + compact_json(doc).encode("utf-8")).hexdigest()


def leaf_bytes(operation_id: str, seq: int, head: str) -> bytes:
    return canonical_bytes([operation_id, seq, head])


def merkle_root(leaves: Sequence[bytes]) -> str:
    """RFC 9162 Merkle tree hash (hex) of the leaves; the empty tree hashes b""."""
    if not leaves:
        return hashlib.sha256(b"").hexdigest()
    level = [hashlib.sha256(b"\x00" + leaf).digest() for leaf in leaves]
    return _mth(level).hex()


def _mth(nodes: list[bytes]) -> bytes:
    if len(nodes) == 1:
        return nodes[0]
    split = 1
    while split * 2 < len(nodes):
        split *= 2
    return hashlib.sha256(b"\x01" + _mth(nodes[:split]) + _mth(nodes[split:])).digest()
