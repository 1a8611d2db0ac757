"""Agent tasks and their steps: the key of every side effect, durable before the effect.

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "tasks",
        sa.Column("task_id", sa.String(200), primary_key=True),
        sa.Column("caller", sa.Text, nullable=False),
        sa.Column("created_at_us", sa.BigInteger, nullable=False),
    )
    op.create_table(
        "task_steps",
        sa.Column("task_id", sa.String(200), sa.ForeignKey("tasks.task_id"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("position", sa.Integer, nullable=False),
        sa.Column("provider", sa.String(200), nullable=False),
        sa.Column("operation_key", sa.String(400), nullable=False),
        sa.Column("request_fingerprint", sa.String(64), nullable=False),
        sa.Column("operation_id", sa.String(40)),
        sa.Column("planned_at_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("task_id", "name", name="pk_task_steps"),
    )


def downgrade() -> None:
    op.drop_table("task_steps")
    op.drop_table("tasks")
