"""The ``jobtrail`` command line, one module per command group (``main`` registers them all).

Exit codes: ``common.EXIT_CODES`` (0 ok, 1 a negative answer, 2 cannot answer, 3 a person must
decide, 4 still running at the time-out).
"""

from jobtrail.interfaces.cli.common import cli
from jobtrail.interfaces.cli.main import main

__all__ = ["cli", "main"]
