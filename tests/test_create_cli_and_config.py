"""Provider files, credentials in custody, the submit CLI, and a process killed mid-create."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobtrail import AsyncJobtrail, ConfigError, RemoteState, State, Store
from jobtrail.domain.backoff import Backoff, parse_retry_after
from jobtrail.domain.redact import Redactor
from jobtrail.ledger.audit import verify
from jobtrail.providers.contract import NoAnswer
from jobtrail.providers.http import load_provider, parse_config
from jobtrail.testing import FakeProvider, Fault, provider_toml

from helpers import op_in, tiered
from processes import cli

jobtrail = cli


# -- provider files --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"base_url": "ftp://x"}, "base_url: expected an absolute http(s) URL"),
        ({"create": None}, "create is missing"),
        ({"create": {"path": "/v1/jobs", "job_id": "id"}}, "create.job_id: expected a JSON path like $.id"),
        ({"create": {"path": "/v1/jobs", "jobid": "$.id"}}, "unknown key 'jobid' in [create]"),
        (
            {"create": {"path": "/v1/jobs", "token": {"in": "cookie"}}},
            "create.token.in: expected one of header",
        ),
        ({"timeout_s": -1}, "timeout_s: expected seconds"),
        ({"reconcile": {"modes": ["telepathy"]}}, "reconcile.modes: expected a list of"),
        ({"reconcile": {"modes": ["status_by_client_id"]}}, "reconcile.status_path is missing"),
        ({"states": {"finished": ["done"]}}, "states.finished: expected one of queued"),
        ({"credential": "sk-live-0123456789abcdef"}, "credential: expected a reference"),
        (
            {"credential": "env:X", "base_url": "http://api.example.com"},
            "https:// (credentials are never sent",
        ),
        ({"headers": {"X-Api-Key": "abc"}}, "headers.X-Api-Key: expected no credentials in headers"),
        ({"base_url": "https://user:pw@api.example.com"}, "a URL without user:password"),
        (
            {"create": {"path": "/v1/jobs", "token": {"in": "none"}}, "reconcile": {"modes": ["replay"]}},
            "no reconciliation modes when create.token.in",
        ),
    ],
)
def test_bad_provider_files_name_file_key_and_expectation(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    config: dict[str, Any] = {
        "name": "p",
        "base_url": "https://api.example.com",
        "create": {"path": "/v1/jobs"},
    }
    for key, value in change.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    path = tmp_path / "provider.toml"
    path.write_text(provider_toml(config))
    with pytest.raises(ConfigError) as err:
        load_provider(path)
    assert str(path) in str(err.value)
    assert message in str(err.value)
    assert "sk-live-0123456789abcdef" not in str(err.value) and "pw@" not in str(err.value)


def test_unreadable_and_invalid_toml_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read provider file"):
        load_provider(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_provider(bad)


def test_unknown_remote_states_stay_raw_and_are_not_terminal() -> None:
    provider = load_provider(
        {
            "name": "p",
            "base_url": "https://x.example",
            "create": {"path": "/j"},
            "states": {"succeeded": ["Done"]},
        }
    )
    caps = provider.capabilities
    assert caps.normalise("Done") is RemoteState.SUCCEEDED
    assert caps.normalise("in_progress") is RemoteState.RUNNING
    assert caps.normalise("quantum-superposition") is RemoteState.UNKNOWN
    assert caps.normalise(None) is RemoteState.UNKNOWN


def test_providers_check_states_the_guarantees(tmp_path: Path) -> None:
    path = tmp_path / "none.toml"
    path.write_text(
        provider_toml(
            {
                "name": "careless",
                "base_url": "https://x.example",
                "create": {"path": "/j", "token": {"in": "none"}},
            }
        )
    )
    out = jobtrail("providers", "check", str(path), "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["at_most_once"] is False
    assert "no reconciliation path" in report["guarantees"]["at-most-once creation"]["why"]
    good = jobtrail("providers", "check", "examples/fake.toml", "--json")
    assert json.loads(good.stdout)["at_most_once"] is True
    broken = jobtrail("providers", "check", str(tmp_path / "nope.toml"))
    assert broken.returncode == 2 and "cannot read provider file" in broken.stderr


def test_retry_after_parsing() -> None:
    now = 1_000_000_000.0
    assert parse_retry_after("120", now) == 120
    assert parse_retry_after("Sun, 09 Sep 2001 01:56:40 GMT", now) == 600  # IMF-fixdate
    assert parse_retry_after("Sunday, 09-Sep-01 01:56:40 GMT", now) == 600  # RFC 850
    assert parse_retry_after("Sun Sep  9 01:56:40 2001", now) == 600  # asctime
    assert parse_retry_after("Sat, 01 Jan 2000 00:00:00 GMT", now) == 0  # past: now
    assert parse_retry_after("soon", now) is None and parse_retry_after("-5", now) is None
    assert Backoff(max_retry_after_s=3600).after(10**9, attempt=1) == 3600  # absurd values are capped


def test_backoff_is_capped_exponential_with_full_jitter() -> None:
    import random

    backoff = Backoff(initial_s=1, factor=2, cap_s=10)
    rng = random.Random(7)
    for attempt, ceiling in [(1, 1), (2, 2), (3, 4), (4, 8), (5, 10), (500, 10)]:
        delays = [backoff.delay(attempt, rng) for _ in range(200)]
        assert min(delays) >= 0 and max(delays) <= ceiling
        assert max(delays) > ceiling * 0.8  # jitter spreads over the whole range


# -- credentials in custody -------------------------------------------------------------------


@pytest.fixture
def guarded_fake() -> Iterator[tuple[FakeProvider, str]]:
    canary = f"jtcanary_cred_{secrets.token_hex(12)}"
    fake = FakeProvider(job_duration_s=0.3, require_bearer=canary).start()
    yield fake, canary
    fake.stop()


def test_credentials_are_injected_at_send_time_and_never_written(
    db_url: str,
    tmp_path: Path,
    guarded_fake: tuple[FakeProvider, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog,
) -> None:
    """The canary scan, with a real credential in play and a provider that echoes it back."""
    import logging

    from jobtrail.domain.redact import install_log_redaction

    fake, canary = guarded_fake
    monkeypatch.setenv("FAKE_API_KEY", canary)
    install_log_redaction()
    caplog.set_level(logging.DEBUG, logger="jobtrail")
    store = Store.open(db_url)
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config(credential="env:FAKE_API_KEY")])

    async def go() -> list[Any]:
        ops = []
        fake.script(Fault.reject(401, echo_auth=True))
        ops.append(await jt.drive_create((await jt.submit("fake", {"n": 1})).operation_id))
        fake.script(Fault.drop())
        ops.append(await jt.drive_create((await jt.submit("fake", {"n": 2})).operation_id))
        ops.append(await jt.drive_create((await jt.submit("fake", {"n": 3})).operation_id))
        logging.getLogger("jobtrail").warning("sent with Authorization: Bearer %s", canary)
        await jt.providers["fake"].aclose()
        return ops

    ops = asyncio.run(go())
    assert [o.state for o in ops] == [State.FAILED, State.ACCEPTED, State.ACCEPTED]
    assert fake.counts["unauthorized"] == 0  # the credential did arrive on every request
    assert verify(store).ok
    haystack = _storage_bytes(store) + caplog.text.encode()
    for form in (canary.encode(), base64.b64encode(canary.encode()), canary.encode().hex().encode()):
        assert form not in haystack
    rejected = store.history(ops[0].operation_id)[-1].to_json()["evidence"]["problem"]
    assert rejected["received_authorization"] == "[REDACTED]" and "[REDACTED]" in rejected["detail"]
    store.close()


def _storage_bytes(store: Store) -> bytes:
    import sqlalchemy as sa

    if store.dialect == "sqlite":
        import sqlite3

        path = Path(str(store.engine.url.database))
        store.engine.dispose()
        raw = sqlite3.connect(path, isolation_level=None)
        raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        raw.close()
        return b"".join(p.read_bytes() for p in (path, Path(f"{path}-wal")) if p.exists())
    with store.engine.connect() as conn:
        return b"\n".join(
            str(r[0]).encode()
            for t in ("operations", "history", "observations")
            for r in conn.execute(sa.text(f"SELECT x::text FROM {t} x"))
        )


def test_a_file_credential_is_read_off_the_loop_not_per_request_and_a_rotation_is_picked_up_at_once(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading a secret file (or a keyring) is I/O: never on the event loop, and not once per request."""
    import threading

    from jobtrail.providers.credentials import Credential

    old, new = f"jtcanary_old_{secrets.token_hex(8)}", f"jtcanary_new_{secrets.token_hex(8)}"
    secret_file = tmp_path / "api-key"
    secret_file.write_text(old + "\n")
    reads: list[str] = []
    real_resolve = Credential.resolve

    def counted_resolve(self: Any, redactor: Any) -> Any:
        reads.append(threading.current_thread().name)
        return real_resolve(self, redactor)

    monkeypatch.setattr(Credential, "resolve", counted_resolve)
    fake = FakeProvider(job_duration_s=0.3, require_bearer=old).start()
    try:
        store = Store.open(db_url)
        jt = AsyncJobtrail(store=store, providers=[fake.provider_config(credential=f"file:{secret_file}")])

        async def go() -> list[Any]:
            ops = [await jt.drive_create((await jt.submit("fake", {"n": i})).operation_id) for i in range(5)]
            # rotated: the provider now wants the new value; its 401 makes jobtrail read the file again and resend
            secret_file.write_text(new + "\n")
            fake.require_bearer = new
            ops.append(await jt.drive_create((await jt.submit("fake", {"n": 99})).operation_id))
            await jt.providers["fake"].aclose()
            return ops

        ops = asyncio.run(go())
        assert [o.state for o in ops] == [State.ACCEPTED] * 6
        assert fake.counts["unauthorized"] == 1  # the one request sent with the old value
        assert fake.counts["jobs_created"] == 6
        assert len(reads) == 2, reads  # once for five creates, once after the refusal
        assert all(name != threading.main_thread().name for name in reads), reads
        store.close()
    finally:
        fake.stop()


def test_credentials_never_go_to_a_url_the_provider_hands_back(
    guarded_fake: tuple[FakeProvider, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake, canary = guarded_fake
    monkeypatch.setenv("FAKE_API_KEY", canary)
    store = Store.open(tmp_path / "c.db")
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config(credential="env:FAKE_API_KEY")])
    op = asyncio.run(jt.submit("fake", {"n": 1}))
    provider = jt.providers["fake"]
    # refused before any connection, with the host and the key that would allow it
    refused = asyncio.run(provider.fetch_result(op, "https://evil.example.net/steal"))
    assert isinstance(refused, NoAnswer) and refused.refused
    assert "evil.example.net" in refused.detail and "result.download_hosts" in refused.detail
    asyncio.run(provider.aclose())
    store.close()


def test_missing_credential_is_a_clear_error_and_nothing_is_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    fake = FakeProvider().start()
    try:
        store = Store.open(tmp_path / "m.db")
        jt = AsyncJobtrail(store=store, providers=[fake.provider_config(credential="env:NOT_SET_ANYWHERE")])
        op = asyncio.run(jt.submit("fake", {"n": 1}))
        with pytest.raises(ConfigError, match="NOT_SET_ANYWHERE is not set"):
            asyncio.run(jt.drive_create(op.operation_id))
        assert fake.counts["creates_received"] == 0
        assert store.get(op.operation_id).state is State.CREATE_PENDING
        store.close()
    finally:
        fake.stop()


# -- the submit CLI and a killed process -------------------------------------------------------------


@pytest.fixture
def provider_file(tmp_path: Path, fake: FakeProvider) -> Path:
    path = tmp_path / "fake.toml"
    config = fake.provider_config(connect_timeout_s=1.0)
    config["create"] = {k: v for k, v in config["create"].items()}
    path.write_text(provider_toml(config))
    return path


@pytest.mark.long_on_postgres  # the CLI's words and exit codes; its SQLite run is in the fast tier
def test_submit_prints_the_id_first_then_the_outcome(db_url: str, fake: FakeProvider, provider_file: Path) -> None:
    out = jobtrail(
        "--db",
        db_url,
        "submit",
        "--provider",
        str(provider_file),
        "--request",
        '{"prompt": "hi"}',
        "--key",
        "k-1",
        "--approved-by",
        "alice",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    first, last = (json.loads(line) for line in out.stdout.strip().splitlines())
    assert first["event"] == "submitted" and first["state"] == "create_pending" and first["created"] is True
    assert last["event"] == "create_finished" and last["state"] == "accepted"
    assert last["operation_id"] == first["operation_id"] and last["approved_by"] == "alice"
    again = jobtrail(
        "--db",
        db_url,
        "submit",
        "--provider",
        str(provider_file),
        "--request",
        '{"prompt": "hi"}',
        "--key",
        "k-1",
    )
    assert again.stdout.splitlines()[0] == first["operation_id"]
    assert "already there: key 'k-1' with this request; nothing new is created" in again.stderr
    args = ("submit", "--provider", str(provider_file), "--request", '{"prompt": "hi"}', "--key", "k-1", "--json")
    again_json = jobtrail("--db", db_url, *args)
    assert json.loads(again_json.stdout.splitlines()[0])["created"] is False
    changed = jobtrail(
        "--db",
        db_url,
        "submit",
        "--provider",
        str(provider_file),
        "--request",
        '{"prompt": "changed"}',
        "--key",
        "k-1",
    )
    assert changed.returncode == 2 and "a changed request is a new operation" in changed.stderr
    assert fake.counts["jobs_created"] == 1


@pytest.mark.long_on_postgres  # the CLI's words and exit codes; its SQLite run is in the fast tier
def test_submit_exit_codes_and_bad_input(db_url: str, fake: FakeProvider, provider_file: Path) -> None:
    fake.script(Fault.reject(422))
    rejected = jobtrail("--db", db_url, "submit", "--provider", str(provider_file), "--request", '{"a": 1}')
    assert rejected.returncode == 1 and "failed" in rejected.stdout
    bad_json = jobtrail("--db", db_url, "submit", "--provider", str(provider_file), "--request", "{nope")
    assert bad_json.returncode == 2 and "not valid JSON" in bad_json.stderr
    secret = jobtrail(
        "--db", db_url, "submit", "--provider", str(provider_file), "--request", '{"api_key": "abc123456"}'
    )
    assert secret.returncode == 2 and "credential" in secret.stderr and "abc123456" not in secret.stderr
    deadline = jobtrail(
        "--db",
        db_url,
        "submit",
        "--provider",
        str(provider_file),
        "--request",
        '{"a": 2}',
        "--create-deadline",
        "soon",
    )
    assert deadline.returncode == 2 and "use a duration like 90s" in deadline.stderr
    with Store.open(db_url) as store:
        before = store.count()
    for odd in ("nan", "1e400", "-5"):
        args = ("submit", "--provider", str(provider_file), "--request", '{"a": 3}', "--create-deadline", odd)
        refused = jobtrail("--db", db_url, *args)
        assert refused.returncode == 2 and "--create-deadline" in refused.stderr, (odd, refused.stderr)
        assert "Traceback" not in refused.stderr
    with Store.open(db_url) as store:
        assert store.count() == before


@pytest.mark.long_on_postgres  # a long story; its SQLite run is in the fast tier
@pytest.mark.parametrize(
    "point", tiered(["create.after_attempt", "create.after_response", "create.after_observation"], fast=1)
)
def test_a_process_killed_mid_create_is_finished_by_the_next_one(
    db_url: str, fake: FakeProvider, provider_file: Path, point: str
) -> None:
    """kill -9 (os._exit) at each point of the create; a fresh process ends with exactly one job."""
    died = jobtrail(
        "--db",
        db_url,
        "submit",
        "--provider",
        str(provider_file),
        "--request",
        '{"job": "x"}',
        "--key",
        "crash",
        "--lease",
        "4",
        env={"JOBTRAIL_FAILPOINTS": f"{point}=exit"},
    )
    assert died.returncode == 137
    op_id = died.stdout.splitlines()[0]
    with Store.open(db_url) as store:
        assert store.get(op_id).state is State.CREATE_PENDING and store.get(op_id).attempts == 1
    sent_before = fake.counts["creates_received"]

    store = Store.open(db_url)
    jt = AsyncJobtrail(store=store, providers=[str(provider_file)])

    async def resume() -> Any:
        try:
            return await jt.drive_create(op_id)
        finally:
            await jt.providers["fake"].aclose()

    op = asyncio.run(resume())
    assert op.state is State.ACCEPTED
    assert fake.jobs_for(op.idempotency_token) == [op.remote_job_id]
    assert fake.counts["jobs_created"] == 1
    causes = [e.cause for e in store.history(op_id)]
    if point == "create.after_observation":  # the answer was stored: it settles the attempt, nothing is re-sent
        assert "ambiguous_create" not in causes and fake.counts["creates_received"] == sent_before
    else:  # no answer stored: the unrecorded outcome is treated as doubt, not as failure
        assert "ambiguous_create" in causes
    if point == "create.after_attempt":
        assert sent_before == 0  # died before sending: the replay is the first request
    assert verify(store).ok
    store.close()


def test_python_m_provider_serves_on_the_given_port() -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobtrail.testing.provider", "--port", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["base_url"] == f"http://127.0.0.1:{port}"
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/jobs",
            data=b'{"a": 1}',
            method="POST",
            headers={"Content-Type": "application/json", "Idempotency-Key": '"k"'},
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.status == 201 and json.loads(resp.read())["id"] == "job_00001"
    finally:
        proc.terminate()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
    assert proc.returncode == 0


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    """README's first command: the demo runs with no configuration and its ledger verifies."""
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "jobtrail", "demo"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "JOBTRAIL_DB": "", "COLUMNS": "120"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "audit verify: OK 9 operations" in out.stdout
    assert (tmp_path / "jobtrail-demo.db").exists()
    listed = jobtrail("--db", str(tmp_path / "jobtrail-demo.db"), "ops", "list", "--json")
    assert json.loads(listed.stdout)["count"] == 9
    assert time.monotonic() - started < 120


def test_a_demo_starts_from_an_empty_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second demo on the first one's ledger saw its webhooks as duplicates (the fake's job ids start again)
    and its operations among the new: the demo's own file is made anew, and a ledger someone named that
    holds operations is refused, never emptied."""
    from rich.console import Console

    from jobtrail.domain.errors import UsageError
    from jobtrail.interfaces.demo import DEFAULT_DEMO_DB, _start_afresh

    monkeypatch.delenv("JOBTRAIL_DATA_DIR", raising=False)
    console = Console(file=io.StringIO())
    own, named = tmp_path / DEFAULT_DEMO_DB, tmp_path / "mine.db"
    for path in (own, named):
        with Store.open(path) as store:
            op_in(store, State.ACCEPTED)
    (tmp_path / f"{DEFAULT_DEMO_DB}-results").mkdir()

    _start_afresh(str(own), own=True, console=console)
    assert not own.exists() and not (tmp_path / f"{DEFAULT_DEMO_DB}-results").exists()
    with pytest.raises(UsageError, match=r"mine.db holds 1 operation\(s\). Give --db a new path"):
        _start_afresh(str(named), own=False, console=console)
    with Store.open(named) as store:
        assert store.count() == 1


def test_parse_config_accepts_a_dict_with_a_callable_credential() -> None:
    config = parse_config(
        {
            "name": "p",
            "base_url": "https://api.example.com",
            "create": {"path": "/v1/jobs"},
            "credential": lambda: "from-a-vault-1234",
        }
    )
    assert config.credential is not None and config.credential.describe() == "callable"
    assert "from-a-vault-1234" not in repr(config.credential.resolve(Redactor()))
