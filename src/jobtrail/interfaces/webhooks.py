"""Webhook receiver (ASGI, Starlette): verified, de-duplicated, and never trusted alone.

``GET /healthz`` answers 200 while the database is reachable and its schema current, else 503.
``POST /webhooks/{provider}`` takes Standard Webhooks deliveries. An event is
verified (``webhook-id``, ``webhook-timestamp`` within the tolerance,
``webhook-signature`` v1 HMAC-SHA256 over the exact bytes, against every
active secret so keys can rotate), recorded once per event id (a uniqueness
constraint: two receivers racing store one), matched to an operation by remote
job id or client reference, and then only brings that operation's next poll
forward. A webhook never ends an operation: the status query that follows does.
The event, its observation and the poll brought forward are written in one
transaction: a delivery answered 503 left nothing behind, and its redelivery is
recorded whole.

Bodies are read whole before their signature can be checked, so what they may
hold at once is capped across all requests, counted as they arrive
(:class:`InFlight`); a delivery whose bytes find no room is answered 503 with
``Retry-After``, and the rest of its body is not read.

Unknown jobs: the event is accepted and kept as an orphan; when an operation
later learns that job id, its orphan events are attached to it and its first
poll is brought forward. (Refusing them would make the provider retry for days
an event we may need minutes later, after a lost create response is reconciled.)
An event that arrives while its operation is learning the job id is not lost
between the two: the operation records the job id, then looks for orphans; the
receiver records the orphan, then looks for the job id again. Whichever looks
second sees the other's write, on SQLite and PostgreSQL alike.

What is stored is masked with the provider's own credential too (its
``credential``, read here though this process never sends it), as everywhere
the ledger keeps what a provider sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

from jobtrail.domain.canonical import compact_json, parse_answer, rfc3339
from jobtrail.domain.errors import ConfigError, StorageError, require_extra
from jobtrail.domain.jsonpath import extract
from jobtrail.domain.record import Operation
from jobtrail.flows.observe import poll_now
from jobtrail.flows.telemetry import webhook_received, webhook_refused, webhook_span
from jobtrail.interfaces.health import health_response
from jobtrail.ledger.offload import Offload, threads
from jobtrail.ledger.store import Observe, Reschedule, Store
from jobtrail.ledger.webhook_events import Filing, Kept, attach_event, count_refusals, match_operation, record_event
from jobtrail.providers.http import CREDENTIAL_TTL_S
from jobtrail.providers.webhooks import CredentialsToMask, Refused, WebhookConfig, check_headers, verify

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

# Starlette comes with the ``webhooks`` extra and is imported where the receiver runs: a worker reading a
# provider file's [webhooks] table does not need it. (Signatures are checked with the standard library's hmac,
# over the body's bytes as they came: see providers.webhooks.verify.)

log = logging.getLogger("jobtrail")
_US = 1_000_000
#: how often refused deliveries are counted in the ledger (see :class:`Refusals`)
REFUSAL_FLUSH_S = 1.0
#: the most bytes of delivery bodies a receiver holds at once, all its requests together (see :class:`InFlight`):
#: 32 deliveries of the largest size by default, thousands of the few kilobytes most providers send
MAX_BYTES_IN_FLIGHT = 32 * 1024 * 1024


def problem(status: int, title: str, detail: str, *, retry_after_s: int | None = None) -> JSONResponse:
    """An RFC 9457 problem body (with ``Retry-After`` when the refusal says when to come back)."""
    from starlette.responses import JSONResponse

    return JSONResponse(
        {"type": "about:blank", "title": title, "status": status, "detail": detail},
        status_code=status,
        media_type="application/problem+json",
        headers=None if retry_after_s is None else {"Retry-After": str(retry_after_s)},
    )


class InFlight:
    """The bytes of delivery bodies held at once, across every request a receiver is answering.

    A delivery's body is read whole before its signature can be checked, so anyone who can reach the receiver
    could make it hold ``max_bytes`` for each connection they opened, with no limit on how many (300 held
    390 MiB, 1,500 held 1.6 GiB). Room is taken for each piece of a body as it arrives, and given back when
    its request is answered; a delivery whose next piece finds no room is answered 503 with ``Retry-After``
    and the rest of its body is not read. (Taken for what a body declares, before a byte of it came, 32
    connections declaring 1 MiB and sending nothing shut every delivery out.)
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()  # (one loop as a rule; a host may run requests on loops of their own)

    def take(self, size: int, retry_after_s: int) -> int:
        """Hold ``size`` bytes for one body; returns them (to give back), or raises :class:`Refused`."""
        with self._lock:
            if self.held + size > self.limit:
                raise Refused(
                    503,
                    "receiver busy",
                    f"the receiver holds as many delivery bodies as it may ({self.limit} bytes); deliver it "
                    f"again in {retry_after_s} s",
                    retry_after_s=retry_after_s,
                )
            self.held += size
        return size

    def give_back(self, size: int) -> None:
        with self._lock:
            self.held -= size


class Receiver:
    """Records verified events and brings polls forward.

    Storage work runs off the event loop (``io``), so a database wait never
    stalls the other deliveries this receiver is answering.
    """

    def __init__(
        self,
        store: Store,
        configs: Mapping[str, WebhookConfig],
        *,
        io: Offload = threads,
        max_bytes_in_flight: int = MAX_BYTES_IN_FLIGHT,
    ) -> None:
        self.store = store
        self.io = io
        self.configs = dict(configs)
        #: each provider's signing keys, decoded once (as they were checked)
        self._keys = {name: cfg.signing_keys(store.redactor) for name, cfg in self.configs.items()}
        # (never less than the largest delivery: one of those must fit when nothing else is held)
        self.in_flight = InFlight(max(max_bytes_in_flight, *(cfg.max_bytes for cfg in self.configs.values())))
        #: the providers' own credentials: an event may echo one, and this process sends none that would
        #: teach the ledger's redactor its value
        self.credentials = CredentialsToMask(
            {name: cfg.provider_credentials for name, cfg in self.configs.items()},
            store.redactor,
            refresh_s=CREDENTIAL_TTL_S,
        )
        self.refusals = Refusals(store, io=io)

    async def handle(self, request: Request) -> JSONResponse:
        name = request.path_params["provider"]
        config = self.configs.get(name)
        if config is None:
            return problem(404, "unknown provider", f"no webhooks are configured for provider {name!r}")
        held = 0
        try:
            # unsigned, malformed or stale deliveries are refused before a byte of the body is read
            check_headers(request.headers, config.tolerance_s, self.store.clock() / _US)
            _check_size(request, config.max_bytes)
            retry_s = math.ceil(config.read_timeout_s)

            # room for each piece as it comes: by the time room is free again, every body held now has arrived
            # whole or been cut off (read_timeout_s)
            def room(size: int) -> None:
                nonlocal held
                held += self.in_flight.take(size, retry_s)

            try:
                body = await asyncio.wait_for(_read_limited(request, config.max_bytes, room), config.read_timeout_s)
            except TimeoutError:
                raise Refused(
                    408, "request timeout", f"the body did not arrive within {config.read_timeout_s:g} s"
                ) from None
            event_id, timestamp = verify(
                body, request.headers, self._keys[name], config.tolerance_s, self.store.clock() / _US
            )
            try:
                event = parse_answer(body)
            except ValueError as exc:
                raise Refused(400, "malformed JSON", f"the body is not JSON that can be kept ({exc})") from None
            return await self.io(self._record, name, config, event_id, timestamp, event)
        except Refused as no:
            webhook_refused(name, no.title)
            await self.refusals.add(name, no)
            return problem(no.status, no.title, no.detail, retry_after_s=no.retry_after_s)
        except StorageError as exc:
            # nothing was recorded (an event is recorded and filed under its operation in one transaction), or
            # an event was kept as an orphan and not yet filed under the operation found for it since: its
            # redelivery files it. Either way a 503 makes the provider deliver the event again later
            log.error("webhook for provider %s not recorded: %s", name, exc)
            return problem(503, "storage unavailable", "the event could not be recorded now; deliver it again later")
        finally:
            self.in_flight.give_back(held)

    def _record(self, provider: str, config: WebhookConfig, event_id: str, timestamp: int, event: Any) -> JSONResponse:
        self.credentials.refresh()  # (read again now and then: a rotated credential is masked too)
        redactor = self.store.redactor
        if redactor.looks_like_credential(event_id):
            # the id is the key deliveries are told apart by, kept and shown as it came: masked, two
            # different ids could read the same; so nothing of such a delivery is kept
            raise Refused(
                400,
                "credential in the event id",
                "the webhook-id header carries what looks like a credential; nothing of this delivery was kept",
            )
        job_id = extract(config.job_id, event, {}, redactor)
        reference = extract(config.reference, event, {}, redactor) if config.reference else None
        op = match_operation(self.store, provider, job_id, reference)
        with webhook_span(provider, op) as span:
            outcome, response = self._keep(provider, config, event_id, timestamp, event, op, job_id, reference)
            if span.is_recording():
                span.set_attribute("jobtrail.webhook.outcome", outcome)
        webhook_received(provider, outcome)
        return response

    def _keep(
        self,
        provider: str,
        config: WebhookConfig,
        event_id: str,
        timestamp: int,
        event: Any,
        op: Operation | None,
        job_id: str | None,
        reference: str | None,
    ) -> tuple[str, JSONResponse]:
        from starlette.responses import JSONResponse

        store = self.store
        now = store.clock()
        event_type = extract(config.event_type, event, {}, store.redactor)
        row = {
            "provider": provider,
            "event_id": event_id,
            "received_at_us": now,
            "provider_time": timestamp,
            "event_type": event_type,
            "remote_job_id": job_id,
            "operation_id": op.operation_id if op else None,
            "body": compact_json(store.redactor.answer(event)),
            "expires_at_us": now + int(config.retention_s * _US),
        }
        filing = self._filing(event_id, timestamp, event_type, event)
        kept = record_event(store, row, filing)
        if kept.operation_id is not None:
            return _filed(event_id, kept) if kept.new else _duplicate(event_id)
        # Kept as an orphan, now or by an earlier delivery of it (which may have failed after keeping it, before
        # filing it under the operation it found then: its 503 sent the provider here, to finish it).
        # Looked for before the event was stored: an operation may have learned this job id since, and looked
        # for its orphans before this one was stored. It wrote the job id, then looked for orphans; this wrote
        # the orphan, then looks for the job id: one of the two sees the other.
        op = op or match_operation(store, provider, job_id, reference)
        if op is None:
            if not kept.new:
                return _duplicate(event_id)
            return "orphan", JSONResponse(
                {
                    "status": "orphan",
                    "event_id": event_id,
                    "detail": "no operation knows this job yet; the event is kept",
                },
                status_code=202,
            )
        attached = attach_event(store, provider, event_id, timestamp, op.operation_id, filing)
        if attached is None:
            if not kept.new:
                return _duplicate(event_id)
            # the operation's adoption took it first: it recorded the adoption and brought the poll forward
            return "accepted", JSONResponse(
                {"status": "accepted", "event_id": event_id, "operation_id": op.operation_id, "adopted": True},
                status_code=202,
            )
        return _filed(event_id, attached)

    def _filing(self, event_id: str, timestamp: int, event_type: str | None, event: Any) -> Filing:
        """What filing the event under an operation writes, in the transaction that records the event: its
        observation, and (unless it is older than one filed already) the operation's next poll made due now,
        if the operation is watched. The event decides nothing more: the status query that follows does."""
        store = self.store

        def writes(op: Operation, stale: bool) -> list[Observe | Reschedule]:
            observed: list[Observe | Reschedule] = [
                Observe(
                    operation_id=op.operation_id,
                    kind="webhook",
                    raw={"event_id": event_id, "type": event_type, "stale": stale, "event": event},
                    provider_time=rfc3339(timestamp * _US),
                    remote_state=None,
                    raw_state=event_type,
                )
            ]
            write = None if stale else poll_now(op, store.clock())
            return observed if write is None else [*observed, write]

        return writes


def _filed(event_id: str, kept: Kept) -> tuple[str, JSONResponse]:
    from starlette.responses import JSONResponse

    return "stale" if kept.stale else "accepted", JSONResponse(
        {"status": "accepted", "event_id": event_id, "operation_id": kept.operation_id, "stale": kept.stale},
        status_code=202,
    )


def _duplicate(event_id: str) -> tuple[str, JSONResponse]:
    from starlette.responses import JSONResponse

    return "duplicate", JSONResponse({"status": "duplicate", "event_id": event_id}, status_code=200)


class Refusals:
    """Refused deliveries, counted in the ledger at most once every :data:`REFUSAL_FLUSH_S`.

    Anyone who can reach the receiver can send deliveries that fail verification. Counted one by one,
    each was a transaction of its own, and a flood of them queued on the database's write lock (SQLite
    has one) ahead of the workers' writes; logged one by one, it buried the log. Here a flood costs one
    write and one log line per reason a second, whatever its rate. A count not yet written when the
    process stops is written at its shutdown (``jobtrail webhooks serve``, or the app's lifespan);
    mounted in another app without it, at most the last second's counts are lost (never an event:
    those are recorded before their answer).
    """

    def __init__(self, store: Store, *, io: Offload = threads) -> None:
        self.store = store
        self.io = io
        #: (provider, reason) -> (refused since the last write, the first one's detail): a provider the
        #: receiver serves (an unknown one is answered 404 first) and a reason of ours, so a few keys at most
        self._pending: dict[tuple[str, str], tuple[int, str]] = {}
        self._written_at = -math.inf  # (time.monotonic())
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writing: asyncio.Task[None] | None = None

    async def add(self, provider: str, no: Refused) -> None:
        """One more refused delivery (never its body). The first of a second is written before its answer;
        the others of that second wait for the next write, a second after it."""
        count, detail = self._pending.get((provider, no.title), (0, no.detail))
        self._pending[(provider, no.title)] = (count + 1, detail)
        loop = asyncio.get_running_loop()
        wait = self._written_at + REFUSAL_FLUSH_S - time.monotonic()
        if wait <= 0 and not self._busy(loop):
            if self._timer is not None and self._loop is loop:
                self._timer.cancel()
            self._timer, self._loop = None, loop
            await asyncio.shield(self._start_write(loop))  # (a client gone meanwhile does not stop the count)
        elif self._timer is None or self._loop is not loop:
            # (a timer left on another loop, one request's in some hosts, may never fire: that loop may be gone)
            self._loop = loop
            self._later(max(0.0, wait))

    def _busy(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Is a write under way on ``loop``? One at a time: what comes during a slow one (a locked database)
        goes with the next."""
        return self._writing is not None and not self._writing.done() and self._writing.get_loop() is loop

    def _later(self, wait: float) -> None:
        assert self._loop is not None
        # in a context of its own: not the request's that happened to come first (its log context, its span)
        self._timer = self._loop.call_later(wait, self._flush, context=contextvars.Context())

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            return  # a timer on a loop since replaced: the new loop's timer writes these
        self._timer = None
        if self._busy(loop):
            self._later(REFUSAL_FLUSH_S)
        elif self._pending:
            self._start_write(loop)

    def _start_write(self, loop: asyncio.AbstractEventLoop) -> asyncio.Task[None]:
        self._writing = loop.create_task(self._write(self._take()))
        return self._writing

    async def _written(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait out the write under way on ``loop``, if any."""
        if self._busy(loop):
            assert self._writing is not None
            await self._writing

    def _take(self) -> dict[tuple[str, str], int]:
        """What is pending, logged (a line for each reason) and taken to be written."""
        self._written_at = time.monotonic()
        pending, self._pending = self._pending, {}
        for (provider, reason), (count, detail) in pending.items():
            log.warning(
                "webhook refused for provider %s: %s (%s)%s",
                provider,
                reason,
                detail,
                f", and {count - 1} more for that reason within {REFUSAL_FLUSH_S:g} s" if count > 1 else "",
            )
        return {key: count for key, (count, _) in pending.items()}

    async def _write(self, counts: dict[tuple[str, str], int]) -> None:
        try:
            await self.io(count_refusals, self.store, counts)
        except Exception as exc:  # counters: never worth failing a request or the receiver's shutdown over
            log.error("could not count %d refused webhooks: %s", sum(counts.values()), exc)

    async def close(self) -> None:
        """Write what is counted and not yet written (at the receiver's shutdown; a host app that mounts the
        receiver runs the receiver's lifespan from its own, see the README)."""
        loop = asyncio.get_running_loop()
        await self._written(loop)
        if self._timer is not None and self._loop is loop:
            self._timer.cancel()
        self._timer, self._loop = None, loop
        self._flush()
        await self._written(loop)


def _check_size(request: Request, limit: int) -> None:
    """413 for a body whose ``Content-Length`` is past ``limit``, before a byte of it is read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Refused(413, "payload too large", f"the body is over {limit} bytes")


async def _read_limited(request: Request, limit: int, room: Callable[[int], None]) -> bytes:
    from starlette.requests import ClientDisconnect

    body, chunk = bytearray(), b""
    try:
        # (closed however the read ends: a stream left waiting for its next chunk holds its last one)
        async with contextlib.aclosing(request.stream()) as stream:
            async for chunk in stream:
                if len(body) + len(chunk) > limit:
                    raise Refused(413, "payload too large", f"the body is over {limit} bytes")
                room(len(chunk))
                body += chunk
        return bytes(body)
    except ClientDisconnect as gone:
        traceback.clear_frames(gone.__traceback__)  # (the stream's, which holds the last chunk: see below)
        # a refusal like the others (counted, a log line a second at most), not an error with a traceback
        # each: anyone can hang up halfway through a body, as often as they like
        raise Refused(
            400, "client disconnected", "the client closed the connection before the whole body arrived"
        ) from None
    finally:
        # What was read is let go now, however the read ends. An error's traceback keeps this frame, and
        # asyncio.wait_for keeps the error in a reference cycle that only the garbage collector's full pass,
        # which megabytes of bytes do not bring on, breaks: clients hanging up halfway through their bodies
        # grew the receiver by what it had read of them, round after round (35 MiB for every 300)
        body.clear()
        chunk = b""  # (the last chunk, up to 64 KiB, likewise)


def webhook_app(
    store: Store,
    configs: Mapping[str, WebhookConfig],
    *,
    io: Offload = threads,
    max_bytes_in_flight: int = MAX_BYTES_IN_FLIGHT,
) -> Starlette:
    """The ASGI app: mount it in your own app, or run ``jobtrail webhooks serve``.

    ``max_bytes_in_flight``: the most bytes of delivery bodies held at once (see :class:`InFlight`); never less
    than the largest ``max_bytes``."""
    require_extra("webhooks", "the webhook receiver", "starlette")
    from starlette.applications import Starlette
    from starlette.routing import Route

    if not configs:
        raise ConfigError('no provider declares [webhooks]; add secrets = ["env:NAME"] to a provider file')
    receiver = Receiver(store, configs, io=io, max_bytes_in_flight=max_bytes_in_flight)

    def healthz(request: Request) -> Response:  # sync: Starlette runs it in its thread pool, off the loop
        return health_response(store)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await receiver.refusals.close()

    return Starlette(
        routes=[
            Route("/webhooks/{provider}", receiver.handle, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
