"""Webhook events as the ledger keeps them: recorded once per event id, matched, adopted, counted when refused.

The receiver (:mod:`jobtrail.interfaces.webhooks`) decides what to record; these
are the statements that record it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from jobtrail.domain.record import Operation
from jobtrail.ledger import schema as t
from jobtrail.ledger.store import Store


def count_refusals(store: Store, counts: Mapping[tuple[str, str], int]) -> None:
    """Add refused deliveries to their counters, by (provider, reason), in one transaction (never a body).

    One statement each, an insert that adds to the row when there is one: two receivers counting the same
    reason for the first time must both land (an update, then an insert, lost one's whole batch to the key).
    """
    table = t.webhook_rejections
    insert: Any = (pg_insert if store.dialect == "postgresql" else sqlite_insert)(table)
    upsert = insert.on_conflict_do_update(
        index_elements=[table.c.provider, table.c.reason],
        set_={"count": table.c.count + insert.excluded.count, "last_at_us": insert.excluded.last_at_us},
    )
    now = store.clock()
    with store.writing("counting refused webhooks") as conn:
        conn.execute(
            upsert,
            [
                {"provider": provider, "reason": reason, "count": count, "last_at_us": now}
                for (provider, reason), count in counts.items()
            ],
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
    """The operation an event is about: the one that knows the event's job id; failing that, the one our
    client reference (the idempotency token) names, if it knows no job id yet (or the event names none).

    A reference never outweighs a job id: an event about job X that carries the token of an operation whose
    job is Y is about another job made with that token (a duplicate left by a lost create answer, on a
    provider without idempotency), so it is kept as an orphan, not filed as that operation's evidence.
    """
    ops = t.operations.c
    if not job_id and not reference:
        return None
    found = None
    with store._read() as conn:
        if job_id:
            found = conn.execute(
                sa.select(ops.operation_id)
                .where(ops.provider == provider, ops.remote_job_id == job_id)
                .order_by(ops.created_at_us, ops.operation_id)
                .limit(1)
            ).scalar()
        if found is None and reference:
            question = sa.select(ops.operation_id).where(ops.provider == provider, ops.idempotency_token == reference)
            if job_id:  # (the operation knowing this very job id was looked for above)
                question = question.where(sa.func.coalesce(ops.remote_job_id, "") == "")
            found = conn.execute(question).scalar()
    return None if found is None else store.get(found)


def attach_event(store: Store, provider: str, event_id: str, operation_id: str) -> bool:
    """Attach one kept orphan event to ``operation_id``; False when it is attached already (adopted)."""
    events = t.webhook_events.c
    with store.writing("matching a webhook") as conn:
        attached = conn.execute(
            sa.update(t.webhook_events)
            .where(events.provider == provider, events.event_id == event_id, events.operation_id.is_(None))
            .values(operation_id=operation_id)
        ).rowcount
    return bool(attached)


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
