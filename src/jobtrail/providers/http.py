"""A provider for most HTTP job APIs, declared in a TOML file (or a dict).

See ``examples/provider.toml`` for every key. Credentials are referenced by
name (``env:NAME``, ``file:PATH``, ``keyring:SERVICE/USER`` or a callable) and
resolved only when a request is sent; the value lives in a :class:`Secret`,
is registered with the redactor, and never reaches the record.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import string
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import yarl

from jobtrail.domain.backoff import Backoff, parse_retry_after
from jobtrail.domain.canonical import parse_json
from jobtrail.domain.errors import ConfigError
from jobtrail.domain.ids import traceparent
from jobtrail.domain.jsonpath import extract, extract_any, job_id, parse_path, why_unusable
from jobtrail.domain.record import Operation
from jobtrail.domain.redact import default_redactor, is_secret_name
from jobtrail.domain.results import BatchFormat, ResultSpec, is_json
from jobtrail.domain.states import RemoteState
from jobtrail.providers.config import Section
from jobtrail.providers.contract import (
    Capabilities,
    CreateOutcome,
    LookupOutcome,
    ReconcileMode,
    Response,
    StatusOutcome,
    TokenPlacement,
)
from jobtrail.providers.credentials import Credential
from jobtrail.providers.egress import (
    AddressRefused,
    EgressPolicy,
    HostRule,
    PublicOnlyResolver,
    UrlRefused,
    origin_of,
    parse_host_rule,
    refusal_body,
)

_AMBIGUOUS = frozenset({408, 409, 425, 429})
_MAX_BODY = 16 * 1024 * 1024
_USER_AGENT = "jobtrail/0.1"
#: how long a resolved credential is used before it is read again (sooner when the provider refuses it)
CREDENTIAL_TTL_S = 60.0

DEFAULT_STATES: dict[str, list[str]] = {
    "queued": ["queued", "pending", "notstarted", "validating", "submitted"],
    "running": ["running", "in_progress", "processing", "finalizing"],
    "succeeded": ["succeeded", "completed", "done", "success"],
    "failed": ["failed", "error", "errored"],
    "cancelling": ["cancelling", "canceling"],
    "cancelled": ["cancelled", "canceled"],
    "expired": ["expired"],
}


# -- the declared endpoints -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Endpoint:
    method: str
    path: str
    #: sent with this endpoint's requests only (``Prefer: wait`` on a create, say), after the file's [headers]
    headers: Mapping[str, str] = field(default_factory=dict)


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
    extra: dict[str, Any] = field(default_factory=dict)


#: what a provider-file path may name in braces
PLACEHOLDERS = ("job_id", "token", "trace_id")


def _endpoint(section: Section | None, default_method: str, base_url: str) -> Endpoint | None:
    if section is None:
        return None
    method = section.choice("method", ("GET", "POST", "PUT", "DELETE", "PATCH"), default_method)
    path = section.text("path", "a path such as /v1/jobs/{job_id}")
    _check_url_path(section, "path", path, base_url)
    return Endpoint(method, path, _headers(section))


def _headers(section: Section) -> dict[str, str]:
    headers = section.raw_table("headers")
    for key, value in headers.items():
        if not isinstance(value, str):
            section.fail(f"headers.{key}", "a string", value)
        if is_secret_name(key):
            section.fail(f"headers.{key}", 'no credentials in headers (use credential = "env:NAME")', "<hidden>")
    return headers


def _check_url_path(section: Section, key: str, path: str, base_url: str) -> None:
    """A path below base_url (or a URL at exactly its origin) naming only known placeholders."""
    try:
        fields = [(name, conv, spec) for _, name, spec, conv in string.Formatter().parse(path) if name is not None]
    except ValueError as exc:
        section.fail(
            key, f"a path whose braces name placeholders ({exc}; write {{{{ and }}}} for literal braces)", path
        )
    for name, conv, spec in fields:
        if name.removeprefix("+") not in PLACEHOLDERS or conv or spec:
            section.fail(
                key,
                "a path naming only the placeholders {" + "}, {".join(PLACEHOLDERS) + "} "
                "(write {+job_id} to keep the slashes of an id such as projects/p/operations/o)",
                path,
            )
    if path.startswith(("http://", "https://")):
        try:
            same = origin_of(path.format(**_sample_values())) == origin_of(base_url)
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


def _sample_values() -> dict[str, str]:
    return {prefix + name: "x" for name in PLACEHOLDERS for prefix in ("", "+")}


def _path_value(value: str, *, keep_slashes: bool) -> str:
    """A value for a path placeholder, percent-encoded; ``{+name}`` keeps its slashes (RFC 6570 reserved
    expansion). Job ids with dot segments never get here (see :func:`~jobtrail.domain.jsonpath.unusable_id`)."""
    return urllib.parse.quote(value, safe="/" if keep_slashes else "")


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


def parse_config(data: Mapping[str, Any], source: str = "<dict>") -> HttpProviderConfig:
    """Validate a provider declaration; a mistake raises ConfigError naming file and key."""
    top = Section(data, "", source)
    name = top.text("name", 'the provider\'s name, e.g. "openai-batches"')
    base_url = top.text("base_url", "an absolute URL such as https://api.example.com")
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        top.fail("base_url", "an absolute http(s) URL", base_url)
    if parts.username or parts.password:
        top.fail(
            "base_url",
            "a URL without user:password (reference the credential by name instead)",
            default_redactor.url(base_url),
        )
    try:
        origin_of(base_url)
    except UrlRefused as exc:
        top.fail("base_url", f"an absolute http(s) URL ({exc.reason})", base_url)
    if parts.query or parts.fragment:
        top.fail("base_url", "a URL without a query or fragment", default_redactor.url(base_url))
    target = top.text("target", "free text naming what the jobs act on", parts.hostname)
    credential = None
    cred_ref = top._get("credential", None)
    if cred_ref is not None:
        if not (
            callable(cred_ref)
            or (isinstance(cred_ref, str) and cred_ref.split(":", 1)[0] in ("env", "file", "keyring"))
        ):
            top.fail(
                "credential",
                "a reference: env:NAME, file:PATH or keyring:SERVICE/USER (never the value)",
                "<hidden>",
            )
        auth = top.text("auth", "bearer, header:<Name> or basic:<user>", "bearer")
        if not (auth == "bearer" or auth.startswith(("header:", "basic:"))) or auth in ("header:", "basic:"):
            top.fail("auth", "bearer, header:<Name> or basic:<user>", auth)
        if parts.scheme == "http" and not _is_loopback(parts.hostname or ""):
            top.fail(
                "base_url",
                "https:// (credentials are never sent over plain HTTP, except to loopback)",
                base_url,
            )
        credential = Credential(cred_ref, auth)
    else:
        top._get("auth", None)
    timeout_s = top.number("timeout_s", "seconds (a number > 0)", 30.0, minimum=0.001)
    max_connections = top.number("max_connections", "a number of connections >= 1", 256, minimum=1)
    connect_timeout_s = top.number("connect_timeout_s", "seconds (a number > 0)", 10.0, minimum=0.001)
    headers = _headers(top)
    trace_header = top.text("trace_header", "a header name", "X-Trace-ID")
    webhooks_s = top.table("webhooks")
    webhooks = None
    if webhooks_s is not None:
        from jobtrail.providers.webhooks import parse_webhooks

        webhooks = parse_webhooks(webhooks_s)
        # a delivery's timestamp is accepted within +-tolerance_s, so a replay can arrive up to
        # 2 x tolerance_s after the first copy: the de-duplication record must outlive that
        if webhooks.retention_s < 2 * webhooks.tolerance_s:
            webhooks_s.fail(
                "retention_days",
                f"at least twice tolerance_s ({2 * webhooks.tolerance_s:g} s = "
                f"{2 * webhooks.tolerance_s / 86400:.6g} days), or a replayed event is accepted again",
                webhooks.retention_s / 86400,
            )
    target_kind = "standard" if webhooks is not None else None
    resume = top.flag("resume", False)

    create_s = top.table("create", required=True)
    assert create_s is not None
    create = _endpoint(create_s, "POST", base_url)
    assert create is not None
    token_s = create_s.table("token")
    if token_s is None:
        token = TokenPlacement("header", "Idempotency-Key", quoted=True)
    else:
        where = token_s.choice("in", ("header", "body", "none"))
        token_name = "" if where == "none" else token_s.text("name", "the header or body field name")
        token = TokenPlacement(where, token_name, token_s.flag("quoted", where == "header"))
        token_s.done()
    retention = create_s.number("token_retention_s", "seconds the provider keeps tokens", None)
    job_id = create_s.text("job_id", "where the job id is: a JSON path like $.id, or header:Location", "$.id")
    _check_path(create_s, "job_id", job_id)
    _json_path(create_s, "job_id", "$.id")
    status_url = _json_path(
        create_s, "status_url", expected="header:Location, header:Operation-Location or a JSON path"
    )
    sync_result = _json_path(create_s, "sync_result", expected="a JSON path to a result returned with HTTP 200")
    error_code = _json_path(create_s, "error_code", expected="a JSON path to the provider's error code")
    non_retryable = frozenset(create_s.strings("non_retryable", "a list of error codes", []))
    # request fields an agent may fill with a URL (the MCP guard refuses URLs anywhere else)
    url_fields = create_s.strings("url_fields", 'JSON paths such as "$.input.image"', [])
    if any(not f.startswith("$") for f in url_fields):
        create_s.fail("url_fields", 'JSON paths such as "$.input.image"', url_fields)
    create_s.done()

    status_s = top.table("status")
    status = _endpoint(status_s, "GET", base_url)
    state_path, progress_path, result_ref, time_path, effects_path = "$.status", None, None, None, None
    if status_s is not None:
        state_path = _json_path(status_s, "state", "$.status", expected="a JSON path to the job's state")
        progress_path = _json_path(status_s, "progress", expected="a JSON path to progress (0..1 or 0..100)")
        result_ref = _json_path(status_s, "result_ref", expected="a JSON path to the result's URL or id")
        time_path = _json_path(status_s, "time", expected="a JSON path to the provider's timestamp of this status")
        effects_path = _json_path(
            status_s, "effects", expected="a JSON path to the partial effects the provider reports"
        )
        status_s.done()

    states_s = top.table("states")
    mapping = dict(DEFAULT_STATES)
    if states_s is not None:
        for key in list(states_s.data):
            if key not in DEFAULT_STATES:
                states_s.fail(key, "one of " + ", ".join(DEFAULT_STATES) + " (normalised states)", key)
            mapping[key] = states_s.strings(key, "a list of the provider's state names")
    states: dict[str, RemoteState] = {}
    for normal, raws in mapping.items():
        for raw in raws:
            states[raw] = RemoteState(normal)

    cancel_s = top.table("cancel")
    cancel = _endpoint(cancel_s, "POST", base_url)
    cancel_idempotent = False
    if cancel_s is not None:
        cancel_idempotent = cancel_s.flag("idempotent", False)
        cancel_s.done()

    result_s = top.table("result")
    result = _endpoint(result_s, "GET", base_url) if result_s is not None and "path" in result_s.data else None
    result_kind = "safe_read"
    result_spec = ResultSpec()
    download_hosts: tuple[HostRule, ...] = ()
    if result_s is not None:
        result_kind = result_s.choice("kind", ("safe_read", "one_time"), "safe_read")
        entries = result_s.strings(
            "download_hosts", 'a list of hosts such as "storage.example.com" or "*.s3.amazonaws.com"', []
        )
        rules = []
        for entry in entries:
            try:
                rules.append(parse_host_rule(entry))
            except ValueError as exc:
                result_s.fail(
                    "download_hosts",
                    f'hosts such as "storage.example.com", "*.s3.amazonaws.com" or "http://10.0.0.5:9000" ({exc})',
                    entry,
                )
        download_hosts = tuple(rules)
        if result is None:
            result_s._get("method", None)
        result_spec = _result_spec(result_s, source)
        result_s.done()

    rec_s = top.table("reconcile")
    modes: tuple[ReconcileMode, ...] = ()
    lookup_status = lookup_list = None
    list_items, list_reference = "$.data", "$.client_reference"
    if rec_s is not None:
        names = rec_s.strings("modes", "a list of: replay, list_by_reference, status_by_client_id", [])
        try:
            modes = tuple(ReconcileMode(n) for n in names)
        except ValueError:
            rec_s.fail("modes", "a list of: replay, list_by_reference, status_by_client_id", names)
        if ReconcileMode.STATUS_BY_CLIENT_ID in modes:
            path = rec_s.text("status_path", "a path with {token}, e.g. /v1/jobs/by-client-id/{token}")
            _check_url_path(rec_s, "status_path", path, base_url)
            lookup_status = Endpoint("GET", path)
        if ReconcileMode.LIST_BY_REFERENCE in modes:
            path = rec_s.text("list_path", "a path with {token}, e.g. /v1/jobs?client_reference={token}")
            _check_url_path(rec_s, "list_path", path, base_url)
            lookup_list = Endpoint("GET", path)
            list_items = _json_path(rec_s, "items", "$.data", expected="a JSON path to the list of jobs", many=True)
            list_reference = _json_path(
                rec_s, "reference", "$.client_reference", expected="a JSON path (inside one job) to our reference"
            )
        rec_s.done()
    if token.where == "none" and modes:
        top.fail(
            "reconcile.modes",
            'no reconciliation modes when create.token.in = "none" '
            "(without a token the provider cannot match a create to us)",
            list(modes),
        )

    backoff = _backoff(top.table("retry"), Backoff())
    poll_backoff = _backoff(top.table("poll"), Backoff(initial_s=1.0, factor=1.5, cap_s=60.0))
    top.done()
    return HttpProviderConfig(
        name=name,
        base_url=base_url.rstrip("/"),
        target=target,
        credential=credential,
        timeout_s=timeout_s,
        connect_timeout_s=connect_timeout_s,
        max_connections=int(max_connections),
        headers=headers,
        trace_header=trace_header,
        create=create,
        token=token,
        token_retention=None if retention is None else timedelta(seconds=retention),
        job_id=job_id,
        status_url=status_url,
        sync_result=sync_result,
        error_code=error_code,
        non_retryable=non_retryable,
        status=status,
        state_path=state_path,
        progress_path=progress_path,
        result_ref_path=result_ref,
        time_path=time_path,
        effects_path=effects_path,
        states=states,
        cancel=cancel,
        cancel_idempotent=cancel_idempotent,
        result=result,
        result_kind=result_kind,
        result_spec=result_spec,
        reconcile=modes,
        lookup_status=lookup_status,
        lookup_list=lookup_list,
        list_items=list_items,
        list_reference=list_reference,
        backoff=backoff,
        poll_backoff=poll_backoff,
        webhook_scheme=target_kind,
        webhooks=webhooks,
        resume=resume,
        download_hosts=download_hosts,
        extra={"url_fields": tuple(url_fields)},
    )


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


async def _read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, or its first ``limit`` bytes: a huge answer is never read whole."""
    chunks: list[bytes] = []
    total = 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        chunks.append(chunk)
        total += len(chunk)
        if total >= limit:
            break
    return b"".join(chunks)[:limit]


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait, from ``retry-after-ms`` (OpenAI, Anthropic: finer, so it wins) or ``Retry-After``."""
    lowered = {k.lower(): v for k, v in headers.items() if k.lower() in ("retry-after-ms", "retry-after")}
    try:
        millis = float(lowered.get("retry-after-ms", "nan"))
    except ValueError:
        millis = float("nan")
    if 0 <= millis < 10**10:  # nan and absurd values fail this: Retry-After decides
        return millis / 1000
    return parse_retry_after(lowered.get("retry-after"), time.time())


def _text(value: str) -> str:
    return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _check_path(section: Section, key: str, value: str) -> None:
    if not (value.startswith("$") or value.startswith("header:")):
        section.fail(key, "a JSON path like $.id, or header:Name", value)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_provider(source: str | os.PathLike[str] | Mapping[str, Any]) -> HttpProvider:
    """Build the provider a file (or dict) declares; ``kind`` picks a built-in adapter (see :mod:`.kinds`)."""
    from jobtrail.providers.kinds import load_provider as load

    return load(source)


def build(kind: str, data: Mapping[str, Any], source: str) -> HttpProvider:
    """``kind = "http"``: the file declares the whole contract."""
    return HttpProvider(parse_config(data, source))


# -- the provider itself ------------------------------------------------------------------------------


class HttpProvider:
    """A :class:`~jobtrail.Provider` driven by an :class:`HttpProviderConfig`.

    Built-in adapters (:mod:`jobtrail.providers.kinds`) subclass it: they keep its
    plumbing (egress rules, credentials at send time, bounded reads, redaction) and
    override the calls whose wire contract a file cannot declare.
    """

    #: the provider file's ``kind``
    kind = "http"
    #: why the adapter's guarantees hold (shown by ``jobtrail providers check``)
    contract_note = ""

    def __init__(self, config: HttpProviderConfig) -> None:
        self.config = config
        self.name = config.name
        self.target = config.target
        self.create_endpoint = f"{config.create.method} {config.create.path}"
        self.capabilities = Capabilities(
            token=config.token,
            token_retention=config.token_retention,
            reconcile=config.reconcile,
            cancel=config.cancel is not None,
            cancel_idempotent=config.cancel_idempotent,
            result="one_time" if config.result_kind == "one_time" else "safe_read",
            webhook_scheme=config.webhook_scheme,
            states=config.states,
            resume=config.resume,
        )
        self.backoff = config.backoff
        self.result_spec = config.result_spec
        self.poll_backoff = config.poll_backoff
        self.egress = EgressPolicy(config.base_url, config.download_hosts)
        #: (when resolved, the headers it gives): see _credential_headers
        self._credential: tuple[float, dict[str, str]] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._foreign: aiohttp.ClientSession | None = None
        self._foreign_loop: asyncio.AbstractEventLoop | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- plumbing -------------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.config.max_connections, ttl_dns_cache=300),
                timeout=aiohttp.ClientTimeout(total=self.config.timeout_s, sock_connect=self.config.connect_timeout_s),
                headers={"User-Agent": _USER_AGENT},
            )
            self._loop = loop
        return self._session

    def _foreign_client(self) -> aiohttp.ClientSession:
        """For declared download hosts: no provider headers, names resolved to public addresses only."""
        loop = asyncio.get_running_loop()
        if self._foreign is None or self._foreign_loop is not loop or self._foreign.closed:
            self._foreign = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.config.max_connections, resolver=PublicOnlyResolver()),
                timeout=aiohttp.ClientTimeout(total=self.config.timeout_s, sock_connect=self.config.connect_timeout_s),
                headers={"User-Agent": _USER_AGENT},
            )
            self._foreign_loop = loop
        return self._foreign

    async def aclose(self) -> None:
        for session in (self._session, self._foreign):
            if session is not None and not session.closed:
                await session.close()
        self._session = self._foreign = None

    def _url(self, path: str, op: Operation, **extra: str) -> str:
        values = {
            "job_id": op.remote_job_id or "",
            "token": op.idempotency_token,
            "trace_id": op.trace_id,
            **extra,
        }
        # only provider-file paths are formatted (checked at load); a provider's answer never is
        filled = path.format(
            **{k: _path_value(v, keep_slashes=False) for k, v in values.items()},
            **{f"+{k}": _path_value(v, keep_slashes=True) for k, v in values.items()},
        )
        if filled.startswith(("http://", "https://")):
            return filled
        return self.config.base_url + filled

    def _headers(self, op: Operation) -> dict[str, str]:
        headers = dict(self.config.headers)
        headers["traceparent"] = traceparent(op.trace_id)
        if op.lease_owner:
            # lets a provider (and our fake) see which lease a request was made under
            headers["X-Jobtrail-Lease"] = f"{op.lease_owner}/{op.lease_epoch}"
        if self.config.trace_header:
            headers[self.config.trace_header] = op.trace_id
        return headers

    async def _credential_headers(self) -> dict[str, str]:
        """The credential's headers, resolved at most once per CREDENTIAL_TTL_S, and again at once when
        the provider refuses it (see _send); a file or keyring is read off the event loop."""
        credential = self.config.credential
        if credential is None:
            return {}
        now = time.monotonic()
        if self._credential is not None and now - self._credential[0] < CREDENTIAL_TTL_S:
            return self._credential[1]
        inline = callable(credential.ref) or credential.ref.startswith("env:")
        secret = credential.resolve() if inline else await asyncio.to_thread(credential.resolve)
        headers = credential.headers(secret)
        self._credential = (now, headers)
        return headers

    async def _send(
        self,
        method: str,
        url: str,
        op: Operation,
        *,
        body: Any = None,
        extra_headers: Mapping[str, str] = {},
        max_bytes: int = _MAX_BODY,
        keep_raw: bool = False,
    ) -> Response | tuple[str, str]:
        """One request to the provider's own origin (credential and provider headers attached).

        Returns the response, or (error_class, detail) with error_class ``not_sent`` when the
        request provably never left (connection refused/failed)."""
        try:
            home = self.egress.judge(url).home
        except UrlRefused as exc:
            home, why = False, exc.reason
        else:
            why = f"not the origin of base_url ({self.egress.home})"
        if not home:
            # provider-file paths are checked at load and answers are judged before they get here:
            # reaching this line is a bug, and the credential must not go out because of it
            raise ConfigError(f"refusing to send a request to {default_redactor.url(url)}: {why}")
        credential = await self._credential_headers()
        answer = await self._transport(
            method, url, {**self._headers(op), **extra_headers, **credential}, body, max_bytes + 1
        )
        if answer[0] in (401, 403) and credential:
            # refused for its credential, which may have been rotated since it was read: read it again now,
            # and if it changed, send once more (a request refused for its credential was not processed)
            self._credential = None
            fresh = await self._credential_headers()
            if fresh != credential:
                answer = await self._transport(
                    method, url, {**self._headers(op), **extra_headers, **fresh}, body, max_bytes + 1
                )
        return self._response(answer, max_bytes, keep_raw)

    def _response(
        self,
        answer: tuple[int, dict[str, str], bytes] | tuple[str, str],
        max_bytes: int,
        keep_raw: bool,
    ) -> Response | tuple[str, str]:
        if len(answer) == 2:
            return answer
        status, raw_headers, raw = answer
        # header bytes that are not UTF-8 arrive as lone surrogates, which no database can store
        resp_headers = {_text(k): _text(v) for k, v in raw_headers.items()}
        body_value: Any
        if keep_raw:
            body_value = None
        elif len(raw) > max_bytes:
            body_value = {"_jobtrail": f"body larger than {max_bytes} bytes, not kept"}
        else:
            text = raw.decode("utf-8", errors="replace")
            try:
                body_value = parse_json(text) if text.strip() else None
            except ValueError:
                body_value = {"_jobtrail_unparsed": text[:2000]}
        request_id = next((v for k, v in resp_headers.items() if k.lower() in ("x-request-id", "request-id")), None)
        return Response(
            http_status=status,
            headers=resp_headers,
            body=body_value,
            provider_request_id=request_id,
            retry_after_s=_retry_after(resp_headers),
            raw=raw if keep_raw else None,
        )

    async def _transport(
        self, method: str, url: str, headers: Mapping[str, str], body: Any, max_bytes: int
    ) -> tuple[int, dict[str, str], bytes] | tuple[str, str]:
        """The wire: (status, headers, at most ``max_bytes`` of the body), or (error_class, detail).

        The deterministic simulation replaces only this method, so everything above the
        socket (headers, credentials, parsing, classification) is the code that runs for real.
        """
        try:
            async with self._client().request(method, url, headers=headers, json=body, allow_redirects=False) as resp:
                raw = await _read_at_most(resp, max_bytes)
                return resp.status, {k: v for k, v in resp.headers.items()}, raw
        except (TimeoutError, aiohttp.ClientError) as exc:
            return self._failure(exc)

    async def _foreign_transport(
        self, url: yarl.URL, max_bytes: int
    ) -> tuple[int, dict[str, str], bytes] | tuple[str, str]:
        """A GET to a declared download host: no credential, no provider headers, no redirects."""
        try:
            async with self._foreign_client().get(url, allow_redirects=False) as resp:
                raw = await _read_at_most(resp, max_bytes)
                return resp.status, {k: v for k, v in resp.headers.items()}, raw
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, AddressRefused):
                return ("refused", str(exc.os_error))
            return self._failure(exc)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return self._failure(exc)

    def _failure(self, exc: BaseException) -> tuple[str, str]:
        """What a request that got no usable answer tells us: (error class, detail).

        Order matters: a connection never made is ``not_sent`` (nothing reached the
        provider), a time-out or a reset after sending may have reached it.
        """
        name = type(exc).__name__
        if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError):
            return ("not_sent", f"{name}: {exc}")
        if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
            return ("timeout", f"no answer within {self.config.timeout_s:g} s ({name})")
        if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
            return ("connection_reset", f"{name}: {exc}")
        if isinstance(exc, aiohttp.ClientPayloadError):
            return ("incomplete_response", f"{name}: {exc}")
        return ("client_error", f"{name}: {exc}")

    # -- the contract --------------------------------------------------------------------------

    async def create(self, op: Operation) -> CreateOutcome:
        cfg = self.config
        body = op.request_body
        headers = dict(cfg.create.headers)
        if cfg.token.where == "header":
            token = f'"{op.idempotency_token}"' if cfg.token.quoted else op.idempotency_token
            headers[cfg.token.name] = token
        elif cfg.token.where == "body":
            if not isinstance(body, dict):
                raise ConfigError(
                    f"provider {self.name} puts the token in the body field "
                    f"{cfg.token.name!r}, so the request body must be a JSON object"
                )
            body = {**body, cfg.token.name: op.idempotency_token}
        sent = await self._send(cfg.create.method, self._url(cfg.create.path, op), op, body=body, extra_headers=headers)
        if isinstance(sent, tuple):
            if sent[0] == "not_sent":
                return CreateOutcome(kind="not_sent", error_class="connection_failed", detail=sent[1])
            return CreateOutcome(kind="ambiguous", error_class=sent[0], detail=sent[1])
        return self.classify_create(sent)

    def classify_create(self, resp: Response) -> CreateOutcome:
        """Which of confirmed / synchronous / rejected / ambiguous a create response proves."""
        cfg = self.config
        status = resp.http_status or 0
        code = extract(cfg.error_code, resp.body, {}) if cfg.error_code else None
        if code is not None and code in cfg.non_retryable:
            return CreateOutcome(
                kind="rejected",
                response=resp,
                declared_non_retryable=True,
                error_class=f"provider_error:{code}",
                detail=f"HTTP {status}, code {code}",
            )
        if 300 <= status < 400:
            # never followed: a redirected POST may or may not have made a job, and re-sending it
            # only repeats the redirect, so the create stops for a person (see CreateFlow)
            location = next((v for k, v in resp.headers.items() if k.lower() == "location"), None)
            where = default_redactor.url(location) if location else "no Location header"
            return CreateOutcome(
                kind="ambiguous",
                response=resp,
                error_class="redirect",
                detail=(
                    f"the create was answered with HTTP {status} redirecting to {where}; redirects are not "
                    "followed and the create is not re-sent (the provider may or may not have made a job). "
                    "Check base_url and create.path in the provider file, look for a job with this trace id "
                    "in the provider's console, then resolve"
                ),
            )
        if 200 <= status < 300:
            remote_id = job_id(cfg.job_id, resp.body, resp.headers)
            status_url = extract(cfg.status_url, resp.body, resp.headers)
            result = extract_any(cfg.sync_result, resp.body) if cfg.sync_result and status == 200 else None
            if result is not None:
                return CreateOutcome(kind="synchronous", response=resp, remote_job_id=remote_id, result=result)
            if remote_id:
                return CreateOutcome(kind="confirmed", response=resp, remote_job_id=remote_id, status_url=status_url)
            unusable = why_unusable(cfg.job_id, resp.body, resp.headers)
            return CreateOutcome(
                kind="ambiguous",
                response=resp,
                error_class="malformed_response",
                detail=f"HTTP {status} without a job id at {cfg.job_id}; the job may exist"
                if unusable is None
                else f"HTTP {status} with an unusable job id at {cfg.job_id} ({unusable}; not stored); "
                "the job may exist",
            )
        if 400 <= status < 500 and status not in _AMBIGUOUS:
            return CreateOutcome(kind="rejected", response=resp, error_class=f"http_{status}", detail=f"HTTP {status}")
        return CreateOutcome(kind="ambiguous", response=resp, error_class=f"http_{status}", detail=f"HTTP {status}")

    async def lookup(self, op: Operation, mode: ReconcileMode) -> LookupOutcome:
        cfg = self.config
        endpoint = cfg.lookup_status if mode is ReconcileMode.STATUS_BY_CLIENT_ID else cfg.lookup_list
        if endpoint is None:
            return LookupOutcome(kind="unknown", path=mode, detail=f"{mode.value} is not configured")
        sent = await self._send(endpoint.method, self._url(endpoint.path, op), op, extra_headers=endpoint.headers)
        if isinstance(sent, tuple):
            return LookupOutcome(kind="unknown", path=mode, detail=f"{sent[0]}: {sent[1]}")
        if mode is ReconcileMode.STATUS_BY_CLIENT_ID:
            if sent.http_status == 404:
                return LookupOutcome(
                    kind="absent",
                    path=mode,
                    response=sent,
                    detail="the provider has no job for our client id",
                )
            found = job_id(cfg.job_id if cfg.job_id.startswith("$") else "$.id", sent.body, sent.headers)
            if sent.http_status == 200 and found:
                return LookupOutcome(kind="found", path=mode, response=sent, remote_job_ids=(found,))
            return LookupOutcome(kind="unknown", path=mode, response=sent, detail=f"HTTP {sent.http_status}")
        if sent.http_status != 200:
            return LookupOutcome(kind="unknown", path=mode, response=sent, detail=f"HTTP {sent.http_status}")
        items = extract_any(cfg.list_items, sent.body)
        if not isinstance(items, list):
            return LookupOutcome(
                kind="unknown", path=mode, response=sent, detail=f"no list at {cfg.list_items} in the answer"
            )
        id_path = cfg.job_id if cfg.job_id.startswith("$") else "$.id"
        ids = tuple(
            job
            for item in items
            if extract(cfg.list_reference, item, {}) == op.idempotency_token
            and (job := job_id(id_path, item, {})) is not None
        )
        return LookupOutcome(kind="found" if ids else "absent", path=mode, response=sent, remote_job_ids=ids)

    async def status(self, op: Operation) -> StatusOutcome:
        cfg = self.config
        if cfg.status is None:
            raise ConfigError(f"provider {self.name} declares no [status] endpoint")
        sent = await self._send(cfg.status.method, self._url(cfg.status.path, op), op, extra_headers=cfg.status.headers)
        if isinstance(sent, tuple):
            return StatusOutcome(remote_state=RemoteState.UNKNOWN, raw_state=None, error_class=sent[0])
        raw = extract(cfg.state_path, sent.body, sent.headers)
        progress_raw = extract(cfg.progress_path, sent.body, sent.headers)
        try:
            progress = float(progress_raw) if progress_raw is not None else None
        except ValueError:
            progress = None
        return StatusOutcome(
            remote_state=self.capabilities.normalise(raw) if sent.http_status == 200 else RemoteState.UNKNOWN,
            raw_state=raw,
            response=sent,
            progress=progress,
            result_ref=extract(cfg.result_ref_path, sent.body, sent.headers),
            provider_time=extract(cfg.time_path, sent.body, sent.headers),
            effects=extract_any(cfg.effects_path, sent.body),
            error_class="" if sent.http_status == 200 else f"http_{sent.http_status}",
        )

    async def cancel(self, op: Operation) -> Response:
        cfg = self.config
        if cfg.cancel is None:
            raise ConfigError(f"provider {self.name} declares no [cancel] endpoint")
        sent = await self._send(cfg.cancel.method, self._url(cfg.cancel.path, op), op, extra_headers=cfg.cancel.headers)
        return sent if isinstance(sent, Response) else Response(body={"error": sent[0], "detail": sent[1]})

    async def candidates(self, op: Operation, since_us: int, until_us: int) -> LookupOutcome:
        """The declarative format lists no jobs by time; built-in adapters for APIs that can do so override this."""
        return LookupOutcome(
            kind="unknown", path=ReconcileMode.LIST_BY_REFERENCE, detail="this provider cannot list its jobs by time"
        )

    async def fetch_result(self, op: Operation, result_ref: str | None) -> Response:
        cfg = self.config
        max_bytes = cfg.result_spec.max_bytes
        if result_ref is None:
            if cfg.result is None:
                raise ConfigError(f"provider {self.name} declares no [result] endpoint and gave no result reference")
            sent = await self._send(
                "GET",
                self._url(cfg.result.path, op),
                op,
                keep_raw=True,
                max_bytes=max_bytes,
                extra_headers=cfg.result.headers,
            )
        else:
            # a reference the provider handed us: judged by origin, never formatted, never given
            # the credential unless it points at exactly base_url's origin
            try:
                target = self.egress.judge(self.egress.resolve_reference(result_ref))
            except UrlRefused as exc:
                return Response(body=refusal_body(exc, url_key="status.result_ref"))
            if target.home:
                sent = await self._send("GET", str(target.url), op, keep_raw=True, max_bytes=max_bytes)
            else:
                answer = await self._foreign_transport(target.url, max_bytes + 1)
                if answer[0] == "refused":
                    refused = UrlRefused(str(answer[1]), target.origin.host)
                    return Response(body=refusal_body(refused, url_key="status.result_ref"))
                sent = self._response(answer, max_bytes, keep_raw=True)
        if isinstance(sent, Response) and 300 <= (sent.http_status or 0) < 400:
            location = next((v for k, v in sent.headers.items() if k.lower() == "location"), None)
            shown = default_redactor.url(location) if location else "no Location header"
            # the raw body stays out; the observation says why nothing was stored
            return Response(
                http_status=sent.http_status,
                headers=sent.headers,
                provider_request_id=sent.provider_request_id,
                retry_after_s=sent.retry_after_s,
                body={"error": "redirect", "detail": f"redirect to {shown} not followed"},
            )
        return sent if isinstance(sent, Response) else Response(body={"error": sent[0], "detail": sent[1]})
