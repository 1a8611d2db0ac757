"""What an operator relies on at the command line when they get something wrong: one line that says what
is wrong and what to do, the documented exit code, JSON where JSON was asked for, no ledger made by
mistake, and a cancel that says honestly what will happen. Real processes, a real fake provider on
loopback; the checks read the ledger and count what the provider saw."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from jobtrail import Store
from jobtrail.domain.states import State
from jobtrail.testing import FakeProvider

from processes import assert_audit_verifies, cli, finish, jobtrail, start_worker, write_provider

SETTLE = ("--until-settled", "--timeout", "90", "--lease", "7")


def one_line_error(stderr: str) -> str:
    """The error a user sees: exactly one line, never a traceback."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def json_lines(stderr: str) -> list[dict[str, object]]:
    """Every stderr line of a command run with --log-format json, each parsed (a line that is not JSON fails)."""
    return [json.loads(line) for line in stderr.splitlines() if line.strip()]


# -- a --db that cannot be read ---------------------------------------------------------------------------


@pytest.mark.parametrize("url", ["postgresql://alice:s3cret-pw@127.0.0.1:notaport/jobs", "postgresql://alice@[::1"])
def test_a_db_url_typo_is_one_line_with_the_way_out_and_never_the_password(url: str) -> None:
    done = cli("--db", url, "ops", "list")
    assert done.returncode == 2
    line = one_line_error(done.stderr)
    assert "is not a database URL" in line and "postgresql://HOST:PORT/DBNAME" in line
    assert "s3cret-pw" not in done.stdout + done.stderr


def test_a_db_url_typo_under_json_is_the_error_object() -> None:
    done = cli("--db", "postgresql://alice@127.0.0.1:notaport/jobs", "ops", "list", "--json")
    assert done.returncode == 2
    assert json.loads(done.stdout)["error"]["exit_code"] == 2


def test_a_worker_with_a_db_url_typo_logs_one_json_line(tmp_path: Path, fake: FakeProvider) -> None:
    provider = write_provider(tmp_path / "fake.toml", fake)
    typo = "postgresql://alice@127.0.0.1:notaport/jobs"
    done = cli("--db", typo, "worker", "--provider", str(provider), "--log-format", "json")
    assert done.returncode == 2
    (line,) = json_lines(done.stderr)
    assert line["level"] == "error" and "is not a database URL" in str(line["message"])


# -- provider files ---------------------------------------------------------------------------------------


def test_a_provider_file_typo_leaves_no_new_ledger_behind(tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    code, _out, err = jobtrail(str(db), "submit", "--provider", str(tmp_path / "nope.toml"), "--request", "{}")
    assert code == 2
    assert "nope.toml" in one_line_error(err)
    assert not db.exists()


def test_a_provider_file_that_is_not_text_is_named_as_the_problem(tmp_path: Path) -> None:
    binary = tmp_path / "provider.toml"
    binary.write_bytes(b"\xff\xfe\x00n\x00a\x00m\x00e")  # saved as UTF-16, say
    checked = cli("providers", "check", str(binary))
    assert checked.returncode == 2
    assert f"{binary}: not UTF-8 text" in one_line_error(checked.stderr)
    db = tmp_path / "jobs.db"
    code, _out, err = jobtrail(str(db), "submit", "--provider", str(binary), "--request", "{}")
    assert code == 2 and "not UTF-8 text" in one_line_error(err) and not db.exists()


# -- errors as the reader asked for them ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["worker", "--log-format", "json"], {}),  # --provider missing
        (["worker", "--provider", "x.toml", "--log-format=json", "--concurrency", "0"], {}),
        (["worker"], {"JOBTRAIL_LOG_FORMAT": "json"}),
    ],
)
def test_a_usage_error_under_log_format_json_is_a_json_line(
    tmp_path: Path, args: list[str], env: dict[str, str]
) -> None:
    done = cli("--db", str(tmp_path / "jobs.db"), *args, env=env)
    assert done.returncode == 2
    (line,) = json_lines(done.stderr)
    assert line["level"] == "error" and (
        "--provider" in str(line["message"]) or "--concurrency" in str(line["message"])
    )


def test_debug_shows_the_traceback_of_an_unknown_operation(tmp_path: Path) -> None:
    db = tmp_path / "jobs.db"
    Store.open(str(db)).close()
    plain = cli("--db", str(db), "ops", "show", "op_nope")
    assert plain.returncode == 1 and "no operation" in one_line_error(plain.stderr)
    debug = cli("--db", str(db), "--debug", "ops", "show", "op_nope")
    assert "Traceback" in debug.stderr and "OperationNotFound" in debug.stderr


# -- cancel says what will happen -------------------------------------------------------------------------


def test_a_cancel_before_anything_was_sent_withdraws_the_create(tmp_path: Path, fake: FakeProvider) -> None:
    """Found by a probe: a person's cancel of a planned operation (no attempt recorded) did not withdraw it; the
    next worker created the remote job, then cancelled it (1 job, 1 cancel), and nothing could stop that. An
    attempt is durable before its send, so none had left: the operation is cancelled at once, and nothing
    is ever sent."""
    db = str(tmp_path / "jobs.db")
    provider = write_provider(tmp_path / "fake.toml", fake)
    code, out, _ = jobtrail(db, "submit", "--provider", str(provider), "--request", '{"p": 1}', "--no-send")
    assert code == 0
    op_id = out.strip()
    code, out, err = jobtrail(db, "cancel", op_id, "--by", "alice", "--reason", "not needed", "--json")
    assert code == 0, err
    said = json.loads(out)
    assert said["outcome"] == "withdrawn" and said["operation"]["state"] == "cancelled"
    code, _, err = finish(start_worker(db, provider, "w1", *SETTLE))
    assert code == 0, err
    with Store.open(db) as store:
        op = store.get(op_id)
        assert op.state is State.CANCELLED and op.attempts == 0 and op.remote_job_id is None
        assert [e.to_json()["evidence"]["kind"] for e in store.history(op_id)][-1] == "cancel_intent"
    assert fake.counts["creates_received"] == 0 and fake.counts.get("cancels", 0) == 0
    code, out, err = jobtrail(db, "explain", op_id, "--json")
    assert code == 0, err
    assert json.loads(out)["cancel"]["standing"] == "withdrawn", out  # not "the provider confirmed it"
    assert_audit_verifies(db)


def test_a_cancel_of_an_operation_that_needs_a_person_exits_3(tmp_path: Path, fake: FakeProvider) -> None:
    """A provider that cannot reconcile, a worker that dies after the create: needs_attention. A cancel then
    is recorded, nothing is sent, and the exit code says a person must decide (as explain and wait do)."""
    db = str(tmp_path / "jobs.db")
    tokenless = {"create": {"token": {"in": "none"}}, "reconcile": {"modes": []}}
    provider = write_provider(tmp_path / "fake.toml", fake, **tokenless)
    code, out, _ = jobtrail(db, "submit", "--provider", str(provider), "--request", '{"p": 2}', "--no-send")
    op_id = out.strip()
    env = {"JOBTRAIL_FAILPOINTS": "create.after_response=exit"}
    code, _, _ = finish(start_worker(db, provider, "doomed", *SETTLE, env=env))
    assert code == 137
    code, _, err = finish(start_worker(db, provider, "w2", *SETTLE))
    assert code == 0, err
    with Store.open(db) as store:
        assert store.get(op_id).state is State.NEEDS_ATTENTION
    code, out, err = jobtrail(db, "cancel", op_id, "--by", "alice", "--reason", "stop", "--json")
    assert code == 3, err
    assert json.loads(out)["operation"]["state"] == "needs_attention"
    assert "resolve" in err
    assert fake.counts["jobs_created"] == 1 and fake.counts.get("cancels", 0) == 0


# -- the ledger an operator points at ---------------------------------------------------------------------


@pytest.mark.long  # it waits out the 30 s busy time-out
def test_a_ledger_held_by_another_writer_is_waited_for_and_then_said(tmp_path: Path, fake: FakeProvider) -> None:
    """A SQLite write lock held for longer than the busy time-out: a read still answers, a submit says who to
    stop, exits 2, and records nothing."""
    db = tmp_path / "jobs.db"
    Store.open(str(db)).close()
    provider = write_provider(tmp_path / "fake.toml", fake)
    holder = sqlite3.connect(db, isolation_level=None, timeout=0)
    holder.execute("BEGIN IMMEDIATE")
    try:
        listed = cli("--db", str(db), "ops", "list", "--json")
        assert listed.returncode == 0 and json.loads(listed.stdout)["total"] == 0
        code, _out, err = jobtrail(
            str(db), "submit", "--provider", str(provider), "--request", "{}", "--no-send", timeout=120
        )
        assert code == 2 and "locked" in one_line_error(err)
    finally:
        holder.rollback()
        holder.close()
    with Store.open(str(db)) as store:
        assert store.count_operations() == 0


def test_a_submit_whose_credential_is_not_set_records_nothing(tmp_path: Path, fake: FakeProvider) -> None:
    """The credential's variable forgotten in this shell: said at once, with the way out, before anything is
    recorded (a recorded attempt that never left would be taken for a create that may have arrived)."""
    db = tmp_path / "jobs.db"
    provider = write_provider(tmp_path / "fake.toml", fake, credential="env:JT_PROBE_UNSET_KEY", auth="bearer")
    code, _out, err = jobtrail(
        str(db), "submit", "--provider", str(provider), "--request", "{}", env={"JT_PROBE_UNSET_KEY": ""}
    )
    assert code == 2
    line = one_line_error(err)
    assert "JT_PROBE_UNSET_KEY is not set" in line and "nothing was recorded" in line and "--no-send" in line
    assert not db.exists() and fake.counts.get("creates_received", 0) == 0


def test_an_empty_db_is_refused_not_taken_for_the_default(tmp_path: Path) -> None:
    """`--db "$LEDGER"` with the variable unset: an error, never the default ledger in the home directory."""
    done = cli("--db", "", "ops", "list", "--json", env={"HOME": str(tmp_path)})
    assert done.returncode == 2
    assert "--db" in json.loads(done.stdout)["error"]["message"]
    assert not (tmp_path / ".local").exists()


def test_a_value_nothing_refused_still_ends_in_one_line_not_a_traceback(tmp_path: Path, fake: FakeProvider) -> None:
    """TOML has `inf`; a provider file's time-out of inf passed the checks and made `submit` print a
    traceback. Whatever refuses it (the provider file's checks, or the command line's last resort), the
    user reads a line that says what to do."""
    provider = write_provider(tmp_path / "fake.toml", fake)
    provider.write_text(provider.read_text().replace("timeout_s = 2.0", "timeout_s = inf"), encoding="utf-8")
    code, _out, err = jobtrail(str(tmp_path / "jobs.db"), "submit", "--provider", str(provider), "--request", "{}")
    assert code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("jobtrail: ") and ("timeout_s" in last or "--debug" in last)
