"""One operation's life on one time axis: history entries, create attempts and their answers,
status reads, webhooks and cancels, with the three deadlines and "now" drawn on the same axis.

Everything here is shaped for the template; nothing is trusted: the template escapes it all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jobtrail.domain.canonical import rfc3339
from jobtrail.domain.record import HistoryEntry, Operation

#: past this many events the middle is left out (the page reads at most 350 observations, see
#: ledger.browse.observation_window; this cuts a history that is itself very long)
MAX_EVENTS = 500
_KEEP_HEAD = 50

#: what an observation's kind means to a person reading the timeline
_OBSERVATION = {
    "create_response": "answer to a create attempt",
    "status_poll": "status read",
    "webhook": "webhook",
    "cancel_response": "answer to the cancel",
    "result_fetch": "result fetched",
    "result_fetch_not_sent": "result fetch not sent (no connection)",
    "synchronous_result": "result in the create answer",
    "reconcile": "reconciliation answer",
}


@dataclass(frozen=True, slots=True)
class Event:
    at_us: int
    #: history | attempt | observation | webhook | gap (events left out)
    kind: str
    title: str
    detail: str
    actor: str
    #: where on the axis, 0..100 (per cent of the drawn span)
    x: float = 0.0
    seq: int | None = None


@dataclass(frozen=True, slots=True)
class Mark:
    """A deadline or "now": a vertical line on the axis."""

    name: str
    at_us: int
    passed: bool
    x: float = 0.0
    #: so far past everything else that it is drawn at the axis's right edge, not to scale
    beyond: bool = False


@dataclass(frozen=True, slots=True)
class Timeline:
    events: list[Event]
    marks: list[Mark]
    start_us: int
    end_us: int
    omitted: int


def _history_event(entry: HistoryEntry) -> Event:
    moved = entry.from_state != entry.to_state
    evidence = json.loads(entry.evidence)
    detail = ", ".join(f"{k}={v}" for k, v in evidence.items() if k != "kind" and v not in (None, "", [], {}))
    if entry.cause == "create_attempt":
        kind = "attempt"
        title = f"create attempt {evidence.get('attempt', '')}".strip()
    else:
        kind = "history"
        title = f"{entry.from_state or 'new'} → {entry.to_state}" if moved else entry.cause
        if moved:
            detail = f"{entry.cause}" + (f": {detail}" if detail else "")
    return Event(entry.at_us, kind, title, detail, entry.actor, seq=entry.seq)


def _observation_event(obs: dict[str, Any]) -> Event:
    kind = str(obs["kind"])
    parts = [
        f"HTTP {obs['http_status']}" if obs.get("http_status") is not None else "",
        f"remote state {obs['remote_state']}" if obs.get("remote_state") else "",
        f"({obs['raw_state']})" if obs.get("raw_state") and obs.get("raw_state") != obs.get("remote_state") else "",
        # (a provider's figure, clamped: "progress inf%" tells no one anything)
        f"progress {min(max(obs['progress'], 0.0), 1.0):.0%}" if isinstance(obs.get("progress"), float) else "",
        f"request id {obs['provider_request_id']}" if obs.get("provider_request_id") else "",
    ]
    raw = obs.get("raw")
    if kind == "create_response" and isinstance(raw, dict) and "attempt" in raw:
        title = f"answer to create attempt {raw['attempt']}"
    else:
        title = _OBSERVATION.get(kind, kind.replace("_", " "))
    return Event(
        int(obs["fetched_at_us"]),
        "webhook" if kind == "webhook" else "observation",
        title,
        " ".join(p for p in parts if p),
        str(obs.get("worker") or ""),
    )


def build(
    op: Operation,
    history: list[HistoryEntry],
    observations: list[dict[str, Any]],
    now_us: int,
    *,
    left_out: int = 0,
) -> Timeline:
    """The timeline of ``op``, oldest first (history in its own order where times tie); ``left_out``
    observations were not read (the middle of a long life)."""
    seen = [_observation_event(o) for o in observations]
    events = [_history_event(e) for e in history] + seen
    # a stable sort: history entries keep their sequence, observations their ids, at equal times
    events.sort(key=lambda e: e.at_us)
    # where the timeline skips events, as (index of the last event before the gap, how many it skips)
    gaps: list[tuple[int, int]] = []
    if left_out and len(seen) >= _KEEP_HEAD:
        last_read = seen[_KEEP_HEAD - 1]
        gaps.append((next(i for i, e in enumerate(events) if e is last_read), left_out))
    if len(events) > MAX_EVENTS:
        cut = len(events) - MAX_EVENTS
        # a window's gap past the head is counted with the cut (said once, where the cut is)
        later = sum(n for i, n in gaps if i >= _KEEP_HEAD)
        gaps = [(i, n) for i, n in gaps if i < _KEEP_HEAD] + [(_KEEP_HEAD - 1, cut + later)]
        events = events[:_KEEP_HEAD] + events[-(MAX_EVENTS - _KEEP_HEAD) :]
    omitted = sum(n for _, n in gaps)
    for i, n in sorted(gaps, reverse=True):
        events.insert(i + 1, Event(events[i].at_us, "gap", f"… {n} events left out …", "", ""))
    marks = [
        Mark(f"{name} deadline", at, at <= now_us)
        for name, at in (
            ("create", op.create_deadline_us),
            ("result", op.result_deadline_us),
            ("cancel", op.cancel_deadline_us),
        )
        if at is not None
    ]
    marks.append(Mark("now", now_us, True))
    lived = [e.at_us for e in events] + [now_us, op.created_at_us]
    start = min(lived + [m.at_us for m in marks])
    # a deadline far past everything that happened (a day-long result deadline on a job that took
    # seconds) would squeeze the whole life into one pixel: past twice the life so far, it sits at the edge
    horizon = max(lived) + max(max(lived) - start, 1)
    end = max([*lived, *(m.at_us for m in marks if m.at_us <= horizon)])
    span = max(end - start, 1)

    def x(at: int) -> float:
        return round(2 + 96 * min(at - start, span) / span, 2)  # 2 % margins keep the end marks visible

    return Timeline(
        events=[Event(e.at_us, e.kind, e.title, e.detail, e.actor, x(e.at_us), e.seq) for e in events],
        marks=[
            Mark(m.name, m.at_us, m.passed, x(m.at_us), m.at_us > end) for m in sorted(marks, key=lambda m: m.at_us)
        ],
        start_us=start,
        end_us=end,
        omitted=omitted,
    )


def when(at_us: int | None) -> str:
    """An instant as people read it: RFC 3339 to the second, in UTC."""
    text = rfc3339(at_us)
    return "-" if text is None else text[:19].replace("T", " ") + "Z"
