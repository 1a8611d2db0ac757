"""The create path of DESIGN.md: persist first, send once with the stored token, reconcile every doubt.

:func:`advance_create` performs the one next action of an operation in the
create phase (if it is due) and returns the updated record. Every send is
preceded by a durable attempt entry; every answer is stored as an observation
before the state moves; a doubtful outcome is reconciled by the provider's
path, re-sending only with the same token and only inside the create deadline.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import random
from typing import Any

from jobtrail.domain.canonical import canonical_bytes, compact_json, rfc3339, span_text
from jobtrail.domain.errors import JobIdTaken
from jobtrail.domain.evidence import (
    AmbiguousCreate,
    CannotTell,
    ConfirmedCreate,
    ConflictingJobIds,
    CreateAttempt,
    CreateNotSent,
    DeadlinePassed,
    DefinitiveRejection,
    HumanDecision,
    ProvedAbsent,
    ReconciliationStarted,
    SynchronousResult,
)
from jobtrail.domain.failpoints import failpoint
from jobtrail.domain.jsonpath import unusable_id
from jobtrail.domain.record import Changes, Operation
from jobtrail.domain.redact import REDACTED
from jobtrail.domain.states import CREATE_PHASE, State
from jobtrail.domain.words import in_their_words
from jobtrail.flows.observe import adopt_orphans
from jobtrail.flows.telemetry import provider_call
from jobtrail.ledger.store import Store
from jobtrail.ledger.writer import Writer
from jobtrail.providers.contract import (
    CreateOutcome,
    LookupOutcome,
    Provider,
    ReconcileMode,
    Response,
    slowest_call_s,
)

log = logging.getLogger("jobtrail")

_US = 1_000_000
#: how far a provider's clock may be off ours when it lists jobs by creation time
_CLOCK_SKEW_US = 60 * _US
#: candidate job ids named in a state reason (the evidence keeps them all)
_CANDIDATES_SHOWN = 10


class CreateFlow:
    """Drives operations of one store through the create phase with their provider."""

    def __init__(
        self,
        store: Store,
        *,
        writer: Writer | None = None,
        actor: str = "jobtrail",
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.writer = writer or Writer(store)
        self.io = self.writer.io
        self.actor = actor
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not secrecy

    def _now(self) -> int:
        return self.store.clock()

    # -- the one next action -------------------------------------------------------------

    async def advance(self, op: Operation, provider: Provider) -> Operation:
        """Do the operation's next create-phase action if it is due; return the new record."""
        if op.state not in CREATE_PHASE:
            return op
        now = self._now()
        if op.next_action_at_us is not None and op.next_action_at_us > now:
            return op
        if op.state is State.CREATE_UNKNOWN:
            modes = provider.capabilities.reconcile
            path = modes[0].value if modes else "none"
            return await self.writer.transition(
                op,
                State.RECONCILIATION,
                ReconciliationStarted(path=path),
                actor=self.actor,
                changes={"next_action_at_us": now},
            )
        open_attempt = op.attempts > 0 and await self._attempt_open(op)
        if open_attempt:
            stored = await self.io(self.store.answer_to_attempt, op.operation_id, op.attempts)
            if stored is not None:
                # the last owner stored the provider's answer to this attempt, then died before acting
                # on it: that answer is the evidence, so settle from it without sending anything
                reason = "replay" if stored["raw"].get("reason") == "replay" else "send"
                return await self._settle(
                    op,
                    provider,
                    _stored_outcome(stored),
                    attempt=op.attempts,
                    reason=reason,
                    obs_id=int(stored["observation_id"]),
                )
        deadline = op.create_deadline_us
        if deadline is not None and now >= deadline:
            return await self._deadline_passed(op, now)
        if op.state is State.CREATE_PENDING:
            if open_attempt:
                # the process that sent attempt N died before any answer to it was stored
                return await self.writer.transition(
                    op,
                    State.CREATE_UNKNOWN,
                    AmbiguousCreate(
                        error_class="outcome_not_recorded",
                        attempt=op.attempts,
                        detail=f"attempt {op.attempts} was sent (or about to be) but no answer to it was "
                        "stored; the provider may have created the job",
                    ),
                    actor=self.actor,
                    changes={
                        "next_action_at_us": now,
                        "state_reason": "previous attempt's outcome not recorded",
                    },
                )
            return await self._send(op, provider, reason="send")
        return await self._reconcile(op, provider, now)

    async def _attempt_open(self, op: Operation) -> bool:
        """Is the latest attempt still without a recorded outcome?

        Other facts (a person's cancel request) may have been recorded since: only
        what can follow an attempt without leaving the state counts.
        """
        last = await self.io(self.store.last_entry, op.operation_id, causes=_ATTEMPT_AND_OUTCOMES)
        return last is not None and last.cause == CreateAttempt.kind

    async def _deadline_passed(self, op: Operation, now: int) -> Operation:
        if op.attempts == 0:
            reason = "create deadline passed before any create was sent; no remote job exists"
        else:
            reason = (
                f"create_unresolved: the create deadline passed after {op.attempts} attempt(s) without "
                "a confirmed job id; a person must check the provider for a job with trace id "
                f"{op.trace_id} before deciding"
            )
        if op.cancel_requested_by:
            reason += (
                f"; {op.cancel_requested_by} asked to cancel it before the create was confirmed: if a job "
                "exists, cancel it by hand"
            )
        return await self.writer.transition(
            op,
            State.NEEDS_ATTENTION,
            DeadlinePassed(deadline="create", observed_at_us=now),
            actor=self.actor,
            changes={"state_reason": reason, "next_action_at_us": None},
        )

    async def _reconcile(self, op: Operation, provider: Provider, now: int) -> Operation:
        caps = provider.capabilities
        if not caps.reconcile:
            candidates: tuple[str, ...] = ()
            listed = ""
            if getattr(provider, "lists_candidates", False):
                candidates, listed = await self._candidates(op, provider, now)
            return await self.writer.transition(
                op,
                State.NEEDS_ATTENTION,
                CannotTell(
                    reason="no_reconciliation_path",
                    detail="this provider cannot guarantee at-most-once creation: it offers no way "
                    "to ask whether a create that may have been sent made a job",
                    candidates=candidates,
                ),
                actor=self.actor,
                changes={
                    "next_action_at_us": None,
                    "state_reason": (
                        f"at-most-once not guaranteed by provider {provider.name}: a create may have "
                        f"reached it. {listed + '. ' if listed else ''}Check its console or job list for a job "
                        "created around "
                        f"{rfc3339(op.updated_at_us)} (trace id {op.trace_id}); then resolve to accepted "
                        "with its job id, or to create_pending if none exists"
                    ),
                },
            )
        mode = caps.reconcile[0]
        if mode is ReconcileMode.REPLAY:
            retention = caps.token_retention
            if retention is not None and now > op.created_at_us + int(retention.total_seconds() * _US):
                return await self.writer.transition(
                    op,
                    State.NEEDS_ATTENTION,
                    CannotTell(
                        reason="token_expired",
                        detail=f"the provider keeps tokens for {span_text(retention)}; a replay now could create "
                        "a second job",
                    ),
                    actor=self.actor,
                    changes={
                        "next_action_at_us": None,
                        "state_reason": "idempotency token expired at the provider",
                    },
                )
            return await self._send(op, provider, reason="replay")
        return await self._lookup(op, provider, mode)

    async def _lookup(self, op: Operation, provider: Provider, mode: ReconcileMode) -> Operation:
        found = await self._looked_up(op, provider, mode)
        if found.kind == "found":
            return await self._confirm_or_conflict(
                op, provider, found.remote_job_ids[0], found, via=mode.value, others=found.remote_job_ids[1:]
            )
        if found.kind == "absent":
            return await self.writer.transition(
                op,
                State.CREATE_PENDING,
                ProvedAbsent(
                    path=mode.value,
                    detail=found.detail,
                    http_status=found.response.http_status,
                    provider_request_id=found.response.provider_request_id,
                ),
                actor=self.actor,
                changes={
                    "next_action_at_us": self._now(),
                    "state_reason": f"{mode.value}: no job exists; re-sending with the same token",
                },
            )
        return await self._wait(
            op,
            provider,
            f"{mode.value} could not tell ({found.detail})",
            None,
            AmbiguousCreate(
                error_class="lookup_inconclusive",
                attempt=op.attempts,
                detail=found.detail,
                http_status=found.response.http_status,
            ),
        )

    # -- sending -------------------------------------------------------------------------------

    async def _send(self, op: Operation, provider: Provider, *, reason: str) -> Operation:
        attempt = op.attempts + 1
        op = await self.writer.record(
            op,
            CreateAttempt(attempt=attempt, reason=reason),
            actor=self.actor,
            changes={
                "attempts": attempt,
                "state_reason": f"attempt {attempt} ({reason}) sent; outcome not yet recorded",
            },
        )
        failpoint("create.after_attempt")
        outcome = await provider_call(op, "create", provider.create(op))
        failpoint("create.after_response")
        obs_id = await self._observe(
            op,
            "create_response",
            outcome.response.to_json()
            | {
                "outcome": outcome.kind,
                "remote_job_id": outcome.remote_job_id,
                "status_url": outcome.status_url,
                "error_class": outcome.error_class,
                "detail": outcome.detail,
                "declared_non_retryable": outcome.declared_non_retryable,
                # (kept: an owner that dies before acting on the answer leaves the same decision to its successor)
                "person_must_decide": outcome.person_must_decide,
                "retry_after_s": outcome.response.retry_after_s,
                "attempt": attempt,
                "reason": reason,
            }
            | ({"result": outcome.result} if outcome.kind == "synchronous" else {}),
            outcome.response.http_status,
            outcome.response.provider_request_id,
        )
        failpoint("create.after_observation")
        return await self._settle(op, provider, outcome, attempt=attempt, reason=reason, obs_id=obs_id)

    async def _settle(
        self, op: Operation, provider: Provider, outcome: CreateOutcome, *, attempt: int, reason: str, obs_id: int
    ) -> Operation:
        """Act on the answer to attempt ``attempt`` (just received, or stored by an owner that died)."""
        resp = outcome.response
        if outcome.kind == "confirmed":
            assert outcome.remote_job_id is not None
            others: tuple[str, ...] = ()
            if reason == "replay":
                others = await self._cross_check(op, provider, outcome.remote_job_id)
            return await self._confirm_or_conflict(
                op,
                provider,
                outcome.remote_job_id,
                outcome,
                via=reason,
                others=others,
                status_url=outcome.status_url,
            )
        if outcome.kind == "synchronous":
            result_obs = await self._observe(
                op,
                "synchronous_result",
                {"result": outcome.result},
                resp.http_status,
                resp.provider_request_id,
            )
            changes: Changes = {
                "next_action_at_us": self._now(),
                "state_reason": f"synchronous result stored under this operation (observation {result_obs})",
                "result_ref": f"observation:{result_obs}",
            }
            if outcome.remote_job_id:
                changes["remote_job_id"] = outcome.remote_job_id
            try:
                op = await self.writer.transition(
                    op,
                    State.RESULT_COLLECTING,
                    SynchronousResult(
                        http_status=resp.http_status or 200,
                        provider_request_id=resp.provider_request_id,
                        remote_job_id=outcome.remote_job_id,
                        observation_id=result_obs,
                        result_sha256=hashlib.sha256(canonical_bytes(outcome.result)).hexdigest(),
                    ),
                    actor=self.actor,
                    changes=changes,
                    request_ids=_ids(resp.provider_request_id),
                )
            except JobIdTaken as taken:  # (the result stays stored as its observation, for the person)
                return await self._job_id_taken(op, taken, resp)
            if outcome.remote_job_id:
                op = await self._adopt_orphans(op, provider, outcome.remote_job_id)
            return op
        if outcome.kind == "rejected":
            problem = resp.body if isinstance(resp.body, dict) else {"body": resp.body}
            if op.state is State.RECONCILIATION:
                # IETF semantics replay the stored outcome, errors included: the original was refused too
                return await self.writer.transition(
                    op,
                    State.CREATE_PENDING,
                    ProvedAbsent(
                        path="replay",
                        detail=f"the replay was refused with HTTP {resp.http_status}, so the "
                        "original create was refused too",
                        http_status=resp.http_status,
                        provider_request_id=resp.provider_request_id,
                    ),
                    actor=self.actor,
                    changes={"next_action_at_us": self._now()},
                    request_ids=_ids(resp.provider_request_id),
                )
            return await self.writer.transition(
                op,
                State.FAILED,
                DefinitiveRejection(
                    http_status=resp.http_status or 0,
                    problem=problem,
                    provider_request_id=resp.provider_request_id,
                    declared_non_retryable=outcome.declared_non_retryable,
                ),
                actor=self.actor,
                changes={
                    "next_action_at_us": None,
                    "state_reason": (
                        f"rejected by the provider: {outcome.detail}"
                        f"{in_their_words(resp.body, provider.redactor, outcome.detail)}; "
                        "a changed request is a new operation"
                    ),
                },
                request_ids=_ids(resp.provider_request_id),
            )
        if outcome.kind == "not_sent":
            return await self._wait(
                op,
                provider,
                f"attempt {attempt} never left: {outcome.error_class}",
                resp.retry_after_s,  # a refusal before any processing (a rate limiter's 429) may say when
                None,
                not_sent=outcome,
                obs_id=obs_id,
            )
        # a redirect (re-sending only repeats it) or an answer the adapter knows waiting cannot settle; or a
        # replay repeating the same unreadable answer
        decide = outcome.person_must_decide
        if decide or (op.state is State.RECONCILIATION and outcome.error_class == "malformed_response"):
            return await self.writer.transition(
                op,
                State.NEEDS_ATTENTION,
                CannotTell(
                    reason=outcome.error_class,
                    detail=outcome.detail,
                ),
                actor=self.actor,
                changes={
                    "next_action_at_us": None,
                    "state_reason": outcome.detail
                    if decide
                    else (
                        f"the provider's answers carry no job id ({outcome.detail}); check the provider "
                        "file's create.job_id, then look for the job in the provider's console"
                    ),
                },
                request_ids=_ids(resp.provider_request_id),
            )
        return await self._ambiguous(op, provider, outcome, attempt=attempt, reason=reason)

    async def _ambiguous(
        self, op: Operation, provider: Provider, outcome: CreateOutcome, *, attempt: int, reason: str
    ) -> Operation:
        """An answer that settles nothing: asked another way if it may be a stored one, else tried again later."""
        resp = outcome.response
        if reason == "replay" and _stored_error(resp):
            found = await self._found_another_way(op, provider)
            if found is not None:
                return found
        evidence = AmbiguousCreate(
            error_class=outcome.error_class,
            attempt=attempt,
            detail=outcome.detail,
            http_status=resp.http_status,
            retry_after_s=resp.retry_after_s,
            provider_request_id=resp.provider_request_id,
        )
        return await self._wait(
            op, provider, f"attempt {attempt} ambiguous: {outcome.error_class}", resp.retry_after_s, evidence
        )

    async def _found_another_way(self, op: Operation, provider: Provider) -> Operation | None:
        """After a replay answered with an error the provider may have stored, ask its other declared path
        (a read) whether the job exists, still under the lease the replay was sent under. A provider that
        stores a create's outcome replays it, a 500 included (Stripe does): every replay would answer the same
        until the create deadline, while a listing by our reference can find the job at once. Only a find
        settles anything (None: nothing found): an absence may be a create still running there, and the token
        already keeps a re-send from making a second job, so the replay is simply tried again later."""
        mode = next((m for m in provider.capabilities.reconcile if m is not ReconcileMode.REPLAY), None)
        if mode is None:
            return None
        found = await self._looked_up(op, provider, mode)
        if found.kind != "found":
            return None
        return await self._confirm_or_conflict(
            op, provider, found.remote_job_ids[0], found, via=mode.value, others=found.remote_job_ids[1:]
        )

    async def _candidates(self, op: Operation, provider: Provider, now: int) -> tuple[tuple[str, ...], str]:
        """The jobs the provider lists as created while this create may have been sent (a minute of clock
        skew either side): named for the person who decides, never adopted."""
        since, until = op.created_at_us - _CLOCK_SKEW_US, now + _CLOCK_SKEW_US
        listed = _usable(await provider_call(op, "candidates", provider.candidates(op, since, until)), provider)
        await self._observe(
            op,
            "reconcile_lookup",
            listed.response.to_json()
            | {"kind": listed.kind, "path": "candidates", "candidates": listed.remote_job_ids},
            listed.response.http_status,
            listed.response.provider_request_id,
        )
        window = f"between {rfc3339(since)} and {rfc3339(until)}"
        if listed.kind != "candidates":
            return (), f"Its jobs could not be listed ({listed.detail})"
        ids = listed.remote_job_ids
        if not ids:
            return ids, f"It lists no job created {window}, which makes one unlikely but is not proof"
        shown = ", ".join(ids[:_CANDIDATES_SHOWN]) + (", ..." if len(ids) > _CANDIDATES_SHOWN else "")
        return ids, f"{len(ids)} job(s) created {window} may be this one: {shown}"

    async def _looked_up(self, op: Operation, provider: Provider, mode: ReconcileMode) -> LookupOutcome:
        """Ask the provider by a non-replay path, and store its answer as an observation."""
        found = _usable(await provider_call(op, "lookup", provider.lookup(op, mode)), provider)
        await self._observe(
            op,
            "reconcile_lookup",
            found.response.to_json() | {"kind": found.kind, "path": mode.value},
            found.response.http_status,
            found.response.provider_request_id,
        )
        return found

    async def _cross_check(self, op: Operation, provider: Provider, job_id: str) -> tuple[str, ...]:
        """After a replay, ask an independent path (if any) which jobs carry our token."""
        for mode in provider.capabilities.reconcile:
            if mode is ReconcileMode.REPLAY:
                continue
            found = await self._looked_up(op, provider, mode)
            if found.kind == "found":
                return tuple(j for j in found.remote_job_ids if j != job_id)
        return ()

    async def _confirm_or_conflict(
        self,
        op: Operation,
        provider: Provider,
        job_id: str,
        outcome: CreateOutcome | LookupOutcome,
        *,
        via: str,
        others: tuple[str, ...] = (),
        status_url: str | None = None,
    ) -> Operation:
        resp = outcome.response
        # answers to earlier attempts of this token (only possible after more than one attempt)
        earlier = [j for j in await self._earlier_job_ids(op) if j != job_id] if op.attempts > 1 else []
        conflicting = (*others, *earlier)
        if conflicting:
            return await self.writer.transition(
                op,
                State.NEEDS_ATTENTION,
                ConflictingJobIds(
                    first_job_id=conflicting[0],
                    second_job_id=job_id,
                    first_response={
                        "source": "earlier answer or independent lookup",
                        "job_ids": list(conflicting),
                    },
                    second_response=resp.to_json(),
                ),
                actor=self.actor,
                changes={
                    "next_action_at_us": None,
                    "state_reason": (
                        "the provider answered one idempotency token with different job ids "
                        f"({conflicting[0]} and {job_id}): it broke its idempotency contract; both may be "
                        "running. A person must decide which to keep and cancel the other"
                    ),
                },
                request_ids=_ids(resp.provider_request_id),
            )
        try:
            op = await self.writer.transition(
                op,
                State.ACCEPTED,
                ConfirmedCreate(
                    remote_job_id=job_id,
                    http_status=resp.http_status,
                    provider_request_id=resp.provider_request_id,
                    status_url=status_url,
                    via=via,
                ),
                actor=self.actor,
                # the first status read waits one poll interval: the job was created a moment ago
                changes={
                    "remote_job_id": job_id,
                    "state_reason": None,
                    "next_action_at_us": self._now() + int(provider.poll_backoff.delay(1, self.rng) * _US),
                },
                request_ids=_ids(resp.provider_request_id),
            )
        except JobIdTaken as taken:
            return await self._job_id_taken(op, taken, resp)
        failpoint("create.after_job_id")
        return await self._adopt_orphans(op, provider, job_id)

    async def _job_id_taken(self, op: Operation, taken: JobIdTaken, resp: Response) -> Operation:
        """The provider named a job another operation holds: nothing automatic can settle which operation the
        job is (nor whether this request ever ran), so a person decides, with both operations named."""
        job_id, holder = taken.details["remote_job_id"], taken.details["holder"]
        return await self.writer.transition(
            op,
            State.NEEDS_ATTENTION,
            CannotTell(reason="job_id_taken", detail=f"job {job_id} is operation {holder}'s", candidates=(job_id,)),
            actor=self.actor,
            changes={"next_action_at_us": None, "state_reason": str(taken)},
            request_ids=_ids(resp.provider_request_id),
        )

    async def _adopt_orphans(self, op: Operation, provider: Provider, job_id: str) -> Operation:
        """Attach the webhook events that came before the operation knew ``job_id`` (now recorded).

        The job id is recorded first, then its events are looked for; a receiver storing one meanwhile looks
        for the job id after storing it, so one of the two attaches it (see jobtrail.interfaces.webhooks).
        """
        if not provider.capabilities.webhook_scheme:
            return op
        await self.io(adopt_orphans, self.store, provider.name, job_id, op.operation_id)
        return await self.io(self.store.get, op.operation_id)

    async def _earlier_job_ids(self, op: Operation) -> list[str]:
        ids = []
        for obs in await self.io(self.store.observations, op.operation_id):
            raw = obs["raw"]
            confirmed = raw.get("outcome") in ("confirmed", "synchronous")
            if obs["kind"] == "create_response" and confirmed and raw.get("remote_job_id"):
                ids.append(raw["remote_job_id"])
        return ids[:-1]  # the newest is the answer being confirmed now

    async def _wait(
        self,
        op: Operation,
        provider: Provider,
        why: str,
        retry_after_s: float | None,
        evidence: AmbiguousCreate | None,
        *,
        not_sent: CreateOutcome | None = None,
        obs_id: int | None = None,
    ) -> Operation:
        """Record a doubtful or failed attempt and when to try again (Retry-After, else back-off).

        Where a doubtful create is settled by a lookup rather than a replay (or its candidates are
        listed for a person), the listing waits out the provider's slowest call first: a request our
        side gave up on may still be in progress there, and a listing made before it finishes would
        wrongly prove its job absent (or name no candidate).
        """
        delay = provider.backoff.after(retry_after_s, max(op.attempts, 1), self.rng)
        reconcile = provider.capabilities.reconcile
        listed = bool(reconcile) and reconcile[0] is not ReconcileMode.REPLAY
        if evidence is not None and (listed or (not reconcile and getattr(provider, "lists_candidates", False))):
            delay = max(delay, slowest_call_s(provider))
        at = self._now() + int(delay * _US)
        changes: Changes = {"next_action_at_us": at, "state_reason": f"{why}; next try at {rfc3339(at)}"}
        if not_sent is not None:
            return await self.writer.record(
                op,
                CreateNotSent(
                    error_class=not_sent.error_class,
                    attempt=op.attempts,
                    detail=not_sent.detail,
                    retry_at=rfc3339(at),
                ),
                actor=self.actor,
                changes=changes,
            )
        assert evidence is not None
        stamped = dataclasses.replace(evidence, retry_at=rfc3339(at))
        if op.state is State.CREATE_PENDING:
            return await self.writer.transition(
                op,
                State.CREATE_UNKNOWN,
                stamped,
                actor=self.actor,
                changes=changes,
                request_ids=_ids(evidence.provider_request_id),
            )
        return await self.writer.record(
            op, stamped, actor=self.actor, changes=changes, request_ids=_ids(evidence.provider_request_id)
        )

    async def _observe(
        self, op: Operation, kind: str, raw: dict[str, Any], status: int | None, request_id: str | None
    ) -> int:
        return await self.writer.observe(
            op.operation_id, kind=kind, raw=raw, http_status=status, provider_request_id=request_id
        )


#: an attempt, and what settles one without leaving the create phase (every other outcome leaves it)
_ATTEMPT_AND_OUTCOMES = (
    CreateAttempt.kind,
    CreateNotSent.kind,
    ProvedAbsent.kind,
    AmbiguousCreate.kind,
    ReconciliationStarted.kind,
    HumanDecision.kind,
)


def _stored_outcome(stored: dict[str, Any]) -> CreateOutcome:
    """The outcome of an attempt, read back from its stored (redacted) answer."""
    raw = stored["raw"]
    kind = raw.get("outcome")
    if kind not in ("confirmed", "synchronous", "rejected", "ambiguous", "not_sent"):
        kind = "ambiguous"  # an answer we cannot read back is a doubt, never a confirmation
    # what was stored went through the redactor: a job id or result it masked is no longer the
    # provider's, and an answer kept without its result cannot give it back, so both are doubts
    # (a provider with tokens is then replayed; one without says so plainly)
    if kind == "confirmed" and (not raw.get("remote_job_id") or REDACTED in str(raw["remote_job_id"])):
        kind = "ambiguous"
    if kind == "synchronous" and ("result" not in raw or REDACTED in compact_json(raw["result"])):
        kind = "ambiguous"
    response = Response(
        http_status=stored.get("http_status"),
        headers=raw.get("headers") or {},
        body=raw.get("body"),
        provider_request_id=stored.get("provider_request_id"),
        retry_after_s=raw.get("retry_after_s"),
    )
    return CreateOutcome(
        kind=kind,
        response=response,
        remote_job_id=raw.get("remote_job_id"),
        status_url=raw.get("status_url"),
        result=raw.get("result"),
        error_class=raw.get("error_class") or ("stored_answer_unusable" if kind == "ambiguous" else ""),
        detail=raw.get("detail") or "",
        declared_non_retryable=bool(raw.get("declared_non_retryable")),
        person_must_decide=bool(raw.get("person_must_decide")) and kind == "ambiguous",
    )


def _stored_error(resp: Response) -> bool:
    """Could this answer be one the provider stored for the token and replays as it is? A 5xx it sent as an
    answer (a time-out or a reset is no answer; a Retry-After says "later", a shed load, not an outcome)."""
    return resp.http_status is not None and resp.http_status >= 500 and resp.retry_after_s is None


def _ids(request_id: str | None) -> tuple[str, ...]:
    return (request_id,) if request_id else ()


def _usable(listed: LookupOutcome, provider: Provider) -> LookupOutcome:
    """A listing's job ids as they may be used: one an adapter read from a provider's list is held to the rule
    of one read from a create's answer (no credential, nothing that shows as other text, no line break, no dot
    segment). A find whose every id is unusable found nothing usable: it says why, and a person decides."""
    kept = tuple(j for j in listed.remote_job_ids if unusable_id(j, provider.redactor) is None)
    if len(kept) == len(listed.remote_job_ids):
        return listed
    dropped = len(listed.remote_job_ids) - len(kept)
    why = f"{dropped} job id(s) the provider listed are unusable and not used"
    if listed.kind == "found" and not kept:
        return dataclasses.replace(listed, kind="unknown", remote_job_ids=(), detail=why)
    return dataclasses.replace(listed, remote_job_ids=kept, detail=f"{listed.detail}; {why}" if listed.detail else why)
