"""Run the fake provider: ``python -m jobtrail.testing.provider --port 8080``."""

from __future__ import annotations

import argparse
import json
import signal
import threading

from jobtrail.testing._fake_provider import FakeProvider


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--job-duration", type=float, default=1.0, help="seconds until a job succeeds")
    parser.add_argument("--no-idempotency", action="store_true", help="ignore Idempotency-Key entirely")
    parser.add_argument(
        "--latency-ms", type=float, default=0.0, help="a fixed delay before every API answer (default 0)"
    )
    args = parser.parse_args()
    fake = FakeProvider(
        host=args.host,
        port=args.port,
        job_duration_s=args.job_duration,
        idempotency=not args.no_idempotency,
        latency_s=args.latency_ms / 1000,
    )
    # the handlers are in place before anyone learns the address, so a prompt SIGTERM still ends it cleanly
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    fake.start()
    print(json.dumps({"base_url": fake.base_url}), flush=True)
    stop.wait()
    fake.stop()


if __name__ == "__main__":
    main()
