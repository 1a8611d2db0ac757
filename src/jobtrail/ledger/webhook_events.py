"""Webhook events as the ledger keeps them: recorded once per event id, matched, adopted, counted when refused.

The receiver (:mod:`jobtrail.interfaces.webhooks`) decides what to record; these
are the statements that record it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from jobtrail.domain.record import Operation
from jobtrail.ledger import schema as t
from jobtrail.ledger.store import Observe, Reschedule, Store

#: what filing an event under its operation writes besides the event (its observation, the poll brought
#: forward), given the operation as it is now and whether the event is older than one already filed
Filing = Callable[[Operation, bool], Sequence[Observe | Reschedule]]
#: what adopting an operation's orphan events writes, given the operation and the events
Adopting = Callable[[Operation, list["Orphan"]], Sequence[Observe | Reschedule]]


@dataclass(frozen=True, slots=True)
class Kept:
    """What recording one event did."""

    #: False: nothing was written now (its event id was recorded before: a redelivery)
    new: bool
    #: the operation it is filed under, now or before; None: it is kept as an orphan
    operation_id: str | None
    #: filed now, and older than an event already filed under that operation
    stale: bool = False


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


def record_event(store: Store, row: dict[str, Any], filing: Filing) -> Kept:
    """Record one event (and forget expired ones) and, when ``row`` names its operation, file it there
    (``filing``), all in one transaction: recorded whole or not at all.

    (Recorded first and filed in a transaction of its own, a failure between the two, a lock waited out on
    PostgreSQL, left the event recorded and unfiled: the receiver answered 503, and the provider's redelivery
    was then a duplicate, so the event was never observed and the poll never brought forward.)

    The uniqueness constraint decides, so two receivers racing on one delivery store it once: the second's
    insert waits for the first's transaction, and adds nothing if that one commits.
    """
    table = t.webhook_events
    insert: Any = (pg_insert if store.dialect == "postgresql" else sqlite_insert)(table)
    with store.writing("recording a webhook") as conn:
        conn.execute(sa.delete(table).where(table.c.expires_at_us < row["received_at_us"]))
        # (RETURNING: what was inserted is what was returned; psycopg's row count says -1 here)
        if conn.execute(insert.on_conflict_do_nothing().returning(table.c.event_id), row).first() is None:
            known = conn.execute(
                sa.select(table.c.operation_id).where(
                    table.c.provider == row["provider"], table.c.event_id == row["event_id"]
                )
            ).scalar()
            return Kept(new=False, operation_id=known)
        if row["operation_id"] is None:
            return Kept(new=True, operation_id=None)
        stale = _file(store, conn, row["operation_id"], row["event_id"], row["provider_time"], filing)
    return Kept(new=True, operation_id=row["operation_id"], stale=stale)


def _file(
    store: Store, conn: sa.Connection, operation_id: str, event_id: str, provider_time: int, filing: Filing
) -> bool:
    """Write what ``filing`` asks for the event, in the caller's transaction; returns whether it is stale.

    As :meth:`Store.apply` writes a batch, but in a transaction that has written the event already: the
    operation's row is locked first (PostgreSQL; SQLite's write lock is held), so the record read here is
    the one the writes land on, and the observation's id is committed before any later history entry of the
    operation looks for the observations to cover."""
    op = store.locked_record(conn, operation_id)
    stale = _newest_event_time(conn, operation_id, event_id) > provider_time
    store.apply_within(conn, filing(op, stale))
    return stale


def _newest_event_time(conn: sa.Connection, operation_id: str, other_than: str) -> int:
    """The newest provider time of the operation's other events (0 when none)."""
    events = t.webhook_events.c
    newest = conn.execute(
        sa.select(sa.func.max(events.provider_time)).where(
            events.operation_id == operation_id, events.event_id != other_than
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


def attach_event(
    store: Store, provider: str, event_id: str, provider_time: int, operation_id: str, filing: Filing
) -> Kept | None:
    """Attach one kept orphan event to ``operation_id`` and file it there (``filing``), in one transaction;
    None when it is attached already (adopted), and nothing was written."""
    events = t.webhook_events.c
    with store.writing("matching a webhook") as conn:
        attached = conn.execute(
            sa.update(t.webhook_events)
            .where(events.provider == provider, events.event_id == event_id, events.operation_id.is_(None))
            .values(operation_id=operation_id)
        ).rowcount
        if not attached:
            return None
        stale = _file(store, conn, operation_id, event_id, provider_time, filing)
    return Kept(new=True, operation_id=operation_id, stale=stale)


def attach_orphans(store: Store, provider: str, remote_job_id: str, operation_id: str, filing: Adopting) -> int:
    """Attach the events that arrived before the operation knew its job id, each filed under it with what
    it said (``filing`` of the operation and the events), in one transaction; returns how many.

    (Only their count was filed before: once the event rows were pruned, what the events said was nowhere.)
    """
    events = t.webhook_events.c
    with store.writing("matching orphan webhooks") as conn:
        adopted = conn.execute(
            sa.update(t.webhook_events)
            .where(events.provider == provider, events.remote_job_id == remote_job_id, events.operation_id.is_(None))
            .values(operation_id=operation_id)
            .returning(events.event_id, events.event_type, events.provider_time, events.body)
        ).all()
        if adopted:
            op = store.locked_record(conn, operation_id)
            store.apply_within(conn, filing(op, [Orphan(*row) for row in adopted]))
    return len(adopted)


@dataclass(frozen=True, slots=True)
class Orphan:
    """An event kept before any operation knew its job, as recorded (its body masked already)."""

    event_id: str
    event_type: str | None
    provider_time: int | None
    body: str
