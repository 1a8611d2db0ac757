"""The worker's progress on a terminal (operations by state, actions per second) and its summary at exit.

On a terminal, a live table redrawn twice a second and a summary table at exit; elsewhere (a log
file, a service manager's journal) one plain summary line at exit and nothing while it runs, or,
under ``--log-format json``, one JSON log line at info.
The ledger counts are read off the event loop, like every other query of the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from jobtrail.domain.errors import JobtrailError
from jobtrail.domain.states import State
from jobtrail.interfaces.logs import json_lines, say
from jobtrail.ledger.gauges import operations_by_state

if TYPE_CHECKING:
    from jobtrail.runtime.worker import Worker, WorkerStats

_REFRESH_S = 0.5
#: the order states are shown in: the life cycle's
_ORDER = {state.value: n for n, state in enumerate(State)}


class WorkerProgress:
    """Watches one worker: :meth:`watch` while it runs, :meth:`summary` after."""

    def __init__(self, runner: Worker, console: Console) -> None:
        self.runner = runner
        self.console = console
        self.started = time.monotonic()
        self._rate = 0.0
        self._counts: dict[str, int] = {}

    @property
    def live(self) -> bool:
        """Drawn on a terminal (else only the summary line)."""
        return self.console.is_terminal

    async def watch(self) -> None:
        """Redraw until cancelled (on a terminal; elsewhere it returns at once)."""
        if not self.live:
            return
        from rich.live import Live

        last_actions, last_at = self.runner.stats.actions, time.monotonic()
        await self._count()
        with (
            Live(self._table(), console=self.console, transient=True, redirect_stderr=True) as live,
            contextlib.suppress(asyncio.CancelledError),
        ):
            while True:
                await asyncio.sleep(_REFRESH_S)
                now, actions = time.monotonic(), self.runner.stats.actions
                self._rate = (actions - last_actions) / max(now - last_at, 1e-6)
                last_actions, last_at = actions, now
                await self._count()
                live.update(self._table())

    async def _count(self) -> None:
        runner = self.runner
        try:
            counts = await runner.io(operations_by_state, runner.store, providers=tuple(runner.providers))
        except JobtrailError:  # the worker says what went wrong; the display keeps its last counts
            return
        self._counts = _by_state(counts)

    def _table(self, *, title: str = "jobtrail worker") -> Group:
        stats = self.runner.stats
        elapsed = time.monotonic() - self.started
        table = Table(box=box.SIMPLE_HEAD)
        table.add_column("state")
        table.add_column("operations", justify="right")
        for state, n in sorted(self._counts.items(), key=lambda item: _ORDER.get(item[0], 99)):
            table.add_row(state, str(n))
        rate = self._rate if self._rate else stats.actions / max(elapsed, 1e-6)
        return Group(
            Text(f"{title} {self.runner.worker_id}", style="bold"),
            table,
            Text(
                f"{stats.actions} actions, {rate:.1f}/s; {stats.errors} errors, {stats.stale} dropped; {elapsed:.0f} s"
            ),
        )

    def summary(self, stats: WorkerStats) -> None:
        """At exit: a table on a terminal, one line elsewhere (stderr either way)."""
        runner = self.runner
        with contextlib.suppress(JobtrailError):  # the database is away: the last counts shown
            self._counts = _by_state(operations_by_state(runner.store, providers=tuple(runner.providers)))
        if self.live:
            self._rate = 0.0
            self.console.print(self._table(title="jobtrail worker finished:"))
            return
        elapsed = time.monotonic() - self.started
        counts = dict(sorted(self._counts.items(), key=lambda item: _ORDER.get(item[0], 99)))
        states = ", ".join(f"{state} {n}" for state, n in counts.items())
        line = (
            f"jobtrail worker {runner.worker_id}: {stats.actions} actions in {elapsed:.1f} s "
            f"({stats.actions / max(elapsed, 1e-6):.1f}/s), {stats.errors} errors, {stats.stale} dropped; "
            f"operations: {states or 'none'}"
        )
        if json_lines():  # a log read as JSON lines holds nothing else: the summary is one of them, at info
            fields = {"worker": runner.worker_id, "actions": stats.actions, "elapsed_s": round(elapsed, 3)}
            fields |= {"errors": stats.errors, "dropped": stats.stale, "operations": counts}
            say(line, logging.INFO, fields)
            return
        self.console.print(line, soft_wrap=True, highlight=False, markup=False)


def _by_state(counts: Mapping[tuple[str, str], int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for (_provider, state), n in counts.items():
        out[state] = out.get(state, 0) + n
    return out
