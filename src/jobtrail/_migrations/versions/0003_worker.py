"""Worker schedule: a per-state request counter, the result reference, an index on the next action time.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("operations") as batch:
        batch.add_column(sa.Column("polls", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("result_ref", sa.Text))
    op.create_index("ix_operations_next_action", "operations", ["next_action_at_us"])
    op.add_column("observations", sa.Column("worker", sa.Text))
    op.add_column("observations", sa.Column("lease_epoch", sa.BigInteger))
    op.add_column("observations", sa.Column("progress", sa.Float))
    op.add_column("observations", sa.Column("next_action_at_us", sa.BigInteger))


def downgrade() -> None:
    op.drop_column("observations", "next_action_at_us")
    op.drop_column("observations", "progress")
    op.drop_column("observations", "lease_epoch")
    op.drop_column("observations", "worker")
    op.drop_index("ix_operations_next_action", "operations")
    with op.batch_alter_table("operations") as batch:
        batch.drop_column("result_ref")
        batch.drop_column("polls")
