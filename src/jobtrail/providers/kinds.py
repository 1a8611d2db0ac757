"""Provider files name their adapter with ``kind``; built-in adapters keep the contract, the operator the rest.

``kind = "http"`` (the default) is the declarative adapter: the file declares the
whole contract. Every other kind is a built-in adapter for one real API whose
wire contract (endpoints, idempotency, states, result files) is fixed in code,
so the operator's file holds only what the operator decides: the credential
reference, the base URL, time-outs, limits, polling. A key the adapter fixes is
refused by name rather than silently ignored or, worse, obeyed.
"""

from __future__ import annotations

import importlib
import os
import tomllib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from jobtrail.domain.errors import ConfigError

if TYPE_CHECKING:
    from jobtrail.providers.http import HttpProvider


class _Builds(Protocol):
    def __call__(self, kind: str, data: Mapping[str, Any], source: str) -> HttpProvider: ...


#: kind -> (module holding ``build(kind, data, source)``, what it speaks to)
KINDS: dict[str, tuple[str, str]] = {
    "http": ("jobtrail.providers.http", "any HTTP job API, declared key by key in the file"),
    "openai-batch": ("jobtrail.providers.adapters.openai_batch", "OpenAI Batch API (/v1/batches)"),
    "openai-file": ("jobtrail.providers.adapters.openai_batch", "OpenAI Files upload (/v1/files), a batch's input"),
    "anthropic-batch": ("jobtrail.providers.adapters.anthropic_batch", "Anthropic Message Batches"),
    "aws-stepfunctions": ("jobtrail.providers.adapters.aws", "AWS Step Functions StartExecution"),
    "aws-athena": ("jobtrail.providers.adapters.aws", "AWS Athena StartQueryExecution"),
    "google-lro": ("jobtrail.providers.adapters.google_lro", "Google long-running operations (operations.get)"),
    "replicate": ("jobtrail.providers.adapters.replicate", "Replicate predictions"),
}

#: what an operator's file may set for every built-in adapter (besides ``kind``)
OPERATOR_KEYS = frozenset(
    {
        "name",
        "base_url",
        "target",
        "credential",
        "timeout_s",
        "connect_timeout_s",
        "max_connections",
        "trace_header",
        "retry",
        "poll",
        "webhooks",
    }
)


def register(kind: str, module: str, what: str) -> None:
    """Make ``kind = "<kind>"`` build its provider with ``module.build`` (for adapters outside jobtrail)."""
    KINDS[kind] = (module, what)


def read_provider_file(source: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """A provider file's table and the name errors should give it."""
    if isinstance(source, Mapping):
        return dict(source), "<dict>"
    path = Path(source)
    try:
        return tomllib.loads(path.read_text(encoding="utf-8")), str(path)
    except OSError as exc:
        # a provider's name where its file is meant ("--provider fake") is the likeliest slip
        hint = "" if path.suffix else " (a provider is given by its file, such as examples/fake.toml, not its name)"
        raise ConfigError(f"cannot read provider file {path}: {exc.strerror}{hint}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML ({exc})") from None


def load_provider(source: str | os.PathLike[str] | Mapping[str, Any]) -> HttpProvider:
    """Build the provider a file (or dict) declares: ``kind`` picks the adapter (default ``http``)."""
    data, where = read_provider_file(source)
    kind = data.pop("kind", "http")
    if kind not in KINDS:
        raise ConfigError(f"{where}: kind: expected one of {', '.join(sorted(KINDS))}, got {kind!r}")
    module, _ = KINDS[kind]
    build: _Builds = importlib.import_module(module).build
    return build(kind, data, where)


def operator_settings(kind: str, data: Mapping[str, Any], source: str, *, also: Collection[str] = ()) -> dict[str, Any]:
    """The operator's keys of a built-in adapter's file; a key the adapter fixes is an error naming it."""
    allowed = OPERATOR_KEYS | set(also)
    fixed = sorted(key for key in data if key not in allowed)
    if fixed:
        raise ConfigError(
            f"{source}: {fixed[0]!r} is fixed by kind = {kind!r} (the adapter speaks the provider's documented "
            f"contract); remove it. This kind's file may set: {', '.join(sorted(allowed))}"
        )
    return dict(data)


__all__ = ["KINDS", "OPERATOR_KEYS", "load_provider", "operator_settings", "read_provider_file", "register"]
