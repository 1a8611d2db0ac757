"""The state table of DESIGN.md as code: every arrow and the evidence it needs.

``check_transition`` is the only judge. The store calls it inside the write
path, so a transition without its evidence never reaches the database.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jobtrail.domain.errors import TransitionRefused
from jobtrail.domain.evidence import (
    AmbiguousCreate,
    CancelAcknowledged,
    CancelIntent,
    CannotTell,
    ConfirmedCreate,
    ConflictingJobIds,
    DeadlinePassed,
    DefinitiveRejection,
    Evidence,
    HumanDecision,
    ProvedAbsent,
    ReconciliationStarted,
    ResultUnavailable,
    ResumeRequested,
    StatusObservation,
    SynchronousResult,
    ValidatedResult,
    ValidationFailure,
)
from jobtrail.domain.record import Operation
from jobtrail.domain.states import RemoteState, State

S = State
Check = Callable[[Evidence, Operation], str | None]

#: HTTP statuses that never prove a create was refused: the request may have been applied.
AMBIGUOUS_HTTP_STATUSES = frozenset({408, 409, 425, 429})


@dataclass(frozen=True, slots=True)
class Rule:
    """One arrow: which evidence kinds it accepts and what they must show."""

    evidence: tuple[type[Evidence], ...]
    needs: str
    check: Check | None = None


def _remote(*states: RemoteState) -> Check:
    def check(ev: Evidence, op: Operation) -> str | None:
        assert isinstance(ev, StatusObservation)
        if ev.remote_state not in states:
            wanted = " or ".join(s.value for s in states)
            return f"the observed remote state is {ev.remote_state.value}, not {wanted}"
        if ev.remote_job_id and op.remote_job_id and ev.remote_job_id != op.remote_job_id:
            return f"the observation is of job {ev.remote_job_id}, but this operation's job is {op.remote_job_id}"
        return None

    return check


def _deadline(kind: str) -> Check:
    def check(ev: Evidence, op: Operation) -> str | None:
        assert isinstance(ev, DeadlinePassed)
        if ev.deadline != kind:
            return f"this arrow needs the {kind} deadline, not the {ev.deadline} deadline"
        deadline = op.deadline_us(kind)
        if deadline is None:
            return f"the operation has no {kind} deadline"
        if ev.observed_at_us < deadline:
            return f"the {kind} deadline has not passed yet"
        return None

    return check


def _deadline_or_other(kind: str) -> Check:
    inner = _deadline(kind)

    def check(ev: Evidence, op: Operation) -> str | None:
        return inner(ev, op) if isinstance(ev, DeadlinePassed) else _other_checks(ev, op)

    return check


def _other_checks(ev: Evidence, op: Operation) -> str | None:
    if isinstance(ev, ConflictingJobIds):
        return _conflict(ev, op)
    return None


def _confirmed(ev: Evidence, op: Operation) -> str | None:
    assert isinstance(ev, ConfirmedCreate)
    if not ev.remote_job_id:
        return "a confirmed create needs the remote job id"
    return None


def _conflict(ev: Evidence, op: Operation) -> str | None:
    assert isinstance(ev, ConflictingJobIds)
    if ev.first_job_id == ev.second_job_id:
        return "the two job ids are the same; that is not a conflict"
    return None


def _ambiguous(ev: Evidence, op: Operation) -> str | None:
    assert isinstance(ev, AmbiguousCreate)
    if op.attempts < 1:
        return "no create attempt is recorded, so no create can have reached the provider"
    return None


def _rejection(ev: Evidence, op: Operation) -> str | None:
    assert isinstance(ev, DefinitiveRejection)
    if ev.declared_non_retryable:
        return None
    if not 400 <= ev.http_status < 500 or ev.http_status in AMBIGUOUS_HTTP_STATUSES:
        return (
            f"HTTP {ev.http_status} does not prove the request was refused; "
            "treat it as an ambiguous create and reconcile"
        )
    return None


def _never_sent(ev: Evidence, op: Operation) -> str | None:
    assert isinstance(ev, CancelIntent)
    if op.attempts > 0:
        return (
            f"{op.attempts} create attempt(s) are recorded, so a job may exist: the cancel waits for the create's "
            "outcome and is sent to the job"
        )
    return None


def _resume(ev: Evidence, op: Operation) -> str | None:
    assert isinstance(ev, ResumeRequested)
    if not ev.provider_supports_resume:
        return "the provider does not support resuming a failed job"
    return None


def _decision_with_job(ev: Evidence, op: Operation) -> str | None:
    assert isinstance(ev, HumanDecision)
    if not (ev.remote_job_id or op.remote_job_id):
        return "resolving to accepted needs the remote job id the person confirmed"
    return None


_settle_success = Rule((StatusObservation,), "a status observation: succeeded", _remote(RemoteState.SUCCEEDED))
_settle_failed = Rule(
    (StatusObservation,),
    "a status observation: failed or expired",
    _remote(RemoteState.FAILED, RemoteState.EXPIRED),
)
_settle_cancelled = Rule((StatusObservation,), "a status observation: cancelled", _remote(RemoteState.CANCELLED))
_human = Rule((HumanDecision,), "a person's decision")

RULES: dict[tuple[State, State], Rule] = {
    # create
    (S.CREATE_PENDING, S.ACCEPTED): Rule((ConfirmedCreate,), "a confirmed create response", _confirmed),
    (S.CREATE_PENDING, S.CREATE_UNKNOWN): Rule((AmbiguousCreate,), "an ambiguous create outcome", _ambiguous),
    (S.CREATE_PENDING, S.FAILED): Rule((DefinitiveRejection,), "a definitive rejection", _rejection),
    (S.CREATE_PENDING, S.RESULT_COLLECTING): Rule((SynchronousResult,), "a synchronous result"),
    # a cancel before any attempt: the attempt is durable before its send, so none has left and no job exists
    (S.CREATE_PENDING, S.CANCELLED): Rule((CancelIntent,), "a cancel asked before any create attempt", _never_sent),
    (S.CREATE_PENDING, S.NEEDS_ATTENTION): Rule(
        (ConflictingJobIds, DeadlinePassed, CannotTell),
        "two job ids for one token, the create deadline passed, or an answer nobody can settle (a redirect)",
        _deadline_or_other("create"),
    ),
    (S.CREATE_UNKNOWN, S.RECONCILIATION): Rule((ReconciliationStarted,), "the reconciliation path taken"),
    (S.RECONCILIATION, S.ACCEPTED): Rule((ConfirmedCreate,), "the provider confirming the job", _confirmed),
    # a replay may answer with the finished result itself
    (S.RECONCILIATION, S.RESULT_COLLECTING): Rule((SynchronousResult,), "a synchronous result"),
    (S.RECONCILIATION, S.CREATE_PENDING): Rule((ProvedAbsent,), "proof from the provider that no job exists"),
    (S.RECONCILIATION, S.NEEDS_ATTENTION): Rule(
        (CannotTell, DeadlinePassed, ConflictingJobIds),
        "reconciliation that cannot tell, the create deadline passed, or two job ids",
        _deadline_or_other("create"),
    ),
    # observe
    (S.ACCEPTED, S.OBSERVING): Rule((StatusObservation,), "a status observation", _remote(*RemoteState)),
    (S.OBSERVING, S.RESULT_COLLECTING): _settle_success,
    (S.ACCEPTED, S.FAILED): _settle_failed,
    (S.OBSERVING, S.FAILED): _settle_failed,
    (S.ACCEPTED, S.CANCELLED): _settle_cancelled,
    (S.OBSERVING, S.CANCELLED): _settle_cancelled,
    (S.OBSERVING, S.RESULT_TIMED_OUT): Rule((DeadlinePassed,), "the result deadline passed", _deadline("result")),
    # cancel
    (S.ACCEPTED, S.CANCEL_REQUESTED): Rule((CancelIntent,), "a recorded cancel intent"),
    (S.OBSERVING, S.CANCEL_REQUESTED): Rule((CancelIntent,), "a recorded cancel intent"),
    (S.CANCEL_REQUESTED, S.CANCELLING): Rule((CancelAcknowledged,), "the provider acknowledging the cancel"),
    (S.CANCELLING, S.CANCELLED): _settle_cancelled,
    # the cancel's answer was lost, but a later status shows it took effect
    (S.CANCEL_REQUESTED, S.CANCELLED): _settle_cancelled,
    (S.CANCEL_REQUESTED, S.RESULT_COLLECTING): _settle_success,
    (S.CANCELLING, S.RESULT_COLLECTING): _settle_success,
    (S.CANCEL_REQUESTED, S.FAILED): _settle_failed,
    (S.CANCELLING, S.FAILED): _settle_failed,
    (S.CANCEL_REQUESTED, S.CANCELLATION_UNCONFIRMED): Rule(
        (DeadlinePassed,), "the cancel deadline passed", _deadline("cancel")
    ),
    (S.CANCELLING, S.CANCELLATION_UNCONFIRMED): Rule(
        (DeadlinePassed,), "the cancel deadline passed", _deadline("cancel")
    ),
    # collect
    (S.RESULT_COLLECTING, S.SUCCEEDED): Rule((ValidatedResult,), "a validated, stored result"),
    (S.RESULT_COLLECTING, S.RESULT_UNAVAILABLE): Rule((ResultUnavailable,), "why the result cannot be fetched"),
    (S.RESULT_COLLECTING, S.RESULT_VALIDATION_FAILED): Rule((ValidationFailure,), "the failed check"),
    # resume
    (S.FAILED, S.OBSERVING): Rule((ResumeRequested,), "a recorded resume on a provider that supports it", _resume),
    # a later observation can still settle an unconfirmed ending (never assumed)
    (S.CANCELLATION_UNCONFIRMED, S.CANCELLED): _settle_cancelled,
    (S.CANCELLATION_UNCONFIRMED, S.RESULT_COLLECTING): _settle_success,
    (S.CANCELLATION_UNCONFIRMED, S.FAILED): _settle_failed,
    (S.RESULT_TIMED_OUT, S.RESULT_COLLECTING): _settle_success,
    (S.RESULT_TIMED_OUT, S.FAILED): _settle_failed,
    (S.RESULT_TIMED_OUT, S.CANCELLED): _settle_cancelled,
    # a person decides what automation could not
    (S.NEEDS_ATTENTION, S.ACCEPTED): Rule(
        (HumanDecision,), "a person's decision naming the job id", _decision_with_job
    ),
    (S.NEEDS_ATTENTION, S.CREATE_PENDING): _human,
    (S.NEEDS_ATTENTION, S.FAILED): _human,
    (S.NEEDS_ATTENTION, S.CANCELLED): _human,
}


def allowed_targets(state: State) -> list[State]:
    return [to for (frm, to) in RULES if frm is state]


def decisions_from(state: State) -> list[State]:
    """Where a person's decision may move an operation in ``state`` (none: it waits for nobody's)."""
    return [to for (frm, to), rule in RULES.items() if frm is state and HumanDecision in rule.evidence]


def check_transition(op: Operation, to: State, evidence: Evidence) -> None:
    """Refuse, with the reason, a transition that is not in the table or lacks evidence."""
    rule = RULES.get((op.state, to))
    if rule is None:
        allowed = ", ".join(s.value for s in allowed_targets(op.state)) or "nothing"
        raise TransitionRefused(
            f"{op.operation_id}: {op.state.value} -> {to.value} is not in the state table "
            f"(from {op.state.value} the allowed next states are: {allowed})",
            operation_id=op.operation_id,
            from_state=op.state.value,
            to_state=to.value,
        )
    if not isinstance(evidence, rule.evidence):
        raise TransitionRefused(
            f"{op.operation_id}: {op.state.value} -> {to.value} needs {rule.needs}, got {evidence.describe()}",
            operation_id=op.operation_id,
            from_state=op.state.value,
            to_state=to.value,
        )
    problem = rule.check(evidence, op) if rule.check else None
    if problem:
        raise TransitionRefused(
            f"{op.operation_id}: {op.state.value} -> {to.value} refused: {problem}",
            operation_id=op.operation_id,
            from_state=op.state.value,
            to_state=to.value,
        )
