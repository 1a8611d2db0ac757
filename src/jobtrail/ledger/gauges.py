"""The ledger's counts that metrics and progress displays read: operations by state, the due backlog.

Each is one aggregate query (no rows leave the database), cheap enough to run at every metrics
collection or display refresh, and gives up after a second's wait on a lock (StorageError) rather
than hold a scrape. Blocking: call them off the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from jobtrail.domain.states import State
from jobtrail.ledger import schema as t
from jobtrail.ledger.store import Store


def operations_by_state(store: Store, *, providers: Sequence[str] | None = None) -> dict[tuple[str, str], int]:
    """How many operations are in each (provider, state)."""
    ops = t.operations
    query = sa.select(ops.c.provider, ops.c.state, sa.func.count()).group_by(ops.c.provider, ops.c.state)
    if providers is not None:
        query = query.where(ops.c.provider.in_(list(providers)))
    with store._glance() as conn:
        return {(provider, state): int(n) for provider, state, n in conn.execute(query)}


@dataclass(frozen=True, slots=True)
class Backlog:
    """Operations whose next action is due and that no live lease covers: waiting for a worker."""

    due: int
    #: how long the longest-waiting one has been due (microseconds; 0 when none is)
    oldest_wait_us: int


def due_backlog(store: Store, *, states: Sequence[State], providers: Sequence[str] | None = None) -> Backlog:
    """The due backlog among operations in ``states`` (those with an automatic next action)."""
    now = store.clock()
    ops = t.operations
    query = sa.select(sa.func.count(), sa.func.min(ops.c.next_action_at_us)).where(
        ops.c.next_action_at_us <= now,
        sa.or_(ops.c.lease_expires_at_us.is_(None), ops.c.lease_expires_at_us <= now),
        ops.c.state.in_([s.value for s in states]),
    )
    if providers is not None:
        query = query.where(ops.c.provider.in_(list(providers)))
    with store._glance() as conn:
        due, oldest = conn.execute(query).one()
    return Backlog(int(due), 0 if oldest is None else max(0, now - int(oldest)))
