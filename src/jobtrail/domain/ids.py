"""Identifiers: sortable operation ids, idempotency tokens and W3C trace ids."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar


class _OsBits:
    """Random bits from the OS (``os.urandom``, as :mod:`secrets` draws them), read 4 KiB at a time: a submit
    draws three values (an id, a token, a trace id), and a system call for each cost a tenth of the
    submit. Each byte is handed out once; a forked child starts with none of its parent's bytes, or two
    processes would hand out the same tokens."""

    _READ = 4096

    def __init__(self) -> None:
        self._forget()

    def _forget(self) -> None:
        self._lock = threading.Lock()  # (a new one in a child: another thread may have held the parent's)
        self._bytes = b""
        self._at = 0

    def __call__(self, k: int) -> int:
        n = (k + 7) // 8
        with self._lock:
            if self._at + n > len(self._bytes):
                self._bytes, self._at = os.urandom(max(self._READ, n)), 0
            chunk = self._bytes[self._at : self._at + n]
            self._at += n
        return int.from_bytes(chunk, "big") >> (8 * n - k)


_OS_BITS = _OsBits()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_OS_BITS._forget)

#: where random bits come from: the OS, except inside a deterministic simulation's
#: :func:`seeded_entropy` (a context variable, so it reaches only the code that simulation runs)
_entropy: ContextVar[Callable[[int], int]] = ContextVar("jobtrail_entropy", default=_OS_BITS)

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
#: every 10-bit value as its two characters: a ULID's 130 bits are 13 of them (base64's b32encode is
#: pure Python, and cost a twentieth of a submit)
_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]


def _ulid(now_ms: int | None = None) -> str:
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    value = (ms << 80) | _entropy.get()(80)
    # 26 characters of 5 bits, the most significant first (the top two bits are the time's, zero until 10889)
    return "".join([_PAIRS[(value >> shift) & 1023] for shift in range(120, -1, -10)])


def new_operation_id(now_ms: int | None = None) -> str:
    """``op_`` + a ULID: sorts by creation time (millisecond), 80 random bits."""
    return "op_" + _ulid(now_ms)


def new_idempotency_token() -> str:
    """128 random bits, hex. Never reused for another request fingerprint."""
    return f"{_entropy.get()(128):032x}"


def new_trace_id() -> str:
    """A W3C trace-context trace id: 32 lowercase hex, never all zeros."""
    while True:
        trace_id = f"{_entropy.get()(128):032x}"
        if trace_id != "0" * 32:
            return trace_id


def traceparent(trace_id: str, *, span_id: str | None = None, sampled: bool = True) -> str:
    """The ``traceparent`` header for one outgoing request of this trace (from span ``span_id``, 16 hex;
    a fresh one when None)."""
    # a span id identifies, it does not protect: no need for the OS's entropy on every request
    span_id = span_id or f"{random.getrandbits(64) or 1:016x}"
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


@contextmanager
def seeded_entropy(randbits: Callable[[int], int]) -> Iterator[None]:
    """Within this block (and the tasks and threads it starts), draw ids and tokens from ``randbits``:
    a seeded simulation's, so that a seed replays exactly. Never in production: tokens must be
    unpredictable."""
    reset = _entropy.set(randbits)
    try:
        yield
    finally:
        _entropy.reset(reset)
