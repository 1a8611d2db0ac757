"""Signals that arrive before the worker's loop runs (the console entry installs :func:`remember`).

Its own module, so the entry (which imports the command line late) and the
command line (which reads what arrived) do not import each other.
"""

from __future__ import annotations

from types import FrameType

#: the signals (SIGTERM, SIGINT) that arrived before the worker's loop installed its own handlers
early_signals: set[int] = set()


def remember(signum: int, frame: FrameType | None) -> None:
    early_signals.add(signum)
