"""Agent tasks and their steps as the ledger keeps them: ids, keys and references only.

A step's state is never stored: it is read from its operation
(:mod:`jobtrail.runtime.tasks`). These are the statements that plan, link and
list steps.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from jobtrail.domain.errors import OperationKeyConflict
from jobtrail.ledger import schema as t
from jobtrail.ledger.store import Store


def open_task(store: Store, task_id: str, caller: str) -> None:
    """Record the task unless it exists (opening twice resumes it)."""
    with store.writing("opening a task") as conn:
        exists = conn.execute(sa.select(t.tasks.c.task_id).where(t.tasks.c.task_id == task_id)).first()
        if exists is None:
            conn.execute(sa.insert(t.tasks), {"task_id": task_id, "caller": caller, "created_at_us": store.clock()})


def task_caller(store: Store, task_id: str) -> str | None:
    """Who the task belongs to (the caller it was first opened by), or None if there is no such task."""
    with store._read() as conn:
        recorded = conn.execute(sa.select(t.tasks.c.caller).where(t.tasks.c.task_id == task_id)).scalar()
    return None if recorded is None else str(recorded)


def plan_step(
    store: Store,
    task_id: str,
    name: str,
    provider: str,
    key: str,
    fingerprint: str,
    *,
    planned_as: str | None = None,
) -> None:
    """Make the step's key durable (idempotent); a different request under the same name is refused, and so
    is a key another step (of any task) already holds: one key names one side effect.

    ``planned_as`` is a key the step may already have been planned under (its default key from before
    default keys were escaped): a step re-declared after an upgrade keeps the key its operation carries.
    """
    steps = t.task_steps.c
    with store.writing("planning a task step") as conn:
        row = conn.execute(sa.select(t.task_steps).where(steps.task_id == task_id, steps.name == name)).first()
        if row is None:
            holder = conn.execute(
                sa.select(steps.task_id, steps.name).where(steps.provider == provider, steps.operation_key == key)
            ).first()
            if holder is not None:
                # two steps under one key would share one operation: one of them would never have its effect
                raise OperationKeyConflict(
                    f"operation key {key!r} is already the key of step {holder.name!r} of task {holder.task_id}; "
                    "nothing was planned: give this step a key of its own (or none: the default key is made "
                    "of the task's id and the step's name)",
                    operation_key=key,
                )
            position = conn.execute(
                sa.select(sa.func.count()).select_from(t.task_steps).where(steps.task_id == task_id)
            ).scalar_one()
            conn.execute(
                sa.insert(t.task_steps),
                {
                    "task_id": task_id,
                    "name": name,
                    "position": position,
                    "provider": provider,
                    "operation_key": key,
                    "request_fingerprint": fingerprint,
                    "operation_id": None,
                    "planned_at_us": store.clock(),
                },
            )
        elif (
            row.request_fingerprint != fingerprint
            or row.provider != provider
            or row.operation_key not in (key, planned_as)
        ):
            raise OperationKeyConflict(
                f"step {name!r} of task {task_id} was planned with a different request; a changed step is "
                "a new step: give it a new name",
                operation_key=key,
            )


def link_step(store: Store, task_id: str, name: str, operation_id: str) -> None:
    """Record the operation a step's effect became."""
    with store.writing("recording a step's operation") as conn:
        conn.execute(
            sa.update(t.task_steps)
            .where(t.task_steps.c.task_id == task_id, t.task_steps.c.name == name)
            .values(operation_id=operation_id)
        )


def step_holding(store: Store, operation_id: str) -> tuple[str, str] | None:
    """The step (task id, step name) whose effect the operation is, if any step has it linked."""
    steps = t.task_steps.c
    with store._read() as conn:
        row = conn.execute(
            sa.select(steps.task_id, steps.name).where(steps.operation_id == operation_id).limit(1)
        ).first()
    return None if row is None else (row.task_id, row.name)


def step_rows(store: Store, task_id: str, name: str | None = None) -> list[Any]:
    """The task's steps in order (or the one named), as rows."""
    steps = t.task_steps.c
    query = sa.select(t.task_steps).where(steps.task_id == task_id).order_by(steps.position)
    if name is not None:
        query = query.where(steps.name == name)
    with store._read() as conn:
        return list(conn.execute(query).all())
