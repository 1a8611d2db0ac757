"""The provider contract: what an adapter for one remote API declares and does.

A provider states its guarantees as :class:`Capabilities` and performs five
calls. Each call returns an outcome object and never raises for what the
remote side did (time-outs, resets, odd status codes, malformed bodies): those
are facts to record. It raises only for our own misuse or misconfiguration.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, Protocol

from jobtrail.domain.backoff import Backoff
from jobtrail.domain.canonical import span_text
from jobtrail.domain.record import Operation
from jobtrail.domain.redact import Redactor
from jobtrail.domain.results import ResultSpec
from jobtrail.domain.states import RemoteState


class ReconcileMode(StrEnum):
    """How a provider lets us find out whether a create we may have sent made a job."""

    #: Re-send the create with the same idempotency token; the provider answers with the original job.
    REPLAY = "replay"
    #: List or search jobs by a client reference we sent with the create.
    LIST_BY_REFERENCE = "list_by_reference"
    #: Read the job's status by a client-supplied id (our token).
    STATUS_BY_CLIENT_ID = "status_by_client_id"


@dataclass(frozen=True, slots=True)
class TokenPlacement:
    """Where the idempotency token travels on a create."""

    where: Literal["header", "body", "query", "none"]
    name: str = ""
    #: IETF draft: the header is an RFC 8941 sf-string, i.e. double-quoted. Stripe-style is bare.
    quoted: bool = False


@dataclass(frozen=True, slots=True)
class Capabilities:
    """A provider's contract, as far as at-most-once creation and honest endings depend on it."""

    token: TokenPlacement
    #: How long the provider remembers a token (None: not documented).
    token_retention: timedelta | None
    #: Reconciliation paths, tried in order; empty means none exists.
    reconcile: tuple[ReconcileMode, ...]
    cancel: bool
    cancel_idempotent: bool
    result: Literal["safe_read", "one_time"]
    webhook_scheme: str | None
    states: Mapping[str, RemoteState]
    resume: bool = False

    def normalise(self, raw: str | None) -> RemoteState:
        """Map a raw provider state; anything unmapped is ``unknown`` (never terminal)."""
        if raw is None:
            return RemoteState.UNKNOWN
        return self.states.get(raw, self.states.get(raw.lower(), RemoteState.UNKNOWN))

    @property
    def at_most_once(self) -> bool:
        """Can a doubtful create be settled without risking a second job?"""
        return bool(self.reconcile)


CreateKind = Literal["confirmed", "synchronous", "rejected", "ambiguous", "not_sent"]


@dataclass(frozen=True, slots=True)
class Spooled:
    """A large body written to a file as it arrived, its size and sha256 counted on the way
    (:class:`~jobtrail.domain.results.ResultBytes`): a result is never held in memory whole.

    The file is the taker's: the ledger moves it into its content-addressed store, and whoever
    does not keep it deletes it (:meth:`discard`).
    """

    path: Path
    size: int
    sha256: str

    def read(self) -> bytes:
        return self.path.read_bytes()

    def lines(self) -> Iterator[bytes]:
        with self.path.open("rb") as fh:
            for line in fh:
                yield line.rstrip(b"\r\n")

    def windows(self, size: int, overlap: int) -> Iterator[bytes]:
        with self.path.open("rb") as fh:
            tail = b""
            while chunk := fh.read(size):
                yield tail + chunk
                tail = chunk[-overlap:] if overlap else b""

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


def count_lines(data: bytes | Spooled) -> int:
    """The non-blank lines of a fetched body (a JSONL file's records). Blocking: run it off the event loop."""
    lines = data.split(b"\n") if isinstance(data, bytes) else data.lines()
    return sum(1 for line in lines if line.strip())


async def lines_short(data: bytes | Spooled, expected: int | None) -> int | None:
    """The lines ``data`` holds when fewer than ``expected`` (None: enough, or nothing to hold it to), its
    file then discarded. A JSONL results file cut at a line boundary (a connection closed early with no
    length given) parses whole, and its missing items would otherwise be stored as a success."""
    if not expected:
        return None
    lines = await asyncio.to_thread(count_lines, data)
    if lines >= expected:
        return None
    if isinstance(data, Spooled):
        data.discard()
    return lines


def join_bodies(parts: Sequence[bytes | Spooled], *, spool_over: int) -> bytes | Spooled:
    """Several fetched bodies as one, each ending in a newline (JSONL files, say): in memory while the
    total stays under ``spool_over`` bytes, else streamed into a file of its own. The parts' files are
    discarded either way, and a half-written join is removed. Blocking: run it off the event loop."""
    try:
        total = sum(p.size if isinstance(p, Spooled) else len(p) for p in parts)
        if total < spool_over and all(isinstance(p, bytes) for p in parts):
            data = b""
            for part in parts:
                assert isinstance(part, bytes)
                data += part if not data or data.endswith(b"\n") else b"\n" + part
            return data
        digest, size, last = hashlib.sha256(), 0, b"\n"
        with tempfile.NamedTemporaryFile(prefix="jobtrail-fetch-", delete=False) as out:
            try:
                for part in parts:
                    chunks = part.windows(1024 * 1024, 0) if isinstance(part, Spooled) else iter((part,))
                    for n, chunk in enumerate(chunks):
                        piece = b"\n" + chunk if n == 0 and size and last != b"\n" else chunk
                        if piece:
                            out.write(piece)
                            digest.update(piece)
                            size += len(piece)
                            last = piece[-1:]
            except BaseException:
                out.close()
                Path(out.name).unlink(missing_ok=True)
                raise
        return Spooled(Path(out.name), size, digest.hexdigest())
    finally:
        for part in parts:
            if isinstance(part, Spooled):
                part.discard()


@dataclass(frozen=True, slots=True, kw_only=True)
class Response:
    """What came back over the wire, before redaction (the store redacts it)."""

    http_status: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    body: Any = None
    provider_request_id: str | None = None
    retry_after_s: float | None = None
    #: the undecoded body (result fetches only); never stored as is
    raw: bytes | None = None
    #: the undecoded body of a large result fetch, in a file instead of ``raw``
    spooled: Spooled | None = None
    #: why the body could not be read (not JSON that can be kept, too large): ours, never the provider's words
    unreadable: str | None = None

    @property
    def fetched(self) -> bytes | Spooled | None:
        """The undecoded body, wherever it is."""
        return self.raw if self.raw is not None else self.spooled

    def content(self) -> bytes | None:
        """The undecoded body in memory (read back from its file if it was spooled; the file is discarded)."""
        if self.spooled is None:
            return self.raw
        try:
            return self.spooled.read()
        finally:
            self.spooled.discard()

    def to_json(self) -> dict[str, Any]:
        return {"http_status": self.http_status, "headers": dict(self.headers), "body": self.body}


@dataclass(frozen=True, slots=True)
class NoAnswer:
    """A request that brought back no HTTP answer: why, in a word (``error_class``), and the detail.

    ``not_sent``: the connection was never made, so nothing reached the provider. ``refused``:
    jobtrail would not make the request (a URL the operator did not declare, say), so asking again
    cannot change anything. Anything else (``timeout``, ``connection_reset``,
    ``incomplete_response``, ...) may have reached the provider.
    """

    error_class: str
    detail: str
    #: what else an observation records about it (the refused host, and where its URL came from)
    facts: Mapping[str, str] = field(default_factory=dict)

    @property
    def not_sent(self) -> bool:
        return self.error_class == "not_sent"

    @property
    def refused(self) -> bool:
        return self.error_class == "refused"

    def create_outcome(self) -> CreateOutcome:
        """What a create that got no answer proves: nothing was made if it never left, else it may have been."""
        if self.not_sent:
            return CreateOutcome(kind="not_sent", error_class="connection_failed", detail=self.detail)
        return CreateOutcome(kind="ambiguous", error_class=self.error_class, detail=self.detail)

    def to_json(self) -> dict[str, str]:
        return {"error": self.error_class, **self.facts, "detail": self.detail}

    def __str__(self) -> str:
        return f"{self.error_class}: {self.detail}"


@dataclass(frozen=True, slots=True)
class WireAnswer:
    """What a transport read off the wire: the status, the headers and at most the body's allowed size."""

    status: int
    headers: dict[str, str]
    body: bytes | Spooled


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateOutcome:
    """The result of one create (or replay) attempt."""

    kind: CreateKind
    response: Response = field(default_factory=Response)
    remote_job_id: str | None = None
    status_url: str | None = None
    result: Any = None
    error_class: str = ""
    detail: str = ""
    declared_non_retryable: bool = False
    #: an ambiguous answer that neither waiting nor sending again can settle (a redirect, an id taken by
    #: another job): the operation stops for a person at once, ``detail`` saying what to look at
    person_must_decide: bool = False


LookupKind = Literal["found", "absent", "unknown", "candidates"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LookupOutcome:
    """The result of asking, by a reconciliation path other than replay, whether our job exists."""

    kind: LookupKind
    path: ReconcileMode
    response: Response = field(default_factory=Response)
    #: every job the provider associates with our token (more than one breaks its contract); for
    #: ``candidates``: the jobs created in the create's window that nothing ties to us or rules out
    remote_job_ids: tuple[str, ...] = ()
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusOutcome:
    """One status read."""

    remote_state: RemoteState
    raw_state: str | None
    response: Response = field(default_factory=Response)
    progress: float | None = None
    result_ref: str | None = None
    provider_time: str | None = None
    #: what the provider says is already done (files written, items processed): the damage bound
    effects: Any = None
    error_class: str = ""
    #: what ``error_class`` leaves out (where a redirect pointed), for a person; never the provider's bytes unmasked
    detail: str = ""
    #: the provider's own words on why the job ended without a result (its error message), through
    #: :func:`~jobtrail.domain.words.their_words`: quoted in the state reason, masked as it is written
    failure: str = ""


class Provider(Protocol):
    """What an adapter implements. :class:`HttpProvider` covers most APIs from a file."""

    name: str
    #: what the jobs act on by default (an account, a project, a host)
    target: str
    #: the create endpoint, e.g. ``POST /v1/jobs`` (part of the request fingerprint)
    create_endpoint: str
    capabilities: Capabilities
    #: when to try again after a doubtful create
    backoff: Backoff
    #: how often to poll a running job (Retry-After, when the provider sends it, wins)
    poll_backoff: Backoff
    #: what a valid result looks like
    result_spec: ResultSpec
    #: learns every credential value the provider resolves; a ledger the provider writes through is
    #: told them too (:meth:`~jobtrail.domain.redact.Redactor.forward_to`)
    redactor: Redactor

    async def create(self, op: Operation) -> CreateOutcome:
        """Send the create with ``op.idempotency_token`` and ``op.trace_id``."""
        ...

    async def lookup(self, op: Operation, mode: ReconcileMode) -> LookupOutcome:
        """Ask whether a job exists for ``op`` by a non-replay path."""
        ...

    async def status(self, op: Operation) -> StatusOutcome:
        """Read the remote job's state."""
        ...

    async def cancel(self, op: Operation) -> Response | NoAnswer:
        """Ask the provider to cancel the remote job (once): the answer, or why there was none."""
        ...

    async def candidates(self, op: Operation, since_us: int, until_us: int) -> LookupOutcome:
        """Where no reconciliation path exists: the jobs created between ``since_us`` and ``until_us``
        (epoch microseconds) that may be ``op``'s (kind ``candidates``; ``unknown`` if the provider cannot
        list them). They are never adopted: a person decides, with the list in front of them."""
        ...

    async def fetch_result(self, op: Operation, result_ref: str | None) -> Response | NoAnswer:
        """Fetch the finished job's result: the answer, or why there was none."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


def slowest_call_s(provider: Provider) -> float:
    """The longest one call to ``provider`` can take (its time-outs; 0 when it declares none)."""
    config = getattr(provider, "config", None)
    return float(getattr(config, "timeout_s", 0.0) or 0.0) + float(getattr(config, "connect_timeout_s", 0.0) or 0.0)


def guarantees(provider: Provider) -> dict[str, Any]:
    """What a provider's declared contract lets jobtrail promise (``jobtrail providers check``)."""
    from jobtrail.domain.record import DEFAULT_CREATE_DEADLINE

    caps = provider.capabilities
    token = caps.token
    if token.where == "none":
        token_text = "no idempotency token is sent"  # noqa: S105 - not a password
    else:
        token_text = f"token in {token.where} {token.name!r}" + (" (quoted sf-string)" if token.quoted else "")
    if caps.at_most_once:
        modes = ", ".join(m.value for m in caps.reconcile)
        once = {"verdict": "yes", "why": f"{token_text}; a doubtful create is reconciled by {modes}"}
    elif getattr(provider, "lists_candidates", False):
        once = {
            "verdict": "no",
            "why": f"{token_text} and no reconciliation path: after a lost response jobtrail never sends "
            "again; it stops at needs_attention naming the jobs the provider lists as created in that "
            "window, and a person decides",
        }
    else:
        once = {
            "verdict": "no",
            "why": f"{token_text} and no reconciliation path: after a lost response "
            "jobtrail stops at needs_attention and a person must check the provider for a job",
        }
    if caps.cancel:
        cancel = {
            "verdict": "yes",
            "why": "cancel endpoint declared"
            + (", idempotent" if caps.cancel_idempotent else ", not idempotent: sent at most once"),
        }
    else:
        cancel = {"verdict": "no", "why": "no cancel endpoint: a cancel request can only be recorded"}
    result = {
        "verdict": caps.result,
        "why": "safe to fetch again"
        if caps.result == "safe_read"
        else "a one-time artifact: stored before it is acknowledged, never fetched twice",
    }
    warnings = []
    retention = caps.token_retention
    if ReconcileMode.REPLAY in caps.reconcile and retention is None:
        warnings.append(
            "the provider's token retention is not declared (create.token_retention_s); "
            "jobtrail cannot tell how long a replay is safe"
        )
    elif ReconcileMode.REPLAY in caps.reconcile and retention is not None and retention < DEFAULT_CREATE_DEADLINE:
        warnings.append(
            f"tokens are kept for {span_text(retention)}, less than the default create deadline "
            f"({span_text(DEFAULT_CREATE_DEADLINE)}): submit with --create-deadline below {span_text(retention)}"
        )
    config = getattr(provider, "config", None)
    if (
        getattr(provider, "kind", "http") == "http"
        and config is not None
        and not (config.result or config.result_from_status or config.result_ref_path)
    ):
        warnings.append(
            "no [result] path, [result] from_status or [status] result_ref: a job that finishes (other than "
            "with a synchronous result) ends result_unavailable, since its result cannot be fetched"
        )
    credential = getattr(config, "credential", None)
    return {
        "provider": provider.name,
        "kind": getattr(provider, "kind", "http"),
        "contract": getattr(provider, "contract_note", ""),
        "base_url": getattr(config, "base_url", None),
        # the only other places a provider's result links may send jobtrail (without the credential)
        "download_hosts": [str(rule) for rule in getattr(config, "download_hosts", ())],
        "at_most_once": caps.at_most_once,
        "credential": None if credential is None else credential.describe(),
        "guarantees": {"at-most-once creation": once, "cancel": cancel, "result": result},
        "reconcile": [m.value for m in caps.reconcile],
        "token_retention_s": None if retention is None else retention.total_seconds(),
        "warnings": warnings,
    }
