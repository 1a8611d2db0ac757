"""Worker liveness: each running worker's heartbeat, so a reader can say when no worker serves a provider.

Not part of the audited history: a heartbeat is a fact about a process, not about an operation.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("worker_id", sa.Text, primary_key=True),
        # the provider names it serves, comma-separated between commas: ",fake,openai-batch,"
        sa.Column("providers", sa.Text, nullable=False),
        sa.Column("started_at_us", sa.BigInteger, nullable=False),
        sa.Column("seen_at_us", sa.BigInteger, nullable=False),
        sa.Column("stopped_at_us", sa.BigInteger),
    )


def downgrade() -> None:
    op.drop_table("workers")
