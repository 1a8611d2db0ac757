"""Log lines of the long-running commands: a default handler, levels, JSON lines that name the operation
and its trace, and the redacting filter in front of every line."""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jobtrail import Store
from jobtrail.domain.redact import REDACTED, Redactor, Secret, install_log_redaction
from jobtrail.flows.telemetry import action_span
from jobtrail.interfaces.logs import CONFIGURED, configure_logging
from jobtrail.testing import FakeProvider

from helpers import free_port, spec, wait_for_port
from processes import (
    finish,
    pipe_capacity,
    start_worker,
    stop_midway_through_a_write,
    submit_many,
    write_provider,
)

log = logging.getLogger("jobtrail")


@pytest.fixture
def restore_logging() -> Iterator[None]:
    """configure_logging changes process-wide loggers: put them back after the test."""
    loggers = [logging.getLogger(name) for name in CONFIGURED] + [logging.getLogger()]
    kept = {logger: (logger.level, list(logger.handlers), logger.propagate) for logger in loggers}
    yield
    for logger, (level, handlers, propagate) in kept.items():
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate = propagate


def _lines(err: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in err.splitlines() if line.startswith("{")]


def test_json_lines_name_the_operation_and_its_trace(
    restore_logging: None, store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    """Inside an action every line carries the operation id and trace id; outside, neither."""
    configure_logging("info", "json")
    op, _ = store.create_operation(spec())
    with action_span(op, "poll"):
        log.info("polled %s", "once")
    log.info("between actions")
    lines = _lines(capsys.readouterr().err)
    inside = next(line for line in lines if line["message"] == "polled once")
    assert inside["operation_id"] == op.operation_id and inside["trace_id"] == op.trace_id
    assert inside["level"] == "info" and inside["logger"] == "jobtrail"
    outside = next(line for line in lines if line["message"] == "between actions")
    assert "operation_id" not in outside and "trace_id" not in outside


def test_the_redacting_filter_is_in_front_of_the_handler(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A secret in a message, in an argument, or in an exception, from any logger under ours, is masked."""
    configure_logging("debug", "text")
    canary = f"jtcanary_{secrets.token_hex(8)}"
    ledger = Redactor()  # an open ledger's, which joins the logs (as a worker's does)
    install_log_redaction(ledger)
    Secret(canary, redactor=ledger)
    logging.getLogger("jobtrail.sub").warning("token %s sent", canary)
    try:
        raise ConnectionError(f"reset while sending key={canary}")
    except ConnectionError:
        log.exception("create failed")
    logging.getLogger("aiohttp.client").error("Authorization: Bearer %s", canary)
    err = capsys.readouterr().err
    assert canary not in err
    assert err.count(REDACTED) >= 3, err
    assert "ConnectionError" in err


def test_log_level_drops_lower_lines_and_configuring_twice_keeps_one_handler(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("info", "text")
    configure_logging("warning", "json")
    log.info("not shown")
    log.warning("shown")
    lines = _lines(capsys.readouterr().err)
    assert [line["message"] for line in lines] == ["shown"]


def test_worker_logs_a_failed_action_as_one_json_line(tmp_path: Path) -> None:
    """``worker --log-format json --log-level error``: an action that raises is one line naming the operation,
    its state, its trace and the exception (type and message), not a bare ``'result_ref'``."""
    db_url = str(tmp_path / "jobs.db")  # one engine: what is tested here does not depend on it
    fake = FakeProvider(job_duration_s=0.1).start()
    try:
        (op_id,) = submit_many(db_url, fake, 1)
        proc = start_worker(
            db_url,
            write_provider(tmp_path / "fake.toml", fake),
            "logs",
            "--timeout",
            "2",
            "--log-format",
            "json",
            "--log-level",
            "error",
            env={"JOBTRAIL_FAILPOINTS": "observe.after_status=raise"},
        )
        code, _out, err = finish(proc)
        assert code == 0, err
        with Store.open(db_url) as store:
            op = store.get(op_id)
        # (the summary at exit is said at any level: what the command owes its reader, not log chatter)
        lines = [line for line in _lines(err) if line.get("worker") != "logs"]
        assert lines, err
        assert all(line["level"] == "error" for line in lines), lines
        failed = lines[0]
        assert failed["operation_id"] == op_id and failed["trace_id"] == op.trace_id
        message = str(failed["message"])
        assert op_id in message and "in state" in message and "FailpointHit" in message, message
    finally:
        fake.stop()


def test_under_json_lines_the_workers_stderr_is_json_lines_to_its_end_summary_included(tmp_path: Path) -> None:
    """``worker --log-format json`` off a terminal: every line on stderr is one JSON object, the summary at
    exit too (at info, with its figures as fields), so a log shipper that reads JSON lines drops nothing."""
    db_url = str(tmp_path / "jobs.db")  # one engine: what is tested here does not depend on it
    fake = FakeProvider(job_duration_s=0.1).start()
    try:
        submit_many(db_url, fake, 2)
        provider = write_provider(tmp_path / "fake.toml", fake)
        proc = start_worker(db_url, provider, "shipped", "--until-settled", "--timeout", "30", "--log-format", "json")
        code, _out, err = finish(proc)
        assert code == 0, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert lines, err
        docs = [json.loads(line) for line in lines]  # fails on any line that is not JSON
        (summary,) = [doc for doc in docs if doc.get("worker") == "shipped"]
        assert summary["level"] == "info" and summary["message"].startswith("jobtrail worker shipped:")
        assert summary["operations"] == {"succeeded": 2} and summary["actions"] >= 6 and summary["errors"] == 0
        # the summary is what the command owes its reader, not log chatter: --log-level warning keeps it
        submit_many(db_url, fake, 1)
        proc = start_worker(
            db_url,
            provider,
            "quiet",
            "--until-settled",
            "--timeout",
            "30",
            "--log-format",
            "json",
            "--log-level",
            "warning",
        )
        code, _out, err = finish(proc)
        assert code == 0, err
        (summary,) = [doc for doc in map(json.loads, err.splitlines()) if doc.get("worker") == "quiet"]
        assert summary["operations"] == {"succeeded": 3}
    finally:
        fake.stop()


def test_under_json_lines_the_commands_own_notices_are_json_lines_too(tmp_path: Path) -> None:
    """Found by a probe: under ``--log-format json`` the worker still wrote "jobtrail: made a new, empty
    ledger ..." and "--timeout ran out ..." as plain text. They are log lines like the others now."""
    fake = FakeProvider(job_duration_s=0.1).start()
    try:
        provider = write_provider(tmp_path / "fake.toml", fake)
        fresh = str(tmp_path / "fresh.db")  # no ledger there yet: the worker makes one, and says so
        code, _out, err = finish(start_worker(fresh, provider, "new", "--until-settled", "--log-format", "json"))
        assert code == 0, err
        docs = [json.loads(line) for line in err.splitlines() if line.strip()]
        made = [doc for doc in docs if "made a new, empty ledger" in str(doc["message"])]
        assert len(made) == 1 and made[0]["level"] == "warning", docs
        db_url = str(tmp_path / "jobs.db")
        fake.job_duration_s = 30
        submit_many(db_url, fake, 1)
        args = ("--until-settled", "--timeout", "1", "--log-format", "json")
        code, _out, err = finish(start_worker(db_url, provider, "short", *args))
        assert code != 0, err
        docs = [json.loads(line) for line in err.splitlines() if line.strip()]
        assert any("--timeout 1 s ran out" in str(doc["message"]) for doc in docs), docs
    finally:
        fake.stop()


@pytest.mark.skipif(not os.path.exists("/proc/self/wchan"), reason="needs Linux's /proc/<pid>/wchan")
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_a_line_longer_than_the_pipe_arrives_whole_from_the_command_under_pythonunbuffered(stream: str) -> None:
    """Under PYTHONUNBUFFERED=1 Python writes standard output and error raw, and a stopped write dropped the
    rest of a long log line or document: what the ``jobtrail`` entry sets up first writes each line whole."""
    size = 4 * pipe_capacity()
    program = (
        "import sys; from jobtrail.interfaces.entry import _whole_writes; _whole_writes(); "
        f"sys.{stream}.write('x' * {size} + '\\n'); sys.{stream}.write('next line\\n')"
    )
    pipe = {stream: subprocess.PIPE}
    with subprocess.Popen(
        [sys.executable, "-c", program], env={**os.environ, "PYTHONUNBUFFERED": "1"}, **pipe
    ) as command:
        stop_midway_through_a_write(command.pid)
        out = getattr(command, stream).read()
        assert command.wait(60) == 0
    assert out == b"x" * size + b"\nnext line\n", f"{len(out)} bytes"


def _mcp_session(db: str, provider: Path, *more: str) -> tuple[subprocess.Popen[bytes], Callable[..., Any]]:
    """A `jobtrail mcp` process spoken to on its pipes, initialized, and a function that calls one tool."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobtrail", "--db", db, "mcp", "--provider", str(provider), "--agent", "bot", *more],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    ids = iter(range(1, 1_000_000))

    def send(method: str, params: dict[str, Any] | None = None) -> Any:
        request_id = next(ids)
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(message).encode() + b"\n")
        proc.stdin.flush()
        reply = json.loads(proc.stdout.readline())
        assert reply["id"] == request_id, reply
        return reply

    hello = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}
    send("initialize", hello)
    proc.stdin.write(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}\n')
    proc.stdin.flush()

    def call(tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = send("tools/call", {"name": tool, "arguments": arguments})["result"]
        return result

    return proc, call


def _stderr_at_exit(proc: subprocess.Popen[bytes]) -> str:
    """Its stdin closed (the agent went away): everything it wrote on stderr until it exited by itself."""
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    return err.decode("utf-8", "replace")


def test_under_json_lines_an_mcp_servers_stderr_is_json_lines_each_written_once(tmp_path: Path) -> None:
    """Found by a probe: `jobtrail mcp --log-format json` wrote each of jobtrail's lines twice, once as JSON
    and once as a Rich block from the handler the MCP SDK puts on the root logger (unmasked, not in the
    format asked for). Every line on stderr is one JSON object, and each is written once."""
    db = str(tmp_path / "jobs.db")
    Store.open(db).close()
    fake = FakeProvider(job_duration_s=0.2).start()
    try:
        provider = write_provider(tmp_path / "fake.toml", fake)
        proc, call = _mcp_session(db, provider, "--with-worker", "--log-format", "json")
        failing = {"prompt": "x", "fail": True, "fake": {"duration": 0.2, "failure": "line1\nline2 \x1b[31mRED"}}
        submitted = call("submit_job", {"provider": "fake", "operation_key": "f1", "request": failing})
        assert not submitted.get("isError"), submitted
        for _ in range(30):
            waited = call("wait_for_change", {"operation_id": "f1", "timeout_s": 5})["structuredContent"]
            if waited["settled"]:
                break
        assert waited["state"] == "failed", waited
        assert call("job_status", {"operation_id": "nothing-of-mine"})["isError"] is True
        err = _stderr_at_exit(proc)
    finally:
        fake.stop()
    lines = [line for line in err.splitlines() if line.strip()]
    docs = [json.loads(line) for line in lines]  # fails on any line that is not JSON
    assert all(isinstance(doc, dict) for doc in docs), lines
    messages = [str(doc["message"]) for doc in docs]
    created = [m for m in messages if m.endswith("created (state create_pending)")]
    assert len(created) == 1, messages


def test_an_mcp_server_that_sent_a_create_itself_exits_without_an_unclosed_session(tmp_path: Path) -> None:
    """Found by a probe: a `jobtrail mcp` without a worker sends a create itself, and at exit its provider's
    HTTP session was left to the garbage collector: "Unclosed client session" / "Unclosed connector" errors
    on stderr, which an operator reads as a fault. The server closes them as it ends."""
    db = str(tmp_path / "jobs.db")
    Store.open(db).close()
    fake = FakeProvider(job_duration_s=30).start()
    try:
        provider = write_provider(tmp_path / "fake.toml", fake)
        proc, call = _mcp_session(db, provider, "--log-format", "json")
        submitted = call("submit_job", {"provider": "fake", "operation_key": "k1", "request": {"prompt": "x"}})
        assert submitted["structuredContent"]["state"] == "accepted", submitted
        err = _stderr_at_exit(proc)
    finally:
        fake.stop()
    assert fake.counts["jobs_created"] == 1
    assert "Unclosed" not in err and "error" not in [json.loads(line)["level"] for line in err.splitlines()], err


def test_under_json_lines_an_mcp_server_over_http_says_where_it_listens_in_a_json_line(tmp_path: Path) -> None:
    """Found by a probe: (its `mcp --log-format json` finding, over --http) the line naming the server's
    address was plain text among the JSON lines. It is one of them."""
    import signal

    db = str(tmp_path / "jobs.db")
    Store.open(db).close()
    fake = FakeProvider()  # never started: nothing is sent
    provider = fake.write_provider_file(tmp_path / "fake.toml", base_url="http://127.0.0.1:9")
    port = free_port()
    command = ["mcp", "--provider", str(provider), "--http", str(port), "--log-format", "json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobtrail", "--db", db, *command],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for_port(port, proc)
        proc.send_signal(signal.SIGTERM)  # (Ctrl-C's goodbye is the CLI's own line, not a log line)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    docs = [json.loads(line) for line in err.decode().splitlines() if line.strip()]  # fails on a line not JSON
    assert f"MCP over streamable HTTP on http://127.0.0.1:{port}/mcp" in [doc["message"] for doc in docs], docs
