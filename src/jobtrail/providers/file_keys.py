"""Every key of a provider file (``kind = "http"``), declared once: the parser reads only declared keys
and refuses undeclared ones by this table, and the README's reference table is generated from it
(``python -m jobtrail.interfaces.reference --write``), so the two cannot drift apart."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NoReturn

from jobtrail.domain.backoff import Backoff
from jobtrail.domain.errors import ConfigError
from jobtrail.providers.config import Section

#: the normalised states a provider's own state names map to (``[states]``, ``[[status.rules]]``)
NORMAL_STATES = ("queued", "running", "succeeded", "failed", "cancelling", "cancelled", "expired")
#: the default back-off of ``[retry]`` (create retries) and ``[poll]`` (status polls)
RETRY_DEFAULT, POLL_DEFAULT = Backoff(), Backoff(initial_s=1.0, factor=1.5, cap_s=60.0)
_PATH = "JSON path"
_NONE = "-"


@dataclass(frozen=True, slots=True)
class Key:
    """One key: the table it sits in (``""`` the top level), its name, its type, default and meaning."""

    table: str
    name: str
    type: str
    default: str
    meaning: str


def _endpoint(table: str, method: str, path_default: str = "required") -> tuple[Key, ...]:
    return (
        Key(table, "method", "GET, POST, PUT, DELETE or PATCH", method, "the HTTP method"),
        Key(
            table,
            "path",
            "path",
            path_default,
            "below base_url (or a URL at its origin); placeholders {job_id}, {token}, {trace_id}"
            + (", {result_ref}" if table == "result" else "")
            + "; {+job_id} keeps the slashes of an id",
        ),
        Key(table, "headers", "table of strings", "{}", "sent with this endpoint's requests only (no credentials)"),
    )


def _backoff(table: str, default: Backoff, what: str) -> tuple[Key, ...]:
    return (
        Key(table, "initial_s", "seconds", f"{default.initial_s:g}", f"the first {what} delay"),
        Key(table, "factor", "number >= 1", f"{default.factor:g}", "each delay is the last one times this"),
        Key(table, "cap_s", "seconds", f"{default.cap_s:g}", "the longest delay"),
        Key(table, "max_retry_after_s", "seconds", f"{default.max_retry_after_s:g}", "the longest Retry-After kept"),
        Key(table, "jitter", "share 0..1", f"{default.jitter:g}", "the random share of each delay (1 = full jitter)"),
    )


KEYS: tuple[Key, ...] = (
    Key("", "kind", "text", "http", "which adapter reads the file: http (these keys) or a built-in kind"),
    Key("", "name", "text", "required", "the provider's name (agents choose providers by it)"),
    Key("", "base_url", "URL", "required", "absolute http(s) URL; the credential goes to its exact origin only"),
    Key("", "target", "text", "base_url's host", "what the jobs act on (part of the request fingerprint)"),
    Key("", "credential", "reference", _NONE, "env:NAME, file:PATH or keyring:SERVICE/USER (never the value)"),
    Key("", "auth", "text", "bearer", "how the credential is sent: bearer, header:<Name> or basic:<user>"),
    Key("", "timeout_s", "seconds", "30", "one call's time-out"),
    Key("", "connect_timeout_s", "seconds", "10", "one connection's time-out"),
    Key("", "max_connections", "count", "256", "open connections at most"),
    Key("", "headers", "table of strings", "{}", "sent with every request (no credentials)"),
    Key("", "trace_header", "header name", "X-Trace-ID", "carries the operation's trace id"),
    Key("", "resume", "bool", "false", "the provider can resume a failed job"),
    Key("", "create", "table", "required", "how a job is created"),
    Key("", "status", "table", _NONE, "how a job's state is read"),
    Key("", "states", "table", "see [states]", "the provider's state names, by normalised state"),
    Key("", "cancel", "table", _NONE, "how a job is cancelled (none: a cancel can only be recorded)"),
    Key("", "result", "table", _NONE, "how a result is fetched and checked"),
    Key("", "reconcile", "table", _NONE, "how a create whose answer was lost is settled"),
    Key("", "retry", "table", "see [retry]", "back-off of create retries"),
    Key("", "poll", "table", "see [poll]", "back-off of status polls"),
    Key("", "webhooks", "table", _NONE, "signed webhooks that bring the next poll forward"),
    *_endpoint("create", "POST"),
    Key("create", "token", "table", 'in = "header", name = "Idempotency-Key"', "where the idempotency token travels"),
    Key("create", "token_retention_s", "seconds", _NONE, "how long the provider remembers a token"),
    Key("create", "job_id", "JSON path or header:Name", "$.id", "where the create's answer names the job"),
    Key("create", "status_url", "JSON path or header:Name", _NONE, "the answer's link to the job's status"),
    Key("create", "sync_result", _PATH, _NONE, "a result returned with the create's answer"),
    Key("create", "error_code", _PATH, _NONE, "the provider's error code in a refusal"),
    Key("create", "non_retryable", "list of strings", "[]", "error codes that are a definitive refusal"),
    Key("create", "url_fields", "list of JSON paths", "[]", "request fields an agent may fill with a URL"),
    Key("create.token", "in", "header, body, query or none", "required", "where the token travels"),
    Key("create.token", "name", "text", "required unless none", "the header, body field (dotted) or query name"),
    Key("create.token", "quoted", "bool", "true for a header", "sent as an sf-string (the IETF draft's form)"),
    *_endpoint("status", "GET"),
    Key("status", "state", _PATH, "$.status", "the job's state"),
    Key("status", "progress", _PATH, _NONE, "progress, 0..1 or 0..100"),
    Key("status", "result_ref", _PATH, _NONE, "the result's URL or id"),
    Key("status", "time", _PATH, _NONE, "the provider's timestamp of this status"),
    Key("status", "effects", _PATH, _NONE, "partial effects the provider reports"),
    Key("status", "error", _PATH, _NONE, "why a job failed (a message, error object or list): quoted in its reason"),
    Key("status", "rules", "list of tables", "[]", "states no single field holds, decided before state"),
    Key("status.rules[]", "if", _PATH, "required", "the rule holds when this selects a (non-empty) value"),
    Key("status.rules[]", "state", "normalised state", "required", "the state when the rule holds"),
    Key("status.rules[]", "equals", "any", _NONE, "hold only when the value equals this"),
    *(
        Key("states", state, "list of strings", "common names", f"the provider's names for {state}")
        for state in NORMAL_STATES
    ),
    *_endpoint("cancel", "POST"),
    Key("cancel", "idempotent", "bool", "false", "a repeated cancel is harmless (else sent at most once)"),
    *_endpoint("result", "GET", _NONE),
    Key("result", "kind", "safe_read or one_time", "safe_read", "one_time: fetched once, never twice"),
    Key("result", "from_status", _PATH, _NONE, "the result is this value of the finished job's status"),
    Key("result", "download_hosts", "list of hosts", "[]", "where result links may point (no credential sent)"),
    Key("result", "content_type", "media type", _NONE, "the result's expected type"),
    Key("result", "max_bytes", "bytes", "268435456", "the largest result accepted"),
    Key("result", "checksum", "header:<Name>", _NONE, "a response header carrying the sha256"),
    Key("result", "schema", "table or .json path", _NONE, "a JSON Schema the result must meet"),
    Key("result", "records", _PATH, _NONE, "the list of records (counted)"),
    Key("result", "min_records", "count", _NONE, "fewer records is a validation failure"),
    Key("result", "check", "package.module:function", _NONE, "your own business rule"),
    Key("result", "batch", "table", _NONE, "JSONL items keyed by an id, with per-item outcomes"),
    Key("result.batch", "format", "jsonl", "jsonl", "the items' format"),
    Key("result.batch", "id", _PATH, "$.custom_id", "each item's id"),
    Key("result.batch", "error", _PATH, "$.error", "set on failed items"),
    Key("result.batch", "outcome", _PATH, _NONE, "each item's outcome word"),
    Key("result.batch", "succeeded", "list of strings", '["succeeded"]', "the outcome words of a succeeded item"),
    Key("reconcile", "modes", "list", "[]", "replay, status_by_client_id, list_by_reference"),
    Key("reconcile", "status_path", "path with {token}", "required by its mode", "look a job up by our token"),
    Key("reconcile", "list_path", "path with {token}", "required by its mode", "list jobs by our reference"),
    Key("reconcile", "items", _PATH, "$.data", "the listed jobs"),
    Key("reconcile", "reference", _PATH, "$.client_reference", "our reference inside one listed job"),
    Key("reconcile", "next", _PATH, _NONE, "the next page's URL"),
    Key("reconcile", "cursor", _PATH, _NONE, "the cursor the next page starts after"),
    Key("reconcile", "cursor_param", "query parameter", "after", "carries the cursor"),
    Key("reconcile", "has_more", _PATH, _NONE, "true while more pages follow"),
    Key("reconcile", "max_pages", "count", "10", "pages read at most"),
    *_backoff("retry", RETRY_DEFAULT, "retry"),
    *_backoff("poll", POLL_DEFAULT, "poll"),
    Key("webhooks", "scheme", "standard", "standard", "Standard Webhooks signatures"),
    Key("webhooks", "secrets", "list of references", "required", "env:NAME, ... (two during a rotation)"),
    Key("webhooks", "tolerance_s", "seconds", "300", "a delivery's timestamp may be this far off"),
    Key("webhooks", "max_bytes", "bytes", "1048576", "the largest delivery accepted"),
    Key("webhooks", "retention_days", "days", "7", "how long delivered event ids are remembered"),
    Key("webhooks", "job_id", _PATH, "$.data.id", "the job id in an event"),
    Key("webhooks", "reference", _PATH, _NONE, "our client reference in an event"),
    Key("webhooks", "type", _PATH, "$.type", "the event type"),
    Key("webhooks", "read_timeout_s", "seconds", "10", "time to receive a whole delivery"),
)

#: the keys each table allows
DECLARED: dict[str, frozenset[str]] = {}
for _key in KEYS:
    DECLARED[_key.table] = DECLARED.get(_key.table, frozenset()) | {_key.name}


def _table_of(where: str) -> str:
    return re.sub(r"\[\d+\]", "[]", where)


class DeclaredSection(Section):
    """A table of a provider file checked against :data:`KEYS`: a key in the file that no table declares
    is refused with the declared ones, and the parser cannot read a key it has not declared."""

    def _get(self, key: str, default: Any) -> Any:
        table = _table_of(self.where)
        if key not in DECLARED.get(table, frozenset()):
            raise AssertionError(
                f"the provider-file parser reads {key!r} in [{table}], which jobtrail.providers.file_keys.KEYS "
                "does not declare: declare it there (the README's reference table is generated from it)"
            )
        return super()._get(key, default)

    def table(self, key: str, *, required: bool = False) -> Section | None:
        found = super().table(key, required=required)
        return None if found is None else DeclaredSection(found.data, found.where, found.source)

    def done(self) -> None:
        table = _table_of(self.where)
        unknown = sorted(set(self.data) - DECLARED.get(table, frozenset()))
        if unknown:
            self._unknown(unknown[0], table)
        super().done()

    def _unknown(self, key: str, table: str) -> NoReturn:
        place = f"[{table}]" if table else "the top level"
        raise ConfigError(
            f"{self.source}: unknown key {key!r} in {place}; the keys there are: "
            f"{', '.join(sorted(DECLARED.get(table, ())))} (see the README's provider file reference)"
        )
