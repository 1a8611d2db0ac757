"""Observing a running job and collecting its result: one poll or one fetch per call.

Every poll stores an observation (normalised and raw state, HTTP status,
provider request id, progress, the redacted raw answer, who polled under which
lease, and when the next poll is due). Progress never implies completion; an
unknown remote state is recorded and polling goes on. Only a terminal status
moves the state, and only with that observation as evidence.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

from jobtrail._canonical import canonical_bytes, rfc3339
from jobtrail._evidence import DeadlinePassed, ResultUnavailable, StatusObservation, ValidatedResult
from jobtrail._provider import Provider
from jobtrail._record import Operation
from jobtrail._states import RemoteState, State
from jobtrail._store import Store
from jobtrail._writer import Writer

_US = 1_000_000
#: a result fetch that keeps failing is given up after this many attempts
MAX_RESULT_ATTEMPTS = 5

_ENDINGS = {
    RemoteState.SUCCEEDED: State.RESULT_COLLECTING,
    RemoteState.FAILED: State.FAILED,
    RemoteState.EXPIRED: State.FAILED,
    RemoteState.CANCELLED: State.CANCELLED,
}


class ObserveFlow:
    """Polls accepted and observing operations."""

    def __init__(self, store: Store, writer: Writer, *, actor: str, rng: random.Random | None = None) -> None:
        self.store = store
        self.writer = writer
        self.actor = actor
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not secrecy

    async def advance(self, op: Operation, provider: Provider) -> Operation:
        if op.state not in (State.ACCEPTED, State.OBSERVING):
            return op
        now = self.store.clock()
        if op.next_action_at_us is not None and op.next_action_at_us > now:
            return op
        if op.state is State.OBSERVING and op.result_deadline_us is not None and now >= op.result_deadline_us:
            return await self.writer.transition(
                op,
                State.RESULT_TIMED_OUT,
                DeadlinePassed(deadline="result", observed_at_us=now),
                actor=self.actor,
                changes={
                    "state_reason": (
                        f"result deadline passed at {rfc3339(op.result_deadline_us)} with the job "
                        f"{op.remote_state or 'in an unknown state'}; the remote job is NOT assumed stopped"
                    )
                },
            )
        status = await provider.status(op)
        resp = status.response
        polls = op.polls + 1
        next_at = now + int(provider.poll_backoff.after(resp.retry_after_s, polls, self.rng) * _US)
        await self.writer.observe(
            op.operation_id,
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
        if status.error_class:
            return await self.writer.reschedule(
                op,
                {
                    "polls": polls,
                    "next_action_at_us": next_at,
                    "state_reason": (
                        f"status poll failed ({status.error_class}); next poll at {rfc3339(next_at)}"
                    ),
                },
            )
        evidence = StatusObservation(
            remote_state=status.remote_state,
            raw_state=status.raw_state,
            http_status=resp.http_status,
            provider_request_id=resp.provider_request_id,
            remote_job_id=op.remote_job_id,
            observed_at=rfc3339(now),
            provider_time=status.provider_time,
            progress=status.progress,
            result_ref=status.result_ref,
        )
        request_ids = (resp.provider_request_id,) if resp.provider_request_id else ()
        ending = _ENDINGS.get(status.remote_state)
        if op.state is State.ACCEPTED:
            op = await self.writer.transition(
                op,
                State.OBSERVING,
                evidence,
                actor=self.actor,
                request_ids=request_ids,
                changes={
                    "remote_state": status.raw_state,
                    "polls": polls,
                    "next_action_at_us": now if ending else next_at,
                },
            )
            if ending is None:
                return op
        if ending is None:
            waiting = (
                "unknown state, still polling"
                if status.remote_state is RemoteState.UNKNOWN
                else (status.remote_state.value)
            )
            return await self.writer.reschedule(
                op,
                {
                    "remote_state": status.raw_state,
                    "polls": polls,
                    "next_action_at_us": next_at,
                    "state_reason": f"{waiting}; next poll at {rfc3339(next_at)}",
                },
            )
        reason = {
            State.RESULT_COLLECTING: "the provider reports the job finished; collecting the result",
            State.FAILED: f"the provider reports the job {status.raw_state}",
            State.CANCELLED: "the provider reports the job cancelled (not by us)",
        }[ending]
        return await self.writer.transition(
            op,
            ending,
            evidence,
            actor=self.actor,
            request_ids=request_ids,
            changes={
                "remote_state": status.raw_state,
                "result_ref": status.result_ref,
                "state_reason": reason,
            },
        )


class CollectFlow:
    """Fetches and checks a finished job's result (or the one a synchronous create returned)."""

    def __init__(self, store: Store, writer: Writer, *, actor: str, rng: random.Random | None = None) -> None:
        self.store = store
        self.writer = writer
        self.actor = actor
        self.rng = rng or random.Random()  # noqa: S311 - jitter, not secrecy

    async def advance(self, op: Operation, provider: Provider) -> Operation:
        if op.state is not State.RESULT_COLLECTING:
            return op
        now = self.store.clock()
        if op.next_action_at_us is not None and op.next_action_at_us > now:
            return op
        ref = op.result_ref
        if ref is not None and ref.startswith("observation:"):  # a synchronous result, stored at create
            stored = self.store.observation(int(ref.split(":", 1)[1]))
            return await self._validated(
                op, stored["raw"].get("result") if stored else None, None, "synchronous"
            )
        attempts = op.polls + 1
        resp = await provider.fetch_result(op, ref)
        body = resp.body
        await self.writer.observe(
            op.operation_id,
            kind="result_fetch",
            raw={
                "http_status": resp.http_status,
                "headers": dict(resp.headers),
                "attempt": attempts,
                "size": len(json.dumps(body)) if body is not None else 0,
            },
            http_status=resp.http_status,
            provider_request_id=resp.provider_request_id,
        )
        if (
            resp.http_status == 200
            and body is not None
            and not (isinstance(body, dict) and "_jobtrail_unparsed" in body)
        ):
            return await self._validated(
                op, body, resp.headers.get("Content-Type"), f"fetched {ref or 'result'}"
            )
        why = f"result fetch {attempts} failed (HTTP {resp.http_status or 'no answer'})"
        if attempts >= MAX_RESULT_ATTEMPTS:
            return await self.writer.transition(
                op,
                State.RESULT_UNAVAILABLE,
                ResultUnavailable(
                    reason=f"{why}; gave up after {attempts} attempts", http_status=resp.http_status
                ),
                actor=self.actor,
                changes={"state_reason": f"{why}; gave up after {attempts} attempts"},
            )
        next_at = now + int(provider.backoff.after(resp.retry_after_s, attempts, self.rng) * _US)
        return await self.writer.reschedule(
            op,
            {
                "polls": attempts,
                "next_action_at_us": next_at,
                "state_reason": f"{why}; retrying at {rfc3339(next_at)}",
            },
        )

    async def _validated(
        self, op: Operation, result: Any, content_type: str | None, source: str
    ) -> Operation:
        data = canonical_bytes(result)
        digest = hashlib.sha256(data).hexdigest()
        obs_id = await self.writer.observe(
            op.operation_id, kind="result", raw={"result": result, "sha256": digest}
        )
        return await self.writer.transition(
            op,
            State.SUCCEEDED,
            ValidatedResult(sha256=digest, size=len(data), content_type=content_type, checks=("json",)),
            actor=self.actor,
            changes={
                "state_reason": f"result stored (observation {obs_id}, sha256 {digest[:12]}..., {source})"
            },
        )
