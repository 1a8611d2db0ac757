"""Webhook receiver (ASGI, Starlette): verified, de-duplicated, and never trusted alone.

``POST /webhooks/{provider}`` takes Standard Webhooks deliveries. An event is
verified (``webhook-id``, ``webhook-timestamp`` within the tolerance,
``webhook-signature`` v1 HMAC-SHA256 over the exact bytes, against every
active secret so keys can rotate), recorded once per event id (a uniqueness
constraint: two receivers racing store one), matched to an operation by remote
job id or client reference, and then only brings that operation's next poll
forward. A webhook never ends an operation: the status query that follows does.

Unknown jobs: the event is accepted and kept as an orphan; when an operation
later learns that job id, its orphan events are attached to it and its first
poll is brought forward. (Refusing them would make the provider retry for days
an event we may need minutes later, after a lost create response is reconciled.)
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from jobtrail.domain.canonical import compact_json, parse_json, rfc3339
from jobtrail.domain.errors import ConfigError, StorageError, require_extra
from jobtrail.domain.jsonpath import extract
from jobtrail.domain.redact import Secret
from jobtrail.flows.observe import pull_poll_forward
from jobtrail.ledger import schema as t
from jobtrail.ledger.offload import Offload, threads
from jobtrail.ledger.store import Store
from jobtrail.providers.config import Section

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse

# Starlette and standardwebhooks come with the ``webhooks`` extra and are imported where the
# receiver runs: a worker reading a provider file's [webhooks] table needs neither.

log = logging.getLogger("jobtrail")
_US = 1_000_000


@dataclass(frozen=True, slots=True)
class WebhookConfig:
    """The ``[webhooks]`` table of a provider file."""

    secrets: tuple[str, ...]
    tolerance_s: float = 300.0
    max_bytes: int = 1024 * 1024
    retention_s: float = 7 * 86400.0
    job_id: str = "$.data.id"
    reference: str | None = None
    event_type: str = "$.type"
    #: the longest a delivery may take to arrive whole (a slow drip is cut off, not waited for)
    read_timeout_s: float = 10.0

    def resolve_secrets(self) -> list[Secret]:
        from jobtrail.providers.http import Credential

        return [Credential(ref, "bearer").resolve() for ref in self.secrets]


def parse_webhooks(section: Section) -> WebhookConfig:
    section.choice("scheme", ("standard",), "standard")
    secrets = section.strings("secrets", "a list of secret references (env:NAME, file:PATH, keyring:S/U)")
    for ref in secrets:
        if ref.split(":", 1)[0] not in ("env", "file", "keyring"):
            section.fail("secrets", "references such as env:WHSEC_CURRENT, never the secret itself", "<hidden>")
    config = WebhookConfig(
        secrets=tuple(secrets),
        tolerance_s=section.number("tolerance_s", "seconds", 300.0, minimum=1),
        max_bytes=int(section.number("max_bytes", "bytes", 1024 * 1024, minimum=1)),
        retention_s=section.number("retention_days", "days (at least the provider's retry horizon)", 7.0, minimum=0.001)
        * 86400,
        job_id=section.text("job_id", "a JSON path to the job id in the event", "$.data.id"),
        reference=section.text("reference", "a JSON path to our client reference in the event", None),
        event_type=section.text("type", "a JSON path to the event type", "$.type"),
        read_timeout_s=section.number("read_timeout_s", "seconds to receive a whole delivery", 10.0, minimum=0.1),
    )
    section.done()
    return config


class Refused(Exception):
    def __init__(self, status: int, title: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.title, self.detail = status, title, detail


def problem(status: int, title: str, detail: str, **extra: Any) -> JSONResponse:
    """An RFC 9457 problem body."""
    from starlette.responses import JSONResponse

    return JSONResponse(
        {"type": "about:blank", "title": title, "status": status, "detail": detail, **extra},
        status_code=status,
        media_type="application/problem+json",
    )


#: a Unix time in seconds (12 digits reach the year 33658; more is an attack, not a clock)
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_MAX_ID = 256
_MAX_SIGNATURES = 8192


def check_headers(headers: Mapping[str, str], tolerance_s: float, now_s: float) -> tuple[str, int, str]:
    """What can be refused before the body is read: returns (event id, timestamp, signatures)."""
    event_id = headers.get("webhook-id")
    stamp = headers.get("webhook-timestamp")
    signatures = headers.get("webhook-signature")
    if not event_id or not stamp or not signatures:
        raise Refused(401, "missing signature", "webhook-id, webhook-timestamp and webhook-signature are required")
    if "." in event_id or len(event_id) > _MAX_ID or not _TIMESTAMP.fullmatch(stamp):
        raise Refused(
            401,
            "bad signature headers",
            f"webhook-id must not contain '.' (at most {_MAX_ID} characters); webhook-timestamp is Unix seconds",
        )
    if len(signatures) > _MAX_SIGNATURES:
        raise Refused(401, "bad signature headers", f"webhook-signature is over {_MAX_SIGNATURES} characters")
    timestamp = int(stamp)
    if abs(now_s - timestamp) > tolerance_s:
        raise Refused(
            401,
            "timestamp outside tolerance",
            f"the delivery is {abs(now_s - timestamp):.0f} s from now (tolerance {tolerance_s:.0f} s)",
        )
    return event_id, timestamp, signatures


def verify(
    body: bytes, headers: Mapping[str, str], secrets: Sequence[Secret], tolerance_s: float, now_s: float
) -> tuple[str, int]:
    """Check a Standard Webhooks delivery; returns (event id, timestamp) or raises :class:`Refused`."""
    event_id, timestamp, signatures = check_headers(headers, tolerance_s, now_s)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise Refused(400, "malformed body", "the body is not UTF-8") from None
    offered = []
    for token in signatures.split():
        version, _, value = token.partition(",")
        if version == "v1" and value:
            try:
                offered.append(base64.b64decode(value, validate=True))
            except ValueError:
                continue
    from standardwebhooks import Webhook

    when = datetime.fromtimestamp(timestamp, tz=UTC)
    for secret in secrets:
        try:
            expected = base64.b64decode(Webhook(secret.reveal()).sign(event_id, when, text).partition(",")[2])
        except Exception as exc:  # a malformed secret must not take the receiver down
            log.warning("a configured webhook secret cannot be used (%s); check its value", type(exc).__name__)
            continue
        if any(hmac.compare_digest(expected, candidate) for candidate in offered):
            return event_id, timestamp
    raise Refused(401, "bad signature", "no v1 signature matches an active secret")


class Receiver:
    """Records verified events and brings polls forward.

    Storage work runs off the event loop (``io``), so a database wait never
    stalls the other deliveries this receiver is answering.
    """

    def __init__(self, store: Store, configs: Mapping[str, WebhookConfig], *, io: Offload = threads) -> None:
        self.store = store
        self.io = io
        self.configs = dict(configs)
        self._secrets = {name: cfg.resolve_secrets() for name, cfg in self.configs.items()}

    async def handle(self, request: Request) -> JSONResponse:
        name = request.path_params["provider"]
        config = self.configs.get(name)
        if config is None:
            return problem(404, "unknown provider", f"no webhooks are configured for provider {name!r}")
        try:
            # unsigned, malformed or stale deliveries are refused before a byte of the body is read
            check_headers(request.headers, config.tolerance_s, self.store.clock() / _US)
            try:
                body = await asyncio.wait_for(_read_limited(request, config.max_bytes), config.read_timeout_s)
            except TimeoutError:
                raise Refused(
                    408, "request timeout", f"the body did not arrive within {config.read_timeout_s:g} s"
                ) from None
            event_id, timestamp = verify(
                body, request.headers, self._secrets[name], config.tolerance_s, self.store.clock() / _US
            )
            try:
                event = parse_json(body)
            except ValueError:
                raise Refused(400, "malformed JSON", "the body is not valid JSON") from None
            return await self.io(self._record, name, config, event_id, timestamp, event)
        except Refused as no:
            try:
                await self.io(self._refused, name, no)
            except StorageError as exc:
                log.error("could not count a refused webhook: %s", exc)
            return problem(no.status, no.title, no.detail)
        except StorageError as exc:
            # nothing was recorded; a 503 makes the provider deliver the event again later
            log.error("webhook for provider %s not recorded: %s", name, exc)
            return problem(503, "storage unavailable", "the event could not be recorded now; deliver it again later")

    def _refused(self, provider: str, no: Refused) -> None:
        # an audit line and a counter; never the body
        log.warning("webhook refused for provider %s: %s (%s)", provider, no.title, no.detail)
        with self.store._errors("counting a refused webhook"), self.store.engine.begin() as conn:
            done = conn.execute(
                sa.update(t.webhook_rejections)
                .where(t.webhook_rejections.c.provider == provider, t.webhook_rejections.c.reason == no.title)
                .values(count=t.webhook_rejections.c.count + 1, last_at_us=self.store.clock())
            ).rowcount
            if not done:
                conn.execute(
                    sa.insert(t.webhook_rejections),
                    {"provider": provider, "reason": no.title, "count": 1, "last_at_us": self.store.clock()},
                )

    def _record(self, provider: str, config: WebhookConfig, event_id: str, timestamp: int, event: Any) -> JSONResponse:
        from starlette.responses import JSONResponse

        store = self.store
        now = store.clock()
        job_id = extract(config.job_id, event, {})
        reference = extract(config.reference, event, {}) if config.reference else None
        event_type = extract(config.event_type, event, {})
        op = _match(store, provider, job_id, reference)
        row = {
            "provider": provider,
            "event_id": event_id,
            "received_at_us": now,
            "provider_time": timestamp,
            "event_type": event_type,
            "remote_job_id": job_id,
            "operation_id": op.operation_id if op else None,
            "body": compact_json(store.redactor.value(event)),
            "expires_at_us": now + int(config.retention_s * _US),
        }
        try:
            with store._errors("recording a webhook"), store.engine.begin() as conn:
                conn.execute(sa.delete(t.webhook_events).where(t.webhook_events.c.expires_at_us < now))
                conn.execute(sa.insert(t.webhook_events), row)
        except Exception as exc:
            if isinstance(exc.__cause__, sa.exc.IntegrityError):
                return JSONResponse({"status": "duplicate", "event_id": event_id}, status_code=200)
            raise
        if op is None:
            return JSONResponse(
                {
                    "status": "orphan",
                    "event_id": event_id,
                    "detail": "no operation knows this job yet; the event is kept",
                },
                status_code=202,
            )
        stale = self._newest_known(op.operation_id, event_id) > timestamp
        store.add_observation(
            op.operation_id,
            kind="webhook",
            raw={"event_id": event_id, "type": event_type, "stale": stale, "event": event},
            provider_time=rfc3339(timestamp * _US),
            remote_state=None,
            raw_state=event_type,
        )
        if not stale:
            pull_poll_forward(store, op.operation_id)
        return JSONResponse(
            {"status": "accepted", "event_id": event_id, "operation_id": op.operation_id, "stale": stale},
            status_code=202,
        )

    def _newest_known(self, operation_id: str, event_id: str) -> int:
        with self.store._read() as conn:
            newest = conn.execute(
                sa.select(sa.func.max(t.webhook_events.c.provider_time)).where(
                    t.webhook_events.c.operation_id == operation_id, t.webhook_events.c.event_id != event_id
                )
            ).scalar()
        return int(newest or 0)


def _match(store: Store, provider: str, job_id: str | None, reference: str | None) -> Any:
    ops = t.operations.c
    conditions = []
    if job_id:
        conditions.append(ops.remote_job_id == job_id)
    if reference:
        conditions.append(ops.idempotency_token == reference)
    if not conditions:
        return None
    with store._read() as conn:
        row = conn.execute(sa.select(ops.operation_id).where(ops.provider == provider, sa.or_(*conditions))).first()
    return None if row is None else store.get(row.operation_id)


async def _read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise Refused(413, "payload too large", f"the body is over {limit} bytes")
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise Refused(413, "payload too large", f"the body is over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def webhook_app(store: Store, configs: Mapping[str, WebhookConfig], *, io: Offload = threads) -> Starlette:
    """The ASGI app: mount it in your own app, or run ``jobtrail webhooks serve``."""
    require_extra("webhooks", "the webhook receiver", "starlette", "standardwebhooks")
    from starlette.applications import Starlette
    from starlette.routing import Route

    if not configs:
        raise ConfigError('no provider declares [webhooks]; add secrets = ["env:NAME"] to a provider file')
    receiver = Receiver(store, configs, io=io)
    return Starlette(routes=[Route("/webhooks/{provider}", receiver.handle, methods=["POST"])])
