"""Which exporter the standard OTEL_* variables select, and W3C context round trips."""
from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from kvpop.runtime import telemetry
@pytest.mark.parametrize("env, want", [
    ({}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, []),
    ({"OTEL_TRACES_EXPORTER": "console"}, ["console"]),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ["otlp", "console"]),
])
def test_exporter_selection(monkeypatch, env, want):
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert telemetry._exporters() == want


def test_traceparent_round_trip():
    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("parent") as span:
        carrier = telemetry.inject()
    assert carrier["traceparent"].split("-")[1] == format(span.get_span_context().trace_id, "032x")
    ctx = telemetry.extract(carrier)
    assert trace.get_current_span(ctx).get_span_context().trace_id == span.get_span_context().trace_id
