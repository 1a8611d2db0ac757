"""Audit coverage: history entries cover the row, observations and result digests (hash version 2).

Adds ``history.covers`` and ``history.obs_upto`` (what a version-2 entry binds to the chain),
``observations.digest`` and ``operations.row_seal``. Entries written before
this revision keep verifying under hash version 1; nothing is rewritten.

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("history", sa.Column("covers", sa.Text))
    op.add_column("history", sa.Column("obs_upto", sa.BigInteger))
    op.add_column("observations", sa.Column("digest", sa.String(64)))
    op.add_column("operations", sa.Column("row_seal", sa.Text))


def downgrade() -> None:
    with op.batch_alter_table("operations") as batch:
        batch.drop_column("row_seal")
    with op.batch_alter_table("observations") as batch:
        batch.drop_column("digest")
    with op.batch_alter_table("history") as batch:
        batch.drop_column("obs_upto")
        batch.drop_column("covers")
