"""The operation record and history entry as read from storage."""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypedDict

from jobtrail.domain.canonical import from_us, rfc3339
from jobtrail.domain.errors import UsageError
from jobtrail.domain.explain import advice, next_action
from jobtrail.domain.states import CREATE_PHASE, State

DEFAULT_CREATE_DEADLINE = timedelta(hours=1)
DEFAULT_RESULT_DEADLINE = timedelta(hours=24)
DEFAULT_CANCEL_DEADLINE = timedelta(minutes=30)
MAX_KEY_LENGTH = 200
#: a caller's, an approver's or a deciding person's name: every listing shows it whole
MAX_NAME_LENGTH = 200


@dataclass(frozen=True, slots=True, kw_only=True)
class OperationSpec:
    """What a caller asks for: one logical remote job.

    Args:
        provider: name of the provider adapter that will run it.
        target: what the job acts on (account, project, dataset...), free text.
        endpoint: the provider endpoint, e.g. ``POST /v1/batches``.
        body: the JSON request body; kept on the record to re-send it unchanged.
        operation_key: optional caller-chosen key, unique per provider.
        caller: who asked.
        approved_by: who approved (a person, a policy), if anyone.
        create_deadline: how long creating may take before a person must look.
        result_deadline: how long the job may take before we stop waiting.
        cancel_deadline: how long a cancel may take to be confirmed.
        trace_id: the W3C trace the operation joins (the caller's current trace); None: a trace of its own.
    """

    provider: str
    target: str
    endpoint: str
    body: Any
    operation_key: str | None = None
    caller: str = "unknown"
    approved_by: str | None = None
    create_deadline: timedelta | None = DEFAULT_CREATE_DEADLINE
    result_deadline: timedelta | None = DEFAULT_RESULT_DEADLINE
    cancel_deadline: timedelta | None = DEFAULT_CANCEL_DEADLINE
    trace_id: str | None = None

    def __post_init__(self) -> None:
        trace_id = self.trace_id
        if trace_id is not None and (len(trace_id) != 32 or trace_id.strip("0123456789abcdef") or trace_id == "0" * 32):
            raise UsageError(f"trace id {trace_id!r} is not a W3C trace id (32 lowercase hex digits, not all zeros)")
        if self.operation_key is not None:
            check_operation_key(self.operation_key)
        check_name("caller", self.caller)
        if self.approved_by is not None:
            check_name("approver", self.approved_by)

    def check_deadlines(self) -> None:
        """A caller's deadlines must lie ahead (the ledger itself records any, a past one included)."""
        for name in ("create_deadline", "result_deadline", "cancel_deadline"):
            value = getattr(self, name)
            if value is not None and not value > timedelta(0):
                raise UsageError(
                    f"{name} must be positive (got {value.total_seconds():g} s); leave it out for the default"
                )


#: what shows as nothing or changes how the rest shows: Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties,
#: 15.1: zero-width characters, bidirectional controls such as U+202E, variation selectors, Hangul fillers, tags)
IGNORABLE = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f\u200b-\u200f\u202a-\u202e\u2060-\u206f\u3164"
    "\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufff8\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]"
)
#: and the categories of the same kind: controls, formatting, lone surrogates, unassigned code points (which a later
#: Unicode may make ignorable), line and paragraph separators
_UNSEEN_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Cn", "Zl", "Zp"})
_ASCII_CONTROL = re.compile("[\x00-\x1f\x7f]")
_ZWNJ, _ZWJ = "\u200c", "\u200d"
#: the Arabic script's blocks, whose letters Persian, Urdu and others separate with ZWNJ inside a word
_ARABIC = ((0x0600, 0x06FF), (0x0750, 0x077F), (0x08A0, 0x08FF), (0xFB50, 0xFDFF), (0xFE70, 0xFEFF))


def unseen_character(text: str) -> str | None:
    """The first character of ``text`` that shows as nothing or changes how the rest shows (``U+202E
    RIGHT-TO-LEFT OVERRIDE at position 4``), or None. Two keys that differ only by one look alike in every
    listing, and an override turns a key or an approver's name around on screen.

    Where such a character is part of how a script or an emoji is written it is kept (see :func:`_writes`):
    a joiner after a virama (Hindi), ZWNJ between Arabic-script letters (Persian), ZWJ between emoji, and a
    variation selector after a symbol or a keycap's digit."""
    if text.isascii():  # (every submit's caller, most keys: one search in C)
        match = _ASCII_CONTROL.search(text)
        found = None if match is None else match.start()
    else:
        found = next(
            (
                i
                for i, c in enumerate(text)
                if (IGNORABLE.match(c) or unicodedata.category(c) in _UNSEEN_CATEGORIES) and not _writes(text, i)
            ),
            None,
        )
    if found is None:
        return None
    char = text[found]
    name = unicodedata.name(char, "a control or unassigned character")
    return f"U+{ord(char):04X} {name} at position {found + 1}"


def check_shown(what: str, text: str) -> None:
    """Raise :class:`UsageError` if ``text`` (a name every listing shows) holds an :func:`unseen_character`."""
    unseen = unseen_character(text)
    if unseen is not None:
        raise UsageError(
            f"the {what} holds {unseen}: no control characters nor invisible formatting (bidirectional "
            "overrides, zero-width characters), which would make a listing show it as other text than it is"
        )


def check_name(what: str, name: str) -> None:
    """Raise :class:`UsageError` for a name (a caller's, an approver's) longer than :data:`MAX_NAME_LENGTH` or
    not shown as it is (see :func:`check_shown`): one of 3,000 characters pushed every other column of a
    listing off the screen."""
    if len(name) > MAX_NAME_LENGTH:
        raise UsageError(f"the {what} must be at most {MAX_NAME_LENGTH} characters (it has {len(name)})")
    check_shown(what, name)


def check_operation_key(key: str) -> None:
    """Raise :class:`UsageError` for a key that is empty, too long or not shown as it is (see :func:`check_shown`)."""
    if not key.strip():
        raise UsageError("the operation key is empty; give a key that names the job, or none at all")
    if len(key) > MAX_KEY_LENGTH:
        raise UsageError(f"the operation key must be at most {MAX_KEY_LENGTH} characters")
    check_shown("operation key", key)


def _writes(text: str, i: int) -> bool:
    """Is ``text[i]`` (an ignorable character) part of how its neighbours are written? (RFC 5892's contexts for
    the joiners, Arabic's approximated by script, and Unicode's emoji sequences.)"""
    char, before = text[i], text[i - 1] if i else ""
    after = text[i + 1] if i + 1 < len(text) else ""
    if char in (_ZWNJ, _ZWJ) and before and unicodedata.combining(before) == 9:  # after a virama
        return True
    if char == _ZWNJ:
        return _arabic_letter(before) and _arabic_letter(after)
    if char == _ZWJ:
        emoji = before if before != "\ufe0f" or i < 2 else text[i - 2]
        return _emoji(emoji) and _emoji(after)
    if char in ("\ufe0e", "\ufe0f"):  # text or emoji presentation: of a symbol, or a keycap's digit
        return bool(before) and (_emoji(before) or before in "0123456789#*")
    return False


def _arabic_letter(char: str) -> bool:
    return bool(char) and unicodedata.category(char).startswith("L") and any(a <= ord(char) <= b for a, b in _ARABIC)


def _emoji(char: str) -> bool:
    """A pictograph (So) or a skin-tone modifier, as an emoji ZWJ sequence joins them."""
    return bool(char) and (unicodedata.category(char) == "So" or 0x1F3FB <= ord(char) <= 0x1F3FF)


class Changes(TypedDict, total=False):
    """What a write may set on an operation besides its state (the state moves only through the machine)."""

    remote_job_id: str | None
    remote_state: str | None
    state_reason: str | None
    attempts: int
    next_action_at_us: int | None
    polls: int
    result_ref: str | None
    cancel_requested_by: str | None
    partial_effects: Any
    cancel_deadline_us: int | None


class _BodyNotLoaded:
    """A claimed record's request body, left unread: an action after the create never sends it, and it
    may be megabytes (a long prompt) for each of a thousand operations claimed at once."""

    __slots__ = ()

    def __reduce__(self) -> str:
        return "BODY_NOT_LOADED"

    def __repr__(self) -> str:
        return "<request body not loaded>"


BODY_NOT_LOADED = _BodyNotLoaded()


def body_needed(state: State, remote_job_id: str | None) -> bool:
    """Can an action in ``state`` send the request body? A create (or a replay of it) in the create phase,
    and a look for the job among the provider's by what was asked, while no job id is known."""
    return state in CREATE_PHASE or remote_job_id is None


@dataclass(frozen=True, slots=True, kw_only=True)
class Operation:
    """One operation record. Immutable: every change goes through the store."""

    operation_id: str
    provider: str
    target: str
    endpoint: str
    operation_key: str | None
    request_fingerprint: str
    #: :data:`BODY_NOT_LOADED` in an operation claimed by a worker where no action of its state sends it
    #: (see :func:`body_needed`); the record keeps it
    request_body: Any
    idempotency_token: str
    trace_id: str
    remote_job_id: str | None
    state: State
    remote_state: str | None
    state_reason: str | None
    attempts: int
    create_deadline_us: int | None
    result_deadline_us: int | None
    cancel_deadline_us: int | None
    caller: str
    approved_by: str | None
    created_at_us: int
    updated_at_us: int
    next_action_at_us: int | None
    version: int
    history_head: str
    lease_owner: str | None
    lease_expires_at_us: int | None
    lease_epoch: int
    #: requests sent to the provider in the current state (the count starts afresh in each state and
    #: paces the back-off): status polls while watching, result fetches while collecting, the cancel
    #: and then status polls while a cancel is requested. :attr:`fetch_attempts` and :attr:`cancel_sent`
    #: say what was sent. (The name is the column's, kept for the audit chain that seals it.)
    polls: int = 0
    #: where the finished result lives (a URL, an id, or ``observation:N`` for a stored one)
    result_ref: str | None = None
    #: who asked to cancel before the job id was known (the worker cancels once it is)
    cancel_requested_by: str | None = None
    #: what the provider reported as already done (files written, items processed): the damage bound
    partial_effects: Any = None

    @property
    def fetch_attempts(self) -> int:
        """Result fetches sent while collecting."""
        return self.polls if self.state is State.RESULT_COLLECTING else 0

    @property
    def cancel_sent(self) -> bool:
        """Whether the recorded cancel has gone out (or, with no cancel endpoint, been given up on)."""
        return self.state is State.CANCEL_REQUESTED and self.polls > 0

    @property
    def cancel_window_us(self) -> int | None:
        """How long a cancel may take, as the operation was submitted with it (until the cancel is asked
        for, ``cancel_deadline_us`` holds the window from creation; then the deadline counts from the ask)."""
        if self.cancel_deadline_us is None:
            return None
        return max(self.cancel_deadline_us - self.created_at_us, 0)

    @property
    def create_deadline(self) -> datetime | None:
        return None if self.create_deadline_us is None else from_us(self.create_deadline_us)

    @property
    def result_deadline(self) -> datetime | None:
        return None if self.result_deadline_us is None else from_us(self.result_deadline_us)

    @property
    def cancel_deadline(self) -> datetime | None:
        return None if self.cancel_deadline_us is None else from_us(self.cancel_deadline_us)

    def deadline_us(self, kind: str) -> int | None:
        return {
            "create": self.create_deadline_us,
            "result": self.result_deadline_us,
            "cancel": self.cancel_deadline_us,
        }[kind]

    def to_json(self) -> dict[str, Any]:
        """The stable JSON shape of ``jobtrail ops show --json`` (the token is never shown)."""
        return {
            "operation_id": self.operation_id,
            "provider": self.provider,
            "target": self.target,
            "endpoint": self.endpoint,
            "operation_key": self.operation_key,
            "request_fingerprint": self.request_fingerprint,
            "trace_id": self.trace_id,
            "remote_job_id": self.remote_job_id,
            "state": self.state.value,
            "remote_state": self.remote_state,
            "state_reason": self.state_reason,
            "attempts": self.attempts,
            "create_deadline": rfc3339(self.create_deadline_us),
            "result_deadline": rfc3339(self.result_deadline_us),
            "cancel_deadline": rfc3339(self.cancel_deadline_us),
            "caller": self.caller,
            "approved_by": self.approved_by,
            "created_at": rfc3339(self.created_at_us),
            "updated_at": rfc3339(self.updated_at_us),
            "next_action_at": rfc3339(self.next_action_at_us),
            "version": self.version,
            "lease": {
                "owner": self.lease_owner,
                "expires_at": rfc3339(self.lease_expires_at_us),
                "epoch": self.lease_epoch,
            },
            "polls": self.polls,
            "result_ref": self.result_ref,
            "cancel_requested_by": self.cancel_requested_by,
            "partial_effects": self.partial_effects,
            "next_action": next_action(self),
            # what the caller should do now (next_action is what a worker does next)
            "advice": advice(self),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryEntry:
    """One append-only, hash-chained history entry."""

    operation_id: str
    seq: int
    at_us: int
    actor: str
    from_state: str | None
    to_state: str
    cause: str
    evidence: str
    remote_job_id: str | None
    trace_id: str
    request_ids: str
    request_fingerprint: str
    prev_hash: str
    entry_hash: str
    hash_version: int
    #: what a version-2 entry binds to the chain (row field digests, observations, result digest)
    covers: str | None = None
    obs_upto: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The stable JSON shape of ``jobtrail ops history --json``."""
        return {
            "operation_id": self.operation_id,
            "seq": self.seq,
            "at": rfc3339(self.at_us),
            "actor": self.actor,
            "from": self.from_state,
            "to": self.to_state,
            "cause": self.cause,
            "evidence": json.loads(self.evidence),
            "remote_job_id": self.remote_job_id,
            "trace_id": self.trace_id,
            "provider_request_ids": json.loads(self.request_ids),
            "request_fingerprint": self.request_fingerprint,
            "prev_hash": self.prev_hash,
            "hash": self.entry_hash,
        }
