"""The small path language of provider files: ``$.a.b[0]`` into JSON, ``header:Name`` into headers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jobtrail._errors import ConfigError

#: longest identifier, state, reference or time accepted from a provider
MAX_TEXT = 2048


def extract(path: str | None, body: Any, headers: Mapping[str, str]) -> str | None:
    """Read a value by ``$.a.b[0]`` (JSON) or ``header:Name``; None when absent or unusable.

    Unusable: control characters (no id, state or reference has them, and PostgreSQL text cannot
    hold NUL), U+FFFD (the answer was not UTF-8, so the value is not what the provider meant) or
    more than :data:`MAX_TEXT` characters.
    """
    text = _extract(path, body, headers)
    if text is None or len(text) > MAX_TEXT or "\ufffd" in text or any(_is_control(c) for c in text):
        return None
    return text


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


def _path_parts(path: str) -> list[str | int]:
    if not path.startswith("$"):
        raise ConfigError(f"JSON path {path!r} must start with '$' (for example $.id or $.data[0].id)")
    parts: list[str | int] = []
    for chunk in path[1:].replace("[", ".[").split("."):
        if not chunk:
            continue
        if chunk.startswith("[") and chunk.endswith("]") and chunk[1:-1].isdigit():
            parts.append(int(chunk[1:-1]))
        else:
            parts.append(chunk)
    return parts
