"""The operation record: durable before anything is sent, keyed, fenced, append-only."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import re
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from jobtrail import (
    BODY_NOT_LOADED,
    AsyncJobtrail,
    CreateAttempt,
    Operation,
    OperationKeyConflict,
    OperationNotFound,
    RemoteState,
    SecretInRequest,
    StaleRecord,
    State,
    StorageError,
    Store,
    UsageError,
    ValidatedResult,
    ValidationFailure,
)
from jobtrail.domain.evidence import DefinitiveRejection, StatusObservation
from jobtrail.ledger.audit import verify
from jobtrail.ledger.results import stored_result
from jobtrail.ledger.store import Change, Release, Reschedule, StoredResult
from jobtrail.testing import FakeProvider

from helpers import S, drive, obs, op_in, spec


def test_record_has_the_design_fields(store: Store) -> None:
    """Sortable op_ id, 128-bit token, W3C trace id, fingerprint, deadlines, caller, approver."""
    op, created = store.create_operation(spec(operation_key="k1"))
    assert created
    assert re.fullmatch(r"op_[0-9A-HJKMNP-TV-Z]{26}", op.operation_id)
    assert re.fullmatch(r"[0-9a-f]{32}", op.idempotency_token)
    assert re.fullmatch(r"[0-9a-f]{32}", op.trace_id) and op.trace_id != "0" * 32
    assert re.fullmatch(r"[0-9a-f]{64}", op.request_fingerprint)
    assert op.state is S.CREATE_PENDING and op.attempts == 0 and op.version == 1
    assert op.caller == "agent-7" and op.approved_by == "ops@example.com"
    assert op.request_body == {"input": "hello", "n": 3}
    assert None not in (op.create_deadline, op.result_deadline, op.cancel_deadline)
    assert op.lease_epoch == 0 and op.lease_owner is None
    # durable: a second, independent connection sees it
    assert store.get(op.operation_id) == op


def test_operation_ids_sort_by_creation(store: Store) -> None:
    ids = [store.create_operation(spec(body={"i": i}))[0].operation_id for i in range(5)]
    listed = [op.operation_id for op in store.list_operations()]
    assert listed == sorted(ids, reverse=True)


def test_an_operation_id_is_a_ulid_of_its_millisecond_and_80_random_bits() -> None:
    # the ULID spec's layout: 48 bits of Unix milliseconds, then 80 random ones, as 26 Crockford base32
    # characters, most significant first (here decoded by hand, bit by bit, against what was drawn)
    from jobtrail.domain.ids import new_operation_id, seeded_entropy

    crockford = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
    for ms, bits in [(0, 0), (1_796_633_241_350, 0x1234_5678_9ABC_DEF0_1357), (2**48 - 1, 2**80 - 1)]:
        with seeded_entropy(lambda k, bits=bits: bits if k == 80 else 0):
            op_id = new_operation_id(ms)
        assert op_id.startswith("op_") and len(op_id) == 29 and set(op_id[3:]) <= set(crockford)
        value = 0
        for char in op_id[3:]:
            value = value * 32 + crockford.index(char)
        assert (value >> 80, value & (2**80 - 1)) == (ms, bits)
    assert new_operation_id(1_796_633_241_350) < new_operation_id(1_796_633_241_351)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks a child process")
def test_tokens_never_repeat_across_threads_or_in_a_forked_child() -> None:
    # the OS's random bytes are read some hundred tokens at a time: each must still go out once, whoever
    # draws it, and a child forked with bytes left in its parent's buffer must not hand those out too
    from jobtrail.domain.ids import new_idempotency_token

    new_idempotency_token()  # bytes left over in this process's buffer
    drawn: list[str] = []
    threads = [
        threading.Thread(target=lambda: drawn.extend(new_idempotency_token() for _ in range(2000))) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first tokens, to the parent
        os.write(write, "".join(new_idempotency_token() for _ in range(50)).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    child = [text[i : i + 32] for i in range(0, len(text), 32)]
    parent = [new_idempotency_token() for _ in range(50)]
    tokens = drawn + child + parent
    assert len(child) == 50 and all(re.fullmatch(r"[0-9a-f]{32}", t) for t in tokens)
    assert len(set(tokens)) == len(tokens)


def test_same_key_same_request_returns_the_existing_operation(store: Store) -> None:
    first, created = store.create_operation(spec(operation_key="export-2026-11"))
    again, created_again = store.create_operation(spec(operation_key="export-2026-11"))
    assert created and not created_again
    assert again.operation_id == first.operation_id
    assert again.idempotency_token == first.idempotency_token
    assert store.count() == 1


def test_same_key_changed_request_is_refused_with_the_way_out(store: Store) -> None:
    first, _ = store.create_operation(spec(operation_key="export-2026-11"))
    with pytest.raises(OperationKeyConflict) as err:
        store.create_operation(spec(operation_key="export-2026-11", body={"input": "changed"}))
    assert first.operation_id in str(err.value)
    assert "a changed request is a new operation" in str(err.value)
    assert "new operation key" in str(err.value)
    assert store.count() == 1


def test_key_is_unique_per_provider_only(store: Store) -> None:
    a, _ = store.create_operation(spec(operation_key="k", provider="alpha"))
    b, _ = store.create_operation(spec(operation_key="k", provider="beta"))
    assert a.operation_id != b.operation_id
    assert a.idempotency_token != b.idempotency_token


def test_racing_submits_with_one_key_create_one_operation(open_store: Callable[..., Store]) -> None:
    """Eight threads submit the same keyed request at once: one record, one token."""
    stores = [open_store() for _ in range(8)]
    results: list[str] = []
    barrier = threading.Barrier(len(stores))

    def submit(s: Store) -> None:
        barrier.wait()
        results.append(s.create_operation(spec(operation_key="race"))[0].operation_id)

    threads = [threading.Thread(target=submit, args=(s,)) for s in stores]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(results) == 8 and len(set(results)) == 1
    assert stores[0].count() == 1


@pytest.mark.parametrize(
    "body",
    [
        {"password": "hunter2-xyz"},
        {"config": {"api_key": "abcd1234"}},
        {"headers": [{"Authorization": "Bearer abcdefgh12345678"}]},
        {"note": "use sk-live0123456789abcdef0123"},
    ],
)
def test_credentials_in_the_request_body_are_refused(store: Store, body: dict) -> None:
    """Credentials are referenced by name and injected at send time, never stored in a body."""
    with pytest.raises(SecretInRequest, match="credential"):
        store.create_operation(spec(body=body))
    assert store.count() == 0


def test_numbers_named_like_secrets_are_not_credentials(store: Store) -> None:
    """``max_tokens: 100`` is a number, not a token."""
    op, _ = store.create_operation(spec(body={"max_tokens": 100, "temperature": 0.2}))
    assert op.request_body == {"max_tokens": 100, "temperature": 0.2}


def test_a_stale_writer_is_refused(store: Store) -> None:
    """Two writers read version 2; the second write is refused, not merged or forked."""
    op = op_in(store, S.ACCEPTED)
    store.transition(op, S.OBSERVING, obs(RemoteState.RUNNING), actor="w1")
    with pytest.raises(StaleRecord, match="changed since it was read"):
        store.transition(op, S.FAILED, obs(RemoteState.FAILED), actor="w2")
    assert store.get(op.operation_id).state is S.OBSERVING
    assert verify(store).ok


_AWKWARD = 'tab\there, new\nline, back\\slash, \\N, a quote " and ü \u2028 end'


def test_text_that_bulk_writes_must_escape_is_stored_exactly(store: Store) -> None:
    """History and observations go in many rows at a time (a COPY on PostgreSQL): what each row holds
    comes back exactly, and the chain that covers it verifies."""
    op = op_in(store, S.ACCEPTED)
    raw = {"detail": _AWKWARD, "list": [_AWKWARD, 1.5, None], _AWKWARD: "key"}
    observation_id = store.add_observation(op.operation_id, kind="status_poll", raw=raw, raw_state=_AWKWARD)
    evidence = StatusObservation(remote_state=RemoteState.RUNNING, raw_state=_AWKWARD, http_status=200)
    store.transition(op, S.OBSERVING, evidence, actor=f"worker {_AWKWARD}", changes={"remote_state": _AWKWARD})
    stored = store.observation(observation_id)
    assert stored is not None and stored["raw"] == raw and stored["raw_state"] == _AWKWARD
    entry = store.history(op.operation_id)[-1]
    assert entry.actor == f"worker {_AWKWARD}"
    assert json.loads(entry.evidence)["raw_state"] == _AWKWARD
    assert store.get(op.operation_id).remote_state == _AWKWARD
    assert verify(store).ok


def test_a_write_under_an_old_lease_epoch_is_refused(store: Store, engine_name: str) -> None:
    """A worker whose lease was taken over cannot overwrite its successor."""
    op = op_in(store, S.ACCEPTED)
    with store.engine.begin() as conn:  # a newer claim bumps the epoch
        conn.execute(sa.text("UPDATE operations SET lease_epoch = 7 WHERE operation_id = :i"), {"i": op.operation_id})
    fresh = store.get(op.operation_id)
    with pytest.raises(StaleRecord, match="lease epoch 6 is no longer current"):
        store.transition(fresh, S.OBSERVING, obs(RemoteState.RUNNING), actor="old", epoch=6)
    moved = store.transition(fresh, S.OBSERVING, obs(RemoteState.RUNNING), actor="new", epoch=7)
    assert moved.state is S.OBSERVING


def test_concurrent_writers_never_fork_a_chain(open_store: Callable[..., Store]) -> None:
    """Many threads race to move one record; exactly one wins and the chain stays linear."""
    stores = [open_store() for _ in range(6)]
    op = op_in(stores[0], S.ACCEPTED)
    wins: list[str] = []
    stale: list[str] = []
    barrier = threading.Barrier(len(stores))

    def race(s: Store, i: int) -> None:
        barrier.wait()
        try:
            s.transition(op, S.OBSERVING, obs(RemoteState.RUNNING), actor=f"w{i}")
            wins.append(f"w{i}")
        except StaleRecord:
            stale.append(f"w{i}")

    threads = [threading.Thread(target=race, args=(s, i)) for i, s in enumerate(stores)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(wins) == 1 and len(stale) == 5
    history = stores[0].history(op.operation_id)
    assert [e.seq for e in history] == list(range(1, len(history) + 1))
    assert verify(stores[0]).ok


def test_history_refuses_update_and_delete_in_the_database(store: Store) -> None:
    """Triggers make the history append-only even for code that bypasses the store."""
    op = op_in(store, S.OBSERVING)
    for statement in ("UPDATE history SET actor = 'mallory'", "DELETE FROM history"):
        with pytest.raises(sa.exc.DBAPIError, match="append-only"), store.engine.begin() as conn:
            conn.execute(sa.text(statement))
    assert len(store.history(op.operation_id)) == op.version
    assert verify(store).ok


def test_postgres_refuses_truncate_of_history(store: Store, engine_name: str) -> None:
    if engine_name != "postgresql":
        pytest.skip("TRUNCATE exists on PostgreSQL only")
    op_in(store, S.ACCEPTED)
    with pytest.raises(sa.exc.DBAPIError, match="append-only"), store.engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE history CASCADE"))


def test_history_carries_the_fingerprint_not_the_body(store: Store) -> None:
    op = op_in(store, S.OBSERVING, body={"document": "a very particular sentence"})
    for entry in store.history(op.operation_id):
        assert entry.request_fingerprint == op.request_fingerprint
        assert "particular sentence" not in entry.evidence
        assert entry.trace_id == op.trace_id


def test_batch_applies_many_in_one_transaction_and_skips_only_the_stale(store: Store) -> None:
    ops = [store.create_operation(spec(body={"i": i}))[0] for i in range(5)]
    stale = ops[2]
    store.record(stale, CreateAttempt(attempt=1), actor="other", changes={"attempts": 1})
    results = store.apply(
        [Change(op=op, evidence=CreateAttempt(attempt=1), actor="w", changes={"attempts": 1}) for op in ops]
    )
    assert [type(r).__name__ for r in results] == ["Operation"] * 2 + ["Moved"] + ["Operation"] * 2
    assert all(store.get(op.operation_id).attempts == 1 for op in ops)
    assert verify(store).ok


@pytest.mark.parametrize("resting", [S.SUCCEEDED, S.FAILED, S.NEEDS_ATTENTION])
def test_a_resting_operation_cannot_be_rescheduled_so_its_row_stays_what_its_last_entry_covers(
    store: Store, resting: State
) -> None:
    op = drive(store, op_in(store, S.CREATE_PENDING), resting)
    with pytest.raises(UsageError, match="cannot be rescheduled"):
        store.apply([Reschedule(op=op, changes={"state_reason": "retrying", "next_action_at_us": 1})])
    assert store.get(op.operation_id).version == op.version
    assert verify(store).ok


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"operation_key": ""}, "operation key is empty"),
        ({"operation_key": "   "}, "operation key is empty"),
        ({"operation_key": "a\nb"}, "control characters"),
        ({"operation_key": "k" * 201}, "at most 200"),
        # what a listing would show as other text: an override turns the rest around, a zero-width space hides
        ({"operation_key": "invoice-\u202efdp.exe"}, "U\\+202E RIGHT-TO-LEFT OVERRIDE at position 9"),
        ({"operation_key": "nightly\u200b"}, "U\\+200B ZERO WIDTH SPACE"),
        ({"operation_key": "a\u0085b"}, "control characters"),
        ({"caller": "agent\u2066-7"}, "the caller holds U\\+2066"),
        ({"approved_by": "alice\u202e"}, "the approver holds U\\+202E"),
        # a name of 3,000 characters pushed every other column of the dashboard's list off the screen
        ({"caller": "c" * 201}, "the caller must be at most 200 characters"),
        ({"approved_by": "a" * 201}, "the approver must be at most 200 characters"),
        # and what renders as nothing though it is no formatting character: a variation selector after a letter,
        # a Hangul filler, a joiner between Latin letters, an unassigned code point, a tag
        ({"operation_key": "nightly\ufe0f"}, "U\\+FE0F VARIATION SELECTOR-16"),
        ({"operation_key": "nightly\u3164"}, "U\\+3164 HANGUL FILLER"),
        ({"operation_key": "night\u200dly"}, "U\\+200D ZERO WIDTH JOINER"),
        ({"operation_key": "nightly\u2065"}, "U\\+2065"),
        ({"approved_by": "bob\U000e0062"}, "U\\+E0062 TAG"),
    ],
)
def test_an_unusable_key_is_refused_before_anything_is_stored(store: Store, fields: dict, says: str) -> None:
    with pytest.raises(UsageError, match=says):
        store.create_operation(spec(**fields))
    assert store.list_operations() == []


@pytest.mark.parametrize("deadline", ["create_deadline", "result_deadline", "cancel_deadline"])
@pytest.mark.parametrize("seconds", [-5, 0])
def test_a_submit_with_a_deadline_not_ahead_is_refused(
    store: Store, fake: FakeProvider, deadline: str, seconds: int
) -> None:
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])
    with pytest.raises(UsageError, match=f"{deadline} must be positive"):
        asyncio.run(jt.submit("fake", {"x": 1}, **{deadline: timedelta(seconds=seconds)}))
    assert store.list_operations() == []


def test_a_batch_mixing_fenced_and_unfenced_writes_lands_exactly_the_current_ones(store: Store) -> None:
    """On PostgreSQL these UPDATEs go pipelined in one round trip: each still lands only on its version and epoch."""
    landed, stale, fenced, old_lease = (op_in(store, S.ACCEPTED, body={"i": i}) for i in range(4))
    store.record(stale, CreateAttempt(attempt=2), actor="other")  # its version moved on
    fenced = store.lease(fenced.operation_id, "w1", lease_s=60)
    first = store.lease(old_lease.operation_id, "w1", lease_s=0)  # expires at once
    store.lease(old_lease.operation_id, "w2", lease_s=60)  # a successor: the epoch moved on
    assert fenced is not None and first is not None
    results = store.apply(
        [
            Change(op=op, to=S.OBSERVING, evidence=obs(RemoteState.RUNNING), actor="w1")
            for op in (landed, stale, fenced, first)
        ]
    )
    assert [type(r).__name__ for r in results] == ["Operation", "Moved", "Operation", "Moved"]
    assert "lease epoch" in str(results[3])
    states = [store.get(op.operation_id).state for op in (landed, stale, fenced, first)]
    assert states == [S.OBSERVING, S.ACCEPTED, S.OBSERVING, S.ACCEPTED]
    assert verify(store).ok


def _result(data: bytes = b'{"ok": true}') -> tuple[StoredResult, ValidatedResult]:
    sha = hashlib.sha256(data).hexdigest()
    stored = StoredResult(
        sha256=sha, size=len(data), content_type="application/json", body=data, path=None, checks=[], summary=None
    )
    return stored, ValidatedResult(sha256=sha, size=len(data), content_type="application/json")


def test_a_stale_transition_stores_no_result(store: Store) -> None:
    op = op_in(store, S.RESULT_COLLECTING)
    store.record(op, obs(RemoteState.SUCCEEDED), actor="successor")  # the record moved on
    stored, evidence = _result()
    with pytest.raises(StaleRecord):
        store.transition(op, S.SUCCEEDED, evidence, actor="stale", result=stored)
    assert stored_result(store, op.operation_id) is None


@pytest.mark.parametrize("mismatch", ["no transition", "not succeeded", "size", "content type", "bytes"])
def test_a_result_is_stored_only_by_the_transition_to_succeeded_that_names_it(store: Store, mismatch: str) -> None:
    op = op_in(store, S.RESULT_COLLECTING)
    stored, evidence = _result()
    to: State | None = S.SUCCEEDED
    if mismatch == "no transition":
        to = None
    elif mismatch == "not succeeded":
        to, evidence = S.RESULT_VALIDATION_FAILED, ValidationFailure(check="schema", reason="x")  # type: ignore[assignment]
    elif mismatch == "size":
        evidence = dataclasses.replace(evidence, size=999)
    elif mismatch == "content type":
        evidence = dataclasses.replace(evidence, content_type="text/plain")
    else:
        stored = dataclasses.replace(stored, body=b'{"ok": false}')  # bytes that are not the named ones
    with pytest.raises(UsageError, match="a result is stored only with the transition to succeeded"):
        store.apply([Change(op=op, to=to, evidence=evidence, actor="w", result=stored)])
    assert stored_result(store, op.operation_id) is None
    assert store.get(op.operation_id).version == op.version


def test_ensure_says_whether_the_operation_was_created_now(store: Store, fake: FakeProvider) -> None:
    jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])
    first, created = asyncio.run(jt.ensure("fake", {"x": 1}, key="report-1"))
    again, created_again = asyncio.run(jt.ensure("fake", {"x": 1}, key="report-1"))
    assert created is True and created_again is False
    assert again.operation_id == first.operation_id and store.count() == 1
    assert asyncio.run(jt.submit("fake", {"x": 1}, key="report-1")).operation_id == first.operation_id


def test_missing_operation_says_how_to_find_one(store: Store) -> None:
    with pytest.raises(OperationNotFound, match="jobtrail ops list"):
        store.get("op_NOPE")


def test_unreachable_database_is_a_clear_error() -> None:
    with pytest.raises(StorageError, match="is the PostgreSQL server running"):
        Store.open("postgresql://postgres@127.0.0.1:1/nothing")


def test_a_ledger_locked_by_another_session_is_a_clear_error_and_loses_nothing(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holds the SQLite file's write lock, or a PostgreSQL session holds the operations
    table: the write waits (here 0.3 s), then is refused whole, with the way out. (On PostgreSQL a probe saw
    a worker and a submit wait without a word for as long as the lock was held, 90 s.)"""
    import sqlite3

    import jobtrail.ledger.store as store_mod

    monkeypatch.setattr(store_mod, "SQLITE_BUSY_TIMEOUT_MS", 300)
    monkeypatch.setattr(store_mod, "POSTGRES_LOCK_TIMEOUT_MS", 300)
    store = Store.open(db_url)
    op = op_in(store, S.ACCEPTED)
    if db_url.startswith("postgresql"):
        engine = sa.create_engine(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
        locker = engine.connect()
        locker.execute(sa.text("LOCK TABLE operations IN ACCESS EXCLUSIVE MODE"))

        def release() -> None:
            locker.close()  # (rolls back: the lock goes with the transaction)
            engine.dispose()

        message = r"another session held a lock on the ledger's tables for more than 0\.3 s; nothing was written"
    else:
        blocker = sqlite3.connect(db_url, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")

        def release() -> None:
            blocker.close()  # (its transaction, and the lock, end with it)

        message = r"another process held the write lock for more than 0\.3 s; nothing was written"
    try:
        with pytest.raises(StorageError, match=message):
            store.transition(op, S.OBSERVING, obs(RemoteState.RUNNING), actor="w")
    finally:
        release()
    assert store.get(op.operation_id) == op
    assert store.transition(op, S.OBSERVING, obs(RemoteState.RUNNING), actor="w").state is S.OBSERVING
    store.close()


def test_sqlite_runs_wal_full_sync_and_secure_delete(tmp_path) -> None:
    store = Store.open(tmp_path / "p.db")
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
        assert conn.exec_driver_sql("PRAGMA secure_delete").scalar() == 1
    store.close()


def test_db_location_order(tmp_path, monkeypatch) -> None:
    """--db wins over JOBTRAIL_DB, which wins over the default path."""
    from jobtrail.ledger.store import resolve_db_url

    monkeypatch.setenv("JOBTRAIL_DB", str(tmp_path / "env.db"))
    assert resolve_db_url(tmp_path / "flag.db").endswith("flag.db")
    assert resolve_db_url(None).endswith("env.db")
    monkeypatch.delenv("JOBTRAIL_DB")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert resolve_db_url(None) == f"sqlite:///{tmp_path}/xdg/jobtrail/jobtrail.db"
    assert resolve_db_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    with pytest.raises(Exception, match="unsupported database URL scheme"):
        resolve_db_url("mysql://x")


def test_a_ledger_path_is_a_path_not_url_text(tmp_path: Path) -> None:
    """``--db 'runs?mode=ro.db'`` is that file: not ``runs`` opened with a query, nor ``a b.db`` for ``a%20b.db``."""
    for name in ("runs?mode=ro.db", "a%20b.db", "h#1.db"):
        with Store.open(tmp_path / name) as store:
            store.create_operation(spec())
        assert (tmp_path / name).is_file(), sorted(p.name for p in tmp_path.iterdir())
        with Store.open(str(tmp_path / name)) as again:
            assert again.count() == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".db") == ["a%20b.db", "h#1.db", "runs?mode=ro.db"]


def test_many_records_in_one_transaction_keep_the_key_rules(store: Store) -> None:
    """create_operations is one commit; a colliding key falls back to per-record answers."""
    first, _ = store.create_operation(spec(operation_key="dup"))
    made = store.create_operations([spec(body={"i": i}) for i in range(20)])
    assert all(created for _, created in made) and store.count() == 21
    mixed = store.create_operations([spec(body={"i": 99}), spec(operation_key="dup")])
    assert mixed[1] == (first, False) and mixed[0][1] is True
    with pytest.raises(OperationKeyConflict):
        store.create_operations([spec(body={"i": 100}), spec(operation_key="dup", body={"changed": 1})])
    assert verify(store).ok


def test_the_write_that_enters_a_resting_state_ends_the_lease(store: Store) -> None:
    """Nothing automatic follows a resting state, so its lease ends in the same write (no release after);
    a write that leaves more to do keeps it, and neither moves the fencing epoch."""
    op, _ = store.create_operation(spec())
    (leased,) = store.claim("w", limit=1, lease_s=30)
    attempted = store.record(leased, CreateAttempt(attempt=1), actor="worker:w", changes={"attempts": 1})
    assert attempted.lease_owner == "w" and store.get(op.operation_id).lease_owner == "w"
    failed = store.transition(
        attempted,
        S.FAILED,
        DefinitiveRejection(http_status=422, problem={"title": "bad input"}),
        actor="worker:w",
    )
    stored = store.get(op.operation_id)
    assert failed.lease_owner is None and failed.lease_expires_at_us is None
    assert stored.lease_owner is None and stored.lease_expires_at_us is None
    assert stored.lease_epoch == leased.lease_epoch == failed.lease_epoch
    assert verify(store).ok


def test_a_workers_step_that_leaves_nothing_due_ends_the_lease_in_the_same_write(store: Store) -> None:
    """A step under the lease that puts the next action off ends the lease in its own UPDATE (no release
    after it); one that leaves the next action due, or where it was, keeps it (the action goes on); a write
    that is not a worker's step, or is not made under the lease, leaves the lease alone. The epoch never
    moves."""
    op, _ = store.create_operation(spec())
    (leased,) = store.claim("w", limit=1, lease_s=30)
    now = store.clock()
    attempt = Change(
        op=leased,
        evidence=CreateAttempt(attempt=1),
        actor="worker:w",
        changes={"attempts": 1},
        lease_ends_if_waiting=True,
    )
    (attempted,) = store.apply([attempt])  # the create goes out next: still due, the lease stays
    assert isinstance(attempted, Operation) and attempted.lease_owner == "w"
    later = {"next_action_at_us": now + 60_000_000}
    (kept,) = store.apply([Reschedule(op=attempted, changes=later)])  # not a worker's step
    assert isinstance(kept, Operation) and kept.lease_owner == "w" and store.get(op.operation_id).lease_owner == "w"
    # a step that leaves the next action where it was keeps the lease, even if that is ahead (the clock
    # stepped back since the claim): it is a step before a request, never the action's end
    same = Change(op=kept, evidence=CreateAttempt(attempt=2), actor="worker:w", lease_ends_if_waiting=True)
    (still,) = store.apply([same])
    assert isinstance(still, Operation) and still.lease_owner == "w"
    even_later = {"next_action_at_us": now + 90_000_000}
    (waiting,) = store.apply([Reschedule(op=still, changes=even_later, lease_ends_if_waiting=True)])
    stored = store.get(op.operation_id)
    assert isinstance(waiting, Operation) and waiting.lease_owner is None and waiting.lease_expires_at_us is None
    assert stored.lease_owner is None and stored.lease_expires_at_us is None
    assert stored.lease_epoch == leased.lease_epoch == waiting.lease_epoch
    # not under a lease (a person's write, a webhook's): nothing to end, and the write lands as before
    (moved,) = store.apply([Reschedule(op=waiting, changes={"polls": 1}, lease_ends_if_waiting=True)])
    assert isinstance(moved, Operation) and moved.polls == 1 and moved.lease_owner is None
    assert verify(store).ok


def test_a_claim_reads_a_request_body_only_where_an_action_may_send_it(store: Store) -> None:
    """A worker claims a thousand operations at a time, and a body may be a long prompt: an operation past
    its create comes without it (nothing it does next sends it); one still to create comes with it, and the
    record keeps every body."""
    prompt = {"prompt": "Summarise this. " * 4096}
    ops = {
        state: op_in(store, state, body=prompt | {"state": state.value})
        for state in (S.CREATE_PENDING, S.ACCEPTED, S.OBSERVING, S.RESULT_COLLECTING)
    }
    store.apply([Reschedule(op=op, changes={"next_action_at_us": 1}) for op in ops.values()])

    claimed = {op.state: op for op in store.claim("w", limit=10, lease_s=30)}

    assert set(claimed) == set(ops)
    assert claimed[S.CREATE_PENDING].request_body == prompt | {"state": "create_pending"}
    # without a job id (a synchronous result, here) it comes too: a look for the job by what was asked needs it
    with_body = {s for s, op in claimed.items() if op.request_body is not BODY_NOT_LOADED}
    assert with_body == {S.CREATE_PENDING} | {s for s, op in claimed.items() if op.remote_job_id is None}
    assert not with_body & {S.ACCEPTED, S.OBSERVING}
    assert {s: store.get(op.operation_id).request_body["state"] for s, op in ops.items()} == {s: s.value for s in ops}
    # what the claim left out is not written back as missing: the next write keeps the body and the seal
    moved = store.transition(claimed[S.ACCEPTED], S.OBSERVING, obs(RemoteState.RUNNING), actor="worker:w")
    assert moved.request_body is BODY_NOT_LOADED
    assert store.get(moved.operation_id).request_body == prompt | {"state": "accepted"}
    assert verify(store).ok


def test_a_claimed_record_is_the_record_as_stored_under_its_new_lease(store: Store) -> None:
    """A claim's rows become records by column position, with statements built once for each set of
    providers and states: every claimed record equals the stored one read after the claim, its partial
    effects, reason and state included (its body where the claim read it), whichever filters it used."""
    ops = [op_in(store, state) for state in (S.CREATE_PENDING, S.ACCEPTED, S.OBSERVING)]
    effects = {"done": 2, "ratio": 0.5, "ok": True, "items": [1, None, "x"]}
    store.apply([Reschedule(op=op, changes={"next_action_at_us": 1, "partial_effects": effects}) for op in ops])
    for states in ([S.ACCEPTED], [S.CREATE_PENDING, S.OBSERVING], None):
        for claimed in store.claim("w", limit=10, lease_s=30, providers=[ops[0].provider], states=states):
            stored = store.get(claimed.operation_id)
            if claimed.request_body is BODY_NOT_LOADED:
                stored = dataclasses.replace(stored, request_body=BODY_NOT_LOADED)
            assert claimed == stored
            assert claimed.lease_owner == "w" and claimed.partial_effects == effects
    assert not store.claim("w", limit=10, lease_s=30, providers=["another"])


def _lease_runs_out(store: Store, op: Operation, at_us: int | None) -> None:
    """The lease ``op`` was claimed under now expires at ``at_us`` (in the past: its worker died; None:
    it was left with no expiry at all)."""
    with store.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE operations SET lease_expires_at_us = :at WHERE operation_id = :i"),
            {"at": at_us, "i": op.operation_id},
        )


def test_a_claim_takes_free_and_run_out_leases_and_never_a_live_one(store: Store) -> None:
    """A claim takes the due operations nobody holds and those whose lease ran out (a worker died holding
    them, or a lease was left with no expiry), never one under a live lease; each claim raises the epoch,
    so the dead worker's late writes are refused."""
    due = [op_in(store, S.ACCEPTED) for _ in range(6)]
    store.apply([Reschedule(op=op, changes={"next_action_at_us": 1}) for op in due])
    live = store.claim("alive", limit=2, lease_s=600)
    (stuck,) = store.claim("stuck", limit=1, lease_s=600)
    (dead,) = store.claim("dead", limit=1, lease_s=600)
    free = {op.operation_id for op in due} - {op.operation_id for op in [*live, stuck, dead]}
    assert len(free) == 2

    _lease_runs_out(store, stuck, None)  # every other lease is live: only this one may be taken over
    first = store.claim("heir", limit=10, lease_s=600)
    assert {op.operation_id for op in first} == free | {stuck.operation_id}

    _lease_runs_out(store, dead, 1)  # its worker died long ago
    (second,) = store.claim("heir", limit=10, lease_s=600)
    assert second.operation_id == dead.operation_id and second.lease_epoch == dead.lease_epoch + 1
    assert not store.claim("heir", limit=10, lease_s=600)  # the live leases stay with their owner
    with pytest.raises(StaleRecord, match="no longer current"):  # the dead worker comes back: refused
        store.transition(dead, S.OBSERVING, obs(RemoteState.RUNNING), actor="worker:dead")


def test_leases_that_ran_out_are_claimed_however_many_free_operations_are_due(store: Store) -> None:
    """A dead worker's operations are not starved by a backlog larger than a claim. On PostgreSQL a claim
    takes leases that ran out before free operations; SQLite takes the earliest due first, as always, so
    an orphan due after the backlog comes with a later claim."""
    backlog = [op_in(store, S.ACCEPTED) for _ in range(8)]
    store.apply([Reschedule(op=op, changes={"next_action_at_us": 1}) for op in backlog])
    orphan = op_in(store, S.ACCEPTED)
    store.apply([Reschedule(op=orphan, changes={"next_action_at_us": 2})])  # due after the whole backlog
    dead = store.claim("dead", limit=10, lease_s=600, states=[S.ACCEPTED])
    held = next(op for op in dead if op.operation_id == orphan.operation_id)
    # the backlog is free again (released); the orphan's lease runs out in its dead worker's hands
    store.apply([Release(operation_id=op.operation_id, epoch=op.lease_epoch) for op in dead if op is not held])
    _lease_runs_out(store, held, 1)

    taken = store.claim("heir", limit=3, lease_s=600)

    assert len(taken) == 3
    taken_ids = {op.operation_id for op in taken}
    assert (orphan.operation_id in taken_ids) is (store.dialect == "postgresql")
    rest = store.claim("heir", limit=100, lease_s=600)
    assert {op.operation_id for op in taken + rest} == {op.operation_id for op in [*backlog, orphan]}


def test_an_idle_worker_learns_when_a_claim_can_next_find_work(store: Store) -> None:
    """The earliest moment a claim could take something: a free operation when it is due, a held one when
    its lease runs out (or at once when it is due and its lease was left with no expiry); not another
    provider's work, nor a resting operation."""
    free, held, loose = (op_in(store, S.ACCEPTED) for _ in range(3))
    elsewhere = op_in(store, S.ACCEPTED, provider="other")
    op_in(store, S.SUCCEEDED)  # resting: nothing is due
    store.apply(
        [
            Reschedule(op=free, changes={"next_action_at_us": 9_000}),
            Reschedule(op=held, changes={"next_action_at_us": 1_000}),
            Reschedule(op=loose, changes={"next_action_at_us": 7_000}),
            Reschedule(op=elsewhere, changes={"next_action_at_us": 10}),
        ]
    )
    by_id = {op.operation_id: op for op in store.claim("w", limit=10, lease_s=600, providers=["fake"])}
    store.apply([Release(operation_id=free.operation_id, epoch=by_id[free.operation_id].lease_epoch)])
    _lease_runs_out(store, by_id[held.operation_id], 20_000)  # live until then, though due long before
    _lease_runs_out(store, by_id[loose.operation_id], None)

    assert store.next_claimable_us(providers=["fake"]) == 7_000
    store.apply([Release(operation_id=loose.operation_id, epoch=by_id[loose.operation_id].lease_epoch)])
    store.apply([Reschedule(op=store.get(loose.operation_id), changes={"next_action_at_us": 30_000})])
    assert store.next_claimable_us(providers=["fake"]) == 9_000
    assert store.next_claimable_us(providers=["fake"], states=[S.OBSERVING]) is None
    assert store.next_claimable_us() == 10


def test_an_idle_workers_question_is_answered_from_indexes_on_postgresql(store: Store, engine_name: str) -> None:
    """Found measuring: on PostgreSQL "when could a claim next find work" read the whole operations table,
    settled operations too, at every idle turn of every worker; it is answered from the claim's own
    partial indexes (asked with sequential scans switched off, the plan shows whether an index can)."""
    if engine_name != "postgresql":
        pytest.skip("SQLite answers it from ix_operations_claim, which its claims read too")
    statements: list[tuple[str, object]] = []

    def seen(conn: object, cursor: object, statement: str, parameters: object, *_: object) -> None:
        statements.append((statement, parameters))

    sa.event.listen(store.engine, "before_cursor_execute", seen)
    try:
        store.next_claimable_us(providers=["fake"], states=[S.ACCEPTED, S.OBSERVING])
    finally:
        sa.event.remove(store.engine, "before_cursor_execute", seen)
    (statement, parameters), *_ = [s for s in statements if "operations" in s[0]]
    with store.engine.connect() as conn:
        conn.exec_driver_sql("SET enable_seqscan = off")
        plan = "\n".join(row[0] for row in conn.exec_driver_sql(f"EXPLAIN {statement}", parameters))
    assert "Seq Scan on operations" not in plan, plan
    assert "ix_operations_unleased" in plan and "ix_operations_leased" in plan, plan


def test_a_sqlite_ledger_deleted_under_a_store_is_never_made_anew(tmp_path) -> None:
    """sqlite3 makes a missing file when it connects. Once a store has seen its ledger, a new connection
    (any thread's, the pool's next) must fail naming the deletion instead, and no empty ledger may
    appear where the old one was: a process that went on there would read and write where no one else
    looks."""
    db = tmp_path / "jobs.db"
    store = Store.open(str(db))
    op, _ = store.create_operation(spec())
    store.engine.dispose()  # every connection closed: the next read needs a new one
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"jobs.db{suffix}").unlink(missing_ok=True)

    errors: list[BaseException] = []

    def read_elsewhere() -> None:
        try:
            store.get(op.operation_id)
        except BaseException as exc:  # what the thread met, for the test to read
            errors.append(exc)

    with pytest.raises(StorageError, match=rf"{re.escape(str(db))} was deleted or moved away"):
        store.get(op.operation_id)
    thread = threading.Thread(target=read_elsewhere)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], StorageError) and "deleted" in str(errors[0])
    with pytest.raises(StorageError, match="deleted"):
        store.create_operation(spec(body={"another": 1}))
    assert not db.exists(), "no new, empty ledger in the old one's place"
    store.close()

    # a store opened afresh on the path starts a new ledger, as asked
    fresh = Store.open(str(db))
    assert fresh.list_operations(limit=None) == []
    fresh.close()


@pytest.mark.parametrize("db", [":memory:", "sqlite://", "sqlite:///:memory:"])
def test_a_ledger_in_memory_is_one_ledger_for_every_thread(db: str, fake: FakeProvider, tmp_path, monkeypatch) -> None:
    """SQLite's own name for a database in memory makes one, not a file called ":memory:" in the working
    directory; and every thread sees the one ledger (SQLite gives each connection a memory database of its
    own, so the async client's and the worker's threads saw "no such table")."""
    monkeypatch.chdir(tmp_path)
    store = Store.open(db)
    op, _ = store.create_operation(spec())
    seen: list[object] = []

    def elsewhere() -> None:
        try:
            seen.append(store.get(op.operation_id))
            seen.append(store.create_operation(spec(body={"from": "a thread"}))[0])
        except BaseException as exc:  # what the thread met, for the test to read
            seen.append(exc)

    threads = [threading.Thread(target=elsewhere) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [type(x) for x in seen] == [Operation] * 8, seen
    assert store.count() == 5

    async def through_the_client() -> list[Operation]:  # its reads and writes run on threads of their own
        jt = AsyncJobtrail(store=store, providers=[fake.provider_config()])
        made = await jt.submit_many("fake", [{"n": i} for i in range(5)])
        try:
            sent = [await jt.advance_create(m.operation_id) for m in made]
            assert await jt.io(store.count) == 10
            return sent
        finally:
            await jt.aclose()

    sent = asyncio.run(through_the_client())
    assert {op.state for op in sent} == {S.ACCEPTED} and fake.counts["creates_received"] == 5
    assert list(tmp_path.iterdir()) == [], "nothing written to disk"
    # the client closed its store, and a ledger in memory goes with it: said plainly, not "no such table"
    with pytest.raises(StorageError, match="was in memory and its store is closed"):
        store.count()


def test_a_claim_for_no_provider_finds_nothing_and_fails_nothing(store: Store) -> None:
    """A worker given no providers (or no states) claims nothing, on either database, rather than failing
    each claim on a statement the driver cannot read."""
    op = op_in(store, S.ACCEPTED)
    store.apply([Reschedule(op=op, changes={"next_action_at_us": 1})])
    assert store.claim("idle", limit=10, lease_s=60, providers=[]) == []
    assert store.claim("idle", limit=10, lease_s=60, states=[]) == []
    (claimed,) = store.claim("busy", limit=10, lease_s=60, providers=[op.provider], states=[S.ACCEPTED])
    assert claimed.operation_id == op.operation_id


def test_a_ledger_in_memory_refuses_a_read_or_write_inside_another_on_one_thread(tmp_path, monkeypatch) -> None:
    """In memory there is one connection: a read begun inside a write would end the write's transaction
    under it, and the rest of the write would commit piece by piece. It is refused, and the write that was
    under way is still all or nothing."""
    monkeypatch.chdir(tmp_path)
    store = Store.open(":memory:")
    op, _ = store.create_operation(spec())
    with pytest.raises(RuntimeError, match="abandoned"), store.writing("a test's write") as conn:
        conn.execute(sa.update(sa.table("operations", sa.column("caller"))).values(caller="A"))
        with pytest.raises(UsageError, match="one connection"):
            store.get(op.operation_id)
        conn.execute(sa.update(sa.table("operations", sa.column("target"))).values(target="B"))
        raise RuntimeError("abandoned")
    after = store.get(op.operation_id)
    assert (after.caller, after.target) == (op.caller, op.target)
    store.close()


def test_a_ledger_in_memory_keeps_large_results_in_a_directory_of_its_own(tmp_path, monkeypatch) -> None:
    """Its results' files do not land in the working directory (a ':memory:-results' folder there), and go
    when the store closes, as its records do."""
    from jobtrail.ledger.files import data_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("JOBTRAIL_DATA_DIR", raising=False)
    store = Store.open(":memory:")
    files = data_dir(store)
    assert files == data_dir(store) and files.is_dir() and tmp_path not in files.parents
    store.close()
    assert not files.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("key", "caller", "approver"),
    [
        ("rapport-trimestriel-été-日本", "José", "Zoë Ω"),
        # the joiners where scripts write with them: Persian's ZWNJ inside a word, a Hindi conjunct after a virama
        (
            "\u06af\u0632\u0627\u0631\u0634\u200c\u0647\u0627",  # (Persian, escaped: ruff takes its letters for Latin)
            "क्\u200dष-agent",
            "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645",
        ),
        # emoji: a ZWJ sequence, a variation selector, a keycap, a skin tone
        ("deploy-👩\u200d💻", "bot-❤️", "1️⃣-👍🏽"),
    ],
)
def test_a_key_or_name_in_any_script_is_kept_as_given(store: Store, key: str, caller: str, approver: str) -> None:
    """Only what shows as nothing (or turns the rest around) is refused: letters of any script are names, and the
    invisible characters a script or an emoji is written with are part of them."""
    op, _ = store.create_operation(spec(operation_key=key, caller=caller, approved_by=approver))
    kept = store.get(op.operation_id)
    assert (kept.operation_key, kept.caller, kept.approved_by) == (key, caller, approver)
