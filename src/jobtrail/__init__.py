"""jobtrail: durable, honest bookkeeping for long-running jobs on remote HTTP APIs.

Names are imported on first use (PEP 562): ``import jobtrail`` stays cheap, so
the command line starts fast and installs its signal handling before anything
heavy (SQLAlchemy, aiohttp) is loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobtrail.domain.backoff import Backoff
    from jobtrail.domain.errors import (
        ConfigError,
        JobIdTaken,
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
    from jobtrail.domain.evidence import (
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
    from jobtrail.domain.record import BODY_NOT_LOADED, HistoryEntry, Operation, OperationSpec
    from jobtrail.domain.redact import Redactor, Secret
    from jobtrail.domain.states import RemoteState, State
    from jobtrail.interfaces.webhooks import webhook_app
    from jobtrail.ledger.store import Change, Store
    from jobtrail.providers.contract import (
        Capabilities,
        CreateOutcome,
        LookupOutcome,
        Provider,
        ReconcileMode,
        Response,
        StatusOutcome,
        TokenPlacement,
    )
    from jobtrail.providers.http import HttpProvider
    from jobtrail.providers.kinds import load_provider
    from jobtrail.runtime.client import AsyncJobtrail, Jobtrail
    from jobtrail.runtime.tasks import StepView, Task
    from jobtrail.runtime.worker import Worker

#: public name -> the module that defines it
_WHERE = {
    "AmbiguousCreate": "jobtrail.domain.evidence",
    "AsyncJobtrail": "jobtrail.runtime.client",
    "BODY_NOT_LOADED": "jobtrail.domain.record",
    "Backoff": "jobtrail.domain.backoff",
    "CancelAcknowledged": "jobtrail.domain.evidence",
    "CancelIntent": "jobtrail.domain.evidence",
    "CannotTell": "jobtrail.domain.evidence",
    "Capabilities": "jobtrail.providers.contract",
    "Change": "jobtrail.ledger.store",
    "ConfigError": "jobtrail.domain.errors",
    "ConfirmedCreate": "jobtrail.domain.evidence",
    "ConflictingJobIds": "jobtrail.domain.evidence",
    "CreateAttempt": "jobtrail.domain.evidence",
    "CreateNotSent": "jobtrail.domain.evidence",
    "CreateOutcome": "jobtrail.providers.contract",
    "DeadlinePassed": "jobtrail.domain.evidence",
    "DefinitiveRejection": "jobtrail.domain.evidence",
    "Evidence": "jobtrail.domain.evidence",
    "HistoryEntry": "jobtrail.domain.record",
    "HttpProvider": "jobtrail.providers.http",
    "HumanDecision": "jobtrail.domain.evidence",
    "Jobtrail": "jobtrail.runtime.client",
    "JobIdTaken": "jobtrail.domain.errors",
    "JobtrailError": "jobtrail.domain.errors",
    "LookupOutcome": "jobtrail.providers.contract",
    "Operation": "jobtrail.domain.record",
    "OperationCreated": "jobtrail.domain.evidence",
    "OperationKeyConflict": "jobtrail.domain.errors",
    "OperationNotFound": "jobtrail.domain.errors",
    "OperationSpec": "jobtrail.domain.record",
    "OperationalError": "jobtrail.domain.errors",
    "ProvedAbsent": "jobtrail.domain.evidence",
    "Provider": "jobtrail.providers.contract",
    "ReconcileMode": "jobtrail.providers.contract",
    "ReconciliationStarted": "jobtrail.domain.evidence",
    "Redactor": "jobtrail.domain.redact",
    "RemoteState": "jobtrail.domain.states",
    "Response": "jobtrail.providers.contract",
    "ResultUnavailable": "jobtrail.domain.evidence",
    "ResumeRequested": "jobtrail.domain.evidence",
    "Secret": "jobtrail.domain.redact",
    "SecretInRequest": "jobtrail.domain.errors",
    "StaleRecord": "jobtrail.domain.errors",
    "State": "jobtrail.domain.states",
    "StatusObservation": "jobtrail.domain.evidence",
    "StatusOutcome": "jobtrail.providers.contract",
    "StepView": "jobtrail.runtime.tasks",
    "StorageError": "jobtrail.domain.errors",
    "Store": "jobtrail.ledger.store",
    "SynchronousResult": "jobtrail.domain.evidence",
    "Task": "jobtrail.runtime.tasks",
    "TokenPlacement": "jobtrail.providers.contract",
    "TransitionRefused": "jobtrail.domain.errors",
    "UsageError": "jobtrail.domain.errors",
    "ValidatedResult": "jobtrail.domain.evidence",
    "ValidationFailure": "jobtrail.domain.evidence",
    "Worker": "jobtrail.runtime.worker",
    "load_provider": "jobtrail.providers.kinds",
    "webhook_app": "jobtrail.interfaces.webhooks",
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
    "BODY_NOT_LOADED",
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
    "JobIdTaken",
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
