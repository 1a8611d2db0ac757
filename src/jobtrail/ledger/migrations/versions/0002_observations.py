"""Observations: every fact seen from outside, with its redacted raw response.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "observations",
        sa.Column(
            "observation_id",
            sa.BigInteger().with_variant(sa.Integer, "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column(
            "operation_id",
            sa.String(40),
            sa.ForeignKey("operations.operation_id"),
            nullable=False,
        ),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("fetched_at_us", sa.BigInteger, nullable=False),
        sa.Column("provider_time", sa.Text),
        sa.Column("http_status", sa.Integer),
        sa.Column("provider_request_id", sa.Text),
        sa.Column("remote_state", sa.String(40)),
        sa.Column("raw_state", sa.Text),
        sa.Column("raw", sa.Text, nullable=False),
    )
    op.create_index("ix_observations_operation", "observations", ["operation_id", "observation_id"])


def downgrade() -> None:
    op.drop_index("ix_observations_operation", "observations")
    op.drop_table("observations")
