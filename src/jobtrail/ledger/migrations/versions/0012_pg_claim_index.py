"""PostgreSQL: drop ``ix_operations_claim``, which nothing there reads.

Since 0011 a PostgreSQL claim reads the two partial indexes, and an idle worker's "when could a claim
next find work" (:meth:`Store.next_claimable_us`) reads them too. Counted by ``pg_stat_user_indexes``
over 10,000 life cycles, ``ix_operations_claim`` was scanned zero times, yet every UPDATE that moves an
operation's state, due time or lease (about six per life cycle, none of them HOT: each changes an
indexed column) wrote an entry into it. SQLite reads its claims from it, and keeps it.

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.drop_index("ix_operations_claim", table_name="operations")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.create_index(
        "ix_operations_claim",
        "operations",
        ["provider", "next_action_at_us", "operation_id", "lease_expires_at_us", "state"],
    )
