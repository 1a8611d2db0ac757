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


def plan_step(store: Store, task_id: str, name: str, provider: str, key: str, fingerprint: str) -> None:
    """Make the step's key durable (idempotent); a different request under the same name is refused."""
    steps = t.task_steps.c
    with store.writing("planning a task step") as conn:
        row = conn.execute(sa.select(t.task_steps).where(steps.task_id == task_id, steps.name == name)).first()
        if row is None:
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
        elif row.request_fingerprint != fingerprint or row.provider != provider or row.operation_key != key:
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


def step_rows(store: Store, task_id: str, name: str | None = None) -> list[Any]:
    """The task's steps in order (or the one named), as rows."""
    steps = t.task_steps.c
    query = sa.select(t.task_steps).where(steps.task_id == task_id).order_by(steps.position)
    if name is not None:
        query = query.where(steps.name == name)
    with store._read() as conn:
        return list(conn.execute(query).all())
