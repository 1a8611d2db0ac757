"""The bytes we hash: history entries (a per-operation chain), what they cover, and the anchor's Merkle tree.

Entry hash, version 1 (entries written before migration 0006)::

    sha256(b"jobtrail/history/v1\\0" + canonical_json(every stored column but the hash and ``covers``))

Entry hash, version 2::

    sha256(b"jobtrail/history/v2\\0" + canonical_json(every stored column but the hash))

Version 2 adds ``obs_upto`` (the newest observation id the entry covers, a
column so the next writer finds where to start in the same query that reads
the row) and ``covers``, a canonical JSON object that binds the rest of the
ledger to the chain:

``row``
    a digest of each mutable field of the operation row, as this transition
    wrote it (:data:`ENTRY_FIELDS`);
``fixed``
    (creation entry only) a digest of each field fixed at creation
    (:data:`FIXED_FIELDS`): the idempotency token is covered by digest only;
``obs``
    the operation's observations stored since the previous entry:
    ``{"after": id, "upto": id, "count": n, "digest": sha256 of [[id, digest], ...]}``;
``result``
    (an entry recording a validated result) the sha256 of the stored bytes;
``result_record``
    (the same entry; entries written before this key was added lack it and
    cover the bytes only) the rest of the result's row as stored, as
    ``{column: field_digest(stored value)}`` over :data:`RESULT_FIELDS`: its
    size, content type, file path, checks and per-item summary (their stored
    JSON text), redacted flag and time.

Every entry is verified by its own ``hash_version``. Merkle tree over chain
heads: RFC 9162 (leaf = sha256(0x00 || leaf), node = sha256(0x01 || left ||
right)), leaves sorted by operation id. An anchor's leaf, per operation:

version 1 (:func:`leaf_bytes`)::

    canonical_json([operation_id, seq, head])

version 2 (:func:`tail_leaf_bytes`), which also binds the operation's *tail*, the
observations stored after its last entry's coverage (ids above its ``obs_upto``,
or every one of them under a version-1 entry), which no entry covers yet::

    canonical_json([operation_id, seq, head, upto, count, digest])

``upto`` is the operation's highest observation id (when the tail is empty, the
last entry's ``obs_upto``, or 0), ``count`` the tail's length and ``digest`` its
:func:`window_digest` (null for an empty tail).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from jobtrail.domain.canonical import canonical_bytes, floatless_json, rfc3339

HASH_VERSION = 2
GENESIS = "0" * 64
_PREFIXES = {1: b"jobtrail/history/v1\0", 2: b"jobtrail/history/v2\0"}

#: The stored columns a version-1 entry hash covers, in the order a reader expects them.
HASHED_COLUMNS_V1 = (
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
HASHED_COLUMNS = (*HASHED_COLUMNS_V1, "covers", "obs_upto")
_COLUMNS = {1: HASHED_COLUMNS_V1, 2: HASHED_COLUMNS}

#: Operation columns fixed when the record is made; the creation entry covers each.
FIXED_FIELDS = (
    "provider",
    "target",
    "endpoint",
    "operation_key",
    "request_fingerprint",
    "request_body",
    "idempotency_token",
    "trace_id",
    "caller",
    "approved_by",
    "create_deadline_us",
    "result_deadline_us",
    "created_at_us",
)
#: Operation columns a transition may write; every entry covers each as it wrote it.
ENTRY_FIELDS = (
    "state",
    "remote_job_id",
    "remote_state",
    "state_reason",
    "attempts",
    "result_ref",
    "cancel_requested_by",
    "partial_effects",
    "cancel_deadline_us",
    "next_action_at_us",
    "polls",
    "updated_at_us",
)
#: The subset a reschedule (a poll's outcome, no history entry) may also write: sealed on the row.
SEALED_FIELDS = ("remote_state", "state_reason", "partial_effects", "next_action_at_us", "polls", "updated_at_us")
#: Columns only a transition writes (apart from the state and the job id, whose seams the audit checks on
#: their own): each entry covers them as it found them too (``before``), so one edited between two
#: transitions leaves a seam the next entry cannot hide.
BEFORE_FIELDS = ("attempts", "result_ref", "cancel_requested_by", "cancel_deadline_us")
#: Operational columns, deliberately not audited: who holds the lease, until when, and its fencing epoch.
LEASE_FIELDS = ("lease_owner", "lease_expires_at_us", "lease_epoch")
#: Result columns the entry recording a result covers (``result_record``); the bytes and their sha256 are
#: covered by ``result``, and the operation id is the row's key.
RESULT_FIELDS = ("size", "content_type", "path", "checks", "summary", "redacted", "stored_at_us")
#: Observation columns an observation's digest covers (its id is covered by the entry's window).
OBSERVATION_FIELDS = (
    "operation_id",
    "kind",
    "fetched_at_us",
    "provider_time",
    "http_status",
    "provider_request_id",
    "remote_state",
    "raw_state",
    "raw",
    "worker",
    "lease_epoch",
    "progress",
    "next_action_at_us",
)


def entry_hash(row: Mapping[str, Any]) -> str:
    """The hash of one history entry, from its stored column values, by the entry's own version."""
    version = row["hash_version"]
    if version not in _COLUMNS:
        raise ValueError(f"unknown history hash version {version}")
    doc = {name: row[name] for name in _COLUMNS[version]}
    doc["at"] = rfc3339(doc.pop("at_us"))
    # every value here is a string, an integer or null, so this is the canonical encoding
    return hashlib.sha256(_PREFIXES[version] + floatless_json(doc).encode("utf-8")).hexdigest()


def field_digest(value: Any) -> str:
    """128 bits of sha256 over one stored column value: enough to name the field, never its content."""
    kind = type(value)
    # counts, and an operation's times (its deadlines, its creation) repeat on every write of it, and
    # so do states and reasons; long values (a provider's partial effects) are not kept. (An exact int or
    # str only: True == 1 must not find 1's digest.)
    if kind is int:
        return _int_digest(value)
    if kind is str:
        return _short_str_digest(value) if len(value) <= _CACHED_LEN else _str_digest(value)
    if value is None:
        return _NULL_DIGEST
    return _digest(value)


_FIELD_PREFIX = b"jobtrail/field/v1\0"


def _digest(value: Any) -> str:
    return hashlib.sha256(_FIELD_PREFIX + canonical_bytes(value)).hexdigest()[:32]


_CACHED_LEN = 200


# An integer's and a string's canonical forms are written here directly, without the encoder's look at
# what the value holds: an entry's times, ids and tokens are new on each write, so most are not found in
# the caches either, and each entry digests a dozen fields.
@functools.lru_cache(maxsize=4096)
def _int_digest(value: int) -> str:
    return hashlib.sha256(_FIELD_PREFIX + str(value).encode("ascii")).hexdigest()[:32]


def _str_digest(value: str) -> str:
    try:
        data = orjson.dumps(value)  # a string's canonical form (json.dumps(ensure_ascii=False)'s escapes)
    except TypeError:  # a lone surrogate, which has no UTF-8 form: the encoder says so, as for any value
        return _digest(value)
    return hashlib.sha256(_FIELD_PREFIX + data).hexdigest()[:32]


_short_str_digest = functools.lru_cache(maxsize=4096)(_str_digest)


_NULL_DIGEST = _digest(None)


def field_digests(row: Mapping[str, Any], names: Sequence[str]) -> dict[str, str]:
    return {name: field_digest(row[name]) for name in names}


def before_digest(digests: Sequence[str]) -> str:
    """One digest of :data:`BEFORE_FIELDS`' field digests, in order: what an entry found them to be."""
    return hashlib.sha256(b"jobtrail/before/v1\0" + ",".join(digests).encode()).hexdigest()[:32]


def observation_digest(row: Mapping[str, Any]) -> str:
    doc = {name: row[name] for name in OBSERVATION_FIELDS}
    return hashlib.sha256(b"jobtrail/observation/v1\0" + canonical_bytes(doc)).hexdigest()


def window_digest(items: Sequence[tuple[int, str | None]]) -> str:
    """The digest of an ordered run of observations, as ``[[id, digest], ...]``."""
    return hashlib.sha256(b"jobtrail/observations/v1\0" + canonical_bytes([list(i) for i in items])).hexdigest()


def seal(row: Mapping[str, Any], digests: Mapping[str, str] | None = None) -> str:
    """The row's seal: the fields a reschedule may change, as last written (not anchored).

    ``digests``: the row's field digests where already computed (an entry's ``covers``).
    """
    if digests is None:
        digests = field_digests(row, SEALED_FIELDS)
    return floatless_json({name: digests[name] for name in SEALED_FIELDS})


def leaf_bytes(operation_id: str, seq: int, head: str) -> bytes:
    """An anchor's leaf, version 1: the chain head alone."""
    return canonical_bytes([operation_id, seq, head])


def tail_digest(items: Sequence[tuple[int, str | None]]) -> str | None:
    """The digest of an operation's tail (see :func:`window_digest`); None when it is empty, the common case
    (an operation resting, or not polled since its last entry), so an anchor of many is no larger for it."""
    return window_digest(items) if items else None


def tail_leaf_bytes(operation_id: str, seq: int, head: str, upto: int, count: int, digest: str | None) -> bytes:
    """An anchor's leaf, version 2: the chain head and the operation's tail (see the module docstring)."""
    return canonical_bytes([operation_id, seq, head, upto, count, digest])


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
