"""Tampering done directly in SQL (guards dropped first) is caught by audit verify, by kind."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given
from hypothesis import strategies as st

from jobtrail import Operation, Secret, Store
from jobtrail.domain.canonical import canonical_bytes
from jobtrail.domain.errors import ConfigError
from jobtrail.ledger.audit import make_anchor, verify
from jobtrail.ledger.chain import entry_hash, field_digest, window_digest

from helpers import S, drop_guards, op_in, sql, succeed, valid_evidence


def rows(store: Store, op: Operation) -> list[dict[str, Any]]:
    with store.engine.connect() as conn:
        return [
            dict(r)
            for r in conn.execute(
                sa.text("SELECT * FROM history WHERE operation_id = :i ORDER BY seq"), {"i": op.operation_id}
            ).mappings()
        ]


def forge(row: dict[str, Any], **changes: Any) -> dict[str, Any]:
    new = {**row, **changes}
    new["entry_hash"] = entry_hash(new)
    return new


def insert(store: Store, row: dict[str, Any]) -> None:
    cols = ", ".join(row)
    sql(store, f"INSERT INTO history ({cols}) VALUES ({', '.join(':' + c for c in row)})", **row)


@pytest.fixture
def victim(store: Store) -> Operation:
    """An operation with a 6-entry history, plus a bystander that stays intact."""
    op_in(store, S.OBSERVING, body={"bystander": True})
    op = op_in(store, S.ACCEPTED)
    for to in (S.OBSERVING, S.RESULT_COLLECTING):
        op = store.transition(op, to, valid_evidence(op.state, to, op), actor="worker")
    op = succeed(store, op)
    assert op.version == 6
    assert verify(store).ok
    drop_guards(store)
    return op


def first_bad(store: Store, **kwargs: Any) -> tuple[str, int]:
    report = verify(store, **kwargs)
    assert not report.ok
    bad = report.first_bad
    assert bad is not None
    return bad.kind, bad.seq


def test_clean_ledger_verifies(store: Store) -> None:
    op_in(store, S.CANCELLED)
    report = verify(store)
    assert report.ok and report.operations == 1 and report.entries >= 4
    assert len(report.root) == 64


def test_edited_entry(store: Store, victim: Operation) -> None:
    sql(
        store,
        "UPDATE history SET actor = 'mallory' WHERE operation_id = :i AND seq = 3",
        i=victim.operation_id,
    )
    assert first_bad(store) == ("edited", 3)


def test_edited_evidence(store: Store, victim: Operation) -> None:
    sql(store, "UPDATE history SET evidence = '{}' WHERE operation_id = :i AND seq = 5", i=victim.operation_id)
    assert first_bad(store) == ("edited", 5)


def test_deleted_entry_leaves_a_gap(store: Store, victim: Operation) -> None:
    sql(store, "DELETE FROM history WHERE operation_id = :i AND seq = 3", i=victim.operation_id)
    assert first_bad(store) == ("gap", 3)


def test_reordered_entries(store: Store, victim: Operation) -> None:
    i = victim.operation_id
    sql(store, "UPDATE history SET seq = -1 WHERE operation_id = :i AND seq = 2", i=i)
    sql(store, "UPDATE history SET seq = 2 WHERE operation_id = :i AND seq = 3", i=i)
    sql(store, "UPDATE history SET seq = 3 WHERE operation_id = :i AND seq = -1", i=i)
    assert first_bad(store) == ("reordered", 2)


def test_inserted_forged_entry_in_the_middle(store: Store, victim: Operation) -> None:
    """A replaced entry that hashes correctly on its own still breaks the next link."""
    original = rows(store, victim)
    sql(store, "DELETE FROM history WHERE operation_id = :i AND seq = 3", i=victim.operation_id)
    insert(store, forge(original[2], actor="mallory"))
    assert first_bad(store) == ("inserted", 3)


def test_inserted_entry_beyond_the_head(store: Store, victim: Operation) -> None:
    last = rows(store, victim)[-1]
    insert(store, forge(last, seq=7, prev_hash=last["entry_hash"], from_state="succeeded", to_state="failed"))
    assert first_bad(store) == ("inserted", 7)


def test_truncated_tail(store: Store, victim: Operation) -> None:
    sql(store, "DELETE FROM history WHERE operation_id = :i AND seq = 6", i=victim.operation_id)
    assert first_bad(store) == ("truncated", 6)


def test_edited_operation_row(store: Store, victim: Operation) -> None:
    """The record must agree with its own history."""
    sql(store, "UPDATE operations SET state = 'failed' WHERE operation_id = :i", i=victim.operation_id)
    assert first_bad(store) == ("edited", 6)


def test_consistent_truncation_is_caught_by_the_anchor(store: Store, victim: Operation) -> None:
    """Truncating the chain AND fixing the row fools the chain check; the anchor is not fooled."""
    anchor = make_anchor(store)
    entries = rows(store, victim)
    sql(store, "DELETE FROM history WHERE operation_id = :i AND seq = 6", i=victim.operation_id)
    sql(
        store,
        "UPDATE operations SET version = 5, history_head = :h, state = :s WHERE operation_id = :i",
        h=entries[4]["entry_hash"],
        s=entries[4]["to_state"],
        i=victim.operation_id,
    )
    assert verify(store).ok  # the documented limit without an anchor
    assert first_bad(store, anchor=anchor) == ("truncated", 6)


def test_rechained_history_is_caught_by_the_anchor(store: Store, victim: Operation) -> None:
    anchor = make_anchor(store)
    entries = rows(store, victim)
    sql(store, "DELETE FROM history WHERE operation_id = :i AND seq >= 2", i=victim.operation_id)
    prev = entries[0]["entry_hash"]
    for row in entries[1:]:
        changes = {"actor": "mallory"} if row["seq"] == 2 else {}
        new = forge(row, prev_hash=prev, **changes)
        insert(store, new)
        prev = new["entry_hash"]
    sql(
        store,
        "UPDATE operations SET history_head = :h WHERE operation_id = :i",
        h=prev,
        i=victim.operation_id,
    )
    assert verify(store).ok
    assert first_bad(store, anchor=anchor) == ("anchor_mismatch", 6)


def test_deleted_operation_is_caught_by_the_anchor(store: Store, victim: Operation) -> None:
    anchor = make_anchor(store)
    sql(store, "DELETE FROM history WHERE operation_id = :i", i=victim.operation_id)
    sql(store, "DELETE FROM results WHERE operation_id = :i", i=victim.operation_id)
    sql(store, "DELETE FROM operations WHERE operation_id = :i", i=victim.operation_id)
    assert verify(store).ok
    assert first_bad(store, anchor=anchor) == ("deleted", 6)


def test_history_without_its_operation_row(store: Store, victim: Operation) -> None:
    if store.dialect == "postgresql":
        sql(store, "ALTER TABLE history DROP CONSTRAINT history_operation_id_fkey")
        sql(store, "ALTER TABLE results DROP CONSTRAINT results_operation_id_fkey")
        sql(store, "DELETE FROM operations WHERE operation_id = :i", i=victim.operation_id)
    else:
        import sqlite3

        raw = sqlite3.connect(str(store.engine.url.database), isolation_level=None)
        raw.execute("PRAGMA foreign_keys = OFF")
        raw.execute("DELETE FROM operations WHERE operation_id = ?", (victim.operation_id,))
        raw.close()
    assert first_bad(store)[0] == "deleted"


def test_keyed_anchor_detects_its_own_alteration(store: Store, victim: Operation) -> None:
    key = Secret("anchor-key-0123456789", redactor=store.redactor)
    anchor = make_anchor(store, key=key, key_name="K")
    assert verify(store, anchor=anchor, key=key).ok
    anchor["heads"] = anchor["heads"][:1]
    assert first_bad(store, anchor=anchor, key=key)[0] == "anchor_mismatch"
    with pytest.raises(Exception, match="--key-env"):
        verify(store, anchor=anchor)


def test_anchor_without_the_key_that_made_it_cannot_be_rewritten_silently(store: Store, victim: Operation) -> None:
    anchor = make_anchor(store)
    anchor["root"] = "0" * 64
    assert first_bad(store, anchor=anchor)[0] == "anchor_mismatch"


def stored_digests(store: Store, op: Operation) -> list[tuple[int, str]]:
    with store.engine.connect() as conn:
        query = "SELECT observation_id, digest FROM observations WHERE operation_id = :i ORDER BY observation_id"
        return [(int(i), d) for i, d in conn.execute(sa.text(query), {"i": op.operation_id})]


def test_an_anchor_holds_each_operations_unentried_observations(store: Store) -> None:
    """Per operation, besides its head: the highest observation id it had, and how many observations after its
    last entry's coverage (no entry covers them yet) and their digest; none for one at rest. `audit verify`'s
    head is the root an anchor taken now holds."""
    resting = op_in(store, S.SUCCEEDED)
    watched = op_in(store, S.OBSERVING)
    polls = [store.add_observation(watched.operation_id, kind="status_poll", raw={"n": n}) for n in range(2)]
    anchor = make_anchor(store)
    assert anchor["format"] == "jobtrail-anchor/v2"
    heads = {h[0]: h for h in anchor["heads"]}
    covered = store.history(resting.operation_id)[-1].obs_upto
    assert heads[resting.operation_id][1:] == [resting.version, resting.history_head, covered, 0, None]
    tail = [item for item in stored_digests(store, watched) if item[0] in polls]
    assert heads[watched.operation_id][3:] == [polls[-1], 2, window_digest(tail)]
    assert verify(store, anchor=anchor).ok
    assert verify(store).root == anchor["root"]


def test_a_keyed_anchors_hmac_and_root_cover_the_tails(store: Store) -> None:
    """An anchored tail edited in the file (to match a ledger rewritten after it) is the file's own alteration."""
    op = op_in(store, S.OBSERVING)
    store.add_observation(op.operation_id, kind="status_poll", raw={"status": "running"})
    key = Secret("anchor-key-0123456789", redactor=store.redactor)
    for anchor, says in ((make_anchor(store, key=key, key_name="K"), "HMAC"), (make_anchor(store), "root")):
        verified = verify(store, anchor=anchor, key=key if anchor["hmac"] else None)
        assert verified.ok
        (head,) = anchor["heads"]
        head[4:] = [0, None]  # "nothing followed its last entry"
        bad = verify(store, anchor=anchor, key=key if anchor["hmac"] else None).findings
        assert bad[0].kind == "anchor_mismatch" and says in bad[0].detail


def test_a_file_that_is_no_anchor_is_refused_before_the_ledger_is_read(store: Store) -> None:
    op_in(store, S.SUCCEEDED)
    anchor = make_anchor(store)
    for forged in ({**anchor, "format": "jobtrail-anchor/v9"}, {**anchor, "heads": [h[:3] for h in anchor["heads"]]}):
        with pytest.raises(ConfigError, match="not a jobtrail anchor"):
            verify(store, anchor=forged)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobtrail", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_cli_verify_exit_codes_and_json(tmp_path) -> None:
    """0 ok, 1 tampered (naming the first bad entry and its kind), 2 cannot verify."""
    db = str(tmp_path / "cli.db")
    store = Store.open(db)
    op = op_in(store, S.SUCCEEDED)
    anchor_file = tmp_path / "anchor.json"
    env = {"ANCHOR_KEY": "k-0123456789abcdef"}
    made = run_cli(
        "--db", db, "audit", "anchor", "--out", str(anchor_file), "--key-env", "ANCHOR_KEY", "--json", env=env
    )
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["keyed"] is True

    ok = run_cli(
        "--db",
        db,
        "audit",
        "verify",
        "--anchor",
        str(anchor_file),
        "--key-env",
        "ANCHOR_KEY",
        "--json",
        env=env,
    )
    assert ok.returncode == 0, ok.stderr
    doc = json.loads(ok.stdout)
    assert doc["ok"] is True and doc["checked"]["operations"] == 1 and doc["first_bad"] is None

    drop_guards(store)
    sql(store, "UPDATE history SET cause = 'forged' WHERE operation_id = :i AND seq = 2", i=op.operation_id)
    bad = run_cli("--db", db, "audit", "verify")
    assert bad.returncode == 1
    assert bad.stdout.startswith(f"TAMPERED edited at {op.operation_id} entry 2")

    cannot = run_cli("--db", db, "audit", "verify", "--anchor", str(tmp_path / "missing.json"))
    assert cannot.returncode == 2
    assert "cannot read anchor" in cannot.stderr
    store.close()


def test_an_anchor_is_never_replaced_by_accident_and_a_mismatch_names_the_likelier_cause(tmp_path) -> None:
    """An anchor is the evidence of an earlier state: writing another over it takes --force. A wrong key, or
    another ledger's anchor, is still TAMPERED (exit 1), but the message names that likelier cause too."""
    db, other = str(tmp_path / "a.db"), str(tmp_path / "b.db")
    op_in(Store.open(db), S.SUCCEEDED)
    op_in(Store.open(other), S.SUCCEEDED, body={"another": "ledger"})
    anchor = tmp_path / "anchor.json"
    env = {"ANCHOR_KEY": "k-0123456789abcdef", "WRONG_KEY": "k-fedcba9876543210"}
    made = run_cli("--db", db, "audit", "anchor", "--out", str(anchor), "--key-env", "ANCHOR_KEY", env=env)
    assert made.returncode == 0, made.stderr
    kept = anchor.read_text()
    again = run_cli("--db", db, "audit", "anchor", "--out", str(anchor), env=env)
    assert again.returncode == 2 and "an anchor is already there" in again.stderr and "--force" in again.stderr
    assert anchor.read_text() == kept
    wrong = run_cli("--db", db, "audit", "verify", "--anchor", str(anchor), "--key-env", "WRONG_KEY", env=env)
    assert wrong.returncode == 1
    assert "not the one it was made with (it was made with the key in ANCHOR_KEY)" in wrong.stdout
    elsewhere = run_cli("--db", other, "audit", "verify", "--anchor", str(anchor), "--key-env", "ANCHOR_KEY", env=env)
    assert elsewhere.returncode == 1 and "TAMPERED deleted" in elsewhere.stdout
    assert "if the anchor is another ledger's, point --db at that one" in elsewhere.stdout
    forced = run_cli("--db", other, "audit", "anchor", "--out", str(anchor), "--force", env=env)
    assert forced.returncode == 0 and anchor.read_text() != kept


def as_written_before_0006(store: Store, op: Operation) -> None:
    """Rewrite an operation's chain as version 1 (no coverage), as a ledger from before 0006 holds it."""
    drop_guards(store)
    entries = rows(store, op)
    sql(store, "DELETE FROM history WHERE operation_id = :i", i=op.operation_id)
    prev = "0" * 64
    for row in entries:
        new = forge(row, hash_version=1, covers=None, obs_upto=None, prev_hash=prev)
        insert(store, new)
        prev = new["entry_hash"]
    sql(
        store,
        "UPDATE operations SET history_head = :h, row_seal = NULL WHERE operation_id = :i",
        h=prev,
        i=op.operation_id,
    )
    sql(store, "UPDATE observations SET digest = NULL WHERE operation_id = :i", i=op.operation_id)


def test_entries_from_before_0006_keep_verifying_and_new_ones_cover_what_follows(store: Store) -> None:
    from jobtrail.domain.states import RemoteState

    from helpers import obs

    op = op_in(store, S.OBSERVING)
    old_obs = store.add_observation(op.operation_id, kind="status_poll", raw={"status": "running"})
    as_written_before_0006(store, op)
    assert verify(store).ok
    op = store.get(op.operation_id)
    new_obs = store.add_observation(op.operation_id, kind="status_poll", raw={"status": "failed"})
    op = store.transition(op, S.FAILED, obs(RemoteState.FAILED), actor="after-upgrade")
    assert [e.hash_version for e in store.history(op.operation_id)][-2:] == [1, 2]
    window = json.loads(store.history(op.operation_id)[-1].covers or "{}")["obs"]
    assert (window["after"], window["upto"], window["count"]) == (old_obs, new_obs, 1)
    assert verify(store).ok
    sql(store, "DELETE FROM observations WHERE observation_id = :o", o=new_obs)
    assert [(f.field, f.kind) for f in verify(store).findings] == [("observations", "deleted")]


@given(
    value=st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(min_value=2**62, max_value=2**80),
        st.text(max_size=250),
        st.lists(st.integers(), max_size=3),
        st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
    )
)
def test_a_field_digest_is_the_documented_hash_of_the_values_canonical_bytes(value: Any) -> None:
    # the audit recomputes digests with the same function: this pins it to the documented bytes
    expected = hashlib.sha256(b"jobtrail/field/v1\0" + canonical_bytes(value)).hexdigest()[:32]
    assert field_digest(value) == expected
    assert field_digest(value) == expected  # and again, from whatever was remembered


def test_an_anchor_for_a_directory_that_does_not_exist_is_one_clear_line(tmp_path) -> None:
    """The README's own example names a directory a newcomer may not have: a usage error (exit 2) naming it,
    one line (a JSON one under --json), no traceback and no file written anywhere."""
    db = str(tmp_path / "cli.db")
    op_in(Store.open(db), S.SUCCEEDED)
    out = tmp_path / "somewhere" / "safe" / "anchor.json"
    for extra in ((), ("--json",)):
        made = run_cli("--db", db, "audit", "anchor", "--out", str(out), *extra)
        assert made.returncode == 2, made.stderr
        assert "Traceback" not in made.stderr and f"the directory {out.parent} does not exist" in made.stderr
        if extra:
            assert json.loads(made.stdout)["error"]["exit_code"] == 2
    assert not (tmp_path / "somewhere").exists()


def test_a_key_given_refuses_an_unkeyed_anchor_in_place_of_a_keyed_one(tmp_path) -> None:
    """Someone who rewrote the ledger can write an unkeyed anchor of it over the keyed one, never a keyed one:
    with --key-env, an anchor without an HMAC is a finding (exit 1) saying what to do, never "anchor matches"."""
    db = str(tmp_path / "cli.db")
    store = Store.open(db)
    op = op_in(store, S.SUCCEEDED)
    env = {"ANCHOR_KEY": "k-0123456789abcdef"}
    keyed = tmp_path / "anchor.json"
    assert (
        run_cli("--db", db, "audit", "anchor", "--out", str(keyed), "--key-env", "ANCHOR_KEY", env=env).returncode == 0
    )
    entries = rows(store, op)
    drop_guards(store)  # a consistent truncation, the rewrite an anchor exists to catch
    sql(store, "DELETE FROM history WHERE operation_id = :i AND seq = :s", i=op.operation_id, s=entries[-1]["seq"])
    sql(store, "DELETE FROM results WHERE operation_id = :i", i=op.operation_id)
    sql(
        store,
        "UPDATE operations SET version = :v, history_head = :h, state = :s, result_ref = NULL WHERE operation_id = :i",
        v=entries[-2]["seq"],
        h=entries[-2]["entry_hash"],
        s=entries[-2]["to_state"],
        i=op.operation_id,
    )
    verify_keyed = ("--db", db, "audit", "verify", "--anchor", str(keyed), "--key-env", "ANCHOR_KEY", "--json")
    assert run_cli(*verify_keyed, env=env).returncode == 1
    assert run_cli("--db", db, "audit", "anchor", "--out", str(keyed), "--force").returncode == 0  # unkeyed, over it

    swapped = run_cli(*verify_keyed, env=env)
    assert swapped.returncode == 1, swapped.stdout + swapped.stderr
    doc = json.loads(swapped.stdout)
    assert doc["ok"] is False and [f["kind"] for f in doc["findings"]] == ["anchor_mismatch"]
    assert "carries no HMAC" in doc["first_bad"]["detail"] and "verify it without one" in doc["first_bad"]["detail"]
    text = run_cli(*verify_keyed[:-1], env=env)
    assert text.returncode == 1 and "anchor matches" not in text.stdout
    store.close()


#: one cell of a bystander stored with a type the ledger never writes there (SQLite keeps any type anywhere)
ODD_CELLS = {
    "operations.state_reason": ("UPDATE operations SET state_reason = X'00' WHERE operation_id = ?", "state_reason"),
    "operations.caller": ("UPDATE operations SET caller = X'41' WHERE operation_id = ?", "caller"),
    "operations.version": ("UPDATE operations SET version = 'x' WHERE operation_id = ?", "version"),
    "history.actor": ("UPDATE history SET actor = X'41' WHERE operation_id = ? AND seq = 2", "history.actor"),
    "history.at_us": ("UPDATE history SET at_us = 'x' WHERE operation_id = ? AND seq = 2", "history.at_us"),
    "history.hash_version": (
        "UPDATE history SET hash_version = 'x' WHERE operation_id = ? AND seq = 2",
        "history.hash_version",
    ),
    "history.entry_hash": (
        "UPDATE history SET entry_hash = X'41' WHERE operation_id = ? AND seq = 2",
        "history.entry_hash",
    ),
    "observations.raw": ("UPDATE observations SET raw = X'41' WHERE operation_id = ?", "observation"),
    "observations.progress": ("UPDATE observations SET progress = 9e999 WHERE operation_id = ?", "observation"),
}


@pytest.mark.parametrize("cell", sorted(ODD_CELLS))
def test_a_value_of_an_unexpected_type_is_a_finding_not_the_end_of_the_audit(tmp_path, cell: str) -> None:
    """A BLOB, an infinite number or text where an integer goes is named as an edit, and the real tamper
    elsewhere is still reported: exit 1 with JSON, no traceback, no usage error."""
    import sqlite3

    from jobtrail.ledger.store import Observe

    db = str(tmp_path / "cli.db")
    store = Store.open(db)
    victim = op_in(store, S.SUCCEEDED)
    bystander = op_in(store, S.FAILED)
    store.apply([Observe(operation_id=bystander.operation_id, kind="status", raw={"x": 1}, progress=0.5)])
    assert verify(store).ok
    drop_guards(store)
    store.close()
    statement, field = ODD_CELLS[cell]
    with sqlite3.connect(db) as raw:
        raw.execute("UPDATE operations SET state = 'failed' WHERE operation_id = ?", (victim.operation_id,))
        raw.execute(statement, (bystander.operation_id,))
    raw.close()

    done = run_cli("--db", db, "audit", "verify", "--json")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    found = {(f["operation_id"], f["field"], f["kind"]) for f in doc["findings"]}
    assert (victim.operation_id, "state", "edited") in found
    assert any(op_id == bystander.operation_id and name.startswith(field) for op_id, name, _ in found), found
    odd = [f for f in doc["findings"] if f["operation_id"] == bystander.operation_id]
    assert any("a type the ledger never writes there" in f["detail"] for f in odd), odd
