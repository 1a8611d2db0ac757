"""Every state's one concrete next action, in words (``ops list``, ``ops show``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobtrail.domain.canonical import rfc3339
from jobtrail.domain.states import State

if TYPE_CHECKING:  # the record's to_json() uses this module: a runtime import back would be a cycle
    from jobtrail.domain.record import Operation


def next_action(op: Operation) -> str:  # noqa: PLR0911 - one answer per state, read top to bottom
    """What happens next to ``op``, and who does it."""
    s = op.state
    if s is State.CREATE_PENDING:
        if op.attempts == 0:
            return "send the create with the stored token"
        # what the create flow does, decided from the history (CreateFlow._attempt_open), not from this text
        return (
            f"settle attempt {op.attempts} first: if its outcome was never recorded, ask the provider (replay "
            f"with the same token, or look the job up) before anything is re-sent; else send attempt "
            f"{op.attempts + 1} with the same token"
        )
    if s is State.CREATE_UNKNOWN:
        return "start reconciliation by the provider's path"
    if s is State.RECONCILIATION:
        return "ask the provider whether the job exists (replay with the same token, or look it up)"
    if s in (State.ACCEPTED, State.OBSERVING):
        return f"poll the remote job {op.remote_job_id}"
    if s is State.RESULT_COLLECTING:
        return "fetch, check and store the result"
    if s is State.CANCEL_REQUESTED:
        return "send the cancel, once" if not op.cancel_sent else "poll until the job ends (the cancel was sent)"
    if s is State.CANCELLING:
        return "poll until the provider confirms the cancel"
    if s in (State.CANCELLATION_UNCONFIRMED, State.RESULT_TIMED_OUT):
        return (
            "escalate to a person with `jobtrail ops escalation`; the worker keeps polling slowly "
            "(the remote job is not assumed stopped)"
        )
    if s is State.NEEDS_ATTENTION:
        return "a person decides (resolve); nothing automatic happens"
    return "nothing: this is an ending"


def advice(op: Operation) -> str:
    """What the caller (an agent, a script) should do now: distinct from :func:`next_action`, which is
    what a worker does next."""
    s = op.state
    if s is State.SUCCEEDED:
        return "fetch the result (get_result, or jobtrail result)"
    if s in (State.NEEDS_ATTENTION, State.CANCELLATION_UNCONFIRMED, State.RESULT_TIMED_OUT):
        return f"a person must decide: {op.state_reason or s.value}; tell them, and do not retry it yourself"
    if s in (State.FAILED, State.CANCELLED, State.RESULT_UNAVAILABLE, State.RESULT_VALIDATION_FAILED):
        return f"nothing: it ended {s.value} (the reason says why); a changed request is a new operation"
    due = "" if op.next_action_at_us is None else f", next step due {rfc3339(op.next_action_at_us)}"
    return (
        f"wait: a worker will {next_action(op)}{due}; do not act on the remote job yourself "
        "(wait_for_change, or jobtrail wait)"
    )
