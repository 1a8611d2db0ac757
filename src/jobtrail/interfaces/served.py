"""What ``jobtrail webhooks serve``, ``jobtrail dashboard`` and ``jobtrail mcp --http`` run: uvicorn, with
deadlines on each request's arrival.

uvicorn waits for a request as long as the client keeps the connection open (its
keep-alive time-out ends only a connection that sends nothing, and any byte
restarts it). A client that sends a header line every few seconds, or a body a
byte at a time (slowloris), holds a connection and a file descriptor for good,
and the application never hears of it or waits with it; enough of them and the
provider's real deliveries find no room. Here a request's headers must arrive
whole within :data:`HEADERS_DEADLINE_S` of the connection's start or the last
answer, and its body within the server's body deadline of the headers (an
answer given early, a 401 before the body, does not extend it), or the
connection is closed. The answer itself takes as long as it takes.

uvicorn also takes as many connections as are opened, and holds a body's first
tens of kilobytes for each before the application reads it: past
:data:`MAX_CONNECTIONS` open at once, a request is answered 503 at once instead.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

#: how long a client has to send a request's headers: a few hundred bytes, sent in milliseconds
HEADERS_DEADLINE_S = 10.0
#: and its body, where the application sets no time of its own: a dashboard form or an MCP message
BODY_DEADLINE_S = 10.0
#: uvicorn's ``limit_concurrency``: past this many connections (or requests under way) open at once, a new request
#: is answered 503 (which a webhook provider retries later) before the application sees it. Without it, each
#: connection cost its buffers (uvicorn reads up to 64 KiB of a body and more arrives with them before it stops
#: reading; the receiver held up to a whole delivery besides) and anyone could open thousands: 1,500 held 1.6 GiB.
#: Each of the three servers answers a few clients: a provider delivering a burst of events, a few people's
#: browsers, an agent or two; 256 leaves them far more room than they use, and bounds what is held to tens of MiB
MAX_CONNECTIONS = 256


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request's headers have not arrived whole within
    :data:`HEADERS_DEADLINE_S`, or its body within ``body_s`` after them."""

    body_s = BODY_DEADLINE_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._awaiting_headers = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._next_request()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self._awaiting_headers and self.conn.their_state is not h11.IDLE:
            self._awaiting_headers = False  # the headers are in: the body (if any) has its own time from now
            self._set(self.body_s)

    def on_response_complete(self) -> None:
        if self.conn.their_state is not h11.SEND_BODY:  # the request was whole: the next one's headers are due
            self._next_request()
        # (answered before its body came: the body's deadline stands.) Pipelined requests are read here
        super().on_response_complete()

    def _next_request(self) -> None:
        self._awaiting_headers = True
        self._set(HEADERS_DEADLINE_S)

    def _set(self, seconds: float) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(seconds, self._late)

    def _late(self) -> None:
        self._deadline = None
        # IDLE: no request yet, or its headers in part; SEND_BODY: its body in part. (DONE: the request is whole,
        # and its answer the application's business)
        if not self.transport.is_closing() and self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self.transport.close()


def serve(app: Any, *, host: str, port: int, body_s: float = BODY_DEADLINE_S, **options: Any) -> None:
    """``uvicorn.run`` with :class:`DeadlineProtocol` (``body_s``: each request's body deadline) and at most
    :data:`MAX_CONNECTIONS` connections served at once (``limit_concurrency`` in ``options`` sets another)."""
    uvicorn.run(app, host=host, port=port, http=_protocol(body_s), **_limited(options))


async def serve_async(app: Any, *, host: str, port: int, body_s: float = BODY_DEADLINE_S, **options: Any) -> None:
    """:func:`serve` on the running event loop."""
    config = uvicorn.Config(app, host=host, port=port, http=_protocol(body_s), **_limited(options))
    await uvicorn.Server(config).serve()


def _limited(options: dict[str, Any]) -> dict[str, Any]:
    limits = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _OverTheLimit) for f in limits.filters):
        limits.addFilter(_OverTheLimit())
    return {"limit_concurrency": MAX_CONNECTIONS, **options}


class _OverTheLimit(logging.Filter):
    """uvicorn's warning for a request refused over ``limit_concurrency``, one line a second at most: it writes
    one for each, so a flood of connections, the thing the limit is for, flooded the log too."""

    _TEXT = "Exceeded concurrency limit."

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._shown_at = -math.inf
        self._unshown = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != self._TEXT:
            return True
        with self._lock:
            now = time.monotonic()
            if now - self._shown_at < 1.0:
                self._unshown += 1
                return False
            unshown, self._unshown, self._shown_at = self._unshown, 0, now
        # (uvicorn's line has no arguments of its own)
        record.msg, record.args = (
            "more connections open at once than the server's limit: a request was answered 503%s",
            (f", and {unshown} more since the last such line" if unshown else "",),
        )
        return True


def _protocol(body_s: float) -> type[DeadlineProtocol]:
    return type("DeadlineProtocol", (DeadlineProtocol,), {"body_s": body_s})
