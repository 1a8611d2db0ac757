"""The README's reference tables, generated from the code that they describe.

``python -m jobtrail.interfaces.reference --write [README.md]`` rewrites every block between
``<!-- BEGIN name -->`` and ``<!-- END name -->``; ``--check`` exits 1 if one differs. The blocks:
the provider file's keys (:data:`jobtrail.providers.file_keys.KEYS`), the fake provider's options
(:data:`jobtrail.testing._fake_provider.FAKE_OPTIONS`), the exit codes
(:data:`jobtrail.interfaces.cli.common.EXIT_CODES`) and the JSON answers
(:mod:`jobtrail.interfaces.shapes`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

COMMAND = "python -m jobtrail.interfaces.reference --write"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _table(headers: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    head = list(headers)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _value(default: str) -> str:
    """A default that is a value is code; one that is prose (``required``, ``see [poll]``) is not."""
    prose = default == "-" or default.startswith("required") or (" " in default and "=" not in default)
    return default if prose else f"`{default}`"


def provider_keys() -> str:
    from jobtrail.providers.file_keys import KEYS

    rows = (
        (
            f"[{k.table}]" if k.table else "(top)",
            f"`{k.name}`",
            k.type,
            _value(k.default),
            k.meaning,
        )
        for k in KEYS
    )
    return _table(("table", "key", "type", "default", "meaning"), rows)


def fake_options() -> str:
    from jobtrail.testing._fake_provider import FAKE_OPTIONS

    rows = ((f"`{name}`", values, f"`{default}`", meaning) for name, values, default, meaning in FAKE_OPTIONS)
    return _table(("option", "values", "default", "what it scripts"), rows)


def exit_codes() -> str:
    from jobtrail.interfaces.cli.common import EXIT_CODES

    return _table(("exit", "meaning"), ((str(code), meaning) for code, meaning in EXIT_CODES))


def json_shapes() -> str:
    from jobtrail.interfaces import shapes

    where: dict[type, list[str]] = {}
    for command, shape in shapes.COMMAND_SHAPES.items():
        where.setdefault(shape, []).append(f"`{command}`")
    for tool, shape in shapes.TOOL_SHAPES.items():
        where.setdefault(shape, []).append(f"MCP `{tool}`")
    base = set(shapes.OperationJson.__annotations__)

    def key(name: str, annotation: object) -> str:
        inner = re.findall(r"\b([A-Z]\w*Json)\b", str(annotation))  # a nested shape is named
        return f"`{name}`" + (f" ({inner[0]})" if inner else "")

    rows = []
    for shape, uses in where.items():
        keys = dict(shape.__annotations__)
        if shape is not shapes.OperationJson and base <= set(keys):
            described = "the operation's keys + " + ", ".join(key(k, a) for k, a in keys.items() if k not in base)
        else:
            described = ", ".join(key(k, a) for k, a in keys.items())
        rows.append((f"`{shape.__name__}`", ", ".join(uses), described))
    return _table(("shape", "answered by", "keys"), rows)


BLOCKS: dict[str, Callable[[], str]] = {
    "provider-keys": provider_keys,
    "fake-options": fake_options,
    "exit-codes": exit_codes,
    "json-shapes": json_shapes,
}


def _filler(generated: str) -> Callable[[re.Match[str]], str]:
    return lambda m: m.group(1) + generated + "\n" + m.group(2)


def regenerate(text: str) -> str:
    """``text`` with every known block replaced by what the code generates now."""
    for name, render in BLOCKS.items():
        pattern = re.compile(rf"(<!-- BEGIN {name} [^\n]*-->\n).*?(<!-- END {name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"no block {name!r} (<!-- BEGIN {name} ... --> ... <!-- END {name} -->) to fill")
        text = pattern.sub(_filler(render()), text)
    return text


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    write = "--write" in args
    paths = [a for a in args if not a.startswith("--")]
    readme = Path(paths[0] if paths else "README.md")
    before = readme.read_text(encoding="utf-8")
    after = regenerate(before)
    if after == before:
        return 0
    if write:
        readme.write_text(after, encoding="utf-8")
        print(f"{readme}: reference tables regenerated")
        return 0
    print(f"{readme}: the reference tables differ from the code; run `{COMMAND}`", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
