"""Bad input, generated: malformed provider answers, webhooks and provider files.

Provider answers are raw HTTP responses written byte for byte by a real
socket server on 127.0.0.1, so anything a broken API can send (wrong types,
missing fields, invalid JSON, odd encodings, huge bodies, absurd
``Retry-After``) reaches the real client, parser and flows. Each example
asserts that nothing raised, that the record is consistent and says what went
wrong, and that nothing was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jobtrail import AsyncJobtrail, ConfigError, JobtrailError, Operation, State, Store
from jobtrail.flows.create import CreateFlow
from jobtrail.flows.observe import CollectFlow, ObserveFlow
from jobtrail.ledger.audit import verify
from jobtrail.ledger.results import read_result
from jobtrail.ledger.writer import Writer
from jobtrail.providers.http import load_provider
from jobtrail.testing import FakeProvider, provider_toml

from helpers import drive

S = State
#: examples per property in this tier (tests/conftest.py: 20 in the fast tier, the rest of
#: JOBTRAIL_FUZZ_EXAMPLES, default 120, with --long)
EXAMPLES = settings().max_examples
pytestmark = [pytest.mark.timeout(120 + EXAMPLES)]
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


class RawServer:
    """Answers every request on 127.0.0.1 with the bytes it was last given."""

    def __init__(self) -> None:
        self.answer = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"
        self.requests = 0
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                sizes = [
                    line.split(b":", 1)[1]
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ]
                length = int(sizes[0]) if sizes else 0
                while len(body) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    body += chunk
                self.requests += 1
                with contextlib.suppress(OSError):
                    conn.sendall(self.answer)

    def close(self) -> None:
        self._sock.close()


def http(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    lines = [f"HTTP/1.1 {status} X".encode(), *(k + b": " + v for k, v in headers)]
    lines += [b"Content-Length: " + str(len(body)).encode(), b"Connection: close"]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
odd_values = st.one_of(json_values, st.sampled_from(["succeeded", "running", "failed", "job-1", "", "\u0000", "💥"]))
#: plausible documents with wrong types and missing fields
documents = st.fixed_dictionaries(
    {},
    optional={
        "id": odd_values,
        "status": odd_values,
        "progress": odd_values,
        "updated_at": odd_values,
        "result_url": odd_values,
        "effects": odd_values,
    },
)
bodies = st.one_of(
    documents.map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),  # invalid JSON, odd bytes
    documents.map(lambda d: json.dumps(d).encode("utf-16")),  # an odd encoding
    documents.map(lambda d: json.dumps(d, ensure_ascii=False).encode("latin-1", errors="replace")),
    st.integers(1, 3).map(lambda n: b'{"id": "job-big", "pad": "' + b"x" * (n * 1_500_000) + b'"}'),  # huge
    # a number no 64-bit float holds (json.dumps never writes one): Python reads infinity, which nothing stores
    st.tuples(documents, st.sampled_from([b"1e999", b"-1e400", b"2e308"])).map(
        lambda d: json.dumps({**d[0], "n": 0}).encode().replace(b'"n": 0', b'"n": ' + d[1])
    ),
)
retry_afters = st.one_of(
    st.integers(-10, 10**30).map(lambda n: str(n).encode()),
    st.sampled_from([b"Wed, 21 Oct 2099 07:28:00 GMT", b"Wed, 21 Oct 1999 07:28:00 GMT", b"soon", b"", b"1e9", b"NaN"]),
    # digits no float holds, more digits than int() reads, a digit that is no ASCII digit
    st.sampled_from([b"9" * 400, b"9" * 5000, "\u00b2".encode(), "\u0663".encode()]),
    st.binary(max_size=12).filter(lambda b: b"\r" not in b and b"\n" not in b),
)
header_lists = st.lists(
    st.tuples(
        st.sampled_from([b"Retry-After", b"Content-Type", b"Location", b"X-Request-Id", b"X-Result-SHA256"]),
        retry_afters,
    ),
    max_size=4,
)
statuses = st.one_of(
    st.sampled_from([200, 201, 202, 204, 400, 404, 409, 410, 422, 429, 500, 503]), st.integers(100, 599)
)
responses = st.builds(http, statuses, header_lists, bodies)


@pytest.fixture(scope="module")
def raw() -> Iterator[RawServer]:
    server = RawServer()
    yield server
    server.close()


@pytest.fixture
def world(raw: RawServer, db_url: str) -> Iterator[tuple[Store, Any]]:
    """The provider answering through ``raw``, and a ledger on each engine (PostgreSQL text holds no NUL)."""
    config = FakeProvider(port=raw.port).provider_config()
    config["base_url"] = f"http://127.0.0.1:{raw.port}"
    config["timeout_s"] = 5
    store = Store.open(db_url)
    yield store, load_provider(config)
    store.close()


def fresh(store: Store, provider: Any) -> Operation:
    async def go() -> Operation:
        jt = AsyncJobtrail(store=store, providers=[provider])
        return await jt.submit("fake", {"n": 1}, result_deadline=timedelta(days=1))

    return asyncio.run(go())


def answered(world: tuple[Store, Any], raw: RawServer, answer: bytes, op: Operation, flow: Any) -> Operation:
    """One step of ``flow`` on ``op`` while the provider answers ``answer``; nothing lost, the chain intact."""
    store, provider = world
    raw.answer = answer

    async def go() -> Operation:
        try:
            return await flow(store, Writer(store), actor="fuzz").advance(op, provider)
        finally:
            await provider.aclose()

    after = store.get(asyncio.run(go()).operation_id)
    assert after.version >= op.version
    assert verify(store).ok
    return after


@pytest.mark.fuzz  # (the generated cases: both tiers, on budgets of their own)
@FUZZ
@given(answer=responses)
@example(answer=http(201, [], b'{"id": "\\u0000"}'))  # found by fuzzing: a NUL job id was taken
@example(answer=http(201, [(b"X-Request-Id", b"\xe7\xe4")], '{"id": "j\u00e9"}'.encode("latin-1")))
@example(answer=http(201, [], b'{"id": "job-1", "n": 1e999}'))
@example(
    answer=http(201, [(b"Retry-After", b"9" * 400)], b'{"id": "job-1"}')
)  # raised: the answer was lost  # past a float: its write failed, the answer lost
def test_any_create_answer_is_recorded_and_never_taken_for_a_job_it_does_not_name(
    world: tuple[Store, Any], raw: RawServer, answer: bytes
) -> None:
    store, provider = world
    op = fresh(store, provider)
    after = answered(world, raw, answer, op, lambda s, w, actor: CreateFlow(s, writer=w, actor=actor))
    assert after.attempts == 1
    assert after.state in {S.CREATE_PENDING, S.CREATE_UNKNOWN, S.RECONCILIATION, S.ACCEPTED, S.FAILED} or (
        after.state is S.NEEDS_ATTENTION
        and (
            answer[9:10] == b"3"  # a redirect: neither followed nor re-sent
            # the job an earlier example's operation holds (examples share the ledger): never given twice
            or "already holds that job" in (after.state_reason or "")
        )
    )
    if after.state is S.ACCEPTED:
        job_id = after.remote_job_id or ""
        assert job_id.isprintable(), "an unusable job id was taken"
        assert job_id.encode() in answer or json.dumps(job_id)[1:-1].encode() in answer, "a job id never given"
    else:
        assert after.state_reason, "a doubtful or refused create says why"
    assert [o["kind"] for o in store.observations(op.operation_id)][-1:] == ["create_response"]


@pytest.mark.fuzz  # (the generated cases: both tiers, on budgets of their own)
@FUZZ
@given(answer=responses)
@example(answer=http(200, [], b'{"status": "running", "result_url": "/r\\u0000", "updated_at": "\\u0000"}'))
@example(answer=http(200, [], b'{"status": "running", "effects": ""}'))  # found by fuzzing: unreadable record
@example(answer=http(200, [], b'{"status": "succeeded", "progress": 1e999}'))  # past a float: polled again and again
def test_any_status_answer_is_an_observation_and_only_a_mapped_state_ends_the_job(
    world: tuple[Store, Any], raw: RawServer, answer: bytes
) -> None:
    store, provider = world
    op = drive(store, fresh(store, provider), S.ACCEPTED)
    after = answered(world, raw, answer, op, ObserveFlow)
    polls = [o for o in store.observations(op.operation_id) if o["kind"] == "status_poll"]
    assert len(polls) == 1
    if after.state in (S.RESULT_COLLECTING, S.FAILED, S.CANCELLED):
        # only a 200 whose status field says so ends the job
        assert answer.startswith(b"HTTP/1.1 200 ")
        word = {S.RESULT_COLLECTING: b"succeeded", S.FAILED: b"failed", S.CANCELLED: b"cancelled"}[after.state]
        assert word in answer
    else:
        assert after.state in (S.ACCEPTED, S.OBSERVING)
        assert after.next_action_at_us is not None and after.next_action_at_us <= store.clock() + 10**6 * 86400 * 2, (
            "an absurd Retry-After never schedules the next poll beyond the back-off's bounds"
        )


@pytest.mark.fuzz  # (the generated cases: both tiers, on budgets of their own)
@FUZZ
@given(answer=responses)
@example(answer=http(200, [(b"Content-Type", b"application/json")], b'{"score": 1e999}'))
def test_any_result_answer_is_stored_verified_or_refused_with_a_reason(
    world: tuple[Store, Any], raw: RawServer, answer: bytes
) -> None:
    store, provider = world
    op = drive(store, fresh(store, provider), S.RESULT_COLLECTING)
    after = answered(world, raw, answer, op, CollectFlow)
    assert after.state in (S.RESULT_COLLECTING, S.SUCCEEDED, S.RESULT_VALIDATION_FAILED, S.RESULT_UNAVAILABLE)
    if after.state is S.SUCCEEDED:
        _, data = read_result(store, op.operation_id)
        assert answer.endswith(data), "the stored result is the bytes that were sent"
    else:
        assert after.state_reason


# -- webhooks ----------------------------------------------------------------------------------

WHSEC = "whsec_" + "ZnV6ei13ZWJob29rLXNlY3JldC1vZi0zMi1ieXRlcyE="


@pytest.fixture(scope="module")
def receiver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Store]]:
    from test_webhooks import serve

    os.environ["WHSEC_FUZZ"] = WHSEC
    store = Store.open(tmp_path_factory.mktemp("wh") / "wh.db")
    cfg = FakeProvider(port=9).provider_config(webhooks={"secrets": ["env:WHSEC_FUZZ"], "max_bytes": 65536})
    cfg["base_url"] = "http://127.0.0.1:9"
    with serve(store, cfg) as url:
        yield url, store
    store.close()


def post(url: str, body: bytes, headers: dict[str, str]) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


header_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40)


@pytest.mark.fuzz  # (the generated cases: both tiers, on budgets of their own)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.one_of(bodies.filter(lambda b: len(b) < 200_000), json_values.map(lambda v: json.dumps(v).encode())),
    webhook_id=header_text,
    timestamp=st.one_of(header_text, st.integers(-(10**12), 10**12).map(str)),
    signature=st.one_of(header_text, st.just("v1,AAAA"), st.just("")),
    signed=st.booleans(),
)
def test_malformed_webhooks_are_refused_or_kept_and_never_break_the_receiver(
    receiver: tuple[str, Store], body: bytes, webhook_id: str, timestamp: str, signature: str, signed: bool
) -> None:
    import time

    from jobtrail.testing import signed_headers

    url, store = receiver
    if signed:
        body = body.decode("utf-8", "replace").encode()  # Standard Webhooks signs text
        event_id = "evt_" + str(abs(hash((body, webhook_id))))
        headers = signed_headers(WHSEC, event_id, int(time.time()), body)
    else:
        headers = {"webhook-id": webhook_id, "webhook-timestamp": timestamp, "webhook-signature": signature}
    before = count_events(store)
    status = post(url, body, headers)
    assert status in (200, 202, 400, 401, 413, 422), status
    if not signed:
        assert status in (400, 401, 413) and count_events(store) == before, "an unsigned event is never kept"
    elif status == 202:
        assert count_events(store) == before + 1


def count_events(store: Store) -> int:
    import sqlalchemy as sa

    with store.engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM webhook_events")).scalar() or 0)


# -- provider files ----------------------------------------------------------------------------

BASE = FakeProvider(port=9).provider_config()
BASE["base_url"] = "http://127.0.0.1:9"
KEYS = [(None, k) for k in BASE] + [(t, k) for t, v in BASE.items() if isinstance(v, dict) for k in v]


@pytest.mark.fuzz  # (the generated cases: both tiers, on budgets of their own)
@settings(max_examples=EXAMPLES * 2, deadline=None)
@given(
    where=st.sampled_from(KEYS),
    value=st.one_of(json_values, st.just("env:"), st.just("sk_live_abcdefabcdef1234567890")),
    action=st.sampled_from(["replace", "delete", "add"]),
)
def test_a_wrong_provider_file_is_refused_with_the_key_that_is_wrong(
    tmp_path_factory: pytest.TempPathFactory, where: tuple[str | None, str], value: Any, action: str
) -> None:
    config = json.loads(json.dumps(BASE))
    table, key = where
    section = config if table is None else config[table]
    if action == "replace":
        section[key] = value
    elif action == "delete":
        section.pop(key)
    else:
        section["unexpected_" + key] = value
    try:
        text = provider_toml(config)
    except (TypeError, ValueError):
        return  # not expressible as TOML: nothing to load
    path = tmp_path_factory.mktemp("p") / "provider.toml"
    path.write_text(text, encoding="utf-8")
    try:
        load_provider(path)
    except ConfigError as exc:
        message = str(exc)
        assert str(path) in message or "provider.toml" in message, message
        named = key if action != "add" else "unexpected_" + key
        assert named in message or (table or "") in message or "TOML" in message, message
    except JobtrailError as exc:  # pragma: no cover - the only family allowed
        pytest.fail(f"not a ConfigError: {type(exc).__name__}: {exc}")


@pytest.mark.fuzz  # (the generated cases: both tiers, on budgets of their own)
@settings(max_examples=EXAMPLES, deadline=None)
@given(text=st.text(max_size=300))
def test_a_provider_file_that_is_not_toml_is_refused_clearly(
    tmp_path_factory: pytest.TempPathFactory, text: str
) -> None:
    path = tmp_path_factory.mktemp("p") / "broken.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as refused:
        load_provider(path)
    assert "broken.toml" in str(refused.value)


# -- answers other parsers would read differently ------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"id": "job-a", "id": "job-b"}', "names the same key twice"),  # job-a to one parser, job-b to this
        (b'{"id": "job-1", "note": "\\ud800"}', "lone surrogate"),  # no UTF-8 text holds it: nothing was stored
        (b'{"id": "job-1", "x": ' + b"[" * 400 + b"]" * 400 + b"}", "nested deeper than"),
        (b'{"id": 1e20}', None),  # read back as 1e+20: not the id the provider wrote
        (b'{"id": 1.50}', None),
        (b'{"id": true}', None),
        (b'{"id": "   "}', None),
    ],
    ids=["key-twice", "lone-surrogate", "deep", "exponent", "fraction", "boolean", "blank"],
)
def test_a_create_answer_whose_job_id_another_parser_reads_otherwise_names_no_job(
    world: tuple[Store, Any], raw: RawServer, body: bytes, why: str | None
) -> None:
    store, provider = world
    op = fresh(store, provider)
    after = answered(world, raw, http(201, [], body), op, lambda s, w, actor: CreateFlow(s, writer=w, actor=actor))
    assert after.state is not S.ACCEPTED and after.remote_job_id is None and after.state_reason
    seen = store.observations(op.operation_id)[-1]
    assert seen["kind"] == "create_response"  # the answer is kept, as it came
    if why:
        assert why in seen["raw"]["body"]["_jobtrail_why"]


@pytest.mark.parametrize(
    "body",
    [
        b'{"status": "running", "status": "succeeded"}',  # running to a parser that keeps the first
        b'{"status": "succeeded", "note": "\\udc00"}',
        b'{"status": "succeeded", "x": ' + b"[" * 400 + b"]" * 400 + b"}",
    ],
    ids=["key-twice", "lone-surrogate", "deep"],
)
def test_a_status_answer_another_parser_reads_otherwise_ends_nothing_and_is_kept(
    world: tuple[Store, Any], raw: RawServer, body: bytes
) -> None:
    store, provider = world
    op = drive(store, fresh(store, provider), S.ACCEPTED)
    after = answered(world, raw, http(200, [], body), op, ObserveFlow)
    assert after.state in (S.ACCEPTED, S.OBSERVING) and after.remote_state in (None, "unknown")
    assert after.next_action_at_us is not None  # polled again later
    (poll,) = [o for o in store.observations(op.operation_id) if o["kind"] == "status_poll"]
    assert "_jobtrail_why" in poll["raw"]["body"]


@pytest.mark.parametrize("progress", [b'"NaN"', b'"-inf"', b'"1e400"', str(10**400).encode()])
def test_a_progress_that_no_float_holds_is_no_progress_and_the_poll_is_kept(
    world: tuple[Store, Any], raw: RawServer, progress: bytes
) -> None:
    store, provider = world
    op = drive(store, fresh(store, provider), S.ACCEPTED)
    after = answered(
        world, raw, http(200, [], b'{"status": "running", "progress": ' + progress + b"}"), op, ObserveFlow
    )
    assert after.state is S.OBSERVING and after.remote_state == "running"
    (poll,) = [o for o in store.observations(op.operation_id) if o["kind"] == "status_poll"]
    assert poll["progress"] is None


@pytest.mark.parametrize("ref", [b'""', b'"  "', b"5", b"true"])
def test_a_result_reference_that_is_blank_or_no_string_is_no_reference(
    world: tuple[Store, Any], raw: RawServer, ref: bytes
) -> None:
    """``""`` resolved to the provider's base URL itself (its home page was stored as the result), ``5`` to
    ``/5``: the declared result path is fetched instead."""
    store, provider = world
    op = drive(store, fresh(store, provider), S.ACCEPTED)
    after = answered(world, raw, http(200, [], b'{"status": "succeeded", "result_url": ' + ref + b"}"), op, ObserveFlow)
    assert after.state is S.RESULT_COLLECTING
    (poll,) = [o for o in store.observations(op.operation_id) if o["kind"] == "status_poll"]
    assert poll["raw"]["result_ref"] is None


def test_a_finished_job_with_no_usable_result_reference_and_no_result_path_is_unavailable_at_once(
    raw: RawServer, db_url: str
) -> None:
    """It was retried without end, its reason a ConfigError: asking again cannot bring a reference."""
    config = FakeProvider(port=raw.port).provider_config()
    config["base_url"] = f"http://127.0.0.1:{raw.port}"
    del config["result"]  # the result is only ever where the status says
    store = Store.open(db_url)
    provider = load_provider(config)
    try:
        op = drive(store, fresh(store, provider), S.RESULT_COLLECTING)
        before = raw.requests
        after = answered((store, provider), raw, http(200, [], b"{}"), op, CollectFlow)
        assert after.state is S.RESULT_UNAVAILABLE
        assert "no usable result reference" in (after.state_reason or "")
        assert raw.requests == before  # nothing was fetched
    finally:
        store.close()


def test_a_provider_that_says_retry_at_once_to_every_poll_is_polled_at_the_back_offs_pace(
    raw: RawServer, db_url: str
) -> None:
    """``Retry-After: 0`` on every answer was taken at its word: some hundred polls a second, each one
    written to the ledger, until the result deadline. It is a floor, not a pace."""
    from jobtrail.runtime.worker import Worker

    config = FakeProvider(port=raw.port).provider_config()  # polls: 0.1 s, then x1.5, at most 0.5 s
    config["base_url"] = f"http://127.0.0.1:{raw.port}"
    store = Store.open(db_url)
    provider = load_provider(config)
    try:
        drive(store, fresh(store, provider), S.ACCEPTED)
        raw.answer = http(503, [(b"Retry-After", b"0")], b"")
        before = raw.requests
        asyncio.run(Worker(store, {"fake": provider}, worker_id="w", writer_process=False).run(timeout=2))
        polls = raw.requests - before
        assert 2 <= polls <= 30, f"{polls} polls in 2 s"
    finally:
        store.close()


_CSV = b"".join(b"row,%d\n" % i for i in range(5000))


def _coded(wbits: int, data: bytes = _CSV) -> bytes:
    squeeze = zlib.compressobj(6, zlib.DEFLATED, wbits)
    return squeeze.compress(data) + squeeze.flush()


@pytest.mark.parametrize(
    ("coding", "body", "plain"),
    [
        (b"gzip", _coded(31), _CSV),
        (b"x-gzip", _coded(31), _CSV),
        (b"deflate", _coded(15), _CSV),  # zlib-wrapped, as RFC 9110 says
        (b"deflate", _coded(-15), _CSV),  # raw, as many servers send it
        (b"deflate", _coded(-15, _CSV * 12), _CSV * 12),  # raw: its last 256 KiB come only once no input is left
        (b"gzip", _coded(31, _CSV[:1000]) + _coded(31, _CSV[1000:]), _CSV),  # two members (RFC 1952 2.2)
        (b"gzip", _coded(31)[: len(_coded(31)) // 2], None),  # cut short, its length intact: was stored
        (b"gzip", _coded(31) + b"trailing", None),
        (b"gzip", b"not gzip at all", None),
        (b"br", b"\x0b\x02\x80hello\x03", None),  # a coding not asked for, not read
    ],
    ids=[
        *("gzip", "x-gzip", "deflate-zlib", "deflate-raw", "deflate-raw-large", "gzip-two-members"),
        *("cut-short", "trailing-bytes", "not-gzip", "brotli"),
    ],
)
def test_a_compressed_result_is_stored_only_when_its_stream_is_whole(
    world: tuple[Store, Any], raw: RawServer, coding: bytes, body: bytes, plain: bytes | None
) -> None:
    store, provider = world
    op = drive(store, fresh(store, provider), S.RESULT_COLLECTING)
    checksum = hashlib.sha256(plain or _CSV).hexdigest().encode()  # of what the body decompresses to
    headers = [(b"Content-Type", b"text/csv"), (b"Content-Encoding", coding), (b"X-Result-SHA256", checksum)]
    after = answered(world, raw, http(200, headers, body), op, CollectFlow)
    if plain is not None:
        assert after.state is S.SUCCEEDED
        assert read_result(store, op.operation_id)[1] == plain
    else:
        assert after.state in (S.RESULT_COLLECTING, S.RESULT_UNAVAILABLE)  # fetched again later, or given up
        assert "incomplete_response" in (after.state_reason or "")  # the reason names what went wrong
        (fetch,) = [o for o in store.observations(op.operation_id) if o["kind"] == "result_fetch"]
        assert (
            fetch["raw"]["error"]["error"] == "incomplete_response"
            and coding.decode() in fetch["raw"]["error"]["detail"]
        )


def test_a_status_answer_that_cannot_be_read_says_why_in_the_operations_reason(
    world: tuple[Store, Any], raw: RawServer
) -> None:
    """ "unknown state, still polling" alone left an operator guessing, poll after poll."""
    store, provider = world
    op = drive(store, fresh(store, provider), S.ACCEPTED)
    twice = http(200, [], b'{"status": "running", "status": "succeeded"}')
    op = answered(world, raw, twice, op, ObserveFlow)
    time.sleep(max(0, (op.next_action_at_us or 0) - store.clock()) / 1e6)  # the next poll is due
    after = answered(world, raw, twice, store.get(op.operation_id), ObserveFlow)
    assert after.state is S.OBSERVING
    assert "names the same key twice" in (after.state_reason or ""), after.state_reason


def test_a_status_answer_that_redirects_says_where_in_the_operations_reason(
    world: tuple[Store, Any], raw: RawServer
) -> None:
    """ "status poll failed (http_302)", poll after poll, left an operator to find the moved path alone."""
    store, provider = world
    op = drive(store, fresh(store, provider), S.ACCEPTED)
    moved = http(302, [(b"Location", b"/v2/jobs/job-1?sig=abc123")], b"")
    after = answered(world, raw, moved, op, ObserveFlow)
    assert after.state is S.ACCEPTED
    reason = after.state_reason or ""
    assert "http_302" in reason and "a redirect to /v2/jobs/job-1" in reason and "not followed" in reason
    assert "abc123" not in reason  # a signature in the Location is masked, as everywhere
