"""How fast the dashboard answers on a large ledger (100,000 operations by default).

    python bench/dashboard.py                              # builds /tmp/jobtrail-dashboard-bench.db once, reuses it
    python bench/dashboard.py --n 100000 --requests 100
    python bench/dashboard.py --db postgresql://postgres@127.0.0.1:5432/test --n 20000

Builds the ledger through the ledger layer in batches (creates, create attempts and
transitions with their evidence and history, results for the succeeded, a few observations),
in a realistic mix of states, then runs ``jobtrail dashboard`` as its own process and times,
over real HTTP from this process, the list, a filtered list, a search, an older page and
operation pages. Prints p50/p95/max per page.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from jobtrail import (
    CancelIntent,
    ConfirmedCreate,
    ConflictingJobIds,
    CreateAttempt,
    OperationSpec,
    RemoteState,
    State,
    StatusObservation,
    Store,
    ValidatedResult,
)
from jobtrail.ledger.store import Change, Observe, StoredResult

BATCH = 1000
PROVIDERS = ("openai-batch", "replicate", "fake")
BODY = b'{"ok": true, "items": 3}'
SHA = hashlib.sha256(BODY).hexdigest()


def _obs(state: RemoteState, job: str) -> StatusObservation:
    return StatusObservation(remote_state=state, raw_state=state.value, http_status=200, remote_job_id=job)


def _step(ops: list[Any], evidence: Any, to: State | None, **kw: Any) -> list[Change]:
    return [Change(op=op, evidence=evidence(op), actor="bench", to=to, **kw) for op in ops]


def build(store: Store, n: int, seed: int = 7) -> None:
    """``n`` operations: 60 % succeeded, 15 % observing, 10 % failed, 8 % create_pending, 5 % cancel_requested,
    2 % needs_attention."""
    rng = random.Random(seed)
    started = time.perf_counter()
    for start in range(0, n, BATCH):
        specs = [
            OperationSpec(
                provider=PROVIDERS[i % len(PROVIDERS)],
                target="acct",
                endpoint="POST /v1/jobs",
                body={"i": i},
                operation_key=f"job-{i:07d}",
                caller=f"agent-{i % 50}",
            )
            for i in range(start, min(start + BATCH, n))
        ]
        ops = [op for op, _ in store.create_operations(specs)]
        ops = store.apply(_step(ops, lambda op: CreateAttempt(attempt=1), None, changes={"attempts": 1}))
        roll = {op.operation_id: rng.random() for op in ops}
        # below 0.08: left in create_pending (attempted once)
        stuck = [op for op in ops if 0.08 <= roll[op.operation_id] < 0.10]
        rest = [op for op in ops if roll[op.operation_id] >= 0.10]
        store.apply(
            _step(stuck, lambda op: ConflictingJobIds(first_job_id="a", second_job_id="b"), State.NEEDS_ATTENTION)
        )
        jobs = {op.operation_id: f"job_{op.operation_id[-10:].lower()}" for op in rest}
        rest = store.apply(
            [
                Change(
                    op=op,
                    evidence=ConfirmedCreate(remote_job_id=jobs[op.operation_id], http_status=201),
                    actor="bench",
                    to=State.ACCEPTED,
                    changes={"remote_job_id": jobs[op.operation_id]},
                )
                for op in rest
            ]
        )
        rest = store.apply(_step(rest, lambda op: _obs(RemoteState.RUNNING, op.remote_job_id), State.OBSERVING))
        store.apply(
            [
                Observe(
                    operation_id=op.operation_id,
                    kind="status_poll",
                    raw={"status": "running"},
                    http_status=200,
                    remote_state="running",
                    raw_state="running",
                    progress=0.5,
                )
                for op in rest
            ]
        )
        # below 0.25: left observing
        failing = [op for op in rest if 0.25 <= roll[op.operation_id] < 0.35]
        cancelling = [op for op in rest if 0.35 <= roll[op.operation_id] < 0.40]
        winning = [op for op in rest if roll[op.operation_id] >= 0.40]
        store.apply(_step(failing, lambda op: _obs(RemoteState.FAILED, op.remote_job_id), State.FAILED))
        store.apply(
            _step(cancelling, lambda op: CancelIntent(requested_by="bob", reason="wrong input"), State.CANCEL_REQUESTED)
        )
        collecting = store.apply(
            _step(winning, lambda op: _obs(RemoteState.SUCCEEDED, op.remote_job_id), State.RESULT_COLLECTING)
        )
        result = StoredResult(
            sha256=SHA, size=len(BODY), content_type="application/json", body=BODY, path=None, checks=[], summary=None
        )
        store.apply(
            _step(
                collecting,
                lambda op: ValidatedResult(sha256=SHA, size=len(BODY), content_type="application/json"),
                State.SUCCEEDED,
                result=result,
            )
        )
        done = min(start + BATCH, n)
        if done % 10_000 == 0 or done == n:
            print(f"  built {done} operations in {time.perf_counter() - started:.0f} s", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(conn: http.client.HTTPConnection, path: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    conn.request("GET", path)
    resp = conn.getresponse()
    body = resp.read().decode()
    elapsed = time.perf_counter() - t0
    if resp.status != 200:
        raise SystemExit(f"GET {path}: {resp.status}\n{body[:500]}")
    return elapsed, body


def report(name: str, samples: list[float]) -> None:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    print(f"{name:<28} p50 {statistics.median(ms):7.1f} ms   p95 {p95:7.1f} ms   max {ms[-1]:7.1f} ms   (n={len(ms)})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", default=os.path.join("/tmp", "jobtrail-dashboard-bench.db"))
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=60, help="requests per page kind")
    args = parser.parse_args()

    store = Store.open(args.db)
    have = store.count()
    if have < args.n:
        print(f"building a ledger of {args.n} operations in {args.db} (has {have}) ...", flush=True)
        t0 = time.perf_counter()
        build(store, args.n - have)
        print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
    total = store.count()
    sample = [op.operation_id for op in store.list_operations(limit=None) if random.random() < 0.002][:40]
    store.close()

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "jobtrail", "--db", args.db, "dashboard", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the dashboard did not start") from None
                time.sleep(0.1)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        _, first = get(conn, "/")  # warm up: the first request imports the templates
        older = re.search(r"before=(op_[0-9A-Z]+)", first)
        pages = {
            "list (newest 50)": "/",
            "filtered: state": "/?state=failed",
            "filtered: state+caller": "/?state=succeeded&caller=agent-7",
            "filtered: provider": "/?provider=replicate",
            "search: key prefix": "/?q=job-00123",
            "older page (keyset)": f"/?before={older.group(1)}" if older else "/",
            "needs-a-person queue": "/queue",
        }
        print(
            f"engine {args.db.split(':')[0] if '://' in args.db else 'sqlite'}, {total} operations; "
            f"{args.requests} requests per page, one at a time, over HTTP on 127.0.0.1"
        )
        for name, path in pages.items():
            report(name, [get(conn, path)[0] for _ in range(args.requests)])
        report("operation page", [get(conn, f"/ops/{sample[i % len(sample)]}")[0] for i in range(args.requests)])
        report("healthz", [get(conn, "/healthz")[0] for _ in range(args.requests)])
        conn.close()
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
