"""Agent tasks: several steps with side effects, each safe across a restart.

A step's key is durable before its effect (``planned``); its effect is a
jobtrail operation created under that key, so every attempt carries the same
idempotency token and a doubtful one is reconciled before anything is re-sent
(``submitted``); the receipt is the operation's confirmed job id or ending
(``confirmed``); a step whose operation ended without any job being made (the
provider rejected the create) is ``failed``; a step whose outcome cannot be
established is ``unresolved``. The last two say why and are never repeated
automatically. The checkpoint holds ids, keys and references only: step states
are read from the operations, never copied.

A step sends only the request it was planned with, under its own key, as the
task's caller; an operation its key names is the step's only if it is its own
(same request, same caller, no other step's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobtrail.domain.canonical import request_fingerprint
from jobtrail.domain.errors import OperationKeyConflict, UsageError
from jobtrail.domain.explain import next_action
from jobtrail.domain.failpoints import failpoint
from jobtrail.domain.record import Operation, check_name, check_operation_key
from jobtrail.domain.states import SETTLED_STATES, State
from jobtrail.ledger import task_steps
from jobtrail.runtime.liveness import no_worker

if TYPE_CHECKING:
    from jobtrail.runtime.client import AsyncJobtrail

#: step states, in the order a step moves through them; a step ends confirmed, failed or unresolved (or is
#: blocked, see BLOCKED, before it starts)
PLANNED, SUBMITTED, CONFIRMED, UNRESOLVED = "planned", "submitted", "confirmed", "unresolved"
#: the step's operation ended and no job was ever made (a rejected create, or a person's decision)
FAILED = "failed"
#: the step's key names an operation that is not the step's own: run() refuses it, now and always
BLOCKED = "blocked"
_UNCERTAIN = {State.CREATE_PENDING, State.CREATE_UNKNOWN, State.RECONCILIATION}
#: endings that, without a job id or a result, say the step's effect never happened
_ENDED_WITHOUT_EFFECT = {State.FAILED, State.CANCELLED}
#: what run() takes from the task and the step, never from its options
_FIXED_OPTIONS = {
    "key": "the step's key is fixed when it is planned: pass it to task.step(..., key=...)",
    "caller": "a task's steps act as its caller: pass it to jt.task(..., caller=...)",
}


def step_key(task_id: str, name: str) -> str:
    """The default key of a step: the task's id and the step's name, each with ``%`` and ``/`` escaped.

    Unescaped, task ``a``'s step ``b/c`` and task ``a/b``'s step ``c`` had one key, and so one operation.
    """
    return f"{_escape(task_id)}/{_escape(name)}"


def _escape(text: str) -> str:
    return text.replace("%", "%25").replace("/", "%2F")


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
    #: the step's operation's state (None before it has an operation)
    operation_state: State | None = None

    @property
    def running(self) -> bool:
        """A worker still carries the step's operation forward (its job runs, a cancel or a collect is due)."""
        return self.operation_state is not None and self.operation_state not in SETTLED_STATES

    def to_json(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "name": self.name,
            "key": self.key,
            "provider": self.provider,
            "state": self.state,
            "operation_id": self.operation_id,
            "receipt": self.receipt,
            "operation_state": None if self.operation_state is None else self.operation_state.value,
            "next_action": self.next_action,
        }


def step_state(op: Operation | None) -> str:
    """planned / submitted / confirmed / failed / unresolved, from the step's operation alone."""
    if op is None or (op.state is State.CREATE_PENDING and op.attempts == 0):
        return PLANNED
    if op.state is State.NEEDS_ATTENTION and op.remote_job_id is None:
        return UNRESOLVED
    if op.state in _UNCERTAIN:
        return SUBMITTED
    # an ending with no job id and no result is no receipt: nothing was done (a 400 is not a confirmation)
    if op.state in _ENDED_WITHOUT_EFFECT and op.remote_job_id is None and op.result_ref is None:
        return FAILED
    return CONFIRMED


def _view(task_id: str, row: Any, op: Operation | None) -> StepView:
    state = step_state(op)
    receipt = None
    if state == CONFIRMED and op is not None:
        receipt = {"remote_job_id": op.remote_job_id, "result_ref": op.result_ref, "operation_state": op.state.value}
    elif state == UNRESOLVED and op is not None:
        receipt = {"why": op.state_reason}
    elif state == FAILED and op is not None:
        receipt = {"why": op.state_reason, "operation_state": op.state.value}
    if op is None:
        action = "submit the step's operation under its key"
    elif state == UNRESOLVED:
        action = "a person decides (jobtrail resolve); the step is never repeated automatically"
    elif state == FAILED:
        action = (
            f"stop: the step's operation ended {op.state.value} and no job was made (the receipt says why); "
            "it is never sent again: plan the corrected request as a new step under a new name"
        )
    elif state == SUBMITTED:
        action = next_action(op)
        if not action.startswith("reconcile"):
            action = f"reconcile before any retry: {action}"
    else:
        action = next_action(op)
    return StepView(
        task_id,
        row.name,
        row.operation_key,
        row.provider,
        state,
        row.operation_id,
        receipt,
        action,
        None if op is None else op.state,
    )


class Task:
    """A task of an agent. Get one with :meth:`AsyncJobtrail.task` (it opens or resumes by id)."""

    def __init__(self, client: AsyncJobtrail, task_id: str) -> None:
        self.client = client
        self.store = client.store
        self.task_id = task_id

    async def step(self, name: str, *, provider: str, request: Any, key: str | None = None) -> StepView:
        """Declare a step (idempotent): its key is durable before anything is sent."""
        # a step planned before default keys were escaped keeps the key it was planned (and maybe sent) under
        planned_as = None if key else f"{self.task_id}/{name}"
        key = key or step_key(self.task_id, name)
        check_operation_key(key)  # before the step is planned: a key no submit can take would hold it for good
        adapter = self.client.provider(provider)
        fingerprint = request_fingerprint(provider, adapter.target, adapter.create_endpoint, request)
        await self.client.io(self._plan, name, provider, key, fingerprint, planned_as)
        return (await self.client.io(self._views, name))[0]

    def _plan(self, name: str, provider: str, key: str, fingerprint: str, planned_as: str | None) -> None:
        task_steps.plan_step(self.store, self.task_id, name, provider, key, fingerprint, planned_as=planned_as)

    async def run(self, name: str, request: Any, **options: Any) -> StepView:
        """Carry out a planned step (or resume it after a restart): submit under its key, drive the create.

        ``request`` must be the one the step was planned with: another is refused before anything is
        recorded. Options as for :meth:`AsyncJobtrail.submit`, except ``key`` and ``caller`` (the step's
        and the task's).
        """
        for option, why in _FIXED_OPTIONS.items():
            if option in options:
                raise UsageError(f"task.run() takes no {option}=: {why}")
        row = await self.client.io(self._row, name)
        adapter = self.client.provider(row.provider)
        # compared before anything is recorded: once recorded under the step's key, another request would be
        # sent by any worker, and the planned one could never run under that key again
        target = options.get("target") or adapter.target
        if request_fingerprint(row.provider, target, adapter.create_endpoint, request) != row.request_fingerprint:
            raise OperationKeyConflict(
                f"step {name!r} of task {self.task_id} was planned with another request; nothing was recorded or "
                "sent: run it with the request it was planned with, or plan the changed request as a new step "
                "under a new name",
                operation_key=row.operation_key,
            )
        failpoint("task.after_plan")
        operation_id = row.operation_id
        if operation_id is None:
            caller = await self.client.io(self._caller)
            op, new = await self.client.ensure(row.provider, request, key=row.operation_key, caller=caller, **options)
            if not new and not await self.client.io(self._own, row, op, caller):
                raise OperationKeyConflict(
                    f"operation key {row.operation_key!r} already names {op.operation_id} (caller {op.caller}), which "
                    f"is not this step's; nothing was recorded or sent for step {name!r}: plan it under a new name "
                    "with a key of its own",
                    operation_key=row.operation_key,
                )
            await self.client.io(self._link, name, op.operation_id)
            operation_id = op.operation_id
        await self.client.drive_create(operation_id)
        return (await self.client.io(self._views, name))[0]

    def _caller(self) -> str:
        """The task's caller, as the ledger has it: a task resumed without naming one stays its first caller's."""
        caller = task_steps.task_caller(self.store, self.task_id)
        if caller is None:
            raise UsageError(f"there is no task {self.task_id}; open it with jt.task() first")
        return caller

    def _own(self, row: Any, op: Operation, caller: str | None) -> bool:
        """Is ``op``, found by the step's key, this step's own: its request and caller, linked to no other step?

        A run() that died between recording the operation and linking it leaves such an operation; any other
        one under the key (another caller's, another task's step's) is never taken for the step's effect.
        """
        if op.request_fingerprint != row.request_fingerprint or op.caller != caller:
            return False
        holder = task_steps.step_holding(self.store, op.operation_id)
        return holder is None or holder == (self.task_id, row.name)

    def _link(self, name: str, operation_id: str) -> None:
        task_steps.link_step(self.store, self.task_id, name, operation_id)

    def steps(self) -> list[StepView]:
        """Every step, in order, as it stands now (after a restart too)."""
        return self._views(None)

    def next_step(self) -> StepView | None:
        """The first step not confirmed (planned, blocked, submitted, failed or unresolved), or None."""
        return next((s for s in self.steps() if s.state != CONFIRMED), None)

    def explain(self) -> dict[str, Any]:
        """The task's next step and action, which steps a worker still carries forward, and every step.

        A confirmed step whose job still runs is not done: the task waits for it, and says so.
        """
        steps = self.steps()
        upcoming = next((s for s in steps if s.state != CONFIRMED), None)
        running = [s for s in steps if s.running]
        if upcoming is not None:
            step, action = upcoming.name, upcoming.next_action
        elif running:
            first = running[0]
            names = ", ".join(f"{s.name} ({s.operation_state})" for s in running)
            step = first.name
            action = (
                f"wait: every step is confirmed and {len(running)} still running: {names}; "
                f"next, a worker will {first.next_action} (jobtrail wait {first.operation_id})"
            )
        else:
            ended = [s for s in steps if s.operation_state not in (None, State.SUCCEEDED)]
            step = None
            action = "nothing: every step is confirmed and ended" + (
                " (" + ", ".join(f"{s.name} ended {s.operation_state}" for s in ended) + ")" if ended else ""
            )
        # a step's operation that waits for a worker none runs for: said once per provider
        stranded = [no_worker(self.store, self.store.get(s.operation_id)) for s in running if s.operation_id]
        return {
            "task_id": self.task_id,
            "next_step": step,
            "next_action": action,
            "running": [s.name for s in running],
            "steps": [s.to_json() for s in steps],
            "no_worker": list(dict.fromkeys(why for why in stranded if why)),
        }

    def _row(self, name: str) -> Any:
        rows = task_steps.step_rows(self.store, self.task_id, name)
        if not rows:
            raise UsageError(f"task {self.task_id} has no step {name!r}; declare it with task.step() first")
        return rows[0]

    def _views(self, name: str | None) -> list[StepView]:
        caller = task_steps.task_caller(self.store, self.task_id)
        views = []
        for row in task_steps.step_rows(self.store, self.task_id, name):
            if row.operation_id:
                op: Operation | None = self.store.get(row.operation_id)
            else:
                found = self.store.find_by_key(row.provider, row.operation_key)
                if found is not None and not self._own(row, found, caller):
                    views.append(_blocked(self.task_id, row))
                    continue
                op = found
            views.append(_view(self.task_id, row, op))
        return views


def _blocked(task_id: str, row: Any) -> StepView:
    """A step whose key another operation holds: said as it is, not as ``planned`` with an action that run()
    refuses. Which operation holds it is not said: it may be another caller's, whose ids are not this one's
    to learn (its key alone was taken)."""
    return StepView(
        task_id,
        row.name,
        row.operation_key,
        row.provider,
        BLOCKED,
        None,
        {"why": f"operation key {row.operation_key!r} already names an operation that is not this step's"},
        "plan it again under a new name with a key of its own (task.step(name, ..., key=...)); under this key it "
        "can never run, and nothing of it was sent",
    )


def open_task(client: AsyncJobtrail, task_id: str, caller: str) -> Task:
    check_name("caller", caller)
    task_steps.open_task(client.store, task_id, caller)
    return Task(client, task_id)
