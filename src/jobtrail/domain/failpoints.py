"""Named failpoints: inert unless ``JOBTRAIL_FAILPOINTS`` (or a simulation) switches one on.

``JOBTRAIL_FAILPOINTS="create.after_attempt=exit,create.after_response=raise"``
makes the named point kill the process (``os._exit(137)``, like ``kill -9``) or
raise :class:`FailpointHit`. Each name is listed in :data:`FAILPOINTS`.

The deterministic simulation installs a handler instead (:func:`failpoint_handler`):
it is called with the point's name at every point reached and may raise to
"crash" the simulated worker there. The handler is a context variable, so it
reaches only the code that simulation runs, not the rest of the process.

Leases are never renewed during an action (an action that outlives its lease
has its writes refused), so there is no lease-renewal point: the simulation
expires leases by moving its clock instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

FAILPOINTS = {
    "task.after_plan": "a task step's key is durable, its operation not yet submitted",
    "create.after_record": "the operation record is durable, nothing sent",
    "create.after_attempt": "the attempt is durable, the create not yet sent",
    "create.after_response": "the create response arrived, nothing of it stored",
    "create.after_observation": "the response is stored as an observation, the state not yet moved",
    "create.after_job_id": "the job id is stored, the first poll not yet scheduled by a worker",
    "observe.after_status": "a status answer arrived, nothing of it stored",
    "cancel.after_intent": "the cancel intent is durable, nothing sent",
    "cancel.after_attempt": "the cancel attempt is durable, the cancel not yet sent",
    "cancel.after_response": "the cancel answer arrived, nothing of it stored",
    "collect.after_fetch": "the result is fetched, nothing of it stored",
}

_handler: ContextVar[Callable[[str], None] | None] = ContextVar("jobtrail_failpoint_handler", default=None)


class FailpointHit(Exception):
    """Raised by a failpoint switched to ``raise``."""


@contextmanager
def failpoint_handler(handler: Callable[[str], None]) -> Iterator[None]:
    """Within this block (and the tasks and threads it starts), call ``handler(name)`` at every failpoint
    reached instead of reading ``JOBTRAIL_FAILPOINTS``."""
    reset = _handler.set(handler)
    try:
        yield
    finally:
        _handler.reset(reset)


def failpoint(name: str) -> None:
    assert name in FAILPOINTS, name
    handler = _handler.get()
    if handler is not None:
        handler(name)
        return
    spec = os.environ.get("JOBTRAIL_FAILPOINTS")
    if not spec:
        return
    for item in spec.split(","):
        point, _, action = item.partition("=")
        if point.strip() == name:
            if action.strip() == "exit":
                os._exit(137)
            raise FailpointHit(name)
