"""The README's reference tables are what the code says, and the declarations they come from are the
ones the code uses: the provider-file parser, the fake provider, the exit codes, the JSON shapes."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import get_args

import pytest

from jobtrail import Store
from jobtrail.domain.errors import ConfigError
from jobtrail.interfaces import reference, shapes
from jobtrail.interfaces.cli.common import EXIT_CODES
from jobtrail.providers import declared, webhooks
from jobtrail.providers.declared import DEFAULT_STATES, parse_config
from jobtrail.providers.file_keys import DECLARED, KEYS, NORMAL_STATES
from jobtrail.runtime import tasks
from jobtrail.testing import FakeProvider
from jobtrail.testing import _fake_provider as fake_module

from helpers import S, op_in

README = Path(__file__).parent.parent / "README.md"


def test_the_readme_tables_are_what_the_code_generates() -> None:
    text = README.read_text(encoding="utf-8")
    assert reference.regenerate(text) == text, f"the README's reference tables are stale: run `{reference.COMMAND}`"


def test_every_declared_key_is_one_the_parser_reads() -> None:
    """The other way round is enforced as the file is read: the parser cannot read an undeclared key."""
    source = inspect.getsource(declared) + inspect.getsource(webhooks)
    unread = [f"[{k.table}] {k.name}" for k in KEYS if k.name != "kind" and f'"{k.name}"' not in source]
    assert unread == [] and tuple(DEFAULT_STATES) == NORMAL_STATES
    config = parse_config({"name": "x", "base_url": "https://api.example.com", "create": {"path": "/jobs"}})
    defaults = {(k.table, k.name): k.default for k in KEYS}
    assert config.timeout_s == float(defaults[("", "timeout_s")])
    assert config.connect_timeout_s == float(defaults[("", "connect_timeout_s")])
    assert config.max_connections == int(defaults[("", "max_connections")])
    assert (config.job_id, config.state_path) == (defaults[("create", "job_id")], defaults[("status", "state")])
    assert config.trace_header == defaults[("", "trace_header")]
    assert config.poll_backoff.initial_s == float(defaults[("poll", "initial_s")])


@pytest.mark.parametrize(
    ("data", "table"),
    [
        ({"timeout": 3}, ""),
        ({"create": {"path": "/jobs", "idempotency": "x"}}, "create"),
        (
            {"status": {"path": "/jobs/{job_id}", "rules": [{"if": "$.error", "state": "failed", "then": 1}]}},
            "status.rules[]",
        ),
    ],
)
def test_an_undeclared_key_is_refused_with_the_declared_ones(data: dict[str, object], table: str) -> None:
    base = {"name": "x", "base_url": "https://api.example.com", "create": {"path": "/jobs"}}
    with pytest.raises(ConfigError) as refused:
        parse_config(base | data, "p.toml")
    assert "unknown key" in str(refused.value)
    assert "the keys there are: " + ", ".join(sorted(DECLARED[table])) in str(refused.value)


def test_the_fake_providers_options_are_the_declared_ones() -> None:
    source = inspect.getsource(fake_module)
    used = set(re.findall(r'(?:options|opts)\.get\("(\w+)"', source))
    declared_options = {name for name, *_ in fake_module.FAKE_OPTIONS}
    assert used == declared_options
    fake = FakeProvider().start()
    try:
        body = json.dumps({"fake": {"cancle": "ignore"}}).encode()
        sent = urllib.request.Request(
            f"{fake.base_url}/v1/jobs", data=body, method="POST", headers={"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(sent, timeout=10)
        assert refused.value.code == 400 and "unknown fake option 'cancle'" in refused.value.read().decode()
    finally:
        fake.stop()
    assert fake.counts["jobs_created"] == 0


def test_the_shapes_name_the_codes_states_and_exit_codes() -> None:
    assert [code for code, _ in EXIT_CODES] == [0, 1, 2, 3, 4, 130]
    assert get_args(shapes.StepState) == (
        tasks.PLANNED,
        tasks.BLOCKED,
        tasks.SUBMITTED,
        tasks.CONFIRMED,
        tasks.FAILED,
        tasks.UNRESOLVED,
    )


def test_explain_exits_3_exactly_when_a_person_must_decide(db_url: str) -> None:
    """needs_attention, an unconfirmed cancel, a timed-out result: 3; any other answer, an ending too: 0."""
    expected = {S.NEEDS_ATTENTION: 3, S.CANCELLATION_UNCONFIRMED: 3, S.RESULT_TIMED_OUT: 3, S.FAILED: 0}
    with Store.open(db_url) as store:
        ids = {state: op_in(store, state).operation_id for state in expected}
    for state, code in expected.items():
        done = subprocess.run(
            [sys.executable, "-m", "jobtrail", "--db", db_url, "explain", ids[state], "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == code, (state, done.stderr)
        assert json.loads(done.stdout)["state"] == state.value
