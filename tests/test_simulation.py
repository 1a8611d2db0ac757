"""The deterministic simulation: 1,000 seeded fault schedules, zero invariant violations, exact replays.

The fast tier runs the first 50 seeds (10 on PostgreSQL) with every check below; the long tier
(``pytest --long``) runs the other 950 (90), so CI covers all 1,000 once.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
from conftest import PG_URL, require_pg

from jobtrail.testing.simulation import run_seed, run_seeds

#: CI runs this many seeds (the issue asks for at least 1,000); 10,000+: bench/simulate.py
SEEDS = 1000
#: the fast tier's seeds; the long tier runs the rest in chunks of CHUNK
FAST_SEEDS = 50
CHUNK = 125
#: and this many on PostgreSQL (a schema each, so slower), FAST_PG_SEEDS of them in the fast tier
PG_SEEDS = 100
FAST_PG_SEEDS = 10

long = pytest.mark.long
CHUNKS = [
    pytest.param(range(0, FAST_SEEDS), id=f"0-{FAST_SEEDS}"),
    *(
        pytest.param(range(start, min(start + CHUNK, SEEDS)), id=f"{start}-{min(start + CHUNK, SEEDS)}", marks=long)
        for start in range(FAST_SEEDS, SEEDS, CHUNK)
    ),
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("seeds", CHUNKS)
def test_every_seed_keeps_every_invariant(seeds: range) -> None:
    reports = run_seeds(seeds)
    failures = [
        f"seed {r.seed}: {'; '.join(r.violations)}\n  replay: {r.replay_command()}" for r in reports if r.violations
    ]
    assert not failures, "\n".join(failures)
    # the schedules really are hostile: crashes happened and every kind of ending was reached
    assert sum(r.crashes for r in reports) > len(seeds)
    assert sum(r.stale for r in reports) > 0, "some worker lost its lease and had its writes refused"
    seen = sum((r.faults for r in reports), Counter())
    assert seen["webhooks_duplicate"] > 0 and seen["webhooks_forged"] > 0 and seen["replayed"] > 0
    assert seen["slow_answers"] > 0
    endings = set().union(*(r.final for r in reports))
    assert {"succeeded", "cancelled", "failed", "needs_attention", "result_unavailable"} <= endings


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "seeds",
    [
        pytest.param(range(0, FAST_PG_SEEDS), id=f"0-{FAST_PG_SEEDS}"),
        pytest.param(range(FAST_PG_SEEDS, PG_SEEDS), id=f"{FAST_PG_SEEDS}-{PG_SEEDS}", marks=long),
    ],
)
def test_seeds_on_postgresql_keep_every_invariant_and_replay_exactly(seeds: range) -> None:
    """The same schedules against PostgreSQL (SKIP LOCKED claims, its own SQL): a schema per seed."""
    require_pg()
    reports = run_seeds(seeds, db=PG_URL)
    failures = [
        f"seed {r.seed}: {'; '.join(r.violations)}\n  replay: {r.replay_command()}" for r in reports if r.violations
    ]
    assert not failures, "\n".join(failures)
    replayed = seeds[len(seeds) // 2]
    assert run_seed(replayed, db=PG_URL).trace == next(r.trace for r in reports if r.seed == replayed)


def test_a_seed_replays_exactly() -> None:
    """Same seed, same schedule: every request, answer, crash and clock move is the same."""
    for seed in (17, 101, 977):
        first, second = run_seed(seed), run_seed(seed)
        assert first.trace == second.trace
        assert first.trace_hash == second.trace_hash
        assert first.final == second.final
    assert run_seed(17).trace != run_seed(18).trace


def test_the_checker_catches_a_provider_that_silently_ignores_tokens() -> None:
    """The invariants can fail: with keys ignored, replays make second jobs and the checker says so.

    (Forty seeds: since a stored answer settles an attempt without a replay, fewer seeds replay at all.)"""
    reports = [run_seed(seed, ignore_keys=True) for seed in range(40)]
    caught = [r for r in reports if any("remote jobs" in v for v in r.violations)]
    assert len(caught) >= 3
    assert caught[0].replay_command().endswith(f"--seed {caught[0].seed} --ignore-keys --verbose")


def test_a_failing_seed_prints_the_command_that_replays_it() -> None:
    seed = next(s for s in range(20) if run_seed(s, ignore_keys=True).violations)
    done = subprocess.run(
        [sys.executable, "-m", "jobtrail.testing.simulation", "--seed", str(seed), "--ignore-keys"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    replay = next(line.split("replay: ", 1)[1] for line in done.stderr.splitlines() if "replay: " in line)
    assert replay == f"python -m jobtrail.testing.simulation --seed {seed} --ignore-keys --verbose"
    again = subprocess.run([sys.executable, *replay.split()[1:]], capture_output=True, text=True, timeout=120)
    assert again.returncode == 1
    violations = [line for line in done.stderr.splitlines() if line.startswith("  - ")]
    assert violations and all(v.split("(op_")[0] in again.stderr for v in violations)
