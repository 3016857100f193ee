"""W3C trace context and OpenTelemetry spans: publish → push → a loopback receiver, spans
collected by the SDK's in-memory exporter."""

from __future__ import annotations

import json
import re

import pytest
import support
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from eventpush import catalog, tracing
from eventpush.publish import publish
from eventpush.push import run_worker

rx = support.rx  # the shared receiver fixture (tests/support.py)

# Version 00; flags: bit 0 sampled, bit 1 "random trace id" (Trace Context level 2).
TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
OWN_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
OWN_PARENT = f"00-{OWN_TRACE}-00f067aa0ba902b7-01"


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    yield exporter
    tracing.use(None)


@pytest.fixture
def tracing_off(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("EVENTPUSH_TRACING", raising=False)
    tracing.use(None)
    yield
    tracing.use(None)


def setup(conn, rx, path: str) -> None:
    catalog.create_bus(conn, "orders", 2)
    catalog.create_rule(conn, "orders", "r", {"source": ["shop"]})
    spec = catalog.TargetSpec(name="t", url=rx.url + path, backoff_ms=5)
    catalog.create_target(conn, "orders", "r", spec)
    catalog.create_worker(conn, "w1")
    catalog.assign(conn)


def valid(header: str | None) -> re.Match:
    match = TRACEPARENT.fullmatch(header or "")
    assert match, f"not a W3C traceparent: {header!r}"
    assert match[1] != "0" * 32 and match[2] != "0" * 16
    return match


def test_spans_and_a_traceparent_on_every_request(conn, rx, spans):
    setup(conn, rx, "/flaky?fail=1")
    own = {"source": "shop", "detail-type": "Order", "detail": {"n": 0}, "traceparent": OWN_PARENT}
    plain = [{"source": "shop", "detail-type": "Order", "detail": {"n": i}} for i in (1, 2, 3)]
    publish(conn, "orders", [json.dumps(e) for e in [own, *plain]])
    report = run_worker("w1", until_idle=True, max_seconds=60)
    assert (report.delivered, report.failed) == (4, 0)

    finished = spans.get_finished_spans()
    [published] = [s for s in finished if s.name == "eventpush.publish"]
    delivers = [s for s in finished if s.name == "eventpush.deliver"]
    commits = [s for s in finished if s.name == "eventpush.commit"]
    assert published.attributes["eventpush.events"] == 4
    assert commits, "every commit has a span"

    requests = rx.state.requests  # 500 then 200 for each event: 8 requests
    assert len(requests) == 8
    headers = [valid(r.headers.get("traceparent")) for r in requests]
    # Each request is its own attempt span, and the receiver sees that span's ids.
    assert len(delivers) == 8
    by_span = {format(s.context.span_id, "016x"): s for s in delivers}
    for request, match in zip(requests, headers, strict=True):
        span = by_span[match[2]]
        assert int(match[3], 16) & 1 == 1  # sampled: the receiver's spans join a kept trace
        assert format(span.context.trace_id, "032x") == match[1]
        body = json.loads(request.body)
        attempt = 1 if request.headers["status"] == 500 else 2
        assert span.attributes["eventpush.attempt"] == attempt
        assert span.attributes["http.response.status_code"] == request.headers["status"]
        assert span.attributes["eventpush.runner"] == "orders/r/t"
        if body["detail"]["n"] == 0:  # published with a trace of its own: kept
            assert match[1] == OWN_TRACE
            assert format(span.parent.span_id, "016x") == "00f067aa0ba902b7"
        else:  # stamped at publish: the delivery joins the publish span's trace
            assert body["traceparent"].split("-")[1] == match[1]
            assert span.context.trace_id == published.context.trace_id
            assert span.parent.span_id == published.context.span_id


def test_tracing_off_still_sends_a_traceparent_and_keeps_an_events_trace(conn, rx, tracing_off):
    setup(conn, rx, "/ok")
    own = {"source": "shop", "detail-type": "Order", "detail": {"n": 0}, "traceparent": OWN_PARENT}
    plain = {"source": "shop", "detail-type": "Order", "detail": {"n": 1}}
    broken = {"source": "shop", "detail-type": "Order", "detail": {"n": 2}, "traceparent": "xyz"}
    publish(conn, "orders", [json.dumps(e) for e in (own, plain, broken)])
    assert not tracing.enabled()
    run_worker("w1", until_idle=True, max_seconds=60)
    requests = rx.state.requests
    assert len(requests) == 3
    for request in requests:
        match = valid(request.headers.get("traceparent"))
        assert int(match[3], 16) & 1 == 0  # not sampled: nothing is recorded
        body = json.loads(request.body)
        if body["detail"]["n"] == 0:
            assert match[1] == OWN_TRACE
        else:  # nothing stamped with tracing off; an invalid traceparent starts a new trace
            assert match[1] != OWN_TRACE
            assert body.get("traceparent") in (None, "xyz")


def test_unrecorded_traceparent_ids_are_random_and_never_zero(monkeypatch):
    own = {"traceparent": OWN_PARENT}
    drawn = {valid(tracing.unrecorded_traceparent({}))[2] for _ in range(100)}
    assert len(drawn) == 100  # a new span id every attempt
    kept = valid(tracing.unrecorded_traceparent(own))
    assert kept[1] == OWN_TRACE and kept[2] != OWN_PARENT.split("-")[2] and kept[3] == "00"
    # W3C forbids all-zero ids: a draw of zeros (one in 2**64 or 2**128) still gives valid ones.
    monkeypatch.setattr(tracing, "_randbytes", bytes)
    for event in ({}, own, {"traceparent": "xyz"}, "not a dict"):
        valid(tracing.unrecorded_traceparent(event))


def test_a_record_nothing_parsed_is_parsed_for_its_trace_only_when_its_text_names_one():
    from eventpush.sinks.contract import Record

    plain = json.dumps({"source": "s", "detail": {"n": 1}})
    record = Record(0, 0, "m0", None, plain)
    assert tracing.carrier(record) is None and record.parsed is None  # not parsed for it
    traced = Record(0, 1, "m1", None, json.dumps({"traceparent": OWN_PARENT, "source": "s"}))
    assert valid(tracing.unrecorded_traceparent(tracing.carrier(traced)))[1] == OWN_TRACE
    assert traced.parsed == {"traceparent": OWN_PARENT, "source": "s"}
    # Named inside the detail only: parsed, and no trace of its own at the top level.
    nested = Record(0, 2, "m2", None, json.dumps({"detail": {"traceparent": OWN_PARENT}}))
    assert valid(tracing.unrecorded_traceparent(tracing.carrier(nested)))[1] != OWN_TRACE
