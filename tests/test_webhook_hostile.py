"""The receiver against what a probe sent it: storage failing halfway through, floods of held bodies, hang-ups,
secrets written with blanks, bodies and headers a parser or a terminal chokes on. Real servers and sockets."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import http.client
import json
import os
import resource
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import sqlalchemy as sa
from test_webhook_intake import HeldBeforeStoring
from test_webhooks import accepted_op, cfg_for, event, new_secret, rows, serve, webhook_observations

from jobtrail import AsyncJobtrail, Store
from jobtrail.interfaces.webhooks import webhook_app
from jobtrail.providers.http import load_provider
from jobtrail.testing import FakeProvider, send_webhook

from helpers import free_port, serve_asgi, sql


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


def signature(secret: str, event_id: bytes, timestamp: int, body: bytes) -> str:
    """A v1 signature as the Standard Webhooks spec makes it: HMAC-SHA256 over the bytes ``id.timestamp.body``."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, event_id + b"." + str(timestamp).encode() + b"." + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def post(url: str, lines: list[tuple[str, str | bytes]], body: bytes) -> tuple[int, dict[str, str], Any]:
    """POST ``body`` with header ``lines`` exactly as given (a name twice is sent twice, bytes as they are);
    returns (status, headers, parsed answer)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=20)
    try:
        conn.putrequest("POST", parts.path)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body)))
        for name, value in lines:
            conn.putheader(name, value)
        conn.endheaders(body)
        answer = conn.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, json.loads(answer.read() or b"null")
    finally:
        conn.close()


def signed(secret: str, event_id: bytes, body: bytes) -> list[tuple[str, str | bytes]]:
    now = int(time.time())
    return [
        ("webhook-id", event_id),
        ("webhook-timestamp", str(now)),
        ("webhook-signature", signature(secret, event_id, now, body)),
    ]


def counted(store: Store) -> dict[str, int]:
    return {r["reason"]: r["count"] for r in rows(store, "webhook_rejections")}


def start_body(url: str, declared: int, sent: bytes, timeout: float = 30) -> socket.socket:
    """A delivery with well-formed (forged) signature headers that declares ``declared`` bytes of body and
    sends ``sent`` of them, then holds the connection open."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: x\r\nwebhook-id: evt_{secrets.token_hex(4)}\r\n"
        f"webhook-timestamp: {int(time.time())}\r\nwebhook-signature: v1,AAAA\r\nContent-Length: {declared}\r\n\r\n"
    )
    try:
        sock.sendall(head.encode() + sent)
    except OSError:
        sock.close()
        raise
    return sock


def answer_head(sock: socket.socket) -> bytes:
    """The answer's status line and headers, as they come on ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.partition(b"\r\n\r\n")[0]


# -- finding 2: all or nothing -------------------------------------------------------------------------------

_REFUSE_OBSERVATIONS = {
    "sqlite": [
        "CREATE TRIGGER refuse_observations BEFORE INSERT ON observations BEGIN SELECT RAISE(ABORT, 'no space'); END"
    ],
    "postgresql": [
        "CREATE FUNCTION refuse_observation() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'no space'; "
        "END $$",
        "CREATE TRIGGER refuse_observations BEFORE INSERT ON observations FOR EACH ROW EXECUTE FUNCTION "
        "refuse_observation()",
    ],
}


@contextlib.contextmanager
def observations_refused(store: Store) -> Iterator[None]:
    """The database refuses every observation meanwhile (as a full disk or a lock waited out would), while it
    takes the other writes of the same transaction."""
    for statement in _REFUSE_OBSERVATIONS[store.dialect]:
        sql(store, statement)
    try:
        yield
    finally:
        sql(store, "DROP TRIGGER refuse_observations" + (" ON observations" if store.dialect == "postgresql" else ""))


def test_a_delivery_answered_503_keeps_nothing_and_its_redelivery_is_recorded_whole(
    ledger: Store, fake: FakeProvider, secret: str
) -> None:
    """Found by a probe: the event's row was committed before its observation was written; when that write
    failed the receiver answered 503 ("deliver it again"), and the redelivery was a 200 duplicate: the event was
    never observed and the poll never brought forward."""
    cfg = cfg_for(fake)
    op = accepted_op(ledger, cfg)
    assert (ledger.get(op.operation_id).next_action_at_us or 0) > ledger.clock()  # the next poll is 30 s away
    with serve(ledger, cfg) as url:
        with observations_refused(ledger):
            refused = send_webhook(url, secret, event(op.remote_job_id), event_id="evt_half")
        assert refused[0] == 503 and refused[1]["title"] == "storage unavailable"
        assert rows(ledger, "webhook_events") == []  # the 503 is true: nothing of it was kept
        again = send_webhook(url, secret, event(op.remote_job_id), event_id="evt_half")
    assert again[0] == 202 and again[1]["status"] == "accepted" and again[1]["operation_id"] == op.operation_id
    assert [o["raw"]["event_id"] for o in webhook_observations(ledger, op.operation_id)] == ["evt_half"]
    pulled = ledger.get(op.operation_id)
    assert pulled.next_action_at_us is not None and pulled.next_action_at_us <= ledger.clock()


def test_a_delivery_that_waited_out_a_locked_table_on_postgres_is_recorded_whole_when_delivered_again(
    db_url: str, engine_name: str, fake: FakeProvider, secret: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a probe: another session held LOCK TABLE observations past the lock time-out; the receiver
    answered 503 with the event's row already committed, and the redelivery got 200 duplicate."""
    if engine_name != "postgresql":
        pytest.skip("LOCK TABLE is PostgreSQL's")
    import jobtrail.ledger.store as store_module

    monkeypatch.setattr(store_module, "POSTGRES_LOCK_TIMEOUT_MS", 500)
    with Store.open(db_url) as store, Store.open(db_url) as other:
        cfg = cfg_for(fake)
        op = accepted_op(store, cfg)
        with serve(store, cfg) as url:
            with other.engine.connect() as locker:
                locker.execute(sa.text("LOCK TABLE observations IN ACCESS EXCLUSIVE MODE"))
                refused = send_webhook(url, secret, event(op.remote_job_id), event_id="msg_A")
                locker.rollback()
            again = send_webhook(url, secret, event(op.remote_job_id), event_id="msg_A")
        assert refused[0] == 503
        assert again[0] == 202 and again[1]["status"] == "accepted"
        assert len(webhook_observations(store, op.operation_id)) == 1
        pulled = store.get(op.operation_id)
        assert pulled.next_action_at_us is not None and pulled.next_action_at_us <= store.clock()


def test_an_event_kept_as_an_orphan_but_not_filed_under_its_operation_is_filed_when_delivered_again(
    open_store: Callable[..., Store], ledger: Store, fake: FakeProvider, secret: str
) -> None:
    """Found by a probe (the same failure, at the orphan's step): an event that arrives while its operation learns
    the job id is kept as an orphan and then filed under that operation; when filing it failed, the answer was
    503 and the redelivery a duplicate, and the operation, which had looked for orphans already, never saw it."""
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

        async def create() -> None:
            await jt.drive_create(op_id)  # the job id is recorded, and waiting events looked for (none yet)
            await jt.providers["fake"].aclose()

        asyncio.run(create())
        with observations_refused(ledger):
            held.go_on.set()
            sender.join(20)
        assert answers[0][0] == 503
        again = send_webhook(url, secret, event("job_00001", "job.running"), event_id="e1")
    assert again[0] == 202 and again[1]["status"] == "accepted" and again[1]["operation_id"] == op_id
    assert [r["operation_id"] for r in rows(ledger, "webhook_events")] == [op_id]
    assert [o["raw"]["event_id"] for o in webhook_observations(ledger, op_id)] == ["e1"]


# -- finding 3: what a flood of bodies can make the receiver hold --------------------------------------------


def test_a_delivery_that_finds_no_room_for_its_body_is_answered_503_with_retry_after_and_not_read_on(
    store: Store, fake: FakeProvider, secret: str
) -> None:
    """Found by a probe: each unauthenticated connection could make the receiver hold max_bytes of body, with no
    limit on how many. Room for bodies is now shared, taken as their bytes arrive: a delivery whose bytes find
    none is refused and the rest not read; and (found by a review) connections that declare bodies and send
    nothing hold no room at all, so they cannot shut real deliveries out."""
    cfg = cfg_for(fake, max_bytes=1000)
    op = accepted_op(store, cfg)
    app = webhook_app(store, {"fake": load_provider(cfg).config.webhooks}, max_bytes_in_flight=3000)
    with serve_asgi(app) as base:
        url = f"{base}/webhooks/fake"
        silent = [start_body(url, 1000, b"") for _ in range(5)]  # declared, nothing sent: no room held
        time.sleep(0.5)
        meanwhile = send_webhook(url, secret, event(op.remote_job_id), event_id="evt_meanwhile")
        holding = [start_body(url, 1000, b"{" + b" " * 998) for _ in range(3)]  # room for 3 bodies of 1000 bytes
        time.sleep(0.5)  # (each one's room is taken as its bytes arrive)
        waiting = start_body(url, 1000, b"{" + b" " * 9, timeout=5)
        head = answer_head(waiting)  # answered at its first bytes, the rest never read
        waiting.close()
        for sock in silent:
            sock.close()
        for sock in holding:
            sock.close()
        time.sleep(0.5)  # the room they held is given back as the receiver hears they hung up
        later = send_webhook(url, secret, event(op.remote_job_id), event_id="evt_after")
    assert meanwhile[0] == 202, meanwhile
    assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 10" in head.lower(), head
    assert later[0] == 202
    assert counted(store)["receiver busy"] == 1


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_flood_of_connections_holding_bodies_does_not_grow_the_receiver_without_bound(
    db_url: str, fake: FakeProvider, secret: str, tmp_path: Path
) -> None:
    """Found by a probe: 1,500 connections each sending most of a 1 MiB body with forged signature headers made
    `jobtrail webhooks serve` hold 1.6 GiB (300: 390 MiB). Now bodies held at once are capped, and so are the
    connections served at once; the receiver answers a signed delivery once the flood is gone."""
    if not Path("/proc/self/status").exists():
        pytest.skip("reads the receiver's memory from /proc")
    n = 1500
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2 * n + 200:
        pytest.skip(f"needs {2 * n + 200} file descriptors (the hard limit is {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2 * n + 200), hard))
    with Store.open(db_url) as store:
        op = accepted_op(store, cfg_for(fake))
    provider_file = fake.write_provider_file(tmp_path / "fake.toml", webhooks={"secrets": ["env:WHSEC_CURRENT"]})
    port = free_port()
    with receiver_process(db_url, provider_file, port, tmp_path / "stderr.txt") as proc:
        url = f"http://127.0.0.1:{port}/webhooks/fake"
        time.sleep(1)
        idle = _rss_mib(proc.pid)
        body = b"{" + b" " * (1024 * 1024 - 2)
        socks: list[socket.socket] = []

        def one(_: int) -> None:
            with contextlib.suppress(OSError):  # (one answered 503 and closed meanwhile)
                socks.append(start_body(url, len(body) + 1, body))

        with ThreadPoolExecutor(64) as pool:
            list(pool.map(one, range(n)))
        time.sleep(2)
        flooded = _rss_mib(proc.pid)
        for sock in socks:
            sock.close()
        time.sleep(1)
        after = send_webhook(url, secret, event(str(op.remote_job_id)), event_id="evt_after_flood")
    assert flooded - idle < 128, (
        f"{n} connections holding 1 MiB bodies grew the receiver from {idle:.0f} MiB to {flooded:.0f}"
    )
    assert after[0] == 202


@contextlib.contextmanager
def receiver_process(db_url: str, provider_file: Path, port: int, stderr: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`jobtrail webhooks serve` in a process of its own, its log in ``stderr``; stopped as Ctrl-C stops it."""
    with stderr.open("wb") as log:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "jobtrail", "--db", db_url, "webhooks", "serve"),
                *("--provider", str(provider_file), "--host", "127.0.0.1", "--port", str(port)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
            env=dict(os.environ),
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            assert proc.poll() is None, stderr.read_text()
            assert time.monotonic() < deadline, "the receiver never listened"
            time.sleep(0.1)
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- finding 5: hang-ups ------------------------------------------------------------------------------------


def test_clients_hanging_up_mid_body_are_counted_as_refusals_with_a_log_line_a_second(
    db_url: str, fake: FakeProvider, secret: str, tmp_path: Path
) -> None:
    """Found by a probe: each client that hung up halfway through its body logged "Exception in ASGI
    application (ClientDisconnect)" with a traceback, and none was counted in webhook_rejections."""
    provider_file = fake.write_provider_file(tmp_path / "fake.toml", webhooks={"secrets": ["env:WHSEC_CURRENT"]})
    port = free_port()
    log = tmp_path / "stderr.txt"
    with receiver_process(db_url, provider_file, port, log):
        started = time.monotonic()
        for _ in range(200):
            start_body(f"http://127.0.0.1:{port}/webhooks/fake", 100, b"{").close()
            time.sleep(0.002)
        time.sleep(1.5)
        took = time.monotonic() - started
    text = log.read_text()
    assert "Traceback" not in text and "Exception in ASGI application" not in text
    lines = [line for line in text.splitlines() if "client disconnected" in line]
    assert 1 <= len(lines) <= took + 2  # a line a second at most
    with Store.open(db_url) as store:
        assert counted(store) == {"client disconnected": 200}


# -- finding 4: a secret with blanks around it ---------------------------------------------------------------


@pytest.mark.parametrize(
    "written",
    [
        pytest.param(lambda s: " " + s, id="a-leading-space"),
        pytest.param(lambda s: "\n" + s, id="a-leading-newline"),
        pytest.param(lambda s: "\t" + s + "\n", id="a-tab-before-and-a-newline-after"),
        pytest.param(lambda s: "  " + s + "  \n", id="blanks-both-sides"),
    ],
)
def test_a_secret_with_blanks_around_it_verifies_what_the_provider_signs(
    store: Store, fake: FakeProvider, monkeypatch: pytest.MonkeyPatch, written: Callable[[str], str]
) -> None:
    """Found by a probe: the start-up check read the secret without its blanks, verification with them, so the
    receiver started and then answered every correctly signed delivery 401."""
    key = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    monkeypatch.setenv("WHSEC_WRITTEN", written(key))
    cfg = cfg_for(fake, secrets=["env:WHSEC_WRITTEN"])
    op = accepted_op(store, cfg)
    with serve(store, cfg) as url:
        got = send_webhook(url, key, event(op.remote_job_id), event_id="evt_1")
    assert got[0] == 202, got


# -- finding 7: a number too long to read --------------------------------------------------------------------


def test_a_number_of_more_than_4300_digits_is_refused_saying_what_is_wrong_with_the_body(
    store: Store, fake: FakeProvider, secret: str
) -> None:
    """Found by a probe: the 400 carried Python's own words, "...use sys.set_int_max_str_digits() to increase the
    limit": advice to the sender about our interpreter, not about its body."""
    cfg = cfg_for(fake)
    op = accepted_op(store, cfg)
    head = b'{"type":"t","data":{"id":"' + str(op.remote_job_id).encode() + b'"},"n":'
    with serve(store, cfg) as url:
        long = head + b"9" * 4301 + b"}"
        too_long = post(url, signed(secret, b"evt_long", long), long)
        longest = head + b"9" * 4300 + b"}"
        read = post(url, signed(secret, b"evt_longest", longest), longest)
    status, _, answer = too_long
    assert status == 400 and answer["title"] == "malformed JSON"
    assert "a number with more than 4300 digits" in answer["detail"]
    assert "sys." not in answer["detail"] and "set_int_max_str_digits" not in answer["detail"]
    assert read[0] == 202  # as many digits as Python reads are read, as before


# -- finding 8: the signature first, every signature line, and the id's bytes -------------------------------


def test_a_body_that_is_not_utf8_is_a_bad_signature_unless_it_is_signed(
    store: Store, fake: FakeProvider, secret: str
) -> None:
    """Found by a probe: a body that was not UTF-8 was answered 400 "malformed body" before its signature was
    checked, forged or not. The signature is checked over the bytes first: forged, 401; signed, the sender's
    body is at fault, 400."""
    cfg = cfg_for(fake)
    with serve(store, cfg) as url:
        body = b"\xff\xfe{}"
        forged = post(url, signed(new_secret(), b"evt_forged", body), body)
        own = post(url, signed(secret, b"evt_signed", body), body)
    assert forged[0] == 401 and forged[2]["title"] == "bad signature"
    assert own[0] == 400 and own[2]["title"] == "malformed JSON"


def test_a_valid_signature_on_a_second_signature_line_is_accepted(
    store: Store, fake: FakeProvider, secret: str
) -> None:
    """Found by a probe: with two webhook-signature header lines only the first was read, so a valid signature on
    the second was answered 401."""
    cfg = cfg_for(fake)
    op = accepted_op(store, cfg)
    body = json.dumps(event(str(op.remote_job_id))).encode()
    lines = signed(secret, b"evt_two_lines", body)
    lines.insert(2, ("webhook-signature", "v1," + base64.b64encode(b"\0" * 32).decode()))
    with serve(store, cfg) as url:
        status, _, answer = post(url, lines, body)
    assert status == 202 and answer["status"] == "accepted"


@pytest.mark.parametrize(
    "event_id",
    [
        pytest.param("evtévènement".encode(), id="utf8-beyond-ascii"),
        pytest.param(b"evt\x01one", id="control-character"),
        pytest.param(b"evt\x1b[31mred", id="terminal-escape"),
        pytest.param(b"evt\x7fdel", id="delete"),
        pytest.param(b"evt\tone", id="tab"),
    ],
)
def test_an_event_id_that_is_not_printable_ascii_is_refused_400_and_nothing_is_kept(
    store: Store, fake: FakeProvider, secret: str, event_id: bytes
) -> None:
    """Found by a probe: ids with control characters (a terminal escape, DEL) were accepted and stored, to be
    shown as other text; and an id beyond ASCII, signed over its UTF-8 bytes, was always 401 (the receiver read the
    header as Latin-1 and checked the signature over that text in UTF-8). Both are a clear 400 now."""
    cfg = cfg_for(fake)
    op = accepted_op(store, cfg)
    body = json.dumps(event(str(op.remote_job_id))).encode()
    with serve(store, cfg) as url:
        status, _, answer = post(url, signed(secret, event_id, body), body)
        normal = post(url, signed(secret, b"evt_plain-1_A:b", body), body)
    assert status == 400 and answer["title"] == "unusable webhook-id", answer
    assert "printable ASCII" in answer["detail"] and "position 4" in answer["detail"]
    assert [r["event_id"] for r in rows(store, "webhook_events")] == ["evt_plain-1_A:b"]
    assert normal[0] == 202
