"""Schema migrations with Alembic, run on a connection jobtrail already holds."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection

_SCRIPTS = Path(__file__).parent / "_migrations"


@cache
def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_SCRIPTS))
    return cfg


@cache
def head_revision() -> str:
    head = ScriptDirectory.from_config(_config()).get_current_head()
    assert head is not None
    return str(head)


def current_revision(conn: Connection) -> str | None:
    if not sa.inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()


def upgrade(conn: Connection, revision: str = "head") -> None:
    """Upgrade the schema inside the caller's transaction (serialised between processes)."""
    if conn.dialect.name == "postgresql":
        # two workers starting at once must not both run the same migration
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(7206151)"))
    target = head_revision() if revision == "head" else revision
    if current_revision(conn) == target:
        return
    cfg = _config()
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, revision)
