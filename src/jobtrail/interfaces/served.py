"""What ``jobtrail webhooks serve`` and ``jobtrail dashboard`` run: uvicorn, with a deadline on each request.

uvicorn waits for a request's headers as long as the client keeps the connection
open (its keep-alive time-out ends only a connection that sends nothing, and any
byte restarts it). A client that sends a header line every few seconds
(slowloris) holds a connection and a file descriptor for good, and the
application never hears of it; enough of them and the provider's real
deliveries find no room. Here a request's headers must arrive whole within
:data:`HEADERS_DEADLINE_S` of the connection opening or the previous answer, or
the connection is closed. (The body is the application's to time: the webhook
receiver answers 408 past the provider's ``read_timeout_s``.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

#: how long a client has to send a request's headers: a few hundred bytes, sent in milliseconds
HEADERS_DEADLINE_S = 10.0


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers have not arrived whole in time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request on this connection has a deadline of its own

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(HEADERS_DEADLINE_S, self._late)

    def _late(self) -> None:
        self._deadline = None
        # IDLE: no request yet, or its headers in part. Past that, the request is the application's (it times
        # the body itself)
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.transport.close()


def serve(app: Any, *, host: str, port: int, **options: Any) -> None:
    """``uvicorn.run`` with :class:`DeadlineProtocol`."""
    uvicorn.run(app, host=host, port=port, http=DeadlineProtocol, **options)
