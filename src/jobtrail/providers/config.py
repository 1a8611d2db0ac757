"""Reading a provider file: every mistake is named by file, key and what was expected."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

from jobtrail.domain.errors import ConfigError

_MISSING = object()


class Section:
    """One table of a provider file. Reading a key marks it known; leftovers are typos."""

    def __init__(self, data: Mapping[str, Any], where: str, source: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: {where or 'the file'} must be a table, got {type(data).__name__}")
        self.data = data
        self.where = where
        self.source = source
        self._seen: set[str] = set()

    def fail(self, key: str, expected: str, got: Any = _MISSING) -> NoReturn:
        place = f"{self.where}.{key}" if self.where else key
        if got is _MISSING:
            raise ConfigError(f"{self.source}: {place} is missing; expected {expected}")
        raise ConfigError(f"{self.source}: {place}: expected {expected}, got {got!r}")

    def _get(self, key: str, default: Any) -> Any:
        self._seen.add(key)
        if key in self.data:
            return self.data[key]
        return default

    def text(self, key: str, expected: str, default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is _MISSING:
            self.fail(key, expected)
        if value is not None and not (isinstance(value, str) and value):
            self.fail(key, expected, value)
        return value

    def number(self, key: str, expected: str, default: Any = _MISSING, *, minimum: float = 0) -> Any:
        value = self._get(key, default)
        if value is _MISSING:
            self.fail(key, expected)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
            self.fail(key, expected, value)
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            self.fail(key, "true or false", value)
        return value

    def choice(self, key: str, options: tuple[str, ...], default: Any = _MISSING) -> Any:
        value = self._get(key, default)
        if value is _MISSING:
            self.fail(key, "one of " + ", ".join(options))
        if value not in options:
            self.fail(key, "one of " + ", ".join(options), value)
        return value

    def strings(self, key: str, expected: str, default: Any = _MISSING) -> list[str]:
        value = self._get(key, default)
        if value is _MISSING:
            self.fail(key, expected)
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            self.fail(key, expected, value)
        return list(value)

    def table(self, key: str, *, required: bool = False) -> Section | None:
        value = self._get(key, None)
        if value is None:
            if required:
                self.fail(key, "a table")
            return None
        if not isinstance(value, Mapping):
            self.fail(key, "a table", value)
        return Section(value, f"{self.where}.{key}" if self.where else key, self.source)

    def raw_table(self, key: str) -> dict[str, Any]:
        value = self._get(key, {})
        if not isinstance(value, Mapping):
            self.fail(key, "a table", value)
        return dict(value)

    def done(self) -> None:
        unknown = sorted(set(self.data) - self._seen)
        if unknown:
            place = f"[{self.where}]" if self.where else "the top level"
            raise ConfigError(
                f"{self.source}: unknown key {unknown[0]!r} in {place}; "
                f"known keys there: {', '.join(sorted(self._seen))}"
            )
