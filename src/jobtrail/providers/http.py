"""A provider for most HTTP job APIs, declared in a TOML file (or a dict): :mod:`.declared` reads it.

See ``examples/fake.toml`` for every key. Credentials are referenced by
name (``env:NAME``, ``file:PATH``, ``keyring:SERVICE/USER`` or a callable) and
resolved only when a request is sent; the value lives in a :class:`Secret`,
is registered with the redactor, and never reaches the record.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import string
import tempfile
import time
import urllib.parse
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import yarl
from aiohttp.http_exceptions import HttpProcessingError

from jobtrail.domain.backoff import parse_retry_after
from jobtrail.domain.canonical import canonical_bytes, parse_answer
from jobtrail.domain.errors import ConfigError
from jobtrail.domain.jsonpath import (
    MAX_TEXT,
    extract,
    extract_any,
    job_id,
    reference,
    unusable,
    unusable_id,
    value_at,
    why_unusable,
)
from jobtrail.domain.machine import AMBIGUOUS_HTTP_STATUSES
from jobtrail.domain.record import Operation, unseen_character
from jobtrail.domain.redact import Redactor
from jobtrail.domain.states import RemoteState, State
from jobtrail.domain.words import why_it_ended
from jobtrail.providers.contract import (
    Capabilities,
    CreateOutcome,
    LookupOutcome,
    NoAnswer,
    ReconcileMode,
    Response,
    Spooled,
    StatusOutcome,
    WireAnswer,
)
from jobtrail.providers.declared import Endpoint, HttpProviderConfig, parse_config
from jobtrail.providers.egress import (
    AddressRefused,
    EgressPolicy,
    PublicOnlyResolver,
    UrlRefused,
    refusal,
)
from jobtrail.providers.gate import ConnectionGate
from jobtrail.providers.tracecontext import outgoing_traceparent

_MAX_BODY = 16 * 1024 * 1024
_USER_AGENT = "jobtrail/0.1"
#: how long a resolved credential is used before it is read again (sooner when the provider refuses it)
CREDENTIAL_TTL_S = 60.0
#: a body larger than this is spooled to a file as it arrives (see read_at_most)
SPOOL_OVER_BYTES = 1024 * 1024
#: a body of declared length up to this is read in one call (most answers: a status, a small result)
_READ_WHOLE_BYTES = 64 * 1024
#: of a large answer that is not a result (an error page), this much is kept
_ERROR_BODY_KEPT = 64 * 1024
#: where providers put their request id (generic, OpenAI and Anthropic, AWS JSON and S3 APIs)
_REQUEST_ID_HEADERS = ("x-request-id", "request-id", "x-amzn-requestid", "x-amz-request-id")


def _path_value(value: str, *, keep_slashes: bool) -> str:
    """A value for a path placeholder, percent-encoded; ``{+name}`` keeps its slashes (RFC 6570 reserved
    expansion). Job ids with dot segments never get here (see :func:`~jobtrail.domain.jsonpath.unusable_id`)."""
    return urllib.parse.quote(value, safe="/" if keep_slashes else "")


@functools.lru_cache(maxsize=256)
def _placeholders(path: str) -> frozenset[str]:
    """The placeholder names of a provider file's path template (``{job_id}``, ``{+job_id}``)."""
    return frozenset(name for _, name, _, _ in string.Formatter().parse(path) if name)


class BodyCodingError(aiohttp.ClientPayloadError):
    """A compressed body that cannot be read whole: its stream ended early (cut short), bytes follow its end,
    or its content coding is not one we read. Its message is ours; it quotes nothing the provider sent."""


#: the content codings asked for and read (RFC 9110 §8.4.1); the session decompresses nothing itself
ACCEPT_ENCODING = "gzip, deflate"
_PIECE_BYTES = 256 * 1024


class _Inflater:
    """A ``gzip`` or ``deflate`` body, decompressed as it arrives, and proven whole at its end: aiohttp's
    own decompression took a gzip stream cut short (its length or chunks intact) for the whole body, and
    half a CSV result was stored as valid."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self._inflate: Any = None
        self.fed = False

    def pieces(self, data: bytes, most: int) -> Iterator[bytes]:
        """What ``data`` decompresses to, at most ``most`` bytes in all, in pieces of at most 256 KiB (64 KiB
        of zeros inflate to 64 MB: no piece of a bomb is ever held whole)."""
        if self._inflate is None:
            if self.coding == "deflate" and data[:1] and data[0] & 0x0F != 8:
                wbits = -zlib.MAX_WBITS  # a raw deflate stream, as many servers send for "deflate"
            else:
                wbits = zlib.MAX_WBITS | (16 if self.coding != "deflate" else 0)
            self._inflate = zlib.decompressobj(wbits)
        self.fed = self.fed or bool(data)
        while most > 0:
            if self._another_member():
                data, self._inflate = self._inflate.unused_data + data, zlib.decompressobj(zlib.MAX_WBITS | 16)
            try:
                out = self._inflate.decompress(data, min(most, _PIECE_BYTES))
            except zlib.error:
                raise BodyCodingError(f"the {self.coding} body is not a valid {self.coding} stream") from None
            most -= len(out)
            data = self._inflate.unconsumed_tail
            if out:
                yield out
            elif not data and not self._another_member():
                # (all input taken and nothing more to give: a raw deflate stream's last output comes only
                # once asked for with no input left, so the loop asks until none comes)
                return

    def _another_member(self) -> bool:
        """A gzip body may be several streams one after the other (RFC 1952 §2.2): has the next begun?"""
        return bool(self.coding == "gzip" and self._inflate.eof and self._inflate.unused_data)

    def finish(self) -> None:
        if not self.fed:  # no body at all (a 204, say): nothing to prove
            return
        if not self._inflate.eof:
            raise BodyCodingError(f"the {self.coding} stream ended early: the body was cut short")
        if self._inflate.unused_data:
            raise BodyCodingError(f"bytes follow the end of the {self.coding} stream")


def _inflater(headers: Mapping[str, str]) -> _Inflater | None:
    coding = headers.get("Content-Encoding", "identity").strip().lower()
    if coding in ("", "identity"):
        return None
    if coding in ("gzip", "x-gzip", "deflate"):
        return _Inflater("deflate" if coding == "deflate" else "gzip")
    raise BodyCodingError(
        f"the body is in a content coding jobtrail does not read ({coding[:40]!r}; it asks for {ACCEPT_ENCODING})"
    )


async def read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes | Spooled:
    """The body, or its first ``limit`` bytes: a huge answer is never read whole.

    A body past :data:`SPOOL_OVER_BYTES` goes to a file as it arrives (written off the event
    loop, its sha256 counted on the way), so a large result is never held in memory. A compressed
    body is decompressed here (``limit`` counts what it decompresses to) and must end where its
    stream ends (:class:`BodyCodingError`): ``resp`` comes from a session made with
    ``auto_decompress=False``, as the provider's are.
    """
    headers = resp.headers
    inflater = _inflater(headers)
    length = resp.content_length
    if (
        length is not None
        and length <= min(limit, _READ_WHOLE_BYTES)
        and "Transfer-Encoding" not in headers
        and inflater is None
    ):
        # a small body of declared length, not compressed: exactly that many bytes arrive (the parser
        # reads no further), so it is read in one go; a compressed body may inflate past its length
        return (await resp.read())[:limit]
    chunks: list[bytes] = []
    total = 0
    spool: Any = None
    digest = hashlib.sha256()
    try:
        async for arrived in resp.content.iter_chunked(64 * 1024):
            for received in (arrived,) if inflater is None else inflater.pieces(arrived, limit - total + 1):
                chunk = received[: limit - total]
                total += len(chunk)
                if spool is None and total > SPOOL_OVER_BYTES:
                    # made here, not on a thread: a cancelled await would leave a file nobody knows of
                    spool = tempfile.NamedTemporaryFile(prefix="jobtrail-fetch-", delete=False)  # noqa: SIM115
                    chunks.append(chunk)
                    held, chunks = b"".join(chunks), []
                    digest.update(held)
                    await asyncio.to_thread(spool.write, held)
                elif spool is not None:
                    digest.update(chunk)
                    await asyncio.to_thread(spool.write, chunk)
                else:
                    chunks.append(chunk)
                if total >= limit:
                    break
            if total >= limit:
                break
        else:  # the whole body arrived (one past the limit is refused for its size anyway)
            if inflater is not None:
                inflater.finish()
    except BaseException:
        if spool is not None:
            spool.close()
            Path(spool.name).unlink(missing_ok=True)
        raise
    if spool is None:
        return b"".join(chunks)
    await asyncio.to_thread(spool.close)
    return Spooled(Path(spool.name), total, digest.hexdigest())


#: where providers say how long to wait (see _retry_after)
_RETRY_HEADERS = ("retry-after-ms", "retry-after")


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait, from ``retry-after-ms`` (OpenAI, Anthropic: finer, so it wins) or ``Retry-After``."""
    lowered = {k.lower(): v for k, v in headers.items() if k.lower() in _RETRY_HEADERS}
    try:
        millis = float(lowered.get("retry-after-ms", "nan"))
    except ValueError:
        millis = float("nan")
    if 0 <= millis < 10**10:  # nan and absurd values fail this: Retry-After decides
        return millis / 1000
    return parse_retry_after(lowered.get("retry-after"), time.time())


def _no_silent_resend(session: aiohttp.ClientSession) -> None:
    """Turn off aiohttp's own re-send of a PUT, DELETE or GET whose connection broke after the request went out
    (RFC 9112 §9.3.1.1 lets a client retry "idempotent" methods). A create declared as PUT then reached the
    provider twice for one recorded attempt: with no idempotency token, two jobs, the first never named in
    the ledger; a DELETE cancel declared not idempotent went twice; a one-time result could be handed over
    twice. Every request must be one the ledger knows of, so a broken connection is an answer the flows
    judge (``connection_reset``), never a re-send behind their back. aiohttp has no public switch: this is
    the attribute its own test client sets (``aiohttp.test_utils``; versions before it never re-sent), and
    tests/test_strict_provider.py guards it."""
    if hasattr(session, "_retry_connection"):
        session._retry_connection = False


def _text(value: str) -> str:
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def load_provider(source: str | os.PathLike[str] | Mapping[str, Any]) -> HttpProvider:
    """Build the provider a file (or dict) declares; ``kind`` picks a built-in adapter (see :mod:`.kinds`)."""
    from jobtrail.providers.kinds import load_provider as load

    return load(source)


def build(kind: str, data: Mapping[str, Any], source: str) -> HttpProvider:
    """``kind = "http"``: the file declares the whole contract."""
    return HttpProvider(parse_config(data, source))


# -- the provider itself ------------------------------------------------------------------------------


class HttpProvider:
    """A :class:`~jobtrail.Provider` driven by an :class:`HttpProviderConfig`.

    Built-in adapters (:mod:`jobtrail.providers.kinds`) subclass it: they keep its
    plumbing (egress rules, credentials at send time, bounded reads, redaction) and
    override the calls whose wire contract a file cannot declare.
    """

    #: the provider file's ``kind``
    kind = "http"
    #: whether :meth:`candidates` can list the jobs created in a window (adapters for APIs that can say so)
    lists_candidates = False
    #: why the adapter's guarantees hold (shown by ``jobtrail providers check``)
    contract_note = ""

    def __init__(self, config: HttpProviderConfig, *, redactor: Redactor | None = None) -> None:
        self.config = config
        self.redactor = redactor or Redactor()
        self.name = config.name
        self.target = config.target
        self.create_endpoint = f"{config.create.method} {config.create.path}"
        self.capabilities = Capabilities(
            token=config.token,
            token_retention=config.token_retention,
            reconcile=config.reconcile,
            cancel=config.cancel is not None,
            cancel_idempotent=config.cancel_idempotent,
            result="one_time" if config.result_kind == "one_time" else "safe_read",
            webhook_scheme=config.webhook_scheme,
            states=config.states,
            resume=config.resume,
        )
        self.backoff = config.backoff
        self.result_spec = config.result_spec
        self.poll_backoff = config.poll_backoff
        self.egress = EgressPolicy(config.base_url, config.download_hosts)
        #: (when resolved, the headers it gives): see _credential_headers
        self._credential: tuple[float, dict[str, str]] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._foreign: aiohttp.ClientSession | None = None
        #: one slot per connection of each session (see _exchange)
        self._gate = self._new_gate()
        self._foreign_gate = self._new_gate()
        self._foreign_loop: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- plumbing -------------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.config.max_connections, ttl_dns_cache=300),
                timeout=aiohttp.ClientTimeout(total=self.config.timeout_s, sock_connect=self.config.connect_timeout_s),
                headers={"User-Agent": _USER_AGENT, "Accept-Encoding": ACCEPT_ENCODING},
                auto_decompress=False,  # read_at_most decompresses, and proves the stream whole
            )
            _no_silent_resend(self._session)
            self._gate = self._new_gate()
            self._loop = loop
        return self._session

    def _foreign_client(self) -> aiohttp.ClientSession:
        """For declared download hosts: no provider headers, names resolved to public addresses only."""
        loop = asyncio.get_running_loop()
        if self._foreign is None or self._foreign_loop is not loop or self._foreign.closed:
            self._foreign = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.config.max_connections, resolver=PublicOnlyResolver()),
                timeout=aiohttp.ClientTimeout(total=self.config.timeout_s, sock_connect=self.config.connect_timeout_s),
                headers={"User-Agent": _USER_AGENT, "Accept-Encoding": ACCEPT_ENCODING},
                auto_decompress=False,
            )
            _no_silent_resend(self._foreign)  # a one-time result may be handed over only once
            self._foreign_gate = self._new_gate()
            self._foreign_loop = loop
        return self._foreign

    async def aclose(self) -> None:
        for session in (self._session, self._foreign):
            if session is not None and not session.closed:
                await session.close()
        self._session = self._foreign = None

    def _url(self, path: str, op: Operation, **extra: str) -> str:
        values = {
            "job_id": op.remote_job_id or "",
            "token": op.idempotency_token,
            "trace_id": op.trace_id,
            **extra,
        }
        # only provider-file paths are formatted (checked at load); a provider's answer never is;
        # only the placeholders the path names are encoded
        filled = path.format(
            **{
                name: _path_value(values[name.removeprefix("+")], keep_slashes=name.startswith("+"))
                for name in _placeholders(path)
                if name.removeprefix("+") in values
            }
        )
        if filled.startswith(("http://", "https://")):
            return filled
        return self.config.base_url + filled

    def _headers(self, op: Operation) -> dict[str, str]:
        headers = dict(self.config.headers)
        headers["traceparent"] = outgoing_traceparent(op.trace_id)
        if op.lease_owner:
            # lets a provider (and our fake) see which lease a request was made under
            headers["X-Jobtrail-Lease"] = f"{op.lease_owner}/{op.lease_epoch}"
        if self.config.trace_header:
            headers[self.config.trace_header] = op.trace_id
        return headers

    def credential_known(self) -> bool:
        """Was the credential read within :data:`CREDENTIAL_TTL_S` (or is there none to read)?"""
        held = self._credential
        return self.config.credential is None or (held is not None and time.monotonic() - held[0] < CREDENTIAL_TTL_S)

    def read_credential(self) -> None:
        """Read the credential now if it is not known (blocking: a file, a keyring), and keep it for the sends.

        Called before a request body is stored: the redactor (and the ledger's, which it forwards to) then
        knows the value, and a body that carries it is refused, as one that carries a known secret format is.
        One that cannot be read now stays unknown: the next submit tries again, and a send says what is wrong."""
        if not self.credential_known():
            with contextlib.suppress(Exception):  # a keyring's own errors too
                self._read_credential()

    def _read_credential(self) -> dict[str, str]:
        credential = self.config.credential
        assert credential is not None
        headers = credential.headers(credential.resolve(self.redactor))
        self._credential = (time.monotonic(), headers)
        return headers

    async def _credential_headers(self) -> dict[str, str]:
        """The credential's headers, resolved at most once per CREDENTIAL_TTL_S, and again at once when
        the provider refuses it (see _send); a file or keyring is read off the event loop."""
        credential = self.config.credential
        if credential is None:
            return {}
        if self._credential is not None and self.credential_known():
            return self._credential[1]
        if callable(credential.ref) or credential.ref.startswith("env:"):
            return self._read_credential()
        return await asyncio.to_thread(self._read_credential)

    async def _send(
        self,
        method: str,
        url: str,
        op: Operation,
        *,
        body: Any = None,
        extra_headers: Mapping[str, str] = {},
        max_bytes: int = _MAX_BODY,
        keep_raw: bool = False,
    ) -> Response | NoAnswer:
        """One request to the provider's own origin (credential and provider headers attached):
        the response, or why there was none (:class:`NoAnswer`)."""
        if not self.egress.is_home(url):
            # provider-file paths are checked at load and answers are judged before they get here:
            # reaching this line is a bug, and the credential must not go out because of it
            try:
                self.egress.judge(url)
            except UrlRefused as exc:
                why = exc.reason
            else:
                why = f"not the origin of base_url ({self.egress.home})"
            raise ConfigError(f"refusing to send a request to {self.redactor.url(url)}: {why}")
        credential = await self._credential_headers()
        answer = await self._transport(
            method, url, {**self._headers(op), **extra_headers, **credential}, body, max_bytes + 1
        )
        if isinstance(answer, WireAnswer) and answer.status in (401, 403) and credential:
            # refused for its credential, which may have been rotated since it was read: read it again now,
            # and if it changed, send once more (a request refused for its credential was not processed)
            self._credential = None
            fresh = await self._credential_headers()
            if fresh != credential:
                if isinstance(answer.body, Spooled):
                    answer.body.discard()
                answer = await self._transport(
                    method, url, {**self._headers(op), **extra_headers, **fresh}, body, max_bytes + 1
                )
        return self._response(answer, max_bytes, keep_raw)

    def _names_a_request(self, value: str) -> bool:
        """Whether a request-id header's value may stand for the request: one that carries the credential
        (echoed back) would go on every span and log line unmasked, one that shows as other text would be
        quoted as another id. Such a header names no request (it is still kept, masked, with the answer).

        Cheaper than a job id's checks (every answer has a new request id, 1.6 against 8 to 19 us): what a
        request id may not carry is the credential itself, in any encoding; the stored answer is masked for
        secret formats besides."""
        return (
            len(value) <= MAX_TEXT
            and unseen_character(value) is None
            and "\ufffd" not in value
            and not self.redactor.contains_secret(value)
        )

    def _response(
        self,
        answer: WireAnswer | NoAnswer,
        max_bytes: int,
        keep_raw: bool,
    ) -> Response | NoAnswer:
        if isinstance(answer, NoAnswer):
            return answer
        status, raw_headers, received = answer.status, answer.headers, answer.body
        resp_headers: dict[str, str] = {}
        request_id: str | None = None
        retry: dict[str, str] = {}
        for raw_name, raw_value in raw_headers.items():
            # a plain str, not aiohttp's case-insensitive istr: each record carries these names through the
            # writer process's pipe, where an istr is pickled by a call of its own and rebuilt by another
            name, value = str(raw_name), raw_value
            if not (name.isascii() and value.isascii()):
                # header bytes that are not UTF-8 arrive as lone surrogates, which no database can store
                name, value = _text(name), _text(value)
            resp_headers[name] = value
            lower = name.lower()
            if lower in _REQUEST_ID_HEADERS and request_id is None and self._names_a_request(value):
                request_id = value
            elif lower in _RETRY_HEADERS:
                retry[lower] = value
        size = received.size if isinstance(received, Spooled) else len(received)
        spooled: Spooled | None = None
        raw = received if isinstance(received, bytes) else b""
        if isinstance(received, Spooled):
            if keep_raw and status == 200:
                spooled = received  # a result stays in its file (its checks judge its size)
            else:  # anything else is read back, bounded, and the file dropped
                with received.path.open("rb") as fh:
                    raw = fh.read(_ERROR_BODY_KEPT if keep_raw else max_bytes) if keep_raw or size <= max_bytes else b""
                received.discard()
                size = len(raw) if keep_raw else size
        body_value: Any
        unreadable = None
        if keep_raw:
            body_value = None
        elif size > max_bytes:
            unreadable = f"larger than {max_bytes} bytes, not kept"
            body_value = {"_jobtrail": f"body {unreadable}"}
        else:
            text = raw.decode("utf-8", errors="replace")
            try:
                body_value = parse_answer(text) if text.strip() else None
            except ValueError as exc:  # kept as it came, with why it could not be read
                unreadable = f"not JSON that can be kept: {exc}"
                body_value = {"_jobtrail_unparsed": text[:2000], "_jobtrail_why": str(exc)}
        return Response(
            http_status=status,
            headers=resp_headers,
            body=body_value,
            provider_request_id=request_id,
            retry_after_s=_retry_after(retry) if retry else None,
            raw=raw if keep_raw and spooled is None else None,
            spooled=spooled,
            unreadable=unreadable,
        )

    async def _transport(
        self, method: str, url: str, headers: Mapping[str, str], body: Any, max_bytes: int
    ) -> WireAnswer | NoAnswer:
        """The wire: the status, headers and at most ``max_bytes`` of the body, or why there was no answer.

        The deterministic simulation replaces only this method, so everything above the
        socket (headers, credentials, parsing, classification) is the code that runs for real.
        """
        return await self._exchange(method, url, max_bytes, headers=headers, json=body)

    async def _exchange(
        self, method: str, url: str | yarl.URL, max_bytes: int, *, foreign: bool = False, **request: Any
    ) -> WireAnswer | NoAnswer:
        """One request on a free connection (of the provider's, or ``foreign``: of the download hosts'),
        its answer read up to ``max_bytes``; no redirects are followed."""
        if foreign:
            client, gate = self._foreign_client(), self._foreign_gate
        else:
            client, gate = self._client(), self._gate  # the gate of this loop's session
        if not await gate.acquire():
            return self._no_slot()
        try:
            async with client.request(method, url, allow_redirects=False, **request) as resp:
                raw = await read_at_most(resp, max_bytes)
                return WireAnswer(resp.status, {k: v for k, v in resp.headers.items()}, raw)
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, AddressRefused):  # a download host that resolved to a private address
                return refusal(UrlRefused(str(exc.os_error), yarl.URL(url).host or ""), url_key="status.result_ref")
            return self._failure(exc)
        except (TimeoutError, aiohttp.ClientError, HttpProcessingError) as exc:
            return self._failure(exc)
        finally:
            gate.release()

    def _new_gate(self) -> ConnectionGate:
        """Slots for the provider's connections. Waiting for one is not part of a request's time-out, but
        bounded by the connect time-out: a request queued behind busy connections and turned away there was
        never sent, and must not be taken for a create that may have reached the provider (nor hold its
        request objects while it waits)."""
        return ConnectionGate(self.config.max_connections, self.config.connect_timeout_s)

    def _no_slot(self) -> NoAnswer:
        return NoAnswer(
            "not_sent",
            f"none of the {self.config.max_connections} connections to the provider came free within "
            f"{self.config.connect_timeout_s:g} s (connect_timeout_s); nothing was sent. More in flight than "
            "the provider's max_connections serve: lower the worker's concurrency or raise max_connections",
        )

    async def _foreign_transport(self, url: yarl.URL, max_bytes: int) -> WireAnswer | NoAnswer:
        """A GET to a declared download host: no credential, no provider headers, no redirects."""
        return await self._exchange("GET", url, max_bytes, foreign=True)

    def _failure(self, exc: BaseException) -> NoAnswer:
        """What a request that got no usable answer tells us.

        Order matters: a connection never made is ``not_sent`` (nothing reached the
        provider), a time-out or a reset after sending may have reached it.
        """
        name = type(exc).__name__
        if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
            return NoAnswer("not_sent", f"{name}: {exc}")
        if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
            return NoAnswer("timeout", f"no answer within {self.config.timeout_s:g} s ({name})")
        if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
            return NoAnswer("connection_reset", f"{name}: {exc}")
        # a parser's message may quote what the provider sent (aiohttp's: a line's first 100 bytes, or the
        # whole line), a credential cut short among it: only the kind of error is kept, never its text
        if isinstance(exc, BodyCodingError):  # (its message is ours)
            return NoAnswer("incomplete_response", f"{exc}; nothing of it is kept")
        if isinstance(exc, aiohttp.ClientPayloadError):
            return NoAnswer("incomplete_response", f"{name}: the body ended early or broke off ({_innermost(exc)})")
        if isinstance(exc, aiohttp.ClientResponseError | HttpProcessingError):
            # (with redirects off, no proxy and no raise_for_status, only the response parser raises these)
            return NoAnswer(
                "unreadable_response", f"the answer is not readable HTTP ({_innermost(exc)}; its bytes are not kept)"
            )
        return NoAnswer("client_error", f"{name}: {exc}")

    # -- the contract --------------------------------------------------------------------------

    def check_request(self, request: Any) -> object:
        """Refuse (ConfigError naming what is wrong) a request the provider's contract cannot carry, at
        submit, before it becomes an operation: a refusal later would only surface as a create that can
        never be sent. Adapters add their API's own rules."""
        if self.config.token.where == "body":
            return with_token(request, self.config.token.name, "", provider=self.name)
        return request

    def check_target(self, target: str) -> None:
        """Refuse (ConfigError) a submit's target the provider cannot act on, at submit, as
        :meth:`check_request` does a request. A target is a label here; adapters whose calls name it check it."""

    async def create(self, op: Operation) -> CreateOutcome:
        cfg = self.config
        body = op.request_body
        headers = dict(cfg.create.headers)
        url = self._url(cfg.create.path, op)
        token = cfg.token
        if token.where == "header":
            headers[token.name] = f'"{op.idempotency_token}"' if token.quoted else op.idempotency_token
        elif token.where == "query":
            url += ("&" if "?" in url else "?") + urllib.parse.urlencode({token.name: op.idempotency_token})
        elif token.where == "body":
            body = with_token(body, token.name, op.idempotency_token, provider=self.name)
        sent = await self._send(cfg.create.method, url, op, body=body, extra_headers=headers)
        if isinstance(sent, NoAnswer):
            return sent.create_outcome()
        outcome = self.classify_create(sent)
        if outcome.kind == "rejected" and op.state is State.RECONCILIATION and _token_used_otherwise(sent):
            return self._token_used_otherwise(op, sent)
        return outcome

    def _token_used_otherwise(self, op: Operation, sent: Response) -> CreateOutcome:
        """A replay refused because the provider holds the token for a different request: it proves the token
        was used, not that the create was refused, so the create stops for a person. (Taken as a replayed
        refusal, the operation was re-sent, refused again and ended ``failed`` beside the job the first
        attempt had made, and a person told "a changed request is a new operation" submitted a second.)"""
        return CreateOutcome(
            kind="ambiguous",
            response=sent,
            person_must_decide=True,
            error_class="token_used_otherwise",
            detail=(
                f"the replay with this operation's idempotency token was refused with HTTP {sent.http_status}, "
                "which says the provider holds the token for a different request (the IETF idempotency draft answers "
                "a reused key with 422, Stripe with an idempotency_error), so a job may exist under it; it is not "
                "re-sent. Look in the "
                f"provider's console for a job with trace id {op.trace_id}, then resolve to accepted with its "
                "job id, or to failed if there is none"
            ),
        )

    def classify_create(self, resp: Response) -> CreateOutcome:
        """Which of confirmed / synchronous / rejected / ambiguous a create response proves."""
        cfg = self.config
        status = resp.http_status or 0
        code = extract(cfg.error_code, resp.body, {}, self.redactor) if cfg.error_code else None
        if code is not None and code in cfg.non_retryable:
            return CreateOutcome(
                kind="rejected",
                response=resp,
                declared_non_retryable=True,
                error_class=f"provider_error:{code}",
                detail=f"HTTP {status}, code {code}",
            )
        if 300 <= status < 400:
            # never followed: a redirected POST may or may not have made a job, and re-sending it
            # only repeats the redirect, so the create stops for a person (see CreateFlow)
            location = next((v for k, v in resp.headers.items() if k.lower() == "location"), None)
            where = self.redactor.url(location) if location else "no Location header"
            return CreateOutcome(
                kind="ambiguous",
                response=resp,
                person_must_decide=True,
                error_class="redirect",
                detail=(
                    f"the create was answered with HTTP {status} redirecting to {where}; redirects are not "
                    "followed and the create is not re-sent (the provider may or may not have made a job). "
                    "Check base_url and create.path in the provider file, look for a job with this trace id "
                    "in the provider's console, then resolve"
                ),
            )
        if 200 <= status < 300:
            remote_id = job_id(cfg.job_id, resp.body, resp.headers, self.redactor)
            status_url = extract(cfg.status_url, resp.body, resp.headers, self.redactor)
            result = extract_any(cfg.sync_result, resp.body) if cfg.sync_result and self._finished(resp) else None
            if result is not None:
                return CreateOutcome(kind="synchronous", response=resp, remote_job_id=remote_id, result=result)
            if remote_id:
                return CreateOutcome(kind="confirmed", response=resp, remote_job_id=remote_id, status_url=status_url)
            unusable = why_unusable(cfg.job_id, resp.body, resp.headers, self.redactor)
            return CreateOutcome(
                kind="ambiguous",
                response=resp,
                error_class="malformed_response",
                detail=f"HTTP {status} without a job id at {cfg.job_id}; the job may exist"
                if unusable is None
                else f"HTTP {status} with an unusable job id at {cfg.job_id} ({unusable}; not stored); "
                "the job may exist",
            )
        if 400 <= status < 500 and status not in AMBIGUOUS_HTTP_STATUSES:
            return CreateOutcome(kind="rejected", response=resp, error_class=f"http_{status}", detail=f"HTTP {status}")
        return CreateOutcome(kind="ambiguous", response=resp, error_class=f"http_{status}", detail=f"HTTP {status}")

    async def lookup(self, op: Operation, mode: ReconcileMode) -> LookupOutcome:
        cfg = self.config
        endpoint = cfg.lookup_status if mode is ReconcileMode.STATUS_BY_CLIENT_ID else cfg.lookup_list
        if endpoint is None:
            return LookupOutcome(kind="unknown", path=mode, detail=f"{mode.value} is not configured")
        sent = await self._send(endpoint.method, self._url(endpoint.path, op), op, extra_headers=endpoint.headers)
        if isinstance(sent, NoAnswer):
            return LookupOutcome(kind="unknown", path=mode, detail=str(sent))
        if mode is ReconcileMode.STATUS_BY_CLIENT_ID:
            return self._by_client_id(sent)
        ids: list[str] = []
        try:
            for page in range(cfg.list_paging.max_pages):
                ids += self._matches(sent, op)
                following = self._next_page(sent, endpoint, op)
                if following is None:
                    break
                if page + 1 == cfg.list_paging.max_pages:
                    raise _Unfollowable(f"more than {cfg.list_paging.max_pages} pages; raise reconcile.max_pages")
                next_sent = await self._send("GET", following, op, extra_headers=endpoint.headers)
                if isinstance(next_sent, NoAnswer):
                    raise _Unfollowable(str(next_sent))
                sent = next_sent
        except _Unfollowable as exc:
            if not ids:  # the list was not read whole: a found job still counts, absence does not
                return LookupOutcome(kind="unknown", path=mode, response=sent, detail=str(exc))
        return LookupOutcome(
            kind="found" if ids else "absent", path=mode, response=sent, remote_job_ids=tuple(dict.fromkeys(ids))
        )

    def _matches(self, sent: Response, op: Operation) -> list[str]:
        """The ids of the jobs on one page of a reconciliation list that carry our reference."""
        cfg = self.config
        if sent.http_status != 200:
            raise _Unfollowable(f"HTTP {sent.http_status}")
        items = extract_any(cfg.list_items, sent.body)
        if not isinstance(items, list):
            raise _Unfollowable(f"no list at {cfg.list_items} in the answer")
        id_path = cfg.job_id if cfg.job_id.startswith("$") else "$.id"
        return [
            job
            for item in items
            if extract(cfg.list_reference, item, {}, self.redactor) == op.idempotency_token
            and (job := job_id(id_path, item, {}, self.redactor)) is not None
        ]

    def _by_client_id(self, sent: Response) -> LookupOutcome:
        mode = ReconcileMode.STATUS_BY_CLIENT_ID
        if sent.http_status == 404:
            return LookupOutcome(
                kind="absent", path=mode, response=sent, detail="the provider has no job for our client id"
            )
        id_path = self.config.job_id if self.config.job_id.startswith("$") else "$.id"
        found = job_id(id_path, sent.body, sent.headers, self.redactor)
        if sent.http_status == 200 and found:
            return LookupOutcome(kind="found", path=mode, response=sent, remote_job_ids=(found,))
        return LookupOutcome(kind="unknown", path=mode, response=sent, detail=f"HTTP {sent.http_status}")

    def _next_page(self, sent: Response, endpoint: Endpoint, op: Operation) -> str | None:
        """The next page's URL, or None on the last page (paging declared in ``[reconcile]``).

        Raises :class:`_Unfollowable` when the answer says more pages follow but gives no link we
        may follow: the list was not read whole, so absence is not proven.
        """
        paging = self.config.list_paging
        more = paging.has_more is None or extract_any(paging.has_more, sent.body) is True
        if not more:
            return None
        if paging.next_url is not None:
            following = extract(paging.next_url, sent.body, sent.headers, self.redactor)
            if not following:
                if paging.has_more is not None:
                    raise _Unfollowable("more pages follow, but the answer gives no usable next link")
                return None
            try:  # a provider's link: judged by origin, and only the provider's own origin gets the credential
                target = self.egress.judge(self.egress.resolve_reference(following))
            except UrlRefused as exc:
                raise _Unfollowable(f"the next page's link is refused ({exc.reason})") from None
            if not target.home:
                raise _Unfollowable(f"the next page's link points away from {self.egress.home}")
            return str(target.url)
        if paging.cursor is not None:
            cursor = extract(paging.cursor, sent.body, sent.headers, self.redactor)
            if not cursor:
                if paging.has_more is not None:
                    raise _Unfollowable("more pages follow, but the answer gives no usable cursor")
                return None
            first = self._url(endpoint.path, op)
            return first + ("&" if "?" in first else "?") + urllib.parse.urlencode({paging.cursor_param: cursor})
        return None

    async def status(self, op: Operation) -> StatusOutcome:
        cfg = self.config
        if cfg.status is None:
            raise ConfigError(f"provider {self.name} declares no [status] endpoint")
        sent = await self._send(cfg.status.method, self._url(cfg.status.path, op), op, extra_headers=cfg.status.headers)
        if isinstance(sent, NoAnswer):
            return StatusOutcome(remote_state=RemoteState.UNKNOWN, raw_state=None, error_class=sent.error_class)
        raw = extract(cfg.state_path, sent.body, sent.headers, self.redactor)
        remote = self._state(sent)
        progress_raw = extract(cfg.progress_path, sent.body, sent.headers, self.redactor)
        try:
            progress = float(progress_raw) if progress_raw is not None else None
        except (ValueError, OverflowError):
            progress = None
        if progress is not None and not math.isfinite(progress):  # "NaN", "inf", 10**400: no share of anything
            progress = None
        error_class, detail = ("", "") if sent.http_status == 200 else (f"http_{sent.http_status}", "")
        if 300 <= (sent.http_status or 0) < 400:
            detail = self._redirect(sent)
        elif not error_class and (other := self._another_job(sent, op)) is not None:
            error_class, detail = "another_job", other
        remote = remote if not error_class else RemoteState.UNKNOWN
        return StatusOutcome(
            remote_state=remote,
            raw_state=raw,
            response=sent,
            progress=progress,
            result_ref=reference(cfg.result_ref_path, sent.body, sent.headers, self.redactor),
            provider_time=extract(cfg.time_path, sent.body, sent.headers, self.redactor),
            effects=extract_any(cfg.effects_path, sent.body),
            error_class=error_class,
            detail=detail,
            failure=why_it_ended(remote, lambda: value_at(cfg.failure_path, sent.body, sent.headers), self.redactor),
        )

    def _another_job(self, sent: Response, op: Operation) -> str | None:
        """Why a status answer is not this job's (None: it is, or it does not say). An answer that names
        another job at the create's ``job_id`` path (a cache or a proxy mixing answers up, a provider's bug)
        ended this operation ``failed``, or collected its result, on the word of another job."""
        path = self.config.job_id
        if op.remote_job_id is None or not path.startswith("$"):  # (an id from a header: the body need not name it)
            return None
        said = extract_any(path, sent.body)
        if said is None or isinstance(said, dict | list) or str(said) == op.remote_job_id:
            return None
        shown = job_id(path, sent.body, {}, self.redactor)
        named = "another job" if shown is None else f"job {json.dumps(shown[:100])}"
        return (
            f"the answer is about {named}, not job {op.remote_job_id}, so it says nothing of this job (a status "
            f"answer is held to name its job where the create's answer did, create.job_id = {path}: a provider "
            "whose status answers hold something else there is one whose answers cannot be told from another "
            "job's)"
        )

    def _redirect(self, sent: Response) -> str:
        location = next((v for k, v in sent.headers.items() if k.lower() == "location"), None)
        where = self.redactor.url(location) if location else "no Location header"
        return f"a redirect to {where}, not followed: is the status path, or base_url, out of date?"

    def _state(self, sent: Response) -> RemoteState:
        """The job's state in an answer: the first ``[[status.rules]]`` that holds, else the state field."""
        for rule in self.config.state_rules:
            if rule.holds(extract_any(rule.path, sent.body)):
                return rule.state
        return self.capabilities.normalise(extract(self.config.state_path, sent.body, sent.headers, self.redactor))

    def _finished(self, resp: Response) -> bool:
        """A create answer carries a finished job unless the state it reports (if any) says otherwise."""
        if not 200 <= (resp.http_status or 0) < 300:
            return False
        says = self._state(resp)
        return says in (RemoteState.SUCCEEDED, RemoteState.UNKNOWN) or says is None

    async def cancel(self, op: Operation) -> Response | NoAnswer:
        cfg = self.config
        if cfg.cancel is None:
            raise ConfigError(f"provider {self.name} declares no [cancel] endpoint")
        return await self._send(cfg.cancel.method, self._url(cfg.cancel.path, op), op, extra_headers=cfg.cancel.headers)

    async def candidates(self, op: Operation, since_us: int, until_us: int) -> LookupOutcome:
        """The declarative format lists no jobs by time; built-in adapters for APIs that can do so override this."""
        return LookupOutcome(
            kind="unknown", path=ReconcileMode.LIST_BY_REFERENCE, detail="this provider cannot list its jobs by time"
        )

    async def fetch_result(self, op: Operation, result_ref: str | None) -> Response | NoAnswer:
        cfg = self.config
        max_bytes = cfg.result_spec.max_bytes
        # the reference is judged and the result checked against the credential before anything is sent, and a
        # download host never gets it: read it now, or a worker whose first request is a download knows none
        await self._credential_headers()
        if cfg.result_from_status is not None:
            return await self._result_from_status(op)
        if cfg.result is not None and cfg.result.names("result_ref"):
            if result_ref is None:
                return NoAnswer("no_reference", "the status gave no result reference")
            why = unusable_id(result_ref, self.redactor)
            if why is not None:  # it goes into a path on the credential's origin: it may not climb out of it
                return NoAnswer("refused", f"the result reference is unusable ({why})")
            sent = await self._send(
                "GET",
                self._url(cfg.result.path, op, result_ref=result_ref),
                op,
                keep_raw=True,
                max_bytes=max_bytes,
                extra_headers=cfg.result.headers,
            )
        elif result_ref is None:
            if cfg.result is None:  # asking again cannot change it: the result is unavailable, and says why
                return NoAnswer(
                    "refused",
                    "the status gave no usable result reference, and the provider file declares no [result] "
                    "path to fetch the result from",
                )
            sent = await self._send(
                "GET",
                self._url(cfg.result.path, op),
                op,
                keep_raw=True,
                max_bytes=max_bytes,
                extra_headers=cfg.result.headers,
            )
        else:
            # a reference the provider handed us: judged by origin, never formatted, never given
            # the credential unless it points at exactly base_url's origin; and never one that carries
            # the credential itself (whatever an adapter read it with), which would go out in a request line
            why = unusable(result_ref, self.redactor)
            if why is not None:
                return NoAnswer("refused", f"the result reference is unusable ({why})")
            try:
                url = self.egress.resolve_reference(result_ref)
                target = None if self.egress.under_base(url) else self.egress.judge(url)
            except UrlRefused as exc:
                return refusal(exc, url_key="status.result_ref")
            if target is None or target.home:
                sent = await self._send("GET", url, op, keep_raw=True, max_bytes=max_bytes)
            else:
                answer = await self._foreign_transport(target.url, max_bytes + 1)
                sent = self._response(answer, max_bytes, keep_raw=True)
        if isinstance(sent, Response) and 300 <= (sent.http_status or 0) < 400:
            location = next((v for k, v in sent.headers.items() if k.lower() == "location"), None)
            shown = self.redactor.url(location) if location else "no Location header"
            # the raw body stays out; the observation says why nothing was stored
            return Response(
                http_status=sent.http_status,
                headers=sent.headers,
                provider_request_id=sent.provider_request_id,
                retry_after_s=sent.retry_after_s,
                body={"error": "redirect", "detail": f"redirect to {shown} not followed"},
            )
        return sent

    async def _result_from_status(self, op: Operation) -> Response | NoAnswer:
        """``[result] from_status``: a final status read, and the value at that path is the result (as JSON)."""
        cfg = self.config
        assert cfg.status is not None and cfg.result_from_status is not None
        sent = await self._send(cfg.status.method, self._url(cfg.status.path, op), op, extra_headers=cfg.status.headers)
        if isinstance(sent, NoAnswer):
            return sent
        value = extract_any(cfg.result_from_status, sent.body) if sent.http_status == 200 else None
        if value is not None and self._another_job(sent, op) is not None:  # another job's result is not ours
            value = None
        if value is None:
            return dataclasses.replace(sent, http_status=sent.http_status if sent.http_status != 200 else 404)
        return dataclasses.replace(
            sent, headers={**sent.headers, "Content-Type": "application/json"}, raw=canonical_bytes(value)
        )


def _token_used_otherwise(sent: Response) -> bool:
    """Does this refusal say the idempotency token is held for another request, rather than refuse ours? The
    IETF draft answers a key reused with a different payload 422; Stripe an ``idempotency_error``."""
    if sent.http_status == 422:
        return True
    error = sent.body.get("error") if isinstance(sent.body, dict) else None
    return isinstance(error, dict) and error.get("type") == "idempotency_error"


class _Unfollowable(Exception):
    """A list says more pages follow, and gives no way to them that we may take."""


def with_token(body: Any, name: str, token: str, *, provider: str) -> dict[str, Any]:
    """The request body with the token at ``name`` (``metadata.ref``: inside a nested object, merged with
    whatever the caller put there, never replacing it)."""
    if not isinstance(body, dict):
        raise ConfigError(
            f"provider {provider} puts the token in the body field {name!r}, so the request body must be a JSON object"
        )
    *parents, leaf = name.split(".")
    merged = dict(body)
    inner = merged
    for at, part in enumerate(parents):
        existing = inner.get(part, {})
        if not isinstance(existing, dict):
            where = ".".join(parents[: at + 1])
            raise ConfigError(
                f"provider {provider} puts the token at {name!r}, but the request's {where!r} is not a JSON object"
            )
        inner[part] = dict(existing)
        inner = inner[part]
    inner[leaf] = token
    return merged


def _innermost(exc: BaseException) -> str:
    """The name of the error at the bottom of ``exc``'s causes (``LineTooLong``, ``BadStatusLine``, ...)."""
    seen = {id(exc)}
    while (cause := exc.__cause__ or exc.__context__) is not None and id(cause) not in seen:
        seen.add(id(cause))
        exc = cause
    return type(exc).__name__


__all__ = [
    "CREDENTIAL_TTL_S",
    "HttpProvider",
    "HttpProviderConfig",
    "build",
    "load_provider",
    "parse_config",
    "read_at_most",
    "with_token",
]
