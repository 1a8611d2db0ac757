"""The ``jobtrail`` command line, one module per command group (``main`` registers them all).

Exit codes: 0 ok; 1 a negative answer (tampered history, operation not found,
operation failed); 2 usage, configuration or storage error (cannot answer);
3 a person must decide.
"""

from jobtrail.interfaces.cli.common import cli
from jobtrail.interfaces.cli.main import main

__all__ = ["cli", "main"]
