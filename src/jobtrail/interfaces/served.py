"""What ``jobtrail webhooks serve`` and ``jobtrail dashboard`` run: uvicorn, with a deadline on each request.

uvicorn waits for a request as long as the client keeps the connection open (its
keep-alive time-out ends only a connection that sends nothing, and any byte
restarts it). A client that sends a header line every few seconds, or a body a
byte at a time (slowloris), holds a connection and a file descriptor for good,
and the application never hears of it or waits with it; enough of them and the
provider's real deliveries find no room. Here a request must arrive whole,
headers and body, within a deadline from the connection's start or the last
answer, or the connection is closed (past an answer given early, a 401 before
the body, the rest of the body has one deadline more, then the same).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

#: how long a client has to send a whole request where the application times no body of its own: a dashboard
#: form or a webhook delivery's headers are a few kilobytes, sent in milliseconds
REQUEST_DEADLINE_S = 10.0


class DeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request has not arrived whole within ``deadline_s``."""

    deadline_s = REQUEST_DEADLINE_S

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
        self._deadline = self.loop.call_later(self.deadline_s, self._late)

    def _late(self) -> None:
        self._deadline = None
        # IDLE: no request yet, or its headers in part; SEND_BODY: its body in part. (DONE: the request is whole,
        # and its answer the application's business)
        if not self.transport.is_closing() and self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self.transport.close()


def serve(app: Any, *, host: str, port: int, deadline_s: float = REQUEST_DEADLINE_S, **options: Any) -> None:
    """``uvicorn.run`` with :class:`DeadlineProtocol` (``deadline_s``: for each whole request)."""
    uvicorn.run(app, host=host, port=port, http=_protocol(deadline_s), **options)


async def serve_async(
    app: Any, *, host: str, port: int, deadline_s: float = REQUEST_DEADLINE_S, **options: Any
) -> None:
    """:func:`serve` on the running event loop."""
    config = uvicorn.Config(app, host=host, port=port, http=_protocol(deadline_s), **options)
    await uvicorn.Server(config).serve()


def _protocol(deadline_s: float) -> type[DeadlineProtocol]:
    return type("DeadlineProtocol", (DeadlineProtocol,), {"deadline_s": deadline_s})
