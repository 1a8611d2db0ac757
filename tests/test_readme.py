"""The README's Python example and its shell walk-through run as written (against a fake provider on a free
port)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jobtrail.testing import FakeProvider

README = Path(__file__).parent.parent / "README.md"


def test_the_readme_python_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = re.search(r"## In Python.*?```python\n(.*?)```", README.read_text(), re.S)
    assert code is not None
    fake = FakeProvider().start()
    try:
        provider = tmp_path / "fake.toml"
        example = (Path(__file__).parent.parent / "examples" / "fake.toml").read_text()
        provider.write_text(example.replace("http://127.0.0.1:8080", fake.base_url))
        source = (
            code.group(1)
            .replace("examples/fake.toml", str(provider))
            .replace('"jobs.db"', repr(str(tmp_path / "jobs.db")))
        )
        monkeypatch.chdir(tmp_path)
        exec(compile(source, "README.md", "exec"), {"__name__": "readme"})
    finally:
        fake.stop()
    assert fake.counts["jobs_created"] == 1 and fake.counts["cancels"] == 1


def test_the_readmes_shell_walk_through_runs_line_by_line_to_a_verified_ledger(tmp_path: Path) -> None:
    """Every line of "From the shell"'s first block, copied as it is, succeeds: one job from submit to result."""
    block = re.search(r"## From the shell.*?```sh\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    starts_fake, *commands = [line for line in lines if line]
    assert starts_fake.startswith("python -m jobtrail.testing.provider --port 8080")
    assert all(line.startswith("jobtrail ") for line in commands)
    fake = FakeProvider().start()
    try:
        examples = tmp_path / "examples"
        examples.mkdir()
        example = (Path(__file__).parent.parent / "examples" / "fake.toml").read_text()
        (examples / "fake.toml").write_text(example.replace("http://127.0.0.1:8080", fake.base_url))
        outputs = []
        for line in commands:
            argv = [sys.executable, "-m", "jobtrail", *shlex.split(line)[1:]]
            done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
            outputs.append(done.stdout)
    finally:
        fake.stop()
    assert fake.counts["jobs_created"] == 1
    assert '"state": "succeeded"' in "".join(outputs)
    assert outputs[-1].startswith("OK 1 operations")


def test_ci_runs_the_readmes_test_command_then_the_long_tier() -> None:
    """`.ci/run` runs the README's test command as written (the fast tier), and the long tier after it."""
    command = re.search(r"Run the tests.*?```sh\n(.*?)\n```", README.read_text(), re.S)
    assert command is not None
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert command.group(1) in ci
    assert ci.index(".venv/bin/python -m pytest --long") > ci.index(command.group(1))
