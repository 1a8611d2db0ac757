"""Observable gauges read from the ledger: operations by state, the due backlog and its age.

The metrics SDK calls these at each collection, on its reader's thread (a periodic exporter's,
a Prometheus scrape's), never on the event loop, so a query there stalls no action. A worker
registers its ledger while it runs; several workers of one process on one ledger count it once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from opentelemetry.metrics import CallbackOptions, Observation

from jobtrail.domain.errors import JobtrailError
from jobtrail.domain.states import AUTOMATIC_STATES
from jobtrail.flows.telemetry import meter
from jobtrail.ledger.gauges import Backlog, due_backlog, operations_by_state
from jobtrail.ledger.store import Store

_lock = threading.Lock()
#: the ledgers being watched: store -> (how many holders, the providers they work, or None for all)
_watched: dict[Store, tuple[int, tuple[str, ...] | None]] = {}
#: the backlog query answers two gauges: kept for a moment so one collection runs it once
_backlogs: dict[Store, tuple[float, Backlog]] = {}
_BACKLOG_FRESH_S = 1.0


@contextmanager
def ledger_gauges(store: Store, providers: Sequence[str] | None = None) -> Iterator[None]:
    """Report ``store``'s gauges while inside (for ``providers``' operations, or all)."""
    scope = None if providers is None else tuple(sorted(providers))
    with _lock:
        holders, _ = _watched.get(store, (0, scope))
        _watched[store] = (holders + 1, scope)
    try:
        yield
    finally:
        with _lock:
            holders, scope = _watched[store]
            if holders > 1:
                _watched[store] = (holders - 1, scope)
            else:
                del _watched[store]
                _backlogs.pop(store, None)


def _stores() -> list[tuple[Store, tuple[str, ...] | None]]:
    with _lock:
        return [(store, scope) for store, (_, scope) in _watched.items()]


def _backlog(store: Store, scope: tuple[str, ...] | None) -> Backlog:
    now = time.monotonic()
    with _lock:
        kept = _backlogs.get(store)
    if kept is not None and now - kept[0] < _BACKLOG_FRESH_S:
        return kept[1]
    backlog = due_backlog(store, states=tuple(AUTOMATIC_STATES), providers=scope)
    with _lock:
        _backlogs[store] = (now, backlog)
    return backlog


def _by_state(options: CallbackOptions) -> Iterable[Observation]:
    for store, scope in _stores():
        try:
            counts = operations_by_state(store, providers=scope)
        except JobtrailError:  # the database is away: no value this time rather than a failed collection
            continue
        for (provider, state), n in counts.items():
            yield Observation(n, {"provider": provider, "state": state})


def _due(options: CallbackOptions) -> Iterable[Observation]:
    for store, scope in _stores():
        try:
            yield Observation(_backlog(store, scope).due)
        except JobtrailError:
            continue


def _age(options: CallbackOptions) -> Iterable[Observation]:
    for store, scope in _stores():
        try:
            yield Observation(_backlog(store, scope).oldest_wait_us / 1_000_000)
        except JobtrailError:
            continue


meter.create_observable_gauge(
    "jobtrail.operations", [_by_state], unit="{operation}", description="Operations by provider and state"
)
meter.create_observable_gauge(
    "jobtrail.due.backlog",
    [_due],
    unit="{operation}",
    description="Operations whose next action is due and that no live lease covers",
)
meter.create_observable_gauge(
    "jobtrail.due.age", [_age], unit="s", description="How long the longest-waiting due operation has been due"
)
