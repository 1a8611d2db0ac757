"""Nobody is left guessing whether a worker runs: an overdue operation with no worker for its provider says so."""

from __future__ import annotations

import json
import subprocess
from datetime import timedelta
from pathlib import Path

from jobtrail import Store
from jobtrail.ledger import task_steps
from jobtrail.testing import FakeProvider

from helpers import spec
from processes import cli, finish, start_worker

_MINUTE_US = 60_000_000
HOUR = timedelta(hours=1)


def jobtrail(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return cli("--db", db_url, *args)


def overdue_operation(db_url: str, key: str) -> str:
    """An operation recorded a minute ago and never sent: its create is a minute overdue."""
    with Store.open(db_url) as now:
        then = now.clock() - _MINUTE_US
    with Store.open(db_url, clock=lambda: then) as store:
        op, _ = store.create_operation(
            spec(provider="fake", operation_key=key, create_deadline=HOUR, result_deadline=HOUR, cancel_deadline=HOUR)
        )
    return op.operation_id


def test_an_overdue_operation_without_a_worker_says_so_and_how_to_start_one(
    db_url: str, fake: FakeProvider, tmp_path: Path
) -> None:
    overdue_operation(db_url, "stranded")
    explained = jobtrail(db_url, "explain", "stranded")
    assert "warning: no worker is running for provider fake" in explained.stdout
    assert "none has ever run on this ledger" in explained.stdout
    # the command to start one names this ledger (a worker started on the default one would serve nothing here)
    with Store.open(db_url) as store:
        assert f"Start one: {store.command} worker --provider <its provider file>" in explained.stdout
        assert store.command.startswith("jobtrail --db ")
    doc = json.loads(jobtrail(db_url, "explain", "stranded", "--json").stdout)
    assert doc["no_worker"].startswith("no worker is running for provider fake")
    # what the caller does now is start one, not wait for a worker that is not there
    assert doc["advice"].startswith("no worker is running") and " worker --provider" in doc["advice"]
    listed = jobtrail(db_url, "ops", "list")
    assert "1 listed operation(s) of provider fake are overdue and no worker is running" in listed.stderr
    # a task whose step is that operation says it too, in its text and in its JSON
    with Store.open(db_url) as store:
        op = store.resolve("stranded")
        task_steps.open_task(store, "nightly", "agent")
        task_steps.plan_step(store, "nightly", "export", "fake", "stranded", op.request_fingerprint)
        task_steps.link_step(store, "nightly", "export", op.operation_id)
    assert "warning: no worker is running for provider fake" in jobtrail(db_url, "explain", "nightly").stdout
    task = json.loads(jobtrail(db_url, "explain", "nightly", "--json").stdout)
    (why,) = task["no_worker"]
    assert why.startswith("no worker is running for provider fake")
    waited = jobtrail(db_url, "wait", "stranded", "--timeout", "3")
    assert waited.returncode == 4 and "no worker is running for provider fake" in waited.stderr
    # said while it waits, as soon as it is known, not only once the time-out has passed
    said = [line for line in waited.stderr.splitlines() if "no worker is running" in line]
    assert len(said) == 1 and "still waiting" in said[0], waited.stderr  # once, not again at the time-out

    # a worker runs, settles it and stops: its heartbeat says when it was last seen, and that it stopped
    provider = fake.write_provider_file(tmp_path / "fake.toml")
    code, _, _ = finish(start_worker(db_url, provider, "w1", "--until-settled", "--timeout", "30"))
    assert code == 0
    with Store.open(db_url) as store:
        (seen,) = store.workers_for("fake")
        assert seen["worker_id"] == "w1" and seen["stopped_at_us"] is not None
        store.heartbeat("w-live", ["fake"])  # what a running worker records every few seconds
    overdue_operation(db_url, "later")
    assert "no worker" not in jobtrail(db_url, "explain", "later").stdout  # a live worker serves it
    with Store.open(db_url) as store:
        store.heartbeat("w-live", ["fake"], stopped=True)
    assert "the last one, w-live, was seen at" in jobtrail(db_url, "explain", "later").stdout


def test_an_operation_that_is_not_late_needs_no_warning(db_url: str) -> None:
    with Store.open(db_url) as store:
        store.create_operation(spec(operation_key="fresh", create_deadline=HOUR, result_deadline=HOUR))
    doc = json.loads(jobtrail(db_url, "explain", "fresh", "--json").stdout)
    assert doc["no_worker"] is None and doc["advice"].startswith("wait: a worker will send the create")
