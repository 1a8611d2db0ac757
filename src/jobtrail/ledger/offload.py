"""Database and file work never runs on the event loop thread.

One wait on a SQLite lock held by another process (up to the 30 s busy
time-out), a slow PostgreSQL round trip or the fsync of a large result would,
on the loop, stall every provider call in flight: a slow answer becomes a
client time-out, a time-out an ambiguous create, and reconciliation work that
never needed to happen. Async code therefore hands blocking work to an
:class:`Offload`: :func:`threads` in production, :func:`inline` in the
deterministic simulation, where a virtual clock and a seeded scheduler, not
threads, decide the order of events.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class Offload(Protocol):
    """Runs one blocking call and returns its value to the awaiting coroutine."""

    async def __call__(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T: ...


async def threads(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """On a thread of the loop's executor (context variables go along, as with :func:`asyncio.to_thread`)."""
    return await asyncio.to_thread(fn, *args, **kwargs)


async def inline(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """On the loop itself: only for the simulation, whose store is a file nobody else writes."""
    return fn(*args, **kwargs)


__all__ = ["Offload", "inline", "threads"]
