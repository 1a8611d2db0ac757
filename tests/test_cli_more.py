"""The remaining commands as real processes: wait, worker, webhooks serve."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from jobtrail import Store
from jobtrail.testing import FakeProvider, send_webhook

from helpers import free_port, wait_for_port
from processes import cli, finish, start_worker

jobtrail = cli


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    provider = FakeProvider(job_duration_s=0.5).start()
    yield provider
    provider.stop()


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
def test_submit_worker_wait(db_url: str, fake: FakeProvider, tmp_path: Path) -> None:
    provider = fake.write_provider_file(tmp_path / "fake.toml", connect_timeout_s=1.0)
    submitted = jobtrail("--db", db_url, "submit", "--provider", str(provider), "--request", '{"n": 1}', "--json")
    assert submitted.returncode == 0, submitted.stderr
    op_id = json.loads(submitted.stdout.splitlines()[0])["operation_id"]
    worker = start_worker(db_url, provider, "w1", "--until-settled", "--timeout", "60", "--lease", "10")
    waited = jobtrail("--db", db_url, "wait", op_id, "--timeout", "60", "--json")
    assert finish(worker)[0] == 0
    assert waited.returncode == 0, waited.stderr
    doc = json.loads(waited.stdout)
    assert doc["settled"] is True and doc["state"] == "succeeded"
    result = jobtrail("--db", db_url, "result", op_id, "--json")
    assert json.loads(result.stdout)["checks"][0]["check"] == "size"


def test_wait_times_out_when_no_worker_runs(db_url: str, fake: FakeProvider, tmp_path: Path) -> None:
    provider = fake.write_provider_file(
        tmp_path / "fake.toml",
    )
    op_id = jobtrail("--db", db_url, "submit", "--provider", str(provider), "--request", '{"n": 2}').stdout.split()[0]
    waited = jobtrail("--db", db_url, "wait", op_id, "--timeout", "0.5")
    assert waited.returncode == 4 and "still accepted after 0.5 s" in waited.stderr  # 4: not an ending
    as_json = jobtrail("--db", db_url, "wait", op_id, "--timeout", "0.2", "--json")
    assert as_json.returncode == 4 and json.loads(as_json.stdout)["settled"] is False


def test_a_worker_that_runs_out_of_time_before_settling_says_so(db_url: str, tmp_path: Path) -> None:
    slow = FakeProvider(job_duration_s=30).start()
    try:
        provider = slow.write_provider_file(tmp_path / "fake.toml")
        jobtrail("--db", db_url, "submit", "--provider", str(provider), "--request", '{"n": 3}')
        code, _, err = finish(start_worker(db_url, provider, "w1", "--until-settled", "--timeout", "1"))
    finally:
        slow.stop()
    assert code == 4 and "ran out with operations still to act on" in err


def test_errors_under_json_are_json_with_their_exit_code(db_url: str) -> None:
    Store.open(db_url).close()  # a ledger: a read command refuses a database without one (tests/test_cli_ops.py)
    missing = jobtrail("--db", db_url, "ops", "show", "no-such-key", "--json")
    assert missing.returncode == 1
    assert json.loads(missing.stdout)["error"]["exit_code"] == 1 and "no-such-key" in missing.stdout
    bad = jobtrail("--db", db_url, "wait", "x", "--timeout", "soon", "--json")
    error = json.loads(bad.stdout)["error"]
    assert bad.returncode == 2 and error["exit_code"] == 2 and "--timeout" in error["message"]


@contextlib.contextmanager
def _webhooks_server(db_url: str, provider: Path, secret: str) -> Iterator[str]:
    """`jobtrail webhooks serve` in a process of its own, once it answers: its delivery URL for provider fake."""
    port = free_port()
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "jobtrail", "--db", db_url, "webhooks", "serve"),
            *("--provider", str(provider), "--port", str(port)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "DEMO_WHSEC": secret},
    )
    try:
        wait_for_port(port, server)
        yield f"http://127.0.0.1:{port}/webhooks/fake"
    finally:
        server.terminate()
        server.communicate(timeout=20)


def test_webhooks_serve_receives_signed_events(db_url: str, fake: FakeProvider, tmp_path: Path) -> None:
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    provider = fake.write_provider_file(tmp_path / "fake.toml", webhooks={"secrets": ["env:DEMO_WHSEC"]})
    with _webhooks_server(db_url, provider, secret) as url:
        answer = send_webhook(url, secret, {"type": "job.running", "data": {"id": "job_x"}}, event_id="e1")
        assert answer[0] == 202 and answer[1]["status"] == "orphan"
        forged = send_webhook(url, "whsec_" + base64.b64encode(b"x" * 24).decode(), {"type": "t"}, event_id="e2")
        assert forged[0] == 401 and forged[1]["title"] == "bad signature"


def _trickled(port: int, pieces: list[bytes], give_up_s: float) -> float:
    """Send ``pieces`` one a second on a new connection, reading whatever comes back: the seconds until the server
    closed the connection (or ``give_up_s``, if it kept it that long)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.settimeout(1.0)
        started = time.monotonic()
        for piece in pieces:
            if time.monotonic() - started > give_up_s:
                break
            try:
                conn.sendall(piece)
                while conn.recv(4096):  # an answer given early (401) is read, and the end waited for
                    pass
                break  # closed
            except TimeoutError:
                continue
            except OSError:  # reset
                break
        return time.monotonic() - started


def test_a_client_that_trickles_its_request_is_cut_off_and_deliveries_go_on(fake: FakeProvider, tmp_path: Path) -> None:
    """Slowloris: headers a line a second, or a body a byte a second, held a connection (and a file descriptor)
    as long as the client liked; the application never heard of it, or waited with it. Headers must now arrive
    within their deadline, and a body within its own after them: the dashboard's, or the webhook receiver's,
    the provider's read_timeout_s (10 s) and a few seconds to read its 408, however early the answer (a 401
    before the body). A form cut off is no error of the server's: nothing is logged as one."""
    from jobtrail.interfaces.cli.serve import _ANSWER_READ_S
    from jobtrail.interfaces.served import BODY_DEADLINE_S, HEADERS_DEADLINE_S

    secret = "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()
    provider = fake.write_provider_file(tmp_path / "fake.toml", webhooks={"secrets": ["env:DEMO_WHSEC"]})
    db = str(tmp_path / "ledger.db")  # (the ledger's kind plays no part)
    Store.open(db).close()
    dashboard_port = free_port()
    dashboard = subprocess.Popen(
        [sys.executable, "-m", "jobtrail", "--db", db, "dashboard", "--port", str(dashboard_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    webhooks_body_s = 10 + _ANSWER_READ_S
    try:
        with _webhooks_server(db, provider, secret) as url:
            wait_for_port(dashboard_port, dashboard)
            port = int(url.split(":")[2].split("/")[0])
            head = b"POST /webhooks/fake HTTP/1.1\r\nHost: x\r\n"
            login = b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n"
            lines = [b"X-Pad-%d: y\r\n" % i for i in range(200)]
            length = b"Content-Length: 9999\r\n\r\n"
            cases = {
                "dashboard, headers": (dashboard_port, [login, *lines], HEADERS_DEADLINE_S),
                "dashboard, a form's body": (dashboard_port, [login + length, *[b"a"] * 200], BODY_DEADLINE_S),
                "webhooks, headers": (port, [head, *lines], HEADERS_DEADLINE_S),
                "webhooks, a body after its 401": (port, [head + length, *[b"{"] * 200], webhooks_body_s),
            }
            with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
                cut = {
                    name: pool.submit(_trickled, port, pieces, deadline + 40)
                    for name, (port, pieces, deadline) in cases.items()
                }
                cut_after = {name: round(future.result(), 1) for name, future in cut.items()}
            # cut off at the deadline, not served on (a thousand seconds of pieces)
            for name, (_, _, deadline) in cases.items():
                assert deadline - 1 <= cut_after[name] <= deadline + 15, cut_after
            answer = send_webhook(url, secret, {"type": "job.running", "data": {"id": "job_y"}}, event_id="e3")
            assert answer[0] == 202
    finally:
        dashboard.terminate()
        logged = dashboard.communicate(timeout=20)[1]
    assert b"ClientDisconnect" not in logged and b"Traceback" not in logged, logged[-3000:]


def test_every_command_has_help_with_an_example() -> None:
    import click

    from jobtrail.interfaces.cli import cli

    def commands(group: click.Group, prefix: str = "") -> list[tuple[str, click.Command]]:
        found = []
        for name, command in group.commands.items():
            if isinstance(command, click.Group):
                found += commands(command, f"{prefix}{name} ")
            else:
                found.append((f"{prefix}{name}", command))
        return found

    every = commands(cli)
    assert {name for name, _ in every} >= {
        "submit",
        "ops list",
        "ops show",
        "ops history",
        "ops escalation",
        "explain",
        "wait",
        "cancel",
        "result",
        "resolve",
        "worker",
        "webhooks serve",
        "audit verify",
        "audit anchor",
        "providers check",
        "demo",
    }
    for name, command in every:
        assert "Example:" in (command.help or ""), f"`jobtrail {name} --help` has no example"
