"""jobtrail: durable, honest bookkeeping for long-running jobs on remote HTTP APIs."""

from __future__ import annotations

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
