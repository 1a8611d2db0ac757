"""Webhooks: received events (de-duplicated by provider and event id) and refusal counters.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "webhook_events",
        sa.Column("provider", sa.String(200), nullable=False),
        sa.Column("event_id", sa.String(400), nullable=False),
        sa.Column("received_at_us", sa.BigInteger, nullable=False),
        sa.Column("provider_time", sa.BigInteger),
        sa.Column("event_type", sa.Text),
        sa.Column("remote_job_id", sa.Text),
        sa.Column("operation_id", sa.String(40)),
        sa.Column("body", sa.Text, nullable=False),
        sa.Column("expires_at_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("provider", "event_id", name="pk_webhook_events"),
    )
    op.create_index("ix_webhook_events_job", "webhook_events", ["provider", "remote_job_id"])
    op.create_index("ix_webhook_events_operation", "webhook_events", ["operation_id"])
    op.create_table(
        "webhook_rejections",
        sa.Column("provider", sa.String(200), nullable=False),
        sa.Column("reason", sa.String(200), nullable=False),
        sa.Column("count", sa.BigInteger, nullable=False),
        sa.Column("last_at_us", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("provider", "reason", name="pk_webhook_rejections"),
    )


def downgrade() -> None:
    op.drop_table("webhook_rejections")
    op.drop_index("ix_webhook_events_operation", "webhook_events")
    op.drop_index("ix_webhook_events_job", "webhook_events")
    op.drop_table("webhook_events")
