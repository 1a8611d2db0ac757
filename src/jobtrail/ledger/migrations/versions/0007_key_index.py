"""Find an operation by its key alone: an index on ``operations.operation_key``.

The unique constraint is on (provider, operation_key), which a lookup by key
without its provider cannot use (``jobtrail ops show KEY``, an agent's
``job_status(KEY)``).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_operations_operation_key", "operations", ["operation_key"])


def downgrade() -> None:
    op.drop_index("ix_operations_operation_key", table_name="operations")
