"""K worker processes on one PostgreSQL ledger: does throughput grow with K, and at what cost per operation?

    python bench/scale.py --n 5000
    python bench/scale.py --n 2000 --workers 1,2,4 --latency-ms 20 --max-connections 10

The fake provider runs in its own process and answers every API request after a
fixed delay (``--latency-ms``, a remote provider's round trip); each job finishes
1 s after creation. For each K the ledger is a fresh database: N operations are
submitted (``submit_many``, 500 a commit), then K processes each run one Worker
(polls every 0.25 s, ``--max-connections`` HTTP connections each) until every
operation is settled. The clock starts once all K processes are ready (imports
and connections done) and stops when the last one ends. CPU, SQL statements,
round trips and commits are counted inside the worker processes only (the
submits are reported apart); a takeover is a write refused because another
worker's newer lease fenced it (``Worker.stats.stale`` counts those and a
person's changes alike).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so lifecycle's helpers are shared, not copied

from lifecycle import POLL_S, _counts, _free_port, provider_config
from sqlcount import add_counts, children_counts, count_in_children, count_sql

CHUNK = 500


def _cpu_s() -> float:
    """Every thread of this process (the store's I/O threads too) and its writer process once it ended."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _ticks(pid: int | None = None) -> tuple[int, int]:
    """(busy, total) clock ticks of the machine, or (CPU ticks, 0) of one process: to see who saturated the cores."""
    if pid is not None:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12]), 0
    cpu = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(cpu) - cpu[3] - cpu[4], sum(cpu)  # idle and iowait are not busy


# -- one worker process -----------------------------------------------------------------------------


def child(base: str, db: str, worker_id: str, max_connections: int, concurrency: int, in_process: bool) -> None:
    import jobtrail.runtime.worker as worker_module
    from jobtrail import Store
    from jobtrail.flows.telemetry import lease_taken_over as taken_over
    from jobtrail.providers.http import load_provider
    from jobtrail.runtime.loop import run as run_loop
    from jobtrail.runtime.worker import Worker

    takeovers = 0

    def counted_takeover(op: Any) -> None:
        nonlocal takeovers
        takeovers += 1
        taken_over(op)

    # the worker calls it when a newer lease fenced its write
    worker_module.lease_taken_over = counted_takeover  # type: ignore[attr-defined]
    sql = count_sql(db)
    in_children = count_in_children(db)  # the worker's writer process
    store = Store.open(db)
    config = provider_config(base, max_connections)
    worker = Worker(
        store,
        {"fake": load_provider(config)},
        worker_id=worker_id,
        concurrency=concurrency,
        lease_s=120,
        batch=1000,
        writer_process=not in_process,
    )
    print("ready", flush=True)
    sys.stdin.readline()  # the parent's go: every process starts at once
    before = dict(sql)
    cpu0 = _cpu_s()
    stats = run_loop(worker.run(until_settled=True))  # as `jobtrail worker` runs it
    ended = time.monotonic()  # CLOCK_MONOTONIC is system-wide: the parent compares it with its own start
    cpu = _cpu_s() - cpu0
    after = add_counts(sql, children_counts(in_children))  # the writer process has ended with the run
    store.close()
    out = {
        "ended": ended,
        "cpu_s": cpu,
        "sql": {k: after[k] - before[k] for k in after},
        "claimed": stats.claimed,
        "claims": stats.claims,
        "stale": stats.stale,
        "takeovers": takeovers,
        "errors": stats.errors,
        "lease_too_short": stats.lease_too_short,
        "settled": stats.settled,
    }
    print(json.dumps(out), flush=True)


# -- one K ----------------------------------------------------------------------------------------------


def _admin(db: str, statement: str) -> None:
    import psycopg

    with psycopg.connect(db, autocommit=True) as conn:  # CREATE/DROP DATABASE refuse to run in a transaction
        conn.execute(statement)


def _submit(db: str, base: str, n: int, max_connections: int) -> dict[str, int]:
    from jobtrail import AsyncJobtrail, Store

    store = Store.open(db)  # creates the tables: the fresh database is the reset ledger
    sql = count_sql(db)

    async def run() -> None:
        jt = AsyncJobtrail(store=store, providers=[provider_config(base, max_connections)])
        for start in range(0, n, CHUNK):
            await jt.submit_many("fake", [{"i": i} for i in range(start, min(n, start + CHUNK))])

    asyncio.run(run())
    store.close()
    return dict(sql)


def _run_workers(k: int, args: argparse.Namespace, base: str, db: str) -> tuple[float, list[dict[str, Any]]]:
    """Start K worker processes, let them go at once, and collect their reports."""
    with contextlib.ExitStack() as stack:
        logs = [stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in range(k)]
        procs = [
            subprocess.Popen(
                [
                    *(sys.executable, __file__, "--child", "--base", base, "--db", db),
                    *("--worker-id", f"scale-{k}-{i}", "--max-connections", str(args.max_connections)),
                    *("--concurrency", str(args.concurrency)),
                    *(["--writes-in-process"] if args.writes_in_process else []),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
            for i, log in enumerate(logs)
        ]
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise SystemExit(f"a worker did not start: {proc.wait()}")
        t0 = time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reports = []
        for proc, log in zip(procs, logs, strict=True):
            assert proc.stdout is not None
            out = proc.stdout.read()
            if proc.wait() != 0:
                for other in procs:  # the rest would wait for operations nobody works
                    other.kill()
                log.seek(0)
                raise SystemExit(f"a worker failed:\n{log.read()[-3000:]}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    return t0, reports


def run_k(k: int, args: argparse.Namespace, base: str, fake_pid: int) -> dict[str, Any]:
    import sqlalchemy as sa

    name = f"jobtrail_scale_{k}"
    db = sa.engine.make_url(args.db).set(database=name).render_as_string(hide_password=False)
    _admin(args.db, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    _admin(args.db, f"CREATE DATABASE {name}")
    try:
        # the submits run in a process of their own so the driver counts of the next K start from nothing
        submit = subprocess.run(
            [sys.executable, __file__, "--submit", "--base", base, "--db", db, "--n", str(args.n)],
            capture_output=True,
            text=True,
            check=False,
        )
        if submit.returncode != 0:
            raise SystemExit(f"submit failed:\n{submit.stderr[-3000:]}")
        submit_sql = json.loads(submit.stdout.strip().splitlines()[-1])
        before, fake0, machine0 = _counts(base), _ticks(fake_pid), _ticks()
        t0, reports = _run_workers(k, args, base, db)
        after, fake1, machine1 = _counts(base), _ticks(fake_pid), _ticks()
        engine = sa.create_engine(db.replace("postgresql://", "postgresql+psycopg://", 1))
        with engine.connect() as conn:
            states: dict[str, int] = dict(
                conn.execute(sa.text("SELECT state, count(*) FROM operations GROUP BY state")).all()
            )
        engine.dispose()
    finally:
        _admin(args.db, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    wall = max(r["ended"] for r in reports) - t0
    http = sum(after.get(c, 0) - before.get(c, 0) for c in ("creates_received", "status", "results"))
    total = {key: sum(r[key] for r in reports) for key in ("cpu_s", "claimed", "claims", "stale", "takeovers")}
    return {
        "k": k,
        "wall_s": wall,
        "http": http,
        "fake_cpu": (fake1[0] - fake0[0]) / os.sysconf("SC_CLK_TCK") / wall,
        "busy": (machine1[0] - machine0[0]) / max(1, machine1[1] - machine0[1]),
        **total,
        "errors": sum(r["errors"] + r["lease_too_short"] for r in reports),
        "sql": {key: sum(r["sql"][key] for r in reports) for key in reports[0]["sql"]},
        "submit_sql": submit_sql,
        "creates": after.get("jobs_created", 0) - before.get("jobs_created", 0),
        "creates_received": after.get("creates_received", 0) - before.get("creates_received", 0),
        "succeeded": int(states.get("succeeded", 0)),
        "states": states,
    }


def _line(r: dict[str, Any], n: int) -> str:
    sql = r["sql"]
    return (
        f"{r['k']:>2} {r['wall_s']:7.1f} {n / r['wall_s']:7.0f} {r['cpu_s'] * 1000 / n:7.2f} "
        f"{sql['statements'] / n:8.2f} {sql['round_trips'] / n:7.2f} {sql['commits'] / n:7.2f} "
        f"{r['claimed'] / n:9.2f} {r['claims']:7d} {r['stale']:5d} {r['takeovers']:6d} {r['errors']:4d} "
        f"{r['creates']:>6}/{n:<6} {r['succeeded']:>6}/{n:<6} {r['http'] / n:6.2f} {r['fake_cpu']:7.0%} "
        f"{r['busy']:6.0%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--workers", default="1,2,4", help="worker process counts to measure (default 1,2,4)")
    parser.add_argument("--db", default="postgresql://postgres@127.0.0.1:5432/test", help="where to create the dbs")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="the provider's fixed cost per request")
    parser.add_argument("--max-connections", type=int, default=10, help="HTTP connections per worker (default 10)")
    parser.add_argument("--concurrency", type=int, default=2000, help="operations in flight per worker")
    parser.add_argument(
        "--writes-in-process",
        action="store_true",
        help="each worker writes in its own process (jobtrail worker --writes-in-process), not a writer process",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--submit", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    parser.add_argument("--worker-id", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.base, args.db, args.worker_id, args.max_connections, args.concurrency, args.writes_in_process)
        return
    if args.submit:
        print(json.dumps(_submit(args.db, args.base, args.n, args.max_connections)))
        return

    port = _free_port()
    fake = subprocess.Popen(
        [
            *(sys.executable, "-m", "jobtrail.testing.provider", "--port", str(port)),
            *("--job-duration", "1.0", "--latency-ms", str(args.latency_ms)),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert fake.stdout is not None
    base = json.loads(fake.stdout.readline())["base_url"]
    n = args.n
    print(
        f"N = {n} operations on PostgreSQL, a fresh database per K; fake provider in its own process, "
        f"{args.latency_ms:g} ms per request, jobs finish 1.0 s after creation; each worker polls every "
        f"{POLL_S} s with {args.max_connections} HTTP connections and {args.concurrency} operations in flight"
        + (", writing in its own process; " if args.writes_in_process else ", writing in a writer process; ")
        + f"{os.cpu_count()} CPUs. Per op: CPU and SQL summed over the worker processes (submits apart); "
        "fake CPU: the provider process's share of one core; busy: the whole machine's cores (others' work too)."
    )
    print(
        f"{'K':>2} {'wall s':>7} {'ops/s':>7} {'CPU ms':>7} {'stmts':>8} {'r.trips':>7} {'commits':>7} "
        f"{'claims/op':>9} {'claim-q':>7} {'stale':>5} {'takeov':>6} {'errs':>4} {'creates/N':>13} {'succeeded/N':>13}"
        f" {'HTTP':>6} {'fake CPU':>8} {'busy':>6}"
    )
    print(f"{'':>2} {'':>7} {'':>7} {'per op':>7} {'per op':>8} {'per op':>7} {'per op':>7}{'req/op':>71}")
    try:
        for k in (int(x) for x in args.workers.split(",")):
            r = run_k(k, args, base, fake.pid)
            print(_line(r, n), flush=True)
            if r["creates"] != n or r["creates_received"] != n or r["succeeded"] != n:
                print(f"   states {r['states']}, creates received {r['creates_received']}", flush=True)
        s = r["submit_sql"]
        print(
            f"submits (each K, in their own process): {s['statements'] / n:.2f} statements/op, "
            f"{s['round_trips'] / n:.3f} round trips/op, {s['commits']} commits for {n} ops"
        )
    finally:
        fake.terminate()
        fake.wait(10)


if __name__ == "__main__":
    main()
