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


def holds_ledger_tables(conn: Connection) -> bool:
    """Does ``conn``'s database hold jobtrail's tables (and their schema version)? Its own tables, not only
    a version table: other programs migrate with Alembic too."""
    inspector = sa.inspect(conn)
    return all(inspector.has_table(name) for name in ("alembic_version", "operations", "history"))


def _ours(revision: str) -> bool:
    """Is ``revision`` one this jobtrail made (not a newer one's)?"""
    return len(revision) == len(HEAD) and revision.isdigit() and revision <= HEAD


def refuse_unknown_schema(conn: Connection) -> str | None:
    """The schema revision of ``conn``'s database (None: it has none yet); raises :class:`StorageError`, before
    anything is changed, for a revision jobtrail did not make: another program's (its Alembic version table,
    without jobtrail's tables), or a newer jobtrail's. (Alembic would only say, in a traceback, that it
    cannot locate the revision, or run jobtrail's migrations over another program's tables.)"""
    current = current_revision(conn)
    if current is None:
        return None
    if not holds_ledger_tables(conn):
        raise StorageError(
            f"this database holds another program's schema (its alembic_version table says revision {current}) "
            "and no jobtrail ledger; jobtrail keeps its own schema version in that table, so it cannot share "
            "the database (on PostgreSQL: the schema) with it, and left it as it is. Point --db (or JOBTRAIL_DB) "
            "at your ledger, or at a new file or an empty database to start one"
        )
    if not _ours(current):
        raise StorageError(
            f"this ledger's schema is at revision {current}, made by a newer jobtrail: this jobtrail knows "
            f"revisions up to {HEAD} and leaves it as it is. Upgrade jobtrail (pip install -U jobtrail), or point "
            "--db (or JOBTRAIL_DB) at another ledger"
        )
    return current


def upgrade(conn: Connection, revision: str = "head") -> str | None:
    """Upgrade the schema inside the caller's transaction (serialised between processes); returns the
    revision it found (None: there was no ledger, and one was made)."""
    if conn.dialect.name == "postgresql":
        # a migration waits as long as it takes for another process's (of a large ledger: minutes), and for
        # the locks its own DDL needs, instead of the store's lock_timeout
        conn.execute(sa.text("SET LOCAL lock_timeout = 0"))
        # two workers starting at once must not both run the same migration
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(7206151)"))
    target = HEAD if revision == "head" else revision
    current = refuse_unknown_schema(conn)
    if current != target:
        from alembic import command

        cfg = _config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    return current


#: what ``/healthz`` says of a database it cannot read: the error itself names hosts, users, databases and
#: paths, which an open endpoint (the webhook receiver faces the internet) must not show; it goes to the log
UNREACHABLE = "database unreachable; the cause is in this process's log"


def schema_health(store: Store) -> tuple[bool, str, str | None]:
    """(fine, what, detail): the database answers and its schema is the one this code expects (``/healthz``).
    ``what`` may be shown to anyone; ``detail``, when set, is the error behind it, for the log only."""
    try:
        with store._read() as conn:
            revision = current_revision(conn)
    except StorageError as exc:
        return False, UNREACHABLE, str(exc)
    if revision is not None and not _ours(revision):
        return (
            False,
            (
                f"schema is at revision {revision}, made by a newer jobtrail; this one knows revisions up to {HEAD}: "
                "upgrade this jobtrail (pip install -U jobtrail)"
            ),
            None,
        )
    if revision != HEAD:
        return (
            False,
            (
                f"schema is at revision {revision or 'none'}, this jobtrail expects {HEAD}: "
                "start a worker (`jobtrail worker`), which creates or upgrades it"
            ),
            None,
        )
    return True, f"schema at revision {revision}", None
