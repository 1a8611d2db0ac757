"""Typed evidence: what a transition must show before the state machine allows it.

Each class is one kind of fact. Its ``to_json()`` is what the history entry
stores (after redaction), so an auditor reads the same fact the code checked.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from jobtrail.domain.states import RemoteState

DeadlineKind = Literal["create", "result", "cancel"]


def _field_names(kind: type) -> tuple[str, ...]:
    """An evidence class's fields, in order (asked for every entry written: worth remembering)."""
    names = _FIELD_NAMES.get(kind)
    if names is None:
        names = _FIELD_NAMES[kind] = tuple(f.name for f in dataclasses.fields(kind))
    return names


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence:
    """Base of every evidence kind."""

    kind: ClassVar[str] = "evidence"

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"kind": self.kind}
        for name in _field_names(type(self)):
            value = getattr(self, name)
            if value is None or value in ((), {}):
                continue
            doc[name] = list(value) if isinstance(value, tuple) else value
        return doc

    def describe(self) -> str:
        return self.kind.replace("_", " ")


@dataclass(frozen=True, slots=True, kw_only=True)
class OperationCreated(Evidence):
    """The record was made durable (first history entry of every operation)."""

    kind: ClassVar[str] = "operation_created"
    request_fingerprint: str
    operation_key: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateAttempt(Evidence):
    """A create is about to be sent; durable before the bytes leave."""

    kind: ClassVar[str] = "create_attempt"
    attempt: int
    reason: str = "send"


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfirmedCreate(Evidence):
    """The provider answered the create (or a reconciliation) with a job id."""

    kind: ClassVar[str] = "confirmed_create"
    remote_job_id: str
    http_status: int | None = None
    provider_request_id: str | None = None
    status_url: str | None = None
    via: str = "create_response"


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateNotSent(Evidence):
    """The create provably never left (connection refused before sending): retry with the same token."""

    kind: ClassVar[str] = "create_not_sent"
    error_class: str
    attempt: int
    detail: str = ""
    retry_at: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SynchronousResult(Evidence):
    """The create answered with the finished result itself."""

    kind: ClassVar[str] = "synchronous_result"
    http_status: int
    provider_request_id: str | None = None
    remote_job_id: str | None = None
    result_sha256: str | None = None
    observation_id: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DefinitiveRejection(Evidence):
    """The provider refused the request in a way a retry cannot change."""

    kind: ClassVar[str] = "definitive_rejection"
    http_status: int
    problem: dict[str, Any] | None = None
    provider_request_id: str | None = None
    declared_non_retryable: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class AmbiguousCreate(Evidence):
    """A create may or may not have reached the provider."""

    kind: ClassVar[str] = "ambiguous_create"
    error_class: str
    attempt: int
    detail: str = ""
    http_status: int | None = None
    retry_after_s: float | None = None
    provider_request_id: str | None = None
    retry_at: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReconciliationStarted(Evidence):
    """We start asking the provider whether the job exists, by this path."""

    kind: ClassVar[str] = "reconciliation_started"
    path: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ProvedAbsent(Evidence):
    """The provider's own answer proves no job exists for our token."""

    kind: ClassVar[str] = "proved_absent"
    path: str
    detail: str = ""
    http_status: int | None = None
    provider_request_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CannotTell(Evidence):
    """Reconciliation cannot establish whether the job exists."""

    kind: ClassVar[str] = "cannot_tell"
    reason: str
    detail: str = ""
    #: jobs created in the create's window that may be this operation's (never adopted: a person decides)
    candidates: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ConflictingJobIds(Evidence):
    """The same token was answered with two different job ids."""

    kind: ClassVar[str] = "conflicting_job_ids"
    first_job_id: str
    second_job_id: str
    first_response: dict[str, Any] | None = None
    second_response: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusObservation(Evidence):
    """One status read of the remote job (poll, cancel answer, final query)."""

    kind: ClassVar[str] = "status_observation"
    remote_state: RemoteState
    raw_state: str | None = None
    http_status: int | None = None
    provider_request_id: str | None = None
    remote_job_id: str | None = None
    observed_at: str | None = None
    provider_time: str | None = None
    progress: float | None = None
    result_ref: str | None = None
    #: what a cancelled or expired job had already produced, stored with this ending
    partial_sha256: str | None = None
    partial_size: int | None = None
    partial_content_type: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelIntent(Evidence):
    """A person (or agent) asked to stop the job: who, why, and what they expect."""

    kind: ClassVar[str] = "cancel_intent"
    requested_by: str
    reason: str
    expected_effect: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelAttempt(Evidence):
    """The cancel is about to be sent; durable before the bytes leave."""

    kind: ClassVar[str] = "cancel_attempt"
    attempt: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelAcknowledged(Evidence):
    """The provider accepted the cancel request (which is not a cancellation)."""

    kind: ClassVar[str] = "cancel_acknowledged"
    http_status: int
    provider_request_id: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DeadlinePassed(Evidence):
    """A deadline on the record is in the past at the time of observation."""

    kind: ClassVar[str] = "deadline_passed"
    deadline: DeadlineKind
    observed_at_us: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidatedResult(Evidence):
    """The result was fetched, checked and stored."""

    kind: ClassVar[str] = "validated_result"
    sha256: str
    size: int
    content_type: str | None = None
    checks: tuple[str, ...] = field(default=())


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultUnavailable(Evidence):
    """The result could not be fetched, and why."""

    kind: ClassVar[str] = "result_unavailable"
    reason: str
    http_status: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationFailure(Evidence):
    """The fetched result failed one of its checks."""

    kind: ClassVar[str] = "validation_failure"
    check: str
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeRequested(Evidence):
    """Someone asked to resume a failed job on a provider that supports resuming."""

    kind: ClassVar[str] = "resume_requested"
    requested_by: str
    reason: str
    provider_supports_resume: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class HumanDecision(Evidence):
    """A person looked at the operation and decided."""

    kind: ClassVar[str] = "human_decision"
    decided_by: str
    reason: str
    remote_job_id: str | None = None
