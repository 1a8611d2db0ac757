"""Agent tasks: a step sends only its planned request, under its own key, as its task's caller, and a step
whose create was refused says so and stops the task."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from jobtrail import AsyncJobtrail, OperationKeyConflict, State, UsageError, Worker
from jobtrail.ledger import task_steps
from jobtrail.testing import FakeProvider, Fault

PLANNED = {"table": "orders"}


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    provider = FakeProvider(job_duration_s=30).start()
    yield provider
    provider.stop()


def test_a_step_run_with_another_request_is_refused_before_anything_is_recorded_or_sent(
    db_url: str, fake: FakeProvider
) -> None:
    """Found by a probe: run() with another request than the planned one recorded it under the step's key
    (a worker then sent it) and only then refused; the planned request could never run after that."""

    async def go() -> None:
        async with AsyncJobtrail(db_url, providers=[fake.provider_config()]) as jt:
            task = await jt.task("nightly-export", caller="agent-7")
            await task.step("start-export", provider="fake", request=PLANNED)
            with pytest.raises(OperationKeyConflict) as refused:
                await task.run("start-export", {"table": "customers", "drop": True})
            assert jt.store.list_operations() == []
            assert "nothing was recorded or sent" in str(refused.value)
            assert [(s.state, s.operation_id) for s in task.steps()] == [("planned", None)]
            await Worker(jt.store, jt.providers).run(until_settled=True, timeout=10)
            assert fake.counts["creates_received"] == 0
            done = await task.run("start-export", PLANNED)
            assert done.state == "confirmed"
            op = jt.store.get(done.operation_id or "")
            assert op.request_body == PLANNED and fake.jobs_for(op.idempotency_token) == [op.remote_job_id]
            # once linked too: the other request is refused, the planned one stands
            with pytest.raises(OperationKeyConflict, match="nothing was recorded or sent"):
                await task.run("start-export", {"table": "customers", "drop": True})
            assert [o.operation_id for o in jt.store.list_operations()] == [op.operation_id]
        assert fake.counts["creates_received"] == 1

    asyncio.run(go())


def test_a_step_whose_create_was_rejected_is_failed_and_the_readme_loop_stops_there(
    db_url: str, fake: FakeProvider
) -> None:
    """Found by a probe: a step whose create the provider refused (400, no job made) was `confirmed`, so the
    README's loop went on to the next step and explain said every step was confirmed."""
    fake.script(Fault.reject(400))
    requests = {"start-export": PLANNED, "notify-owner": {"to": "owner"}}

    async def go() -> list[str]:
        async with AsyncJobtrail(db_url, providers=[fake.provider_config()]) as jt:
            task = await jt.task("nightly-export", caller="agent-7")
            for name, request in requests.items():
                await task.step(name, provider="fake", request=request)
            ran = []
            for step in task.steps():  # the README's loop
                if step.state != "confirmed":
                    step = await task.run(step.name, requests[step.name])
                    ran.append(step.name)
                    if step.state != "confirmed":
                        break
            first, second = task.steps()
            assert (first.state, first.operation_state, second.state) == ("failed", State.FAILED, "planned")
            assert first.receipt is not None and "rejected by the provider: HTTP 400" in first.receipt["why"]
            assert "never sent again" in first.next_action and "new step" in first.next_action
            assert task.next_step() == first
            return ran

    assert asyncio.run(go()) == ["start-export"]
    assert (fake.counts["creates_received"], fake.counts["jobs_created"]) == (1, 0)
    out = subprocess.run(
        [sys.executable, "-m", "jobtrail", "--db", db_url, "explain", "nightly-export", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    explained = json.loads(out.stdout)
    assert explained["next_step"] == "start-export" and "never sent again" in explained["next_action"]
    assert [s["state"] for s in explained["steps"]] == ["failed", "planned"]


def test_a_tasks_step_operations_carry_the_tasks_caller(db_url: str, fake: FakeProvider) -> None:
    """Found by a probe: jt.task(..., caller="agent-7") made operations whose caller was "unknown"."""

    async def go() -> None:
        async with AsyncJobtrail(db_url, providers=[fake.provider_config()]) as jt:
            task = await jt.task("nightly-export", caller="agent-7")
            await task.step("start-export", provider="fake", request=PLANNED)
            first = await task.run("start-export", PLANNED)
            # resumed without naming the caller: the task is still agent-7's
            resumed = await jt.task("nightly-export")
            await resumed.step("notify-owner", provider="fake", request={"to": "owner"})
            second = await resumed.run("notify-owner", {"to": "owner"})
            ops = [jt.store.get(v.operation_id or "") for v in (first, second)]
            assert [op.caller for op in ops] == ["agent-7", "agent-7"]
            assert {op.operation_id for op in jt.store.list_operations(caller="agent-7")} == {
                op.operation_id for op in ops
            }
            with pytest.raises(UsageError, match=r"jt\.task\(\.\.\., caller=\.\.\.\)"):
                await task.run("start-export", PLANNED, caller="agent-9")

    asyncio.run(go())
    assert fake.counts["jobs_created"] == 2


def test_tasks_whose_ids_and_step_names_hold_slashes_each_keep_their_own_effect(
    db_url: str, fake: FakeProvider
) -> None:
    """Found by a probe: task "a"'s step "b/c" and task "a/b"'s step "c" had one key, "a/b/c": task a's step
    showed confirmed before it ran, and running it adopted the other task's operation (one job for two)."""

    async def go() -> None:
        async with AsyncJobtrail(db_url, providers=[fake.provider_config()]) as jt:
            ab, a = await jt.task("a/b", caller="agent-7"), await jt.task("a", caller="agent-7")
            await ab.step("c", provider="fake", request={"same": True})
            theirs = await ab.run("c", {"same": True})
            mine = await a.step("b/c", provider="fake", request={"same": True})
            assert (mine.state, mine.operation_id, mine.operation_state) == ("planned", None, None)
            assert mine.key != theirs.key
            mine = await a.run("b/c", {"same": True})
            assert mine.state == "confirmed" and mine.operation_id != theirs.operation_id
            assert [s.operation_id for s in ab.steps()] == [theirs.operation_id]
            # a step planned before keys were escaped keeps the key it was planned with
            fingerprint = jt.store.get(theirs.operation_id or "").request_fingerprint
            await jt.io(task_steps.plan_step, jt.store, "a", "x/y", "fake", "a/x/y", fingerprint)
            kept = await a.step("x/y", provider="fake", request={"same": True})
            assert kept.key == "a/x/y"

    asyncio.run(go())
    assert fake.counts["jobs_created"] == 2


def test_one_operation_key_names_one_step_across_tasks(db_url: str, fake: FakeProvider) -> None:
    """Found by a probe: two tasks' steps could hold one key and so share one operation; the second is now
    refused when it is planned, with nothing recorded."""

    async def go() -> None:
        async with AsyncJobtrail(db_url, providers=[fake.provider_config()]) as jt:
            one, two = await jt.task("one", caller="agent-7"), await jt.task("two", caller="agent-7")
            await one.step("export", provider="fake", request=PLANNED, key="export-2024")
            with pytest.raises(OperationKeyConflict, match="already the key of step 'export' of task one"):
                await two.step("export", provider="fake", request=PLANNED, key="export-2024")
            assert two.steps() == []

    asyncio.run(go())


def test_a_step_adopts_only_its_own_operation_found_by_its_key(db_url: str, fake: FakeProvider) -> None:
    """Found by a probe: a step not yet linked took whatever operation its key named (another caller's too),
    showed its state and, run, drove it as its own. Its own (recorded before a crash could link it) it keeps."""

    async def go() -> None:
        async with AsyncJobtrail(db_url, providers=[fake.provider_config()]) as jt:
            task = await jt.task("nightly-export", caller="agent-7")
            await task.step("start-export", provider="fake", request=PLANNED, key="export-1")
            other = await jt.submit("fake", PLANNED, key="export-1", caller="agent-9")
            # said as blocked, with what to do, not as planned with an action run() refuses; whose it is, not said
            (view,) = task.steps()
            assert (view.state, view.operation_id, view.operation_state) == ("blocked", None, None)
            assert "new name" in view.next_action and other.operation_id not in str(task.explain())
            assert task.explain()["next_step"] == "start-export" and "agent-9" not in str(task.explain())
            with pytest.raises(OperationKeyConflict, match="not this step's"):
                await task.run("start-export", PLANNED)
            assert [o.operation_id for o in jt.store.list_operations()] == [other.operation_id]
            assert fake.counts["creates_received"] == 0
            # the step's own operation, recorded by a run() that died before it linked it, is adopted and sent once
            await task.step("notify-owner", provider="fake", request={"to": "owner"}, key="notify-1")
            own = await jt.submit("fake", {"to": "owner"}, key="notify-1", caller="agent-7")
            assert task.steps()[1].operation_state is State.CREATE_PENDING
            done = await task.run("notify-owner", {"to": "owner"})
            assert done.operation_id == own.operation_id and done.state == "confirmed"
            assert fake.jobs_for(own.idempotency_token) == [done.receipt and done.receipt["remote_job_id"]]

    asyncio.run(go())
    assert fake.counts["creates_received"] == 1
