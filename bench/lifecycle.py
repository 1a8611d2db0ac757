"""Whole life cycles: N operations (create -> polls -> result -> succeeded) against the fake provider.

    python bench/lifecycle.py --n 1000
    python bench/lifecycle.py --n 10000 --db postgresql://postgres@127.0.0.1:5432/test
    python bench/lifecycle.py --n 5000 --max-connections 10     # a provider that allows few connections
    python bench/lifecycle.py --n 5000 --max-connections 10 --rounds 5   # alternately, five times: median ratios

The fake provider runs in its own process on loopback; each job finishes 1 s
after creation. The same run measures a plain, non-durable asyncio + aiohttp
loop doing the same HTTP work (create with an Idempotency-Key, poll every
0.25 s with small jitter, fetch the result, check its sha256), then jobtrail
(submit, then one worker polling every 0.25 s with 10 % jitter), each in a
process of its own, and prints both with jobtrail's throughput as a ratio.
jobtrail's transactions include every write (submits, group commits with the
results they store, claims); SQL statements are counted at the driver, and on
PostgreSQL so are round trips (a pipelined executemany is one). On Linux it also prints what each
phase cost the whole machine: its own CPU, the fake provider's, and the rest (on PostgreSQL, the
database server's work above all, which shares the same cores). Neither phase's CPU counts the
imports of its own process; jobtrail's counts its writer process's whole life, its start included
(some 0.25-0.3 s of imports, once per worker, shared by the N life cycles).

The CPU figures are absolute, and a shared machine's speed drifts: the same fixed Python loop (the
reference loop) took 110 ms in one minute and 209 in the next on one machine, and machines differ by
three times and more. Each run prints that loop's time before, between and after its phases: compare
CPU figures from two runs only beside it.

    BENCH_BODY_KIB=64 python bench/lifecycle.py --n 2000      # request bodies of 64 KiB (a long prompt)
    BENCH_CONCURRENCY=5000 python bench/lifecycle.py --n 10000  # the worker's --concurrency (default 2000)
    BENCH_WRITES_IN_PROCESS=1 python bench/lifecycle.py --n 5000   # the worker's --writes-in-process
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import random
import resource
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from sqlcount import add_counts, children_counts, count_in_children, count_sql

POLL_S = 0.25
#: operations one jobtrail worker keeps in flight (the plain loop keeps all N in flight)
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", "2000"))
#: the worker writes on its own threads (`jobtrail worker --writes-in-process`), not in a writer process
WRITES_IN_PROCESS = os.environ.get("BENCH_WRITES_IN_PROCESS") == "1"
#: each request body's padding, in KiB (a prompt's size; default none), for both the plain loop and jobtrail
_PAD = ("Please categorise these customer complaints by severity and summarise them. " * 15_000)[
    : 1024 * int(os.environ.get("BENCH_BODY_KIB", "0"))
]


def _request(i: int) -> dict[str, Any]:
    return {"i": i, "pad": _PAD} if _PAD else {"i": i}


def provider_config(base: str, max_connections: int = 256) -> dict[str, Any]:
    """The fake provider as every bench declares it: polls every POLL_S with 10 % jitter."""
    return {
        "name": "fake",
        "base_url": base,
        "timeout_s": 30,
        "connect_timeout_s": 10,
        "create": {"path": "/v1/jobs", "job_id": "$.id"},
        "status": {"path": "/v1/jobs/{job_id}", "state": "$.status", "result_ref": "$.result_url"},
        "result": {"path": "/v1/jobs/{job_id}/result"},
        "reconcile": {"modes": ["replay"]},
        "poll": {"initial_s": POLL_S, "factor": 1, "cap_s": POLL_S, "jitter": 0.1},
        "max_connections": max_connections,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _counts(base: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{base}/_fake/counts", timeout=10) as resp:
        data: dict[str, int] = json.loads(resp.read())
        return data


#: seconds the garbage collector ran in this process (each phase is a process of its own)
_GC = {"s": 0.0, "started": 0.0}


def _gc_timer(phase: str, _info: dict[str, Any]) -> None:
    if phase == "start":
        _GC["started"] = time.perf_counter()
    else:
        _GC["s"] += time.perf_counter() - _GC["started"]


gc.callbacks.append(_gc_timer)


def _usage() -> tuple[float, float, float]:
    """CPU seconds and peak RSS (MB) of this process and of its children that ended (the worker's writer
    process: the worker closes it when it stops), and the children's CPU seconds alone."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    children = kids.ru_utime + kids.ru_stime
    return me.ru_utime + me.ru_stime + children, (me.ru_maxrss + kids.ru_maxrss) / 1024, children


def _machine_cpu(provider_pid: int) -> tuple[float, float] | None:
    """CPU seconds the whole machine and the fake provider have used so far (Linux; None elsewhere): what
    a phase cost beyond its own processes, the database server's work on PostgreSQL above all."""
    try:
        with open("/proc/stat") as fh:
            fields = fh.readline().split()[1:]
        with open(f"/proc/{provider_pid}/stat") as fh:
            provider = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = sum(int(v) for i, v in enumerate(fields[:8]) if i not in (3, 4))  # all but idle and iowait
    return busy / tick, (int(provider[11]) + int(provider[12])) / tick  # utime, stime


def _reference_ms() -> float:
    """CPU milliseconds of a fixed pure-Python loop: how fast this machine runs Python just now.

    The CPU figures per operation are absolute, and this shared machine's speed drifts by half from one hour
    to the next (and differs from machine to machine): this reading beside them says which kind of hour it was.
    """
    started = time.process_time()
    total = 0
    for i in range(3_000_000):
        total += i
    return (time.process_time() - started) * 1000


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


# -- the plain loop ----------------------------------------------------------------------------


async def _plain(base: str, n: int, max_connections: int) -> dict[str, Any]:
    import aiohttp

    latencies: list[float] = []
    failures = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal failures
        started = time.monotonic()
        key = secrets.token_hex(16)
        async with session.post(f"{base}/v1/jobs", json=_request(i), headers={"Idempotency-Key": f'"{key}"'}) as r:
            job = (await r.json())["id"]
        while True:
            await asyncio.sleep(POLL_S * (1 - 0.1 * random.random()))
            async with session.get(f"{base}/v1/jobs/{job}") as r:
                if (await r.json())["status"] == "succeeded":
                    break
        async with session.get(f"{base}/v1/jobs/{job}/result") as r:
            body = await r.read()
        if not hashlib.sha256(body).hexdigest():
            failures += 1
        latencies.append(time.monotonic() - started)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_connections)) as session:
        await asyncio.gather(*(one(session, i) for i in range(n)))
    return {"latencies": latencies, "failures": failures}


def phase_plain(base: str, n: int, max_connections: int) -> dict[str, Any]:
    # imported before the count starts, as jobtrail's phase imports its own: neither phase is charged its imports
    import aiohttp  # noqa: F401

    from jobtrail.runtime.loop import run as run_loop

    cpu0, _, _ = _usage()
    t0 = time.monotonic()
    out = run_loop(_plain(base, n, max_connections))  # the loop jobtrail's worker runs on: like for like
    wall = time.monotonic() - t0
    cpu1, rss, _ = _usage()
    return {
        "wall_s": wall,
        "gc_s": _GC["s"],
        "cpu_s": cpu1 - cpu0,
        "rss_mb": rss,
        "latencies": out["latencies"],
        "succeeded": n - out["failures"],
    }


# -- jobtrail ------------------------------------------------------------------------------------


def _wal_lsn(engine: Any) -> str:
    import sqlalchemy as sa

    with engine.connect() as conn:
        return str(conn.execute(sa.text("SELECT pg_current_wal_insert_lsn()")).scalar_one())


def phase_jobtrail(base: str, n: int, db: str, max_connections: int) -> dict[str, Any]:
    import sqlalchemy as sa

    from jobtrail import AsyncJobtrail, State, Store
    from jobtrail.providers.http import load_provider
    from jobtrail.runtime.loop import run as run_loop
    from jobtrail.runtime.worker import Worker

    config = provider_config(base, max_connections)
    store = Store.open(db)  # migrations (if any) run before the count starts
    sql = count_sql(db)
    in_children = count_in_children(db)  # the worker's writer process
    store.close()
    store = Store.open(db)
    postgres = db.startswith("postgres")
    wal0 = _wal_lsn(store.engine) if postgres else None
    cpu0, _, kids0 = _usage()
    t0 = time.monotonic()
    jt = AsyncJobtrail(store=store, providers=[config])

    async def run() -> Any:
        for start in range(0, n, 500):  # durable in batches: one commit per 500 records
            await jt.submit_many("fake", [_request(i) for i in range(start, min(n, start + 500))])
        worker = Worker(
            store,
            {"fake": load_provider(config)},
            worker_id="bench",
            concurrency=CONCURRENCY,
            lease_s=120,
            batch=1000,
            writer_process=not WRITES_IN_PROCESS,
        )
        return await worker.run(until_settled=True)

    stats = run_loop(run())  # as `jobtrail worker` runs it
    wall = time.monotonic() - t0
    cpu1, rss, kids1 = _usage()
    sql_counts = add_counts(sql, children_counts(in_children))
    ops = store.list_operations(limit=None)
    done = [op for op in ops if op.state is State.SUCCEEDED]
    latencies = [(op.updated_at_us - op.created_at_us) / 1e6 for op in done]
    with store.engine.connect() as conn:
        rows = {
            t: conn.execute(sa.text(f"SELECT count(*) FROM {t}")).scalar_one()
            for t in ("operations", "history", "observations")
        }
        disk = 0
        wal = 0
        if postgres:
            # what an operator plans storage and replication by: WAL written (the whole server's, so run
            # on a quiet one) and the tables' size on disk, indexes and TOAST included
            since = sa.text("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), :lsn)")
            wal = int(conn.execute(since, {"lsn": wal0}).scalar_one())
            disk = sum(
                int(conn.execute(sa.text(f"SELECT pg_total_relation_size('{t}')")).scalar_one())
                for t in ("operations", "history", "observations", "results")
            )
    store.close()
    return {
        "wall_s": wall,
        "gc_s": _GC["s"],
        "cpu_s": cpu1 - cpu0,
        "writer_cpu_s": kids1 - kids0,
        "rss_mb": rss,
        "latencies": latencies,
        "succeeded": len(done),
        "transactions": stats.transactions + jt.writer.transactions + stats.claims,
        "submit_transactions": jt.writer.transactions,
        "worker_transactions": stats.transactions,
        "writes": stats.writes,
        "rows": rows,
        "claims": stats.claimed,
        "claim_queries": stats.claims,
        "sql": sql_counts,
        "wal_bytes": wal,
        "disk_bytes": disk,
    }


# -- driver ----------------------------------------------------------------------------------------


def _child(phase: str, base: str, n: int, db: str, max_connections: int) -> dict[str, Any]:
    out = subprocess.run(
        [
            *(sys.executable, __file__, "--phase", phase, "--base", base, "--n", str(n), "--db", db),
            *("--max-connections", str(max_connections)),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"{phase} phase failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _line(name: str, r: dict[str, Any], n: int, requests: int) -> str:
    lat = r["latencies"]
    return (
        f"{name:<9} {n / r['wall_s']:8.0f} ops/s  {r['cpu_s'] * 1000 / n:6.2f} CPU ms/op  "
        f"{requests / n:5.2f} HTTP req/op  peak RSS {r['rss_mb']:6.1f} MB  "
        f"latency p50 {statistics.median(lat):.2f} s p99 {_pct(lat, 0.99):.2f} s  "
        f"({r['succeeded']}/{n} succeeded; garbage collector {r['gc_s'] / r['cpu_s']:.0%} of the CPU)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--db", default="", help="database URL (default: a temp SQLite file)")
    parser.add_argument(
        "--max-connections",
        type=int,
        default=256,
        help="HTTP connections to the provider, for both the plain loop and jobtrail (default 256, jobtrail's default)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the two phases this many times, alternately, and print the median ratios (default 1)",
    )
    parser.add_argument("--phase", choices=["plain", "jobtrail"], help=argparse.SUPPRESS)
    parser.add_argument("--base", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase == "plain":
        print(json.dumps(phase_plain(args.base, args.n, args.max_connections)), flush=True)
        return
    if args.phase == "jobtrail":
        print(json.dumps(phase_jobtrail(args.base, args.n, args.db, args.max_connections)), flush=True)
        return

    port = _free_port()
    fake = subprocess.Popen(
        [sys.executable, "-m", "jobtrail.testing.provider", "--port", str(port), "--job-duration", "1.0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert fake.stdout is not None
    base = json.loads(fake.stdout.readline())["base_url"]
    tmp = tempfile.mkdtemp()
    try:
        rounds = [_round(base, fake.pid, args, tmp, i) for i in range(args.rounds)]
    finally:
        fake.terminate()
        fake.wait(10)
    if args.rounds == 1:
        _report(args, *rounds[0])
        return
    # the machine drifts between minutes: each round's two phases run back to back, and the medians of
    # the rounds' own ratios say more than any one round
    print(
        f"N = {args.n}, {args.rounds} rounds (plain, then jobtrail, alternately), "
        f"{args.max_connections} HTTP connections, {'postgresql' if args.db.startswith('postgres') else 'sqlite'}"
    )
    cpu, speed, p99 = [], [], []
    for i, (plain, durable, _, _) in enumerate(rounds, 1):
        cpu.append(durable["cpu_s"] / plain["cpu_s"])
        speed.append(plain["wall_s"] / durable["wall_s"])
        p99.append(_pct(durable["latencies"], 0.99) / _pct(plain["latencies"], 0.99))
        print(
            f"round {i}: plain {plain['cpu_s'] * 1000 / args.n:.2f}, jobtrail {durable['cpu_s'] * 1000 / args.n:.2f} "
            f"CPU ms/op (ratio {cpu[-1]:.2f}); throughput ratio {speed[-1]:.2f}; p99 latency ratio {p99[-1]:.2f}; "
            f"reference loop {_span(plain['reference_ms'] + durable['reference_ms'])} ms"
        )
    print(
        f"medians: CPU ratio {statistics.median(cpu):.2f} (jobtrail's CPU per op over the plain loop's), "
        f"throughput ratio {statistics.median(speed):.2f}, p99 latency ratio {statistics.median(p99):.2f}"
    )


def _round(
    base: str, provider_pid: int, args: argparse.Namespace, tmp: str, i: int
) -> tuple[dict[str, Any], dict[str, Any], dict[str, int], dict[str, int]]:
    """One plain phase, then one jobtrail phase on a ledger of its own: their results, and the HTTP
    requests the fake provider saw in each."""
    db = args.db or os.path.join(tmp, f"lifecycle-{i}.db")
    if db.startswith("postgres"):
        import sqlalchemy as sa

        schema = "bench_" + secrets.token_hex(4)
        engine = sa.create_engine(db.replace("postgresql://", "postgresql+psycopg://", 1))
        with engine.begin() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
        db_for_run = f"{db}{'&' if '?' in db else '?'}options=-csearch_path%3D{schema}"
    else:
        db_for_run = db
    try:
        speed = [_reference_ms()]
        before, cpu_before = _counts(base), _machine_cpu(provider_pid)
        plain = _child("plain", base, args.n, "", args.max_connections)
        middle, cpu_middle = _counts(base), _machine_cpu(provider_pid)
        speed.append(_reference_ms())
        durable = _child("jobtrail", base, args.n, db_for_run, args.max_connections)
        after, cpu_after = _counts(base), _machine_cpu(provider_pid)
        speed.append(_reference_ms())
    finally:
        if db.startswith("postgres"):
            with engine.begin() as conn:
                conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
    plain["machine"] = _spent(cpu_before, cpu_middle)
    durable["machine"] = _spent(cpu_middle, cpu_after)
    plain["reference_ms"], durable["reference_ms"] = speed[:2], speed[1:]
    keys = ("creates_received", "status", "results")
    return (
        plain,
        durable,
        {k: middle.get(k, 0) - before.get(k, 0) for k in keys},
        {k: after.get(k, 0) - middle.get(k, 0) for k in keys},
    )


def _spent(start: tuple[float, float] | None, end: tuple[float, float] | None) -> tuple[float, float] | None:
    """The whole machine's CPU seconds and the fake provider's between two readings (None off Linux)."""
    if start is None or end is None:
        return None
    return end[0] - start[0], end[1] - start[1]


def _report(
    args: argparse.Namespace, plain: dict[str, Any], durable: dict[str, Any], req: dict[str, int], req2: dict[str, int]
) -> None:
    n = args.n
    engine_name = "postgresql" if args.db.startswith("postgres") else "sqlite"
    from jobtrail.runtime.loop import loop_name

    print(
        f"N = {n}, engine {engine_name}, jobs finish 1.0 s after creation, polls every {POLL_S} s, "
        f"{args.max_connections} HTTP connections, both on the {loop_name()} event loop"
    )
    print(_line("plain", plain, n, sum(req.values())))
    print(_line("jobtrail", durable, n, sum(req2.values())))
    rows = durable["rows"]
    print(
        f"jobtrail database: {durable['transactions'] / n:.2f} transactions/op "
        f"({durable['worker_transactions']} group commits for {durable['writes']} writes, "
        f"{durable['claim_queries']} claim queries, "
        f"submits in {durable['submit_transactions']} transactions), rows/op: "
        f"history {rows['history'] / n:.1f}, observations {rows['observations'] / n:.1f}"
    )
    sql = durable["sql"]
    print(
        f"jobtrail SQL: {sql['commits'] / n:.3f} commits/op (every COMMIT the driver sent), "
        f"{sql['statements'] / n:.1f} statements/op"
        + (f", {sql['round_trips'] / n:.2f} round trips/op" if engine_name == "postgresql" else "")
    )
    if engine_name == "postgresql":
        print(
            f"jobtrail PostgreSQL: {durable['wal_bytes'] / n / 1024:.1f} KiB WAL/op, "
            f"{durable['disk_bytes'] / n / 1024:.1f} KiB on disk/op (tables, indexes, TOAST)"
        )
    print(
        f"jobtrail HTTP: {req2['creates_received'] / n:.2f} creates, {req2['status'] / n:.2f} polls, "
        f"{req2['results'] / n:.2f} result fetches per op (plain: {req['status'] / n:.2f} polls)"
    )
    for name, phase in (("plain", plain), ("jobtrail", durable)):
        if phase["machine"] is None:
            continue
        machine, provider = phase["machine"]
        rest = machine - phase["cpu_s"] - provider
        whose = "PostgreSQL's server, " if name == "jobtrail" and engine_name == "postgresql" else ""
        own = f"{phase['cpu_s'] * 1000 / n:.2f} its own"
        if phase.get("writer_cpu_s"):
            own += f" = {(phase['cpu_s'] - phase['writer_cpu_s']) * 1000 / n:.2f} worker"
            own += f" + {phase['writer_cpu_s'] * 1000 / n:.2f} writer process"
        print(
            f"{name} machine: {machine * 1000 / n:.2f} CPU ms/op on all cores "
            f"({own}, {provider * 1000 / n:.2f} the fake provider, "
            f"{rest * 1000 / n:.2f} the rest: {whose}the kernel's own share of the traffic, the phase starting up, "
            "anything else running)"
        )
    ratio = (n / durable["wall_s"]) / (n / plain["wall_s"])
    p99_ratio = _pct(durable["latencies"], 0.99) / _pct(plain["latencies"], 0.99)
    print(
        f"ratio: {ratio:.2f}   CPU ratio: {durable['cpu_s'] / plain['cpu_s']:.2f}   p99 latency ratio: {p99_ratio:.2f}"
    )
    print(f"machine speed: {_speed(plain['reference_ms'] + durable['reference_ms'])}")


def _speed(readings: list[float]) -> str:
    return (
        f"a fixed Python loop (the reference loop) took {_span(readings)} ms before, between and after the phases "
        "(the CPU figures scale with it: compare runs by it)"
    )


def _span(readings: list[float]) -> str:
    return f"{min(readings):.0f}-{max(readings):.0f}"


if __name__ == "__main__":
    main()
