"""The core install needs no extra; a command that needs a missing one says which to install.

Each case is a real ``jobtrail`` process in which the extra's packages cannot be imported
(``sys.modules[name] = None`` makes ``import name`` raise ImportError, as on a core install).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobtrail import Store

EXTRAS = {
    "postgres": ("psycopg",),
    "mcp": ("mcp",),
    "webhooks": ("starlette", "uvicorn", "standardwebhooks"),
    # the API (opentelemetry) is core: spans and metrics cost nothing until an SDK is configured
    "otel": ("opentelemetry.sdk", "opentelemetry.exporter.prometheus", "prometheus_client"),
}
EVERY_EXTRA = tuple(name for names in EXTRAS.values() for name in names)
#: what only an upgrade needs: an up-to-date ledger must open without them
MIGRATION_ONLY = ("alembic", "mako")

EXAMPLE = Path(__file__).parent.parent / "examples" / "fake.toml"


def jobtrail_without(blocked: tuple[str, ...], *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None\n"
        f"sys.argv = ['jobtrail', *{list(args)!r}]\n"
        "from jobtrail.interfaces.entry import main\n"
        "main()\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


def assert_names_extra(done: subprocess.CompletedProcess[str], extra: str) -> None:
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # one line, no traceback
    assert f"pip install 'jobtrail[{extra}]'" in lines[0]
    assert f"needs the '{extra}' extra" in lines[0]


def test_postgresql_without_the_postgres_extra() -> None:
    done = jobtrail_without(EXTRAS["postgres"], "--db", "postgresql://postgres@127.0.0.1:5432/test", "ops", "list")
    assert_names_extra(done, "postgres")
    assert "psycopg is not installed" in done.stderr


def test_mcp_without_the_mcp_extra(tmp_path: Path) -> None:
    done = jobtrail_without(
        EXTRAS["mcp"], "--db", str(tmp_path / "j.db"), "mcp", "--provider", str(EXAMPLE), "--agent", "a"
    )
    assert_names_extra(done, "mcp")
    assert "MCP server" in done.stderr


@pytest.mark.parametrize("missing", EXTRAS["webhooks"])
def test_webhooks_serve_without_the_webhooks_extra(tmp_path: Path, missing: str) -> None:
    done = jobtrail_without((missing,), "--db", str(tmp_path / "j.db"), "webhooks", "serve", "--provider", str(EXAMPLE))
    assert_names_extra(done, "webhooks")
    assert f"{missing} is not installed" in done.stderr


@pytest.mark.parametrize("missing", EXTRAS["otel"])
def test_worker_metrics_port_without_the_otel_extra(tmp_path: Path, missing: str) -> None:
    done = jobtrail_without(
        (missing,), "--db", str(tmp_path / "j.db"), "worker", "--provider", str(EXAMPLE), "--metrics-port", "0"
    )
    assert_names_extra(done, "otel")
    assert f"({missing}" in done.stderr and "is not installed" in done.stderr


def test_demo_without_the_webhooks_extra(tmp_path: Path) -> None:
    done = jobtrail_without(EXTRAS["webhooks"], "demo", cwd=tmp_path)
    assert_names_extra(done, "webhooks")
    assert not (tmp_path / "jobtrail-demo.db").exists(), "the demo stopped before it started anything"


def test_the_core_commands_need_no_extra_and_no_alembic_on_an_up_to_date_ledger(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    Store.open(db).close()  # created (and migrated) with everything installed
    blocked = EVERY_EXTRA + MIGRATION_ONLY
    listed = jobtrail_without(blocked, "--db", str(db), "ops", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) == {"count": 0, "total": 0, "items": []}
    checked = jobtrail_without(EVERY_EXTRA, "providers", "check", str(EXAMPLE))
    assert checked.returncode == 0, checked.stderr
    helped = jobtrail_without(blocked, "--help")
    assert helped.returncode == 0 and "Usage: jobtrail" in helped.stdout


def test_a_new_ledger_is_created_on_the_core_install(tmp_path: Path) -> None:
    """Only the first open (or an upgrade) loads Alembic; it is part of the core install."""
    done = jobtrail_without(EVERY_EXTRA, "--db", str(tmp_path / "new.db"), "ops", "list", "--json")
    # a read-only command refuses a missing file rather than creating an empty ledger
    assert done.returncode == 2 and "no database" in done.stderr
    made = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\n"
            f"for name in {EVERY_EXTRA!r}:\n"
            "    sys.modules[name] = None\n"
            "from jobtrail import Store\n"
            f"Store.open({str(tmp_path / 'new.db')!r}).close()\n",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert made.returncode == 0, made.stderr


def test_version() -> None:
    from importlib.metadata import version

    done = jobtrail_without((), "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"jobtrail {version('jobtrail')}"
