"""Traces: W3C trace context on every request to a target, OpenTelemetry spans when asked.

- **Always:** every request to a target carries a W3C ``traceparent`` header, so a receiver
  can join the trace; with tracing off its sampled flag is 0 and nothing is recorded here.
- **Tracing on** (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
  set, or ``EVENTPUSH_TRACING=1``): spans go to the OTLP/HTTP exporter, configured by the
  standard ``OTEL_*`` variables. Spans: ``eventpush.publish`` per publish batch,
  ``eventpush.deliver`` per delivery attempt (runner, target, attempt number, HTTP status,
  outcome), ``eventpush.commit`` per commit.
- **An event's own trace.** An event published with a top-level ``traceparent`` field (a
  W3C traceparent string) keeps it: its delivery spans are children of that context and the
  ``traceparent`` a target receives carries its trace id. With tracing on, publish stamps
  the field on events that have none, with the publish span's context, so one trace runs
  publish → push → target. ``eventpush publish`` takes its own parent from the
  ``TRACEPARENT`` environment variable (the OpenTelemetry environment carrier).

The tracer provider is this module's, never the global one, so embedding applications keep
theirs; :func:`use` swaps it (the tests use an in-memory exporter).
"""

from __future__ import annotations

import os
import random
import re
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT_FIELD = "traceparent"
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
_ONE_TRACE, _ONE_SPAN = "0" * 31 + "1", "0" * 15 + "1"
_randbytes = random.randbytes
_propagator = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None
_enabled: bool | None = None


def enabled_by_environment() -> bool:
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        or os.environ.get("EVENTPUSH_TRACING", "").strip() == "1"
    )


def _from_environment() -> tuple[TracerProvider, bool]:
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "eventpush")})
    if not enabled_by_environment():
        # Spans still get valid ids (the traceparent a target sees) but are never recorded.
        return TracerProvider(sampler=ALWAYS_OFF, resource=resource), False
    # Deferred: OpenTelemetry's SDK is loaded only when tracing is switched on.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider, True


def provider() -> TracerProvider:
    global _provider, _enabled
    if _provider is None:
        _provider, _enabled = _from_environment()
    return _provider


def enabled() -> bool:
    if _enabled is None:  # asked per attempt: no call once the provider is known
        provider()
    return bool(_enabled)


def use(new: TracerProvider | None, *, on: bool = True) -> None:
    """Use ``new`` from now on (None: back to what the environment says)."""
    global _provider, _enabled
    _provider, _enabled = new, (on if new is not None else None)


def tracer() -> trace.Tracer:
    return provider().get_tracer("eventpush")


def context_of(traceparent: object) -> Context | None:
    """The context a W3C traceparent string names, or None when it names none (invalid)."""
    if not isinstance(traceparent, str):
        return None
    ctx = _propagator.extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


_FIELD_KEY = f'"{TRACEPARENT_FIELD}"'


def carrier(record) -> object:
    """What may carry a record's trace context: its event, or None when the event's text does
    not name the field, so a record nothing else needed parsed (a target sending the body as
    stored) is not parsed for this either. A stored event's top-level keys are written by
    eventpush's encoders, never escaped (only a producer writing a broker's stream directly
    could spell one escaped, and its trace would then start anew)."""
    if record.parsed is None and _FIELD_KEY not in record.raw:
        return None
    return record.event


def event_context(event: object) -> Context | None:
    """The trace an event was published in (its top-level ``traceparent``), if any."""
    return context_of(event.get(TRACEPARENT_FIELD)) if isinstance(event, dict) else None


def traceparent_of(span: trace.Span) -> str:
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=trace.set_span_in_context(span))
    return carrier["traceparent"]


def unrecorded_traceparent(event: object) -> str:
    """A traceparent for an attempt nobody records: the event's trace id when it has a valid
    one, else a new one; a new span id; not sampled. The SDK's non-recording span costs
    about 15 times this on every request.

    The ids are random (W3C: random, non-zero), both drawn in one call from the process's
    Mersenne Twister (not a secret, as in the SDK's own id generator) and hex-encoded in one."""
    value = event.get(TRACEPARENT_FIELD) if isinstance(event, dict) else None
    ids = _randbytes(24).hex()
    span_id = ids[32:]
    if span_id == _ZERO_SPAN:  # one draw in 2**64
        span_id = _ONE_SPAN
    if value is not None:
        match = _TRACEPARENT.fullmatch(value) if isinstance(value, str) else None
        if match and match[1] != "ff" and match[2] != _ZERO_TRACE and match[3] != _ZERO_SPAN:
            return f"00-{match[2]}-{span_id}-00"
    trace_id = ids[:32]
    if trace_id == _ZERO_TRACE:
        trace_id = _ONE_TRACE
    return f"00-{trace_id}-{span_id}-00"


@contextmanager
def deliver_span(target, records, attempt: int):
    """The span of one delivery attempt, a child of the first record's trace when it has
    one; yields (span, traceparent header value)."""
    if not enabled():
        yield trace.INVALID_SPAN, unrecorded_traceparent(carrier(records[0]))
        return
    span = tracer().start_span(
        "eventpush.deliver",
        context=event_context(carrier(records[0])),
        kind=trace.SpanKind.CLIENT,
        attributes={
            "eventpush.runner": target.runner,
            "eventpush.bus": target.bus,
            "eventpush.target": target.name,
            "eventpush.attempt": attempt,
            "eventpush.records": len(records),
            "messaging.message.id": records[0].message_id,
        },
    )
    try:
        yield span, traceparent_of(span)
    finally:
        span.end()


def finish_deliver_span(span: trace.Span, outcome) -> None:
    if not span.is_recording():
        return
    span.set_attribute("eventpush.outcome", outcome.kind)
    if outcome.http_status is not None:
        span.set_attribute("http.response.status_code", outcome.http_status)
    if outcome.kind != "delivered":
        span.set_status(trace.Status(trace.StatusCode.ERROR, outcome.error or outcome.kind))


async def in_deliver_span(target, records, send):
    """``await send(traceparent)`` in a deliver span of its own, ``traceparent`` naming that
    span (the request carries it, so the receiver can join the trace); the outcome is
    recorded on the span."""
    with deliver_span(target, records, records[0].attempts + 1) as (span, parent):
        outcome = await send(parent)
        finish_deliver_span(span, outcome)
    return outcome


@contextmanager
def commit_span(worker: str):
    with tracer().start_as_current_span(
        "eventpush.commit", attributes={"eventpush.worker": worker}
    ) as span:
        yield span


@contextmanager
def publish_span(bus: str):
    """The span of one publish batch, a child of ``TRACEPARENT`` from the environment when
    set. Yields (span, traceparent to stamp on events, or None when tracing is off)."""
    parent = context_of(os.environ.get("TRACEPARENT"))
    with tracer().start_as_current_span(
        "eventpush.publish",
        context=parent,
        kind=trace.SpanKind.PRODUCER,
        attributes={"eventpush.bus": bus},
    ) as span:
        yield span, (traceparent_of(span) if span.is_recording() else None)
