"""Deterministic simulation: one seed, one fault schedule, replayed exactly.

A seeded scheduler with a virtual clock drives real :class:`~jobtrail.Worker`
objects, the real flows and the real ledger (SQLite) against :class:`SimWorld`,
an in-memory async-job provider that misbehaves at random: refused
connections, dropped and lost responses (before or after it committed the
job), 5xx and 429 with ``Retry-After``, malformed and wrongly typed answers,
unknown states, idempotency broken on purpose (a new job for a known token),
flaky, missing and corrupted results, acknowledged cancels that never take
effect, jobs that finish as the cancel arrives, and signed webhooks delivered
twice, out of order and forged. Workers crash at the named failpoints
(:mod:`jobtrail.domain.failpoints`), pause past their leases while another worker
takes over, and restart. People ask for cancels at random moments.

Only the socket is simulated: :class:`SimProvider` is an
:class:`~jobtrail.HttpProvider` whose ``_transport`` hands the request to the
world, so headers, credentials, parsing and classification are the real code.
Every random choice comes from the seed, and the clock only moves when the
scheduler moves it, so a seed replays exactly (:attr:`SeedReport.trace_hash`
is the same on every run).

After each seed a calm phase lets everything settle, then :func:`check`
asserts the invariants:

- at most one remote job per operation whenever the provider honoured idempotency;
- every request that left (create, cancel) was recorded as an attempt first;
- no terminal state without its evidence: ``succeeded`` holds the exact bytes the
  provider produced; ``cancelled``/``failed`` match the provider's own state; a
  remote job id on the record is one the provider made for that operation;
- every remotely finished job is collected, or its operation says why not;
- nothing is left half-done once the provider is calm (each operation ends or
  waits for a person with a reason);
- every cancel request is in the history; every history chain verifies;
- no canary secret (the API key, which the provider echoes back in errors)
  in the database file or the log.

Run ``python -m jobtrail.testing.simulation --seeds 10000``; a failing seed
prints the one command that replays it.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import io
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import urllib.parse
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from random import Random
from typing import Any

from jobtrail.domain import failpoints as _failpoints
from jobtrail.domain import ids as _ids
from jobtrail.domain.errors import JobtrailError, missing_extra
from jobtrail.flows.cancel import request_cancel
from jobtrail.ledger.audit import verify
from jobtrail.runtime.client import AsyncJobtrail

try:  # the simulation delivers webhooks to the real receiver
    from starlette.requests import Request
except ImportError as exc:
    raise missing_extra("webhooks", "the simulation", exc) from exc
from jobtrail.domain.record import Operation
from jobtrail.domain.redact import install_log_redaction
from jobtrail.domain.states import FINAL_STATES, State
from jobtrail.interfaces.webhooks import Receiver
from jobtrail.ledger.offload import inline
from jobtrail.ledger.results import read_result
from jobtrail.ledger.store import Store
from jobtrail.providers.contract import NoAnswer, WireAnswer
from jobtrail.providers.http import HttpProvider, parse_config
from jobtrail.runtime.worker import WORKED_STATES, Worker
from jobtrail.testing._fake_provider import signed_headers
from jobtrail.testing._ledgers import Ledger, PostgresLedger, SqliteLedger

_US = 1_000_000
#: 2027-01-01T00:00:00Z: the virtual clock's start
START_US = 1_798_761_600 * _US
LEASE_S = 30.0
BASE_URL = "http://127.0.0.1:9"
PROVIDER = "sim"
_CANARY_ENV = "JOBTRAIL_SIM_API_KEY"
_WHSEC_ENV = "JOBTRAIL_SIM_WHSEC"
_WHSEC = "whsec_" + base64.b64encode(b"jobtrail-simulation-webhook-key!").decode()
_log = logging.getLogger("jobtrail")


class Crash(BaseException):
    """A simulated process death at a failpoint (a BaseException, so no ``except Exception`` survives it)."""


class VirtualClock:
    """Microseconds since the epoch; moves only when told to."""

    def __init__(self, start_us: int = START_US) -> None:
        self.now_us = start_us

    def __call__(self) -> int:
        return self.now_us

    def advance(self, seconds: float) -> None:
        self.now_us += max(int(seconds * _US), 1)

    def advance_to(self, at_us: int) -> None:
        self.now_us = max(self.now_us, at_us)


# -- the provider's side -----------------------------------------------------------------------


@dataclass(slots=True)
class SimJob:
    id: str
    token: str
    body: Any
    created_us: int
    duration_us: int
    fail: bool
    #: "normal" (takes effect after 2 s), "ignore" (acknowledged, never effective), "finish_first"
    cancel_mode: str
    #: "ok", "flaky" (``flaky`` fetches get 503), "corrupt" (checksum never matches), "missing"
    result_mode: str
    flaky: int = 0
    cancel_at_us: int | None = None
    fetches: int = 0

    def state(self, now_us: int) -> str:
        finish = self.created_us + self.duration_us
        if self.cancel_at_us is not None and self.cancel_mode != "ignore":
            if self.cancel_mode == "finish_first" or self.cancel_at_us >= finish:
                return "failed" if self.fail else "succeeded"
            return "cancelled" if now_us - self.cancel_at_us >= 2 * _US else "cancelling"
        if now_us >= finish:
            return "failed" if self.fail else "succeeded"
        return "queued" if now_us - self.created_us < self.duration_us // 10 else "running"

    def result_bytes(self) -> bytes:
        return json.dumps({"job_id": self.id, "output": {"echo": self.body}}, sort_keys=True).encode()


Answer = tuple[int, dict[str, str], bytes] | tuple[str, str]


def key_for(token: str, body: Any) -> str:
    """What tells one operation's creates apart at the provider: its token, else its request body."""
    return token or "body:" + json.dumps(body, sort_keys=True)


class SimWorld:
    """An in-memory async-job API with IETF ``Idempotency-Key`` semantics and seeded misbehaviour."""

    def __init__(self, rng: Random, clock: VirtualClock, *, rate: float, violations: bool, canary: str) -> None:
        self.rng = rng
        self.clock = clock
        #: scales every fault probability (0: a perfect provider)
        self.rate = rate
        self.violations = violations
        self.canary = canary
        #: a calm provider answers everything properly (the settling phase)
        self.calm = False
        #: honour tokens; False ignores them silently (a contract breach nobody declared)
        self.idempotency = True
        self.jobs: dict[str, SimJob] = {}
        #: by idempotency token, or by request body where none is sent (see :func:`key_for`)
        self.jobs_by_key: dict[str, list[str]] = defaultdict(list)
        self._keys: dict[str, tuple[str, Answer]] = {}
        self.counts: Counter[str] = Counter()
        self.creates_by_key: Counter[str] = Counter()
        self.cancels_by_job: Counter[str] = Counter()
        #: finished jobs whose result fetch was refused (503, gone) or whose answer never arrived
        self.undelivered_results: set[str] = set()
        #: tokens for which the provider knowingly broke idempotency (a new job on a replay)
        self.broken_tokens: set[str] = set()
        self.rejected_tokens: set[str] = set()
        self.corrupt_served: set[str] = set()
        self.trace: list[str] = []
        self.events: list[tuple[str, int, bytes]] = []
        self._event_ids = 0
        self._emitted: dict[str, str] = {}

    # faults

    def _fault(self, table: Mapping[str, float]) -> str | None:
        if self.calm or self.rate <= 0:
            return None
        roll = self.rng.random()
        for name, p in table.items():
            roll -= p * self.rate
            if roll < 0:
                return name
        return None

    def _retry_after(self) -> str:
        return str(self.rng.choice((1, 2, 5, 30, 120)))

    def _json(self, status: int, doc: Any, **headers: str) -> Answer:
        return status, {"Content-Type": "application/json", **headers}, json.dumps(doc).encode()

    def _echo(self, headers: Mapping[str, str]) -> dict[str, str]:
        # bad APIs echo the credential back in errors: it must never reach storage or logs
        return {"X-Debug-Authorization": headers.get("Authorization", "")}

    def _job_doc(self, job: SimJob) -> dict[str, Any]:
        now = self.clock()
        state = job.state(now)
        doc: dict[str, Any] = {
            "id": job.id,
            "status": state,
            "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now // _US)),
            "progress": round(min(1.0, (now - job.created_us) / max(job.duration_us, 1)), 3),
            "client_reference": None if job.token.startswith("body:") else job.token,
        }
        if state == "succeeded":
            doc["result_url"] = f"/v1/jobs/{job.id}/result"
        return doc

    # requests

    def handle(self, method: str, url: str, headers: Mapping[str, str], body: Any) -> Answer:
        parsed = urllib.parse.urlsplit(url)
        path = parsed.path
        answer = self._route(method, path, urllib.parse.parse_qs(parsed.query), headers, body)
        self.trace.append(f"{self.clock()} {method} {self._shape(path)} {answer[0]}")
        self.emit_events()
        return answer

    def _route(  # noqa: PLR0911 - one answer per endpoint of the simulated provider
        self, method: str, path: str, query: Mapping[str, list[str]], headers: Mapping[str, str], body: Any
    ) -> Answer:
        if self._fault({"refused": 0.05}):
            return ("not_sent", "ConnectionRefusedError: [Errno 111] simulated")
        parts = path.strip("/").split("/")
        if method == "POST" and path == "/v1/jobs":
            return self._create(headers, body)
        if method == "GET" and path == "/v1/jobs":
            return self._list(query.get("client_reference", [""])[0])
        if parts[:3] == ["v1", "jobs", "by-client-id"] and len(parts) == 4:
            return self._by_client_id(urllib.parse.unquote(parts[3]))
        job = self.jobs.get(urllib.parse.unquote(parts[2])) if len(parts) >= 3 else None
        if job is None:
            return self._json(404, {"title": "no such job"})
        if method == "GET" and len(parts) == 3:
            return self._status(job, headers)
        if method == "POST" and parts[3:] == ["cancel"]:
            return self._cancel(job)
        if method == "GET" and parts[3:] == ["result"]:
            return self._result(job)
        return self._json(405, {"title": "method not allowed"})

    def _create(self, headers: Mapping[str, str], body: Any) -> Answer:  # noqa: PLR0911 - every create fault
        self.counts["creates_received"] += 1
        sent_token = headers.get("Idempotency-Key", "").strip('"')
        token = key_for(sent_token, body)
        self.creates_by_key[token] += 1
        self.jobs_by_key.setdefault(token, [])
        raw = json.dumps(body, sort_keys=True).encode()
        fingerprint = hashlib.sha256(raw).hexdigest()
        fault = self._fault(
            {
                "reset_before_commit": 0.05,
                "unavailable": 0.06,
                "throttled": 0.04,
                "lost_after_commit": 0.08,
                "error_after_commit": 0.04,
                "new_job_on_replay": 0.06 if self.violations else 0.0,
                "no_job_id": 0.02,
                "reject": 0.02,
            }
        )
        if fault == "reset_before_commit":
            return ("connection_reset", "ServerDisconnectedError: simulated, nothing processed")
        if fault in ("unavailable", "throttled"):
            status = 503 if fault == "unavailable" else 429
            return self._json(status, {"title": fault, "detail": "try later"}, **{"Retry-After": self._retry_after()})
        known = self._keys.get(token) if sent_token and self.idempotency else None
        if known is not None and fault != "new_job_on_replay":
            if known[0] != fingerprint:
                return self._json(422, {"title": "Idempotency-Key reused with a different request"})
            self.counts["replayed"] += 1
            return known[1]
        if known is not None:
            self.broken_tokens.add(token)
        if fault == "reject":
            self.rejected_tokens.add(token)
            return self._json(400, {"title": "rejected", "detail": f"bad request from {headers.get('Authorization')}"})
        job = self._new_job(token, body)
        status, doc = 201, self._job_doc(job)
        good = self._json(status, doc, Location=f"/v1/jobs/{job.id}", **{"X-Request-Id": f"req_{job.id}"})
        if sent_token and self.idempotency:
            self._keys[token] = (fingerprint, good)
        if fault == "lost_after_commit":
            return ("timeout", "no answer within 10 s (simulated)")
        if fault == "error_after_commit":
            return self._json(500, {"title": "internal error"}, **self._echo(headers))
        if fault == "no_job_id":
            return self._json(201, {"status": "queued"})
        return good

    def _new_job(self, token: str, body: Any) -> SimJob:
        rng = self.rng
        n = len(self.jobs) + 1
        job = SimJob(
            id=f"job_{n:04d}",
            token=token,
            body=body,
            created_us=self.clock(),
            duration_us=rng.randint(1, 120) * _US,
            fail=rng.random() < 0.1,
            cancel_mode=rng.choices(("normal", "ignore", "finish_first"), (8, 1, 1))[0],
            result_mode=rng.choices(("ok", "flaky", "corrupt", "missing"), (80, 10, 5, 5))[0],
            flaky=rng.randint(1, 3),
        )
        self.jobs[job.id] = job
        self.jobs_by_key[token].append(job.id)
        self.counts["jobs_created"] += 1
        return job

    def _status(self, job: SimJob, headers: Mapping[str, str]) -> Answer:
        self.counts["status"] += 1
        fault = self._fault(
            {"unavailable": 0.05, "timeout": 0.04, "not_json": 0.02, "wrong_type": 0.02, "unknown_state": 0.02}
        )
        if fault == "unavailable":
            return self._json(503, {"title": "busy"}, **{"Retry-After": self._retry_after()}, **self._echo(headers))
        if fault == "timeout":
            return ("timeout", "no answer within 10 s (simulated)")
        if fault == "not_json":
            return 200, {"Content-Type": "application/json"}, b'{"id": "' + job.id.encode() + b'", "status": '
        doc = self._job_doc(job)
        if fault == "wrong_type":
            doc["status"], doc["progress"] = 42, "lots"
        if fault == "unknown_state":
            doc["status"] = "paused_for_maintenance"
        return self._json(200, doc)

    def _cancel(self, job: SimJob) -> Answer:
        self.counts["cancels"] += 1
        self.cancels_by_job[job.id] += 1
        fault = self._fault({"unavailable": 0.05, "lost_after_commit": 0.05})
        if fault == "unavailable":
            return self._json(503, {"title": "busy"})
        if job.cancel_at_us is None and job.state(self.clock()) not in ("succeeded", "failed"):
            job.cancel_at_us = self.clock()
        if fault == "lost_after_commit":
            return ("timeout", "no answer within 10 s (simulated)")
        return self._json(202, self._job_doc(job))

    def _result(self, job: SimJob) -> Answer:
        self.counts["results"] += 1
        if job.state(self.clock()) != "succeeded":
            return self._json(404, {"title": "no result yet"})
        job.fetches += 1
        if self._fault({"unavailable": 0.08}) or (job.result_mode == "flaky" and job.fetches <= job.flaky):
            self.undelivered_results.add(job.id)
            return self._json(503, {"title": "result store unavailable"})
        if job.result_mode == "missing":
            self.undelivered_results.add(job.id)
            return self._json(404, {"title": "the result is gone"})
        data = job.result_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if job.result_mode == "corrupt":
            self.corrupt_served.add(job.id)
            data = data[:-2] + b"#}"
        return 200, {"Content-Type": "application/json", "X-Result-SHA256": digest}, data

    def _list(self, reference: str) -> Answer:
        self.counts["lists"] += 1
        if self._fault({"unavailable": 0.05}):
            return self._json(503, {"title": "busy"})
        return self._json(200, {"data": [self._job_doc(self.jobs[j]) for j in self.jobs_by_key.get(reference, [])]})

    def _by_client_id(self, token: str) -> Answer:
        self.counts["lookups"] += 1
        if self._fault({"unavailable": 0.05}):
            return self._json(503, {"title": "busy"})
        ids = self.jobs_by_key.get(token)
        return self._json(200, self._job_doc(self.jobs[ids[0]])) if ids else self._json(404, {"title": "no job"})

    def slow(self) -> float | None:
        """Seconds the answer to the request just handled is late (None: on time)."""
        if self._fault({"slow": 0.1}):
            self.counts["slow_answers"] += 1
            return self.rng.choice((2.0, 8.0, 15.0))
        return None

    def _shape(self, path: str) -> str:
        # tokens are random per run; the trace names them by order of first use so a replay compares equal
        for n, token in enumerate(self.jobs_by_key):
            if not token.startswith("body:"):
                path = path.replace(token, f"<token {n}>")
        return path

    # webhooks

    def emit_events(self) -> None:
        """Queue one signed event per job state change (what a provider's webhook sender does)."""
        now = self.clock()
        for job in self.jobs.values():
            state = job.state(now)
            if self._emitted.get(job.id) != state:
                self._emitted[job.id] = state
                self._event_ids += 1
                body = json.dumps({"type": f"job.{state}", "data": {"id": job.id, "status": state}}).encode()
                self.events.append((f"evt_{self._event_ids:05d}", now // _US, body))


class SimProvider(HttpProvider):
    """An :class:`HttpProvider` whose wire is :meth:`SimWorld.handle`."""

    def __init__(self, config: Any, world: SimWorld) -> None:
        super().__init__(config)
        self.world = world
        #: run while a slow request is in flight: other workers act meanwhile (set by the scheduler)
        self.meanwhile: Callable[[], Awaitable[None]] | None = None

    async def _transport(
        self, method: str, url: str, headers: Mapping[str, str], body: Any, max_bytes: int
    ) -> WireAnswer | NoAnswer:
        answer = self.world.handle(method, url, headers, body)
        slow = self.world.slow()
        if slow:
            # the provider has done its part; the answer takes a while (past the time-out: never arrives),
            # and the rest of the world goes on meanwhile: leases expire, other workers claim and act
            timeout = self.config.timeout_s
            self.world.clock.advance(min(slow, timeout))
            self.world.trace.append(f"{self.world.clock()} slow answer ({slow} s)")
            if self.meanwhile is not None:
                await self.meanwhile()
            if slow > timeout:
                parts = urllib.parse.urlsplit(url).path.strip("/").split("/")
                if parts[-1] == "result":  # a result that never arrived counts as not delivered
                    self.world.undelivered_results.add(urllib.parse.unquote(parts[2]))
                return NoAnswer("timeout", f"no answer within {timeout:g} s (simulated)")
        if len(answer) == 3:
            return WireAnswer(answer[0], answer[1], answer[2][:max_bytes])
        return NoAnswer(*answer)


def provider_config(rng: Random) -> dict[str, Any]:
    """One of the provider contracts the simulation draws from (a file a user could write)."""
    tokenless = rng.random() < 0.15  # no token, no way to look a job up: at-most-once cannot be promised
    modes: list[str] = (
        []
        if tokenless
        else rng.choice((["replay"], ["replay", "list_by_reference"], ["status_by_client_id"], ["list_by_reference"]))
    )
    reconcile: dict[str, Any] = {"modes": modes}
    if "list_by_reference" in modes:
        reconcile |= {
            "list_path": "/v1/jobs?client_reference={token}",
            "items": "$.data",
            "reference": "$.client_reference",
        }
    if "status_by_client_id" in modes:
        reconcile["status_path"] = "/v1/jobs/by-client-id/{token}"
    return {
        "name": PROVIDER,
        "base_url": BASE_URL,
        "credential": f"env:{_CANARY_ENV}",
        "timeout_s": 10,
        "create": {
            "path": "/v1/jobs",
            "token": {"in": "none"} if tokenless else {"in": "header", "name": "Idempotency-Key", "quoted": True},
            "token_retention_s": 86400,
            "job_id": "$.id",
            "status_url": "header:Location",
        },
        "status": {"path": "/v1/jobs/{job_id}", "state": "$.status", "progress": "$.progress"},
        "states": {"cancelling": ["cancelling"]},
        "cancel": {"path": "/v1/jobs/{job_id}/cancel", "idempotent": rng.random() < 0.5},
        "result": {
            "path": "/v1/jobs/{job_id}/result",
            "checksum": "header:X-Result-SHA256",
            "kind": rng.choice(("safe_read", "safe_read", "one_time")),
        },
        "reconcile": reconcile,
        "retry": {"initial_s": 1, "factor": 2, "cap_s": 60},
        "poll": {"initial_s": 2, "factor": 1.5, "cap_s": 60},
        "webhooks": {"secrets": [f"env:{_WHSEC_ENV}"], "reference": "$.data.client_reference"},
    }


# -- one seed ----------------------------------------------------------------------------------


@dataclass
class SeedReport:
    seed: int
    violations: list[str]
    trace_hash: str
    steps: int
    crashes: int
    #: writes refused because the lease had moved on
    stale: int
    final: Counter[str]
    faults: Counter[str]
    elapsed_s: float
    trace: list[str] = field(default_factory=list)
    ignore_keys: bool = False
    #: PostgreSQL URL the seed ran on (None: SQLite)
    db: str | None = None
    #: how each operation ended, and why
    notes: list[str] = field(default_factory=list)

    def replay_command(self) -> str:
        flags = (" --ignore-keys" if self.ignore_keys else "") + (f" --db '{self.db}'" if self.db else "")
        return f"python -m jobtrail.testing.simulation --seed {self.seed}{flags} --verbose"


@dataclass
class _SimWorker:
    worker: Worker
    pending: list[Operation] = field(default_factory=list)


class _Sim:
    def __init__(self, seed: int, db: str, *, migrate: bool, ignore_keys: bool = False) -> None:
        self.seed = seed
        self.rng = Random(seed)
        self.clock = VirtualClock()
        # one canary for every seed: each distinct credential stays registered with the redactor for the
        # life of the process, so a fresh one per seed would make every later seed slower
        canary = "jtcanary5e3d1f0c9a7b4e28"
        self.world = SimWorld(
            Random(self.rng.getrandbits(64)),
            self.clock,
            rate=self.rng.choice((0.0, 0.5, 1.0, 1.0, 2.0)),
            violations=self.rng.random() < 0.2,
            canary=canary,
        )
        self.world.idempotency = not ignore_keys
        os.environ[_CANARY_ENV] = canary
        os.environ[_WHSEC_ENV] = _WHSEC
        self.config = provider_config(self.rng)
        parsed = parse_config(self.config, f"<simulation seed {seed}>")
        self.provider = SimProvider(parsed, self.world)
        self.provider.meanwhile = self._meanwhile
        self._nested = False
        #: the worker whose action is running (a slow request lets the others act meanwhile)
        self._active: _SimWorker | None = None
        self.store = Store.open(db, clock=self.clock, migrate=migrate)
        self.receiver = Receiver(self.store, {PROVIDER: parsed.webhooks}, io=inline)
        self.crash_rng = Random(self.rng.getrandbits(64))
        self.crash_rate = self.rng.choice((0.0, 0.05, 0.15))
        self.crashes = 0
        #: writes refused because the lease had moved on (a paused worker's, after another took over)
        self.stale = 0
        #: what went wrong during the run itself (checked with the invariants)
        self.problems: list[str] = []
        self.crash_points: dict[str, set[str]] = defaultdict(set)
        self.workers: list[_SimWorker] = []
        self.worker_serial = 0
        self.op_ids: list[str] = []
        self.intents = 0
        self.trace = self.world.trace
        self.final: Counter[str] = Counter()
        self.notes: list[str] = []

    def _failpoint(self, name: str) -> None:
        if self.crash_rate and self.crash_rng.random() < self.crash_rate:
            self.crashes += 1
            self.trace.append(f"{self.clock()} crash at {name}")
            raise Crash(name)

    def new_worker(self) -> _SimWorker:
        self.worker_serial += 1
        worker = Worker(
            self.store,
            {PROVIDER: self.provider},
            worker_id=f"w{self.worker_serial}",
            lease_s=LEASE_S,
            rng=Random(self.rng.getrandbits(64)),
            io=inline,
        )
        return _SimWorker(worker)

    def replace(self, old: _SimWorker) -> None:
        """The process is gone (crashed or restarted); its claims stay on the records until their leases expire."""
        self.stale += old.worker.stats.stale
        self.workers[self.workers.index(old)] = self.new_worker()

    async def run(self, max_steps: int) -> int:
        jt = AsyncJobtrail(store=self.store, providers=[self.provider], actor="sim", io=inline)
        planned = self.rng.randint(1, 6)
        self.workers = [self.new_worker() for _ in range(self.rng.randint(1, 3))]
        steps = 0
        for steps in range(1, max_steps + 1):
            if steps % 10 == 0 and len(self.op_ids) >= planned and self._all_settled():
                break
            action = self.rng.choices(
                ("submit", "claim", "handle", "clock", "cancel", "webhook", "restart"), (2, 4, 8, 4, 1, 2, 1)
            )[0]
            if action == "submit" and len(self.op_ids) < planned:
                await self._submit(jt)
            elif action == "claim":
                await self._claim(self.rng.choice(self.workers))
            elif action == "handle":
                await self._handle_one()
            elif action == "clock":
                self._advance()
            elif action == "cancel" and self.op_ids:
                self._cancel()
            elif action == "webhook":
                await self._deliver()
            elif action == "restart":
                index = self.rng.randrange(len(self.workers))
                self.trace.append(f"{self.clock()} restart {self.workers[index].worker.worker_id}")
                self.replace(self.workers[index])
        while len(self.op_ids) < planned:
            await self._submit(jt)
        return steps

    def _all_settled(self) -> bool:
        return self.store.next_due_us(providers=(PROVIDER,), states=WORKED_STATES) is None

    async def _submit(self, jt: AsyncJobtrail) -> None:
        n = len(self.op_ids)
        rng = self.rng
        create_s, result_s = rng.choice((300, 3600, 86400)), rng.choice((90, 900, 7200, 86400))
        cancel_s = rng.choice((10, 60, 600))
        while True:
            try:
                op = await jt.submit(
                    PROVIDER,
                    {"input": f"item-{n}", "n": n},
                    key=f"sim-{n}",
                    caller="agent",
                    create_deadline=timedelta(seconds=create_s),
                    result_deadline=timedelta(seconds=result_s),
                    cancel_deadline=timedelta(seconds=cancel_s),
                )
                break
            except Crash:
                continue  # the agent died after the record was durable; it submits again with the same key
        self.op_ids.append(op.operation_id)
        self.trace.append(f"{self.clock()} submit {n}")

    async def _claim(self, sim_worker: _SimWorker) -> None:
        claimed = await sim_worker.worker._claim(self.rng.randint(1, 3))
        sim_worker.pending.extend(claimed)
        if claimed:
            self.trace.append(f"{self.clock()} {sim_worker.worker.worker_id} claims {len(claimed)}")

    async def _meanwhile(self) -> None:
        """While one request is slow, another worker claims and acts (one level deep)."""
        if self._nested:
            return
        others = [w for w in self.workers if w is not self._active]
        if not others:
            return
        self._nested = True
        try:
            await self._claim(self.rng.choice(others))
            await self._handle_one(among=others)
        finally:
            self._nested = False

    async def _handle_one(self, among: list[_SimWorker] | None = None) -> None:
        busy = [w for w in (among or self.workers) if w.pending]
        if not busy:
            return
        sim_worker = self.rng.choice(busy)
        op = sim_worker.pending.pop(self.rng.randrange(len(sim_worker.pending)))
        outer, self._active = self._active, sim_worker
        try:
            await sim_worker.worker._handle(op)
        except Crash as crash:
            self.crash_points[op.operation_id].add(str(crash))
            # the process died: its claims stay on the records until their leases expire
            self.replace(sim_worker)
        finally:
            self._active = outer

    def _advance(self) -> None:
        due = self.store.next_due_us(providers=(PROVIDER,), states=WORKED_STATES)
        if due is not None and self.rng.random() < 0.6:
            self.clock.advance_to(due)
        else:
            self.clock.advance(self.rng.choice((0.5, 3, 10, LEASE_S * 1.2, LEASE_S * 1.2, 200)))
        self.trace.append(f"{self.clock()} clock")
        self.world.emit_events()

    def _cancel(self) -> None:
        operation_id = self.rng.choice(self.op_ids)
        try:
            request_cancel(self.store, operation_id, requested_by="alice", reason="simulated change of mind")
        except Crash:
            pass  # the intent was durable before the failpoint
        except JobtrailError as exc:
            self.trace.append(f"{self.clock()} cancel refused: {exc}")
            return
        self.intents += 1
        self.trace.append(f"{self.clock()} cancel {self.op_ids.index(operation_id)}")

    async def _deliver(self, *, forged: bool | None = None) -> None:
        events = self.world.events
        if not events:
            return
        calm = self.world.calm
        index = 0 if calm else self.rng.randrange(len(events))  # out of order
        event_id, _, body = events[index]
        stamp = self.clock() // _US  # senders sign each attempt with its own time (Standard Webhooks)
        if calm or self.rng.random() < 0.7:
            events.pop(index)  # else delivered again later: a duplicate
        forged = (not calm and self.rng.random() < 0.05) if forged is None else forged
        secret = "whsec_" + base64.b64encode(b"x" * 32).decode() if forged else _WHSEC
        headers = signed_headers(secret, event_id, stamp, body)
        status = await self._post_webhook(headers, body)
        self.trace.append(f"{self.clock()} webhook {event_id} -> {status}")
        counts = self.world.counts
        counts["webhooks_forged" if forged else "webhooks_duplicate" if status == 200 else "webhooks_new"] += 1
        if forged and status != 401:
            self.problems.append(f"a forged webhook ({event_id}) was answered {status}, not 401")
        if not forged and status not in (200, 202):
            self.problems.append(f"a genuine webhook ({event_id}) was answered {status}")

    async def _post_webhook(self, headers: Mapping[str, str], body: bytes) -> int:
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {
            "type": "http",
            "method": "POST",
            "path": f"/webhooks/{PROVIDER}",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            "path_params": {"provider": PROVIDER},
            "query_string": b"",
        }
        response = await self.receiver.handle(Request(scope, receive))
        return response.status_code

    async def settle(self, max_rounds: int = 400) -> None:
        """A calm provider, no crashes, one worker: everything that can end, ends."""
        self.world.calm = True
        self.crash_rate = 0.0
        worker = self.new_worker().worker
        for _ in range(max_rounds):
            while self.world.events:
                await self._deliver(forged=False)
            claimed = await worker._claim(100)
            for op in claimed:
                await worker._handle(op)
            if claimed:
                continue
            due = self.store.next_due_us(providers=(PROVIDER,), states=WORKED_STATES)
            if due is None:
                return
            # due but not claimable: a dead worker's lease has not expired yet
            self.clock.advance_to(max(due, self.clock() + _US))
            self.world.emit_events()


# -- the invariants ----------------------------------------------------------------------------


#: how an operation may end once its remote job ended so: collected, or a recorded reason why not
_ENDINGS = {
    "succeeded": {State.SUCCEEDED, State.RESULT_UNAVAILABLE, State.RESULT_VALIDATION_FAILED, State.NEEDS_ATTENTION},
    "failed": {State.FAILED, State.NEEDS_ATTENTION},
    "cancelled": {State.CANCELLED, State.NEEDS_ATTENTION},
}


def _evidence_kinds(store: Store, operation_id: str) -> list[tuple[str, str]]:
    kinds = []
    for entry in store.history(operation_id):
        evidence = json.loads(entry.evidence) if entry.evidence else {}
        kinds.append((entry.actor, str(evidence.get("kind", ""))))
    return kinds


def check(sim: _Sim, ledger: Ledger, log_text: str) -> list[str]:  # noqa: PLR0912, PLR0915 - every invariant
    """Every invariant of the module docstring; returns what was violated (empty: none)."""
    store, world = sim.store, sim.world
    problems: list[str] = list(sim.problems)
    intents = 0
    for index, operation_id in enumerate(sim.op_ids):
        op = store.get(operation_id)
        name = f"operation {index} ({operation_id}, {op.state.value})"
        sent = sim.config["create"]["token"]["in"] != "none"
        token = key_for(op.idempotency_token if sent else "", op.request_body)
        jobs = world.jobs_by_key.get(token, [])
        history = _evidence_kinds(store, operation_id)
        evidence = [kind for _, kind in history]
        intents += history.count(("person:alice", "cancel_intent"))
        if len(jobs) > 1 and token not in world.broken_tokens:
            problems.append(
                f"{name}: {len(jobs)} remote jobs {jobs}; the provider never knowingly broke idempotency for it"
            )
        if world.creates_by_key[token] > evidence.count("create_attempt"):
            problems.append(
                f"{name}: the provider saw {world.creates_by_key[token]} creates but only "
                f"{evidence.count('create_attempt')} attempts were recorded first"
            )
        if op.remote_job_id is not None and op.remote_job_id not in jobs:
            problems.append(f"{name}: remote job id {op.remote_job_id} is not one the provider made for it ({jobs})")
        job = world.jobs.get(op.remote_job_id or "")
        if job is not None and world.cancels_by_job[job.id] > evidence.count("cancel_attempt"):
            problems.append(f"{name}: {world.cancels_by_job[job.id]} cancels sent, fewer attempts recorded")
        remote = job.state(sim.clock()) if job else None
        if op.state is State.SUCCEEDED:
            if job is None or remote != "succeeded":
                problems.append(f"{name}: succeeded but the provider's job is {remote}")
            else:
                try:
                    _, data = read_result(store, operation_id)
                except JobtrailError as exc:
                    problems.append(f"{name}: succeeded but its result cannot be read: {exc}")
                else:
                    if data != job.result_bytes():
                        problems.append(f"{name}: the stored result is not the bytes the provider produced")
        elif op.state is State.CANCELLED and remote != "cancelled":
            # a cancel before any attempt withdraws the create: then no create may have reached the provider
            withdrawn = op.attempts == 0 and job is None and not jobs and world.creates_by_key[token] == 0
            if not withdrawn:
                problems.append(f"{name}: cancelled but the provider's job is {remote}")
        elif op.state is State.FAILED and remote != "failed" and token not in world.rejected_tokens:
            problems.append(f"{name}: failed but the provider neither failed the job ({remote}) nor rejected it")
        elif op.state is State.RESULT_UNAVAILABLE and not (
            (job is not None and job.id in world.undelivered_results)
            or "collect.after_fetch" in sim.crash_points[operation_id]
        ):
            problems.append(f"{name}: result_unavailable, but every fetch was answered and no fetch was lost")
        elif op.state is State.RESULT_VALIDATION_FAILED and (job is None or job.id not in world.corrupt_served):
            problems.append(f"{name}: result_validation_failed but no corrupted result was served")
        if op.state in FINAL_STATES and op.state is not State.SUCCEEDED and not op.state_reason:
            problems.append(f"{name}: ends without a reason")
        if remote in _ENDINGS and op.state not in _ENDINGS[remote]:
            problems.append(f"{name}: the remote job {remote}, but the operation ended {op.state.value}")
        if op.state not in FINAL_STATES and op.state is not State.NEEDS_ATTENTION:
            problems.append(f"{name}: still {op.state.value} after the provider calmed down ({op.state_reason})")
        if op.state is State.NEEDS_ATTENTION and not op.state_reason:
            problems.append(f"{name}: needs attention without saying why")
    errors = [line for line in log_text.splitlines() if " failed in " in line or "could not" in line]
    if errors:
        problems.append(
            f"{len(errors)} unexpected error(s) in worker actions (provider misbehaviour must be recorded as a "
            f"fact, not raised): {errors[0]}"
        )
    if intents != sim.intents:
        problems.append(f"{sim.intents} cancel requests made, {intents} in the histories")
    report = verify(store)
    if not report.ok:
        problems.append(f"audit verify failed: {report}")
    store.close()
    forms = {world.canary, base64.b64encode(world.canary.encode()).decode()[:16], urllib.parse.quote(world.canary)}
    problems += [f"canary secret ({form!r}) in {where}" for form in forms for where in ledger.holding(form)]
    problems += [f"canary secret ({form!r}) in the log" for form in forms if form in log_text]
    return problems


# -- running many seeds ------------------------------------------------------------------------


def _work_dir() -> Path:
    shm = Path("/dev/shm")  # noqa: S108 - a private mkdtemp below; tmpfs spares the fsyncs
    return Path(tempfile.mkdtemp(prefix="jobtrail-sim-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.buffer = io.StringIO()

    def emit(self, record: logging.LogRecord) -> None:
        self.buffer.write(self.format(record) + "\n")


def run_seed(
    seed: int, *, work: Path | None = None, db: str | None = None, max_steps: int = 300, ignore_keys: bool = False
) -> SeedReport:
    """Run one seed to the end and check the invariants (on SQLite, or on PostgreSQL at ``db``)."""
    started = time.perf_counter()
    own = work is None and db is None
    if db is None:
        work = work or _work_dir()
        ledger: Ledger = SqliteLedger(work, seed)
    else:
        ledger = PostgresLedger(db, seed)
    install_log_redaction()
    capture = _Capture()
    _log.addHandler(capture)
    old_level = _log.level
    _log.setLevel(logging.INFO)
    sim = _Sim(seed, ledger.url, migrate=ledger.migrate, ignore_keys=ignore_keys)
    try:
        # ids and tokens too, so claim order replays on every engine
        with _failpoints.failpoint_handler(sim._failpoint), _ids.seeded_entropy(Random(seed).getrandbits):
            steps = asyncio.run(_drive(sim, max_steps))
        violations = check(sim, ledger, capture.buffer.getvalue())
    finally:
        _log.removeHandler(capture)
        _log.setLevel(old_level)
        sim.store.close()
        ledger.drop()
        if own and work is not None:
            shutil.rmtree(work, ignore_errors=True)
            SqliteLedger.templates.pop(str(work), None)
    return SeedReport(
        seed=seed,
        violations=violations,
        trace_hash=hashlib.sha256("\n".join(sim.trace).encode()).hexdigest()[:16],
        steps=steps,
        crashes=sim.crashes,
        stale=sim.stale,
        final=sim.final,
        faults=Counter(sim.world.counts),
        elapsed_s=time.perf_counter() - started,
        trace=sim.trace,
        notes=sim.notes,
        ignore_keys=ignore_keys,
        db=db,
    )


async def _drive(sim: _Sim, max_steps: int) -> int:
    steps = await sim.run(max_steps)
    sim.stale += sum(w.worker.stats.stale for w in sim.workers)
    await sim.settle()
    ops = [sim.store.get(i) for i in sim.op_ids]
    sim.final = Counter(op.state.value for op in ops)
    sim.notes = [f"{op.operation_id} {op.state.value}: {op.state_reason}" for op in ops]
    return steps


def run_seeds(
    seeds: range, *, on_report: Any = None, db: str | None = None, ignore_keys: bool = False, keep: bool = True
) -> list[SeedReport]:
    """Run many seeds (in one work directory on SQLite); returns every report (none unless ``keep``)."""
    work = _work_dir()
    reports = []
    try:
        for seed in seeds:
            report = run_seed(seed, work=work, db=db, ignore_keys=ignore_keys)
            if keep:
                reports.append(report)
            if on_report is not None:
                on_report(report)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        SqliteLedger.templates.pop(str(work), None)
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jobtrail.testing.simulation",
        description="Run seeded fault schedules against the real worker and ledger and check the invariants.",
    )
    parser.add_argument("--seeds", type=int, default=1000, help="how many seeds to run (default 1000)")
    parser.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--seed", type=int, help="run this one seed (replay)")
    parser.add_argument("--verbose", action="store_true", help="print each seed's whole trace and outcomes")
    parser.add_argument(
        "--ignore-keys",
        action="store_true",
        help="simulate a provider that silently ignores idempotency keys (shows the checker catching duplicates)",
    )
    parser.add_argument("--db", help="run on PostgreSQL at this URL (a schema per seed) instead of SQLite")
    args = parser.parse_args(argv)
    seeds = range(args.seed, args.seed + 1) if args.seed is not None else range(args.start, args.start + args.seeds)
    failed: list[SeedReport] = []
    finals: Counter[str] = Counter()
    requests: Counter[str] = Counter()
    crashes = stale = 0
    started = time.perf_counter()

    def on_report(report: SeedReport) -> None:
        nonlocal crashes, stale
        finals.update(report.final)
        requests.update(report.faults)
        crashes += report.crashes
        stale += report.stale
        if args.verbose:
            print("\n".join(report.trace))
            print(f"seed {report.seed}: {report.steps} steps, trace {report.trace_hash}, final {dict(report.final)}")
            for line in report.notes:
                print(f"  {line}")
        if report.violations:
            failed.append(report)
            print(f"seed {report.seed}: {len(report.violations)} invariant violation(s)", file=sys.stderr)
            for problem in report.violations:
                print(f"  - {problem}", file=sys.stderr)
            print(f"  replay: {report.replay_command()}", file=sys.stderr)

    # reports are summed as they come: 100,000 seeds need no more memory than one
    run_seeds(seeds, on_report=on_report, db=args.db, ignore_keys=args.ignore_keys, keep=False)
    elapsed = time.perf_counter() - started
    print(
        f"{len(seeds)} seeds in {elapsed:.1f} s ({len(seeds) / elapsed:.1f} seeds/s); "
        f"{sum(finals.values())} operations, {crashes} simulated crashes, {stale} writes refused for a lost lease; "
        f"{len(failed)} seed(s) violated an invariant"
    )
    print(f"final states: {dict(sorted(finals.items()))}")
    print(f"provider saw: {dict(sorted(requests.items()))}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
