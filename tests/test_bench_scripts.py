"""The benchmarks README quotes still run: a bench that no longer imports (a helper renamed in src) or
no longer finishes is found here, not by the next person who needs a figure."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
#: the runnable ones (sqlcount.py is a helper the others import)
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if "__main__" in p.read_text())


def _run(*args: str, timeout: float = 120) -> str:
    out = subprocess.run(
        [sys.executable, *args], cwd=BENCH.parent, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, f"{args} exited {out.returncode}:\n{out.stderr[-3000:]}"
    return out.stdout


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_script_imports_and_explains_itself(script: str) -> None:
    assert _run(f"bench/{script}", "--help").strip()


def test_the_lifecycle_bench_finishes_every_life_cycle_and_prints_its_ratios() -> None:
    out = _run("bench/lifecycle.py", "--n", "60")
    assert re.search(r"^plain .*\(60/60 succeeded", out, re.M), out
    assert re.search(r"^jobtrail .*\(60/60 succeeded", out, re.M), out
    assert re.search(r"^ratio: \d+\.\d+ +CPU ratio: \d+\.\d+ +p99 latency ratio: \d+\.\d+$", out, re.M), out
    # the machine's speed beside the absolute CPU figures, read three times (before, between and after)
    speed = re.search(r"^machine speed: a fixed Python loop \(the reference loop\) took (\d+)-(\d+) ms", out, re.M)
    assert speed and 0 < int(speed[1]) <= int(speed[2]), out


def test_the_write_replay_replays_every_write_as_recorded() -> None:
    out = _run("bench/writes.py", "--n", "60", "--replays", "2")
    replay = r"Store\.apply: .* \((\d+) replays of (\d+) writes.*; (\d+) refused as stale, as recorded: (\d+)\)"
    found = re.search(replay, out)
    assert found, out
    replays, writes, refused, recorded = map(int, found.groups())
    assert (replays, refused, recorded) == (2, 0, 0)
    assert writes >= 60 * 5  # a life cycle is several writes: none was lost from the replay
