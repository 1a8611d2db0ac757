"""Observing a running job and collecting its result: one poll or one fetch per call.

Every poll stores an observation (normalised and raw state, HTTP status,
provider request id, progress, the redacted raw answer, who polled under which
lease, and when the next poll is due). Progress never implies completion; an
unknown remote state is recorded and polling goes on. Only a terminal status
moves the state, and only with that observation as evidence.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jobtrail.domain.canonical import canonical_bytes, parse_json, rfc3339
from jobtrail.domain.evidence import (
    CancelIntent,
    DeadlinePassed,
    ResultUnavailable,
    StatusObservation,
    ValidatedResult,
    ValidationFailure,
)
from jobtrail.domain.failpoints import failpoint
from jobtrail.domain.jsonpath import unusable
from jobtrail.domain.record import Changes, Operation
from jobtrail.domain.results import (
    NO_CREDENTIALS_CHECK,
    NO_CREDENTIALS_REASON,
    Buffer,
    Check,
    ResultCarriesCredential,
    ResultSpec,
    Validation,
    load_check,
    validate,
)
from jobtrail.domain.states import ESCALATED_STATES, RemoteState, State
from jobtrail.domain.words import in_their_words, quoted, state_shown
from jobtrail.flows.telemetry import provider_call
from jobtrail.ledger.results import carries_secret, prepare_result
from jobtrail.ledger.store import FollowUp, Observe, Reschedule, Store, StoredResult
from jobtrail.ledger.webhook_events import Orphan, attach_orphans
from jobtrail.ledger.writer import Writer
from jobtrail.providers.contract import NoAnswer, Provider, Response, Spooled, StatusOutcome

_US = 1_000_000
#: a finished job's result that is not served is fetched again, with back-off, at least this many times
#: and for at least RESULT_PATIENCE_S (a provider may serve it a while after its status says succeeded),
#: never past the operation's result deadline, before it is given up
MAX_RESULT_ATTEMPTS = 5
RESULT_PATIENCE_S = 600
#: a result in memory up to this size may be checked on the loop (see _checked_on_the_loop): its
#: credential scan takes well under a millisecond even when every byte looks encoded
_CHECKED_ON_THE_LOOP = 1024

_ENDINGS = {
    RemoteState.SUCCEEDED: State.RESULT_COLLECTING,
    RemoteState.FAILED: State.FAILED,
    RemoteState.EXPIRED: State.FAILED,
    RemoteState.CANCELLED: State.CANCELLED,
}


#: states in which the worker polls the remote job
WATCHED_STATES = frozenset(
    {
        State.ACCEPTED,
        State.OBSERVING,
        State.CANCEL_REQUESTED,
        State.CANCELLING,
        State.CANCELLATION_UNCONFIRMED,
        State.RESULT_TIMED_OUT,
    }
)
_CANCEL_STATES = frozenset({State.CANCEL_REQUESTED, State.CANCELLING, State.CANCELLATION_UNCONFIRMED})
#: states a person has been told about: polled at the back-off's cap, not faster


class ObserveFlow:
    """Polls a remote job; applies the result and cancel deadlines; starts a deferred cancel."""

    def __init__(self, store: Store, writer: Writer, *, actor: str, rng: random.Random | None = None) -> None:
        self.store = store
        self.writer = writer
        self.io = writer.io
        self.actor = actor
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not secrecy

    async def advance(self, op: Operation, provider: Provider) -> Operation:
        if op.state not in WATCHED_STATES:
            return op
        now = self.store.clock()
        if op.next_action_at_us is not None and op.next_action_at_us > now:
            return op
        if op.state in (State.ACCEPTED, State.OBSERVING) and op.cancel_requested_by:
            return await self._deferred_cancel(op, now)
        passed = await self._deadline_passed(op, provider, now)
        return passed if passed is not None else await self._poll(op, provider, now)

    async def _deadline_passed(self, op: Operation, provider: Provider, now: int) -> Operation | None:
        """The result or cancel deadline, once passed: the state says so (the job is polled on, slowly)."""
        slow = now + int(provider.poll_backoff.cap_s * _US)
        if op.state is State.OBSERVING and _past(op.result_deadline_us, now):
            return await self.writer.transition(
                op,
                State.RESULT_TIMED_OUT,
                DeadlinePassed(deadline="result", observed_at_us=now),
                actor=self.actor,
                changes={
                    "next_action_at_us": slow,
                    "state_reason": (
                        f"result deadline passed at {rfc3339(op.result_deadline_us)} with the job "
                        f"{state_shown(op.remote_state) if op.remote_state else 'in an unknown state'}; the remote "
                        "job is NOT assumed stopped"
                    ),
                },
            )
        if (
            op.state in (State.CANCEL_REQUESTED, State.CANCELLING)
            and op.cancel_deadline_us is not None
            and now >= op.cancel_deadline_us
        ):
            return await self.writer.transition(
                op,
                State.CANCELLATION_UNCONFIRMED,
                DeadlinePassed(deadline="cancel", observed_at_us=now),
                actor=self.actor,
                changes={
                    "next_action_at_us": slow,
                    "state_reason": (
                        f"cancel deadline passed at {rfc3339(op.cancel_deadline_us)} without the provider confirming "
                        f"the cancel (last seen: {state_shown(op.remote_state) if op.remote_state else 'unknown'}); "
                        f"see `jobtrail ops escalation {op.operation_id}`"
                    ),
                },
            )
        return None

    async def _poll(self, op: Operation, provider: Provider, now: int) -> Operation:
        """One status read, stored as an observation; only a terminal status moves the state."""
        status = _kept_words(await provider_call(op, "status", provider.status(op)), provider)
        failpoint("observe.after_status")
        resp = status.response
        polls = op.polls + 1
        # Retry-After counts from the answer, not from the request: a slow answer must not pull the next poll
        # ahead of the time the provider asked for
        answered = self.store.clock()
        delay = provider.poll_backoff.after(resp.retry_after_s, polls, self.rng)
        if op.state in ESCALATED_STATES:  # a person has been told: the slow pace, or later if the provider asks
            delay = max(provider.poll_backoff.cap_s, delay)
        next_at = answered + int(delay * _US)
        # stored with the write this answer leads to (one commit), and covered by its entry if it is a transition
        observed: Observe | None = Observe(
            operation_id=op.operation_id,
            kind="status_poll",
            raw=resp.to_json() | {"error_class": status.error_class, "result_ref": status.result_ref},
            http_status=resp.http_status,
            provider_request_id=resp.provider_request_id,
            remote_state=status.remote_state.value,
            raw_state=status.raw_state,
            worker=op.lease_owner,
            lease_epoch=op.lease_epoch if op.lease_owner else None,
            progress=status.progress,
            provider_time=status.provider_time,
            next_action_at_us=next_at,
        )
        effects: Changes = {"partial_effects": status.effects} if status.effects is not None else {}
        if status.error_class and op.state is State.ACCEPTED and _past(op.result_deadline_us, answered):
            return await self._timed_out_unseen(op, provider, status, answered, polls, effects, observed)
        if status.error_class:
            return await self.writer.reschedule(
                op,
                {
                    "polls": polls,
                    "next_action_at_us": next_at,
                    **effects,
                    "state_reason": f"{_poll_failed(op, status, provider)}; next poll at {rfc3339(next_at)}",
                },
                observed=observed,
            )
        evidence = StatusObservation(
            remote_state=status.remote_state,
            raw_state=status.raw_state,
            http_status=resp.http_status,
            provider_request_id=resp.provider_request_id,
            remote_job_id=op.remote_job_id,
            observed_at=rfc3339(answered),
            provider_time=status.provider_time,
            progress=status.progress,
            result_ref=status.result_ref,
        )
        request_ids = (resp.provider_request_id,) if resp.provider_request_id else ()
        ending = _ENDINGS.get(status.remote_state)
        if op.state is State.ACCEPTED:
            # the first answer moves the job to observing; one that is already the job's ending moves it on
            # in the same write, unless there is partial output to fetch first (durable before that request)
            follow = None
            if ending is not None and _partial_output_ref(status) is None:
                follow = FollowUp(
                    to=ending,
                    evidence=evidence,
                    request_ids=request_ids,
                    changes={
                        "remote_state": status.raw_state,
                        "result_ref": status.result_ref,
                        **effects,
                        "state_reason": _ending_reason(op, ending, status),
                    },
                )
            op = await self.writer.transition(
                op,
                State.OBSERVING,
                evidence,
                actor=self.actor,
                request_ids=request_ids,
                changes={
                    "remote_state": status.raw_state,
                    "polls": polls,
                    **effects,
                    # (past the result deadline: the next step ends the wait, not a poll later)
                    "next_action_at_us": now if ending or _past(op.result_deadline_us, answered) else next_at,
                },
                observed=observed,
                then=follow,
            )
            if ending is None or follow is not None:
                return op
            observed = None
        if ending is None:
            return await self._keep_polling(op, status, polls, next_at, effects, observed)
        return await self._end(op, provider, ending, status, evidence, request_ids, effects, observed)

    async def _timed_out_unseen(
        self,
        op: Operation,
        provider: Provider,
        status: StatusOutcome,
        answered: int,
        polls: int,
        effects: Changes,
        observed: Observe | None,
    ) -> Operation:
        """The result deadline passed while no status read has told anything of the job (every one failed):
        this read is recorded as what it is, an observation of a job in an unknown state, and the deadline
        ends the wait in the same write. (The deadline was looked at only once a read had succeeded: a job
        whose reads all failed was polled on in ``accepted`` for ever, past the deadline its caller set.)"""
        resp = status.response
        slow = answered + int(provider.poll_backoff.cap_s * _US)
        assert op.result_deadline_us is not None
        evidence = StatusObservation(
            remote_state=RemoteState.UNKNOWN,
            http_status=resp.http_status,
            provider_request_id=resp.provider_request_id,
            remote_job_id=op.remote_job_id,
            observed_at=rfc3339(answered),
        )
        request_ids = (resp.provider_request_id,) if resp.provider_request_id else ()
        if observed is not None:  # (its next poll is the one the record gets: the slow pace, past the deadline)
            observed = dataclasses.replace(observed, next_action_at_us=slow)
        reason = (
            f"result deadline passed at {rfc3339(op.result_deadline_us)} before any status read told the job's "
            f"state (the last: {_poll_failed(op, status, provider)}); the remote job is NOT assumed stopped"
        )
        return await self.writer.transition(
            op,
            State.OBSERVING,
            evidence,
            actor=self.actor,
            request_ids=request_ids,
            changes={"polls": polls, **effects, "next_action_at_us": slow},
            observed=observed,
            then=FollowUp(
                to=State.RESULT_TIMED_OUT,
                evidence=DeadlinePassed(deadline="result", observed_at_us=answered),
                changes={"next_action_at_us": slow, "state_reason": reason},
            ),
        )

    async def _keep_polling(
        self,
        op: Operation,
        status: StatusOutcome,
        polls: int,
        next_at: int,
        effects: Changes,
        observed: Observe | None,
    ) -> Operation:
        unknown = status.remote_state is RemoteState.UNKNOWN
        waiting: str = "unknown state, still polling" if unknown else status.remote_state.value
        if unknown and status.response is not None and status.response.unreadable:
            waiting = f"unknown state, still polling (the last answer's body is {status.response.unreadable})"
        if op.state is State.RESULT_TIMED_OUT:
            waiting = f"result deadline passed; the remote job is NOT assumed stopped and is still {waiting}"
        elif op.state is State.CANCELLATION_UNCONFIRMED:
            waiting = f"cancel deadline passed and the cancel is still not confirmed (job {waiting})"
        elif op.state in _CANCEL_STATES:
            waiting = f"cancel not confirmed yet (job {waiting})"
        return await self.writer.reschedule(
            op,
            {
                "remote_state": status.raw_state,
                "polls": polls,
                "next_action_at_us": next_at,
                **effects,
                "state_reason": f"{waiting}; next poll at {rfc3339(next_at)}",
            },
            observed=observed,
        )

    async def _end(
        self,
        op: Operation,
        provider: Provider,
        ending: State,
        status: StatusOutcome,
        evidence: StatusObservation,
        request_ids: tuple[str, ...],
        effects: Changes,
        observed: Observe | None,
    ) -> Operation:
        """The provider's terminal word, with the partial output a cancelled or expired job left."""
        reason = _ending_reason(op, ending, status)
        partial = None
        partial_ref = _partial_output_ref(status)
        if partial_ref is not None:
            if observed is not None:  # durable before another request goes out
                await self.writer.apply(observed)
                observed = None
            partial, note = await self._partial_output(op, provider, partial_ref)
            reason = f"{reason}; {note}"
            if partial is not None:
                evidence = dataclasses.replace(
                    evidence,
                    partial_sha256=partial.sha256,
                    partial_size=partial.size,
                    partial_content_type=partial.content_type,
                )
        return await self.writer.transition(
            op,
            ending,
            evidence,
            actor=self.actor,
            request_ids=request_ids,
            changes={
                "remote_state": status.raw_state,
                "result_ref": status.result_ref,
                **effects,
                "state_reason": reason,
            },
            result=partial,
            observed=observed,
        )

    async def _partial_output(self, op: Operation, provider: Provider, ref: str) -> tuple[StoredResult | None, str]:
        """What a cancelled or expired job had already produced: fetched once, checked, stored with the ending.

        The ending does not wait on it: if the fetch or a check fails, the job still ends as the
        provider says, and the reason names the output that was left behind (and where it is).
        """
        resp = await provider_call(op, "fetch_result", provider.fetch_result(op, ref))
        try:
            await self.writer.apply(fetch_observation(op.operation_id, resp, attempt=1))
            if isinstance(resp, NoAnswer) or resp.http_status != 200 or resp.fetched is None:
                why = f"HTTP {resp.http_status}" if isinstance(resp, Response) else str(resp)
                return None, f"its partial output ({ref}) could not be fetched ({why})"
            checked = await self.io(
                check_and_prepare, self.store, op.operation_id, resp, provider.result_spec, named_check(provider)
            )
        finally:
            discard(resp)
        if checked.stored is None:
            return None, f"its partial output was not stored ({checked.refusal})"
        summary = checked.stored.summary or {}
        items = f": {summary['succeeded']} of {summary['items']} items succeeded" if "items" in summary else ""
        return checked.stored, f"partial output stored ({checked.stored.size} bytes{items})"

    async def _deferred_cancel(self, op: Operation, now: int) -> Operation:
        """The cancel asked for before the job id was known: its time has come."""
        window = op.cancel_window_us
        intent = CancelIntent(
            requested_by=op.cancel_requested_by or "unknown",
            reason="cancel requested before the create was confirmed",
            expected_effect="the job is stopped as soon as its id is known",
        )
        return await self.writer.transition(
            op,
            State.CANCEL_REQUESTED,
            intent,
            actor=self.actor,
            changes={
                "cancel_deadline_us": None if window is None else now + window,
                "state_reason": f"carrying out the cancel {op.cancel_requested_by} asked for before the job id "
                "was known",
            },
        )


def _partial_output_ref(status: StatusOutcome) -> str | None:
    """Where a cancelled or expired job's output is (fetched and stored with its ending), if it names any."""
    if status.remote_state in (RemoteState.CANCELLED, RemoteState.EXPIRED):
        return status.result_ref
    return None


def _kept_words(status: StatusOutcome, provider: Provider) -> StatusOutcome:
    """A status read's raw state and provider time as the ledger may keep them, whichever adapter read them:
    one that carries the credential (or would show as other text) is not kept. (The declared providers drop
    such values as they read them; a built-in adapter that took a time as it came stored a credential an
    answer echoed in clear.) The state is then unknown: nothing is decided from a word that was not kept."""
    bad = [
        name
        for name in ("raw_state", "provider_time")
        if isinstance(value := getattr(status, name), str) and unusable(value, provider.redactor) is not None
    ]
    if not bad:
        return status
    if "raw_state" in bad:
        return dataclasses.replace(status, raw_state=None, provider_time=None, remote_state=RemoteState.UNKNOWN)
    return dataclasses.replace(status, provider_time=None)


def _past(deadline_us: int | None, now: int) -> bool:
    return deadline_us is not None and now >= deadline_us


def _poll_failed(op: Operation, status: StatusOutcome, provider: Provider) -> str:
    """Why a status read told nothing, and, where the provider says it does not know the job, what that
    may mean: nothing is assumed from it (the job may be gone, or not listed yet), but a person should know."""
    said = f"status poll failed ({status.error_class}{': ' + status.detail if status.detail else ''})"
    code = status.response.http_status
    if code not in (404, 410) or op.remote_job_id is None:
        return said
    words = in_their_words(status.response.body, provider.redactor)
    return (
        f"{said}{words}: the provider says it does not know job {op.remote_job_id}"
        f"{' any more' if code == 410 else ''}. Just after a create some APIs take a moment to list a job; if this "
        "goes on, it may have been deleted or dropped after the provider's retention, so check its console. It is "
        "NOT assumed stopped or failed: polling goes on until the operation's deadline"
    )


def _ending_reason(op: Operation, ending: State, status: StatusOutcome) -> str:
    """Why the operation ends where it does: the provider's state, and its own words on why (its error
    message), which a person would otherwise dig out of the raw answer."""
    after_cancel = op.state in _CANCEL_STATES
    if ending is State.RESULT_COLLECTING:
        if after_cancel:
            return "the job finished before the cancel took effect; collecting its result"
        return "the provider reports the job finished; collecting the result"
    raw_state, remote = status.raw_state, status.remote_state
    words = f": {quoted(status.failure)}" if status.failure else ""
    if ending is State.FAILED:
        said = state_shown(raw_state or remote.value)
        said = said if said.lower() == remote.value else f"{said} ({remote.value})"
        return f"the provider reports the job {said}{words}" + (
            " (after the cancel was requested)" if after_cancel else ""
        )
    if after_cancel:
        return "the provider reports the job cancelled, as asked"
    return f"the provider reports the job cancelled (not by us){words}"


class CollectFlow:
    """Fetches, checks and stores a finished job's result: its own recorded action."""

    def __init__(
        self,
        store: Store,
        writer: Writer,
        *,
        actor: str,
        rng: random.Random | None = None,
        checks: Mapping[str, Check] | None = None,
    ) -> None:
        self.store = store
        self.writer = writer
        self.io = writer.io
        self.actor = actor
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not secrecy
        self.checks = dict(checks or {})

    def _check_for(self, provider: Provider) -> Check | None:
        return self.checks[provider.name] if provider.name in self.checks else named_check(provider)

    async def advance(self, op: Operation, provider: Provider) -> Operation:
        if op.state is not State.RESULT_COLLECTING:
            return op
        now = self.store.clock()
        if op.next_action_at_us is not None and op.next_action_at_us > now:
            return op
        ref = op.result_ref
        if ref is not None and ref.startswith("observation:"):  # a synchronous result, stored at create
            return await self._synchronous(op, provider, int(ref.split(":", 1)[1]))
        attempts = op.fetch_attempts + 1
        one_time = provider.capabilities.result == "one_time"
        fetched = op.fetch_attempts
        if one_time and fetched > await self.io(self.store.count_observations, op.operation_id, "result_fetch"):
            return await self._unavailable(
                op,
                f"the one-time result was fetched (attempt {fetched}) but storing it "
                "was never recorded, and the provider does not allow fetching it "
                "again: it may be lost",
                None,
            )
        if one_time:  # durable before the fetch: a crash between fetch and store is then visible as such
            op = await self.writer.reschedule(op, {"polls": attempts, "state_reason": "fetching the one-time result"})
        resp = await provider_call(op, "fetch_result", provider.fetch_result(op, ref))
        try:
            failpoint("collect.after_fetch")
            fetch = fetch_observation(op.operation_id, resp, attempt=attempts)
            good = resp if isinstance(resp, Response) and resp.http_status == 200 and resp.fetched is not None else None
            check = self._check_for(provider)
            # a small safe read, checked at once on the loop, lands with the ending it leads to (one commit;
            # a crash before it only means the result is read again); any other fetch is durable first (a
            # one-time result's count of fetches says what was handed over)
            folded = good is not None and not one_time and _checked_on_the_loop(good, provider, check)
            if not folded:
                await self.writer.apply(fetch)
            if good is not None:
                try:
                    return await self._finish(
                        op, provider, good, f"fetched {ref or 'result'}", check, observed=fetch if folded else None
                    )
                except Exception:
                    if folded:  # the ending did not land: the fetch that reached the provider is still recorded
                        await self.writer.apply(fetch)
                    raise
        finally:  # stored by now, or not to be: a spooled body never outlives its collect step
            discard(resp)
        return await self._fetch_failed(op, provider, resp, attempts, one_time=one_time)

    async def _fetch_failed(
        self, op: Operation, provider: Provider, resp: Response | NoAnswer, attempts: int, *, one_time: bool
    ) -> Operation:
        """Fetch ``attempts`` brought no result: try again later, or say why it never will."""
        if isinstance(resp, NoAnswer) and resp.refused:  # no request made; asking again cannot change the answer
            return await self._unavailable(op, resp.detail, None)
        retry_after = resp.retry_after_s if isinstance(resp, Response) else None
        # counted from the answer (Retry-After means "after this answer"), not from when the fetch was sent
        next_at = self.store.clock() + int(provider.backoff.after(retry_after, attempts, self.rng) * _US)
        if isinstance(resp, NoAnswer) and resp.not_sent:
            # nothing reached the provider (no connection came free, or none could be made): no attempt
            # is spent, so only the result deadline ends the retries, never "gave up after N attempts"
            return await self.writer.reschedule(
                op,
                {
                    "polls": attempts - 1,
                    "next_action_at_us": next_at,
                    "state_reason": f"result fetch not sent ({resp.detail}); retrying at {rfc3339(next_at)}",
                },
            )
        status = resp.http_status if isinstance(resp, Response) else None
        # an answer by its status; no answer by why (a time-out, a body cut short), not "HTTP no answer"
        got = f"HTTP {status}" if status else "no answer"
        if isinstance(resp, NoAnswer):
            got = f"{resp.error_class}: {resp.detail}"
        why = f"result fetch {attempts} failed ({got})"
        # an error answer, or a connection that was never made, handed nothing over; silence or 410 may have
        maybe_consumed = status == 410 or (isinstance(resp, NoAnswer) and not resp.not_sent)
        deadline = op.result_deadline_us
        give_up = None
        if one_time and maybe_consumed:
            give_up = "a one-time result may have been handed over and cannot be fetched again"
        elif status == 410:
            give_up = "the provider says the result is gone (410)"
        elif status is not None and 300 <= status < 400:
            give_up = "the provider redirects the fetch, and a redirect is never followed (asking again gets the same)"
        elif deadline is not None and next_at >= deadline:
            give_up = f"the result deadline ({rfc3339(deadline)}) comes before the next try, after {attempts} attempts"
        elif attempts >= MAX_RESULT_ATTEMPTS:
            since = await self._collecting_since(op)
            if self.store.clock() - since >= RESULT_PATIENCE_S * _US:
                give_up = f"gave up after {attempts} attempts since {rfc3339(since)}"
        if give_up is not None:
            return await self._unavailable(op, f"{why}; {give_up}", status)
        return await self.writer.reschedule(
            op,
            {"polls": attempts, "next_action_at_us": next_at, "state_reason": f"{why}; retrying at {rfc3339(next_at)}"},
        )

    async def _collecting_since(self, op: Operation) -> int:
        """When ``op`` last entered result_collecting (read only once its fetches have failed a few times)."""
        entries = await self.io(self.store.history, op.operation_id)
        entered = [e.at_us for e in entries if e.to_state == State.RESULT_COLLECTING.value != e.from_state]
        return entered[-1] if entered else op.created_at_us

    async def _synchronous(self, op: Operation, provider: Provider, observation_id: int) -> Operation:
        stored = await self.io(self.store.observation, observation_id)
        raw = stored["raw"] if stored else {}
        if "withheld" in raw:  # it carried a credential: nothing to store, nothing to hand out
            return await self._refuse_credential(op)
        # a result that came with the create: no response headers to check a sum against
        synchronous = Response(
            http_status=200, headers={"Content-Type": "application/json"}, raw=canonical_bytes(raw.get("result"))
        )
        return await self._finish(op, provider, synchronous, "synchronous", self._check_for(provider), checksum=False)

    async def _unavailable(self, op: Operation, reason: str, status: int | None) -> Operation:
        return await self.writer.transition(
            op,
            State.RESULT_UNAVAILABLE,
            ResultUnavailable(reason=reason, http_status=status),
            actor=self.actor,
            changes={"state_reason": f"the remote job finished; {reason}"},
        )

    async def _refuse_credential(self, op: Operation, observed: Observe | None = None) -> Operation:
        return await self.writer.transition(
            op,
            State.RESULT_VALIDATION_FAILED,
            ValidationFailure(check=NO_CREDENTIALS_CHECK, reason=NO_CREDENTIALS_REASON),
            actor=self.actor,
            changes={
                "state_reason": f"the remote job finished; its result failed validation ({NO_CREDENTIALS_REASON})"
            },
            observed=observed,
        )

    async def _finish(
        self,
        op: Operation,
        provider: Provider,
        resp: Response,
        source: str,
        check: Check | None,
        *,
        checksum: bool = True,
        observed: Observe | None = None,
    ) -> Operation:
        """Check the result (with the caller's ``check``) and store it with its ending (and ``observed``,
        the fetch that brought it)."""
        spec = provider.result_spec if checksum else dataclasses.replace(provider.result_spec, checksum_header=None)
        if _checked_on_the_loop(resp, provider, check):
            checked = check_and_prepare(self.store, op.operation_id, resp, spec, None)
        else:
            checked = await self.io(check_and_prepare, self.store, op.operation_id, resp, spec, check)
        if checked.validation is None:
            return await self._refuse_credential(op, observed)
        stored = checked.stored
        if stored is None:
            return await self.writer.transition(
                op,
                State.RESULT_VALIDATION_FAILED,
                ValidationFailure(check=checked.failed_check, reason=checked.refusal),
                actor=self.actor,
                changes={"state_reason": f"the remote job finished; its result failed validation ({checked.refusal})"},
                observed=observed,
            )
        summary = stored.summary
        if summary and summary.get("failed"):
            shown = ", ".join(summary["failed_ids"][:5]) + (", ..." if summary["failed"] > 5 else "")
            reason = (
                f"succeeded with partial failures: {summary['failed']} of {summary['items']} items failed "
                f"({shown}); result stored, sha256 {stored.sha256[:12]}..."
            )
        else:
            reason = f"result stored ({stored.size} bytes, sha256 {stored.sha256[:12]}..., {source})"
        return await self.writer.transition(
            op,
            State.SUCCEEDED,
            ValidatedResult(
                sha256=stored.sha256,
                size=stored.size,
                content_type=stored.content_type,
                checks=tuple(c["check"] for c in stored.checks if c["ok"]),
            ),
            actor=self.actor,
            changes={"state_reason": reason},
            result=stored,
            observed=observed,
        )


@dataclass(frozen=True, slots=True)
class Checked:
    """A fetched result after its checks: stored (ready to land with its transition), or why not."""

    stored: StoredResult | None
    #: None: refused for carrying a credential (nothing was checked further or stored)
    validation: Validation | None

    @property
    def failed_check(self) -> str:
        failed = self.validation.failed if self.validation is not None else None
        return NO_CREDENTIALS_CHECK if failed is None else str(failed["check"])

    @property
    def refusal(self) -> str:
        failed = self.validation.failed if self.validation is not None else None
        if self.validation is None or failed is None:
            return NO_CREDENTIALS_REASON
        return f"{failed['check']}: expected {failed['expected']}, saw {failed['seen']}"


def _checked_on_the_loop(resp: Response, provider: Provider, check: Check | None) -> bool:
    """Is this result checked on the loop? Only a small one in memory, with no schema and no caller's
    check: a few bytes scanned, no file written, no code of anyone else's (nor its imports) run,
    quicker than the hop to a thread and back."""
    fetched = resp.fetched
    return (
        isinstance(fetched, bytes)
        and len(fetched) <= _CHECKED_ON_THE_LOOP
        and provider.result_spec.schema is None
        and check is None
    )


def check_and_prepare(
    store: Store, operation_id: str, resp: Response, spec: ResultSpec, check: Check | None
) -> Checked:
    """Validate fetched bytes and make them ready to store: blocking (parsing, scanning every byte for a
    credential, writing a large file), so flows run it through their ``io``."""
    fetched = resp.fetched
    assert fetched is not None
    content_type = next((v for k, v in resp.headers.items() if k.lower() == "content-type"), None)
    try:
        checked = validate(fetched, content_type, resp.headers, spec, check)
        if checked.failed is not None:  # a credential in it outranks any other failure (and is named as such)
            view = Buffer(fetched) if isinstance(fetched, bytes) else fetched
            return Checked(None, None if carries_secret(store, view) else checked)
        try:
            stored = prepare_result(
                store, operation_id, fetched, content_type=content_type, checks=checked.checks, summary=checked.summary
            )
        except ResultCarriesCredential:
            return Checked(None, None)
        return Checked(stored, checked)
    finally:
        if isinstance(fetched, Spooled):  # stored by now (copied into the ledger's files), or refused
            fetched.discard()


def named_check(provider: Provider) -> Check | None:
    """The result check a provider file names (``[result] check``), if any."""
    named = provider.result_spec.check
    return load_check(named) if named else None


def discard(resp: Response | NoAnswer) -> None:
    """Drop a fetched body's spool file, if it has one (again is harmless)."""
    if isinstance(resp, Response) and resp.spooled is not None:
        resp.spooled.discard()


def fetch_observation(operation_id: str, resp: Response | NoAnswer, *, attempt: int) -> Observe:
    """A result fetch as the observation that records it (stored by itself, or with the write it leads to)."""
    if isinstance(resp, NoAnswer):
        raw: dict[str, Any] = {"http_status": None, "headers": {}, "attempt": attempt, "size": None}
        # a fetch that never left is no fetch: a one-time result's count of fetches made must not include it
        kind = "result_fetch_not_sent" if resp.not_sent else "result_fetch"
        return Observe(operation_id=operation_id, kind=kind, raw={**raw, "error": resp.to_json()})
    fetched = resp.fetched
    return Observe(
        operation_id=operation_id,
        kind="result_fetch",
        raw={
            "http_status": resp.http_status,
            "headers": dict(resp.headers),
            "attempt": attempt,
            "size": None if fetched is None else fetched.size if isinstance(fetched, Spooled) else len(fetched),
            "error": resp.body,
        },
        http_status=resp.http_status,
        provider_request_id=resp.provider_request_id,
    )


def poll_now(op: Operation, now: int) -> Reschedule | None:
    """The write that makes a watched operation's next poll due now (None: not watched, or due already). A
    webhook decides nothing more: the status query it brings forward does."""
    if op.state in WATCHED_STATES and (op.next_action_at_us or 0) > now:
        return Reschedule(op=op, changes={"next_action_at_us": now})
    return None


def adopt_orphans(store: Store, provider: str, remote_job_id: str, operation_id: str) -> int:
    """Attach events that arrived before the operation knew its job id, each an observation of the operation
    with what it said, and bring its next poll forward; returns how many."""

    def filing(op: Operation, orphans: list[Orphan]) -> list[Observe | Reschedule]:
        writes: list[Observe | Reschedule] = [
            Observe(
                operation_id=op.operation_id,
                kind="webhook",
                raw={"event_id": o.event_id, "type": o.event_type, "adopted": True, "event": parse_json(o.body)},
                provider_time=rfc3339(o.provider_time * _US) if o.provider_time else None,  # (Unix seconds)
                remote_state=None,
                raw_state=o.event_type,
            )
            for o in orphans
        ]
        write = poll_now(op, store.clock())
        return writes if write is None else [*writes, write]

    return attach_orphans(store, provider, remote_job_id, operation_id, filing)
