"""The provider's connections as slots: at most so many requests on the wire, each waiting a bounded time."""

from __future__ import annotations

import asyncio
import collections


class ConnectionGate:
    """At most ``size`` requests hold a slot at once; the others queue in order, each for at most ``wait_s``.

    An :class:`asyncio.Semaphore` under :func:`asyncio.timeout` did the same with a timer of its own for
    every request that waited: with few connections nearly every request waits, and arming and cancelling
    those timers cost the worker's loop 3 % of its CPU. Here every waiter has the same patience,
    so the queue is also in the order of their deadlines, and one timer (for the oldest) serves them all.
    """

    def __init__(self, size: int, wait_s: float) -> None:
        self._free = size
        self._wait_s = wait_s
        #: (deadline on the loop's clock, the waiter's future), oldest first
        self._waiting: collections.deque[tuple[float, asyncio.Future[bool]]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None

    def locked(self) -> bool:
        """Would a request wait now?"""
        return self._free == 0 or bool(self._waiting)

    async def acquire(self) -> bool:
        """Take a slot: True once one is ours, False when none came free within ``wait_s``."""
        if not self.locked():
            self._free -= 1
            return True
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        deadline = loop.time() + self._wait_s
        self._waiting.append((deadline, future))
        if self._timer is None:
            self._timer = loop.call_at(deadline, self._expire)
        try:
            return await future
        except asyncio.CancelledError:
            # handed a slot just before the cancel reached us: pass it on, or it is lost for good
            if future.done() and not future.cancelled() and future.result():
                self.release()
            raise

    def release(self) -> None:
        """Give a slot back: to the oldest request still waiting, else to the free ones."""
        waiting = self._waiting
        while waiting:
            _, future = waiting.popleft()
            if not future.done():  # (a waiter cancelled meanwhile is skipped)
                future.set_result(True)
                return
        self._free += 1

    def _expire(self) -> None:
        """Turn away the waiters whose time ran out, and set the timer for the next oldest."""
        self._timer = None
        waiting = self._waiting
        loop = asyncio.get_running_loop()
        now = loop.time()
        while waiting and (waiting[0][0] <= now or waiting[0][1].done()):
            _, future = waiting.popleft()
            if not future.done():
                future.set_result(False)
        if waiting:
            self._timer = loop.call_at(waiting[0][0], self._expire)
