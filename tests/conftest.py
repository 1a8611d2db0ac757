"""Shared fixtures: one ledger per test, on SQLite and on PostgreSQL; and the two test tiers.

``python -m pytest`` runs the fast tier: every test not marked ``long``, a bounded
sample of each large family of like cases (:func:`helpers.tiered`), 50 simulation
seeds and a few dozen fuzz examples per property. ``python -m pytest --long`` runs
only the long tier: the rest of those families, seeds and examples, and the long
process stories. CI runs both, so each test runs once.

PostgreSQL is reached at ``$JOBTRAIL_TEST_PG`` (default
``postgresql://postgres@127.0.0.1:5432/test``); each test gets its own schema.
Without a server the PostgreSQL half is skipped, unless
``JOBTRAIL_REQUIRE_POSTGRES=1`` (as in CI), which turns the skip into a failure.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from hypothesis import settings

from jobtrail import Store
from jobtrail.domain.redact import Redactor

#: fuzz examples per property: this many in the fast tier, the rest of FUZZ_EXAMPLES in the long tier
FUZZ_FAST = 20
FUZZ_EXAMPLES = max(int(os.environ.get("JOBTRAIL_FUZZ_EXAMPLES", "120")), FUZZ_FAST + 1)
settings.register_profile("fast", max_examples=FUZZ_FAST)
settings.register_profile("long", max_examples=FUZZ_EXAMPLES - FUZZ_FAST)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        help="run the long tier (tests marked long, and the long tier's fuzz examples) instead of the fast tier",
    )


def pytest_configure(config: pytest.Config) -> None:
    # fuzz tests run in both tiers, on disjoint budgets of random examples
    settings.load_profile("long" if config.getoption("--long") else "fast")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    long = bool(config.getoption("--long"))
    keep, drop = [], []
    for item in items:
        marked = item.get_closest_marker("long") is not None or (
            item.get_closest_marker("long_on_postgres") is not None and _engine(item) == "postgres"
        )
        fuzz = item.get_closest_marker("fuzz") is not None
        (keep if marked == long or fuzz else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _engine(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("db_url") if callspec is not None else None


def pytest_report_header(config: pytest.Config) -> str:
    if config.getoption("--long"):
        return "tier: long (the tests marked long, and the long tier's fuzz examples)"
    return "tier: fast (tests marked long are deselected; run them with --long)"


PG_URL = os.environ.get("JOBTRAIL_TEST_PG", "postgresql://postgres@127.0.0.1:5432/test")
ENGINES = [e for e in os.environ.get("JOBTRAIL_TEST_ENGINES", "sqlite,postgres").split(",") if e]


def _pg_engine() -> sa.Engine:
    return sa.create_engine(PG_URL.replace("postgresql://", "postgresql+psycopg://", 1))


_pg_problem: str | bool | None = False


def pg_unavailable() -> str | None:
    """None when PostgreSQL answers, else why not (checked once per session)."""
    global _pg_problem
    if _pg_problem is False:
        try:
            engine = _pg_engine()
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
            engine.dispose()
            _pg_problem = None
        except Exception as exc:
            _pg_problem = f"PostgreSQL at {PG_URL} is not reachable ({type(exc).__name__}: {exc})"
    return _pg_problem or None


def require_pg() -> None:
    problem = pg_unavailable()
    if problem is None:
        return
    if os.environ.get("JOBTRAIL_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"JOBTRAIL_REQUIRE_POSTGRES=1 but {problem}")
    pytest.skip(f"{problem}; start it or set JOBTRAIL_TEST_PG (CI requires it)")


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite ledger migrated once per session: copying it is much cheaper than migrating each test's."""
    path = tmp_path_factory.mktemp("template") / "jobtrail.db"
    Store.open(str(path)).close()  # the last connection's close checkpoints: everything is in the file
    assert not Path(f"{path}-wal").exists() or Path(f"{path}-wal").stat().st_size == 0
    return path


@pytest.fixture(params=ENGINES)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database URL: a SQLite file (a copy of the migrated template, unless the test is marked
    ``empty_ledger``), or a PostgreSQL schema of its own (empty: the first open migrates it)."""
    if request.param == "sqlite":
        path = tmp_path / "jobtrail.db"
        if request.node.get_closest_marker("empty_ledger") is None:
            shutil.copyfile(request.getfixturevalue("sqlite_template"), path)
        yield str(path)
        return
    require_pg()
    schema = "jt_" + secrets.token_hex(6)
    engine = _pg_engine()
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    try:
        yield f"{PG_URL}?options=-csearch_path%3D{schema}"
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        engine.dispose()


@pytest.fixture
def open_store(db_url: str) -> Iterator[Callable[..., Store]]:
    """Factory: open the test's database (as many times as a test needs)."""
    stores: list[Store] = []

    def factory(**kwargs: object) -> Store:
        store = Store.open(db_url, **kwargs)  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield factory
    for store in stores:
        store.close()


@pytest.fixture
def store(open_store: Callable[..., Store]) -> Store:
    return open_store(redactor=Redactor())


@pytest.fixture
def engine_name(db_url: str) -> str:
    return "postgresql" if db_url.startswith("postgresql") else "sqlite"


class FakeClock:
    """A controllable clock in microseconds (for Retry-After and deadlines, no sleeping)."""

    def __init__(self) -> None:
        import time

        self.now_us = time.time_ns() // 1000

    def __call__(self) -> int:
        return self.now_us

    def advance(self, seconds: float) -> None:
        self.now_us += int(seconds * 1_000_000)


@pytest.fixture
def fake() -> Iterator[object]:
    """The fake provider, a real HTTP server on 127.0.0.1, per test."""
    from jobtrail.testing import FakeProvider

    provider = FakeProvider(job_duration_s=0.3).start()
    yield provider
    provider.stop()


@pytest.fixture
def ledger(db_url: str) -> Iterator[Store]:
    """The test's database, opened once and closed at teardown."""
    store = Store.open(db_url)
    yield store
    store.close()
