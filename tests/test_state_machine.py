"""The state table is code: every arrow needs its evidence, everything else is refused."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jobtrail import (
    AmbiguousCreate,
    CancelIntent,
    ConfirmedCreate,
    ConflictingJobIds,
    DeadlinePassed,
    DefinitiveRejection,
    HumanDecision,
    RemoteState,
    ResumeRequested,
    State,
    StatusObservation,
    Store,
    TransitionRefused,
)
from jobtrail.domain.machine import RULES
from jobtrail.ledger.audit import verify

from helpers import S, drive, obs, op_in, path_to, spec, valid_evidence

ALLOWED = sorted(RULES, key=lambda p: (p[0].value, p[1].value))
FORBIDDEN = [(a, b) for a, b in itertools.product(State, State) if (a, b) not in RULES]


def test_every_state_is_reachable_and_every_arrow_is_counted() -> None:
    """The table reaches every state from create_pending (no dead states in the design)."""
    for state in State:
        assert path_to(state)[-1] is state
    assert len(ALLOWED) + len(FORBIDDEN) == len(State) ** 2


@pytest.mark.parametrize(("frm", "to"), ALLOWED, ids=lambda s: s.value)
def test_allowed_arrow_with_its_evidence_is_recorded(store: Store, frm: State, to: State) -> None:
    """Each allowed arrow, given its evidence, moves the record and appends one history entry."""
    # (a cancel withdraws only a create never attempted: that arrow starts from a record with no attempt)
    op = store.create_operation(spec())[0] if (frm, to) == (S.CREATE_PENDING, S.CANCELLED) else op_in(store, frm)
    before = len(store.history(op.operation_id))
    moved = store.transition(op, to, valid_evidence(frm, to, op), actor="tester")
    assert moved.state is to
    assert store.get(op.operation_id).state is to
    history = store.history(op.operation_id)
    assert len(history) == before + 1
    assert (history[-1].from_state, history[-1].to_state) == (frm.value, to.value)
    assert history[-1].cause == valid_evidence(frm, to, op).kind


@pytest.mark.parametrize("frm", list(State), ids=lambda s: s.value)
def test_forbidden_pairs_are_refused_and_leave_the_record_untouched(store: Store, frm: State) -> None:
    """Every (from, to) pair outside the table is refused, whatever evidence comes with it."""
    op = op_in(store, frm)
    targets = [to for (a, to) in FORBIDDEN if a is frm]
    for to in targets:
        # the evidence some real arrow into ``to`` accepts: right evidence, wrong origin
        origin = next((a for (a, b) in RULES if b is to), S.OBSERVING)
        evidence = valid_evidence(origin, to, op)
        with pytest.raises(TransitionRefused, match="not in the state table"):
            store.transition(op, to, evidence, actor="tester")
    after = store.get(op.operation_id)
    assert after == op
    assert len(store.history(op.operation_id)) == op.version


WRONG_EVIDENCE = [
    # (from, to, evidence, phrase in the refusal)
    (S.OBSERVING, S.RESULT_COLLECTING, obs(RemoteState.RUNNING), "not succeeded"),
    (S.ACCEPTED, S.OBSERVING, ConfirmedCreate(remote_job_id="x"), "needs a status observation"),
    (S.OBSERVING, S.CANCELLED, obs(RemoteState.CANCELLING), "not cancelled"),
    (S.CANCELLING, S.CANCELLED, CancelIntent(requested_by="a", reason="b"), "needs a status observation"),
    (S.CREATE_PENDING, S.FAILED, DefinitiveRejection(http_status=429), "does not prove"),
    (S.CREATE_PENDING, S.FAILED, DefinitiveRejection(http_status=503), "does not prove"),
    (S.CREATE_PENDING, S.FAILED, DefinitiveRejection(http_status=409), "does not prove"),
    (S.CREATE_PENDING, S.ACCEPTED, ConfirmedCreate(remote_job_id=""), "needs the remote job id"),
    (
        S.CREATE_PENDING,
        S.NEEDS_ATTENTION,
        ConflictingJobIds(first_job_id="a", second_job_id="a"),
        "not a conflict",
    ),
    (
        S.OBSERVING,
        S.RESULT_TIMED_OUT,
        DeadlinePassed(deadline="cancel", observed_at_us=2**62),
        "result deadline",
    ),
    (
        S.FAILED,
        S.OBSERVING,
        ResumeRequested(requested_by="a", reason="b", provider_supports_resume=False),
        "does not support",
    ),
    (S.NEEDS_ATTENTION, S.SUCCEEDED, HumanDecision(decided_by="a", reason="b"), "not in the state table"),
    (S.OBSERVING, S.SUCCEEDED, obs(RemoteState.SUCCEEDED), "not in the state table"),
]


@pytest.mark.parametrize(("frm", "to", "evidence", "phrase"), WRONG_EVIDENCE)
def test_wrong_or_insufficient_evidence_is_refused(store: Store, frm, to, evidence, phrase) -> None:
    """Progress is not success, a sent cancel is not a cancellation, a 429 is not a rejection."""
    op = op_in(store, frm)
    with pytest.raises(TransitionRefused, match=phrase):
        store.transition(op, to, evidence, actor="tester")
    assert store.get(op.operation_id) == op


def test_ambiguous_create_needs_a_recorded_attempt(store: Store) -> None:
    """No attempt recorded means nothing can have reached the provider: not 'unknown'."""
    op, _ = store.create_operation(spec())
    with pytest.raises(TransitionRefused, match="no create attempt"):
        store.transition(op, S.CREATE_UNKNOWN, AmbiguousCreate(error_class="timeout", attempt=0), actor="t")


def test_deadline_evidence_must_be_true_of_the_record(store: Store) -> None:
    """A deadline that has not passed on the record is no evidence."""
    from datetime import timedelta

    op = drive(store, store.create_operation(spec(result_deadline=timedelta(hours=1)))[0], S.OBSERVING)
    with pytest.raises(TransitionRefused, match="has not passed"):
        store.transition(
            op,
            S.RESULT_TIMED_OUT,
            DeadlinePassed(deadline="result", observed_at_us=op.updated_at_us),
            actor="t",
        )


def test_observation_of_another_job_is_refused(store: Store) -> None:
    """A terminal status for some other job id cannot end this operation."""
    op = op_in(store, S.OBSERVING)
    other = StatusObservation(remote_state=RemoteState.SUCCEEDED, remote_job_id="job-someone-else")
    with pytest.raises(TransitionRefused, match="job-someone-else"):
        store.transition(op, S.RESULT_COLLECTING, other, actor="t")


# -- property: random attempts never put a record in a state without its evidence -----

EVIDENCE_POOL = st.one_of(
    st.tuples(st.sampled_from(list(State)), st.sampled_from(list(State))).map(lambda p: ("valid_for", p)),
    st.sampled_from(list(RemoteState)).map(lambda r: ("obs", r)),
    st.sampled_from([400, 404, 408, 409, 422, 425, 429, 500, 503]).map(lambda c: ("reject", c)),
    st.sampled_from(["create", "result", "cancel"]).map(lambda k: ("deadline", k)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.sampled_from(list(State)), EVIDENCE_POOL), min_size=1, max_size=25))
def test_random_attempts_never_reach_a_state_without_evidence(store: Store, steps) -> None:
    """Drive random transition attempts; every accepted one matches a rule and its check."""
    from jobtrail.domain.machine import check_transition

    op, _ = store.create_operation(spec(operation_key=None))
    op = store.record(op, __import__("jobtrail").CreateAttempt(attempt=1), actor="t", changes={"attempts": 1})
    for to, (how, arg) in steps:
        if how == "valid_for":
            frm, target = arg
            try:
                evidence = valid_evidence(frm, target, op)
            except AssertionError:
                continue
        elif how == "obs":
            evidence = obs(arg)
        elif how == "reject":
            evidence = DefinitiveRejection(http_status=arg)
        else:
            evidence = DeadlinePassed(deadline=arg, observed_at_us=op.updated_at_us + 10**12)
        before = op
        try:
            op = store.transition(op, to, evidence, actor="prop")
        except TransitionRefused:
            assert store.get(op.operation_id) == before
            continue
        rule = RULES[(before.state, to)]
        assert isinstance(evidence, rule.evidence)
        check_transition(before, to, evidence)  # the judge agrees, on the record as it was
        assert store.history(op.operation_id)[-1].cause == evidence.kind
    assert verify(store).ok


def test_a_cancel_withdraws_only_a_create_never_attempted(store: Store) -> None:
    """create_pending -> cancelled needs a person's cancel and no attempt on the record: an attempt is durable
    before its send, so with one recorded a job may exist, and the cancel must wait for it and be sent."""
    attempted = op_in(store, S.CREATE_PENDING)
    assert attempted.attempts == 1
    with pytest.raises(TransitionRefused, match="a job may exist"):
        store.transition(attempted, S.CANCELLED, valid_evidence(S.CREATE_PENDING, S.CANCELLED, attempted), actor="t")
    assert store.get(attempted.operation_id).state is S.CREATE_PENDING
    planned = store.create_operation(spec())[0]
    with pytest.raises(TransitionRefused):
        store.transition(planned, S.CANCELLED, obs(RemoteState.CANCELLED), actor="t")  # not a status: nothing ran
    moved = store.transition(planned, S.CANCELLED, valid_evidence(S.CREATE_PENDING, S.CANCELLED, planned), actor="t")
    assert moved.state is S.CANCELLED and moved.attempts == 0
