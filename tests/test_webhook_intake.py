"""A verified webhook event: which operation it goes to, that it reaches it however it races the job id,
and that what is kept of it masks the provider's own credential. Real sockets and processes throughout."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_webhooks import accepted_op, cfg_for, event, new_secret, rows, serve, webhook_observations

from jobtrail import AsyncJobtrail, State, Store
from jobtrail.domain.errors import ConfigError
from jobtrail.domain.redact import WITHHELD_SPLIT_CREDENTIAL, Redactor
from jobtrail.interfaces.webhooks import webhook_app
from jobtrail.providers.credentials import Credential
from jobtrail.providers.http import load_provider
from jobtrail.providers.webhooks import CredentialsToMask
from jobtrail.testing import FakeProvider, Fault, send_webhook

from helpers import canary_hits, free_port, ledger_bytes
from processes import jobtrail

S = State


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> str:
    value = new_secret()
    monkeypatch.setenv("WHSEC_CURRENT", value)
    return value


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    provider = FakeProvider(job_duration_s=60).start()
    yield provider
    provider.stop()


# -- an event racing the create's answer -----------------------------------------------------------


class HeldBeforeStoring(Redactor):
    """The receiver's redactor, holding the receiver where it masks an event's body: after it looked for the
    event's operation, before it stores the event. The race's window, held open for as long as a test needs."""

    def __init__(self) -> None:
        super().__init__()
        self.reached, self.go_on = threading.Event(), threading.Event()

    def value(self, value: Any) -> Any:
        if isinstance(value, dict) and "data" in value and not self.reached.is_set():
            self.reached.set()
            self.go_on.wait(20)
        return super().value(value)


def test_an_event_that_races_the_create_answer_is_attached_to_its_operation(
    open_store: Callable[..., Store], ledger: Store, fake: FakeProvider, secret: str
) -> None:
    """The provider notifies the moment it makes the job: the receiver finds no operation for it, and while it
    stores the event the create records the job id and looks for waiting events. The event is attached anyway."""
    cfg = cfg_for(fake)
    jt = AsyncJobtrail(store=ledger, providers=[cfg])
    op_id = asyncio.run(jt.submit("fake", {"x": secrets.token_hex(4)})).operation_id
    held = HeldBeforeStoring()
    answers: list[tuple[int, Any]] = []
    with serve(open_store(redactor=held), cfg) as url:
        sender = threading.Thread(
            target=lambda: answers.append(send_webhook(url, secret, event("job_00001", "job.running"), event_id="e1"))
        )
        sender.start()
        assert held.reached.wait(20), "the receiver never reached the point where it stores the event"

        async def create() -> Any:
            op = await jt.drive_create(op_id)  # the job id is recorded, and waiting events looked for, now
            await jt.providers["fake"].aclose()
            return op

        op = asyncio.run(create())
        assert op.remote_job_id == "job_00001" and rows(ledger, "webhook_events") == []  # none to adopt yet
        held.go_on.set()
        sender.join(20)
    assert [r["operation_id"] for r in rows(ledger, "webhook_events")] == [op_id]
    assert answers[0][0] == 202 and answers[0][1]["status"] == "accepted" and answers[0][1]["operation_id"] == op_id
    [seen] = webhook_observations(ledger, op_id)
    assert seen["raw"]["event_id"] == "e1" and seen["raw"]["stale"] is False
    pulled = ledger.get(op_id)
    assert pulled.next_action_at_us is not None and pulled.next_action_at_us <= ledger.clock()  # polled now


# -- a person's decision -------------------------------------------------------------------------


def test_a_person_confirming_the_job_id_attaches_the_events_waiting_for_it(
    db_url: str, ledger: Store, secret: str
) -> None:
    """`jobtrail resolve --to accepted --job-id`: the events kept for that job while no operation knew it (its
    create answer was lost, and the provider has no lookup) become the operation's, and bring its poll forward."""
    fake = FakeProvider(idempotency=False, job_duration_s=60).start()
    try:
        cfg = fake.provider_config(
            create={"token": {"in": "none"}},
            reconcile=None,
            webhooks={"secrets": ["env:WHSEC_CURRENT"]},
            poll={"initial_s": 30, "factor": 1, "cap_s": 30},
        )
        fake.script(Fault.drop())  # the job is made; its answer is lost
        jt = AsyncJobtrail(store=ledger, providers=[cfg])

        async def create() -> Any:
            op = await jt.drive_create((await jt.submit("fake", {"p": 1})).operation_id)
            await jt.providers["fake"].aclose()
            return op

        op = asyncio.run(create())
        assert op.state is S.NEEDS_ATTENTION and op.remote_job_id is None and "job_00001" in fake.jobs
        with serve(ledger, cfg) as url:
            early = send_webhook(url, secret, event("job_00001", "job.running"), event_id="evt_early")
        assert early[0] == 202 and early[1]["status"] == "orphan"  # answered: the provider will not send it again
        code, out, err = jobtrail(
            db_url,
            "resolve",
            op.operation_id,
            "--to",
            "accepted",
            "--job-id",
            "job_00001",
            "--by",
            "alice",
            "--reason",
            "found it in the console",
            "--json",
        )
        assert code == 0, err
        assert json.loads(out)["remote_job_id"] == "job_00001"
    finally:
        fake.stop()
    assert [r["operation_id"] for r in rows(ledger, "webhook_events")] == [op.operation_id]
    assert [o["raw"]["event_id"] for o in webhook_observations(ledger, op.operation_id)] == ["evt_early"]
    after = ledger.get(op.operation_id)
    assert after.state is S.ACCEPTED
    assert after.next_action_at_us is not None and after.next_action_at_us <= ledger.clock()


# -- job id before reference ---------------------------------------------------------------------


def event_about(job_id: str, reference: str, kind: str = "job.succeeded") -> dict[str, Any]:
    return {"type": kind, "data": {"id": job_id, "reference": reference}}


def test_an_event_about_another_job_is_not_filed_under_an_operation_by_its_reference(
    ledger: Store, fake: FakeProvider, secret: str
) -> None:
    """An event for job_00077 carrying B's token, B's job being job_00001: another job made with that token (a
    duplicate), so it is kept as an orphan, and B's timeline, stale check and next poll do not hear of it."""
    cfg = cfg_for(fake, reference="$.data.reference")
    b = accepted_op(ledger, cfg)
    assert b.remote_job_id == "job_00001"
    before = ledger.get(b.operation_id).next_action_at_us
    with serve(ledger, cfg) as url:
        got = send_webhook(url, secret, event_about("job_00077", b.idempotency_token), event_id="e77")
    assert got[0] == 202 and got[1]["status"] == "orphan"
    assert [(r["remote_job_id"], r["operation_id"]) for r in rows(ledger, "webhook_events")] == [("job_00077", None)]
    assert webhook_observations(ledger, b.operation_id) == []
    assert ledger.get(b.operation_id).next_action_at_us == before


def test_the_job_id_wins_over_the_reference_and_the_reference_finds_an_operation_without_a_job(
    ledger: Store, fake: FakeProvider, secret: str
) -> None:
    """An event naming A's job and carrying B's token is A's, on either backend, whatever the row order; an
    event carrying the token of C, which knows no job id yet, is C's (what the reference is for)."""
    cfg = cfg_for(fake, reference="$.data.reference")
    a, b = accepted_op(ledger, cfg), accepted_op(ledger, cfg)
    jt = AsyncJobtrail(store=ledger, providers=[cfg])
    c = asyncio.run(jt.submit("fake", {"x": "not sent yet"}))
    assert c.remote_job_id is None
    with serve(ledger, cfg) as url:
        to_a = send_webhook(url, secret, event_about(str(a.remote_job_id), b.idempotency_token), event_id="ea")
        to_c = send_webhook(url, secret, event_about("job_00099", c.idempotency_token), event_id="ec")
    assert to_a[1]["operation_id"] == a.operation_id and to_c[1]["operation_id"] == c.operation_id
    assert webhook_observations(ledger, b.operation_id) == []
    assert [o["raw"]["event_id"] for o in webhook_observations(ledger, c.operation_id)] == ["ec"]


# -- the provider's credential in what is kept ---------------------------------------------------


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def _serve_webhooks(db_url: str, provider_file: Path, port: int) -> subprocess.Popen[str]:
    """`jobtrail webhooks serve` in a process of its own, once it answers /healthz."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "jobtrail", "--db", db_url),
            *("webhooks", "serve", "--provider", str(provider_file), "--host", "127.0.0.1", "--port", str(port)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    deadline = time.monotonic() + 30
    while not _healthy(port):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "the receiver never answered /healthz"
        time.sleep(0.1)
    return proc


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=20)[1]


@contextlib.contextmanager
def _receiver_knowing_a_credential(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, Any, str, str]]:
    """``jobtrail webhooks serve`` for a provider with a credential (a key of no recognisable form) and one
    accepted operation: (the delivery URL, the operation, the credential, the webhook secret)."""
    api_key = "r8_" + secrets.token_hex(18)  # a Replicate-style token: no general form gives it away
    whsec = new_secret()
    monkeypatch.setenv("FAKE_API_KEY", api_key)
    monkeypatch.setenv("WHSEC_CURRENT", whsec)
    fake = FakeProvider(job_duration_s=60, require_bearer=api_key).start()
    proc = None
    try:
        overrides: dict[str, Any] = {
            "credential": "env:FAKE_API_KEY",
            "webhooks": {"secrets": ["env:WHSEC_CURRENT"]},
            "poll": {"initial_s": 30, "factor": 1, "cap_s": 30},
        }
        with Store.open(db_url) as store:
            op = accepted_op(store, fake.provider_config(**overrides))
        port = free_port()
        proc = _serve_webhooks(db_url, fake.write_provider_file(tmp_path / "fake.toml", **overrides), port)
        yield f"http://127.0.0.1:{port}/webhooks/fake", op, api_key, whsec
    finally:
        if proc is not None:
            _stop(proc)
        fake.stop()


def test_webhooks_serve_masks_the_providers_credential_when_an_event_echoes_it(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver process never sends the provider's credential, yet an event that carries it (a key of no
    recognisable form) is kept masked, in the event and in the operation's observation, as the webhook secret is."""
    with _receiver_knowing_a_credential(db_url, tmp_path, monkeypatch) as (url, op, api_key, whsec):
        body = {"type": "job.failed", "data": {"id": op.remote_job_id, "echo": api_key, "also": whsec}}
        got = send_webhook(url, whsec, body, event_id="evt_echo")
        assert got[0] == 202 and got[1]["status"] == "accepted"
    with Store.open(db_url) as store:
        [kept] = webhook_observations(store, op.operation_id)
        assert kept["raw"]["event"]["data"]["echo"] != api_key  # it is there, masked
        held = ledger_bytes(store)
    assert canary_hits(api_key, held) == [] and canary_hits(whsec, held) == []


def test_a_delivery_that_carries_the_credential_in_its_id_or_split_in_its_body_keeps_none_of_it(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A provider that signs correctly but sends its own credential as the event id (stored and shown as it
    came, so it cannot be masked) is refused; one that splits it across two fields of an event about a job
    nobody knows yet has the event kept withheld. Before, the ledger file held both in the clear."""
    with _receiver_knowing_a_credential(db_url, tmp_path, monkeypatch) as (url, op, api_key, whsec):
        for event_id in (api_key, base64.b64encode(api_key.encode()).decode()):
            code, answer = send_webhook(url, whsec, event(op.remote_job_id), event_id=event_id)
            assert code == 400 and answer["title"] == "credential in the event id", answer
            assert api_key not in json.dumps(answer)
        half = len(api_key) // 2
        split = {"type": "job.done", "data": {"id": "job-nobody-knows", "a": api_key[:half], "b": api_key[half:]}}
        code, answer = send_webhook(url, whsec, split, event_id="evt_split")
        assert code == 202 and answer["status"] == "orphan"
    with Store.open(db_url) as store:
        kept = rows(store, "webhook_events")
        assert [row["event_id"] for row in kept] == ["evt_split"]
        assert json.loads(kept[0]["body"]) == {"withheld": WITHHELD_SPLIT_CREDENTIAL}
        held = ledger_bytes(store)
    assert canary_hits(api_key, held) == []


def test_a_credential_the_receiver_cannot_read_is_named_and_does_not_stop_it(
    db_url: str, tmp_path: Path, fake: FakeProvider, secret: str
) -> None:
    """`webhooks serve` with the provider's credential unreadable where it runs: it serves all the same, and says
    which credential it cannot mask and what that means."""
    provider_file = fake.write_provider_file(
        tmp_path / "fake.toml", credential="env:JT_TEST_KEY_NOT_SET_HERE", webhooks={"secrets": ["env:WHSEC_CURRENT"]}
    )
    port = free_port()
    proc = _serve_webhooks(db_url, provider_file, port)
    try:
        got = send_webhook(f"http://127.0.0.1:{port}/webhooks/fake", secret, event("job_00042"), event_id="e42")
    finally:
        err = _stop(proc)
    assert got[0] == 202 and got[1]["status"] == "orphan"
    assert "provider fake: its credential env:JT_TEST_KEY_NOT_SET_HERE cannot be read here" in err
    assert "JT_TEST_KEY_NOT_SET_HERE is not set" in err and "stored unmasked" in err


def test_a_receivers_credentials_are_read_again_so_a_rotated_one_is_masked_too(tmp_path: Path) -> None:
    """A credential file rewritten while the receiver runs: the new value is masked after the next reading,
    and the old one still is (events about old jobs may carry it)."""
    key_file = tmp_path / "key"
    old, new = "k_" + secrets.token_hex(16), "k_" + secrets.token_hex(16)
    key_file.write_text(old)
    redactor = Redactor()
    credentials = CredentialsToMask({"p": [Credential(f"file:{key_file}", "bearer")]}, redactor, refresh_s=0)
    key_file.write_text(new)
    assert redactor.text(f"{old} {new}") == f"[REDACTED] {new}"
    credentials.refresh()
    assert old not in redactor.text(f"{old} {new}") and new not in redactor.text(f"{old} {new}")


# -- a signing secret that could never verify a delivery -------------------------------------------


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("whsec_" + base64.b64encode(b"short-key").decode(), "holds a key of 9 bytes: too short"),
        ("whsec_not base64 at all!", "is not a Standard Webhooks secret"),
        ("whsec_", "holds a key of 0 bytes"),
    ],
)
def test_a_receiver_with_an_unusable_secret_stops_at_its_start_naming_it(
    store: Store, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch, value: str, why: str
) -> None:
    # before: it started, and refused every delivery (a warning each time); the provider's retries ran out
    monkeypatch.setenv("WHSEC_BAD", value)
    configs = {"fake": load_provider(cfg_for(fake, secrets=["env:WHSEC_BAD"])).config.webhooks}
    assert configs["fake"] is not None
    with pytest.raises(ConfigError, match=why) as refused:
        webhook_app(store, configs)
    message = str(refused.value)
    assert "env:WHSEC_BAD" in message and "whsec_" in message
    key = value.removeprefix("whsec_")
    assert not key or key not in message


def test_jobtrail_webhooks_serve_refuses_a_short_secret_with_the_way_out(
    db_url: str, fake: FakeProvider, tmp_path: Path
) -> None:
    provider = fake.write_provider_file(tmp_path / "fake.toml", webhooks={"secrets": ["env:SHORT_WHSEC"]})
    key = "whsec_" + base64.b64encode(secrets.token_bytes(8)).decode()
    code, out, err = jobtrail(
        db_url, "webhooks", "serve", "--provider", str(provider), "--port", str(free_port()), env={"SHORT_WHSEC": key}
    )
    assert code != 0
    assert "webhook secret env:SHORT_WHSEC holds a key of 8 bytes" in err
    assert "secrets.token_bytes(32)" in err and key[6:] not in err + out


# -- a flood of forged deliveries ----------------------------------------------------------------------


def test_a_flood_of_forged_deliveries_is_counted_whole_in_a_write_a_second(
    store: Store, fake: FakeProvider, secret: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # each refusal was a transaction of its own (on SQLite, the one write lock the workers need) and a log line
    import jobtrail.interfaces.webhooks as receiver

    writes: list[dict[tuple[str, str], int]] = []

    def count_refusals(ledger: Store, counts: dict[tuple[str, str], int]) -> None:
        writes.append(dict(counts))
        real(ledger, counts)

    real = receiver.count_refusals
    monkeypatch.setattr(receiver, "count_refusals", count_refusals)
    op = accepted_op(store, cfg_for(fake))
    with serve(store, cfg_for(fake)) as url:
        started = time.monotonic()
        answers = [send_webhook(url, new_secret(), event(op.remote_job_id), event_id=f"evt_{i}")[0] for i in range(300)]
        stale = send_webhook(url, secret, event(op.remote_job_id), event_id="evt_s", timestamp=int(time.time()) - 3600)
        signed = send_webhook(url, secret, event(op.remote_job_id), event_id="evt_ok")
        took = time.monotonic() - started
    # stopped: what was counted and not yet written was written at the receiver's shutdown
    assert answers == [401] * 300 and stale[0] == 401 and signed[0] == 202
    counted = {(r["provider"], r["reason"]): r["count"] for r in rows(store, "webhook_rejections")}
    assert counted == {("fake", "bad signature"): 300, ("fake", "timestamp outside tolerance"): 1}
    assert sum(sum(w.values()) for w in writes) == 301
    assert len(writes) <= took / receiver.REFUSAL_FLUSH_S + 2  # one write a second at most, whatever the rate
    refused = [r.getMessage() for r in caplog.records if "webhook refused" in r.getMessage()]
    assert any("bad signature" in m and "more for that reason" in m for m in refused)
    assert len(refused) <= 2 * (took / receiver.REFUSAL_FLUSH_S + 2)  # a line a second for each reason
    assert len(webhook_observations(store, op.operation_id)) == 1  # the signed one, recorded meanwhile


@pytest.mark.parametrize(
    "written",
    [
        pytest.param(lambda s: s.rstrip("="), id="padding-left-off"),
        pytest.param(lambda s: s + "\n", id="an-environment-variables-newline"),
        pytest.param(lambda s: s.removeprefix("whsec_"), id="without-the-prefix"),
    ],
)
def test_a_secret_written_as_the_verifying_library_reads_it_starts_the_receiver_and_verifies(
    store: Store, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch, written: Callable[[str], str]
) -> None:
    key = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()  # 44 characters, one "=" of padding
    monkeypatch.setenv("WHSEC_WRITTEN", written(key))
    cfg = cfg_for(fake, secrets=["env:WHSEC_WRITTEN"])
    op = accepted_op(store, cfg)
    with serve(store, cfg) as url:
        assert send_webhook(url, key, event(op.remote_job_id), event_id="evt_1")[0] == 202


def _refused_on_a_loop_of_its_own(app: Any, path: str) -> int:
    """One POST without signature headers, through the ASGI app on an event loop that ends with it: as hosts
    that run each request on a loop of its own do (Starlette's TestClient without `with`, some test rigs)."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    asyncio.run(app(scope, receive, send))
    return int(next(m["status"] for m in sent if m["type"] == "http.response.start"))


def test_refusals_made_on_loops_that_end_with_their_request_are_all_counted(
    store: Store, fake: FakeProvider, secret: str
) -> None:
    import jobtrail.interfaces.webhooks as receiver

    app = receiver.webhook_app(store, {"fake": load_provider(cfg_for(fake)).config.webhooks})

    def counted() -> int:
        return sum(r["count"] for r in rows(store, "webhook_rejections"))

    assert _refused_on_a_loop_of_its_own(app, "/webhooks/fake") == 401
    assert counted() == 1  # the first of its second: written before its answer
    assert [_refused_on_a_loop_of_its_own(app, "/webhooks/fake") for _ in range(4)] == [401] * 4
    time.sleep(receiver.REFUSAL_FLUSH_S)  # their timer's loop is gone; the next refusal writes them with its own
    assert _refused_on_a_loop_of_its_own(app, "/webhooks/fake") == 401
    assert counted() == 6


def test_two_receivers_counting_a_reason_for_the_first_time_together_both_count(db_url: str) -> None:
    """An update, then an insert when no row matched: two receivers both inserted, and one lost its batch."""
    from jobtrail.ledger.webhook_events import count_refusals

    stores = [Store.open(db_url) for _ in range(2)]
    start = threading.Barrier(2)

    def count(ledger: Store) -> None:
        for _ in range(50):
            start.wait()  # each round, both count the same new reasons at once
            count_refusals(ledger, {("fake", "bad signature"): 2, ("other", "stale"): 1})

    threads = [threading.Thread(target=count, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counted = {(r["provider"], r["reason"]): r["count"] for r in rows(stores[0], "webhook_rejections")}
    assert counted == {("fake", "bad signature"): 200, ("other", "stale"): 100}
    for s in stores:
        s.close()


def test_a_host_app_that_runs_the_receivers_lifespan_gets_every_refusal_counted_at_shutdown(
    store: Store, fake: FakeProvider, secret: str
) -> None:
    """As the README shows for mounting the receiver in your own app: the last second's counts are written
    when the host shuts down."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.routing import Mount

    from helpers import serve_asgi

    hooks = webhook_app(store, {"fake": load_provider(cfg_for(fake)).config.webhooks})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> Any:
        async with hooks.router.lifespan_context(hooks):
            yield

    host = Starlette(routes=[Mount("/hooks", app=hooks)], lifespan=lifespan)
    with serve_asgi(host) as base:
        answers = [
            send_webhook(f"{base}/hooks/webhooks/fake", new_secret(), {}, event_id=f"e{i}")[0] for i in range(50)
        ]
    assert answers == [401] * 50
    assert sum(r["count"] for r in rows(store, "webhook_rejections")) == 50
