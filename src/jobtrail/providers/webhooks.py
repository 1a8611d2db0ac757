"""Webhooks as a provider declares them: the ``[webhooks]`` table, and verification of a delivery.

Standard Webhooks: ``webhook-id``, ``webhook-timestamp`` within the tolerance,
``webhook-signature`` v1 HMAC-SHA256 over the exact bytes, against every active
secret so keys can rotate. Receiving a delivery is
:mod:`jobtrail.interfaces.webhooks`; recording it, :mod:`jobtrail.ledger.webhook_events`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from jobtrail.domain.errors import ConfigError
from jobtrail.domain.record import unseen_character
from jobtrail.domain.redact import Redactor
from jobtrail.providers.config import Section
from jobtrail.providers.credentials import Credential

log = logging.getLogger("jobtrail")


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
    #: the provider's own credential (its ``credential``), which a receiver never sends: it reads it only to
    #: mask it in what it stores, as every process that stores what the provider sends must (see
    #: :class:`CredentialsToMask`)
    provider_credentials: tuple[Credential, ...] = ()

    def signing_keys(self, redactor: Redactor) -> list[bytes]:
        """Each signing secret, read now and decoded into the key deliveries are verified with: one that could
        never verify a delivery (not base64, or too short to be a key) stops the receiver at its start, instead
        of refusing every delivery."""
        return [
            signing_key(ref, Credential(ref, "bearer").resolve(redactor).reveal(), redactor) for ref in self.secrets
        ]


#: the shortest signing key accepted, in bytes (Standard Webhooks makes them 24 to 64 random bytes)
MIN_KEY_BYTES = 16
_MAKE_ONE = "python -c \"import base64, secrets; print('whsec_' + base64.b64encode(secrets.token_bytes(32)).decode())\""


def signing_key(ref: str, value: str, redactor: Redactor) -> bytes:
    """The key a Standard Webhooks secret holds: ``whsec_`` and the key in base64 (the prefix may be left off).
    The error names the reference, never the value.

    Decoded here once, and deliveries are verified with what this returns: the secret was checked stripped and
    verified as it was read, so one with a blank around it (an environment variable's newline, a pasted space)
    passed the check and then failed every delivery."""
    # surrounding blanks and padding left off are no matter; any other character outside base64's alphabet is:
    # a reader that skipped it would sign with another key than the provider's
    text = value.strip()
    redactor.register(text)  # (as the provider shows it: the value read, blanks and all, is registered already)
    text = text.removeprefix("whsec_")
    redactor.register(text)
    try:
        key = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except ValueError:
        raise ConfigError(
            f"webhook secret {ref} is not a Standard Webhooks secret (whsec_ followed by the key in base64): "
            "no delivery could be verified with it; set the secret the provider gives for signing its "
            f"webhooks, or make one with {_MAKE_ONE} and give it to the provider"
        ) from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"webhook secret {ref} holds a key of {len(key)} bytes: too short to sign with (at least "
            f"{MIN_KEY_BYTES} random bytes; Standard Webhooks uses 24 to 64); make one with {_MAKE_ONE} "
            "and give it to the provider"
        )
    return key


class CredentialsToMask:
    """Providers' own credentials, read into the redactor of a process that stores what those providers send
    but sends them nothing (a webhook receiver): no request resolves them there, so nothing else would.

    Each is read at once and again after ``refresh_s`` (as a provider reads its own, so a rotated one is
    masked too). One that cannot be read stops nothing: a warning says which, why and what it means, and it
    is tried again.
    """

    def __init__(
        self, credentials: Mapping[str, Sequence[Credential]], redactor: Redactor, *, refresh_s: float = 60.0
    ) -> None:
        self._credentials = {name: tuple(found) for name, found in credentials.items() if found}
        self._redactor = redactor
        self._refresh_s = refresh_s
        self._lock = threading.Lock()
        self._read_at: float | None = None
        #: (provider, reference) -> why it could not be read, while it cannot (to warn once, not every time)
        self._unread: dict[tuple[str, str], str] = {}
        self.refresh()

    def refresh(self) -> None:
        """Read the credentials again if ``refresh_s`` has passed since they were last read."""
        if self._read_at is not None and time.monotonic() - self._read_at < self._refresh_s:
            return
        with self._lock:
            if self._read_at is not None and time.monotonic() - self._read_at < self._refresh_s:
                return
            for name, credentials in self._credentials.items():
                for credential in credentials:
                    self._read(name, credential)
            self._read_at = time.monotonic()

    @property
    def unread(self) -> dict[tuple[str, str], str]:
        """(provider, credential reference) -> why it could not be read, for those that cannot be now."""
        with self._lock:
            return dict(self._unread)

    def _read(self, provider: str, credential: Credential) -> None:
        key = (provider, credential.describe())
        try:
            credential.resolve(self._redactor)  # the Secret registers its value: that is all it is read for
        except Exception as exc:  # a credential that cannot be read must not stop the receiver
            why = self._redactor.text(str(exc)) if isinstance(exc, ConfigError) else type(exc).__name__
            if self._unread.get(key) != why:
                log.warning(
                    "provider %s: its credential %s cannot be read here (%s); webhooks are still received, but "
                    "an event that carries that credential is stored unmasked unless it has a credential's usual "
                    "form. Make it readable where the receiver runs (it is tried again every %g s)",
                    provider,
                    key[1],
                    why,
                    self._refresh_s,
                )
            self._unread[key] = why
            return
        if self._unread.pop(key, None) is not None:
            log.info("provider %s: its credential %s can be read again; it is masked", provider, key[1])


def parse_webhooks(section: Section, provider_credential: Credential | None = None) -> WebhookConfig:
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
        provider_credentials=() if provider_credential is None else (provider_credential,),
    )
    section.done()
    return config


class Refused(Exception):
    """A delivery refused: the answer's status, a title (the reason it is counted by) and a detail; a refusal
    that a later delivery would not meet (the receiver busy) says when to come back (``retry_after_s``)."""

    def __init__(self, status: int, title: str, detail: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(detail)
        self.status, self.title, self.detail = status, title, detail
        self.retry_after_s = retry_after_s


class HeaderLines(Protocol):
    """A request's headers as Starlette gives them: every line of a name, in order."""

    def getlist(self, key: str) -> list[str]: ...


#: a Unix time in seconds (12 digits reach the year 33658; more is an attack, not a clock)
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_MAX_ID = 256
_MAX_SIGNATURES = 8192


def check_headers(headers: HeaderLines, tolerance_s: float, now_s: float) -> tuple[str, str, list[str]]:
    """What can be refused before the body is read: returns (event id, timestamp as sent, signatures).

    Every ``webhook-signature`` line is read: a sender (or a proxy on its way) may put each signature on a
    line of its own, and one that matches on the second line is as good as one on the first."""
    ids, stamps = headers.getlist("webhook-id"), headers.getlist("webhook-timestamp")
    signatures = " ".join(headers.getlist("webhook-signature"))
    event_id, stamp = (ids or [""])[0], (stamps or [""])[0]
    if not event_id or not stamp or not signatures.strip():
        raise Refused(401, "missing signature", "webhook-id, webhook-timestamp and webhook-signature are required")
    if "." in event_id or len(event_id) > _MAX_ID or not _TIMESTAMP.fullmatch(stamp):
        raise Refused(
            401,
            "bad signature headers",
            f"webhook-id must not contain '.' (at most {_MAX_ID} characters); webhook-timestamp is Unix seconds",
        )
    unusable = _unusable_id(event_id)
    if unusable is not None:
        # The id is how deliveries are told apart, kept and shown as it came: a control character in it would
        # show as other text in a listing or a terminal. And a header's bytes beyond ASCII reach us read as
        # Latin-1 (as HTTP has it), while a sender signs them as it holds them (UTF-8, as a rule): no signature
        # made over them could be checked as it was made. Either way sending it again will not help: a 400
        raise Refused(
            400,
            "unusable webhook-id",
            f"the webhook-id holds {unusable}: an event id must be printable ASCII (letters, digits, '_', '-' and "
            "such, as Standard Webhooks ids are); nothing of this delivery was kept",
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
    return event_id, stamp, signatures.split()


def _unusable_id(event_id: str) -> str | None:
    """What in ``event_id`` is not printable ASCII (the first such character, and where), or None."""
    if event_id.isascii() and event_id.isprintable():
        return None
    at, char = next((i, c) for i, c in enumerate(event_id) if not (c.isascii() and c.isprintable()))
    if char.isascii():
        return unseen_character(event_id) or f"U+{ord(char):04X} at position {at + 1}"
    return f"a byte beyond ASCII (0x{ord(char):02X}) at position {at + 1}"


def verify(
    body: bytes, headers: HeaderLines, keys: Sequence[bytes], tolerance_s: float, now_s: float
) -> tuple[str, int]:
    """Check a Standard Webhooks delivery; returns (event id, timestamp) or raises :class:`Refused`.

    The signature is checked over the body's bytes as they came, before anything reads them: a body that is
    not UTF-8, or not JSON, is a matter for whoever signed it (a 400), and anyone else's a bad signature (a
    401), whatever its bytes."""
    event_id, stamp, signatures = check_headers(headers, tolerance_s, now_s)
    offered = []
    for token in signatures:
        # (a proxy joins the lines of one header with ", ": the comma left at a signature's end is not its own)
        version, _, value = token.rstrip(",").partition(",")
        if version == "v1" and value:
            try:
                offered.append(base64.b64decode(value, validate=True))
            except ValueError:
                continue
    # v1: HMAC-SHA256 over "{id}.{timestamp}.{body}", the id and timestamp as sent (ASCII, checked above)
    signed = f"{event_id}.{stamp}.".encode("ascii") + body
    for key in keys:
        expected = hmac.new(key, signed, hashlib.sha256).digest()
        if any(hmac.compare_digest(expected, candidate) for candidate in offered):
            return event_id, int(stamp)
    raise Refused(401, "bad signature", "no v1 signature matches an active secret")
