"""The entry point: the root group with every command group registered."""

from __future__ import annotations

import sys

from jobtrail.domain.errors import OperationalError
from jobtrail.interfaces.cli import audit, dashboard, intent, ops, providers, results, serve
from jobtrail.interfaces.cli.common import EXIT_USAGE, cli, fail

#: the modules whose commands register themselves on the root group when imported
COMMAND_GROUPS = (ops, intent, results, providers, serve, audit, dashboard)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``jobtrail`` script."""
    try:
        cli.main(args=argv, prog_name="jobtrail", standalone_mode=True)
    except OperationalError as exc:  # raised while closing the context, or re-raised for --debug
        if "--debug" in (sys.argv[1:] if argv is None else argv):
            raise  # the traceback the user asked for (the root re-raised it; this is not the place to hide it)
        fail(str(exc), EXIT_USAGE)
