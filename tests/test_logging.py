"""Log lines of the long-running commands: a default handler, levels, JSON lines that name the operation
and its trace, and the redacting filter in front of every line."""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobtrail import Store
from jobtrail.domain.redact import REDACTED, Redactor, Secret, install_log_redaction
from jobtrail.flows.telemetry import action_span
from jobtrail.interfaces.logs import configure_logging
from jobtrail.testing import FakeProvider

from helpers import spec
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
    kept = {
        name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers))
        for name in ("jobtrail", "aiohttp", "uvicorn")
    }
    yield
    for name, (level, handlers) in kept.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers[:] = handlers


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
        lines = _lines(err)
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
        # --log-level warning leaves the summary out, as any info line
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
        assert code == 0 and "quiet" not in err, err
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
