"""The agent's story told with the command line's ``--json`` only: real ``jobtrail`` processes, a real
fake provider, a real worker process. An agent that lost its memory finds its operation by key, learns
from one status what to do, sees progress, gets ``created: false`` on a repeat, cancels, waits and
collects; every answer has the documented shape (jobtrail.interfaces.shapes), checked strictly."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_shapes import check

from jobtrail.interfaces.shapes import (
    CancelAnswerJson,
    ErrorJson,
    HistoryListJson,
    OperationListJson,
    OperationShownJson,
    ResultJson,
    StatusJson,
    SubmitJson,
    WaitJson,
)
from jobtrail.testing import FakeProvider

POLL = {"initial_s": 0.1, "factor": 1, "cap_s": 0.2}


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    # no job of the story ends by itself (one is cancelled, the other finishes as its cancel arrives): long
    # enough that a dozen CLI calls on a slow, busy machine (2-4 s each, seen here) still find both running
    provider = FakeProvider(job_duration_s=300).start()
    yield provider
    provider.stop()


class Agent:
    """Runs ``jobtrail --db DB ... --json`` as an agent would: exit code and parsed stdout, nothing else."""

    def __init__(self, db: str, provider: Path) -> None:
        self.db = db
        self.provider = provider

    def run(self, *args: str) -> tuple[int, Any]:
        (answer,) = self.run_all(args)
        return answer

    def run_all(self, *commands: tuple[str, ...]) -> list[tuple[int, Any]]:
        """Commands that only read, run side by side (as several agents' calls would)."""
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "jobtrail", "--db", self.db, *args, "--json"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, "USER": "research-bot"},
            )
            for args in commands
        ]
        answers = []
        for args, proc in zip(commands, procs, strict=True):
            out, _ = proc.communicate(timeout=90)
            lines = out.strip().splitlines()
            doc = [json.loads(line) for line in lines] if args[0] == "submit" else json.loads(out)
            answers.append((proc.returncode, doc))
        return answers

    def submit(self, request: dict[str, Any], key: str) -> tuple[int, list[Any]]:
        return self.run("submit", "--provider", str(self.provider), "--request", json.dumps(request), "--key", key)


@contextlib.contextmanager
def worker(db_url: str, provider: Path, log: Path) -> Iterator[None]:
    """A real worker process (its progress lines go to a file, never a full pipe)."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "jobtrail", "--db", db_url, "worker", "--provider", str(provider), "--id", "w1"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ),
        )
        try:
            yield
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def submitted(agent: Agent, request: dict[str, Any], key: str) -> tuple[int, dict[str, Any]]:
    """``submit --json``: a first line {event: submitted, ...}, then the operation with ``created``."""
    code, lines = agent.submit(request, key)
    first, last = lines
    assert first["event"] == "submitted" and first["operation_id"] == last["operation_id"]
    assert last.pop("event") == "create_finished"
    return code, check(last, SubmitJson)


def progress_seen(agent: Agent, key: str) -> dict[str, Any]:
    for _ in range(100):
        code, status = agent.run("explain", key)
        assert code == 0
        check(status, StatusJson)
        if status["progress"] is not None:
            return status
        time.sleep(0.1)
    raise AssertionError(f"no progress seen: {status}")


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_an_agent_with_only_the_cli_submits_finds_cancels_waits_and_collects(
    db_url: str, fake: FakeProvider, tmp_path: Path
) -> None:
    """Two jobs: one the agent cancels; one that finishes as the cancel arrives, so it succeeded, explain
    says who asked and that the cancel lost the race, and the result is there. ``submit`` sends the
    creates itself; a worker polls, cancels and collects."""
    provider = fake.write_provider_file(tmp_path / "fake.toml", connect_timeout_s=1.0, poll=POLL)
    agent = Agent(db_url, provider)
    request = {"prompt": "summarise"}
    code, op = submitted(agent, request, "report-1")
    assert code == 0 and op["created"] is True and op["state"] == "accepted" and op["caller"] == "research-bot"
    code, race = submitted(agent, {"prompt": "race", "fake": {"cancel": "finish_first"}}, "race-1")
    assert code == 0 and race["created"] is True
    with worker(db_url, provider, tmp_path / "worker.out"):
        the_story_goes_on(agent, fake, op)


def the_story_goes_on(agent: Agent, fake: FakeProvider, op: dict[str, Any]) -> None:
    request = {"prompt": "summarise"}
    # the agent lost its memory: it has its key, and one status says what to do
    status = progress_seen(agent, "report-1")
    assert status["operation_id"] == op["operation_id"] and 0 <= status["progress"] < 1
    assert status["next_action"].startswith("poll the remote job") and status["advice"].startswith("wait:")
    assert status["cancel"] is None and status["no_worker"] is None

    code, again = submitted(agent, request, "report-1")
    assert code == 0 and again["created"] is False and again["operation_id"] == op["operation_id"]
    code, changed = agent.submit({"prompt": "something else"}, "report-1")
    (refused,) = changed
    check(refused, ErrorJson)
    assert code == refused["error"]["exit_code"] == 2 and "a changed request is a new operation" in str(refused)

    (code, listed), (shown_code, shown), (history_code, history) = agent.run_all(
        ("ops", "list", "--state", "accepted", "--state", "observing", "--provider", "fake"),
        ("ops", "show", "report-1"),
        ("ops", "history", "report-1"),
    )
    assert code == 0 and check(listed, OperationListJson)["total"] == 2
    assert shown_code == 0 and check(shown, OperationShownJson)["result"] is None
    assert history_code == 0 and check(history, HistoryListJson)["count"] == history["total"] >= 2

    for key, by in (("race-1", "alice"), ("report-1", "agent:research-bot")):
        code, asked = agent.run("cancel", key, "--by", by, "--reason", "not needed")
        assert code == 0 and check(asked, CancelAnswerJson)["outcome"] == "requested"
        assert asked["operation"]["cancel_requested_by"] == by
    code, waited = agent.run("wait", "report-1", "--timeout", "60")
    assert code == 0 and check(waited, WaitJson)["state"] == "cancelled" and waited["settled"]
    assert waited["cancel"]["standing"] == "confirmed" and waited["cancel"]["requested_by"] == "agent:research-bot"
    (code, result), (race_code, waited) = agent.run_all(("result", "report-1"), ("wait", "race-1", "--timeout", "60"))
    assert code == 1 and check(result, ResultJson)["result"] is None and result["why"]

    # the cancel that lost the race
    assert race_code == 0 and check(waited, WaitJson)["state"] == "succeeded"
    (code, status), (result_code, result), (missing_code, missing) = agent.run_all(
        ("explain", "race-1"), ("result", "race-1"), ("explain", "report-9")
    )
    assert code == 0 and check(status, StatusJson)["cancel_requested_by"] == "alice"
    story = status["cancel"]
    assert story["standing"] == "lost_race" and story["requested_by"] == "alice" and story["reason"] == "not needed"
    assert "lost the race" in story["says"] and "succeeded; its result is stored" in story["says"]
    assert "lost the race" in status["advice"] and status["advice"].startswith("fetch the result")
    assert result_code == 0 and check(result, ResultJson)["why"] is None
    assert result["result"]["output"]["echo"]["prompt"] == "race" and result["sha256"]
    assert missing_code == 1 and check(missing, ErrorJson)["error"]["exit_code"] == 1
    assert fake.counts["jobs_created"] == 2 and fake.counts["cancels"] == 2


def test_every_cancel_tells_who_asked_and_how_it_stands(db_url: str) -> None:
    """A cancel before the job id is known is deferred, one after the ending sent nothing, and one past
    its deadline waits for a person: the status says which, and who asked."""
    from jobtrail import Store
    from jobtrail.flows.cancel import request_cancel
    from jobtrail.interfaces.answers import status_json

    from helpers import S, op_in

    with Store.open(db_url) as store:
        early, done = op_in(store, S.CREATE_PENDING), op_in(store, S.SUCCEEDED)
        late = op_in(store, S.CANCELLATION_UNCONFIRMED)
        for op in (early, done):
            request_cancel(store, op.operation_id, requested_by="dave", reason="changed my mind")
        deferred, after, unconfirmed = (
            status_json(store, store.get(op.operation_id))["cancel"] for op in (early, done, late)
        )
    assert deferred is not None and deferred["standing"] == "deferred" and deferred["requested_by"] == "dave"
    assert "before the job id was known" in deferred["says"]
    assert after is not None and after["standing"] == "after_the_end"
    assert "after the job had ended (succeeded); nothing was sent" in after["says"]
    assert unconfirmed is not None and unconfirmed["standing"] == "unconfirmed"
