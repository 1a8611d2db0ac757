"""Every state's one concrete next action, in words (``ops list``, ``ops show``), what the caller
should do now, and how a requested cancel stands."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jobtrail.domain.canonical import rfc3339
from jobtrail.domain.states import CREATE_PHASE, ESCALATED_STATES, State
from jobtrail.domain.steps import Step, next_step

if TYPE_CHECKING:  # the record's to_json() uses this module: a runtime import back would be a cycle
    from jobtrail.domain.record import HistoryEntry, Operation

#: the states in which nothing automatic decides any more: a person must (explain exits 3 in them)
PERSON_DECIDES = frozenset({State.NEEDS_ATTENTION}) | ESCALATED_STATES
_BEFORE_THE_JOB_ID = CREATE_PHASE


def next_action(op: Operation) -> str:  # noqa: PLR0911 - one answer per step, read top to bottom
    """What happens next to ``op``, and who does it: :func:`~jobtrail.domain.steps.next_step` (what the
    worker dispatches on) in words."""
    s = op.state
    step = next_step(op)
    if step is Step.CREATE:
        if s is State.CREATE_UNKNOWN:
            return "start reconciliation by the provider's path"
        if s is State.RECONCILIATION:
            return "ask the provider whether the job exists (replay with the same token, or look it up)"
        if op.attempts == 0:
            return "send the create with the stored token"
        # what the create flow does, decided from the history (CreateFlow._attempt_open), not from this text
        return (
            f"settle attempt {op.attempts} first: if its outcome was never recorded, ask the provider (replay "
            f"with the same token, or look the job up) before anything is re-sent; else send attempt "
            f"{op.attempts + 1} with the same token"
        )
    if step is Step.COLLECT:
        return "fetch, check and store the result"
    if step is Step.SEND_CANCEL:
        return "send the cancel, once"
    if step is Step.POLL:
        if s in ESCALATED_STATES:
            return (
                "escalate to a person with `jobtrail ops escalation`; the worker keeps polling slowly "
                "(the remote job is not assumed stopped)"
            )
        if s is State.CANCEL_REQUESTED:
            return "poll until the job ends (the cancel was sent)"
        if s is State.CANCELLING:
            return "poll until the provider confirms the cancel"
        return f"poll the remote job {op.remote_job_id}"
    if step is Step.PERSON:
        return "a person decides (resolve); nothing automatic happens"
    return "nothing: this is an ending"


def advice(op: Operation) -> str:
    """What the caller (an agent, a script) should do now: distinct from :func:`next_action`, which is
    what a worker does next."""
    s = op.state
    if s is State.SUCCEEDED:
        late = (
            f"; the cancel {op.cancel_requested_by} asked for lost the race: the job finished first"
            if op.cancel_requested_by
            else ""
        )
        return f"fetch the result (get_result, or jobtrail result){late}"
    if s in PERSON_DECIDES:
        return f"a person must decide: {op.state_reason or s.value}; tell them, and do not retry it yourself"
    if s is State.RESULT_UNAVAILABLE and op.remote_job_id:
        # the job ran and finished: submitting again would run it again, and the provider may still hold the result
        return (
            f"nothing automatic: the remote job {op.remote_job_id} finished but its result could not be collected "
            "(the reason says why); fetch it from the provider yourself if it still holds it, rather than "
            "submitting again, which runs the job a second time"
        )
    if s in (State.FAILED, State.CANCELLED, State.RESULT_UNAVAILABLE, State.RESULT_VALIDATION_FAILED):
        # (the same key and request answer with this very operation: trying again is a new one)
        return (
            f"nothing: it ended {s.value} (the reason says why); to try again, submit it as a new operation, "
            "with a new key"
        )
    due = "" if op.next_action_at_us is None else f", next step due {rfc3339(op.next_action_at_us)}"
    return (
        f"wait: a worker will {next_action(op)}{due}; do not act on the remote job yourself "
        "(wait_for_change, or jobtrail wait)"
    )


def cancel_story(op: Operation, history: Sequence[HistoryEntry]) -> dict[str, Any] | None:
    """Who asked to cancel ``op`` (the first to ask), why, when, and how that cancel stands now; None if
    nobody asked. ``standing`` is one of ``deferred`` (asked before the job id was known: sent once it
    is), ``pending``, ``confirmed``, ``lost_race`` (the job ended otherwise before the cancel took
    effect), ``after_the_end`` (asked once the job had ended: nothing sent), ``unconfirmed`` (past the
    cancel deadline) and ``a_person_decides``."""
    intents = [(e, json.loads(e.evidence)) for e in history if '"cancel_intent"' in e.evidence]
    intents = [(e, ev) for e, ev in intents if isinstance(ev, dict) and ev.get("kind") == "cancel_intent"]
    if not intents:
        return None
    entry, intent = intents[0]
    who, why = str(intent.get("requested_by")), str(intent.get("reason"))
    asked = f"{who} asked to cancel at {rfc3339(entry.at_us)} ({why})"
    sent = any(e.to_state == State.CANCEL_REQUESTED.value for e in history)
    s = op.state
    standing: str
    if s is State.CANCELLED and (entry.from_state, entry.to_state) == (State.CREATE_PENDING, State.CANCELLED):
        standing, says = "withdrawn", f"{asked} before any create was sent: the create was withdrawn, no job was made"
    elif s is State.CANCELLED:
        standing, says = "confirmed", f"{asked}; the provider confirmed the job cancelled"
    elif s in (State.CANCEL_REQUESTED, State.CANCELLING):
        standing, says = "pending", f"{asked}; a worker sends it once and polls until the provider confirms it"
    elif s is State.CANCELLATION_UNCONFIRMED:
        standing, says = (
            "unconfirmed",
            f"{asked}; the cancel deadline passed without the provider confirming it: a person decides",
        )
    elif not sent and (s in _BEFORE_THE_JOB_ID or (s in (State.ACCEPTED, State.OBSERVING) and op.cancel_requested_by)):
        standing, says = (
            "deferred",
            f"{asked} before the job id was known; it is sent as soon as the create is confirmed",
        )
    elif s is State.NEEDS_ATTENTION:
        standing, says = "a_person_decides", f"{asked}; the operation needs a person, who decides"
    elif sent:
        standing = "lost_race"
        says = f"{asked}; the cancel lost the race: the job finished before it took effect and " + {
            State.SUCCEEDED: "succeeded; its result is stored (get_result, or jobtrail result)",
            State.RESULT_COLLECTING: "succeeded; its result is being collected",
        }.get(s, f"ended {s.value} (the reason says why)")
    else:
        standing, says = "after_the_end", f"{asked}, after the job had ended ({entry.from_state}); nothing was sent"
    return {
        "requested_by": who,
        "reason": why,
        "requested_at": rfc3339(entry.at_us),
        "standing": standing,
        "says": says,
    }
