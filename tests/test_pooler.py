"""jobtrail behind a PostgreSQL pooler in transaction mode: a real PgBouncer on 127.0.0.1, in front of the
test server, handing each transaction whichever of its few server connections is free.

That is how most production PostgreSQL is reached (PgBouncer, RDS Proxy, Supavisor, Neon's pooler), and
nothing a session keeps survives it: each transaction may run on another server connection, shared with
other clients. A probe found every write after the first refused ("prepared statement "_pg3_1" already
exists": psycopg prepares a statement it runs often, under a name each client connection numbers from 0)
and the lock time-out set once per session lost. PgBouncer here also resets each server connection after
every transaction (``server_reset_query_always``), as some operators run it, so whatever a session kept
is gone for certain, not only where two clients happened to share.

Without PgBouncer installed (Debian's ``pgbouncer``) these tests are skipped, unless
``JOBTRAIL_REQUIRE_POSTGRES=1`` (CI, which installs it).
"""

from __future__ import annotations

import asyncio
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa
from conftest import PG_URL, require_pg

from jobtrail import AsyncJobtrail, State, Store
from jobtrail.domain.errors import StorageError
from jobtrail.runtime.worker import Worker
from jobtrail.testing import FakeProvider

from helpers import free_port
from processes import assert_audit_verifies, finish, jobtrail, start_worker, write_provider

#: the server connections PgBouncer keeps for one database: fewer than jobtrail's client connections
POOL_SIZE = 2


def _pgbouncer_binary() -> str:
    found = shutil.which("pgbouncer") or ("/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None)
    if found is not None:
        return found
    problem = "PgBouncer is not installed (Debian: apt-get install pgbouncer)"
    if os.environ.get("JOBTRAIL_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"JOBTRAIL_REQUIRE_POSTGRES=1 but {problem}")
    pytest.skip(problem)


def _as_postgres() -> dict[str, object]:
    """PgBouncer refuses to run as root (CI runs as root): then it runs as the postgres user."""
    if os.geteuid() != 0:
        return {}
    user = pwd.getpwnam("postgres")
    return {"user": user.pw_uid, "group": user.pw_gid}


@pytest.fixture
def pooled_url() -> Iterator[str]:
    """A new database on the test server, reached through a PgBouncer in transaction mode."""
    require_pg()
    binary = _pgbouncer_binary()
    server = sa.engine.make_url(PG_URL)
    database = "jt_pool_" + secrets.token_hex(4)
    admin = sa.create_engine(PG_URL.replace("postgresql://", "postgresql+psycopg://", 1), isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {database}"))
    folder = Path(tempfile.mkdtemp(prefix="jt-pgbouncer-"))
    folder.chmod(0o755)  # (read by the postgres user when run as root)
    port = free_port()
    (folder / "users.txt").write_text(f'"{server.username}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={server.host} port={server.port or 5432}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {folder / 'users.txt'}\n"
        f"pool_mode = transaction\ndefault_pool_size = {POOL_SIZE}\nmax_client_conn = 200\n"
        "server_reset_query = DISCARD ALL\nserver_reset_query_always = 1\n"
    )
    for name in ("users.txt", "pgbouncer.ini"):
        (folder / name).chmod(0o644)
    log = (folder / "pgbouncer.log").open("w")
    os.chmod(log.name, 0o666)
    proc = subprocess.Popen(
        [binary, str(folder / "pgbouncer.ini")],
        stdout=log,
        stderr=subprocess.STDOUT,
        **_as_postgres(),  # type: ignore[arg-type]
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    why = (folder / "pgbouncer.log").read_text()
                    raise RuntimeError(f"PgBouncer did not start: {why}") from exc
                time.sleep(0.05)
        yield f"postgresql://{server.username}@127.0.0.1:{port}/{database}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        shutil.rmtree(folder, ignore_errors=True)
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE {database} WITH (FORCE)"))
        admin.dispose()


@pytest.mark.long
def test_jobs_run_once_each_behind_a_pooler_in_transaction_mode(
    pooled_url: str, fake: FakeProvider, tmp_path: Path
) -> None:
    """Submits from a process, two workers in processes of their own and the audit, all through PgBouncer
    with two server connections between them: every job created once, every operation succeeded, the chain
    intact."""
    provider = write_provider(tmp_path / "fake.toml", fake)
    ids = []
    for i in range(12):  # each a process of its own: a new client connection each time, on shared servers
        code, out, err = jobtrail(
            pooled_url, "submit", "--provider", str(provider), "--key", f"k{i}", "--request", "{}"
        )
        assert code == 0, err
        ids.append(out.split()[0])
    workers = [start_worker(pooled_url, provider, f"w{i}", "--until-settled") for i in range(2)]
    for worker in workers:
        code, _, err = finish(worker)
        assert code == 0, err
    with Store.open(pooled_url) as store:
        states = [op.state for op in store.list_operations(limit=None)]
        tokens = [op.idempotency_token for op in store.list_operations(limit=None)]
    assert states == [State.SUCCEEDED] * 12
    assert fake.counts["creates_received"] == 12 and all(len(fake.jobs_for(t)) == 1 for t in tokens)
    assert_audit_verifies(pooled_url)


def test_a_worker_and_its_writer_process_share_the_pooler(pooled_url: str, fake: FakeProvider) -> None:
    """One worker process, its writer process and its threads: many client connections on two servers, each
    statement run hundreds of times (where psycopg would prepare it)."""
    store = Store.open(pooled_url)
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])

    async def go() -> None:
        await jt.submit_many("fake", [{"i": i} for i in range(200)])
        worker = Worker(store, {"fake": jt.provider("fake")}, worker_id="w", concurrency=50, writer_process=True)
        await worker.run(until_settled=True)
        await jt.aclose()

    asyncio.run(go())
    ops = store.list_operations(limit=None)
    assert [op.state for op in ops] == [State.SUCCEEDED] * 200
    assert fake.counts["creates_received"] == 200
    store.close()


def test_a_lock_held_elsewhere_is_a_clear_error_behind_the_pooler(
    pooled_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock time-out holds in every transaction, whichever server connection it runs on: a write waits
    that long for a table another session locked, then is refused with the way out (set once per session,
    it was lost, and the write waited as long as the lock was held)."""
    import jobtrail.ledger.store as store_mod
    from jobtrail.domain.states import RemoteState

    from helpers import S, obs, op_in

    monkeypatch.setattr(store_mod, "POSTGRES_LOCK_TIMEOUT_MS", 500)
    store = Store.open(pooled_url)
    op = op_in(store, S.ACCEPTED)
    direct = sa.engine.make_url(PG_URL).set(database=sa.engine.make_url(pooled_url).database)
    engine = sa.create_engine(direct.set(drivername="postgresql+psycopg"))
    locker = engine.connect()
    locker.execute(sa.text("LOCK TABLE operations IN ACCESS EXCLUSIVE MODE"))
    try:
        with ThreadPoolExecutor(1) as pool:
            write = pool.submit(store.transition, op, S.OBSERVING, obs(RemoteState.RUNNING), actor="w")
            try:
                error = write.exception(timeout=20)  # (the lock is released below either way)
            finally:
                locker.close()
        assert isinstance(error, StorageError) and "another session held a lock" in str(error), error
    finally:
        engine.dispose()
    assert store.get(op.operation_id) == op
    assert store.transition(op, S.OBSERVING, obs(RemoteState.RUNNING), actor="w").state is S.OBSERVING
    store.close()
