"""The tamper matrix: every stored field, observation and result, changed as an attacker with database access would.

Each case runs a real lifecycle (the fake provider on loopback, a Worker), checks
that ``jobtrail audit verify`` passes, tampers with one thing directly in SQL or on
disk (dropping the history's append-only triggers first, as an attacker would), and
then runs ``jobtrail audit verify --json`` and ``jobtrail result`` as separate
processes: verify exits 1 naming the operation, the field and the kind, and
``result`` never hands out forged bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from jobtrail import AsyncJobtrail, Operation, State, Store, ValidatedResult
from jobtrail.domain.canonical import floatless_json
from jobtrail.domain.results import ResultCorrupted
from jobtrail.ledger.audit import make_anchor, verify
from jobtrail.ledger.chain import entry_hash, observation_digest
from jobtrail.ledger.files import data_dir
from jobtrail.ledger.results import INLINE_MAX_BYTES, prepare_result, read_result, stored_result
from jobtrail.providers.http import load_provider
from jobtrail.runtime.worker import Worker
from jobtrail.testing import FakeProvider

from helpers import S, drop_guards, obs, op_in, sql, tiered
from processes import jobtrail

FAST = {
    "poll": {"initial_s": 0.05, "factor": 1, "cap_s": 0.1},
    "retry": {"initial_s": 0.02, "factor": 1, "cap_s": 0.05},
}


def history(store: Store, op_id: str) -> list[dict[str, Any]]:
    with store.engine.connect() as conn:
        return [
            dict(r)
            for r in conn.execute(
                sa.text("SELECT * FROM history WHERE operation_id = :i ORDER BY seq"), {"i": op_id}
            ).mappings()
        ]


def observations(store: Store, op_id: str) -> list[dict[str, Any]]:
    with store.engine.connect() as conn:
        return [
            dict(r)
            for r in conn.execute(
                sa.text("SELECT * FROM observations WHERE operation_id = :i ORDER BY observation_id"), {"i": op_id}
            ).mappings()
        ]


def insert_entry(store: Store, row: dict[str, Any]) -> None:
    cols = ", ".join(row)
    sql(store, f"INSERT INTO history ({cols}) VALUES ({', '.join(':' + c for c in row)})", **row)


def forge(row: dict[str, Any], **changes: Any) -> dict[str, Any]:
    new = {**row, **changes}
    new["entry_hash"] = entry_hash(new)
    return new


@dataclass
class Ledger:
    """A finished lifecycle: an inline result, a file result and a bystander, all verified intact."""

    store: Store
    db_url: str
    inline: str
    file: str
    bystander: str

    def set(self, op_id: str, column: str, value: Any) -> None:
        sql(self.store, f"UPDATE operations SET {column} = :v WHERE operation_id = :i", v=value, i=op_id)


@pytest.fixture
def ledger(db_url: str, fake: FakeProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("JOBTRAIL_DATA_DIR", str(tmp_path / "results"))  # the CLI processes inherit it
    store = Store.open(db_url)
    cfg = fake.provider_config(**FAST)
    jt = AsyncJobtrail(store=store, providers=[cfg])

    async def lifecycle() -> list[str]:
        ids = [
            (await jt.submit("fake", {"n": 1}, caller="agent-a", approved_by="alice")).operation_id,
            (await jt.submit("fake", {"fake": {"result": "large", "size": 2 * INLINE_MAX_BYTES}})).operation_id,
            (await jt.submit("fake", {"n": 3})).operation_id,
        ]
        worker = Worker(store, {"fake": load_provider(cfg)}, worker_id="w1", idle_s=0.02)
        await worker.run(until_settled=True, timeout=30)
        return ids

    inline, file, bystander = asyncio.run(lifecycle())
    for op_id in (inline, file, bystander):
        assert store.get(op_id).state is State.SUCCEEDED, store.get(op_id).state_reason
    assert stored_result(store, inline)["body"] is not None  # type: ignore[index]
    assert stored_result(store, file)["path"] is not None  # type: ignore[index]
    assert len(observations(store, inline)) >= 2
    # intact before the tampering (in process: each test runs `jobtrail audit verify` as a process after it)
    assert verify(store).ok
    drop_guards(store)
    yield Ledger(store, db_url, inline, file, bystander)
    store.close()


def verify_cli(led: Ledger) -> dict[str, Any]:
    code, out, err = jobtrail(led.db_url, "audit", "verify", "--json")
    assert code == 1, f"audit verify exited {code}: {out}{err}"
    doc: dict[str, Any] = json.loads(out)
    assert doc["ok"] is False
    return doc


def named(doc: dict[str, Any], op_id: str, field: str, kind: str) -> None:
    found = [(f["operation_id"], f["field"], f["kind"]) for f in doc["findings"]]
    assert (op_id, field, kind) in found, found


# -- the operation row --------------------------------------------------------------------------------

#: every audited column of the operation row and a forged value for it
ROW_FIELDS: dict[str, Any] = {
    "provider": "mallory",
    "target": "someone-else",
    "endpoint": "POST /v1/other",
    "operation_key": "forged-key",
    "request_body": '{"n":999}',
    "request_fingerprint": "f" * 64,
    "idempotency_token": "0" * 32,
    "trace_id": "1" * 32,
    "caller": "agent-b",
    "approved_by": "mallory",
    "create_deadline_us": 1,
    "result_deadline_us": 2,
    "cancel_deadline_us": 3,
    "created_at_us": 4,
    "remote_job_id": "job-forged",
    "state": "failed",
    "remote_state": "forged",
    "state_reason": "nothing to see here",
    "attempts": 7,
    "result_ref": "https://evil.example/result",
    "cancel_requested_by": "mallory",
    "partial_effects": '{"rows":0}',
    "next_action_at_us": 5,
    "polls": 99,
    "updated_at_us": 6,
    "history_head": "e" * 64,
}


@pytest.mark.parametrize("column", tiered(sorted(ROW_FIELDS), fast=4))
def test_an_edited_operation_column_is_named(ledger: Ledger, column: str) -> None:
    ledger.set(ledger.inline, column, ROW_FIELDS[column])
    doc = verify_cli(ledger)
    named(doc, ledger.inline, column, "edited")
    assert {f["operation_id"] for f in doc["findings"]} == {ledger.inline}, "the bystanders stay intact"


def test_approved_by_cleared_is_an_edit(ledger: Ledger) -> None:
    ledger.set(ledger.inline, "approved_by", None)
    named(verify_cli(ledger), ledger.inline, "approved_by", "edited")


def test_lease_columns_are_operational_not_audited(ledger: Ledger) -> None:
    """Who holds the lease and its fencing epoch change outside the history by design."""
    sql(
        ledger.store,
        "UPDATE operations SET lease_owner = 'w9', lease_expires_at_us = 1, lease_epoch = 42 WHERE operation_id = :i",
        i=ledger.inline,
    )
    code, out, err = jobtrail(ledger.db_url, "audit", "verify", "--json")
    assert code == 0 and json.loads(out)["ok"] is True, out + err


# -- results ------------------------------------------------------------------------------------------


def refuses_result(led: Ledger, op_id: str, why: str) -> None:
    code, out, err = jobtrail(led.db_url, "result", op_id)
    assert code != 0, f"result served: {out[:200]}"
    assert why in err, err
    assert out == ""


def test_a_forged_inline_result_with_its_sha256_is_caught_and_never_served(ledger: Ledger) -> None:
    forged = b'{"answer": "forged"}'
    sql(
        ledger.store,
        "UPDATE results SET body = :b, sha256 = :h, size = :n WHERE operation_id = :i",
        b=forged,
        h=hashlib.sha256(forged).hexdigest(),
        n=len(forged),
        i=ledger.inline,
    )
    doc = verify_cli(ledger)
    named(doc, ledger.inline, "result", "edited")
    named(doc, ledger.inline, "result.sha256", "edited")
    refuses_result(ledger, ledger.inline, "its history recorded it")
    # the Python API (and MCP get_result, which calls it) refuses too
    with pytest.raises(Exception, match="does not match its sha256"):
        read_result(ledger.store, ledger.inline)


def test_a_forged_inline_result_is_caught_with_an_anchor_too(ledger: Ledger, tmp_path: Path) -> None:
    anchor = tmp_path / "anchor.json"
    assert jobtrail(ledger.db_url, "audit", "anchor", "--out", str(anchor))[0] == 0
    forged = b"{}"
    sql(
        ledger.store,
        "UPDATE results SET body = :b, sha256 = :h WHERE operation_id = :i",
        b=forged,
        h=hashlib.sha256(forged).hexdigest(),
        i=ledger.inline,
    )
    code, out, _ = jobtrail(ledger.db_url, "audit", "verify", "--anchor", str(anchor), "--json")
    assert code == 1
    named(json.loads(out), ledger.inline, "result", "edited")


def test_a_forged_result_file_is_caught_and_never_served(ledger: Ledger) -> None:
    row = stored_result(ledger.store, ledger.file)
    assert row is not None
    path = data_dir(ledger.store) / row["path"]
    path.write_bytes(b"x" * row["size"])
    named(verify_cli(ledger), ledger.file, "result", "edited")
    refuses_result(ledger, ledger.file, "does not match its sha256")


def test_a_forged_result_file_with_its_sha256_is_caught(ledger: Ledger) -> None:
    forged = b"forged"
    path = data_dir(ledger.store) / "forged"
    path.write_bytes(forged)
    sql(
        ledger.store,
        "UPDATE results SET path = 'forged', sha256 = :h, size = 6 WHERE operation_id = :i",
        h=hashlib.sha256(forged).hexdigest(),
        i=ledger.file,
    )
    doc = verify_cli(ledger)
    named(doc, ledger.file, "result", "edited")
    refuses_result(ledger, ledger.file, "does not match its sha256")


def test_a_deleted_result_file_is_caught(ledger: Ledger) -> None:
    row = stored_result(ledger.store, ledger.file)
    assert row is not None
    (data_dir(ledger.store) / row["path"]).unlink()
    named(verify_cli(ledger), ledger.file, "result", "deleted")
    refuses_result(ledger, ledger.file, "cannot be read")


def test_a_deleted_result_row_is_caught(ledger: Ledger) -> None:
    sql(ledger.store, "DELETE FROM results WHERE operation_id = :i", i=ledger.inline)
    named(verify_cli(ledger), ledger.inline, "result", "deleted")
    refuses_result(ledger, ledger.inline, "no result is stored")


def a_batch_with_failures(store: Store) -> Operation:
    """A batch's result as the collector stores it: 3 of its 10 items failed, named in its summary."""
    op = op_in(store, S.RESULT_COLLECTING)
    stored = prepare_result(
        store,
        op.operation_id,
        b'{"lines": 10}',
        content_type="application/json",
        checks=[{"check": "content_type", "ok": True}, {"check": "json", "ok": True}],
        summary={"items": 10, "succeeded": 7, "failed": 3, "failed_ids": ["r-4", "r-5", "r-9"]},
    )
    evidence = ValidatedResult(
        sha256=stored.sha256, size=stored.size, content_type="application/json", checks=("content_type", "json")
    )
    return store.transition(op, S.SUCCEEDED, evidence, actor="worker", result=stored)


#: every column of a result's record besides its bytes and sha256, and a forged value for it
RESULT_RECORD: dict[str, Any] = {
    "summary": json.dumps({"items": 10, "succeeded": 10, "failed": 0, "failed_ids": []}),  # no partial failure
    "checks": json.dumps([{"check": "content_type", "ok": False}, {"check": "json", "ok": False}]),
    "content_type": "text/html",
    "size": 999_999,
    "redacted": True,
    "path": "elsewhere",
    "stored_at_us": 1,
}


@pytest.mark.parametrize("column", sorted(RESULT_RECORD))
def test_an_edited_result_record_is_named_even_with_an_anchor(store: Store, column: str) -> None:
    """What ops show, result --json, MCP and the dashboard show of a result (its per-item summary, checks,
    content type, size...) is covered by the entry that recorded it, not only its bytes."""
    op = a_batch_with_failures(store)
    anchor = make_anchor(store)
    drop_guards(store)
    sql(store, f"UPDATE results SET {column} = :v WHERE operation_id = :i", v=RESULT_RECORD[column], i=op.operation_id)
    bad = verify(store, anchor=anchor).findings
    assert [(f.operation_id, f.field, f.kind) for f in bad] == [(op.operation_id, "result", "edited")]
    assert f"its {column} differs from what entry {op.version} recorded" in bad[0].detail


def test_an_edited_result_record_names_each_column_that_differs(store: Store) -> None:
    op = a_batch_with_failures(store)
    drop_guards(store)
    sql(store, "UPDATE results SET summary = NULL, size = 1 WHERE operation_id = :i", i=op.operation_id)
    (bad,) = verify(store).findings
    assert (bad.field, bad.kind) == ("result", "edited")
    assert "its size, summary differ" in bad.detail
    # and it is not served as it is now (`jobtrail result`, MCP's get_result, the dashboard read it so)
    with pytest.raises(ResultCorrupted, match="has its size, summary changed since its history recorded it"):
        read_result(store, op.operation_id)


def test_a_result_recorded_before_its_record_was_covered_still_verifies(store: Store) -> None:
    """An entry written before ``result_record`` covers the stored bytes only: no false alarm on the rest of
    the record, the bytes still checked; an entry rewritten to look that old is the anchor's to catch."""
    op = a_batch_with_failures(store)
    anchor = make_anchor(store)
    drop_guards(store)
    last = history(store, op.operation_id)[-1]
    covers = json.loads(last["covers"])
    del covers["result_record"]
    older = forge(last, covers=floatless_json(covers))
    sql(store, "DELETE FROM history WHERE operation_id = :i AND seq = :s", i=op.operation_id, s=last["seq"])
    insert_entry(store, older)
    sql(
        store,
        "UPDATE operations SET history_head = :h WHERE operation_id = :i",
        h=older["entry_hash"],
        i=op.operation_id,
    )
    assert verify(store).ok

    sql(store, "UPDATE results SET summary = NULL WHERE operation_id = :i", i=op.operation_id)
    assert verify(store).ok  # the documented limit of such an entry
    sql(store, "UPDATE results SET body = :b WHERE operation_id = :i", b=b"{}", i=op.operation_id)
    assert [(f.field, f.kind) for f in verify(store).findings] == [("result", "edited")]
    assert ("anchor_mismatch", "history") in [(f.kind, f.field) for f in verify(store, anchor=anchor).findings]


# -- observations -------------------------------------------------------------------------------------


def test_an_edited_observation_is_caught(ledger: Ledger) -> None:
    first = observations(ledger.store, ledger.inline)[0]
    sql(ledger.store, "UPDATE observations SET raw = '{}' WHERE observation_id = :o", o=first["observation_id"])
    named(verify_cli(ledger), ledger.inline, f"observation {first['observation_id']}", "edited")


def test_an_edited_observation_with_a_recomputed_digest_is_caught_by_the_chain(ledger: Ledger) -> None:
    first = observations(ledger.store, ledger.inline)[0]
    forged = {**first, "http_status": 500}
    sql(
        ledger.store,
        "UPDATE observations SET http_status = 500, digest = :d WHERE observation_id = :o",
        d=observation_digest(forged),
        o=first["observation_id"],
    )
    named(verify_cli(ledger), ledger.inline, "observations", "edited")


def test_a_deleted_observation_is_caught(ledger: Ledger) -> None:
    last = observations(ledger.store, ledger.inline)[-1]
    sql(ledger.store, "DELETE FROM observations WHERE observation_id = :o", o=last["observation_id"])
    named(verify_cli(ledger), ledger.inline, "observations", "deleted")


# -- history entries ----------------------------------------------------------------------------------


def _edit_entry(led: Ledger) -> None:
    sql(led.store, "UPDATE history SET actor = 'mallory' WHERE operation_id = :i AND seq = 2", i=led.inline)


def _edit_covers(led: Ledger) -> None:
    last = history(led.store, led.inline)[-1]
    covers = json.loads(last["covers"])
    covers["result"] = "0" * 64
    sql(
        led.store,
        "UPDATE history SET covers = :c WHERE operation_id = :i AND seq = :s",
        c=json.dumps(covers),
        i=led.inline,
        s=last["seq"],
    )


def _delete_entry(led: Ledger) -> None:
    sql(led.store, "DELETE FROM history WHERE operation_id = :i AND seq = 2", i=led.inline)


def _reorder_entries(led: Ledger) -> None:
    i = led.inline
    sql(led.store, "UPDATE history SET seq = -1 WHERE operation_id = :i AND seq = 2", i=i)
    sql(led.store, "UPDATE history SET seq = 2 WHERE operation_id = :i AND seq = 3", i=i)
    sql(led.store, "UPDATE history SET seq = 3 WHERE operation_id = :i AND seq = -1", i=i)


def _insert_entry(led: Ledger) -> None:
    original = history(led.store, led.inline)[2]
    sql(led.store, "DELETE FROM history WHERE operation_id = :i AND seq = 3", i=led.inline)
    insert_entry(led.store, forge(original, actor="mallory"))


def _truncate(led: Ledger) -> None:
    last = history(led.store, led.inline)[-1]
    sql(led.store, "DELETE FROM history WHERE operation_id = :i AND seq = :s", i=led.inline, s=last["seq"])


HISTORY_CASES: dict[str, tuple[Callable[[Ledger], None], str]] = {
    "edited_entry": (_edit_entry, "edited"),
    "edited_covers": (_edit_covers, "edited"),
    "deleted_entry": (_delete_entry, "gap"),
    "reordered_entries": (_reorder_entries, "reordered"),
    "inserted_entry": (_insert_entry, "inserted"),
    "truncated_tail": (_truncate, "truncated"),
}


@pytest.mark.parametrize("case", tiered(sorted(HISTORY_CASES), fast=3))
def test_a_tampered_history_is_named(ledger: Ledger, case: str) -> None:
    tamper, kind = HISTORY_CASES[case]
    tamper(ledger)
    named(verify_cli(ledger), ledger.inline, "history", kind)


def test_an_edited_entry_makes_its_result_unservable(ledger: Ledger) -> None:
    _edit_covers(ledger)
    refuses_result(ledger, ledger.inline, "no longer matches its hash")


def test_a_consistently_rechained_result_needs_the_anchor(ledger: Ledger, tmp_path: Path) -> None:
    """Bytes, sha256 and the covering entry rewritten together, head fixed: only the anchor tells."""
    anchor = make_anchor(ledger.store)
    forged = b"{}"
    digest = hashlib.sha256(forged).hexdigest()
    last = history(ledger.store, ledger.inline)[-1]
    covers = json.loads(last["covers"])
    covers["result"] = digest
    rewritten = forge(last, covers=json.dumps(covers, sort_keys=True, separators=(",", ":")))
    sql(ledger.store, "DELETE FROM history WHERE operation_id = :i AND seq = :s", i=ledger.inline, s=last["seq"])
    insert_entry(ledger.store, rewritten)
    ledger.set(ledger.inline, "history_head", rewritten["entry_hash"])
    sql(
        ledger.store,
        "UPDATE results SET body = :b, sha256 = :h WHERE operation_id = :i",
        b=forged,
        h=digest,
        i=ledger.inline,
    )
    assert verify(ledger.store).ok  # the documented limit without an anchor
    bad = verify(ledger.store, anchor=anchor).findings
    assert [(f.operation_id, f.kind, f.field) for f in bad] == [(ledger.inline, "anchor_mismatch", "history")]


# -- an operation still being watched: reschedules write no entry, the row's seal holds their fields ----


@pytest.mark.parametrize(
    ("column", "value", "against"),
    [
        ("state_reason", "forged", "seal"),
        ("remote_state", "forged", "seal"),
        ("polls", 99, "seal"),
        ("next_action_at_us", 5, "seal"),
        ("partial_effects", '{"rows":0}', "seal"),
        ("attempts", 9, "entry"),
        ("approved_by", "mallory", "entry"),
    ],
)
def test_a_watched_operation_after_reschedules(store: Store, column: str, value: Any, against: str) -> None:
    from jobtrail.domain.states import RemoteState
    from jobtrail.ledger.store import Observe, Reschedule

    op = op_in(store, S.ACCEPTED)
    op = store.transition(op, S.OBSERVING, obs(RemoteState.RUNNING), actor="worker", changes={"polls": 1})
    for n in range(3):  # polls: an observation and a reschedule each, no history entry
        op = store.apply(
            [
                Observe(operation_id=op.operation_id, kind="status_poll", raw={"n": n}),
                Reschedule(
                    op=op,
                    changes={
                        "polls": op.polls + 1,
                        "remote_state": f"running-{n}",
                        "state_reason": f"poll {n}",
                        "partial_effects": {"rows": n},
                        "next_action_at_us": store.clock() + 10**6,
                    },
                ),
            ]
        )[1]
        time.sleep(0.001)
    assert verify(store).ok
    drop_guards(store)
    sql(store, f"UPDATE operations SET {column} = :v WHERE operation_id = :i", v=value, i=op.operation_id)
    bad = verify(store).findings
    assert [(f.operation_id, f.field, f.kind) for f in bad] == [(op.operation_id, column, "edited")]
    assert ("seal" in bad[0].detail) == (against == "seal")


def test_observations_after_the_last_entry_are_checked_by_their_own_digest(store: Store) -> None:
    op = op_in(store, S.OBSERVING)
    oid = store.add_observation(op.operation_id, kind="status_poll", raw={"status": "running"})
    assert verify(store).ok
    sql(store, "UPDATE observations SET raw = '{}' WHERE observation_id = :o", o=oid)
    bad = verify(store).findings
    assert [(f.field, f.kind) for f in bad] == [(f"observation {oid}", "edited")]


def test_a_last_entry_downgraded_to_version_1_is_caught_without_an_anchor(ledger: Ledger) -> None:
    """Re-hashing the last entry as version 1 (which covers nothing else) and fixing the head is still seen."""
    last = history(ledger.store, ledger.inline)[-1]
    downgraded = forge(last, hash_version=1, covers=None, obs_upto=None)
    sql(ledger.store, "DELETE FROM history WHERE operation_id = :i AND seq = :s", i=ledger.inline, s=last["seq"])
    insert_entry(ledger.store, downgraded)
    ledger.set(ledger.inline, "history_head", downgraded["entry_hash"])
    ledger.set(ledger.inline, "attempts", 9)  # what the version-2 entry covered and version 1 does not
    named(verify_cli(ledger), ledger.inline, "history", "edited")


def test_mcp_get_result_refuses_a_forged_result(db_url: str, fake: FakeProvider, tmp_path: Path) -> None:
    """An agent's own job, its result and results.sha256 forged together: the agent gets the reason, not the bytes."""
    from test_mcp import agent_session, result_of

    provider = fake.write_provider_file(
        tmp_path / "fake.toml", connect_timeout_s=1.0, poll={"initial_s": 0.1, "factor": 1, "cap_s": 0.2}
    )
    forged = b'{"verdict": "forged-by-mallory"}'

    async def session_test(session: Any) -> tuple[Any, Any]:
        job = result_of(
            await session.call_tool(
                "submit_job", {"provider": "fake", "request": {"prompt": "p"}, "operation_key": "tamper-1"}
            )
        )
        for _ in range(50):
            status = result_of(
                await session.call_tool("wait_for_change", {"operation_id": job["operation_id"], "timeout_s": 5})
            )
            if status["state"] == "succeeded":
                break
        honest = result_of(await session.call_tool("get_result", {"operation_id": job["operation_id"]}))
        with Store.open(db_url) as store:
            sql(
                store,
                "UPDATE results SET body = :b, sha256 = :h WHERE operation_id = :i",
                b=forged,
                h=hashlib.sha256(forged).hexdigest(),
                i=job["operation_id"],
            )
        return honest, result_of(await session.call_tool("get_result", {"operation_id": job["operation_id"]}))

    honest, answer = asyncio.run(agent_session(db_url, provider, session_test))
    assert honest.get("sha256") and "error" not in honest
    assert "forged-by-mallory" not in json.dumps(answer)
    assert "does not match its sha256" in answer["error"]


# -- observations after the last entry: no entry covers them yet, a keyed anchor does -------------------

ANCHOR_KEY = {"ANCHOR_KEY": "k-0123456789abcdef"}


@dataclass
class Watched:
    """Two jobs being polled (their observations' ids interleave), none of their polls covered by an entry
    yet, and a keyed anchor taken by `jobtrail audit anchor` then; the history's guards dropped."""

    store: Store
    db_url: str
    cfg: Any
    anchor: Path
    watched: str
    other: str

    def tail(self, op_id: str) -> list[dict[str, Any]]:
        """The operation's observations after its last entry's coverage."""
        covered = history(self.store, op_id)[-1]["obs_upto"]
        return [o for o in observations(self.store, op_id) if o["observation_id"] > covered]

    def verify(self, anchor: Path | None = None) -> tuple[int, dict[str, Any]]:
        """`jobtrail audit verify --anchor A --key-env ANCHOR_KEY --json`, as its own process."""
        args = ("--anchor", str(anchor or self.anchor), "--key-env", "ANCHOR_KEY", "--json")
        code, out, err = jobtrail(self.db_url, "audit", "verify", *args, env=ANCHOR_KEY)
        assert code in (0, 1), f"audit verify exited {code}: {out}{err}"
        return code, json.loads(out)

    def work(self, **kwargs: Any) -> None:
        worker = Worker(self.store, {"fake": load_provider(self.cfg)}, worker_id="w1", idle_s=0.02)
        asyncio.run(worker.run(**kwargs))


def findings_of(doc: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(f["operation_id"], f["field"], f["kind"]) for f in doc["findings"]]


@pytest.fixture
def watched(db_url: str, fake: FakeProvider, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("JOBTRAIL_DATA_DIR", str(tmp_path / "results"))
    store = Store.open(db_url)
    cfg = fake.provider_config(**FAST)
    jt = AsyncJobtrail(store=store, providers=[cfg])

    async def submit() -> list[str]:
        return [(await jt.submit("fake", {"n": n, "fake": {"duration": 4}})).operation_id for n in (1, 2)]

    led = Watched(store, db_url, cfg, tmp_path / "anchor.json", *asyncio.run(submit()))
    led.work(timeout=1.2)  # polled about ten times each; the jobs run on
    for op_id in (led.watched, led.other):
        assert store.get(op_id).state is State.OBSERVING
        assert len(led.tail(op_id)) >= 3, "polls after the last entry, which no entry covers yet"
    made = jobtrail(db_url, "audit", "anchor", "--out", str(led.anchor), "--key-env", "ANCHOR_KEY", env=ANCHOR_KEY)
    assert made[0] == 0, made
    code, doc = led.verify()
    assert code == 0 and doc["ok"] is True, doc["findings"]
    drop_guards(store)
    yield led
    store.close()


def test_an_unentried_observation_rewritten_with_its_digest_recomputed_is_caught_by_the_keyed_anchor(
    watched: Watched,
) -> None:
    """Its own digest is public, and no entry covers it yet: the anchor's record of the tail does."""
    victim = watched.tail(watched.watched)[1]
    forged = {**victim, "remote_state": "succeeded", "raw": '{"status": "succeeded"}'}
    sql(
        watched.store,
        "UPDATE observations SET remote_state = 'succeeded', raw = :r, digest = :d WHERE observation_id = :o",
        r=forged["raw"],
        d=observation_digest(forged),
        o=victim["observation_id"],
    )
    assert verify(watched.store).ok  # without an anchor: the documented limit
    code, doc = watched.verify()
    assert code == 1 and findings_of(doc) == [(watched.watched, "observations", "edited")]
    detail = doc["first_bad"]["detail"]
    assert "they were rewritten" in detail and "restore its observations from a backup older than the anchor" in detail


def test_unentried_observations_deleted_are_caught_by_the_keyed_anchor(watched: Watched) -> None:
    gone = [o["observation_id"] for o in watched.tail(watched.watched)[-2:]]
    sql(watched.store, "DELETE FROM observations WHERE observation_id IN (:a, :b)", a=gone[0], b=gone[1])
    assert verify(watched.store).ok  # without an anchor: the documented limit
    code, doc = watched.verify()
    assert code == 1 and findings_of(doc) == [(watched.watched, "observations", "deleted")]
    assert "2 of them are gone" in doc["first_bad"]["detail"]


def test_an_observation_forged_inside_the_anchored_range_is_caught_by_the_keyed_anchor(watched: Watched) -> None:
    """The only free ids below the watched job's newest are ones the forger frees: the other job's, polled in
    between. Both tails then differ from what the anchor recorded."""
    tail = watched.tail(watched.watched)
    first, newest = tail[0]["observation_id"], tail[-1]["observation_id"]
    freed = next(o for o in watched.tail(watched.other) if first < o["observation_id"] < newest)
    sql(watched.store, "DELETE FROM observations WHERE observation_id = :o", o=freed["observation_id"])
    row = {**tail[0], "observation_id": freed["observation_id"], "remote_state": "failed", "raw": '{"status": "x"}'}
    row["digest"] = observation_digest(row)
    sql(watched.store, f"INSERT INTO observations ({', '.join(row)}) VALUES ({', '.join(':' + c for c in row)})", **row)
    assert verify(watched.store).ok  # without an anchor: the documented limit
    code, doc = watched.verify()
    assert code == 1
    assert sorted(findings_of(doc)) == sorted(
        [(watched.watched, "observations", "inserted"), (watched.other, "observations", "deleted")]
    )
    inserted = next(f for f in doc["findings"] if f["operation_id"] == watched.watched)
    covered = history(watched.store, watched.watched)[-1]["obs_upto"]
    assert f"ids {covered + 1}..{newest}" in inserted["detail"]
    assert "1 more are there now, with ids inside that range" in inserted["detail"]


def anchor_in_the_v1_format(store: Store, key: str, key_name: str) -> dict[str, Any]:
    """What `jobtrail audit anchor` wrote before it held tails: [operation id, seq, head] per operation."""
    import hmac

    from jobtrail.domain.canonical import canonical_bytes, rfc3339
    from jobtrail.ledger.chain import leaf_bytes, merkle_root

    with store.engine.connect() as conn:
        query = "SELECT operation_id, version, history_head FROM operations ORDER BY operation_id"
        heads = [list(row) for row in conn.execute(sa.text(query))]
    anchor: dict[str, Any] = {
        "format": "jobtrail-anchor/v1",
        "created_at": rfc3339(store.clock()),
        "operations": len(heads),
        "entries": sum(h[1] for h in heads),
        "root": merkle_root([leaf_bytes(*h) for h in heads]),
        "heads": heads,
        "hmac_key": key_name,
        "hmac": None,
    }
    body = {name: value for name, value in anchor.items() if name != "hmac"}
    anchor["hmac"] = hmac.new(key.encode(), canonical_bytes(body), hashlib.sha256).hexdigest()
    return anchor


def test_a_ledger_that_keeps_working_after_the_anchor_still_verifies_against_it(watched: Watched) -> None:
    """New polls, the entries that then cover the anchored ones, a result and a new operation: none is a
    finding, against the keyed anchor or against one in the earlier format (heads only)."""
    old = watched.anchor.with_name("anchor-v1.json")
    old.write_text(json.dumps(anchor_in_the_v1_format(watched.store, ANCHOR_KEY["ANCHOR_KEY"], "ANCHOR_KEY")))
    anchored = json.loads(watched.anchor.read_text())
    assert anchored["format"] == "jobtrail-anchor/v2"
    newest = max(h[3] for h in anchored["heads"])
    jt = AsyncJobtrail(store=watched.store, providers=[watched.cfg])

    async def another() -> str:
        return (await jt.submit("fake", {"n": 3})).operation_id

    new_op = asyncio.run(another())
    watched.work(until_settled=True, timeout=30)
    for op_id in (watched.watched, watched.other, new_op):
        assert watched.store.get(op_id).state is State.SUCCEEDED
    assert max(o["observation_id"] for o in observations(watched.store, watched.watched)) > newest  # polled since
    assert watched.tail(watched.watched) == []  # the anchored tail is covered by an entry now
    for anchor in (watched.anchor, old):
        code, doc = watched.verify(anchor)
        assert (code, doc["ok"], doc["anchor_checked"]) == (0, True, True), doc["findings"]


def test_an_anchor_in_the_earlier_format_is_checked_as_before(watched: Watched) -> None:
    """Heads only: a rewritten tail goes unseen by it (the limit it always had), a re-chained history does not."""
    old = watched.anchor.with_name("anchor-v1.json")
    old.write_text(json.dumps(anchor_in_the_v1_format(watched.store, ANCHOR_KEY["ANCHOR_KEY"], "ANCHOR_KEY")))
    assert watched.verify(old)[0] == 0
    newest = watched.tail(watched.watched)[-1]["observation_id"]
    sql(watched.store, "DELETE FROM observations WHERE observation_id = :o", o=newest)
    assert watched.verify(old)[0] == 0
    assert findings_of(watched.verify()[1]) == [(watched.watched, "observations", "deleted")]
    _rechain_first_entry(watched)
    code, doc = watched.verify(old)
    assert code == 1 and (watched.other, "history", "anchor_mismatch") in findings_of(doc)


def _rechain_first_entry(led: Watched) -> None:
    """The other job's chain rewritten consistently from its first entry on, its head fixed: only an anchor sees it."""
    entries = history(led.store, led.other)
    sql(led.store, "DELETE FROM history WHERE operation_id = :i", i=led.other)
    prev = "0" * 64
    for n, row in enumerate(entries):
        new = forge(row, prev_hash=prev, **({"actor": "mallory"} if n == 0 else {}))
        insert_entry(led.store, new)
        prev = new["entry_hash"]
    sql(led.store, "UPDATE operations SET history_head = :h WHERE operation_id = :i", h=prev, i=led.other)
