"""Local operation states and normalised remote states."""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    """Where an operation stands, locally. Each state has exactly one next action."""

    #: Record durable; create not yet sent (attempts == 0) or maybe sent (attempts > 0).
    CREATE_PENDING = "create_pending"
    #: A create may have reached the provider; its outcome is not known.
    CREATE_UNKNOWN = "create_unknown"
    #: Asking the provider, by its reconciliation path, whether the job exists.
    RECONCILIATION = "reconciliation"
    #: The provider confirmed the job and gave us its id.
    ACCEPTED = "accepted"
    #: Polling the remote job until it ends.
    OBSERVING = "observing"
    #: The job finished; its result is being fetched and validated.
    RESULT_COLLECTING = "result_collecting"
    #: A validated result is stored.
    SUCCEEDED = "succeeded"
    #: The provider rejected the request or reported the job failed.
    FAILED = "failed"
    #: A person asked to stop; the intent is durable, nothing sent yet.
    CANCEL_REQUESTED = "cancel_requested"
    #: The provider acknowledged the cancel; waiting for it to take effect.
    CANCELLING = "cancelling"
    #: The provider reported the job cancelled.
    CANCELLED = "cancelled"
    #: The cancel deadline passed without the provider confirming the cancel.
    CANCELLATION_UNCONFIRMED = "cancellation_unconfirmed"
    #: The result deadline passed; the remote job is NOT assumed stopped.
    RESULT_TIMED_OUT = "result_timed_out"
    #: The job finished but its result could not be fetched.
    RESULT_UNAVAILABLE = "result_unavailable"
    #: The result was fetched but failed validation.
    RESULT_VALIDATION_FAILED = "result_validation_failed"
    #: Automatic activity stopped; a person must decide (``resolve``).
    NEEDS_ATTENTION = "needs_attention"


#: States in which nothing more will happen without a person or a new observation.
FINAL_STATES = frozenset(
    {
        State.SUCCEEDED,
        State.FAILED,
        State.CANCELLED,
        State.RESULT_UNAVAILABLE,
        State.RESULT_VALIDATION_FAILED,
    }
)


#: States whose next action a worker takes without a person; the rest wait (next_action_at is null).
AUTOMATIC_STATES = frozenset(
    {
        State.CREATE_PENDING,
        State.CREATE_UNKNOWN,
        State.RECONCILIATION,
        State.ACCEPTED,
        State.OBSERVING,
        State.RESULT_COLLECTING,
        State.CANCEL_REQUESTED,
        State.CANCELLING,
        # a person is told, and the worker keeps looking at a slow pace: a later observation settles it
        State.CANCELLATION_UNCONFIRMED,
        State.RESULT_TIMED_OUT,
    }
)


#: the create phase: a create is to be sent, or its outcome settled, before anything else happens
CREATE_PHASE = frozenset({State.CREATE_PENDING, State.CREATE_UNKNOWN, State.RECONCILIATION})
#: Automatic states a person has already been told about: polled slowly, but nothing automatic is
#: expected to end them soon, so they count as settled for ``worker --until-settled`` and for waiting callers.
ESCALATED_STATES = frozenset({State.CANCELLATION_UNCONFIRMED, State.RESULT_TIMED_OUT})
#: Ended, waiting for a person, or escalated: what a caller waiting for an operation waits for.
SETTLED_STATES = FINAL_STATES | {State.NEEDS_ATTENTION} | ESCALATED_STATES


class RemoteState(StrEnum):
    """A provider's job state, normalised. Unknown raw states are kept raw elsewhere."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    #: The provider said something we cannot map; never terminal.
    UNKNOWN = "unknown"


TERMINAL_REMOTE_STATES = frozenset(
    {RemoteState.SUCCEEDED, RemoteState.FAILED, RemoteState.CANCELLED, RemoteState.EXPIRED}
)
#: the remote states a job ends in without a result: an answer in one of these may say why
ENDED_WITHOUT_RESULT = TERMINAL_REMOTE_STATES - {RemoteState.SUCCEEDED}
