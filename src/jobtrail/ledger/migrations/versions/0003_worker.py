"""Worker era: schedule fields, cancel intent, partial effects, stored results.

Adds a per-state request counter, the result reference, the cancel intent made
before a job id was known, the provider's reported partial effects, an index on
the next action time, and the ``results`` table (small results inline, large
ones as content-addressed files).

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
        batch.add_column(sa.Column("cancel_requested_by", sa.Text))
        batch.add_column(sa.Column("partial_effects", sa.Text))
    op.create_index("ix_operations_next_action", "operations", ["next_action_at_us"])
    op.add_column("observations", sa.Column("worker", sa.Text))
    op.add_column("observations", sa.Column("lease_epoch", sa.BigInteger))
    op.add_column("observations", sa.Column("progress", sa.Float))
    op.add_column("observations", sa.Column("next_action_at_us", sa.BigInteger))
    op.create_table(
        "results",
        sa.Column("operation_id", sa.String(40), sa.ForeignKey("operations.operation_id"), primary_key=True),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("content_type", sa.Text),
        sa.Column("body", sa.LargeBinary),
        sa.Column("path", sa.Text),
        sa.Column("checks", sa.Text, nullable=False),
        sa.Column("summary", sa.Text),
        sa.Column("redacted", sa.Boolean, nullable=False),
        sa.Column("stored_at_us", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("results")
    op.drop_column("observations", "next_action_at_us")
    op.drop_column("observations", "progress")
    op.drop_column("observations", "lease_epoch")
    op.drop_column("observations", "worker")
    op.drop_index("ix_operations_next_action", "operations")
    with op.batch_alter_table("operations") as batch:
        batch.drop_column("partial_effects")
        batch.drop_column("cancel_requested_by")
        batch.drop_column("result_ref")
        batch.drop_column("polls")
