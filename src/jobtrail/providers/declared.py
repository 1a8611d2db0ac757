"""What a provider file declares (``kind = "http"``), read table by table.

See ``examples/provider.toml`` for every key. A mistake is a :class:`ConfigError`
naming the file, the key and what was expected, raised when the file is loaded:
paths that can never resolve, placeholders that do not exist, JSON paths that
select many values where one is meant, a result endpoint that needs a reference
the status never gives.
"""

from __future__ import annotations

import ipaddress
import json
import string
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from jobtrail.domain.backoff import Backoff
from jobtrail.domain.errors import ConfigError
from jobtrail.domain.jsonpath import parse_path
from jobtrail.domain.redact import is_secret_name, redact_url
from jobtrail.domain.results import BatchFormat, ResultSpec, is_json
from jobtrail.domain.states import RemoteState
from jobtrail.providers.config import Section
from jobtrail.providers.contract import ReconcileMode, TokenPlacement
from jobtrail.providers.credentials import Credential
from jobtrail.providers.egress import HostRule, UrlRefused, origin_of, parse_host_rule
from jobtrail.providers.file_keys import POLL_DEFAULT, RETRY_DEFAULT, DeclaredSection

DEFAULT_STATES: dict[str, list[str]] = {
    "queued": ["queued", "pending", "notstarted", "validating", "submitted"],
    "running": ["running", "in_progress", "processing", "finalizing"],
    "succeeded": ["succeeded", "completed", "done", "success"],
    "failed": ["failed", "error", "errored"],
    "cancelling": ["cancelling", "canceling"],
    "cancelled": ["cancelled", "canceled"],
    "expired": ["expired"],
}

#: what a provider-file path may name in braces (``{+name}`` keeps slashes); ``result_ref`` only in [result]
PLACEHOLDERS = ("job_id", "token", "trace_id")
_RESULT_PLACEHOLDERS = (*PLACEHOLDERS, "result_ref")
_UNSET = object()


@dataclass(frozen=True, slots=True)
class Endpoint:
    method: str
    path: str
    #: sent with this endpoint's requests only (``Prefer: wait`` on a create, say), after the file's [headers]
    headers: Mapping[str, str] = field(default_factory=dict)

    def names(self, placeholder: str) -> bool:
        return any(name in (placeholder, f"+{placeholder}") for name in _fields(self.path))


@dataclass(frozen=True, slots=True)
class StateRule:
    """``[[status.rules]]``: the job is in ``state`` when ``path`` selects a value (equal to ``equals``, if given).

    For states no single field holds: a Google operation is failed when ``done`` is true and ``error``
    is present, succeeded when ``response`` is.
    """

    path: str
    state: RemoteState
    equals: Any = _UNSET

    def holds(self, value: Any) -> bool:
        if self.equals is _UNSET:
            return value is not None and value is not False and value not in ([], {})
        return bool(value == self.equals)


@dataclass(frozen=True, slots=True)
class Paging:
    """How a reconciliation list continues: a next-page URL, or a cursor sent back as a query parameter."""

    next_url: str | None = None
    cursor: str | None = None
    cursor_param: str = "after"
    has_more: str | None = None
    max_pages: int = 10


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpProviderConfig:
    name: str
    base_url: str
    target: str
    credential: Credential | None
    timeout_s: float
    connect_timeout_s: float
    max_connections: int
    headers: dict[str, str]
    trace_header: str | None
    create: Endpoint
    token: TokenPlacement
    token_retention: timedelta | None
    job_id: str
    status_url: str | None
    sync_result: str | None
    error_code: str | None
    non_retryable: frozenset[str]
    status: Endpoint | None
    state_path: str
    progress_path: str | None
    result_ref_path: str | None
    time_path: str | None
    effects_path: str | None
    #: where a failed job's answer says why (a message, an error object or a list of them)
    failure_path: str | None
    states: dict[str, RemoteState]
    cancel: Endpoint | None
    cancel_idempotent: bool
    result: Endpoint | None
    result_kind: str
    result_spec: ResultSpec
    reconcile: tuple[ReconcileMode, ...]
    lookup_status: Endpoint | None
    lookup_list: Endpoint | None
    list_items: str
    list_reference: str
    backoff: Backoff
    poll_backoff: Backoff
    webhook_scheme: str | None
    webhooks: Any = None
    resume: bool = False
    #: hosts (besides base_url's origin) that result links may point to; fetched without the credential
    download_hosts: tuple[HostRule, ...] = ()
    #: evaluated before ``state_path``: the first that holds decides the state
    state_rules: tuple[StateRule, ...] = ()
    #: the result is this value of the finished job's status body (no result endpoint)
    result_from_status: str | None = None
    list_paging: Paging = field(default_factory=Paging)
    extra: dict[str, Any] = field(default_factory=dict)


# -- the file, table by table ---------------------------------------------------------------------


def parse_config(data: Mapping[str, Any], source: str = "<dict>") -> HttpProviderConfig:
    """Validate a provider declaration; a mistake raises ConfigError naming file and key."""
    top = DeclaredSection(data, "", source)  # every key checked against file_keys.KEYS
    base = _base(top)
    webhooks = _webhooks(top.table("webhooks"), base["credential"])
    resume = top.flag("resume", False)
    create = _create(top.table("create", required=True), base["base_url"])
    status = _status(top.table("status"), base["base_url"])
    states = _states(top.table("states"))
    cancel_s = top.table("cancel")
    cancel = _endpoint(cancel_s, "POST", base["base_url"])
    cancel_idempotent = cancel_s is not None and cancel_s.flag("idempotent", False)
    if cancel_s is not None:
        cancel_s.done()
    result = _result(top.table("result"), base["base_url"], source, status)
    reconcile = _reconcile(top.table("reconcile"), base["base_url"])
    if create["token"].where == "none" and reconcile["reconcile"]:
        top.fail(
            "reconcile.modes",
            'no reconciliation modes when create.token.in = "none" '
            "(without a token the provider cannot match a create to us)",
            [m.value for m in reconcile["reconcile"]],
        )
    backoff = _backoff(top.table("retry"), RETRY_DEFAULT)
    poll_backoff = _backoff(top.table("poll"), POLL_DEFAULT)
    top.done()
    return HttpProviderConfig(
        **base,
        **create,
        **status,
        **result,
        **reconcile,
        states=states,
        cancel=cancel,
        cancel_idempotent=cancel_idempotent,
        backoff=backoff,
        poll_backoff=poll_backoff,
        webhook_scheme="standard" if webhooks is not None else None,
        webhooks=webhooks,
        resume=resume,
    )


def _base(top: Section) -> dict[str, Any]:
    """Who the provider is, where it lives, how to authenticate, and the limits of one call."""
    base_url = top.text("base_url", "an absolute URL such as https://api.example.com")
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        top.fail("base_url", "an absolute http(s) URL", base_url)
    if parts.username or parts.password:
        top.fail(
            "base_url",
            "a URL without user:password (reference the credential by name instead)",
            redact_url(base_url),
        )
    try:
        origin_of(base_url)
    except UrlRefused as exc:
        top.fail("base_url", f"an absolute http(s) URL ({exc.reason})", base_url)
    if parts.query or parts.fragment:
        top.fail("base_url", "a URL without a query or fragment", redact_url(base_url))
    return {
        "name": top.text("name", 'the provider\'s name, e.g. "openai-batches"'),
        "base_url": base_url.rstrip("/"),
        "target": top.text("target", "free text naming what the jobs act on", parts.hostname),
        "credential": _credential(top, parts),
        "timeout_s": top.number("timeout_s", "seconds (a number > 0)", 30.0, minimum=0.001),
        "connect_timeout_s": top.number("connect_timeout_s", "seconds (a number > 0)", 10.0, minimum=0.001),
        "max_connections": int(top.number("max_connections", "a number of connections >= 1", 256, minimum=1)),
        "headers": _headers(top),
        "trace_header": top.text("trace_header", "a header name", "X-Trace-ID"),
    }


def _credential(top: Section, parts: urllib.parse.SplitResult) -> Credential | None:
    ref = top._get("credential", None)
    if ref is None:
        top._get("auth", None)
        return None
    if not (callable(ref) or (isinstance(ref, str) and ref.split(":", 1)[0] in ("env", "file", "keyring"))):
        top.fail("credential", "a reference: env:NAME, file:PATH or keyring:SERVICE/USER (never the value)", "<hidden>")
    auth = top.text("auth", "bearer, header:<Name> or basic:<user>", "bearer")
    if not (auth == "bearer" or auth.startswith(("header:", "basic:"))) or auth in ("header:", "basic:"):
        top.fail("auth", "bearer, header:<Name> or basic:<user>", auth)
    if parts.scheme == "http" and not is_loopback(parts.hostname or ""):
        top.fail(
            "base_url", "https:// (credentials are never sent over plain HTTP, except to loopback)", parts.geturl()
        )
    return Credential(ref, auth)


def _webhooks(section: Section | None, credential: Credential | None) -> Any:
    if section is None:
        return None
    from jobtrail.providers.webhooks import parse_webhooks

    # the receiver stores what the provider sends, so it must mask the provider's credential too
    webhooks = parse_webhooks(section, credential)
    # a delivery's timestamp is accepted within +-tolerance_s, so a replay can arrive up to
    # 2 x tolerance_s after the first copy: the de-duplication record must outlive that
    if webhooks.retention_s < 2 * webhooks.tolerance_s:
        section.fail(
            "retention_days",
            f"at least twice tolerance_s ({2 * webhooks.tolerance_s:g} s = "
            f"{2 * webhooks.tolerance_s / 86400:.6g} days), or a replayed event is accepted again",
            webhooks.retention_s / 86400,
        )
    return webhooks


def _create(section: Section | None, base_url: str) -> dict[str, Any]:
    assert section is not None
    create = _endpoint(section, "POST", base_url)
    token_s = section.table("token")
    if token_s is None:
        token = TokenPlacement("header", "Idempotency-Key", quoted=True)
    else:
        where = token_s.choice("in", ("header", "body", "query", "none"))
        name = "" if where == "none" else token_s.text("name", "the header, body field or query parameter name")
        if where == "body" and any(not part for part in name.split(".")):
            token_s.fail("name", 'a body field, or a dotted path into a nested object such as "metadata.ref"', name)
        token = TokenPlacement(where, name, token_s.flag("quoted", where == "header"))
        token_s.done()
    retention = section.number("token_retention_s", "seconds the provider keeps tokens", None)
    job_id = section.text("job_id", "where the job id is: a JSON path like $.id, or header:Location", "$.id")
    _check_path(section, "job_id", job_id)
    _json_path(section, "job_id", "$.id")
    fields = {
        "create": create,
        "token": token,
        "token_retention": None if retention is None else timedelta(seconds=retention),
        "job_id": job_id,
        "status_url": _json_path(
            section, "status_url", expected="header:Location, header:Operation-Location or a JSON path"
        ),
        "sync_result": _json_path(
            section, "sync_result", expected="a JSON path to a result returned with the create's answer"
        ),
        "error_code": _json_path(section, "error_code", expected="a JSON path to the provider's error code"),
        "non_retryable": frozenset(section.strings("non_retryable", "a list of error codes", [])),
    }
    # request fields an agent may fill with a URL (the MCP guard refuses URLs anywhere else)
    url_fields = section.strings("url_fields", 'JSON paths such as "$.input.image"', [])
    if any(not f.startswith("$") for f in url_fields):
        section.fail("url_fields", 'JSON paths such as "$.input.image"', url_fields)
    section.done()
    return fields | {"extra": {"url_fields": tuple(url_fields)}}


def _status(section: Section | None, base_url: str) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "status": _endpoint(section, "GET", base_url),
        "state_path": "$.status",
        "progress_path": None,
        "result_ref_path": None,
        "time_path": None,
        "effects_path": None,
        "failure_path": None,
        "state_rules": (),
    }
    if section is None:
        return fields
    fields |= {
        "state_path": _json_path(section, "state", "$.status", expected="a JSON path to the job's state"),
        "progress_path": _json_path(section, "progress", expected="a JSON path to progress (0..1 or 0..100)"),
        "result_ref_path": _json_path(section, "result_ref", expected="a JSON path to the result's URL or id"),
        "time_path": _json_path(section, "time", expected="a JSON path to the provider's timestamp of this status"),
        "effects_path": _json_path(
            section, "effects", expected="a JSON path to the partial effects the provider reports"
        ),
        "failure_path": _json_path(
            section, "error", expected="a JSON path to why a job failed (a message, an error object or a list of them)"
        ),
        "state_rules": _state_rules(section),
    }
    section.done()
    return fields


def _state_rules(section: Section) -> tuple[StateRule, ...]:
    raw = section._get("rules", [])
    expected = 'a list of tables such as { if = "$.error", state = "failed" } (optionally with equals = ...)'
    if not isinstance(raw, list):
        section.fail("rules", expected, raw)
    rules = []
    for n, item in enumerate(raw):
        rule = DeclaredSection(item, f"{section.where}.rules[{n}]", section.source)
        path = _json_path(rule, "if", expected="a JSON path whose value decides the rule")
        state = rule.choice("state", tuple(DEFAULT_STATES))
        equals = rule._get("equals", _UNSET)
        rule.done()
        rules.append(StateRule(path, RemoteState(state), equals))
    return tuple(rules)


def _states(section: Section | None) -> dict[str, RemoteState]:
    mapping = dict(DEFAULT_STATES)
    if section is not None:
        for key in list(section.data):
            if key not in DEFAULT_STATES:
                section.fail(key, "one of " + ", ".join(DEFAULT_STATES) + " (normalised states)", key)
            mapping[key] = section.strings(key, "a list of the provider's state names")
    return {raw: RemoteState(normal) for normal, raws in mapping.items() for raw in raws}


def _result(section: Section | None, base_url: str, source: str, status: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "result": None,
        "result_kind": "safe_read",
        "result_spec": ResultSpec(),
        "download_hosts": (),
        "result_from_status": None,
    }
    if section is None:
        return fields
    result = _endpoint(section, "GET", base_url, _RESULT_PLACEHOLDERS) if "path" in section.data else None
    if result is None:
        section._get("method", None)
    elif result.names("result_ref") and status["result_ref_path"] is None:
        section.fail(
            "path", "a path that can resolve: it names {result_ref}, so declare status.result_ref", result.path
        )
    from_status = _json_path(section, "from_status", expected="a JSON path into the finished job's status body")
    if from_status is not None and (result is not None or status["status"] is None):
        section.fail(
            "from_status", "either a result path or from_status, and from_status needs a [status] path", from_status
        )
    entries = section.strings(
        "download_hosts", 'a list of hosts such as "storage.example.com" or "*.s3.amazonaws.com"', []
    )
    rules = []
    for entry in entries:
        try:
            rules.append(parse_host_rule(entry))
        except ValueError as exc:
            section.fail(
                "download_hosts",
                f'hosts such as "storage.example.com", "*.s3.amazonaws.com" or "http://10.0.0.5:9000" ({exc})',
                entry,
            )
    fields |= {
        "result": result,
        "result_kind": section.choice("kind", ("safe_read", "one_time"), "safe_read"),
        "result_spec": _result_spec(section, source),
        "download_hosts": tuple(rules),
        "result_from_status": from_status,
    }
    section.done()
    return fields


def _result_spec(section: Section, source: str) -> ResultSpec:
    checksum = section.text("checksum", "header:<Name> of a response header carrying the sha256", None)
    if checksum is not None and not checksum.startswith("header:"):
        section.fail("checksum", "header:<Name> of a response header carrying the sha256", checksum)
    schema: Any = section._get("schema", None)
    if isinstance(schema, str):
        path = Path(schema) if Path(schema).is_absolute() else Path(source).parent / schema
        try:
            schema = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            section.fail("schema", f"a JSON Schema file ({exc})", schema)
    elif schema is not None and not isinstance(schema, Mapping):
        section.fail("schema", "a JSON Schema as a table, or the path of a .json file", schema)
    batch_s = section.table("batch")
    batch = None
    if batch_s is not None:
        batch_s.choice("format", ("jsonl",), "jsonl")
        batch = BatchFormat(
            id_path=_json_path(batch_s, "id", "$.custom_id", expected="a JSON path to each item's id"),
            error_path=_json_path(batch_s, "error", "$.error", expected="a JSON path that is set on failed items"),
            outcome_path=_json_path(
                batch_s, "outcome", expected='a JSON path to each item\'s outcome word, e.g. "$.result.type"'
            ),
            succeeded=tuple(batch_s.strings("succeeded", "the outcome words of a succeeded item", ["succeeded"])),
        )
        batch_s.done()
    min_records = section.number("min_records", "a count >= 0", None)
    content_type = section.text("content_type", "a media type such as application/json", None)
    records = _json_path(section, "records", expected="a JSON path to the list of records", many=True)
    if batch is None and not is_json(content_type) and (schema is not None or records):
        section.fail(
            "content_type",
            "a JSON media type where schema or records is declared (a result of any other type is stored "
            "byte for byte and checked by size, checksum and type only)",
            content_type,
        )
    return ResultSpec(
        content_type=content_type,
        max_bytes=int(section.number("max_bytes", "bytes (a number > 0)", 256 * 1024 * 1024, minimum=1)),
        checksum_header=None if checksum is None else checksum[len("header:") :],
        schema=schema,
        records_path=records,
        min_records=None if min_records is None else int(min_records),
        batch=batch,
        check=section.text("check", "a named check package.module:function", None),
    )


def _reconcile(section: Section | None, base_url: str) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "reconcile": (),
        "lookup_status": None,
        "lookup_list": None,
        "list_items": "$.data",
        "list_reference": "$.client_reference",
        "list_paging": Paging(),
    }
    if section is None:
        return fields
    names = section.strings("modes", "a list of: replay, list_by_reference, status_by_client_id", [])
    try:
        modes = tuple(ReconcileMode(n) for n in names)
    except ValueError:
        section.fail("modes", "a list of: replay, list_by_reference, status_by_client_id", names)
    fields["reconcile"] = modes
    if ReconcileMode.STATUS_BY_CLIENT_ID in modes:
        path = section.text("status_path", "a path with {token}, e.g. /v1/jobs/by-client-id/{token}")
        _check_url_path(section, "status_path", path, base_url)
        fields["lookup_status"] = Endpoint("GET", path)
    if ReconcileMode.LIST_BY_REFERENCE in modes:
        path = section.text("list_path", "a path with {token}, e.g. /v1/jobs?client_reference={token}")
        _check_url_path(section, "list_path", path, base_url)
        fields |= {
            "lookup_list": Endpoint("GET", path),
            "list_items": _json_path(section, "items", "$.data", expected="a JSON path to the list of jobs", many=True),
            "list_reference": _json_path(
                section, "reference", "$.client_reference", expected="a JSON path (inside one job) to our reference"
            ),
            "list_paging": _paging(section),
        }
    section.done()
    return fields


def _paging(section: Section) -> Paging:
    next_url = _json_path(section, "next", expected="a JSON path to the next page's URL (on the provider's origin)")
    cursor = _json_path(section, "cursor", expected="a JSON path to the cursor the next page starts after")
    if next_url is not None and cursor is not None:
        section.fail("cursor", "either next (a URL) or cursor (sent back as cursor_param), not both", cursor)
    return Paging(
        next_url=next_url,
        cursor=cursor,
        cursor_param=section.text("cursor_param", "the query parameter that carries the cursor", "after"),
        has_more=_json_path(section, "has_more", expected="a JSON path that is true while more pages follow"),
        max_pages=int(section.number("max_pages", "a number of pages >= 1", 10, minimum=1)),
    )


def _backoff(section: Section | None, default: Backoff) -> Backoff:
    if section is None:
        return default
    backoff = Backoff(
        initial_s=section.number("initial_s", "seconds", default.initial_s, minimum=0.001),
        factor=section.number("factor", "a number >= 1", default.factor, minimum=1),
        cap_s=section.number("cap_s", "seconds", default.cap_s, minimum=0.001),
        max_retry_after_s=section.number("max_retry_after_s", "seconds", default.max_retry_after_s),
        jitter=section.number("jitter", "a share between 0 and 1 (1 = full jitter)", default.jitter),
    )
    if backoff.jitter > 1:
        section.fail("jitter", "a share between 0 and 1 (1 = full jitter)", backoff.jitter)
    section.done()
    return backoff


# -- the pieces -------------------------------------------------------------------------------


def _endpoint(
    section: Section | None, default_method: str, base_url: str, placeholders: tuple[str, ...] = PLACEHOLDERS
) -> Endpoint | None:
    if section is None:
        return None
    method = section.choice("method", ("GET", "POST", "PUT", "DELETE", "PATCH"), default_method)
    path = section.text("path", "a path such as /v1/jobs/{job_id}")
    _check_url_path(section, "path", path, base_url, placeholders)
    return Endpoint(method, path, _headers(section))


def _headers(section: Section) -> dict[str, str]:
    headers = section.raw_table("headers")
    for key, value in headers.items():
        if not isinstance(value, str):
            section.fail(f"headers.{key}", "a string", value)
        if is_secret_name(key):
            section.fail(f"headers.{key}", 'no credentials in headers (use credential = "env:NAME")', "<hidden>")
    return headers


def _fields(path: str) -> list[str]:
    return [name for _, name, _, _ in string.Formatter().parse(path) if name is not None]


def _check_url_path(
    section: Section, key: str, path: str, base_url: str, placeholders: tuple[str, ...] = PLACEHOLDERS
) -> None:
    """A path below base_url (or a URL at exactly its origin) naming only known placeholders."""
    try:
        fields = [(name, conv, spec) for _, name, spec, conv in string.Formatter().parse(path) if name is not None]
    except ValueError as exc:
        section.fail(
            key, f"a path whose braces name placeholders ({exc}; write {{{{ and }}}} for literal braces)", path
        )
    for name, conv, spec in fields:
        if name.removeprefix("+") not in placeholders or conv or spec:
            section.fail(
                key,
                "a path naming only the placeholders {" + "}, {".join(placeholders) + "} "
                "(write {+job_id} to keep the slashes of an id such as projects/p/operations/o)",
                path,
            )
    if path.startswith(("http://", "https://")):
        try:
            sample = path.format(**{prefix + name: "x" for name in placeholders for prefix in ("", "+")})
            same = origin_of(sample) == origin_of(base_url)
        except UrlRefused as exc:
            section.fail(key, f"a path below base_url, or a URL at its origin ({exc.reason})", path)
        if not same:
            section.fail(
                key,
                "a path below base_url, or a URL at exactly its origin (scheme, host, port): "
                "the credential goes nowhere else",
                path,
            )
    elif not path.startswith("/"):
        section.fail(key, "a path starting with / (below base_url)", path)


def _json_path(
    section: Section, key: str, default: Any = None, *, expected: str = "a JSON path", many: bool = False
) -> Any:
    """A JSON path value, compiled now so a typo is a load-time error naming file and key.

    Where one value is meant (an id, a state), the path must be a singular query: a wildcard
    or a filter there would pick one of several values by accident.
    """
    value = section.text(key, expected, default)
    if isinstance(value, str) and not value.startswith("header:"):
        try:
            compiled = parse_path(value)
        except ConfigError as exc:
            section.fail(key, f"{expected} ({exc})", value)
        if not (many or compiled.singular):
            section.fail(
                key, f"{expected}: one value, so names and indexes only (e.g. $.data[0].id, $['a.b'], $.x[-1])", value
            )
    return value


def _check_path(section: Section, key: str, value: str) -> None:
    if not (value.startswith("$") or value.startswith("header:")):
        section.fail(key, "a JSON path like $.id, or header:Name", value)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


__all__ = [
    "DEFAULT_STATES",
    "PLACEHOLDERS",
    "Endpoint",
    "HttpProviderConfig",
    "Paging",
    "StateRule",
    "is_loopback",
    "parse_config",
]
