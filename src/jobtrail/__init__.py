"""jobtrail: durable, honest bookkeeping for long-running jobs on remote HTTP APIs.

Names are imported on first use (PEP 562): ``import jobtrail`` stays cheap, so
the command line starts fast and installs its signal handling before anything
heavy (SQLAlchemy, aiohttp) is loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobtrail._backoff import Backoff
    from jobtrail._client import AsyncJobtrail, Jobtrail
    from jobtrail._errors import (
        ConfigError,
        JobtrailError,
        OperationalError,
        OperationKeyConflict,
        OperationNotFound,
        SecretInRequest,
        StaleRecord,
        StorageError,
        TransitionRefused,
        UsageError,
    )
    from jobtrail._evidence import (
        AmbiguousCreate,
        CancelAcknowledged,
        CancelIntent,
        CannotTell,
        ConfirmedCreate,
        ConflictingJobIds,
        CreateAttempt,
        CreateNotSent,
        DeadlinePassed,
        DefinitiveRejection,
        Evidence,
        HumanDecision,
        OperationCreated,
        ProvedAbsent,
        ReconciliationStarted,
        ResultUnavailable,
        ResumeRequested,
        StatusObservation,
        SynchronousResult,
        ValidatedResult,
        ValidationFailure,
    )
    from jobtrail._http_provider import HttpProvider, load_provider
    from jobtrail._provider import (
        Capabilities,
        CreateOutcome,
        LookupOutcome,
        Provider,
        ReconcileMode,
        Response,
        StatusOutcome,
        TokenPlacement,
    )
    from jobtrail._record import HistoryEntry, Operation, OperationSpec
    from jobtrail._redact import Redactor, Secret
    from jobtrail._states import RemoteState, State
    from jobtrail._store import Change, Store
    from jobtrail._tasks import StepView, Task
    from jobtrail._webhooks import webhook_app
    from jobtrail._worker import Worker

#: public name -> the module that defines it
_WHERE = {
    "AmbiguousCreate": "jobtrail._evidence",
    "AsyncJobtrail": "jobtrail._client",
    "Backoff": "jobtrail._backoff",
    "CancelAcknowledged": "jobtrail._evidence",
    "CancelIntent": "jobtrail._evidence",
    "CannotTell": "jobtrail._evidence",
    "Capabilities": "jobtrail._provider",
    "Change": "jobtrail._store",
    "ConfigError": "jobtrail._errors",
    "ConfirmedCreate": "jobtrail._evidence",
    "ConflictingJobIds": "jobtrail._evidence",
    "CreateAttempt": "jobtrail._evidence",
    "CreateNotSent": "jobtrail._evidence",
    "CreateOutcome": "jobtrail._provider",
    "DeadlinePassed": "jobtrail._evidence",
    "DefinitiveRejection": "jobtrail._evidence",
    "Evidence": "jobtrail._evidence",
    "HistoryEntry": "jobtrail._record",
    "HttpProvider": "jobtrail._http_provider",
    "HumanDecision": "jobtrail._evidence",
    "Jobtrail": "jobtrail._client",
    "JobtrailError": "jobtrail._errors",
    "LookupOutcome": "jobtrail._provider",
    "Operation": "jobtrail._record",
    "OperationCreated": "jobtrail._evidence",
    "OperationKeyConflict": "jobtrail._errors",
    "OperationNotFound": "jobtrail._errors",
    "OperationSpec": "jobtrail._record",
    "OperationalError": "jobtrail._errors",
    "ProvedAbsent": "jobtrail._evidence",
    "Provider": "jobtrail._provider",
    "ReconcileMode": "jobtrail._provider",
    "ReconciliationStarted": "jobtrail._evidence",
    "Redactor": "jobtrail._redact",
    "RemoteState": "jobtrail._states",
    "Response": "jobtrail._provider",
    "ResultUnavailable": "jobtrail._evidence",
    "ResumeRequested": "jobtrail._evidence",
    "Secret": "jobtrail._redact",
    "SecretInRequest": "jobtrail._errors",
    "StaleRecord": "jobtrail._errors",
    "State": "jobtrail._states",
    "StatusObservation": "jobtrail._evidence",
    "StatusOutcome": "jobtrail._provider",
    "StepView": "jobtrail._tasks",
    "StorageError": "jobtrail._errors",
    "Store": "jobtrail._store",
    "SynchronousResult": "jobtrail._evidence",
    "Task": "jobtrail._tasks",
    "TokenPlacement": "jobtrail._provider",
    "TransitionRefused": "jobtrail._errors",
    "UsageError": "jobtrail._errors",
    "ValidatedResult": "jobtrail._evidence",
    "ValidationFailure": "jobtrail._evidence",
    "Worker": "jobtrail._worker",
    "load_provider": "jobtrail._http_provider",
    "webhook_app": "jobtrail._webhooks",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'jobtrail' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "AmbiguousCreate",
    "AsyncJobtrail",
    "Backoff",
    "CancelAcknowledged",
    "CancelIntent",
    "CannotTell",
    "Capabilities",
    "Change",
    "ConfigError",
    "ConfirmedCreate",
    "ConflictingJobIds",
    "CreateAttempt",
    "CreateNotSent",
    "CreateOutcome",
    "DeadlinePassed",
    "DefinitiveRejection",
    "Evidence",
    "HistoryEntry",
    "HttpProvider",
    "HumanDecision",
    "Jobtrail",
    "JobtrailError",
    "LookupOutcome",
    "Operation",
    "OperationCreated",
    "OperationKeyConflict",
    "OperationNotFound",
    "OperationSpec",
    "OperationalError",
    "ProvedAbsent",
    "Provider",
    "ReconcileMode",
    "ReconciliationStarted",
    "Redactor",
    "RemoteState",
    "Response",
    "ResultUnavailable",
    "ResumeRequested",
    "Secret",
    "SecretInRequest",
    "StaleRecord",
    "State",
    "StatusObservation",
    "StatusOutcome",
    "StepView",
    "StorageError",
    "Store",
    "SynchronousResult",
    "Task",
    "TokenPlacement",
    "TransitionRefused",
    "UsageError",
    "ValidatedResult",
    "ValidationFailure",
    "Worker",
    "load_provider",
    "webhook_app",
]
