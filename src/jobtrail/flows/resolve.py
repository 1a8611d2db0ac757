"""A person's decision on an operation automation could not settle (``jobtrail resolve``, the dashboard).

One code path for every way a person decides, so the history reads the same whoever typed it:
the actor is ``person:NAME``, the evidence a :class:`HumanDecision` with who and why, and the
state machine refuses a decision its rules do not allow (accepted without the job id, say).
A person who confirms the job id teaches the operation its job, as a create's answer would: the
webhook events kept for that job until an operation knew it are attached to it then.
"""

from __future__ import annotations

from jobtrail.domain.errors import NoDecisionAwaited, UsageError
from jobtrail.domain.evidence import HumanDecision
from jobtrail.domain.jsonpath import unusable_id
from jobtrail.domain.machine import decisions_from
from jobtrail.domain.record import Changes, Operation, check_name, check_shown
from jobtrail.domain.states import FINAL_STATES, State
from jobtrail.flows.observe import adopt_orphans
from jobtrail.ledger.store import Store

#: what a person may decide: accepted (with the job id they confirmed), create_pending (send again with
#: the same token), failed, cancelled
DECISIONS = ("accepted", "create_pending", "failed", "cancelled")


def decide(
    store: Store, ref: str, to_state: str, *, decided_by: str, reason: str, job_id: str | None = None
) -> Operation:
    """Record ``decided_by``'s decision on the operation ``ref`` (an id or key) and move it to ``to_state``.

    The name and the reason are shown in every listing and history: the reason's line breaks and runs of
    blanks become one space, and either holding a character that shows as nothing or turns the text around
    (a bidirectional override: ``alice`` shown for another name) is refused, as in a key or a caller.
    """
    reason = " ".join(reason.split())
    check_name("name of the person deciding", decided_by)
    check_shown("reason", reason)
    op = store.resolve(ref)  # an id, or the operation's key
    choices = [s.value for s in decisions_from(op.state) if s.value in DECISIONS]
    if not choices:
        waiting = sorted({frm.value for frm in State if any(s.value in DECISIONS for s in decisions_from(frm))})
        where = "it has ended" if op.state in FINAL_STATES else "automation carries it on"
        raise NoDecisionAwaited(
            f"{op.operation_id} is {op.state.value}: {where}, and it waits for no person's decision; nothing was "
            f"recorded. A decision is for an operation in {', '.join(waiting)} "
            "(`jobtrail ops list --state needs_attention` lists those that wait)"
        )
    if to_state not in choices:
        raise UsageError(
            f"{op.operation_id} is {op.state.value}: a person's decision may move it to {', '.join(choices)}, "
            f"not {to_state}; nothing was recorded"
        )
    if job_id and to_state != State.ACCEPTED.value:
        raise UsageError(f"--job-id goes with --to accepted (the job you confirmed), not --to {to_state}")
    # the job id goes into the URLs of every poll, cancel and result fetch: a person's is held to what a
    # provider's is (a ".." segment would move those requests to another path, a credential would be stored)
    why = unusable_id(job_id, store.redactor) if job_id else None
    if why is not None:
        raise UsageError(
            f"{op.operation_id}: that job id cannot be used ({why}); nothing was recorded. Give the id exactly "
            "as the provider's console or API shows it"
        )
    changes: Changes = {"state_reason": f"resolved by {decided_by}: {reason}"}
    if job_id:
        changes["remote_job_id"] = job_id
    op = store.transition(
        op,
        State(to_state),
        HumanDecision(decided_by=decided_by, reason=reason, remote_job_id=job_id),
        actor=f"person:{decided_by}",
        changes=changes,
    )
    # the job id is recorded first, then its waiting events are looked for: a receiver storing one meanwhile
    # looks for the job id after storing it, so one of the two attaches it (see jobtrail.interfaces.webhooks)
    if job_id and adopt_orphans(store, op.provider, job_id, op.operation_id):
        op = store.get(op.operation_id)  # its next poll was brought forward
    return op
