"""One index that answers a worker's claim: its provider's due operations, earliest first.

A claim asks for due operations of the worker's providers, in a working state, whose lease is
free or expired, earliest due first. Without statistics SQLite took the (provider, remote_job_id)
index for the ``provider IN (...)`` term, read every operation of the provider and sorted them:
about 15 ms per claim on a ledger of 10,000. This index is read in the claim's own order, and it
holds the lease and state columns, so the rows that are not claimable (leased, resting) are
skipped without reading the table. It replaces the plain ``next_action_at_us`` index, whose every
query names a provider or a state.

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_CLAIM = ["provider", "next_action_at_us", "operation_id", "lease_expires_at_us", "state"]


def upgrade() -> None:
    op.create_index("ix_operations_claim", "operations", _CLAIM)
    op.drop_index("ix_operations_next_action", table_name="operations")


def downgrade() -> None:
    op.create_index("ix_operations_next_action", "operations", ["next_action_at_us"])
    op.drop_index("ix_operations_claim", table_name="operations")
