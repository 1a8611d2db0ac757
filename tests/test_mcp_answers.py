"""What the MCP tools take and hand out, at their edges: results nested deeper than structured output
carries, and numbers that are numbers. Real `jobtrail mcp` processes over stdio, the official client."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from test_mcp import result_of

from jobtrail import Jobtrail, Store
from jobtrail.ledger.results import read_result
from jobtrail.testing import FakeProvider

AGENT = "research-bot"


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    provider = FakeProvider(job_duration_s=0.2).start()
    yield provider
    provider.stop()


def served(db: str, provider: Path, calls: list[tuple[str, dict[str, Any]]], *more: str) -> list[Any]:
    """Each call's answer from a `jobtrail mcp` process acting for AGENT."""
    args = ["-m", "jobtrail", "--db", db, "mcp", "--provider", str(provider), "--agent", AGENT, *more]

    async def run() -> list[Any]:
        params = StdioServerParameters(command=sys.executable, args=args, env={**os.environ})
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            answers = []
            for name, arguments in calls:
                if name == "wait_until_settled":
                    for _ in range(60):
                        answer = result_of(await session.call_tool("wait_for_change", arguments))
                        if answer.get("settled"):
                            break
                    answers.append(answer)
                else:
                    answers.append(result_of(await session.call_tool(name, arguments)))
            return answers

    return asyncio.run(run())


def test_get_result_hands_out_a_result_nested_deeper_than_structured_output_carries_as_its_exact_text(
    db_url: str, fake: FakeProvider, tmp_path: Path
) -> None:
    """Found by a probe: a JSON result nested 300 to 900 levels was collected and stored, and `jobtrail
    result` handed it out, but get_result answered only "Error executing tool get_result" (the SDK could
    not serialize it as structured output). Now the agent gets it exactly as stored, as text, with a note
    saying why and how to fetch it as a file."""
    request: dict[str, Any] = {"prompt": "deep"}
    for _ in range(400):  # the agent's own requests nest at most 64 levels: this one comes from a script
        request = {"n": request}
    with Jobtrail(db_url, providers=[fake.provider_config()]) as jt:
        op, _ = jt.ensure("fake", request, key=f"{AGENT}/deep", caller=AGENT)
        jt.drive_create(op.operation_id)
    provider = fake.write_provider_file(
        tmp_path / "fake.toml", connect_timeout_s=1.0, poll={"initial_s": 0.1, "factor": 1, "cap_s": 0.2}
    )
    status, got = served(
        db_url,
        provider,
        [("wait_until_settled", {"operation_id": "deep", "timeout_s": 5}), ("get_result", {"operation_id": "deep"})],
        "--with-worker",
    )
    assert status["state"] == "succeeded", status
    with Store.open(db_url) as store:
        _, stored = read_result(store, op.operation_id)
    assert "error" not in got, got
    assert got["result"] is None and got["result_text"] == stored.decode("utf-8")
    assert json.loads(got["result_text"])["output"]["echo"] == request
    assert "nested" in got["note"] and "result_text holds it exactly as stored" in got["note"], got["note"]
    assert f"result {op.operation_id} --out FILE" in got["note"]


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("create_deadline_s", True),
        ("result_deadline_s", True),
        ("create_deadline_s", "7"),
        ("result_deadline_s", " 9 "),
        ("timeout_s", True),
        ("timeout_s", "5"),
    ],
)
def test_deadlines_and_waits_take_a_json_number_and_nothing_read_as_one(
    argument: str, value: Any, db_url: str, fake: FakeProvider, tmp_path: Path
) -> None:
    """Found by a probe: create_deadline_s, result_deadline_s and timeout_s took "7" and " 9 " as numbers
    and true as 1 (a deadline of one second). Each is refused, naming the argument and what it takes, and
    nothing is submitted; a number with a fraction is a number."""
    provider = fake.write_provider_file(tmp_path / "fake.toml", connect_timeout_s=1.0)
    request = {"provider": "fake", "operation_key": "k", "request": {"prompt": "x"}}
    if argument == "timeout_s":
        calls = [("submit_job", request), ("wait_for_change", {"operation_id": "k", argument: value})]
    else:
        calls = [("submit_job", request | {argument: value}), ("submit_job", request | {argument: 90.5})]
    first, second = served(db_url, provider, calls)
    refused = second if argument == "timeout_s" else first
    assert f"invalid arguments: {argument}: Input should be a valid number" in refused.get("error", ""), refused
    assert "(a JSON number, not text and not true/false)" in refused["error"]
    if argument != "timeout_s":
        made = datetime.fromisoformat(second["created_at"])
        deadline = datetime.fromisoformat(second[argument.removesuffix("_s")])
        assert (deadline - made).total_seconds() == pytest.approx(90.5, abs=0.01)
    with Store.open(db_url) as store:
        assert store.count() == 1
