"""Every named failpoint is reachable: switched on, it stops the code exactly there."""

from __future__ import annotations

import asyncio
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from jobtrail import AsyncJobtrail, State, Store
from jobtrail.domain.failpoints import FAILPOINTS, FailpointHit, failpoint, failpoint_handler
from jobtrail.flows.cancel import CancelFlow
from jobtrail.flows.observe import CollectFlow, ObserveFlow
from jobtrail.ledger.writer import Writer
from jobtrail.testing import FakeProvider


async def reach(point: str, jt: AsyncJobtrail, store: Store) -> None:
    if point == "task.after_plan":
        task = await jt.task("t")
        await task.step("s", provider="fake", request={"x": 1})
        await task.run("s", {"x": 1})
    elif point == "collect.after_fetch":
        op = await jt.drive_create((await jt.submit("fake", {"x": 2})).operation_id)
        while op.state is not State.RESULT_COLLECTING:  # the fake job takes 0.1 s
            await asyncio.sleep(0.05)
            op = await ObserveFlow(store, Writer(store), actor="t").advance(
                store.get(op.operation_id), jt.provider("fake")
            )
        await CollectFlow(store, Writer(store), actor="t").advance(op, jt.provider("fake"))
    elif point.startswith(("cancel.", "observe.")):
        op = await jt.drive_create((await jt.submit("fake", {"x": 4, "fake": {"duration": 30}})).operation_id)
        if point == "observe.after_status":
            due = op.next_action_at_us or 0
            await asyncio.sleep(max(due - store.clock(), 0) / 1e6 + 0.01)  # the first poll is due
            await ObserveFlow(store, Writer(store), actor="t").advance(op, jt.provider("fake"))
        await jt.cancel(op.operation_id, requested_by="alice", reason="test")
        await CancelFlow(store, Writer(store), actor="t").advance(store.get(op.operation_id), jt.provider("fake"))
    else:
        op = await jt.submit("fake", {"x": 3})
        await jt.drive_create(op.operation_id)


@pytest.mark.parametrize("point", sorted(FAILPOINTS))
def test_each_named_failpoint_is_reachable(point: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeProvider(job_duration_s=0.1).start()
    store = Store.open(tmp_path / "f.db")
    jt = AsyncJobtrail(
        store=store, providers=[fake.provider_config(poll={"initial_s": 0.01, "factor": 1, "cap_s": 0.01})]
    )
    monkeypatch.setenv("JOBTRAIL_FAILPOINTS", f"{point}=raise")

    async def go() -> Any:
        try:
            await reach(point, jt, store)
        finally:
            await jt.provider("fake").aclose()

    try:
        with pytest.raises(FailpointHit, match=point):
            asyncio.run(go())
    finally:
        store.close()
        fake.stop()


def test_failpoints_are_inert_unless_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOBTRAIL_FAILPOINTS", raising=False)
    failpoint("create.after_attempt")  # nothing happens
    monkeypatch.setenv("JOBTRAIL_FAILPOINTS", "create.after_response=raise")
    failpoint("create.after_attempt")  # another point: nothing happens
    with pytest.raises(FailpointHit):
        failpoint("create.after_response")


def test_a_handler_replaces_the_environment_only_where_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation's hook: called at every point reached in its own context, whatever the environment
    says; code running elsewhere in the process (another thread) still obeys the environment."""
    monkeypatch.setenv("JOBTRAIL_FAILPOINTS", "create.after_response=raise")
    seen: list[str] = []
    elsewhere: list[BaseException] = []

    def other_thread() -> None:
        try:
            failpoint("create.after_response")
        except FailpointHit as exc:
            elsewhere.append(exc)

    with failpoint_handler(seen.append):
        failpoint("create.after_response")  # the handler decides, and it does not raise
        failpoint("collect.after_fetch")
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen == ["create.after_response", "collect.after_fetch"]
    assert len(elsewhere) == 1  # the plain thread never saw the handler
    with pytest.raises(FailpointHit):
        failpoint("create.after_response")


def test_the_readme_lists_every_failpoint() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    section = readme.split("**Failpoints.**", 1)[1].split("##", 1)[0]
    listed = set(re.findall(r"`([a-z]+\.[a-z_]+)`", section))
    assert listed == set(FAILPOINTS)
