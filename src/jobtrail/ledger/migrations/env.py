"""Alembic environment: always run on the connection jobtrail hands over."""

from __future__ import annotations

from alembic import context

from jobtrail.ledger.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata)
with context.begin_transaction():
    context.run_migrations()
