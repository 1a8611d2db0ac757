"""Indexes for browsing the ledger (the dashboard's list, filters and search), newest first.

The list pages by ``operation_id`` descending; a filter by state, provider or caller, or a search by
remote job id (without its provider) must not scan the whole table to find the
newest matches on a ledger of 100,000 operations.

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_operations_state_id", "operations", ["state", "operation_id"])
    op.create_index("ix_operations_caller_id", "operations", ["caller", "operation_id"])
    op.create_index("ix_operations_provider_id", "operations", ["provider", "operation_id"])
    op.create_index("ix_operations_remote_job_id", "operations", ["remote_job_id"])


def downgrade() -> None:
    op.drop_index("ix_operations_remote_job_id", table_name="operations")
    op.drop_index("ix_operations_provider_id", table_name="operations")
    op.drop_index("ix_operations_caller_id", table_name="operations")
    op.drop_index("ix_operations_state_id", table_name="operations")
