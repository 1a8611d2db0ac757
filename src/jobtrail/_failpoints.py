"""Named failpoints: inert unless ``JOBTRAIL_FAILPOINTS`` switches one on.

``JOBTRAIL_FAILPOINTS="create.after_attempt=exit,create.after_response=raise"``
makes the named point kill the process (``os._exit(137)``, like ``kill -9``) or
raise :class:`FailpointHit`. Each name is listed in :data:`FAILPOINTS`.
"""

from __future__ import annotations

import os

FAILPOINTS = {
    "task.after_plan": "a task step's key is durable, its operation not yet submitted",
    "create.after_record": "the operation record is durable, nothing sent",
    "create.after_attempt": "the attempt is durable, the create not yet sent",
    "create.after_response": "the create response arrived, nothing of it stored",
    "create.after_observation": "the response is stored as an observation, the state not yet moved",
    "create.after_job_id": "the job id is stored, the first poll not yet scheduled by a worker",
    "collect.after_fetch": "the result is fetched, nothing of it stored",
}


class FailpointHit(Exception):
    """Raised by a failpoint switched to ``raise``."""


def failpoint(name: str) -> None:
    spec = os.environ.get("JOBTRAIL_FAILPOINTS")
    if not spec:
        return
    assert name in FAILPOINTS, name
    for item in spec.split(","):
        point, _, action = item.partition("=")
        if point.strip() == name:
            if action.strip() == "exit":
                os._exit(137)
            raise FailpointHit(name)
