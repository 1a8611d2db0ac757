"""Every state's one concrete next action, in words (``ops list``, ``ops show``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobtrail.domain.states import State

if TYPE_CHECKING:  # the record's to_json() uses this module: a runtime import back would be a cycle
    from jobtrail.domain.record import Operation


def next_action(op: Operation) -> str:  # noqa: PLR0911 - one answer per state, read top to bottom
    """What happens next to ``op``, and who does it."""
    s = op.state
    if s is State.CREATE_PENDING:
        if op.attempts == 0:
            return "send the create with the stored token"
        if op.state_reason and "outcome not yet recorded" in op.state_reason:
            return (
                f"reconcile: the outcome of attempt {op.attempts} was never recorded, so ask the provider "
                "(replay with the same token, or look the job up) before anything is re-sent"
            )
        return f"send the create again with the same token (attempt {op.attempts + 1})"
    if s is State.CREATE_UNKNOWN:
        return "start reconciliation by the provider's path"
    if s is State.RECONCILIATION:
        return "ask the provider whether the job exists (replay with the same token, or look it up)"
    if s in (State.ACCEPTED, State.OBSERVING):
        return f"poll the remote job {op.remote_job_id}"
    if s is State.RESULT_COLLECTING:
        return "fetch, check and store the result"
    if s is State.CANCEL_REQUESTED:
        return "send the cancel, once" if op.polls == 0 else "poll until the job ends (the cancel was sent)"
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
