"""One provider request's CPU: jobtrail's HTTP provider against plain aiohttp, on the same fake.

    python bench/requests.py                       # 10,000 status requests each, 10 connections
    python bench/requests.py --n 20000 --max-connections 256

Both send the same GET of one job's status to the fake provider (its own process, on loopback) with
the same connection limit, ``--concurrency`` requests in flight, on uvloop, in one process; each
round is measured after a warm-up, alternately, and reports the process's CPU per request. jobtrail's
request includes what it does around the wire: the egress check, the provider's and trace headers,
the response read to a bound, parsed, and its state, progress and result reference extracted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

from lifecycle import _free_port, provider_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10_000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-connections", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=500, help="requests in flight")
    args = parser.parse_args()

    import aiohttp

    from jobtrail import Store
    from jobtrail.domain.record import OperationSpec
    from jobtrail.providers.http import load_provider
    from jobtrail.runtime.loop import loop_name
    from jobtrail.runtime.loop import run as run_loop

    gc.freeze()  # as a worker tunes its collector (and neither side's N requests are all in flight)
    gc.set_threshold(50_000, 20, 10)
    fake = subprocess.Popen(
        [sys.executable, "-m", "jobtrail.testing.provider", "--port", str(_free_port()), "--job-duration", "3600"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert fake.stdout is not None
    try:
        base = json.loads(fake.stdout.readline())["base_url"]
        config = provider_config(base, args.max_connections)
        store = Store.open(":memory:")
        op, _ = store.create_operation(
            OperationSpec(provider="fake", target="bench", endpoint="POST /v1/jobs", body={"i": 1})
        )
        provider = load_provider(config)

        async def run() -> dict[str, list[float]]:
            created = await provider.create(op)
            assert created.remote_job_id, created
            polled = dataclasses.replace(op, remote_job_id=created.remote_job_id)
            url = f"{base}/v1/jobs/{created.remote_job_id}"
            cpu: dict[str, list[float]] = {"plain aiohttp": [], "jobtrail": []}
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.max_connections)) as session:

                async def plain() -> object:
                    async with session.get(url) as resp:
                        return (await resp.json())["status"]

                async def durable() -> object:
                    return (await provider.status(polled)).remote_state

                async def round_of(one: Callable[[], Awaitable[object]], n: int) -> float:
                    left = n

                    async def lane() -> None:
                        nonlocal left
                        while left > 0:
                            left -= 1
                            await one()

                    started = time.process_time()
                    await asyncio.gather(*(lane() for _ in range(args.concurrency)))
                    return time.process_time() - started

                for one in (plain, durable):
                    await round_of(one, min(args.n, 1000))  # connections opened, caches warm
                for _ in range(args.rounds):
                    for name, one in (("plain aiohttp", plain), ("jobtrail", durable)):
                        cpu[name].append(await round_of(one, args.n) / args.n)
            await provider.aclose()
            return cpu

        cpu = run_loop(run())
        store.close()
    finally:
        fake.terminate()
        fake.wait(10)
    print(
        f"{args.n} status requests a round, {args.rounds} rounds alternately, {args.max_connections} connections, "
        f"{args.concurrency} in flight, {loop_name()}"
    )
    for name, seconds in cpu.items():
        us = [s * 1e6 for s in seconds]
        print(f"{name:<14} {min(us):6.1f} us CPU per request at best, median {statistics.median(us):6.1f}")


if __name__ == "__main__":
    main()
