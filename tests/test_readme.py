"""The README's Python example runs as written (against a fake provider on a free port)."""

from __future__ import annotations

import re
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


def test_ci_runs_the_readmes_test_command_then_the_long_tier() -> None:
    """`.ci/run` runs the README's test command as written (the fast tier), and the long tier after it."""
    command = re.search(r"Run the tests.*?```sh\n(.*?)\n```", README.read_text(), re.S)
    assert command is not None
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert command.group(1) in ci
    assert ci.index(".venv/bin/python -m pytest --long") > ci.index(command.group(1))
