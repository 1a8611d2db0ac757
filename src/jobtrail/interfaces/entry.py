"""The ``jobtrail`` console entry: signal handling first, then the command line.

A worker asked to stop while it is still starting (importing, opening the
database, loading provider files) must exit cleanly with 0, not die by the
signal. So before anything heavy is imported, SIGTERM and SIGINT only set a
flag; the worker honours it as soon as its loop runs, and from then on its
loop's own handlers take over.
"""

from __future__ import annotations

import signal
import sys

from jobtrail.interfaces.argv import subcommand
from jobtrail.interfaces.early import remember


def main() -> None:
    if subcommand(sys.argv[1:]) == "worker":
        signal.signal(signal.SIGTERM, remember)
        signal.signal(signal.SIGINT, remember)
    from jobtrail.interfaces.cli import main as cli_main

    cli_main()
