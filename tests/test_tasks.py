"""Agent tasks across crashes: each restart ends with exactly one side effect per step, or says why not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobtrail import AsyncJobtrail, ConfigError, State, Store
from jobtrail.domain.explain import next_action
from jobtrail.runtime.tasks import step_state
from jobtrail.testing import FakeProvider

SCRIPT = Path(__file__).parent / "scripts" / "agent_task.py"


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    provider = FakeProvider(job_duration_s=30).start()
    yield provider
    provider.stop()


def run_agent(db: str, cfg: dict[str, Any], failpoint: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env.pop("JOBTRAIL_FAILPOINTS", None)
    if failpoint:
        env["JOBTRAIL_FAILPOINTS"] = f"{failpoint}=exit"
    return subprocess.run(
        [sys.executable, str(SCRIPT), db, json.dumps(cfg)], capture_output=True, text=True, timeout=120, env=env
    )


def explain(db: str, task_id: str = "nightly-export") -> tuple[int, dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "jobtrail", "--db", db, "explain", task_id, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.returncode, json.loads(out.stdout)


@pytest.mark.parametrize(
    ("point", "after_crash"),
    [
        ("task.after_plan", "planned"),  # before submission: key durable, nothing sent
        # these two wait out the dead agent's lease (about 50 s each): long tier
        pytest.param("create.after_attempt", "submitted", marks=pytest.mark.long),  # attempt durable, bytes not sent
        pytest.param("create.after_response", "submitted", marks=pytest.mark.long),  # committed, unconfirmed
        ("create.after_job_id", "confirmed"),  # after the confirmation
    ],
)
def test_a_killed_agent_resumes_its_task_with_one_effect_per_step(
    db_url: str, fake: FakeProvider, point: str, after_crash: str
) -> None:
    cfg = fake.provider_config(timeout_s=5)
    died = run_agent(db_url, cfg, point)
    assert died.returncode == 137, died.stderr
    code, crashed = explain(db_url)
    first = crashed["steps"][0]
    assert first["state"] == after_crash
    assert crashed["next_step"] == ("notify-owner" if after_crash == "confirmed" else "start-export")
    assert code == 0
    sent_at_crash = fake.counts["jobs_created"]
    again = run_agent(db_url, cfg)
    assert again.returncode == 0, again.stderr
    final = json.loads(again.stdout.strip().splitlines()[-1])
    assert [s["state"] for s in final["steps"]] == ["confirmed", "confirmed"]
    # confirmed is not done: steps whose jobs still run are named, with what happens next
    running = [s["name"] for s in final["steps"] if s["operation_state"] in ("accepted", "observing")]
    assert final["running"] == running
    if running:
        assert final["next_action"].startswith(f"wait: every step is confirmed and {len(running)} still running")
        assert all(name in final["next_action"] for name in running) and "a worker will poll" in final["next_action"]
    else:
        assert final["next_action"].startswith("nothing: every step is confirmed and ended")
    with Store.open(db_url) as store:
        for step in final["steps"]:
            token = store.get(step["operation_id"]).idempotency_token
            assert fake.jobs_for(token) == [step["receipt"]["remote_job_id"]]
    assert fake.counts["jobs_created"] == 2
    print(
        f"| {point} | {after_crash}: {first['next_action']} | confirmed, confirmed | "
        f"jobs at crash {sent_at_crash}, after restart {fake.counts['jobs_created']} |"
    )


@pytest.mark.long  # waits out a dead agent's lease (about a minute)
def test_without_a_reconciliation_path_the_step_is_unresolved_and_not_repeated(db_url: str) -> None:
    fake = FakeProvider(job_duration_s=30, idempotency=False).start()
    try:
        cfg = fake.provider_config(timeout_s=5, create={"token": {"in": "none"}}, reconcile=None)
        died = run_agent(db_url, cfg, "create.after_response")
        assert died.returncode == 137
        again = run_agent(db_url, cfg)
        assert again.returncode == 0, again.stderr
        code, explained = explain(db_url)
        assert code == 3  # a person must decide
        first, second = explained["steps"]
        assert first["state"] == "unresolved" and "at-most-once not guaranteed" in first["receipt"]["why"]
        assert "a person decides" in first["next_action"] and second["state"] == "planned"
        assert fake.counts["creates_received"] == 1  # never repeated automatically
        again_twice = run_agent(db_url, cfg)
        assert again_twice.returncode == 0 and fake.counts["creates_received"] == 1
        print(
            f"| create.after_response, no reconciliation path | unresolved: {first['next_action']} | "
            f"unresolved, planned | jobs {fake.counts['jobs_created']} (never repeated) |"
        )
    finally:
        fake.stop()


def test_a_changed_step_is_a_new_step(tmp_path: Path, fake: FakeProvider) -> None:
    import asyncio

    from jobtrail import OperationKeyConflict

    async def go() -> None:
        async with AsyncJobtrail(tmp_path / "t.db", providers=[fake.provider_config()]) as jt:
            task = await jt.task("t1")
            await task.step("a", provider="fake", request={"v": 1})
            await task.step("a", provider="fake", request={"v": 1})  # idempotent
            with pytest.raises(OperationKeyConflict, match="a changed step is a new step"):
                await task.step("a", provider="fake", request={"v": 2})
            assert [s.state for s in task.steps()] == ["planned"]

    asyncio.run(go())


def test_a_step_whose_key_no_submit_could_take_is_refused_before_it_is_planned(
    tmp_path: Path, fake: FakeProvider
) -> None:
    """A step is planned durably before anything is sent: one planned under a key the submit then refuses would
    stay planned for good, never run. Its key (the task's id and the step's name) is checked first."""
    import asyncio

    from jobtrail import UsageError

    async def go() -> None:
        async with AsyncJobtrail(tmp_path / "t.db", providers=[fake.provider_config()]) as jt:
            with pytest.raises(UsageError, match="the caller holds U\\+202E"):
                await jt.task("t0", caller="agent\u202e")
            task = await jt.task("t1")
            for name in ("night\u200bly", "a\nb", "x" * 300):
                with pytest.raises(UsageError, match="operation key"):
                    await task.step(name, provider="fake", request={"v": 1})
            assert task.steps() == []
            persian = "\u0631\u0633\u06cc\u062f\u200c\u0647\u0627"  # its ZWNJ included (escaped: ruff reads Latin)
            await task.step(persian, provider="fake", request={"v": 1})
            assert [s.state for s in task.steps()] == ["planned"]

    asyncio.run(go())


def test_every_state_has_exactly_one_next_action() -> None:
    """The explain table is complete: every operation state and every step state maps to an action."""
    from jobtrail.domain.record import Operation

    base = {f: None for f in Operation.__dataclass_fields__}
    actions = {}
    for state in State:
        op = Operation(**{**base, "state": state, "attempts": 0, "polls": 0, "lease_epoch": 0, "version": 1})
        actions[state] = next_action(op)
        assert actions[state] and isinstance(actions[state], str)
    assert len(set(actions.values())) >= 10
    assert step_state(None) == "planned"


def test_token_retention_shorter_than_the_create_deadline_warns_or_refuses(
    tmp_path: Path, fake: FakeProvider, caplog: pytest.LogCaptureFixture
) -> None:
    import asyncio
    from datetime import timedelta

    cfg = fake.provider_config(create={"token_retention_s": 600})

    async def go(policy: str) -> None:
        async with AsyncJobtrail(tmp_path / f"{policy}.db", providers=[cfg], retention_policy=policy) as jt:
            await jt.submit("fake", {"x": 1}, create_deadline=timedelta(hours=1))
            await jt.submit("fake", {"x": 2}, create_deadline=timedelta(minutes=5))  # inside: no complaint

    asyncio.run(go("warn"))
    assert "keeps idempotency tokens for 10 min" in caplog.text
    with pytest.raises(ConfigError, match="could create a second job"):
        asyncio.run(go("refuse"))
