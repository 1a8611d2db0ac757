"""Webhook events as the ledger keeps them: recorded once per event id, matched, adopted, counted when refused.

The receiver (:mod:`jobtrail.interfaces.webhooks`) decides what to record; these
are the statements that record it.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from jobtrail.domain.record import Operation
from jobtrail.ledger import schema as t
from jobtrail.ledger.store import Store


def count_refusal(store: Store, provider: str, reason: str) -> None:
    """One more refused delivery of ``provider`` for ``reason`` (a counter; never the body)."""
    with store.writing("counting a refused webhook") as conn:
        done = conn.execute(
            sa.update(t.webhook_rejections)
            .where(t.webhook_rejections.c.provider == provider, t.webhook_rejections.c.reason == reason)
            .values(count=t.webhook_rejections.c.count + 1, last_at_us=store.clock())
        ).rowcount
        if not done:
            conn.execute(
                sa.insert(t.webhook_rejections),
                {"provider": provider, "reason": reason, "count": 1, "last_at_us": store.clock()},
            )


def record_event(store: Store, row: dict[str, Any]) -> bool:
    """Record one event (and forget expired ones); False when its event id was already recorded.

    The uniqueness constraint decides, so two receivers racing on one delivery store it once.
    """
    try:
        with store.writing("recording a webhook") as conn:
            conn.execute(sa.delete(t.webhook_events).where(t.webhook_events.c.expires_at_us < row["received_at_us"]))
            conn.execute(sa.insert(t.webhook_events), row)
    except Exception as exc:
        if isinstance(exc.__cause__, sa.exc.IntegrityError):
            return False
        raise
    return True


def newest_event_time(store: Store, operation_id: str, other_than: str) -> int:
    """The newest provider time of the operation's other events (0 when none)."""
    with store._read() as conn:
        newest = conn.execute(
            sa.select(sa.func.max(t.webhook_events.c.provider_time)).where(
                t.webhook_events.c.operation_id == operation_id, t.webhook_events.c.event_id != other_than
            )
        ).scalar()
    return int(newest or 0)


def match_operation(store: Store, provider: str, job_id: str | None, reference: str | None) -> Operation | None:
    """The operation an event is about, by remote job id or by our client reference (the idempotency token)."""
    ops = t.operations.c
    conditions = []
    if job_id:
        conditions.append(ops.remote_job_id == job_id)
    if reference:
        conditions.append(ops.idempotency_token == reference)
    if not conditions:
        return None
    with store._read() as conn:
        row = conn.execute(sa.select(ops.operation_id).where(ops.provider == provider, sa.or_(*conditions))).first()
    return None if row is None else store.get(row.operation_id)


def attach_orphans(store: Store, provider: str, remote_job_id: str, operation_id: str) -> int:
    """Attach the events that arrived before the operation knew its job id; returns how many."""
    with store.writing("matching orphan webhooks") as conn:
        adopted = conn.execute(
            sa.update(t.webhook_events)
            .where(
                t.webhook_events.c.provider == provider,
                t.webhook_events.c.remote_job_id == remote_job_id,
                t.webhook_events.c.operation_id.is_(None),
            )
            .values(operation_id=operation_id)
        ).rowcount
    return int(adopted)
