"""Schema migrations with Alembic, run on a connection jobtrail already holds.

Opening a ledger only reads its version row and compares it with :data:`HEAD`;
Alembic (and Mako, which it brings) is imported only when an upgrade really runs,
so a quick command on an up-to-date ledger costs one small query.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from jobtrail.domain.errors import StorageError

if TYPE_CHECKING:
    from alembic.config import Config

    from jobtrail.ledger.store import Store

_SCRIPTS = Path(__file__).parent / "migrations"

#: the newest revision under migrations/versions (tests/test_migrations.py checks it against Alembic's own head)
HEAD = "0012"


@cache
def _config() -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_SCRIPTS))
    return cfg


def head_revision() -> str:
    return HEAD


def script_head() -> str:
    """The head revision as Alembic reads it from the scripts (slow: loads every migration)."""
    from alembic.script import ScriptDirectory

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
    target = HEAD if revision == "head" else revision
    current = current_revision(conn)
    if current == target:
        return
    if current is not None and not (len(current) == len(HEAD) and current.isdigit() and current <= HEAD):
        # Alembic would only say it cannot locate the revision, in a traceback
        made_by = "a newer jobtrail" if current.isdigit() else "something other than jobtrail"
        raise StorageError(
            f"this ledger's schema is at revision {current}, made by {made_by}: this jobtrail knows revisions up "
            f"to {HEAD} and leaves it as it is. Upgrade jobtrail (pip install -U jobtrail), or point --db "
            "(or JOBTRAIL_DB) at another ledger"
        )
    from alembic import command

    cfg = _config()
    cfg.attributes["connection"] = conn
    command.upgrade(cfg, revision)


def schema_health(store: Store) -> tuple[bool, str]:
    """(fine, what): the database answers and its schema is the one this code expects (``/healthz``)."""
    try:
        with store._read() as conn:
            revision = current_revision(conn)
    except StorageError as exc:
        return False, f"database unreachable: {exc}"
    if revision != HEAD:
        return False, (
            f"schema is at revision {revision or 'none'}, this jobtrail expects {HEAD}: "
            "start a worker (`jobtrail worker`), which creates or upgrades it"
        )
    return True, f"schema at revision {revision}"
