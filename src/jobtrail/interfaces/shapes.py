"""The JSON every interface answers, written down once.

``jobtrail ... --json`` and the MCP tools answer these shapes, built from the
``to_json()`` methods of the records: an operation is :class:`OperationJson`
wherever it appears, a list is ``{count, total, items}``, an error under
``--json`` is :class:`ErrorJson`. The MCP server publishes them as its tools'
output schemas (and validates every answer against them); the README's contract
table and the agent-story tests are generated from and checked against this
module, so the three cannot drift apart.

The classes are ``typing_extensions.TypedDict``: pydantic (which turns them into
the MCP output schemas) needs that class on Python 3.11.
"""

from __future__ import annotations

from typing import Any, Literal

from typing_extensions import TypedDict

from jobtrail.domain.states import State

#: what ``request_cancel`` did (``cancel --json``, MCP ``cancel_job``)
CancelOutcome = Literal["requested", "already_requested", "deferred", "withdrawn", "already_ended", "person_decides"]
#: how a requested cancel stands (``cancel`` in a status): see :func:`jobtrail.domain.explain.cancel_story`
CancelStanding = Literal[
    "deferred", "withdrawn", "pending", "confirmed", "lost_race", "after_the_end", "unconfirmed", "a_person_decides"
]
StepState = Literal["planned", "blocked", "submitted", "confirmed", "failed", "unresolved"]


class LeaseJson(TypedDict):
    owner: str | None
    expires_at: str | None
    epoch: int


class OperationJson(TypedDict):
    """One operation (``Operation.to_json()``): ``ops show``, ``ops list`` items, ``wait``, MCP lists."""

    operation_id: str
    provider: str
    target: str
    endpoint: str
    operation_key: str | None
    request_fingerprint: str
    trace_id: str
    remote_job_id: str | None
    state: State
    remote_state: str | None
    state_reason: str | None
    attempts: int
    create_deadline: str | None
    result_deadline: str | None
    cancel_deadline: str | None
    caller: str | None
    approved_by: str | None
    created_at: str | None
    updated_at: str | None
    next_action_at: str | None
    version: int
    lease: LeaseJson
    polls: int
    result_ref: str | None
    cancel_requested_by: str | None
    partial_effects: Any
    #: what a worker does next
    next_action: str
    #: what the caller (an agent, a script) should do now
    advice: str


class CancelJson(TypedDict):
    """Who asked to cancel, why, when, and how that cancel stands now."""

    requested_by: str
    reason: str
    requested_at: str | None
    standing: CancelStanding
    #: the whole story in one sentence
    says: str


class OperationShownJson(OperationJson):
    """``ops show --json``: the operation and its stored result's record (null before there is one)."""

    result: dict[str, Any] | None


class StatusJson(OperationJson):
    """``explain OP --json``, MCP ``job_status``: the operation, what the last status read saw, whether
    it waits for a worker that is not running, and the story of a cancel if one was asked for."""

    last_observed_at: str | None
    progress: float | None
    no_worker: str | None
    cancel: CancelJson | None


class WaitJson(StatusJson):
    """``wait --json``, MCP ``wait_for_change``: the status once waiting ended."""

    changed: bool
    settled: bool


class SubmitJson(OperationJson):
    """MCP ``submit_job``; ``submit --json`` prints it as its last line with ``event: create_finished``."""

    created: bool


class CancelAnswerJson(TypedDict):
    """``cancel --json``, MCP ``cancel_job``."""

    outcome: CancelOutcome
    message: str
    operation: OperationJson


class ResultJson(TypedDict):
    """``result --json``, MCP ``get_result``: the same keys whether or not there is a result.

    With a result: its record (``sha256`` ... ``stored``) and its content: ``result`` (JSON, parsed),
    or ``result_text`` (other text) or ``result_base64`` (other bytes); a result larger than 64 KiB
    is not inlined and ``note`` says how to fetch it. Without one: ``result`` is null, ``why`` says why.
    """

    operation_id: str
    why: str | None
    sha256: str | None
    size: int | None
    content_type: str | None
    checks: Any
    summary: Any
    redacted: Any
    stored: Literal["file", "database"] | None
    result: Any
    result_text: str | None
    result_base64: str | None
    note: str | None
    #: the file ``result --out`` wrote (null elsewhere)
    out: str | None


class OperationListJson(TypedDict):
    """``ops list --json``, MCP ``list_jobs`` and ``jobs_needing_a_person``."""

    count: int
    total: int
    items: list[OperationJson]


#: one history entry (``HistoryEntry.to_json()``); ``from`` is a Python keyword, hence this spelling
HistoryEntryJson = TypedDict(
    "HistoryEntryJson",
    {
        "operation_id": str,
        "seq": int,
        "at": str | None,
        "actor": str,
        "from": str | None,
        "to": str,
        "cause": str,
        "evidence": Any,
        "remote_job_id": str | None,
        "trace_id": str | None,
        "provider_request_ids": Any,
        "request_fingerprint": str | None,
        "prev_hash": str | None,
        "hash": str,
    },
)


class HistoryListJson(TypedDict):
    """``ops history --json``: every entry, oldest first."""

    count: int
    total: int
    items: list[HistoryEntryJson]


class StepJson(TypedDict):
    task_id: str
    name: str
    key: str
    provider: str
    state: StepState
    operation_id: str | None
    receipt: dict[str, Any] | None
    #: the step's operation state, null before it has one
    operation_state: State | None
    next_action: str


class TaskExplainJson(TypedDict):
    """``explain TASK_ID --json``."""

    task_id: str
    next_step: str | None
    next_action: str
    #: steps whose operation a worker still carries forward (confirmed or not)
    running: list[str]
    steps: list[StepJson]
    #: why nothing happens to a step's overdue operation, where no worker serves its provider (one line each)
    no_worker: list[str]


class ProviderJson(TypedDict):
    """MCP ``list_providers`` items: what to pass as ``provider`` and what ``request`` it takes."""

    name: str
    kind: str
    target: str
    create_endpoint: str
    request: str
    url_fields: list[str]
    cancel: bool
    result: str


class ProviderListJson(TypedDict):
    count: int
    total: int
    items: list[ProviderJson]


class ErrorBodyJson(TypedDict):
    message: str
    exit_code: int


class ErrorJson(TypedDict):
    """Every command's answer under ``--json`` when it fails (stdout; the one line goes to stderr too)."""

    error: ErrorBodyJson


#: every command's ``--json`` answer, by command (MCP tools in :data:`TOOL_SHAPES`)
COMMAND_SHAPES: dict[str, type] = {
    "resolve --json": OperationJson,
    "ops show --json": OperationShownJson,
    "ops list --json": OperationListJson,
    "ops history --json": HistoryListJson,
    "explain OP --json": StatusJson,
    "explain TASK --json": TaskExplainJson,
    "wait --json": WaitJson,
    "submit --json (its last line, with event)": SubmitJson,
    "cancel --json": CancelAnswerJson,
    "result --json": ResultJson,
    "every command, failing under --json": ErrorJson,
}

#: every MCP tool's structured answer
TOOL_SHAPES: dict[str, type] = {
    "submit_job": SubmitJson,
    "job_status": StatusJson,
    "list_jobs": OperationListJson,
    "wait_for_change": WaitJson,
    "cancel_job": CancelAnswerJson,
    "get_result": ResultJson,
    "jobs_needing_a_person": OperationListJson,
    "list_providers": ProviderListJson,
}
