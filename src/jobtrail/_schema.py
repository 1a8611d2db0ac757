"""Table definitions (SQLAlchemy Core). The migrations in ``_migrations`` create them."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Column,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
)

metadata = MetaData()

operations = Table(
    "operations",
    metadata,
    Column("operation_id", String(40), primary_key=True),
    Column("provider", String(200), nullable=False),
    Column("target", Text, nullable=False),
    Column("endpoint", Text, nullable=False),
    Column("operation_key", String(400)),
    Column("request_fingerprint", String(64), nullable=False),
    Column("request_body", Text, nullable=False),
    Column("idempotency_token", String(64), nullable=False, unique=True),
    Column("trace_id", String(32), nullable=False),
    Column("remote_job_id", Text),
    Column("state", String(40), nullable=False),
    Column("remote_state", String(200)),
    Column("state_reason", Text),
    Column("attempts", Integer, nullable=False),
    Column("create_deadline_us", BigInteger),
    Column("result_deadline_us", BigInteger),
    Column("cancel_deadline_us", BigInteger),
    Column("caller", Text, nullable=False),
    Column("approved_by", Text),
    Column("created_at_us", BigInteger, nullable=False),
    Column("updated_at_us", BigInteger, nullable=False),
    Column("next_action_at_us", BigInteger),
    Column("version", Integer, nullable=False),
    Column("history_head", String(64), nullable=False),
    Column("lease_owner", Text),
    Column("lease_expires_at_us", BigInteger),
    Column("lease_epoch", BigInteger, nullable=False),
    UniqueConstraint("provider", "operation_key", name="uq_operations_provider_key"),
    Index("ix_operations_due", "state", "next_action_at_us"),
    Index("ix_operations_remote_job", "provider", "remote_job_id"),
)

history = Table(
    "history",
    metadata,
    Column("operation_id", String(40), ForeignKey("operations.operation_id"), nullable=False),
    Column("seq", Integer, nullable=False),
    Column("at_us", BigInteger, nullable=False),
    Column("actor", Text, nullable=False),
    Column("from_state", String(40)),
    Column("to_state", String(40), nullable=False),
    Column("cause", Text, nullable=False),
    Column("evidence", Text, nullable=False),
    Column("remote_job_id", Text),
    Column("trace_id", String(32), nullable=False),
    Column("request_ids", Text, nullable=False),
    Column("request_fingerprint", String(64), nullable=False),
    Column("prev_hash", String(64), nullable=False),
    Column("entry_hash", String(64), nullable=False),
    Column("hash_version", SmallInteger, nullable=False),
    PrimaryKeyConstraint("operation_id", "seq", name="pk_history"),
)

observations = Table(
    "observations",
    metadata,
    Column(
        "observation_id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    ),
    Column("operation_id", String(40), ForeignKey("operations.operation_id"), nullable=False),
    Column("kind", String(40), nullable=False),
    Column("fetched_at_us", BigInteger, nullable=False),
    Column("provider_time", Text),
    Column("http_status", Integer),
    Column("provider_request_id", Text),
    Column("remote_state", String(40)),
    Column("raw_state", Text),
    Column("raw", Text, nullable=False),
    Index("ix_observations_operation", "operation_id", "observation_id"),
)
