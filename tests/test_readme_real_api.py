"""The README's walk through a real API runs as written (against OpenAI's contract fake); every example loads."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from jobtrail.providers.contract import guarantees
from jobtrail.providers.kinds import load_provider
from jobtrail.testing._fake_provider import provider_toml
from jobtrail.testing.fakes.openai_batch import BatchPlan, OpenAIBatchFake

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_provider_file_loads_and_states_its_guarantees(example: Path) -> None:
    report = guarantees(load_provider(example))
    assert report["guarantees"]["at-most-once creation"]["verdict"] in ("yes", "no")
    top = example.read_text().split("\n[")[0]  # the top-level keys, before the first table
    assert report["kind"] == (re.search(r'^kind = "([^"]+)"', top, re.M) or ["", "http"])[1]


def _walkthrough() -> list[str]:
    block = re.search(r"A walk through OpenAI's Batch API.*?```sh\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    lines = block.group(1).replace("\\\n", " ").splitlines()
    return [line.split("  #")[0].strip() for line in lines if line.strip()]


def test_the_readme_walk_through_openai_batch_runs_as_written(tmp_path: Path) -> None:
    fake = OpenAIBatchFake(default_plan=BatchPlan(duration_s=0.5)).start()
    try:
        (tmp_path / "examples").mkdir()
        for name in ("openai-file", "openai-batch"):  # the example files, pointed at the fake, polling fast
            config = tomllib.loads((ROOT / "examples" / f"{name}.toml").read_text())
            config |= {"base_url": fake.base_url, "poll": {"initial_s": 0.1, "factor": 1, "cap_s": 0.2}}
            (tmp_path / "examples" / f"{name}.toml").write_text(provider_toml(config))
        requests = [
            {"custom_id": f"r{n}", "method": "POST", "url": "/v1/chat/completions", "body": {"n": n}} for n in range(4)
        ]
        (tmp_path / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
        env = {
            **os.environ,
            "OPENAI_API_KEY": str(fake.api_key),
            "JOBTRAIL_DB": str(tmp_path / "jobs.db"),
            "PWD": str(tmp_path),
        }
        script = ["set -euo pipefail"]
        for line in _walkthrough():
            if line.startswith("export "):
                continue
            if line.startswith("jobtrail worker") and "--until-settled" not in line:
                line += " --until-settled --timeout 60"  # the README's worker runs until stopped
            # the id the reader copies from the upload's result
            script.append(line.replace('"file-..."', '"\'"$file_id"\'"'))
            if line.startswith("jobtrail result upload-1"):
                pick = "import json,sys; print(json.load(sys.stdin)['id'])"
                script.append(f'file_id=$(jobtrail result upload-1 | python -c "{pick}")')
        bin_dir = tmp_path / "bin"  # `jobtrail` and `python` as a reader who installed jobtrail has them
        bin_dir.mkdir()
        (bin_dir / "jobtrail").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m jobtrail "$@"\n')
        (bin_dir / "jobtrail").chmod(0o755)
        (bin_dir / "python").symlink_to(sys.executable)
        env["PATH"] = f"{bin_dir}:{env['PATH']}"
        run = subprocess.run(
            ["bash", "-c", "\n".join(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
        )
        assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
        assert fake.counts["uploads_received"] == 1 and fake.counts["batches_created"] == 1
        assert fake.counts["shape_errors"] == 0
        (batch,) = fake.batches.values()
        uploaded = [f.id for f in fake.files.values() if f.filename.startswith("jobtrail-")]
        assert batch.body["input_file_id"] == uploaded[0] and len(uploaded) == 1
        assert batch.body["metadata"]["team"] == "search" and "jobtrail_token" in batch.body["metadata"]
        kept = (tmp_path / "results.jsonl").read_bytes()
        assert sorted(json.loads(line)["custom_id"] for line in kept.splitlines()) == ["r0", "r1", "r2", "r3"]
    finally:
        fake.stop()
