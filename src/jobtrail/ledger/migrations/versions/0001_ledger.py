"""The operation ledger: operations and their append-only, hash-chained history.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_SQLITE_TRIGGERS = (
    """CREATE TRIGGER history_no_update BEFORE UPDATE ON history
       BEGIN SELECT RAISE(ABORT, 'jobtrail history is append-only: UPDATE refused'); END""",
    """CREATE TRIGGER history_no_delete BEFORE DELETE ON history
       BEGIN SELECT RAISE(ABORT, 'jobtrail history is append-only: DELETE refused'); END""",
)

_PG_TRIGGERS = (
    """CREATE FUNCTION jobtrail_history_append_only() RETURNS trigger AS $$
       BEGIN
         RAISE EXCEPTION 'jobtrail history is append-only: % refused', TG_OP;
       END $$ LANGUAGE plpgsql""",
    """CREATE TRIGGER history_no_update_delete BEFORE UPDATE OR DELETE ON history
       FOR EACH ROW EXECUTE FUNCTION jobtrail_history_append_only()""",
    """CREATE TRIGGER history_no_truncate BEFORE TRUNCATE ON history
       FOR EACH STATEMENT EXECUTE FUNCTION jobtrail_history_append_only()""",
)


def upgrade() -> None:
    op.create_table(
        "operations",
        sa.Column("operation_id", sa.String(40), primary_key=True),
        sa.Column("provider", sa.String(200), nullable=False),
        sa.Column("target", sa.Text, nullable=False),
        sa.Column("endpoint", sa.Text, nullable=False),
        sa.Column("operation_key", sa.String(400)),
        sa.Column("request_fingerprint", sa.String(64), nullable=False),
        sa.Column("request_body", sa.Text, nullable=False),
        sa.Column("idempotency_token", sa.String(64), nullable=False, unique=True),
        sa.Column("trace_id", sa.String(32), nullable=False),
        sa.Column("remote_job_id", sa.Text),
        sa.Column("state", sa.String(40), nullable=False),
        sa.Column("remote_state", sa.String(200)),
        sa.Column("state_reason", sa.Text),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("create_deadline_us", sa.BigInteger),
        sa.Column("result_deadline_us", sa.BigInteger),
        sa.Column("cancel_deadline_us", sa.BigInteger),
        sa.Column("caller", sa.Text, nullable=False),
        sa.Column("approved_by", sa.Text),
        sa.Column("created_at_us", sa.BigInteger, nullable=False),
        sa.Column("updated_at_us", sa.BigInteger, nullable=False),
        sa.Column("next_action_at_us", sa.BigInteger),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("history_head", sa.String(64), nullable=False),
        sa.Column("lease_owner", sa.Text),
        sa.Column("lease_expires_at_us", sa.BigInteger),
        sa.Column("lease_epoch", sa.BigInteger, nullable=False),
        sa.UniqueConstraint("provider", "operation_key", name="uq_operations_provider_key"),
    )
    op.create_index("ix_operations_due", "operations", ["state", "next_action_at_us"])
    op.create_index("ix_operations_remote_job", "operations", ["provider", "remote_job_id"])
    op.create_table(
        "history",
        sa.Column(
            "operation_id",
            sa.String(40),
            sa.ForeignKey("operations.operation_id"),
            nullable=False,
        ),
        sa.Column("seq", sa.Integer, nullable=False),
        sa.Column("at_us", sa.BigInteger, nullable=False),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("from_state", sa.String(40)),
        sa.Column("to_state", sa.String(40), nullable=False),
        sa.Column("cause", sa.Text, nullable=False),
        sa.Column("evidence", sa.Text, nullable=False),
        sa.Column("remote_job_id", sa.Text),
        sa.Column("trace_id", sa.String(32), nullable=False),
        sa.Column("request_ids", sa.Text, nullable=False),
        sa.Column("request_fingerprint", sa.String(64), nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("entry_hash", sa.String(64), nullable=False),
        sa.Column("hash_version", sa.SmallInteger, nullable=False),
        sa.PrimaryKeyConstraint("operation_id", "seq", name="pk_history"),
    )
    triggers = _PG_TRIGGERS if op.get_bind().dialect.name == "postgresql" else _SQLITE_TRIGGERS
    for statement in triggers:
        op.execute(statement)


def downgrade() -> None:
    raise NotImplementedError("the ledger is never dropped by a migration")
