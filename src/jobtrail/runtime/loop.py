"""The event loop a long-running jobtrail process runs on.

uvloop where it is installed (a core dependency on Linux and macOS), asyncio's own loop
elsewhere. A worker spends a good part of its CPU in the loop itself (sockets, callbacks,
timers); measured with ``bench/lifecycle.py``, uvloop cuts a worker's CPU per operation by
about a tenth, while the plain aiohttp loop it is compared with runs the same on either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


def run(main: Coroutine[Any, Any, _T]) -> _T:
    """Run ``main`` to completion on a new event loop (uvloop's when installed), like :func:`asyncio.run`."""
    uvloop = _uvloop()
    if uvloop is None:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


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
