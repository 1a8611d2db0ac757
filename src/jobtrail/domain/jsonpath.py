"""The small path language of provider files: ``$.a.b[0]`` into JSON, ``header:Name`` into headers."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from jobtrail.domain.errors import ConfigError
from jobtrail.domain.redact import default_redactor

#: longest identifier, state, reference or time accepted from a provider
MAX_TEXT = 2048


def extract(path: str | None, body: Any, headers: Mapping[str, str]) -> str | None:
    """Read a value by ``$.a.b[0]`` (JSON) or ``header:Name``; None when absent or unusable.

    Unusable: control characters (no id, state or reference has them, and PostgreSQL text cannot
    hold NUL), U+FFFD (the answer was not UTF-8, so the value is not what the provider meant),
    more than :data:`MAX_TEXT` characters, or a credential in it (a provider that echoes the
    credential as a job id or state must not get it stored, shown or put into a URL).
    """
    text = _extract(path, body, headers)
    if text is None or unusable(text):
        return None
    return text


def unusable(text: str) -> str | None:
    """Why a provider-supplied id, state or reference cannot be used (None: it can)."""
    if len(text) > MAX_TEXT:
        return f"longer than {MAX_TEXT} characters"
    if "\ufffd" in text or any(_is_control(c) for c in text):
        return "control characters or bytes that are not UTF-8"
    if default_redactor.secret_paths(text):
        return "it carries a credential"
    return None


def why_unusable(path: str | None, body: Any, headers: Mapping[str, str]) -> str | None:
    """Why the value at ``path`` was not usable, when one is there (for a reason text; never the value)."""
    text = _extract(path, body, headers)
    return None if text is None else unusable(text)


def _is_control(char: str) -> bool:
    code = ord(char)
    return code < 32 or 127 <= code < 160


def _extract(path: str | None, body: Any, headers: Mapping[str, str]) -> str | None:
    if not path:
        return None
    if path.startswith("header:"):
        name = path[len("header:") :].lower()
        for key, value in headers.items():
            if key.lower() == name:
                return value
        return None
    found = extract_any(path, body)
    if found is None or isinstance(found, dict | list):
        return None
    if isinstance(found, bool):
        return str(found).lower()
    return str(found)


def extract_any(path: str | None, body: Any) -> Any:
    """Like :func:`extract`, but returns lists and objects too (JSON paths only)."""
    if not path:
        return None
    value: Any = body
    for part in _path_parts(path):
        if isinstance(part, int):
            value = value[part] if isinstance(value, list) and part < len(value) else None
        else:
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            return None
    return value


# one step: .name (anything but '.', '[', ']', quotes, '*', '$' or whitespace) or [index]
_STEP = re.compile(r"\.([^.\[\]\s'\"*$]+)|\[([0-9]{1,9})\]")


def parse_path(path: str) -> list[str | int]:
    """The steps of ``$.a.b[0]``; ConfigError for anything else (filters, wildcards, ``..``, typos)."""
    if not path.startswith("$"):
        raise ConfigError(f"JSON path {path!r} must start with '$' (for example $.id or $.data[0].id)")
    parts: list[str | int] = []
    at = 1
    while at < len(path):
        step = _STEP.match(path, at)
        if step is None:
            raise ConfigError(
                f"JSON path {path!r} cannot be read at character {at + 1} ({path[at : at + 10]!r}): "
                "use $.name steps and [index] steps only, e.g. $.data[0].id"
            )
        parts.append(step.group(1) if step.group(1) is not None else int(step.group(2)))
        at = step.end()
    return parts


def _path_parts(path: str) -> list[str | int]:
    return parse_path(path)
