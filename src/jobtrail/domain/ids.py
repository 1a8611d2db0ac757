"""Identifiers: sortable operation ids, idempotency tokens and W3C trace ids."""

from __future__ import annotations

import random
import secrets
import time
from collections.abc import Callable

#: where random bits come from; only the deterministic simulation replaces it (see :func:`use_entropy`)
_randbits: Callable[[int], int] = secrets.randbits

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def _ulid(now_ms: int | None = None) -> str:
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    value = (ms << 80) | _randbits(80)
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def new_operation_id(now_ms: int | None = None) -> str:
    """``op_`` + a ULID: sorts by creation time (millisecond), 80 random bits."""
    return "op_" + _ulid(now_ms)


def new_idempotency_token() -> str:
    """128 random bits, hex. Never reused for another request fingerprint."""
    return f"{_randbits(128):032x}"


def new_trace_id() -> str:
    """A W3C trace-context trace id: 32 lowercase hex, never all zeros."""
    while True:
        trace_id = f"{_randbits(128):032x}"
        if trace_id != "0" * 32:
            return trace_id


def traceparent(trace_id: str, *, span_id: str | None = None, sampled: bool = True) -> str:
    """The ``traceparent`` header for one outgoing request of this trace (from span ``span_id``, 16 hex;
    a fresh one when None)."""
    # a span id identifies, it does not protect: no need for the OS's entropy on every request
    span_id = span_id or f"{random.getrandbits(64) or 1:016x}"
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def use_entropy(randbits: Callable[[int], int] | None) -> None:
    """Draw ids and tokens from ``randbits`` (a seeded simulation's), or from the OS again (None).

    Never in production: tokens must be unpredictable.
    """
    global _randbits  # noqa: PLW0603 - one process-wide source, by design
    _randbits = randbits or secrets.randbits
