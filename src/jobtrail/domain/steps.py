"""What a worker does next to an operation, as data: one step per state, decided once.

The worker dispatches on it and :mod:`.explain` puts it into words, so the two
cannot disagree.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

from jobtrail.domain.states import AUTOMATIC_STATES, CREATE_PHASE, State

if TYPE_CHECKING:
    from jobtrail.domain.record import Operation


class Step(StrEnum):
    #: send the create, settle an attempt whose outcome was not recorded, or reconcile a doubtful one
    CREATE = "create"
    #: send the recorded cancel, once
    SEND_CANCEL = "send_cancel"
    #: read the remote job's status (slowly, in an escalated state: a person has been told)
    POLL = "poll"
    #: fetch, check and store the result
    COLLECT = "collect"
    #: nothing automatic: a person decides
    PERSON = "person"
    #: nothing: the operation has ended
    NONE = "none"


def next_step(op: Operation) -> Step:
    """The kind of action a worker takes next on ``op``."""
    if op.state in CREATE_PHASE:
        return Step.CREATE
    if op.state is State.RESULT_COLLECTING:
        return Step.COLLECT
    if op.state is State.CANCEL_REQUESTED and not op.cancel_sent:
        return Step.SEND_CANCEL
    if op.state in AUTOMATIC_STATES:
        return Step.POLL
    return Step.PERSON if op.state is State.NEEDS_ATTENTION else Step.NONE
