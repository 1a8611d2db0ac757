"""Agent tasks: several steps with side effects, each safe across a restart.

A step's key is durable before its effect (``planned``); its effect is a
jobtrail operation created under that key, so every attempt carries the same
idempotency token and a doubtful one is reconciled before anything is re-sent
(``submitted``); the receipt is the operation's confirmed job id or ending
(``confirmed``); a step whose outcome cannot be established is ``unresolved``,
says why, and is never repeated automatically. The checkpoint holds ids, keys
and references only: step states are read from the operations, never copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobtrail.domain.canonical import request_fingerprint
from jobtrail.domain.errors import OperationKeyConflict, UsageError
from jobtrail.domain.explain import next_action
from jobtrail.domain.failpoints import failpoint
from jobtrail.domain.record import Operation
from jobtrail.domain.states import State
from jobtrail.ledger import task_steps

if TYPE_CHECKING:
    from jobtrail.runtime.client import AsyncJobtrail

#: step states, in the order a step moves through them
PLANNED, SUBMITTED, CONFIRMED, UNRESOLVED = "planned", "submitted", "confirmed", "unresolved"
_UNCERTAIN = {State.CREATE_PENDING, State.CREATE_UNKNOWN, State.RECONCILIATION}


@dataclass(frozen=True, slots=True)
class StepView:
    """One step as it stands now."""

    task_id: str
    name: str
    key: str
    provider: str
    state: str
    operation_id: str | None
    #: the confirmation: remote job id, result reference and how the operation ended, or why not
    receipt: dict[str, Any] | None
    next_action: str

    def to_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "name": self.name,
            "key": self.key,
            "provider": self.provider,
            "state": self.state,
            "operation_id": self.operation_id,
            "receipt": self.receipt,
            "next_action": self.next_action,
        }


def step_state(op: Operation | None) -> str:
    """planned / submitted / confirmed / unresolved, from the step's operation alone."""
    if op is None or (op.state is State.CREATE_PENDING and op.attempts == 0):
        return PLANNED
    if op.state is State.NEEDS_ATTENTION and op.remote_job_id is None:
        return UNRESOLVED
    if op.state in _UNCERTAIN:
        return SUBMITTED
    return CONFIRMED


def _view(task_id: str, row: Any, op: Operation | None) -> StepView:
    state = step_state(op)
    receipt = None
    if state == CONFIRMED and op is not None:
        receipt = {"remote_job_id": op.remote_job_id, "result_ref": op.result_ref, "operation_state": op.state.value}
    elif state == UNRESOLVED and op is not None:
        receipt = {"why": op.state_reason}
    if op is None:
        action = "submit the step's operation under its key"
    elif state == UNRESOLVED:
        action = "a person decides (jobtrail resolve); the step is never repeated automatically"
    elif state == SUBMITTED:
        action = next_action(op)
        if not action.startswith("reconcile"):
            action = f"reconcile before any retry: {action}"
    else:
        action = next_action(op)
    return StepView(task_id, row.name, row.operation_key, row.provider, state, row.operation_id, receipt, action)


class Task:
    """A task of an agent. Get one with :meth:`AsyncJobtrail.task` (it opens or resumes by id)."""

    def __init__(self, client: AsyncJobtrail, task_id: str) -> None:
        self.client = client
        self.store = client.store
        self.task_id = task_id

    async def step(self, name: str, *, provider: str, request: Any, key: str | None = None) -> StepView:
        """Declare a step (idempotent): its key is durable before anything is sent."""
        key = key or f"{self.task_id}/{name}"
        adapter = self.client.provider(provider)
        fingerprint = request_fingerprint(provider, adapter.target, adapter.create_endpoint, request)
        await self.client.io(self._plan, name, provider, key, fingerprint)
        return (await self.client.io(self._views, name))[0]

    def _plan(self, name: str, provider: str, key: str, fingerprint: str) -> None:
        task_steps.plan_step(self.store, self.task_id, name, provider, key, fingerprint)

    async def run(self, name: str, request: Any, **options: Any) -> StepView:
        """Carry out a planned step (or resume it after a restart): submit under its key, drive the create."""
        row = await self.client.io(self._row, name)
        failpoint("task.after_plan")
        operation_id = row.operation_id
        if operation_id is None:
            op = await self.client.submit(row.provider, request, key=row.operation_key, **options)
            if op.request_fingerprint != row.request_fingerprint:
                raise OperationKeyConflict(
                    f"step {name!r}: the request differs from the planned one", operation_key=row.operation_key
                )
            await self.client.io(self._link, name, op.operation_id)
            operation_id = op.operation_id
        await self.client.drive_create(operation_id)
        return (await self.client.io(self._views, name))[0]

    def _link(self, name: str, operation_id: str) -> None:
        task_steps.link_step(self.store, self.task_id, name, operation_id)

    def steps(self) -> list[StepView]:
        """Every step, in order, as it stands now (after a restart too)."""
        return self._views(None)

    def next_step(self) -> StepView | None:
        return next((s for s in self.steps() if s.state != CONFIRMED), None)

    def explain(self) -> dict[str, Any]:
        steps = self.steps()
        upcoming = next((s for s in steps if s.state != CONFIRMED), None)
        return {
            "task_id": self.task_id,
            "next_step": None if upcoming is None else upcoming.name,
            "next_action": "nothing: every step is confirmed" if upcoming is None else upcoming.next_action,
            "steps": [s.to_json() for s in steps],
        }

    def _row(self, name: str) -> Any:
        rows = task_steps.step_rows(self.store, self.task_id, name)
        if not rows:
            raise UsageError(f"task {self.task_id} has no step {name!r}; declare it with task.step() first")
        return rows[0]

    def _views(self, name: str | None) -> list[StepView]:
        return [
            _view(
                self.task_id,
                row,
                self.store.get(row.operation_id)
                if row.operation_id
                else self.store.find_by_key(row.provider, row.operation_key),
            )
            for row in task_steps.step_rows(self.store, self.task_id, name)
        ]


def open_task(client: AsyncJobtrail, task_id: str, caller: str) -> Task:
    task_steps.open_task(client.store, task_id, caller)
    return Task(client, task_id)
