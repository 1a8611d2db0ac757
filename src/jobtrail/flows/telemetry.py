"""Spans, action metrics and the log context of each action, through the OpenTelemetry API.

Only the API is a dependency: without an SDK its tracer and meter are no-ops, so an action
costs a few attribute-free calls more (attributes are built only for a recording span). The
operator picks the SDK and exporters (``pip install 'jobtrail[otel]'``, or ``opentelemetry-instrument``).

Every span of an operation carries the operation's own trace id, the one on its record and in
the ``traceparent`` sent to the provider: an action's span is a child of the current span when
that span is already in the operation's trace (a submit inside an agent's span, then its
create), and otherwise of a remote parent made from the stored trace id, so the spans of one
operation share one trace across processes and restarts. That parent stands for the operation
and is never exported itself.

Spans and metrics carry ids, names, states, HTTP statuses and provider request ids: never a
credential, a request or response body, or an exception's text unredacted.
"""

from __future__ import annotations

import contextvars
import functools
import os
import time
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.environment_variables import OTEL_PYTHON_TRACER_PROVIDER
from opentelemetry.trace import (
    NonRecordingSpan,
    NoOpTracerProvider,
    ProxyTracerProvider,
    Span,
    SpanContext,
    Status,
    StatusCode,
    TraceFlags,
)

from jobtrail.domain.record import Operation
from jobtrail.domain.redact import redact_outgoing
from jobtrail.domain.states import State
from jobtrail.domain.steps import Step, next_step
from jobtrail.providers.contract import NoAnswer, Response

T = TypeVar("T")

#: the instrumentation scope of every span and instrument
SCOPE = "jobtrail"

_tracer = trace.get_tracer(SCOPE)  # a proxy: an SDK configured later is picked up
#: the meter of every jobtrail instrument (the runtime adds its ledger gauges to it)
meter = metrics.get_meter(SCOPE)

_actions = meter.create_counter(
    "jobtrail.actions", unit="{action}", description="Actions done, by kind (create, reconcile, poll, ...)"
)
_provider_duration = meter.create_histogram(
    "jobtrail.provider.duration",
    unit="s",
    description="How long one provider call took, by provider and call",
    # seconds, from a loopback answer to a slow API's time-out (the default buckets are for milliseconds)
    explicit_bucket_boundaries_advisory=[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
)
_provider_errors = meter.create_counter(
    "jobtrail.provider.errors",
    unit="{call}",
    description="Provider calls that got no answer or an error status, by provider, call and error",
)
_takeovers = meter.create_counter(
    "jobtrail.lease.takeovers",
    unit="{lease}",
    description="Leases another owner took over while this process was acting (its write was refused)",
)
_webhooks = meter.create_counter(
    "jobtrail.webhook.receipts", unit="{delivery}", description="Webhook deliveries, by provider and outcome"
)
_refusals = meter.create_counter(
    "jobtrail.webhook.refusals", unit="{delivery}", description="Refused webhook deliveries, by provider and reason"
)

#: (operation id, trace id) of the action under way: what each log line names
_log_context: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("jobtrail_op", default=None)


def action_kind(op: Operation) -> str:
    """What the operation's next action is: create, reconcile, poll, cancel or collect (its span's name)."""
    step = next_step(op)
    if step is Step.CREATE:
        return "create" if op.state is State.CREATE_PENDING else "reconcile"
    return {Step.COLLECT: "collect", Step.SEND_CANCEL: "cancel"}.get(step, "poll")


def ambient_trace_id() -> str | None:
    """The trace id of the caller's current span (an agent's own), if it has one: a submit joins it."""
    context = trace.get_current_span().get_span_context()
    return f"{context.trace_id:032x}" if context.is_valid else None


@functools.lru_cache(maxsize=4096)
def _operation_parent(trace_id: str) -> Context:
    tid = int(trace_id, 16)
    # a span id of its own for the operation, the same in every process: the parent of its actions
    span_id = (tid >> 64 ^ tid) & 0xFFFF_FFFF_FFFF_FFFF or 1
    # sampled: every operation is traced unless the operator's sampler says otherwise for remote parents
    parent = SpanContext(tid, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.set_span_in_context(NonRecordingSpan(parent))


def _tracing() -> bool:
    """Is a tracer provider (an SDK) configured? Asked at each action: one may be installed at any time.

    Once one is, it stays (the API allows setting it once). Until then, the API's own answer reads
    the environment at every call, which costs more than the rest of an untraced action's telemetry;
    its module-level provider says the same without that (a provider named in the environment is
    looked for at every call, as the API would).
    """
    if _Sdk.seen:
        return True
    if getattr(trace, "_TRACER_PROVIDER", _UNSET) is None and not _PROVIDER_FROM_ENV:
        return False
    _Sdk.seen = not isinstance(trace.get_tracer_provider(), ProxyTracerProvider | NoOpTracerProvider)
    return _Sdk.seen


_UNSET = object()
#: an SDK named in the environment (the API loads it on its first use)
_PROVIDER_FROM_ENV = OTEL_PYTHON_TRACER_PROVIDER in os.environ


class _Sdk:
    seen = False


def _parent(trace_id: str) -> Context | None:
    current = trace.get_current_span().get_span_context()
    if current.is_valid and f"{current.trace_id:032x}" == trace_id:
        return None  # already in the operation's trace (the caller's span): a real parent
    return _operation_parent(trace_id)


@contextmanager
def operation_context(op: Operation) -> Iterator[None]:
    """Log lines written inside name ``op`` and its trace."""
    token = _log_context.set((op.operation_id, op.trace_id))
    try:
        yield
    finally:
        _log_context.reset(token)


def log_context() -> tuple[str, str] | None:
    """(operation id, trace id) of the action under way, or None."""
    return _log_context.get()


@contextmanager
def action_span(op: Operation, kind: str) -> Iterator[Span]:
    """The span of one action on ``op`` (current while it runs), and its count.

    Call :func:`finished` with the new record before leaving it.
    """
    if not _tracing():
        # no SDK: a no-op span would cost tens of microseconds of context managers and change nothing
        # (the traceparent and the log lines take the trace id from the operation either way)
        token = _log_context.set((op.operation_id, op.trace_id))
        try:
            yield trace.INVALID_SPAN
        finally:
            _log_context.reset(token)
            _actions.add(1, {"kind": kind, "provider": op.provider})
        return
    with (
        _tracer.start_as_current_span(
            f"jobtrail.{kind}", context=_parent(op.trace_id), record_exception=False, set_status_on_exception=False
        ) as span,
        operation_context(op),
    ):
        if span.is_recording():
            span.set_attributes(
                {
                    "jobtrail.operation_id": op.operation_id,
                    "jobtrail.provider": op.provider,
                    "jobtrail.action": kind,
                    "jobtrail.state.before": op.state.value,
                    "jobtrail.attempt": op.attempts,
                }
            )
            if op.remote_job_id:
                span.set_attribute("jobtrail.remote_job_id", op.remote_job_id)
        try:
            yield span
        except BaseException as exc:
            if span.is_recording():
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {redact_outgoing(str(exc))}"))
            raise
        finally:
            _actions.add(1, {"kind": kind, "provider": op.provider})


def finished(span: Span, new: Operation) -> None:
    """Put the state the action left the operation in on its span."""
    if span.is_recording():
        span.set_attribute("jobtrail.state.after", new.state.value)
        if new.remote_job_id:
            span.set_attribute("jobtrail.remote_job_id", new.remote_job_id)


async def provider_call(op: Operation, call: str, pending: Awaitable[T]) -> T:
    """Await one provider call (create, lookup, status, cancel, candidates, fetch_result): its latency,
    its error if any, and its HTTP status and provider request id on the action's span."""
    started = time.perf_counter()
    try:
        outcome = await pending
    except Exception as exc:
        _provider_errors.add(1, {"provider": op.provider, "call": call, "error": type(exc).__name__})
        raise
    _provider_duration.record(time.perf_counter() - started, {"provider": op.provider, "call": call})
    if isinstance(outcome, NoAnswer):  # no HTTP answer: a time-out, a reset, a connection never made
        _provider_errors.add(1, {"provider": op.provider, "call": call, "error": outcome.error_class})
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event(f"provider.{call}", {"jobtrail.no_answer": outcome.error_class})
        return outcome
    response = outcome if isinstance(outcome, Response) else getattr(outcome, "response", None)
    if isinstance(response, Response):
        status = response.http_status
        if status is None or status >= 400:
            error = "no_answer" if status is None else str(status)
            _provider_errors.add(1, {"provider": op.provider, "call": call, "error": error})
        span = trace.get_current_span()
        if span.is_recording():
            if status is not None:
                span.set_attribute("http.response.status_code", status)
            if response.provider_request_id:
                span.set_attribute("jobtrail.provider_request_id", response.provider_request_id)
            # a reconciliation may make several calls: each is an event, the last one's answer the attributes
            span.add_event(f"provider.{call}", {} if status is None else {"http.response.status_code": status})
    return outcome


def lease_taken_over(op: Operation) -> None:
    _takeovers.add(1, {"provider": op.provider})


def webhook_received(provider: str, outcome: str) -> None:
    _webhooks.add(1, {"provider": provider, "outcome": outcome})


def webhook_refused(provider: str, reason: str) -> None:
    _webhooks.add(1, {"provider": provider, "outcome": "refused"})
    _refusals.add(1, {"provider": provider, "reason": reason})


@contextmanager
def webhook_span(provider: str, op: Operation | None) -> Iterator[Span]:
    """The span of one verified delivery: in the matched operation's trace, else in a trace of its own."""
    context = _parent(op.trace_id) if op is not None else None
    with _tracer.start_as_current_span(
        "jobtrail.webhook", context=context, record_exception=False, set_status_on_exception=False
    ) as span:
        if span.is_recording():
            span.set_attribute("jobtrail.provider", provider)
            if op is not None:
                span.set_attributes({"jobtrail.operation_id": op.operation_id, "jobtrail.state.before": op.state.value})
        if op is None:
            yield span
            return
        with operation_context(op):
            yield span
