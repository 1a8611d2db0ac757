"""Records made without their dataclass ``__init__``, where the ledger makes thousands a second.

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``
(it must get past the class's own refusal), which looks the field's slot up by
name on every call: for the operation record's 31 fields, 7 µs a record, and a
life cycle makes some fifteen of them (each write's new record in the writer
process, its copy back on the worker, claims, the pipe between the two). A
builder sets each slot through the slot's own descriptor instead, found once:
the same record in under half the time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


def builder(
    cls: type, values: Mapping[str, str], params: str, names: Mapping[str, Any] | None = None
) -> Callable[..., Any]:
    """A function ``build(<params>)`` returning a new ``cls`` whose each field is the Python expression
    ``values[field]`` (over the parameters and ``names``), every field named.

    ``cls`` is a dataclass with slots. Nothing runs but the assignments: not its ``__post_init__``,
    so a builder makes what was checked once already (a record copied, or sent down a pipe), or
    records without one (:class:`~jobtrail.domain.record.Operation`).
    """
    if not (dataclasses.is_dataclass(cls) and hasattr(cls, "__slots__")):
        raise TypeError(f"{cls.__name__} is not a dataclass with slots")
    fields = [f.name for f in dataclasses.fields(cls)]
    if set(values) != set(fields):
        raise TypeError(f"a builder of {cls.__name__} names every field once: {sorted(set(fields) ^ set(values))}")
    namespace: dict[str, Any] = {**(names or {}), "_new": object.__new__, "_cls": cls}
    lines = []
    for i, name in enumerate(fields):
        namespace[f"_set{i}"] = _slot(cls, name).__set__
        lines.append(f"    _set{i}(_o, {values[name]})")
    source = f"def build({params}):\n    _o = _new(_cls)\n" + "\n".join(lines) + "\n    return _o\n"
    exec(source, namespace)  # noqa: S102 - made above from the dataclass's own field names and our expressions
    build: Callable[..., Any] = namespace["build"]
    return build


def _slot(cls: type, name: str) -> Any:
    """The descriptor of the slot that holds ``name`` (a subclass's fields' slots are its bases')."""
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        if name in ((slots,) if isinstance(slots, str) else slots):
            return klass.__dict__[name]
    raise TypeError(f"{cls.__name__}.{name} has no slot")
