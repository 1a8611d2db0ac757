"""Cancellation: the intent is durable first, the cancel is sent once, only the provider ends it.

:func:`request_cancel` records who asked, why and what they expect. Nothing is
sent by it: the lease owner (a worker) sends the cancel once and then polls;
``cancelled`` needs the provider's own status. A second request is recorded in
the history and not re-sent. A cancel asked for before the job id is known is
kept on the record and carried out as soon as the create is confirmed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from jobtrail.domain.canonical import rfc3339
from jobtrail.domain.errors import StaleRecord, UsageError
from jobtrail.domain.evidence import CancelAcknowledged, CancelAttempt, CancelIntent
from jobtrail.domain.failpoints import failpoint
from jobtrail.domain.record import Changes, Operation
from jobtrail.domain.states import CREATE_PHASE, FINAL_STATES, State
from jobtrail.flows.telemetry import provider_call
from jobtrail.ledger.store import Store
from jobtrail.ledger.writer import Writer
from jobtrail.providers.contract import Provider, Response

_US = 1_000_000
_RETRIES = 8


@dataclass(frozen=True, slots=True)
class CancelOutcome:
    """What :func:`request_cancel` did."""

    operation: Operation
    #: "requested" (new intent), "already_requested", "deferred" (no job id yet), "withdrawn" (nothing had
    #: been sent: cancelled at once), "already_ended", or "person_decides" (a state a cancel is not sent from,
    #: not an ending either: the job may still run)
    outcome: str
    message: str


def request_cancel(
    store: Store, operation_id: str, *, requested_by: str, reason: str, expected_effect: str = ""
) -> CancelOutcome:
    """Record a cancel intent (durably, before anything is sent) and say what will happen."""
    if not requested_by.strip() or not reason.strip():
        raise UsageError("a cancel needs who asks (--by) and why (--reason); both are kept in the history")
    intent = CancelIntent(requested_by=requested_by, reason=reason, expected_effect=expected_effect)
    actor = f"person:{requested_by}"
    for _ in range(_RETRIES):
        op = store.get(operation_id)
        try:
            outcome = _record_intent(store, op, intent, actor)
        except StaleRecord:
            continue  # a worker moved the record meanwhile: read it again and decide again
        failpoint("cancel.after_intent")
        return outcome
    raise StaleRecord(f"operation {operation_id} kept changing; try the cancel again", operation_id=operation_id)


def _record_intent(store: Store, op: Operation, intent: CancelIntent, actor: str) -> CancelOutcome:
    if op.state in (State.ACCEPTED, State.OBSERVING):
        window = op.cancel_window_us
        changes: Changes = {
            "state_reason": f"cancel requested by {intent.requested_by}: {intent.reason}",
            # kept whatever the ending: a cancel that loses the race is told as such (explain)
            "cancel_requested_by": intent.requested_by,
            "cancel_deadline_us": None if window is None else store.clock() + window,
        }
        moved = store.transition(op, State.CANCEL_REQUESTED, intent, actor=actor, changes=changes)
        return CancelOutcome(
            moved,
            "requested",
            f"cancel of {op.remote_job_id} recorded; a worker sends it once "
            f"and confirms it by polling (deadline {rfc3339(moved.cancel_deadline_us)})",
        )
    if op.state in (State.CANCEL_REQUESTED, State.CANCELLING, State.CANCELLATION_UNCONFIRMED):
        kept = store.record(op, intent, actor=actor)
        return CancelOutcome(
            kept,
            "already_requested",
            "a cancel is already under way; this request is recorded and nothing is re-sent",
        )
    if op.state is State.CREATE_PENDING and op.attempts == 0:
        # planned, never sent (an attempt is durable before its send): stopping it is not sending it. A worker
        # about to send finds the record moved on (its attempt's write is conditional) and sends nothing
        withdrawn = store.transition(
            op,
            State.CANCELLED,
            intent,
            actor=actor,
            changes={
                "cancel_requested_by": intent.requested_by,
                "next_action_at_us": None,
                "state_reason": f"cancelled by {intent.requested_by} before any create was sent ({intent.reason}); "
                "no job was made",
            },
        )
        return CancelOutcome(
            withdrawn,
            "withdrawn",
            "nothing had been sent: the operation is cancelled and its create will never be sent",
        )
    if op.state in CREATE_PHASE:
        kept = store.record(op, intent, actor=actor, changes={"cancel_requested_by": intent.requested_by})
        return CancelOutcome(
            kept,
            "deferred",
            "the job id is not known yet; the cancel is recorded and will be "
            "sent as soon as the create is confirmed (if it never is, the record will say so)",
        )
    ended = op.state in FINAL_STATES or op.state is State.RESULT_COLLECTING
    kept = store.record(op, intent, actor=actor)
    if ended:
        return CancelOutcome(
            kept,
            "already_ended",
            f"the job already ended ({op.state.value}); nothing to cancel, the request is recorded",
        )
    if op.state is State.RESULT_TIMED_OUT:
        # not an ending (the job is NOT assumed stopped), and past its result deadline no cancel is sent
        return CancelOutcome(
            kept,
            "person_decides",
            f"the result deadline passed, and jobtrail sends no cancel from {op.state.value}: if job "
            f"{op.remote_job_id} must stop, stop it in provider {op.provider}'s console; a worker keeps polling "
            "slowly and records how it ends. The request is recorded",
        )
    return CancelOutcome(
        kept,
        "person_decides",
        f"the operation is in {op.state.value}: a person decides first (jobtrail resolve); the request is recorded",
    )


#: answers that say a request was not taken now, and may be sent again later
_NOT_NOW = frozenset({408, 425, 429})


class CancelFlow:
    """Sends a recorded cancel, once, from the lease owner."""

    def __init__(self, store: Store, writer: Writer, *, actor: str, rng: random.Random | None = None) -> None:
        self.store = store
        self.writer = writer
        self.actor = actor
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not secrecy

    async def advance(self, op: Operation, provider: Provider) -> Operation:
        if op.state is not State.CANCEL_REQUESTED or op.cancel_sent:
            return op
        now = self.store.clock()
        if not provider.capabilities.cancel:
            return await self.writer.reschedule(
                op,
                {
                    "polls": 1,
                    "next_action_at_us": now,
                    "state_reason": (
                        f"provider {provider.name} has no cancel endpoint: the intent is recorded and nothing can be "
                        "sent; polling until the job ends or the cancel deadline passes"
                    ),
                },
            )
        # durable before the bytes leave: a crash after this line never sends a second cancel
        op = await self.writer.record(op, CancelAttempt(attempt=1), actor=self.actor, changes={"polls": 1})
        failpoint("cancel.after_attempt")
        sent = await provider_call(op, "cancel", provider.cancel(op))
        failpoint("cancel.after_response")
        # the next request is timed from the answer (a slow answer must not bring it forward)
        answered = self.store.clock()
        answer = sent if isinstance(sent, Response) else None
        retry_after = answer.retry_after_s if answer else None
        # and no request to the job before the time the provider asked for
        first_poll = answered + int(provider.poll_backoff.after(retry_after, 1, self.rng) * _US)
        request_id = answer.provider_request_id if answer else None
        await self.writer.observe(
            op.operation_id,
            kind="cancel_response",
            raw=sent.to_json() if answer else {"http_status": None, "headers": {}, "body": sent.to_json()},
            http_status=answer.http_status if answer else None,
            provider_request_id=request_id,
            worker=op.lease_owner,
            lease_epoch=op.lease_epoch if op.lease_owner else None,
        )
        request_ids = (request_id,) if request_id else ()
        status = (answer.http_status if answer else None) or 0
        if 200 <= status < 300:
            return await self.writer.transition(
                op,
                State.CANCELLING,
                CancelAcknowledged(http_status=status, provider_request_id=request_id),
                actor=self.actor,
                request_ids=request_ids,
                changes={
                    "next_action_at_us": first_poll,
                    "state_reason": (
                        f"cancel acknowledged (HTTP {status}); not a cancellation until the provider reports it"
                    ),
                },
            )
        # no answer, or one saying "not now" (a rate limit, an overloaded or failing server): an idempotent cancel
        # is sent again, once the provider's Retry-After has passed
        not_now = answer is None or status in _NOT_NOW or status >= 500
        if not_now and provider.capabilities.cancel_idempotent:
            retry = answered + int(provider.backoff.after(retry_after, 1, self.rng) * _US)
            got = "no answer" if answer is None else f"HTTP {status}"
            return await self.writer.reschedule(
                op,
                {
                    "polls": 0,
                    "next_action_at_us": retry,
                    "state_reason": (
                        f"the cancel got {got}; the provider's cancel is idempotent, so it is sent again at "
                        f"{rfc3339(retry)}"
                    ),
                },
            )
        why = f"HTTP {status}" if status else "no answer"
        return await self.writer.reschedule(
            op,
            {
                "next_action_at_us": first_poll,
                "state_reason": (
                    f"the cancel was sent once and not acknowledged ({why}); it is not re-sent; polling to see how the "
                    "job ends"
                ),
            },
        )
