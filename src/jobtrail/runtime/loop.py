"""The event loop a jobtrail process runs on.

uvloop where it is installed (a core dependency on Linux and macOS), asyncio's own loop
elsewhere. A worker spends a good part of its CPU in the loop itself (sockets, callbacks,
timers); measured with ``bench/lifecycle.py``, uvloop cuts a worker's CPU per operation by
about a tenth, while the plain aiohttp loop it is compared with runs the same on either.

Ctrl-C: asyncio's runner cancels the main task once, and only a second Ctrl-C interrupts. A
library may swallow that one cancellation (a time-out that fires in the same turn can turn it
into a ``TimeoutError``, which the flows take for a provider that did not answer and try again):
a command would go on waiting, until its create deadline, for a person who had already said
stop. Here the cancellation is repeated until the task ends, and after :data:`_INSIST_S` the
loop is interrupted as a second Ctrl-C would. (A task that swallows every cancellation still holds
up the runner's close, which waits for it, as asyncio's own does: a second Ctrl-C ends that.)
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Coroutine
from types import FrameType
from typing import Any, TypeVar

_T = TypeVar("_T")
#: how often the cancellation is repeated, and how long before the loop itself is interrupted
_AGAIN_S = 0.25
_INSIST_S = 3.0


def run(main: Coroutine[Any, Any, _T]) -> _T:
    """Run ``main`` to completion on a new event loop (uvloop's when installed), like :func:`asyncio.run`;
    a Ctrl-C ends it with ``KeyboardInterrupt`` (see the module's docstring)."""
    uvloop = _uvloop()
    with asyncio.Runner(loop_factory=None if uvloop is None else uvloop.new_event_loop) as runner:
        stop = _CtrlC(runner.get_loop())
        previous = None
        # (as asyncio's runner does: only where Ctrl-C would otherwise raise, and a worker handles its own)
        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            previous = signal.signal(signal.SIGINT, stop.on_sigint)
        try:
            return runner.run(stop.watch(main))
        except asyncio.CancelledError:
            if stop.interrupted:
                raise KeyboardInterrupt from None
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)


class _CtrlC:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.task: asyncio.Task[Any] | None = None
        self.interrupted = False

    async def watch(self, main: Coroutine[Any, Any, _T]) -> _T:
        self.task = asyncio.current_task()
        return await main

    def on_sigint(self, signum: int, frame: FrameType | None) -> None:
        task = self.task
        if self.interrupted or task is None or task.done():
            raise KeyboardInterrupt  # a second Ctrl-C, or one before the task ran
        self.interrupted = True
        task.cancel()
        self.loop.call_soon_threadsafe(self.loop.call_later, _AGAIN_S, self._insist, task, time.monotonic() + _INSIST_S)

    def _insist(self, task: asyncio.Task[Any], until: float) -> None:
        if task.done():
            return
        if time.monotonic() >= until:
            raise KeyboardInterrupt  # (out of the loop, as from a second Ctrl-C's handler)
        task.cancel()
        self.loop.call_later(_AGAIN_S, self._insist, task, until)


def loop_name() -> str:
    """Which loop :func:`run` uses: ``uvloop`` or ``asyncio``."""
    return "asyncio" if _uvloop() is None else "uvloop"


def _uvloop() -> Any:
    """uvloop, or None where it is not installed (imported when asked: a test may take it away)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop
