"""Log lines of the long-running commands (``worker``, ``webhooks serve``, ``mcp``, ``dashboard``).

One handler on stderr, as text or one JSON object a line. Every line written during an action
names its operation and trace (``operation_id``, ``trace_id``; ``span_id`` when a span records),
and passes the redacting filter first: the filter sits on the handler itself, so no record
reaches the stream, whichever logger wrote it, without being redacted.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

from opentelemetry import trace

from jobtrail.domain.redact import RedactingFilter, install_log_redaction
from jobtrail.flows.telemetry import log_context

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
#: marks the handler installed here, so configuring again replaces it instead of adding a second
_OURS = "jobtrail"
#: the loggers given our handler and a level (the root gets the handler too)
CONFIGURED = ("jobtrail", "aiohttp", "uvicorn", "mcp")


class ContextFilter(logging.Filter):
    """Adds the operation id, trace id and span id of the action under way to each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = log_context()
        operation_id, trace_id = current if current is not None else (None, None)
        span_id = None
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            trace_id = trace_id or f"{context.trace_id:032x}"
            if trace.get_current_span().is_recording():
                span_id = f"{context.span_id:016x}"
        record.operation_id = getattr(record, "operation_id", None) or operation_id
        record.trace_id = getattr(record, "trace_id", None) or trace_id
        record.span_id = getattr(record, "span_id", None) or span_id
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, and the operation's ids when there are."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in ("operation_id", "trace_id", "span_id"):
            value = getattr(record, name, None)
            if value:
                doc[name] = value
        # a line's figures as fields of their own (the worker's summary), beside the message that says them
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            doc |= {k: v for k, v in fields.items() if k not in doc}
        return json.dumps(doc, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``time level logger [op trace] message``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(ids)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        op, trace_id = getattr(record, "operation_id", None), getattr(record, "trace_id", None)
        ids = " ".join(part for part in (op, f"trace={trace_id}" if trace_id else None) if part)
        record.ids = f" [{ids}]" if ids else ""
        return super().format(record)


class StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to ``sys.stderr`` as it is at each line (a live terminal display may have wrapped it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # read-only: always the current sys.stderr
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


def json_lines() -> bool:
    """Whether the command's log lines are JSON (``--log-format json``): then nothing else goes to stderr."""
    handlers = logging.getLogger("jobtrail").handlers
    return any(h.get_name() == _OURS and isinstance(h.formatter, JsonFormatter) for h in handlers)


def say(message: str, level: int = logging.INFO, fields: dict[str, Any] | None = None) -> None:
    """A line the command owes its reader (a notice, the worker's summary at exit), written by our handler
    whatever ``--log-level`` leaves out: a level is for log chatter, and these said what they say in text
    mode at any level. ``fields``: the line's figures, as fields of their own in a JSON line."""
    logger = logging.getLogger("jobtrail")
    handler = next((h for h in logger.handlers if h.get_name() == _OURS), None)
    record = logger.makeRecord("jobtrail", level, __file__, 0, message, (), None, extra={"fields": fields or {}})
    if handler is None:
        logger.handle(record)
    else:
        handler.handle(record)


def configure_logging(level: str = "info", fmt: str = "text") -> logging.Handler:
    """Send ``jobtrail``'s log lines (the HTTP stack's and the MCP SDK's too) at ``level`` and up to stderr as ``fmt``.

    Our handler is the one that writes to stderr: each logger configured here stops propagating (its lines
    are written once, by ours), and ours sits on the root logger as well, so any other library's warnings
    are redacted and formatted alike, and ``logging.basicConfig`` (which the MCP SDK calls, adding a Rich
    handler of its own that wrote every line a second time, unmasked, not in ``--log-format``) finds the
    root configured and adds nothing. Idempotent: a second call replaces the handler the first installed.
    """
    if level not in LEVELS or fmt not in FORMATS:
        raise ValueError(f"log level must be one of {LEVELS} and format one of {FORMATS}")
    install_log_redaction()
    handler = StderrHandler()
    handler.set_name(_OURS)
    # redaction first: the context filter and the formatter see the redacted message only
    handler.addFilter(RedactingFilter())
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    threshold = getattr(logging, level.upper())
    for name in (*CONFIGURED, ""):
        logger = logging.getLogger(name or None)
        for old in [h for h in logger.handlers if h.get_name() == _OURS]:
            logger.removeHandler(old)
        logger.addHandler(handler)
        if not name:
            continue  # the root keeps its level (warnings): other libraries' chatter stays out
        # written by our handler here, never again by one further up (the root's holds ours too)
        logger.propagate = False
        # the HTTP stack's info lines are one per request: only its warnings and errors
        logger.setLevel(threshold if name == "jobtrail" else max(threshold, logging.WARNING))
    return handler
