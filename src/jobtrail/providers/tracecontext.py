"""The W3C ``traceparent`` of an outgoing request: the operation's trace, the current action's span."""

from __future__ import annotations

from opentelemetry import trace

from jobtrail.domain.ids import traceparent


def outgoing_traceparent(trace_id: str) -> str:
    """``traceparent`` for a request of the operation whose trace id is ``trace_id``.

    Sent from inside a recording span of that trace (an action's span), it names that span, so
    the provider's own spans hang under ours in a collector; otherwise (no SDK) a fresh span id.
    The trace id is always the operation's, and the sampled flag the span's when there is one.
    """
    span = trace.get_current_span()
    context = span.get_span_context()
    if context.is_valid and f"{context.trace_id:032x}" == trace_id:
        sampled = context.trace_flags.sampled
        span_id = f"{context.span_id:016x}" if span.is_recording() else None
        return traceparent(trace_id, span_id=span_id, sampled=sampled)
    return traceparent(trace_id)
