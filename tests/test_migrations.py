"""Schema upgrades keep a user's data."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from jobtrail import RemoteState, StorageError, Store
from jobtrail.ledger.audit import verify
from jobtrail.ledger.migrate import HEAD, current_revision, head_revision, script_head

from helpers import S, obs, op_in
from processes import cli

DATA = Path(__file__).parent / "data" / "ledger_0001.sql"


@pytest.mark.empty_ledger
def test_upgrade_from_the_first_schema_keeps_every_record(open_store: Callable[..., Store]) -> None:
    """Rows written by the store at revision 0001 survive the upgrade to head, chains intact."""
    old = open_store(migrate=False)
    old.migrate("0001")
    rows = [line for line in DATA.read_text().splitlines() if line.startswith("INSERT")]
    with old.engine.begin() as conn:
        assert current_revision(conn) == "0001"
        assert not sa.inspect(conn).has_table("observations")
        for statement in rows:
            conn.exec_driver_sql(statement)
        made = [dict(r) for r in conn.execute(sa.text("SELECT * FROM operations")).mappings()]
    old.close()
    assert len(made) == 4

    new = open_store()  # opening upgrades
    with new.engine.connect() as conn:
        assert current_revision(conn) == head_revision()
    kept = ("state", "version", "history_head", "idempotency_token", "remote_job_id", "operation_key")
    for row in made:
        op = new.get(row["operation_id"])
        assert {k: getattr(op, k) for k in kept} == {k: row[k] for k in kept}
        assert op.polls == 0
        assert len(new.history(op.operation_id)) == op.version
    assert verify(new).ok
    observing = next(r["operation_id"] for r in made if r["state"] == "observing")
    assert new.add_observation(observing, kind="status_poll", raw={"status": "running"}) > 0
    moved = new.transition(new.get(observing), S.FAILED, obs(RemoteState.FAILED), actor="after-upgrade")
    assert moved.state is S.FAILED and verify(new).ok


def test_opening_twice_is_harmless(open_store: Callable[..., Store]) -> None:
    a = open_store()
    op = op_in(a, S.ACCEPTED)
    b = open_store()
    assert b.get(op.operation_id) == op


def test_the_head_constant_is_alembics_head() -> None:
    """Opening compares the ledger with HEAD instead of loading Alembic: a new migration must move HEAD."""
    assert head_revision() == script_head()


def test_a_ledger_made_by_a_newer_jobtrail_is_left_as_it_is_with_the_way_out(
    open_store: Callable[..., Store], db_url: str
) -> None:
    """An older jobtrail opening a newer one's ledger says so, instead of Alembic's traceback, and writes nothing."""
    store = open_store()
    op = op_in(store, S.ACCEPTED)
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999'"))
    store.close()
    with pytest.raises(StorageError, match=r"revision 9999, made by a newer jobtrail.*pip install -U jobtrail"):
        Store.open(db_url)
    reading = subprocess.run(
        [sys.executable, "-m", "jobtrail", "--db", db_url, "ops", "show", op.operation_id],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert reading.returncode == 2 and "made by a newer jobtrail" in reading.stderr
    assert "Traceback" not in reading.stderr and len(reading.stderr.strip().splitlines()) == 1
    with open_store(migrate=False).engine.connect() as conn:
        assert current_revision(conn) == "9999"


@pytest.mark.empty_ledger
@pytest.mark.parametrize("their_revision", ["3f2a9c1b7d4e", "0003", HEAD])
def test_another_programs_alembic_database_is_refused_and_left_as_it_was(
    db_url: str, engine_name: str, their_revision: str
) -> None:
    """Another program that migrates with Alembic keeps its revision where jobtrail keeps its own: a command
    that would make a ledger there (a worker, a submit) says so and changes nothing, not even SQLite's
    journal mode; a revision numbered like jobtrail's ("0003") does not start jobtrail's migrations there, and
    one that happens to be jobtrail's newest is not taken for a ledger that needs none."""
    url = db_url.replace("postgresql://", "postgresql+psycopg://", 1) if "://" in db_url else f"sqlite:///{db_url}"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
        conn.execute(sa.text(f"INSERT INTO alembic_version VALUES ('{their_revision}')"))
        conn.execute(sa.text("CREATE TABLE users (name VARCHAR(20))"))
    engine.dispose()
    before = Path(db_url).read_bytes() if engine_name == "sqlite" else None
    with pytest.raises(StorageError, match=r"another program's schema .*revision " + their_revision):
        Store.open(db_url)
    examples = Path(__file__).parent.parent / "examples"
    made = cli("--db", db_url, "worker", "--provider", str(examples / "fake.toml"), "--until-settled", timeout=60)
    assert made.returncode == 2 and "another program's schema" in made.stderr, made.stderr
    assert "Traceback" not in made.stderr and "pip install -U" not in made.stderr
    if before is not None:
        assert Path(db_url).read_bytes() == before  # journal mode (in the header) included
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        assert sorted(sa.inspect(conn).get_table_names()) == ["alembic_version", "users"]
    engine.dispose()


def test_healthz_says_a_newer_ledger_needs_a_newer_jobtrail(open_store: Callable[..., Store]) -> None:
    """During a rolling upgrade an old worker's /healthz names the way out: upgrade it (a new worker would not help)."""
    from jobtrail.ledger.migrate import schema_health

    store = open_store()
    with store.engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999'"))
    fine, said, _ = schema_health(store)
    assert not fine and "made by a newer jobtrail" in said and "pip install -U jobtrail" in said
