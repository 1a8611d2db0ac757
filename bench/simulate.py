"""Run the deterministic simulation over many seeds and print the figures.

    python bench/simulate.py                 # 10,000 seeds
    python bench/simulate.py --seeds 50000 --start 10000

A failing seed prints the one command that replays it. See jobtrail/testing/simulation.py.
"""

from __future__ import annotations

import sys

from jobtrail.testing.simulation import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(arg.startswith("--seed") for arg in argv):
        argv = ["--seeds", "10000", *argv]
    raise SystemExit(main(argv))
