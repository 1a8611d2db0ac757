"""The ``jobtrail`` console entry: signal handling first, then the command line.

A worker asked to stop while it is still starting (importing, opening the
database, loading provider files) must exit cleanly with 0, not die by the
signal. So before anything heavy is imported, SIGTERM and SIGINT only set a
flag; the worker honours it as soon as its loop runs, and from then on its
loop's own handlers take over.
"""

from __future__ import annotations

import io
import signal
import sys

from jobtrail.interfaces.argv import subcommand
from jobtrail.interfaces.early import remember


def main() -> None:
    _whole_writes()
    if subcommand(sys.argv[1:]) == "worker":
        signal.signal(signal.SIGTERM, remember)
        signal.signal(signal.SIGINT, remember)
    from jobtrail.interfaces.cli import main as cli_main

    cli_main()


def _whole_writes() -> None:
    """Standard output and error that never drop part of what is written to them.

    Under PYTHONUNBUFFERED=1 (many container images set it) or ``python -u``, ``sys.stdout`` and
    ``sys.stderr`` write to the raw file, and a write that a signal interrupts (a stop: ^Z in a pipeline, a
    debugger or profiler attaching) takes only part of a long text and returns, the rest silently dropped:
    ``print``, ``--json`` documents and log lines included, so the reader gets a truncated answer and no
    error. A buffered file finishes every write; flushing at each line keeps the output as prompt as
    unbuffered output (and is what Python gives standard error without ``-u``).
    """
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        # io.FileIO, or a Windows console's raw file (which also writes part of a long text)
        if isinstance(getattr(stream, "buffer", None), io.RawIOBase):
            whole = open(  # noqa: SIM115 - the process's own stream, for as long as it runs
                stream.fileno(), "w", encoding=stream.encoding, errors=stream.errors, buffering=1, closefd=False
            )
            setattr(sys, name, whole)
