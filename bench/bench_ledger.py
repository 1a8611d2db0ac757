"""Cost of one ledger transition on SQLite (and PostgreSQL if given).

    python bench/bench_ledger.py                      # SQLite in a temp dir
    python bench/bench_ledger.py --db postgresql://postgres@127.0.0.1:5432/test
    strace -f -c -e trace=fsync,fdatasync python bench/bench_ledger.py --only single --n 2000

Prints transitions per second for a single writer (one transaction per
transition) and for batches (many operations' transitions in one transaction),
with SQL statements and commits per transition counted at the driver.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import sqlalchemy as sa
from sqlalchemy import event

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from jobtrail import CreateAttempt, OperationSpec, Store
from jobtrail.ledger.store import Change


class Counter:
    def __init__(self, engine: sa.Engine) -> None:
        self.statements = 0
        self.commits = 0
        event.listen(engine, "before_cursor_execute", self._stmt)
        event.listen(engine, "commit", self._commit)

    def _stmt(self, *args: object) -> None:
        self.statements += 1

    def _commit(self, *args: object) -> None:
        self.commits += 1

    def reset(self) -> None:
        self.statements = self.commits = 0


def make_ops(store: Store, n: int) -> list:
    return [
        store.create_operation(OperationSpec(provider="bench", target="t", endpoint="POST /x", body={"i": i}))[0]
        for i in range(n)
    ]


def single(store: Store, counter: Counter, n: int) -> None:
    ops = make_ops(store, n)
    counter.reset()
    latencies = []
    start = time.perf_counter()
    for op in ops:
        t0 = time.perf_counter()
        store.record(op, CreateAttempt(attempt=1), actor="bench", changes={"attempts": 1})
        latencies.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    print(
        f"single writer : {n / elapsed:8.0f} transitions/s  "
        f"p50 {statistics.median(latencies) * 1e3:.2f} ms  "
        f"p99 {sorted(latencies)[int(len(latencies) * 0.99)] * 1e3:.2f} ms  "
        f"{counter.statements / n:.1f} statements and {counter.commits / n:.2f} commits per transition"
    )


def batched(store: Store, counter: Counter, n: int, size: int) -> None:
    ops = make_ops(store, n)
    counter.reset()
    start = time.perf_counter()
    for i in range(0, n, size):
        store.apply(
            [
                Change(op=op, evidence=CreateAttempt(attempt=1), actor="bench", changes={"attempts": 1})
                for op in ops[i : i + size]
            ]
        )
    elapsed = time.perf_counter() - start
    print(
        f"batch of {size:<4} : {n / elapsed:8.0f} transitions/s  "
        f"{counter.statements / n:.2f} statements and {counter.commits / n:.3f} commits per transition"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", help="database URL or path (default: a temp SQLite file)")
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--only", choices=["single", "batch"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.open(args.db or os.path.join(tmp, "bench.db"))
        counter = Counter(store.engine)
        print(f"engine: {store.dialect}, n = {args.n}")
        if args.only in (None, "single"):
            single(store, counter, args.n)
        if args.only in (None, "batch"):
            for size in (10, 100):
                batched(store, counter, args.n, size)
        store.close()


if __name__ == "__main__":
    main()
