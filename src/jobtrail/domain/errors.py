"""Every error jobtrail raises on purpose.

::

    JobtrailError                      one root; str() says what is wrong and what to do
    ├── UsageError                     the caller asked for something that cannot be done
    │   ├── ConfigError                a setting, URL or provider file is wrong
    │   ├── OperationKeyConflict       same operation key, different request
    │   ├── SecretInRequest            a request body carries a credential
    │   └── TransitionRefused          not in the state table, or evidence missing
    └── OperationalError               the world did not cooperate
        ├── StorageError               the database is locked, gone or refused a write
        ├── StaleRecord                another writer (or a newer lease) changed the record first
        ├── JobIdTaken                 the provider named a job another operation already holds
        └── OperationNotFound          no record with that id

Every error keeps its constructor arguments as attributes, so it can be stored
as a structured row or pickled and rebuilt.
"""

from __future__ import annotations

from typing import Any


class JobtrailError(Exception):
    """Base of every error jobtrail raises on purpose."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.message, self.details))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[JobtrailError], message: str, details: dict[str, Any]) -> JobtrailError:
    err = cls.__new__(cls)
    JobtrailError.__init__(err, message, **details)
    return err


class UsageError(JobtrailError):
    """The caller asked for something that cannot be done as asked."""


class ConfigError(UsageError):
    """A setting, database URL or provider file is wrong."""


class OperationKeyConflict(UsageError):
    """The operation key already names an operation with a different request."""


class SecretInRequest(UsageError):
    """A request body carries something that looks like a credential."""


class TransitionRefused(UsageError):
    """The transition is not in the state table, or its evidence is missing or wrong."""


class OperationalError(JobtrailError):
    """Something outside the caller's control failed."""


class StorageError(OperationalError):
    """The database is locked, unreachable or refused a write."""


class StaleRecord(OperationalError):
    """The record changed since it was read (another writer, or a newer lease)."""


class JobIdTaken(OperationalError):
    """The provider answered with a remote job id that another operation of the same provider already holds:
    one remote job cannot be two operations' (the write that would have given it to this one did not land)."""


class OperationNotFound(OperationalError):
    """No operation with that id exists in this database."""


class NoDecisionAwaited(OperationalError):
    """A person's decision was recorded for an operation that waits for none (it runs, or it ended)."""


def missing_extra(extra: str, purpose: str, exc: ImportError) -> ConfigError:
    """The error for an optional part whose extra is not installed (raise it ``from exc``).

    The core install is the library, the CLI, the worker and SQLite; PostgreSQL, the MCP
    server and the webhook receiver each come with an extra, so the way out is one pip line.
    """
    return ConfigError(
        f"{purpose} needs the {extra!r} extra ({exc.name or exc} is not installed); "
        f"install it with: pip install 'jobtrail[{extra}]'",
        extra=extra,
        module=exc.name,
    )


def require_extra(extra: str, purpose: str, *modules: str) -> None:
    """Import ``modules`` now, or raise :func:`missing_extra`'s error naming ``extra``."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise missing_extra(extra, purpose, exc) from exc
