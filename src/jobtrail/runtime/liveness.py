"""Whether a worker serves an operation: what ``explain``, ``wait``, ``ops list`` and MCP say when none does.

Workers record a heartbeat (:meth:`Store.heartbeat`) when they start, every
:data:`HEARTBEAT_S` while they run, and when they stop. An operation whose next
automatic action is overdue while no worker serving its provider has been seen
recently is waiting for a worker that is not there: say so, and how to start one.
"""

from __future__ import annotations

from jobtrail.domain.canonical import rfc3339
from jobtrail.domain.record import Operation
from jobtrail.domain.states import AUTOMATIC_STATES
from jobtrail.ledger.store import Store

#: how often a running worker records that it runs
HEARTBEAT_S = 5.0
#: a worker not seen for this long is taken to be gone (longer than a heartbeat may wait for SQLite's lock)
GONE_AFTER_S = 45.0
#: an action this late (past its due time) is overdue: a live worker would have taken it
OVERDUE_AFTER_S = 10.0
_US = 1_000_000


def overdue(store: Store, op: Operation) -> bool:
    """Is ``op``'s next automatic action so late that a live worker would have taken it?"""
    due = op.next_action_at_us
    return op.state in AUTOMATIC_STATES and due is not None and store.clock() - due >= OVERDUE_AFTER_S * _US


def no_worker(store: Store, op: Operation) -> str | None:
    """Why nothing is happening to ``op``, when that is because no worker serves its provider; else None."""
    if not overdue(store, op):
        return None
    assert op.next_action_at_us is not None
    now = store.clock()
    workers = store.workers_for(op.provider)
    alive = [w for w in workers if w["stopped_at_us"] is None and now - w["seen_at_us"] < GONE_AFTER_S * _US]
    if alive:
        return None
    last = workers[0] if workers else None
    seen = (
        f"; the last one, {last['worker_id']}, was seen at {rfc3339(last['seen_at_us'])}"
        + (" (it stopped)" if last["stopped_at_us"] is not None else "")
        if last is not None
        else "; none has ever run on this ledger"
    )
    return (
        f"no worker is running for provider {op.provider}: its next step was due at "
        f"{rfc3339(op.next_action_at_us)}{seen}. Start one: {store.command} worker --provider <its provider file>"
    )
