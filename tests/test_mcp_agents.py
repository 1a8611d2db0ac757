"""One MCP server per agent: an agent's operations and keys are its own, and another agent's operation says
nothing of itself. Real `jobtrail mcp` processes over stdio, driven by the official client."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from test_mcp import result_of

from jobtrail import Store
from jobtrail.testing import FakeProvider


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    provider = FakeProvider(job_duration_s=30).start()
    yield provider
    provider.stop()


def served(
    db: str, providers: list[Path], agent: str, test: Callable[[ClientSession], Awaitable[Any]], *more: str
) -> Any:
    """Run ``test`` against a `jobtrail mcp` process acting for ``agent``."""
    args = ["-m", "jobtrail", "--db", db, "mcp", "--agent", agent, *more]
    for provider in providers:
        args += ["--provider", str(provider)]

    async def run() -> Any:
        params = StdioServerParameters(command=sys.executable, args=args, env={**os.environ})
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            return await test(session)

    return asyncio.run(run())


def submit(key: str, request: dict[str, Any], provider: str = "fake") -> tuple[str, dict[str, Any]]:
    return "submit_job", {"provider": provider, "operation_key": key, "request": request}


def calls(*wanted: tuple[str, dict[str, Any]]) -> Callable[[ClientSession], Awaitable[list[Any]]]:
    async def test(session: ClientSession) -> list[Any]:
        return [result_of(await session.call_tool(name, args)) for name, args in wanted]

    return test


@pytest.mark.parametrize("agent", ["a/b", "research\u200bbot", "\u202ebot", " "])
def test_an_agent_name_that_could_share_keys_or_hide_characters_is_refused_before_anything_starts(
    agent: str, tmp_path: Path
) -> None:
    """Found by a probe: agent "a" submitting key "b/c" and agent "a/b" submitting key "c" named one
    ledger key, so one agent was refused its key or told the other's operation id and fingerprint; a name
    with an invisible character reads as another agent's. The server refuses such a name at start, says
    why and what to do, and makes no ledger."""
    fake = FakeProvider()  # never started: nothing may reach it
    provider = fake.write_provider_file(tmp_path / "fake.toml", base_url="http://127.0.0.1:9")
    db = tmp_path / "jobs.db"
    done = subprocess.run(
        [sys.executable, "-m", "jobtrail", "--db", str(db), "mcp", "--provider", str(provider), "--agent", agent],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "agent name (--agent)" in done.stderr and "Traceback" not in done.stderr, done.stderr
    if "/" in agent:
        assert "choose a name without '/'" in done.stderr
    assert not db.exists()


def test_a_key_another_agent_holds_answers_alike_for_any_request_and_names_nothing_of_its_operation(
    db_url: str, fake: FakeProvider, tmp_path: Path
) -> None:
    """Found by a probe: a key that names another agent's operation (here one a --shared server submitted as
    "research-bot/report") was refused with that operation's id and its request's fingerprint when the
    request differed, and with other words when it matched, which told the agent whether the other sent
    the same request. Now both answers are the same words, naming no operation; nothing is sent."""
    provider = fake.write_provider_file(tmp_path / "fake.toml", connect_timeout_s=1.0)
    (theirs,) = served(
        db_url, [provider], "ops", calls(submit("research-bot/report", {"prompt": "the ops report"})), "--shared"
    )
    same, other, status, listed = served(
        db_url,
        [provider],
        "research-bot",
        calls(
            submit("report", {"prompt": "the ops report"}),
            submit("report", {"prompt": "my report"}),
            ("job_status", {"operation_id": "report"}),
            ("list_jobs", {}),
        ),
    )
    assert theirs["operation_id"].startswith("op_"), theirs
    assert "error" in same and same == other, (same, other)
    assert "op_" not in same["error"] and "fingerprint" not in same["error"]
    assert "'report' cannot be used by this agent: choose another key" in same["error"]
    assert "no operation 'report' of yours" in status["error"]
    assert listed["total"] == 0
    assert fake.counts["jobs_created"] == 1
    with Store.open(db_url) as store:
        assert store.count() == 1


def test_a_key_held_with_several_providers_finds_the_agents_own_operation_and_names_no_other(
    db_url: str, fake: FakeProvider, tmp_path: Path
) -> None:
    """Found by a probe: (beside its agent-name finding, of the same cause: the ledger's message is built
    before the server's visibility check) when the agent's key was also held, with another provider, by
    someone else's operation, job_status by the key answered "used with several providers" and listed the
    other operation's id. The agent's own operation is the answer."""
    providers = [
        fake.write_provider_file(tmp_path / "fake.toml", connect_timeout_s=1.0),
        fake.write_provider_file(tmp_path / "fake2.toml", name="fake2", connect_timeout_s=1.0),
    ]
    (theirs,) = served(
        db_url, providers, "ops", calls(submit("research-bot/report", {"prompt": "x"}, "fake2")), "--shared"
    )
    mine, status = served(
        db_url,
        providers,
        "research-bot",
        calls(submit("report", {"prompt": "x"}), ("job_status", {"operation_id": "report"})),
    )
    assert theirs["operation_id"] != mine["operation_id"]
    assert status.get("operation_id") == mine["operation_id"], status
    assert theirs["operation_id"] not in json.dumps(status)


def test_an_agent_is_told_the_longest_key_it_may_give(db_url: str, fake: FakeProvider, tmp_path: Path) -> None:
    """Found by a probe: (while fixing its agent-name finding) the ledger holds an agent's key behind its
    name, so a key of 195 characters from
    agent "research-bot" was refused as "at most 200 characters". The answer says how long it may be."""
    provider = fake.write_provider_file(tmp_path / "fake.toml", connect_timeout_s=1.0)
    room = 200 - len("research-bot/")
    (too_long, longest) = served(
        db_url,
        [provider],
        "research-bot",
        calls(submit("k" * (room + 1), {"prompt": "x"}), submit("k" * room, {"prompt": "x"})),
    )
    assert f"operation_key must be 1 to {room} characters for this agent" in too_long["error"], too_long
    assert longest["operation_key"] == "k" * room and longest["created"] is True
