"""Redaction: the one choke point between what we see and what we write.

Nothing reaches storage or our logs without passing a :class:`Redactor`.
Four passes, in this order:

1. the exact values of credentials we injected (and their base64, URL-encoded,
   hex and Basic-auth forms) are masked wherever they appear;
2. known secret formats (PEM blocks, JWTs, ``Bearer ...``, common key
   prefixes, ``key=value`` pairs whose key names a secret) are masked in text;
3. URLs lose their userinfo and the values of token-like query parameters;
4. headers outside an allow-list, and JSON fields whose names carry secrets,
   are masked, keeping the name so the shape of the evidence survives.
"""

from __future__ import annotations

import base64
import binascii
import functools
import html
import json
import logging
import re
import string
import threading
import urllib.parse
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NoReturn, TypeVar

_T = TypeVar("_T")
REDACTED = "[REDACTED]"
#: what stands in for a result that carried a credential
WITHHELD_CREDENTIAL = "no_credentials: the result carried a configured credential and was not kept"
#: what an answer stored as evidence is replaced by when a credential runs across its strings
WITHHELD_SPLIT_CREDENTIAL = (
    "no_credentials: the answer carried a configured credential split across its strings and was not kept"
)

_HEADER_ALLOW = frozenset(
    {
        "content-type",
        "content-length",
        "content-encoding",
        "retry-after",
        "etag",
        "date",
        "last-modified",
        "cache-control",
        "vary",
        "server",
        "location",
        "operation-location",
        "azure-asyncoperation",
        "operation-id",
        "idempotency-key",
        "idempotent-replayed",
        "repeatability-result",
        "traceparent",
        "tracestate",
        "x-trace-id",
        "webhook-id",
        "webhook-timestamp",
    }
)
_HEADER_ALLOW_SUFFIX = ("request-id", "requestid")
_HEADER_ALLOW_PREFIX = ("ratelimit-", "x-ratelimit-")
_URL_HEADERS = frozenset({"location", "operation-location", "azure-asyncoperation"})

_SECRET_KEY_PARTS = (
    "password",
    "passwd",
    "secret",
    "token",
    "apikey",
    "privatekey",
    "credential",
    "signature",
    "cookie",
    "authorization",
    "sessionid",
    "accesskey",
)
_SECRET_KEY_EXACT = frozenset({"auth", "session", "sig", "key", "code", "pass", "pwd", "jwt"})

_QUERY_SECRET = frozenset(
    {
        "awsaccesskeyid",
        "signature",
        "sig",
        "key",
        "apikey",
        "accesstoken",
        "refreshtoken",
        "idtoken",
        "token",
        "code",
        "clientsecret",
        "password",
        "secret",
        "auth",
    }
)

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"-----BEGIN [A-Z0-9 ]+-----[\s\S]*?-----END [A-Z0-9 ]+-----"), REDACTED),
    (re.compile(r"\beyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*"), REDACTED),
    # an auth scheme followed by something credential-shaped (a digit or symbol, not prose)
    (
        re.compile(r"(?i)\b(bearer|basic|token|digest)(\s+)(?=[A-Za-z]*[0-9._~+/=-])[A-Za-z0-9._~+/=-]{6,}"),
        r"\1\2" + REDACTED,
    ),
    (re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"), REDACTED),
    (re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}"), REDACTED),
    (re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"), REDACTED),
    (re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"), REDACTED),
    (re.compile(r"\b(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{10,}"), REDACTED),
    (re.compile(r"\bsk-(?:ant-)?[A-Za-z0-9_-]{16,}"), REDACTED),
    (re.compile(r"\bwhsec_[A-Za-z0-9+/=]{10,}"), REDACTED),
    # userinfo in any URL inside text
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s:@]+(?::[^/\s@]*)?@"), r"\1" + "REDACTED:REDACTED@"),
)
#: where each of _PATTERNS can match: the hints (lower case) one of which any match contains, each with how
#: far into the match it starts (None where that varies: a URL's scheme comes before its "://") and what
#: else any match holds after it, where a match may run on (a PEM block is only one once its END follows)
_PATTERN_ANCHORS: tuple[tuple[tuple[str, int | None, re.Pattern[str] | None], ...], ...] = (
    (("-----begin", 0, re.compile(r"(?=-----END [A-Z0-9 ]+-----)")),),  # (a lookahead finds every start)
    (("eyj", 0, None),),
    (("bearer", 0, None), ("basic", 0, None), ("token", 0, None), ("digest", 0, None)),
    (("akia", 0, None), ("asia", 0, None)),
    (("ghp_", 0, None), ("gho_", 0, None), ("ghu_", 0, None), ("ghs_", 0, None), ("ghr_", 0, None)),
    (("github_pat_", 0, None),),
    (("xox", 0, None),),
    (("_live_", 2, None), ("_test_", 2, None)),
    (("sk-", 0, None),),
    (("whsec_", 0, None),),
    (("://", None, None),),
)
#: a string that contains none of these cannot match any of _PATTERNS
_STRONG_HINTS = tuple(hint for anchors in _PATTERN_ANCHORS for hint, _, _ in anchors)
#: nor these any of _KV_PATTERNS
_KV_HINTS = (
    "passw",
    "pwd",
    "secret",
    "token",
    "key",
    "sig",
    "auth",
    "credential",
    "cookie",
    "session",
)

#: no pattern in _PATTERNS matches fewer characters than this
_SHORTEST_PATTERN = 6  # "a://b@"
_TEXT_CACHED_LEN = 200
_TEXT_CACHE_SIZE = 8192
#: a character a URL scheme may hold, as the userinfo pattern in _PATTERNS reads it (without case)
_SCHEME_CHAR = re.compile(r"(?i)[a-z0-9+.-]")
#: that pattern's end, from its "://": where it fails, each scheme start before would fail the same way
#: (tried from each, a long run of "a.a.a..." took time in its square)
_USERINFO = re.compile(r"://[^/\s:@]+(?::[^/\s@]*)?@")
_STRONG_HINT_LOWER = re.compile("|".join(re.escape(h) for h in _STRONG_HINTS))
_KV_HINT_LOWER = re.compile("|".join(re.escape(h) for h in _KV_HINTS))
#: the only characters beyond ASCII that Python's case-insensitive matching takes for a hint's letters
#: (dotted and dotless I, long s, Kelvin; tests/test_redaction.py scans every code point to be sure)
_HINT_LOOKALIKES = (("\u0130", "i"), ("\u0131", "i"), ("\u017f", "s"), ("\u212a", "k"))


def _hint_text(text: str) -> str:
    """``text`` as a hint search reads it: lower case, Unicode's case rules kept, in ASCII (which searches at
    a seventh of the cost of a case-insensitive match): the look-alikes as their letters, any other
    character beyond ASCII (which no hint can contain or match) as ``?``."""
    if not text.isascii():
        for lookalike, letter in _HINT_LOOKALIKES:  # four scans in C: a translation table is read per character
            text = text.replace(lookalike, letter)
        text = text.encode("ascii", errors="replace").decode("ascii")
    return text.lower()


def _strong_hint(text: str) -> bool:
    """Does ``text`` contain one of :data:`_STRONG_HINTS`, in any case?"""
    return _STRONG_HINT_LOWER.search(_hint_text(text)) is not None


def _pattern_found(text: str) -> bool:
    """Does one of :data:`_PATTERNS` match in ``text``? (``any(p.search(text) ...)``, the same answer.)

    A pattern is tried only where one of its hints occurs, and from where its match would start: a
    search of a long text costs a millisecond or more per pattern, and prose is full of hints ("token").
    """
    lower = _hint_text(text)
    if len(text) <= _TEXT_CACHED_LEN and _STRONG_HINT_LOWER.search(lower) is None:
        # a short text with no hint at all (an id, a state, a relative URL): one search, not one per hint
        # (past some hundreds of characters the plain finds below cost less than the alternation)
        return False
    for (pattern, _), anchors in zip(_PATTERNS, _PATTERN_ANCHORS, strict=True):
        for hint, offset, after in anchors:
            at = lower.find(hint)
            # past the last of what a match holds after its hint, no match starts (tried from each hint, a
            # thousand BEGINs without an END took time in their square)
            last = len(text) if after is None or at < 0 else max((m.start() for m in after.finditer(text)), default=-1)
            while 0 <= at <= last:
                if offset is not None:
                    starts: Iterable[int] = (at - offset,) if at >= offset else ()
                elif _USERINFO.match(text, at):  # else no scheme before this "://" makes a match
                    starts = _scheme_starts(text, at)
                else:
                    starts = ()
                if any(pattern.match(text, start) for start in starts):
                    return True
                at = lower.find(hint, at + 1)
    return False


def _scheme_starts(text: str, at: int) -> list[int]:
    """Where a URL scheme ending at ``at`` (its "://") could start: the run of scheme characters before it,
    at its first character or after a ``+ . -`` in it (a scheme starts at a word boundary)."""
    start = at
    while start > 0 and _SCHEME_CHAR.match(text, start - 1):
        start -= 1
    return [start, *(i + 1 for i in range(start, at) if text[i] in "+.-")]


def _kv_hint(text: str) -> bool:
    """Does ``text`` contain one of :data:`_KV_HINTS`, in any case?"""
    return _KV_HINT_LOWER.search(_hint_text(text)) is not None


_NON_ALNUM = re.compile(r"[^a-z0-9]")

#: ``key=value`` / ``"key": "value"`` where the key names a secret. Used to redact,
#: not to refuse request bodies: it would also match harmless prose.
_KV_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(
            r"""(?ix)
            (["']?[a-z0-9_.-]*
              (?:password|passwd|pwd|secret|token|key|sig|signature|auth|authorization
                 |credential|cookie|session[_-]?id)
            ["']?\s*[:=]\s*["']?)
            (?!\[REDACTED\])([^"'\s&,;}]+)
            """
        ),
        r"\1" + REDACTED,
    ),
)


#: field names that name a credential outright (refused in request bodies); narrower than
#: :func:`is_secret_name`, which masks, so ``code``, ``key`` or ``tokenizer`` are not refused
_CREDENTIAL_KEYS = frozenset(
    {
        "authorization",
        "auth",
        "apikey",
        "xapikey",
        "token",
        "accesstoken",
        "refreshtoken",
        "idtoken",
        "authtoken",
        "bearer",
        "bearertoken",
        "secret",
        "clientsecret",
        "password",
        "passwd",
        "credential",
        "credentials",
        "privatekey",
        "secretkey",
        "accesskey",
        "accesskeyid",
        "sessiontoken",
        "sessionid",
        "sessionkey",
    }
)
_CREDENTIAL_KEY_SUFFIXES = (
    "apikey",
    "secret",
    "password",
    "accesstoken",
    "authtoken",
    "refreshtoken",
    "bearertoken",
    "privatekey",
    "secretkey",
    "accesskey",
    "sessiontoken",
    "credentials",
    "credential",
)


@functools.lru_cache(maxsize=4096)
@functools.lru_cache(maxsize=4096)
def _norm(name: str) -> str:
    return _NON_ALNUM.sub("", name.lower())


@functools.lru_cache(maxsize=4096)
def is_credential_field(name: str) -> bool:
    """Does a request field's name say it carries a credential (``api_key``, ``Authorization``, ...)?"""
    n = _norm(name)
    return n in _CREDENTIAL_KEYS or n.endswith(_CREDENTIAL_KEY_SUFFIXES)


@functools.lru_cache(maxsize=4096)
def is_secret_name(name: str) -> bool:
    """Does a header, field or parameter name say its value is a credential?"""
    n = _norm(name)
    return n in _SECRET_KEY_EXACT or any(part in n for part in _SECRET_KEY_PARTS)


class Secret:
    """A resolved credential. Its repr is masked; it refuses to be pickled or stored.

    Creating one registers its value (and encodings of it) with the redactor of
    whoever resolved it (a provider's, which passes it on to the ledgers it writes
    to), so the exact value is masked anywhere it might leak.
    """

    __slots__ = ("_value",)

    def __init__(self, value: str, *, redactor: Redactor) -> None:
        self._value = value
        redactor.register(value)

    def reveal(self) -> str:
        """The value, for the one place that puts it on the wire."""
        return self._value

    def __repr__(self) -> str:
        return "Secret('[REDACTED]')"

    __str__ = __repr__

    def __reduce__(self) -> NoReturn:
        raise TypeError("a Secret cannot be pickled; store its reference name instead")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("Secret", self._value))


def _b64_cores(raw: bytes) -> set[str]:
    """Substrings every base64 text that carries ``raw`` contains, whatever bytes come before it.

    base64 works on 3-byte groups, so ``raw`` lands at one of three alignments; for each, the
    characters that depend only on ``raw`` (not on its neighbours) are a fixed string.
    """
    cores: set[str] = set()
    for shift in range(3):
        encoded = base64.b64encode(b"\0" * shift + raw).decode()
        start = (shift * 4 + 2) // 3  # characters touched by the padding bytes in front
        end = (len(raw) + shift) // 3 * 4  # characters touched by whatever follows
        core = encoded[start:end]
        if len(core) >= 8:
            cores.add(core)
            cores.add(core.replace("+", "-").replace("/", "_"))
    return cores


def _encodings(value: str) -> set[str]:
    raw = value.encode("utf-8")
    forms = {
        value,
        base64.b64encode(raw).decode(),
        base64.b64encode(raw).decode().rstrip("="),
        base64.urlsafe_b64encode(raw).decode(),
        base64.urlsafe_b64encode(raw).decode().rstrip("="),
        urllib.parse.quote(value, safe=""),
        urllib.parse.quote_plus(value),
        raw.hex(),
        raw.hex().upper(),
    }
    return {f for f in forms if len(f) >= 4}


class Redactor:
    """Masks secrets in text, URLs, headers and JSON values. Thread-safe."""

    def __init__(self) -> None:
        self._exact: set[str] = set()
        self._ordered: list[str] = []
        #: the exact encodings and base64 cores of the registered values: what detection looks for
        self._detect: list[str] = []
        self._lock = threading.Lock()
        #: text() of short strings already seen: states, causes, actors and ids repeat on every write
        self._texts: dict[str, str] = {}
        #: looks_like_credential() of short strings already seen (provider ids and states, on every answer)
        self._looks: dict[str, bool] = {}
        #: how value() treats a field of each name already seen (see _field_rule)
        self._fields: dict[str, tuple[str, int]] = {}
        #: the forms also masked where they appear cut short (a credential as sent, and its base64), longest
        #: first; their first and last eight characters, and a search for any of them (see _fragments)
        self._cut_forms: list[str] = []
        self._ends: tuple[str, ...] = ()
        self._ends_search: re.Pattern[str] | None = None
        #: the values registered here, and the redactors that learn each of them too (see forward_to)
        self._values: list[str] = []
        self._forward: weakref.WeakSet[Redactor] = weakref.WeakSet()

    # -- registration of injected credentials ---------------------------------

    def register(self, value: str) -> None:
        """Mask this exact value (and its common encodings) from now on, here and in every redactor
        this one forwards to."""
        if len(value) < 4:
            return
        for other in list(self._forward):
            other.register(value)
        with self._lock:
            new = _encodings(value) - self._exact
            if not new:
                return
            self._values.append(value)
            self._exact |= new
            # longest first, so a base64 form is not half-masked by a shorter one
            self._ordered = sorted(self._exact, key=len, reverse=True)
            forms = {*self._exact, *_b64_cores(value.encode("utf-8"))}
            forms |= {f.lower() for f in forms if f.isascii() and _HEXISH.fullmatch(f)}
            if value.isascii():  # its UTF-16 bytes, read as text: every character and a NUL (either byte order)
                forms.add("\0".join(value))
            self._detect = sorted({*self._detect, *forms}, key=len, reverse=True)
            # a user:password pair registered after its password (register_basic): the password is looked for
            # cut short on its own; the pair's start, the user name alone, must not be taken for a credential
            _, colon, tail = value.rpartition(":")
            if not (colon and tail in self._values[:-1]):
                raw = value.encode("utf-8")
                cut = {
                    value,
                    *(base64.b64encode(raw).decode().rstrip("="), base64.urlsafe_b64encode(raw).decode().rstrip("=")),
                }
                self._cut_forms = sorted(
                    {*self._cut_forms, *(f for f in cut if len(f) >= _FRAGMENT_FROM)}, key=len, reverse=True
                )
            ends = {end for form in self._cut_forms for end in (form[:8], form[-8:])}
            self._ends = tuple(sorted(ends))
            self._ends_search = re.compile("|".join(re.escape(end) for end in self._ends)) if ends else None
            # what was clean may carry the new credential
            self._texts, self._looks, self._fields = {}, {}, {}

    # -- detection -------------------------------------------------------------------

    def contains_secret(self, data: str | bytes) -> bool:
        """Does ``data`` carry a registered credential, in any encoding we can undo?

        Looks through JSON ``\\u`` escapes, percent-encoding (also ``+`` for space),
        HTML entities, base64 (standard and URL-safe, at any alignment, also wrapped
        in lines as MIME writes it), hex, and nestings of these; in a JSON document
        also through a value split across several strings. Never says *which*
        credential or where: callers refuse the whole input.
        """
        detect = self._detect
        if not detect:
            return False
        text = data.decode("utf-8", errors="replace") if isinstance(data, bytes | bytearray) else str(data)
        if self._found(text) or self._fragments(text) != text:
            return True
        return self._split_across_strings(text)

    def _hidden(self, text: str) -> bool:
        """The cheap check for every string we write: exact forms, then decoding only if it looks encoded."""
        if self._holds(text):
            return True
        return ("\\" in text or "%" in text or "&" in text) and self._found(text, deep=False)

    def _holds(self, text: str) -> bool:
        """Does ``text`` hold one of the exact forms, as it is or with its line breaks (CR, LF) taken out?

        MIME base64 (RFC 2045) is wrapped in lines of 76 characters, and every decoder skips the breaks:
        a break inside a credential's base64 cuts each of its exact forms (and its base64 cores) in two.
        Every break is taken out, whatever is around it and however long the lines: that costs less than
        finding the breaks between base64 characters, and a registered form found across any break is a
        leak too.
        """
        detect = self._detect
        if any(form in text for form in detect):
            return True
        joined = _unwrapped(text)
        return len(joined) != len(text) and any(form in joined for form in detect)

    def _found(self, text: str, *, deep: bool = True) -> bool:
        """Exact forms, then the same after undoing encodings (a few rounds, for nestings).

        ``deep`` also decodes base64 and hex runs (their aligned forms are matched exactly
        either way; decoding finds them nested inside another encoding).
        """
        detect = self._detect
        if not detect:
            return False
        # no decoding lengthens a text (each undoes an escape, or reads four characters as three bytes or two
        # as one): a text shorter than the shortest form holds none, nor does anything decoded from it
        shortest = len(detect[-1])
        seen: set[str] = set()
        frontier = [text]
        for _ in range(4):
            nxt: list[str] = []
            for candidate in frontier:
                if candidate in seen or len(candidate) < shortest:
                    continue
                seen.add(candidate)
                if self._holds(candidate):
                    return True
                nxt.extend(c for c in _decoded_forms(candidate, deep=deep, at_least=shortest) if c not in seen)
            if not nxt:
                return False
            frontier = nxt
        return any(self._holds(c) for c in frontier)

    def _split_across_strings(self, text: str) -> bool:
        # only worth parsing when it looks like JSON and holds more than one string
        stripped = text.lstrip()
        if stripped[:1] not in ("{", "[", '"') or text.count('"') < 4 or len(text) > _SPLIT_SCAN_MAX:
            return False
        try:
            document = json.loads(text)
        except (ValueError, RecursionError):
            return False
        return self.splits_a_credential(document)

    def answer(self, value: Any) -> Any:
        """A provider's answer (a JSON-like value) as it may be stored: masked string by string, or withheld
        whole when a credential runs across its strings in pieces too short for :meth:`value` to mask."""
        masked = self.value(value)
        return {"withheld": WITHHELD_SPLIT_CREDENTIAL} if self.splits_a_credential(value) else masked

    def splits_a_credential(self, value: Any) -> bool:
        """Does a registered credential run across several strings of ``value`` (a JSON-like value as it came,
        before masking), as ``["<first half>", "<second half>"]``? :meth:`value` masks a string at a time and
        cannot see it: a caller that stores its output asks this too.

        Asked of the masked value, it missed a split whose first piece was masked on its own (a key's format,
        or two thirds of it): the rest was kept. A whole credential in one string is masked on its own and is
        no split: for the second look it is cut out of its string (what is around it stays, a piece of a split
        beside an echoed copy among it)."""
        if not self._detect:
            return False
        pieces: list[str] = []
        values: list[str] = []
        _strings(value, pieces, values)
        if len(pieces) < 2 or not self._runs_across(pieces, values):
            return False
        forms = sorted((form for form in self._detect if len(form) >= 8), key=len, reverse=True)
        if not any(form in p for p in pieces for form in forms):
            return True

        def cut(text: str) -> str:
            for form in forms:  # (longest first: a shorter form inside a longer one is cut with it)
                text = text.replace(form, "\0")
            return text

        return self._runs_across([cut(p) for p in pieces], [cut(v) for v in values])

    def _runs_across(self, pieces: list[str], values: list[str]) -> bool:
        """Whether a registered form is in the strings run together (keys and values, or values alone)."""
        # short values would match by accident in a long concatenation; a credential may run on from a key
        # into its value, or from one value into the next (the key between them left out)
        joined = ["".join(pieces), "".join(values)]
        unwrapped = _unwrapped(joined[1])  # MIME base64 as a list of its lines, each with its line break
        if len(unwrapped) != len(joined[1]):
            joined.append(unwrapped)
        return any(form in text for text in joined for form in self._detect if len(form) >= 8)

    def registered(self) -> tuple[str, ...]:
        """The values registered so far, in order (what another process needs to mask the same)."""
        with self._lock:
            return tuple(self._values)

    def forward_to(self, other: Redactor) -> None:
        """Let ``other`` mask every value registered here, now and later: a provider's redactor forwards
        to the ledger's, so whatever the provider resolves is masked in what the ledger stores."""
        if other is self:
            return
        with self._lock:
            self._forward.add(other)
            values = list(self._values)
        for value in values:
            other.register(value)

    def register_basic(self, user: str, password: str) -> None:
        """Also mask the Basic-auth form ``base64(user:password)``."""
        self.register(password)
        self.register(f"{user}:{password}")

    # -- the passes ------------------------------------------------------------

    def text(self, value: str) -> str:
        return _remembered(self._texts, value, self._text)

    def _text(self, value: str) -> str:
        value = self._strong(value)
        # a credential we could not find as a substring but can see once decoded: the whole string goes
        if self._detect and self._hidden(value):
            return REDACTED
        if ("=" in value or ":" in value) and _kv_hint(value):
            for pattern, replacement in _KV_PATTERNS:
                value = pattern.sub(replacement, value)
        return value

    def _fragments(self, text: str) -> str:
        """``text`` with every run of a registered form cut short masked: from the form's start, or up to its
        end, two thirds of it or more (and 12 characters). The third left unseen of a random credential is
        still far too much to guess; and credentials of one format share a shorter start than that (two
        keys ``sk-proj-...`` are not taken for each other). A whole form is masked already."""
        search = self._ends_search
        if search is None:
            return text
        # one alternation is quickest through a short text; past some hundred characters, a plain search each
        if not (any(end in text for end in self._ends) if len(text) > 128 else search.search(text)):
            return text
        for form in self._cut_forms:  # (longest first)
            for run in sorted(_runs_of(form, text, max(_FRAGMENT_FROM, 2 * len(form) // 3)), key=len, reverse=True):
                text = text.replace(run, REDACTED)
        return text

    def _strong(self, value: str) -> str:
        """Exact injected values and unmistakable secret formats only."""
        for secret in self._ordered:
            if secret in value:
                value = value.replace(secret, REDACTED)
        value = self._fragments(value)
        # the patterns are costly; most stored strings (states, causes, ids, numbers) are too short
        # to hold any of them or contain no hint at all
        if len(value) < _SHORTEST_PATTERN or not _strong_hint(value) or not _pattern_found(value):
            return value
        for pattern, replacement in _PATTERNS:
            value = pattern.sub(replacement, value)
        return value

    def url(self, value: str) -> str:
        if "@" not in value and "?" not in value:
            # no userinfo and no query: nothing but the text itself can carry a credential (a relative
            # Location, most status URLs), and it is kept as it came instead of re-assembled
            return self.text(value)
        try:
            parts = urllib.parse.urlsplit(value)
        except ValueError:
            return self.text(value)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = "REDACTED:REDACTED@" + netloc.rsplit("@", 1)[1]
        query = parts.query
        if query:
            pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
            query = urllib.parse.urlencode([(k, REDACTED if _is_secret_query(k) else v) for k, v in pairs], safe="[]")
        rebuilt = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
        return self.text(rebuilt)

    def headers(self, headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> dict[str, str]:
        items = headers.items() if isinstance(headers, Mapping) else headers
        out: dict[str, str] = {}
        for raw_name, value in items:
            name = self.text(str(raw_name))
            if name != raw_name:  # a name that carries a credential: neither it nor its value is kept
                out[_unique(out, name)] = REDACTED
                continue
            lower = name.lower()
            if lower in _URL_HEADERS:
                out[name] = self.url(str(value))
            elif _header_allowed(lower):
                out[name] = self.text(str(value))
            else:
                out[name] = REDACTED
        return out

    def value(self, value: Any) -> Any:
        """Redact a JSON-like value recursively (a new value; the input is untouched)."""
        kind = type(value)
        # exact types first: every stored answer is walked, and most of its values are plain scalars
        if kind is str:
            return self._texts.get(value) or self.text(value)
        if kind is int or kind is float or kind is bool or value is None:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            out: dict[str, Any] = {}
            fields = self._fields
            for key, item in value.items():
                name = key if type(key) is str else str(key)
                rule = fields.get(name)
                if rule is None:
                    rule = self._field_rule(name)
                    if len(fields) >= _TEXT_CACHE_SIZE:
                        fields.clear()
                    fields[name] = rule
                key_s, how = rule
                if how == _KEY_CARRIES_SECRET:
                    out[_unique(out, key_s)] = REDACTED
                elif how == _SECRET_NAME and _carries_secret(item):
                    out[key_s] = REDACTED
                elif how == _CODE and _carries_secret(item):
                    # kept only as an error's code: a field of an object that also says what went wrong
                    named = type(item) is str and _named_code(item) and not _ERROR_FIELDS.isdisjoint(value)
                    out[key_s] = self.text(item) if named else REDACTED
                elif how == _HEADERS and isinstance(item, Mapping):
                    out[key_s] = self.headers(item)
                elif how == _URL and isinstance(item, str):
                    out[key_s] = self.url(item)
                elif type(item) is str:  # the common case, without a call of its own
                    out[key_s] = self._texts.get(item) or self.text(item)
                else:
                    out[key_s] = self.value(item)
            return out
        if isinstance(value, list | tuple):
            return [self.value(item) for item in value]
        return value

    def _field_rule(self, name: str) -> tuple[str, int]:
        """How :meth:`value` treats a field called ``name``: its stored name, and what its value gets."""
        key_s = self.text(name)
        if key_s != name:  # a key that carries a credential
            return key_s, _KEY_CARRIES_SECRET
        norm = _norm(key_s)
        if norm == "code":
            return key_s, _CODE
        if is_secret_name(key_s):
            return key_s, _SECRET_NAME
        if norm in ("headers", "responseheaders", "requestheaders"):
            return key_s, _HEADERS
        if norm in ("url", "statusurl", "href", "resultreference", "location"):
            return key_s, _URL
        return key_s, _PLAIN

    def looks_like_credential(self, text: str) -> bool:
        """A registered credential or a known secret format (``Bearer ...``, a JWT, a key prefix,
        userinfo in a URL), in ``text`` or in any decoding of it (base64, percent, JSON escapes)."""
        return _remembered(self._looks, text, self._looks_like_credential)

    def _looks_like_credential(self, text: str) -> bool:
        if self.contains_secret(text):
            return True
        if _pattern_found(text):
            return True
        # prose decodes to hundreds of forms (every word of eight letters is a base64 run), and almost none
        # has a hint: one search of them all, decoded together, rules them out together
        if not _strong_hint("\n".join(_decoded_forms(text, deep=True, together=True))):
            return False
        return any(len(c) >= _SHORTEST_PATTERN and _pattern_found(c) for c in _decoded_forms(text, deep=True))

    def result_value(self, value: Any) -> Any:
        """A provider's result carried inside a record: kept exactly, or withheld whole.

        Field names never mask a result (``{"key": ..., "code": ...}`` is user data); a result
        that carries a registered credential in any encoding is replaced by ``{"withheld": ...}``.
        """
        try:
            text = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError, RecursionError):
            return {"withheld": "the result is not JSON"}
        if self.contains_secret(text):
            return {"withheld": WITHHELD_CREDENTIAL}
        return value

    def secret_paths(self, value: Any, path: str = "$") -> list[str]:
        """JSON paths in ``value`` that the redactor would mask (used to refuse request bodies)."""
        found: list[str] = []
        if isinstance(value, str):
            # whatever _strong would mask (a registered value, a secret format) this finds too, and it is
            # remembered: provider ids and states are checked on every answer
            if self.looks_like_credential(value):
                found.append(path)
        elif type(value) is int:
            # a credential of digits alone, sent as a JSON number: stored as those digits all the same
            if self.contains_secret(str(value)):
                found.append(path)
        elif isinstance(value, Mapping):
            for key, item in value.items():
                sub = f"{path}.{key}"
                if self.looks_like_credential(str(key)):
                    found.append(f"{path} (a field name)")
                elif is_credential_field(str(key)) and _carries_secret(item):
                    found.append(sub)
                else:
                    found.extend(self.secret_paths(item, sub))
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                found.extend(self.secret_paths(item, f"{path}[{i}]"))
        return found


class NullRedactor(Redactor):
    """Redacts nothing. Exists so tests can prove the canary scan would catch a leak."""

    def contains_secret(self, data: str | bytes) -> bool:
        return False

    def result_value(self, value: Any) -> Any:
        return value

    def text(self, value: str) -> str:
        return value

    def url(self, value: str) -> str:
        return value

    def headers(self, headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> dict[str, str]:
        return dict(headers.items() if isinstance(headers, Mapping) else headers)

    def value(self, value: Any) -> Any:
        return value


#: what Redactor.value does with a field, by its name (see Redactor._field_rule)
_PLAIN, _KEY_CARRIES_SECRET, _SECRET_NAME, _HEADERS, _URL, _CODE = range(6)
#: the words of a ``code`` that reads as a name: lower or upper case letters (a single one of 24 at most),
#: Capitalized or camelCase words of three letters and more, five digits at most, or one short run of
#: letters and digits, such as ``E1234``
_CODE_WORD = re.compile(
    r"(?P<plain>[a-z]+|[A-Z]+)|[a-z]*(?:[A-Z][a-z]{2,})+|[0-9]{1,5}"
    r"|(?P<mixed>(?=[A-Za-z0-9]*[A-Za-z])(?=[A-Za-z0-9]*[0-9])[A-Za-z0-9]{2,6})"
)
_CODE_BREAK = re.compile(r"[_.\- ]")
#: fields beside a ``code`` that make its object an error's (OpenAI's, Google's, a problem document...)
_ERROR_FIELDS = frozenset({"message", "type", "status", "detail", "details", "reason", "param", "title", "line"})


def _named_code(value: str) -> bool:
    """Does a ``code`` field's value read as an error's name (``rate_limit_exceeded``, ``RESOURCE_EXHAUSTED``,
    ``ThrottlingException``, ``E1234``), which a person needs to read, rather than as a one-time code, a
    recovery code or a token (six digits and more, a long run of letters, words of one length in a row,
    letters and digits mixed, other characters)?"""
    if not value or len(value) > 64:
        return False
    words = _CODE_BREAK.split(value)
    if len(words) >= 3 and len({len(word) for word in words}) == 1:  # ABCD-EFGH-IJKL, "abcd efgh ijkl mnop"
        return False
    mixed = 0
    for word in words:
        found = _CODE_WORD.fullmatch(word)
        if found is None or (found.group("plain") is not None and len(word) > 24 and len(words) == 1):
            return False
        mixed += found.group("mixed") is not None
    return mixed <= 1


#: JSON documents larger than this are not parsed to look for a credential split across strings
_SPLIT_SCAN_MAX = 64 * 1024 * 1024
_HEXISH = re.compile(r"[0-9A-Fa-f]+")
_JSON_ESCAPE = re.compile(r"\\(?:u([0-9A-Fa-f]{4})|([\"\\/bfnrt]))")
_SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
#: the shortest base64 or hex run decoded (the {8,} of both; a shorter text holds none)
_SHORTEST_RUN = 8
_B64_RUN = re.compile(r"[A-Za-z0-9+/_-]{8,}={0,2}")
#: base64 wrapped in lines is read on across a line break that ends a run of at least this many characters:
#: a whole line (MIME's are 76 characters, PEM's 64), not a word of prose at a line's end
_WRAP_WIDTH = 16
#: such a break (once every break is LF, see _lf_breaks) and the run after it. A literal first: the regex engine
#: skips from LF to LF; a search that starts with a character class, or a lookbehind, is tried at every character
#: (milliseconds for 64 KiB of prose)
_WRAP_BREAK = re.compile(rf"\n(?<=[A-Za-z0-9+/_-]{{{_WRAP_WIDTH}}}\n)[A-Za-z0-9+/_-]+")
_B64_CHARS = string.ascii_letters + string.digits + "+/_-"
#: a line break written as a JSON escape; a literal first, as in _WRAP_BREAK
_ESCAPED_BREAK = re.compile(r"\\(?:r\\n|[rn])")
#: runs of eight hex digits or more, read as whole bytes (an odd run's last digit is left out); a class
#: repeated, not pairs of it, which the regex engine tried again at every digit of prose
_HEX_RUN = re.compile(r"[0-9A-Fa-f]{8,}")
#: the standard alphabet's decoder without base64.b64decode's wrapper (which only converts what a str already is)
_B64_BOTH = (binascii.a2b_base64, base64.urlsafe_b64decode)
_B64_ONE = (binascii.a2b_base64,)


def _remembered(cache: dict[str, _T], value: str, compute: Callable[[str], _T]) -> _T:
    """``compute(value)``, remembered for short strings in ``cache`` (which register() replaces)."""
    if len(value) > _TEXT_CACHED_LEN:
        return compute(value)
    out = cache.get(value)
    if out is None:
        out = compute(value)
        if len(cache) >= _TEXT_CACHE_SIZE:
            cache.clear()
        cache[value] = out
    return out


def _lf_breaks(text: str) -> str:
    """``text`` with each of its line breaks as one LF: first the JSON escapes ``\\r\\n``, ``\\n`` and ``\\r``,
    then CRLF and CR (``text`` itself if it has none of those)."""
    # (in 64 KiB a search for one character takes a microsecond, one for two some eighty: "\\n" in text is not asked)
    if "\\" in text:
        text = _ESCAPED_BREAK.sub("\n", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def _unwrapped(text: str) -> str:
    """``text`` without its CRs and LFs (``text`` itself if it has none). Line breaks written as JSON escapes stay:
    :meth:`Redactor._found` reads the text unescaped too, and the breaks are there."""
    if "\r" in text:
        text = text.replace("\r", "")
    return text.replace("\n", "") if "\n" in text else text


def _wrapped_runs(text: str) -> list[str]:
    """The base64 runs in ``text`` wrapped in lines, each without its line breaks: a run of at least
    :data:`_WRAP_WIDTH` characters that ends a line, the next line's first run, and on while the line before
    a break is all one run that long. Only the breaks are looked at, not every character."""
    text = _lf_breaks(text)
    wrapped: list[list[str]] = []
    end = -1
    for brk in _WRAP_BREAK.finditer(text):  # (each match holds the run after its break)
        at = brk.start()
        if at != end:  # a new wrapped run, from where the last run of the line before starts
            line = text[text.rfind("\n", 0, at) + 1 : at]
            wrapped.append([line[len(line.rstrip(_B64_CHARS)) :]])
        end = brk.end()
        wrapped[-1].append(text[at + 1 : end])
    return ["".join(lines) for lines in wrapped]


def _unescape_json(text: str) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(1) is not None:
            return chr(int(m.group(1), 16))
        return _SIMPLE_ESCAPES[m.group(2)]

    out = _JSON_ESCAPE.sub(one, text)
    # surrogate pairs written as two escapes
    return out.encode("utf-16", "surrogatepass").decode("utf-16", errors="replace") if out != text else out


def _decoded_forms(text: str, *, deep: bool, together: bool = False, at_least: int = 0) -> list[str]:
    """``text`` with one layer of each encoding undone (only those that change something).

    ``together``: the base64 runs of letters and digits as one text (:func:`_decoded_together`), to rule
    out hints in all of them with one search. ``at_least``: no base64 or hex run is decoded whose decoding
    would be shorter (what is looked for is no shorter)."""
    forms: list[str] = []
    if "\\" in text:
        forms.append(_unescape_json(text))
    if "%" in text:  # a credential's quote_plus form (its spaces as "+") is an exact form already
        forms.append(urllib.parse.unquote_plus(text))
        forms.append(urllib.parse.unquote(text))
    if "&" in text:
        forms.append(html.unescape(text))
    # a text shorter than a run holds none (most decodings of words: a run decodes to 3/4 of its length)
    if not deep or len(text) < _SHORTEST_RUN:
        return [f for f in forms if f != text]
    quanta: list[str] = []
    runs = dict.fromkeys(_B64_RUN.findall(text))  # prose repeats its words: each decoded once
    if "\n" in text or "\r" in text or "\\" in text:
        # base64 wrapped in lines is also decoded as one run, as any decoder reads it (each line stays a run of
        # its own: the first may start with something else)
        runs.update(dict.fromkeys(_wrapped_runs(text)))
    for run in runs:
        if len(run) * 3 // 4 < at_least:  # four characters are three bytes at most
            continue
        # letters and digits only (a word, say): both alphabets read it alike, so it is decoded once
        bare = run.rstrip("=")
        alnum = bare.isalnum()
        if together and alnum:
            quanta.append(bare)
            continue
        padded = run + "=" * (-len(run) % 4)
        for decode in _B64_ONE if alnum else _B64_BOTH:
            try:
                raw = decode(padded)
            except (binascii.Error, ValueError):
                continue
            forms.append(raw.decode("utf-8", errors="replace"))
    if quanta:
        forms.append(_decoded_together(quanta))
    # a hex run is part of a base64 run (the same characters and more): searched there, not in all the text
    for run in _HEX_RUN.findall(" ".join(runs)):
        if len(run) // 2 >= at_least:
            forms.append(bytes.fromhex(run[: len(run) // 2 * 2]).decode("utf-8", errors="replace"))
    return [f for f in forms if f != text]


def _decoded_together(runs: list[str]) -> str:
    """Base64 runs of letters and digits decoded in one call, into one text that holds each run's decoding
    (bar a character cut at its end) and what spans none: each run is filled out to whole four-character
    groups with ``A`` (zero bits) and followed by ``AAAA``, three zero bytes after which the UTF-8 decoder
    starts afresh. It may hold more (a run that alone is refused as badly padded, its last bits); it is
    only searched for hints, never taken for a form."""
    filled = "".join(f"{run}{'A' * (-len(run) % 4)}AAAA" for run in runs)
    return binascii.a2b_base64(filled).decode("utf-8", errors="replace")


def _strings(value: Any, every: list[str], values: list[str], depth: int = 0) -> None:
    """Every string in a JSON document, in document order, in one walk: into ``every`` keys too, into
    ``values`` the values only."""
    if depth > 200:
        return
    if isinstance(value, str):
        every.append(value)
        values.append(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            every.append(str(key))
            _strings(item, every, values, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _strings(item, every, values, depth + 1)


#: a registered form this long or longer is also masked where it appears cut short (see Redactor._fragments)
_FRAGMENT_FROM = 12


def _runs_of(form: str, text: str, least: int) -> set[str]:
    """The runs in ``text`` of at least ``least`` characters that begin ``form``, or end it."""
    runs: set[str] = set()
    head, tail = form[:8], form[-8:]
    at = text.find(head)
    while at >= 0:
        n = 8
        while n < len(form) and at + n < len(text) and text[at + n] == form[n]:
            n += 1
        if n >= least:
            runs.add(text[at : at + n])
        at = text.find(head, at + 1)
    end = text.find(tail)
    while end >= 0:
        start, n = end, 8
        while n < len(form) and start > 0 and text[start - 1] == form[-n - 1]:
            start, n = start - 1, n + 1
        if n >= least:
            runs.add(text[start : end + 8])
        end = text.find(tail, end + 1)
    return runs


def _unique(taken: Mapping[str, Any], name: str) -> str:
    if name not in taken:
        return name
    n = 2
    while f"{name}#{n}" in taken:
        n += 1
    return f"{name}#{n}"


def _carries_secret(item: Any) -> bool:
    # ``max_tokens: 100`` names a token but carries a number, not a credential.
    return isinstance(item, str | Mapping | list | tuple) and bool(item)


def _is_secret_query(name: str) -> bool:
    n = _norm(name)
    return n in _QUERY_SECRET or n.startswith(("xamz", "xgoog")) or is_secret_name(name)


def _header_allowed(lower: str) -> bool:
    return lower in _HEADER_ALLOW or lower.endswith(_HEADER_ALLOW_SUFFIX) or lower.startswith(_HEADER_ALLOW_PREFIX)


#: holds no secret (nothing registers with it): masks what looks like a credential by its form alone
_FORMS_ONLY = Redactor()


def looks_secret(text: str) -> bool:
    """Does ``text`` look like a credential by its form alone (a known key format, a secret-named
    query parameter)? Registered values are found by a redactor that knows them."""
    return bool(_FORMS_ONLY.secret_paths(text))


def redact_text(text: str) -> str:
    """``text`` with whatever looks like a credential by its form masked (no registered value is known)."""
    return _FORMS_ONLY.text(text)


def redact_url(url: str) -> str:
    """``url`` with userinfo and secret-named query parameters masked (for messages)."""
    return _FORMS_ONLY.url(url)


#: the redactors of the ledgers open in this process that joined the logs (install_log_redaction): log lines
#: and span texts leave the process, so each is masked with everything any open ledger knows to mask
_joined: weakref.WeakSet[Redactor] = weakref.WeakSet()


def redact_outgoing(text: str) -> str:
    """``text`` masked for a log line or a span: by every joined ledger's redactor, and by form."""
    for redactor in [*_joined, _FORMS_ONLY]:
        text = redactor.text(text)
    return text


class RedactingFilter(logging.Filter):
    """A logging filter that redacts the fully formatted message of every record
    (:func:`redact_outgoing`), looked up per record, so a credential resolved later is masked too."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            message = f"{message} ({type(record.exc_info[1]).__name__}: {record.exc_info[1]})"
            record.exc_info = None
            record.exc_text = None
        record.msg = redact_outgoing(message)
        record.args = None
        return True


_FILTERED_LOGGERS = ("jobtrail", "aiohttp.client", "aiohttp.server", "aiohttp.access", "aiohttp.web")


def install_log_redaction(redactor: Redactor | None = None) -> None:
    """Put the redacting filter on our loggers and the HTTP stack's (idempotent), and have every log
    line masked with what ``redactor`` knows too (a ledger's: it learns every credential its providers
    resolve)."""
    for name in _FILTERED_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactingFilter) for f in logger.filters):
            logger.addFilter(RedactingFilter())
    if redactor is not None:
        _joined.add(redactor)
