"""The credential check of a long request body (a prompt), per 64 KiB.

    python bench/redaction.py [--kib 64] [--repeat 20]

Every request body is checked before it is stored (``Redactor.secret_paths``): a
registered credential in any encoding, or a known secret format in the text or in
any decoding of it. The text is prose of the README's own words in random order
(seeded), so that words repeat as in real prose and some are hints ("token",
"basic", "digest"); it is checked with no credential registered and with one.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time
from pathlib import Path

from jobtrail.domain.redact import Redactor


def prose(kib: int, seed: int = 1) -> str:
    words = re.findall(r"[A-Za-z]+", (Path(__file__).parent.parent / "README.md").read_text())
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < kib * 1024:
        word = rng.choice(words)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[: kib * 1024]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    text = prose(args.kib)
    for registered in (False, True):
        redactor = Redactor()
        if registered:
            redactor.register("sk-live-4f9a8b7c6d5e4f3a2b1c")
        times = []
        for i in range(args.repeat):
            body = {"prompt": f"{text} {i}"}  # a new text each time: short texts' verdicts are remembered
            started = time.perf_counter()
            found = redactor.secret_paths(body)
            times.append(time.perf_counter() - started)
            assert found == [], found
        print(
            f"{args.kib} KiB of prose, {'one credential' if registered else 'no credential'} registered: "
            f"median {statistics.median(times) * 1000:.1f} ms, best {min(times) * 1000:.1f} ms per check"
        )


if __name__ == "__main__":
    main()
