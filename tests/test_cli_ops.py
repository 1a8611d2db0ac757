"""`jobtrail ops ...`: stable JSON for agents, one-line errors with an exit code for people."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from jobtrail import Store
from jobtrail.domain.states import RemoteState

from helpers import S, ctrl_c_as_from_a_terminal, obs, op_in


def jobtrail(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "jobtrail", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_ops_show_into_a_pipe_prints_every_value_whole(tmp_path: Path) -> None:
    """An operator pipes `ops show` into grep or a file: each value whole on its own line, none cut short
    with an ellipsis (Rich takes a pipe for 80 columns, COLUMNS or not)."""
    db = str(tmp_path / "ops.db")
    store = Store.open(db)
    key = "quarterly-report-" + "x" * 90
    op = op_in(store, S.FAILED, body={"i": 1}, operation_key=key)
    store.close()

    shown = jobtrail("--db", db, "ops", "show", op.operation_id, env={"COLUMNS": "80"})
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert [line for line in lines if "request_fingerprint" in line and op.request_fingerprint in line]
    assert [line for line in lines if "operation_key" in line and key in line]
    assert "\u2026" not in shown.stdout
    for command in (("ops", "list"), ("ops", "history", op.operation_id)):
        out = jobtrail("--db", db, *command, env={"COLUMNS": "80"})
        assert out.returncode == 0 and "\u2026" not in out.stdout, out.stdout
        assert key in out.stdout or command[1] == "history"


def test_provider_words_and_keys_in_brackets_are_shown_as_written_never_read_as_markup(tmp_path: Path) -> None:
    """A provider's error message (quoted in the reason) and a caller's key are foreign text: Rich must not take
    ``[/tmp/x]`` for a closing tag (it raised MarkupError) nor ``[link=...]`` for a hyperlink escape."""
    db = str(tmp_path / "ops.db")
    store = Store.open(db)
    key = "[bold]q3[/bold]-report"
    op = op_in(store, S.OBSERVING, body={"i": 1}, operation_key=key)
    said = 'the provider reports the job failed: "no such file [/tmp/x] [link=https://evil.example]click[/link]"'
    failed = store.transition(
        op, S.FAILED, obs(RemoteState.FAILED), actor="worker", changes={"state_reason": said, "remote_state": "failed"}
    )
    store.close()

    for command in (("ops", "show", failed.operation_id), ("ops", "list"), ("explain", failed.operation_id)):
        out = jobtrail("--db", db, *command, env={"COLUMNS": "300"})
        assert out.returncode in (0, 3), out.stderr
        assert "MarkupError" not in out.stderr and "\x1b" not in out.stdout
        assert key in out.stdout or command[0] == "explain"
        if command[0] != "ops" or command[1] == "show":
            assert "[/tmp/x] [link=https://evil.example]click[/link]" in out.stdout


def test_ops_list_show_history_json(tmp_path: Path) -> None:
    db = str(tmp_path / "ops.db")
    store = Store.open(db)
    done = op_in(store, S.FAILED, body={"i": 1})
    pending = op_in(store, S.CREATE_PENDING, body={"i": 2}, operation_key="nightly")
    store.close()

    listed = jobtrail("--db", db, "ops", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    ids = [o["operation_id"] for o in json.loads(listed.stdout)["items"]]
    assert ids == [pending.operation_id, done.operation_id]

    only = jobtrail("ops", "list", "--state", "failed", "--json", env={"JOBTRAIL_DB": db})
    assert [o["operation_id"] for o in json.loads(only.stdout)["items"]] == [done.operation_id]
    # --provider takes a name here (every other --provider takes a file): an empty list says which names exist
    by_file = jobtrail("--db", db, "ops", "list", "--provider", "examples/fake.toml", "--json")
    assert by_file.returncode == 0 and json.loads(by_file.stdout)["count"] == 0
    assert f"the names in use: {done.provider}" in by_file.stderr and "not its file" in by_file.stderr

    shown = json.loads(jobtrail("--db", db, "ops", "show", pending.operation_id, "--json").stdout)
    assert shown["state"] == "create_pending" and shown["operation_key"] == "nightly"
    assert shown["trace_id"] == pending.trace_id
    assert "idempotency_token" not in shown and pending.idempotency_token not in json.dumps(shown)
    assert set(shown) >= {
        "operation_id",
        "provider",
        "target",
        "request_fingerprint",
        "remote_job_id",
        "remote_state",
        "attempts",
        "create_deadline",
        "result_deadline",
        "cancel_deadline",
        "caller",
        "approved_by",
        "created_at",
        "updated_at",
        "version",
        "lease",
    }

    history = json.loads(jobtrail("--db", db, "ops", "history", done.operation_id, "--json").stdout)["items"]
    assert [h["seq"] for h in history] == list(range(1, done.version + 1))
    assert history[-1]["to"] == "failed" and history[0]["prev_hash"] == "0" * 64
    assert history[1]["prev_hash"] == history[0]["hash"]

    table = jobtrail("--db", db, "ops", "list")
    assert done.operation_id in table.stdout


def test_an_operation_is_found_by_its_key_wherever_an_id_is_accepted(tmp_path: Path) -> None:
    """An agent that lost its memory still has the key it chose: that is enough to find the job."""
    db = str(tmp_path / "ops.db")
    store = Store.open(db)
    op = op_in(store, S.FAILED, operation_key="q3-summary")
    shared_a = op_in(store, S.FAILED, operation_key="nightly", provider="a")
    shared_b = op_in(store, S.FAILED, operation_key="nightly", provider="b")
    store.close()

    shown = jobtrail("--db", db, "ops", "show", "q3-summary", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["operation_id"] == op.operation_id
    history = json.loads(jobtrail("--db", db, "ops", "history", "q3-summary", "--json").stdout)["items"]
    assert len(history) == op.version
    explained = jobtrail("--db", db, "explain", "q3-summary", "--json")
    assert json.loads(explained.stdout)["operation_id"] == op.operation_id
    bundle = json.loads(jobtrail("--db", db, "ops", "escalation", "q3-summary", "--json").stdout)
    assert op.operation_id in json.dumps(bundle)
    with Store.open(db) as again:
        assert again.resolve("q3-summary") == again.get(op.operation_id)

    # one key with two providers names no single operation: the error lists both ids, changes nothing
    ambiguous = jobtrail("--db", db, "ops", "show", "nightly")
    assert ambiguous.returncode == 2
    assert shared_a.operation_id in ambiguous.stderr and shared_b.operation_id in ambiguous.stderr
    assert "Traceback" not in ambiguous.stderr
    missing = jobtrail("--db", db, "ops", "show", "no-such-key")
    assert missing.returncode == 1 and "no operation has the id or key 'no-such-key'" in missing.stderr


def test_ops_list_filters_by_key_caller_and_several_states_and_says_when_it_is_cut(tmp_path: Path) -> None:
    db = str(tmp_path / "ops.db")
    store = Store.open(db)
    failed = op_in(store, S.FAILED, operation_key="nightly", caller="alice")
    stuck = op_in(store, S.NEEDS_ATTENTION, body={"i": 2}, caller="bob")
    pending = [op_in(store, S.CREATE_PENDING, body={"i": 10 + i}, caller="bob") for i in range(3)]
    store.close()

    def listed(*args: str) -> list[str]:
        out = jobtrail("--db", db, "ops", "list", "--json", *args)
        assert out.returncode == 0, out.stderr
        return [o["operation_id"] for o in json.loads(out.stdout)["items"]]

    assert listed("--key", "nightly") == [failed.operation_id]
    assert listed("--caller", "alice") == [failed.operation_id]
    assert listed("--state", "failed", "--state", "needs_attention") == [stuck.operation_id, failed.operation_id]
    assert listed("--caller", "bob", "--state", "create_pending") == [op.operation_id for op in reversed(pending)]

    cut = jobtrail("--db", db, "ops", "list", "--json", "--limit", "2")
    assert {k: v for k, v in json.loads(cut.stdout).items() if k != "items"} == {"count": 2, "total": 5}
    assert "showing the newest 2 of 5 operations; raise --limit" in cut.stderr
    whole = jobtrail("--db", db, "ops", "list", "--json", "--limit", "5")
    # nothing was cut (whatever else stderr says: on a slow machine these unserved operations are overdue)
    assert json.loads(whole.stdout)["count"] == 5 and "showing the newest" not in whole.stderr
    table = jobtrail("--db", db, "ops", "list", "--key", "nightly")
    assert "nightly" in table.stdout and failed.operation_id in table.stdout


def test_global_options_work_after_the_command_too(tmp_path: Path) -> None:
    """People write `jobtrail ops list --db X`; it means what `jobtrail --db X ops list` means."""
    db = str(tmp_path / "ops.db")
    store = Store.open(db)
    op = op_in(store, S.FAILED, operation_key="after")
    store.close()
    listed = jobtrail("ops", "list", "--json", "--db", db)
    assert listed.returncode == 0, listed.stderr
    assert [o["operation_id"] for o in json.loads(listed.stdout)["items"]] == [op.operation_id]
    shown = jobtrail("ops", "show", "after", f"--db={db}", "--json")
    assert json.loads(shown.stdout)["operation_id"] == op.operation_id
    missing = jobtrail("ops", "list", "--db", str(tmp_path / "none.db"))
    assert missing.returncode == 2 and "no database at" in missing.stderr  # the --db given after, not the default


def test_a_command_on_a_database_without_a_ledger_writes_nothing_there(
    tmp_path: Path, db_url: str, engine_name: str
) -> None:
    """`jobtrail --db X ops list` (or resolve, or cancel) pointed at the wrong database (another program's
    file, an empty schema, a mistyped path) says there is no ledger there, and leaves it as it was: no
    tables, no new file, and SQLite's journal mode untouched."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    other = theirs / "another-program.db"
    with contextlib.closing(sqlite3.connect(other)) as conn, conn:
        conn.execute("CREATE TABLE notes (text)")
        conn.execute("INSERT INTO notes VALUES ('theirs')")
    # a program that migrates with Alembic too, in WAL mode (its -wal and -shm files come and go with it)
    migrated = theirs / "migrated-app.db"
    with contextlib.closing(sqlite3.connect(migrated)) as conn, conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        conn.execute("INSERT INTO alembic_version VALUES ('3f2a9c1b7d4e')")
        conn.execute("CREATE TABLE users (name)")
    empty = theirs / "empty.db"
    empty.touch()
    before = {path: path.read_bytes() for path in (other, migrated, empty)}
    for db in before:
        listed = jobtrail("--db", str(db), "ops", "list")
        assert listed.returncode == 2 and "no jobtrail ledger in" in listed.stderr, listed.stderr
        assert "Point --db (or JOBTRAIL_DB) at your ledger" in listed.stderr
    # commands that act on an operation already recorded find none there either, and make no ledger to say so
    for acting in (
        ("resolve", "op_1", "--to", "failed", "--by", "me", "--reason", "r"),
        ("cancel", "op_1", "--by", "me", "--reason", "r"),
    ):
        refused = jobtrail("--db", str(other), *acting)
        assert refused.returncode == 2 and "no jobtrail ledger in" in refused.stderr, refused.stderr
        gone = jobtrail("--db", str(theirs / "typo.db"), *acting)
        assert gone.returncode == 2 and "no database at" in gone.stderr, gone.stderr
    assert {path: path.read_bytes() for path in before} == before
    assert sorted(p.name for p in theirs.iterdir()) == ["another-program.db", "empty.db", "migrated-app.db"]
    if engine_name == "postgresql":  # the test's schema is empty until something opens it for writing
        verified = jobtrail("--db", db_url, "audit", "verify")
        assert verified.returncode == 2 and "no jobtrail ledger in" in verified.stderr, verified.stderr
        engine = sa.create_engine(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
        with engine.connect() as conn:
            assert sa.inspect(conn).get_table_names() == []
        engine.dispose()
    # a ledger of its own is read as ever (an existing one of an older revision is upgraded by any command)
    Store.open(db_url).close()
    assert jobtrail("--db", db_url, "ops", "list", "--json").returncode == 0


def test_errors_are_one_line_with_the_way_out(tmp_path: Path) -> None:
    db = str(tmp_path / "e.db")
    Store.open(db).close()  # a read command on a missing file says so (tests/test_hostile_provider_leaks.py)
    missing = jobtrail("--db", db, "ops", "show", "op_DOESNOTEXIST")
    assert missing.returncode == 1
    assert missing.stderr.strip().count("\n") == 0 and "jobtrail ops list" in missing.stderr
    assert "Traceback" not in missing.stderr

    bad_url = jobtrail("--db", "mysql://nowhere/x", "ops", "list")
    assert bad_url.returncode == 2 and "unsupported database URL scheme" in bad_url.stderr

    down = jobtrail(
        "--db", "postgresql://postgres:pw1@127.0.0.1:1/x?password=hunter2&sslpassword=s3cret", "ops", "list"
    )
    assert down.returncode == 2 and "is the PostgreSQL server running" in down.stderr
    assert "Traceback" not in down.stderr
    # the URL is named, its passwords never: neither the URL's own nor one given as a parameter
    assert "127.0.0.1:1/x" in down.stderr and "password=***" in down.stderr
    assert not any(secret in down.stderr for secret in ("pw1", "hunter2", "s3cret"))

    for command in (("ops", "list"), ("worker", "--provider", str(EXAMPLES / "fake.toml"), "--until-settled")):
        directory = jobtrail("--db", str(tmp_path), *command)
        assert directory.returncode == 2 and f"{tmp_path} is a directory, not a ledger" in directory.stderr


def test_a_person_resolves_what_automation_could_not(tmp_path: Path) -> None:
    """needs_attention waits for a person; resolve records the decision, explain shows what follows."""
    from jobtrail import ConflictingJobIds

    (tmp_path / "my ledgers").mkdir()
    db = str(tmp_path / "my ledgers" / "r.db")
    store = Store.open(db)
    op, other = (
        store.transition(
            op_in(store, S.CREATE_PENDING, body={"i": i}),
            S.NEEDS_ATTENTION,
            ConflictingJobIds(first_job_id="a", second_job_id="b"),
            actor="worker",
            changes={"state_reason": "two job ids"},
        )
        for i in range(2)
    )
    store.close()
    stuck = jobtrail("--db", db, "explain", op.operation_id)
    assert stuck.returncode == 3 and "a person decides" in stuck.stdout
    # the escalation names both job ids, and each way out is a command that, pasted into a shell as
    # printed, reaches this very ledger (its --db, quoted, included)
    decision = json.loads(jobtrail("--db", db, "ops", "escalation", other.operation_id, "--json").stdout)["decision"]
    assert "a and b" in decision["question"]
    keep = {o["if"].split()[0]: o["then"] for o in decision["options"] if "--job-id" in o["then"]}
    assert sorted(keep) == ["a", "b"]
    pasted = keep["a"].replace("YOUR_NAME", "bob").replace("'...'", "'kept a'")
    shell = subprocess.run(
        ["/bin/sh", "-c", pasted],
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"},
        cwd=tmp_path,  # not where the ledger is: only its --db leads there
        timeout=60,
    )
    assert shell.returncode == 0, shell.stderr
    kept = Store.open(db)
    assert kept.get(other.operation_id).remote_job_id == "a"
    kept.close()
    wrong = jobtrail("--db", db, "resolve", op.operation_id, "--to", "accepted", "--by", "alice", "--reason", "x")
    assert wrong.returncode == 2 and "needs the remote job id the person confirmed" in wrong.stderr
    # a name or a reason shown turned around (or with an invisible character) is no record of who decided why
    for by, why in (("\u202eecila\u202c", "x"), ("alice", "job \u202e00000_boj\u202c"), ("al\u200bice", "x")):
        hidden = jobtrail("--db", db, "resolve", op.operation_id, "--to", "failed", "--by", by, "--reason", why)
        assert hidden.returncode == 2 and "invisible formatting" in hidden.stderr, hidden.stderr
    with Store.open(db) as unchanged:
        assert unchanged.get(op.operation_id).state is S.NEEDS_ATTENTION
    done = jobtrail(
        "--db",
        db,
        "resolve",
        op.operation_id,
        "--to",
        "accepted",
        "--job-id",
        "b",
        "--by",
        "alice",
        "--reason",
        "kept b, cancelled a by hand",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    resolved = json.loads(done.stdout)
    assert resolved["state"] == "accepted" and resolved["remote_job_id"] == "b"
    history = json.loads(jobtrail("--db", db, "ops", "history", op.operation_id, "--json").stdout)["items"]
    assert history[-1]["actor"] == "person:alice" and history[-1]["evidence"]["kind"] == "human_decision"
    assert jobtrail("--db", db, "explain", op.operation_id).returncode == 0


def test_a_decision_for_an_operation_that_waits_for_none_is_refused_and_records_nothing(tmp_path: Path) -> None:
    """resolve is for an operation waiting for a person: on one that ended or that automation carries on it says
    so (a negative answer, exit 1), and a job id given with any decision but accepted is refused, not dropped."""
    db = str(tmp_path / "decide.db")
    store = Store.open(db)
    ops = [
        op_in(store, S.SUCCEEDED, operation_key="done-1"),
        op_in(store, S.ACCEPTED, body={"i": 2}, operation_key="run-1"),
        op_in(store, S.NEEDS_ATTENTION, body={"i": 3}, operation_key="wait-1"),
    ]
    store.close()
    for key, why in (("done-1", "it has ended"), ("run-1", "automation carries it on")):
        ran = jobtrail("--db", db, "resolve", key, "--to", "failed", "--by", "bob", "--reason", "x", "--json")
        assert ran.returncode == 1, ran.stderr
        assert why in ran.stderr and "nothing was recorded" in ran.stderr and "needs_attention" in ran.stderr
        assert json.loads(ran.stdout)["error"]["exit_code"] == 1
    ran = jobtrail("--db", db, "resolve", "wait-1", "--to", "failed", "--job-id", "j1", "--by", "bob", "--reason", "x")
    assert ran.returncode == 2 and "--job-id goes with --to accepted" in ran.stderr
    # a person's job id goes into the same URLs a provider's does, and is held to the same checks
    for job_id, why in (
        ("../../admin", "a . or .. path segment"),
        ("job\n1", "control characters"),
        ("Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.c2lnbmF0dXJlLXZhbHVl", "it carries a credential"),
    ):
        ran = jobtrail(
            "--db", db, "resolve", "wait-1", "--to", "accepted", "--job-id", job_id, "--by", "b", "--reason", "x"
        )
        assert ran.returncode == 2 and why in ran.stderr and "nothing was recorded" in ran.stderr, (job_id, ran.stderr)
        assert "eyJzdWIiOiIxIn0" not in ran.stderr + ran.stdout
    with Store.open(db) as kept:
        assert [kept.get(op.operation_id).version for op in ops] == [op.version for op in ops]


def test_a_command_that_makes_a_new_ledger_says_where(tmp_path: Path) -> None:
    """A typo in --db makes a new ledger instead of finding the one meant: the command says so on stderr,
    once (its stdout stays the answer), and not again on a ledger that exists."""
    db = tmp_path / "jobz.db"
    provider = str(EXAMPLES / "fake.toml")
    first = jobtrail("--db", str(db), "submit", "--provider", provider, "--request", "{}", "--no-send")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("op_")
    assert f"made a new, empty ledger in {db}" in first.stderr and "check --db" in first.stderr
    again = jobtrail("--db", str(db), "ops", "list")
    assert again.returncode == 0 and "made a new" not in again.stderr


def test_ops_list_fits_80_columns_with_states_and_keys_whole(tmp_path: Path) -> None:
    db = str(tmp_path / "ops.db")
    store = Store.open(db)
    ops = [
        op_in(store, S.CANCELLATION_UNCONFIRMED, operation_key="nightly-export-7"),
        op_in(store, S.RESULT_VALIDATION_FAILED, body={"i": 2}, operation_key="q3-summary"),
        op_in(store, S.CREATE_PENDING, body={"i": 3}, operation_key="report-2026-12"),
    ]
    store.close()
    on_a_terminal = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1", "COLUMNS": "80"}
    shown = jobtrail("--db", db, "ops", "list", env=on_a_terminal)
    lines = re.sub(r"\x1b\[[0-9;]*m", "", shown.stdout).splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    for op in ops:
        row = next(line for line in lines if (op.operation_key or "") in line)  # the key, whole
        assert f" {op.state.value} " in row  # the state, whole
    piped = jobtrail("--db", db, "ops", "list", env={"COLUMNS": "80"})  # into a pipe: every id whole
    assert all(op.operation_id in piped.stdout for op in ops)
    history = jobtrail("--db", db, "ops", "history", "nightly-export-7", env=on_a_terminal)
    rows = re.sub(r"\x1b\[[0-9;]*m", "", history.stdout).splitlines()
    assert max(len(line) for line in rows) <= 80, "\n".join(rows)
    assert any(" cancellation_unconfirmed " in line for line in rows)


EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_an_in_memory_ledger_is_refused_on_the_command_line(tmp_path: Path) -> None:
    """One command is one process: a ledger in memory would end with it, a job it sent included (submit sent
    one and kept nothing). Refused with the way out, and no file called ":memory:" looked for or made."""
    for db in (":memory:", "sqlite:///:memory:", "sqlite://"):
        for args in (
            ("ops", "list", "--json"),
            ("submit", "--provider", str(EXAMPLES / "fake.toml"), "--request", "{}"),
        ):
            ran = subprocess.run(
                [sys.executable, "-m", "jobtrail", "--db", db, *args],
                capture_output=True,
                text=True,
                timeout=60,
                cwd=tmp_path,
            )
            assert ran.returncode == 2, (db, args, ran.stdout, ran.stderr)
            assert "a ledger in memory ends with the command" in ran.stderr and "--db" in ran.stderr
            assert "Traceback" not in ran.stderr
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_stops_submit_and_wait_with_what_stays_recorded(tmp_path: Path) -> None:
    """Ctrl-C while submit waits for a provider that is down, or while wait waits: one line saying the
    operation stays recorded for a worker (JSON too under --json), exit 130, and the operation still there."""
    import signal
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    text = (EXAMPLES / "fake.toml").read_text(encoding="utf-8")
    provider = tmp_path / "down.toml"
    provider.write_text(text.replace("http://127.0.0.1:8080", f"http://127.0.0.1:{port}"), encoding="utf-8")
    db = str(tmp_path / "stopped.db")
    for args in (
        ("submit", "--provider", str(provider), "--request", "{}", "--key", "k1", "--json"),
        ("wait", "k1", "--json"),
    ):
        proc = subprocess.Popen(
            [sys.executable, "-m", "jobtrail", "--db", db, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=ctrl_c_as_from_a_terminal,
        )
        # until the command says it waits, and that Ctrl-C stops it (submit: an attempt got no answer; wait: no
        # worker serves it): a Ctrl-C before its start is done (seconds on a slow machine) stops Python instead
        assert proc.stderr is not None
        said = ""
        while "Ctrl-C stops" not in said and (line := proc.stderr.readline()):
            said += line
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        err = said + err
        assert proc.returncode == 130, err
        assert "stopped by Ctrl-C" in err and "jobtrail worker" in err and "Aborted!" not in err
        assert json.loads(out.strip().splitlines()[-1])["error"]["exit_code"] == 130
    with Store.open(db) as kept:
        (op,) = kept.list_operations()
        assert op.operation_key == "k1" and op.state is S.CREATE_PENDING and op.attempts >= 1


def test_submit_says_each_attempt_that_got_no_answer_instead_of_waiting_in_silence(tmp_path: Path) -> None:
    """The provider is not running (the commonest first mistake): submit tries again until the create
    deadline, and says so at each attempt on stderr, naming the provider's address and the way out."""
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    text = (EXAMPLES / "fake.toml").read_text(encoding="utf-8")
    provider = tmp_path / "down.toml"
    provider.write_text(text.replace("http://127.0.0.1:8080", f"http://127.0.0.1:{port}"), encoding="utf-8")
    db = str(tmp_path / "down.db")
    ran = jobtrail("--db", db, "submit", "--provider", str(provider), "--request", "{}", "--create-deadline", "3s")
    assert ran.returncode == 3, ran.stderr  # needs attention: nobody confirmed a job before the deadline
    said = [line for line in ran.stderr.splitlines() if "never left" in line]
    assert len(said) >= 2, ran.stderr
    assert f"http://127.0.0.1:{port}" in said[0] and "create deadline" in said[0] and "jobtrail worker" in said[0]
    attempts = Store.open(db).list_operations(limit=None)[0].attempts
    # once per attempt, not once per look at the record (the last may end at the deadline, with nothing to say)
    assert attempts - 1 <= len(said) <= attempts


def test_a_provider_named_where_its_file_is_meant_gets_the_way_out(tmp_path: Path) -> None:
    """`--provider fake` (the name `ops list --provider` takes) on submit: say a file is meant, and which."""
    ran = jobtrail("--db", str(tmp_path / "p.db"), "submit", "--provider", "fake", "--request", "{}")
    assert ran.returncode == 2
    assert "cannot read provider file fake" in ran.stderr and "such as examples/fake.toml" in ran.stderr


def test_a_ledger_path_in_a_directory_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    """A typo in --db made the directories and a new, empty ledger there, unseen: a write now refuses too,
    naming the directory, as reads did. (The default path's own directory is still made on first use.)"""
    db = tmp_path / "no-such-dir" / "jobs.db"
    ran = jobtrail("--db", str(db), "submit", "--provider", str(EXAMPLES / "fake.toml"), "--request", "{}")
    assert ran.returncode == 2 and f"the directory {db.parent} for the ledger" in ran.stderr
    assert not db.parent.exists()
    data = tmp_path / "home" / "data"
    made = jobtrail(
        *("submit", "--provider", str(EXAMPLES / "fake.toml"), "--request", "{}", "--no-send"),
        env={"JOBTRAIL_DB": "", "XDG_DATA_HOME": str(data)},
    )
    assert made.returncode == 0, made.stderr
    assert (data / "jobtrail" / "jobtrail.db").is_file()


def test_an_empty_listing_says_why_in_one_line(tmp_path: Path) -> None:
    """No table of nothing: an empty ledger, or filters nothing matches, is one line saying which."""
    db = str(tmp_path / "empty.db")
    Store.open(db).close()
    assert jobtrail("--db", db, "ops", "list").stdout.strip() == "no operations in this ledger"
    filtered = jobtrail("--db", db, "ops", "list", "--state", "failed")
    assert filtered.stdout.strip() == "no operations match these filters"


def test_a_printed_command_names_the_ledger_unless_a_bare_command_opens_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Commands printed for a person (start a worker, resolve) carry --db, quoted for a shell, only where a
    bare `jobtrail` would open another ledger."""
    db = tmp_path / "it's here.db"
    with Store.open(str(db)) as store:
        assert store.command == f"jobtrail --db {shlex.quote(str(db))}"
        monkeypatch.setenv("JOBTRAIL_DB", str(db))
        assert store.command == "jobtrail"


def test_reading_commands_answer_while_another_process_holds_the_write_lock(tmp_path: Path) -> None:
    """A worker's long commit, or a person's open `sqlite3` session, holds the file's write lock: an operator
    can still list, show and verify (SQLite's WAL lets readers in), instead of waiting out the busy time-out
    and being told the schema could not be upgraded (it needed no upgrade)."""
    from processes import write_lock_held_elsewhere

    db = str(tmp_path / "ops.db")
    store = Store.open(db)
    op = op_in(store, S.FAILED, body={"i": 1})
    store.close()
    with write_lock_held_elsewhere(db, 60) as holder:
        listed = jobtrail("--db", db, "ops", "list", "--json")
        shown = jobtrail("--db", db, "ops", "show", op.operation_id, "--json")
        verified = jobtrail("--db", db, "audit", "verify", "--json")
        still_held = holder.poll() is None
        holder.kill()
    assert still_held, "the lock was let go before the commands ran: this proves nothing"
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert [item["operation_id"] for item in json.loads(listed.stdout)["items"]] == [op.operation_id]
    assert shown.returncode == 0 and json.loads(shown.stdout)["operation_id"] == op.operation_id, shown.stderr
    assert verified.returncode == 0 and json.loads(verified.stdout)["ok"] is True, verified.stdout + verified.stderr
