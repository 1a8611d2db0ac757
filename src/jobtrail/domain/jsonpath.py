"""The path language of provider files: RFC 9535 JSONPath into JSON (``$.a.b[0]``), ``header:Name`` into headers."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jsonpath_rfc9535 as rfc9535
from jsonpath_rfc9535.selectors import IndexSelector, NameSelector

from jobtrail.domain.errors import ConfigError
from jobtrail.domain.record import unseen_character
from jobtrail.domain.redact import Redactor, looks_secret

#: longest identifier, state, reference or time accepted from a provider
MAX_TEXT = 2048
#: C0 controls, DEL and C1 controls
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def extract(path: str | None, body: Any, headers: Mapping[str, str], redactor: Redactor | None) -> str | None:
    """Read a value by ``$.a.b[0]`` (JSON) or ``header:Name``; None when absent or unusable.

    Unusable: control characters (no id, state or reference has them, and PostgreSQL text cannot
    hold NUL), U+FFFD (the answer was not UTF-8, so the value is not what the provider meant),
    more than :data:`MAX_TEXT` characters, or a credential in it (a provider that echoes the
    credential as a job id or state must not get it stored, shown or put into a URL): by its form,
    and, given the provider's ``redactor``, the values it resolved. Every caller passes one, or None
    where no credential can be known (the checks of a stored result, say): a value read with a forgotten
    redactor was a credential sent to another host and stored in clear.
    """
    text = _extract(path, body, headers)
    if text is None or unusable(text, redactor):
        return None
    return text


def unusable(text: str, redactor: Redactor | None) -> str | None:
    """Why a provider-supplied id, state or reference cannot be used (None: it can); ``redactor`` knows
    the provider's own credential values."""
    if len(text) > MAX_TEXT:
        return f"longer than {MAX_TEXT} characters"
    if "\ufffd" in text or _CONTROL.search(text):
        return "control characters or bytes that are not UTF-8"
    unseen = unseen_character(text)
    if unseen is not None:  # as a key may not: an override or a zero-width space would show it as other text
        return f"{unseen}, which shows as nothing or turns the text around"
    # a redactor checks every form looks_secret checks, and the values it knows besides
    if redactor.secret_paths(text) if redactor is not None else looks_secret(text):
        return "it carries a credential"
    return None


def why_unusable(path: str | None, body: Any, headers: Mapping[str, str], redactor: Redactor | None) -> str | None:
    """Why the job id at ``path`` was not usable, when one is there (for a reason text; never the value)."""
    found = _found(path, body, headers)
    if isinstance(found, float | bool):
        return _NOT_AN_ID
    text = _text(found)
    return None if text is None else unusable_id(text, redactor)


def value_at(path: str | None, body: Any, headers: Mapping[str, str]) -> Any:
    """The value at ``path`` as it is (any JSON value; a header's text), or None: for words shown to a person
    after :func:`~jobtrail.domain.words.their_words` has made them plain, never for an id or a state."""
    return _found(path, body, headers)


def _extract(path: str | None, body: Any, headers: Mapping[str, str]) -> str | None:
    return _text(_found(path, body, headers))


def _text(found: Any) -> str | None:
    """A found value as text: a string as it is, a number or boolean as JSON writes it, else None."""
    if found is None or isinstance(found, dict | list):
        return None
    if isinstance(found, bool):
        return str(found).lower()
    return str(found)


def _found(path: str | None, body: Any, headers: Mapping[str, str]) -> Any:
    if not path:
        return None
    if path.startswith("header:"):
        name = path[len("header:") :].lower()
        for key, value in headers.items():
            if key.lower() == name:
                return value
        return None
    return extract_any(path, body)


def reference(path: str | None, body: Any, headers: Mapping[str, str], redactor: Redactor | None) -> str | None:
    """A result reference (a URL or an id) at ``path``: a string, as :func:`extract` reads it; None when
    absent, empty or only white space (``""`` would resolve to the provider's base URL itself), not a
    string (``5`` would be fetched as ``/5``), or unusable."""
    found = _found(path, body, headers)
    if not isinstance(found, str) or not found.strip() or unusable(found, redactor):
        return None
    return found


def unusable_id(text: str, redactor: Redactor | None) -> str | None:
    """Why a provider's job id cannot be used: as :func:`unusable`, or a ``.`` or ``..`` segment, which
    would move the requests it is put into to another path (URL normalisation removes dot segments)."""
    if any(segment in (".", "..") for segment in text.split("/")):
        return "a . or .. path segment"
    if not text.strip():
        return "empty, or only white space"
    return unusable(text, redactor)


#: a job id must be a string or an integer: ``1e20``, ``1.50`` or ``-0.0`` read back as ``1e+20``, ``1.5``
#: or ``-0.0``, not as the provider spelled them, and ``true`` names no job
_NOT_AN_ID = "a number with a fraction or an exponent, or true or false: parsing loses how the provider spelled it"


def job_id(path: str | None, body: Any, headers: Mapping[str, str], redactor: Redactor | None) -> str | None:
    """The job id at ``path`` (see :func:`extract`), None when absent or unusable (:func:`unusable_id`), or
    when it is a number with a fraction or an exponent, or a boolean (see :data:`_NOT_AN_ID`)."""
    found = _found(path, body, headers)
    if isinstance(found, float | bool):
        return None
    text = _text(found)
    return None if text is None or unusable_id(text, redactor) else text


def extract_any(path: str | None, body: Any) -> Any:
    """Like :func:`extract`, but returns lists and objects too (JSON paths only).

    A singular query (names and indexes: ``$.a['b.c'][-1]``) gives its one value or None; any
    other query (``$.data[*].id``, ``$..id``, filters) gives the list of every value it selects.
    """
    if not path:
        return None
    compiled = parse_path(path)
    if compiled.steps is None:
        return [node.value for node in compiled.query.finditer(body)]
    value: Any = body
    for step in compiled.steps:
        if isinstance(step, int):
            value = value[step] if isinstance(value, list) and -len(value) <= step < len(value) else None
        else:
            value = value.get(step) if isinstance(value, dict) else None
        if value is None:
            return None
    return value


@dataclass(frozen=True, slots=True)
class JsonPath:
    """An RFC 9535 JSONPath query, compiled once."""

    text: str
    query: rfc9535.JSONPathQuery
    #: the walk of a singular query (each a member name or an array index); None: it selects many values
    steps: tuple[str | int, ...] | None

    @property
    def singular(self) -> bool:
        return self.steps is not None


@functools.lru_cache(maxsize=4096)
def parse_path(path: str) -> JsonPath:
    """Compile an RFC 9535 JSONPath; ConfigError for anything it cannot evaluate (caught at load time)."""
    if not path.startswith("$"):
        raise ConfigError(f"JSON path {path!r} must start with '$' (for example $.id or $.data[0].id)")
    try:
        query = rfc9535.compile(path)
    except rfc9535.JSONPathError as exc:
        raise ConfigError(
            f"JSON path {path!r} is not RFC 9535 JSONPath ({exc}); for example $.id, $.data[0].id, "
            "$['a.b'], $.data[-1] or $.data[*].id"
        ) from None
    steps: tuple[str | int, ...] | None = None
    if query.singular_query():
        steps = tuple(
            selector.name if isinstance(selector, NameSelector) else selector.index
            for segment in query.segments
            for selector in segment.selectors
            if isinstance(selector, NameSelector | IndexSelector)
        )
    return JsonPath(path, query, steps)
