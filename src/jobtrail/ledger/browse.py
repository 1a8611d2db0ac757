"""Browsing the ledger a page at a time (the dashboard): filtered lists, counts by state, the queue of
what needs a person, recent workers.

Every query is bounded: lists page by ``operation_id`` (newest first, keyset paging: a page after
``before`` costs the same on the thousandth page as on the first), and the text search matches
only indexed columns (an id or key by prefix, a caller or remote job id exactly), never a scan
of request bodies or reasons. Migration 0009 adds the indexes these queries use.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from jobtrail.domain.record import Operation
from jobtrail.domain.states import ESCALATED_STATES, State
from jobtrail.ledger import schema as t
from jobtrail.ledger.store import Store, _operation

#: states in which nothing automatic will settle the operation: a person must look, the longest waiting first
PERSON_STATES = (State.NEEDS_ATTENTION, *sorted(ESCALATED_STATES))
#: the most rows one page may ask for
MAX_PAGE = 200
#: past the highest code point: ``prefix <= value < prefix + _TOP`` is a prefix match an index can serve
_TOP = "\U0010ffff"


@dataclass(frozen=True, slots=True, kw_only=True)
class Filters:
    """What a person narrowed the list to; an empty field filters nothing."""

    states: tuple[State, ...] = ()
    provider: str | None = None
    caller: str | None = None
    key: str | None = None
    #: an operation id or key (by prefix), a caller or a remote job id (exactly)
    text: str | None = None


@dataclass(frozen=True, slots=True)
class Page:
    operations: list[Operation]
    #: the ``before`` of the next (older) page, or None on the last one
    next_before: str | None


def _where(filters: Filters) -> list[Any]:
    ops = t.operations.c
    out: list[Any] = []
    if filters.states:
        out.append(ops.state.in_([s.value for s in filters.states]))
    if filters.provider:
        out.append(ops.provider == filters.provider)
    if filters.caller:
        out.append(ops.caller == filters.caller)
    if filters.key:
        out.append(ops.operation_key == filters.key)
    if filters.text:
        q = filters.text
        out.append(
            sa.or_(
                sa.and_(ops.operation_id >= q, ops.operation_id < q + _TOP),
                sa.and_(ops.operation_key >= q, ops.operation_key < q + _TOP),
                ops.caller == q,
                ops.remote_job_id == q,
            )
        )
    return out


def list_page(store: Store, filters: Filters, *, before: str | None = None, limit: int = 50) -> Page:
    """One page of operations matching ``filters``, newest first, older than ``before`` (an operation id)."""
    limit = max(1, min(limit, MAX_PAGE))
    ops = t.operations
    where = _where(filters)
    if before:
        where.append(ops.c.operation_id < before)
    query = sa.select(ops).where(*where).order_by(ops.c.operation_id.desc()).limit(limit + 1)
    with store._read() as conn:
        rows = conn.execute(query).mappings().all()
    found = [_operation(row) for row in rows[:limit]]
    return Page(found, found[-1].operation_id if len(rows) > limit and found else None)


def count_matching(store: Store, filters: Filters) -> int:
    """How many operations match ``filters`` (all pages)."""
    query = sa.select(sa.func.count()).select_from(t.operations).where(*_where(filters))
    with store._read() as conn:
        return int(conn.execute(query).scalar_one())


def counts_by_state(store: Store) -> dict[State, int]:
    """How many operations are in each state (states with none are left out)."""
    ops = t.operations.c
    with store._read() as conn:
        rows = conn.execute(sa.select(ops.state, sa.func.count()).group_by(ops.state)).all()
    return {State(state): int(n) for state, n in rows}


def needs_person(store: Store, *, limit: int = 50) -> list[Operation]:
    """Operations waiting for a person: needs_attention first, then the escalated; longest waiting first."""
    ops = t.operations
    out: list[Operation] = []
    with store._read() as conn:
        for state in PERSON_STATES:
            if len(out) >= limit:
                break
            rows = conn.execute(
                sa.select(ops)
                .where(ops.c.state == state.value)
                .order_by(ops.c.updated_at_us, ops.c.operation_id)
                .limit(limit - len(out))
            ).mappings()
            out += [_operation(row) for row in rows]
    return out


def providers_in_use(store: Store) -> list[str]:
    """The provider names the ledger's operations use (for the list's filter)."""
    ops = t.operations.c
    with store._read() as conn:
        # the unique (provider, operation_key) index serves this without reading the table
        names = conn.execute(sa.select(ops.provider).distinct().order_by(ops.provider).limit(200)).scalars()
        return [str(name) for name in names]


def recent_workers(store: Store, *, limit: int = 100) -> list[dict[str, Any]]:
    """Workers by their heartbeats, most recently seen first (stopped ones too)."""
    workers = t.workers
    with store._read() as conn:
        rows = conn.execute(sa.select(workers).order_by(workers.c.seen_at_us.desc()).limit(limit)).mappings()
        return [{**row, "providers": [p for p in str(row["providers"]).split(",") if p]} for row in rows]


def observation_window(
    store: Store, operation_id: str, *, head: int = 50, tail: int = 300
) -> tuple[list[dict[str, Any]], int]:
    """The first ``head`` and the last ``tail`` observations of one operation, oldest first, and how many
    lie between them (left out): a job polled for a week has thousands, and a page needs the ends."""
    obs = t.observations
    mine = obs.c.operation_id == operation_id
    with store._read() as conn:
        total = int(conn.execute(sa.select(sa.func.count()).select_from(obs).where(mine)).scalar_one())
        if total <= head + tail:
            rows = conn.execute(sa.select(obs).where(mine).order_by(obs.c.observation_id)).mappings().all()
        else:
            first = conn.execute(sa.select(obs).where(mine).order_by(obs.c.observation_id).limit(head))
            last = conn.execute(sa.select(obs).where(mine).order_by(obs.c.observation_id.desc()).limit(tail))
            rows = [*first.mappings().all(), *reversed(last.mappings().all())]
    return [{**row, "raw": json.loads(row["raw"])} for row in rows], max(0, total - head - tail)


__all__: Sequence[str] = (
    "MAX_PAGE",
    "PERSON_STATES",
    "Filters",
    "Page",
    "count_matching",
    "counts_by_state",
    "list_page",
    "needs_person",
    "observation_window",
    "providers_in_use",
    "recent_workers",
)
