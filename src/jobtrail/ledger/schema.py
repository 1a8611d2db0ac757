"""Table definitions (SQLAlchemy Core). The migrations in ``migrations`` create them."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
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
    Column("polls", Integer, nullable=False, server_default="0"),
    Column("result_ref", Text),
    Column("cancel_requested_by", Text),
    Column("partial_effects", Text),
    # the fields a reschedule may change, as last written (see _chain.seal); 0006
    Column("row_seal", Text),
    UniqueConstraint("provider", "operation_key", name="uq_operations_provider_key"),
    Index("ix_operations_due", "state", "next_action_at_us"),
    Index("ix_operations_remote_job", "provider", "remote_job_id"),
    Index("ix_operations_operation_key", "operation_key"),  # 0007: found by key without its provider
    # 0009: the dashboard's list, newest first, filtered by state, caller or provider, searched by remote job id
    Index("ix_operations_state_id", "state", "operation_id"),
    Index("ix_operations_caller_id", "caller", "operation_id"),
    Index("ix_operations_provider_id", "provider", "operation_id"),
    Index("ix_operations_remote_job_id", "remote_job_id"),
    # 0010: a worker's claim, in its own order, the lease and state read from the index (SQLite only since 0012)
    Index("ix_operations_claim", "provider", "next_action_at_us", "operation_id", "lease_expires_at_us", "state"),
    # 0011, on PostgreSQL only (partial): ix_operations_unleased (provider, next_action_at_us, operation_id,
    # state) WHERE lease_owner IS NULL AND next_action_at_us IS NOT NULL, and ix_operations_leased (provider,
    # lease_expires_at_us NULLS FIRST) WHERE lease_owner IS NOT NULL: a claim reads no lease another holds
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
    # what the entry binds to the chain: row fields, observations, result digest (hash version 2; 0006)
    Column("covers", Text),
    Column("obs_upto", BigInteger),
    PrimaryKeyConstraint("operation_id", "seq", name="pk_history"),
)

observations = Table(
    "observations",
    metadata,
    Column("observation_id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("operation_id", String(40), ForeignKey("operations.operation_id"), nullable=False),
    Column("kind", String(40), nullable=False),
    Column("fetched_at_us", BigInteger, nullable=False),
    Column("provider_time", Text),
    Column("http_status", Integer),
    Column("provider_request_id", Text),
    Column("remote_state", String(40)),
    Column("raw_state", Text),
    Column("raw", Text, nullable=False),
    Column("worker", Text),
    Column("lease_epoch", BigInteger),
    Column("progress", Float),
    Column("next_action_at_us", BigInteger),
    # sha256 of the stored fields (see _chain.observation_digest); null before 0006
    Column("digest", String(64)),
    Index("ix_observations_operation", "operation_id", "observation_id"),
)

results = Table(
    "results",
    metadata,
    Column("operation_id", String(40), ForeignKey("operations.operation_id"), primary_key=True),
    Column("sha256", String(64), nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("content_type", Text),
    Column("body", LargeBinary),
    Column("path", Text),
    Column("checks", Text, nullable=False),
    Column("summary", Text),
    Column("redacted", Boolean, nullable=False),
    Column("stored_at_us", BigInteger, nullable=False),
)

webhook_events = Table(
    "webhook_events",
    metadata,
    Column("provider", String(200), nullable=False),
    Column("event_id", String(400), nullable=False),
    Column("received_at_us", BigInteger, nullable=False),
    Column("provider_time", BigInteger),
    Column("event_type", Text),
    Column("remote_job_id", Text),
    Column("operation_id", String(40)),
    Column("body", Text, nullable=False),
    Column("expires_at_us", BigInteger, nullable=False),
    PrimaryKeyConstraint("provider", "event_id", name="pk_webhook_events"),
    Index("ix_webhook_events_job", "provider", "remote_job_id"),
    Index("ix_webhook_events_operation", "operation_id"),
)

webhook_rejections = Table(
    "webhook_rejections",
    metadata,
    Column("provider", String(200), nullable=False),
    Column("reason", String(200), nullable=False),
    Column("count", BigInteger, nullable=False),
    Column("last_at_us", BigInteger, nullable=False),
    PrimaryKeyConstraint("provider", "reason", name="pk_webhook_rejections"),
)

tasks = Table(
    "tasks",
    metadata,
    Column("task_id", String(200), primary_key=True),
    Column("caller", Text, nullable=False),
    Column("created_at_us", BigInteger, nullable=False),
)

task_steps = Table(
    "task_steps",
    metadata,
    Column("task_id", String(200), ForeignKey("tasks.task_id"), nullable=False),
    Column("name", String(200), nullable=False),
    Column("position", Integer, nullable=False),
    Column("provider", String(200), nullable=False),
    Column("operation_key", String(400), nullable=False),
    Column("request_fingerprint", String(64), nullable=False),
    Column("operation_id", String(40)),
    Column("planned_at_us", BigInteger, nullable=False),
    PrimaryKeyConstraint("task_id", "name", name="pk_task_steps"),
)

workers = Table(
    "workers",
    metadata,
    Column("worker_id", Text, primary_key=True),
    # the provider names it serves, between commas: ",fake,openai-batch,"
    Column("providers", Text, nullable=False),
    Column("started_at_us", BigInteger, nullable=False),
    Column("seen_at_us", BigInteger, nullable=False),
    Column("stopped_at_us", BigInteger),
)
