"""The JSON shapes of jobtrail.interfaces.shapes as strict JSON Schemas: what the CLI's ``--json`` and the
MCP tools are checked against (one declaration, every interface)."""

from __future__ import annotations

import functools
from typing import Any

import jsonschema
from pydantic import TypeAdapter


def _closed(node: Any) -> None:
    """No key beyond the declared ones, at every level (the TypedDicts declare every key)."""
    if isinstance(node, dict):
        if "properties" in node:
            node["additionalProperties"] = False
        for value in node.values():
            _closed(value)
    elif isinstance(node, list):
        for value in node:
            _closed(value)


@functools.cache
def schema_of(shape: type) -> dict[str, Any]:
    schema = TypeAdapter(shape).json_schema()
    _closed(schema)
    return schema


def check(doc: Any, shape: type) -> Any:
    """``doc`` has exactly the keys and types of ``shape``; returns ``doc`` for chaining."""
    jsonschema.validate(doc, schema_of(shape))
    return doc
