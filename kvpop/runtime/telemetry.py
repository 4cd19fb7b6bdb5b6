"""OpenTelemetry setup shared by the services.

Tracing is configured by the standard variables: spans go to OTLP/gRPC when
`OTEL_TRACES_EXPORTER` names `otlp` or, if that is unset, when
`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set
(the exporter reads endpoint, headers, insecure, timeout itself);
`OTEL_TRACES_EXPORTER=console` prints them; `none` or nothing set: spans are
created (context still propagates) but not exported. `OTEL_BSP_SCHEDULE_DELAY`
sets the batch delay. The resource's service.name is the service's own name.

Context crosses process boundaries in gRPC metadata (W3C `traceparent`) through
the interceptors below, and inside the cache-manager's bidi stream as a
`traceparent` field on each message (`inject` / `extract`).
"""
from __future__ import annotations

import logging
import os
from typing import Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

log = logging.getLogger(__name__)

_provider: TracerProvider | None = None


def _exporters() -> list[str]:
    names = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if names:
        return [n.strip() for n in names.split(",") if n.strip() and n.strip() != "none"]
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return ["otlp"]
    return []


def setup_tracing(service_name: str) -> TracerProvider:
    """Install the global tracer provider once per process; returns it."""
    global _provider
    if _provider is not None:
        return _provider
    resource = Resource.create({"service.name": service_name})
    provider = TracerProvider(resource=resource)
    for name in _exporters():
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:
            log.warning("OTEL_TRACES_EXPORTER=%s is not supported (otlp, console, none)", name)
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    """Flush pending spans (call on exit; the batch processor would lose them)."""
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


SERVE_METHOD = "/kvpop.compute.v1.Compute/Serve"


def server_interceptors() -> list:
    from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

    # compute's Serve carries many requests for as long as a gateway lives: each
    # request gets its own span there instead (services/compute/server.py).
    return [aio_server_interceptor(filter_=filters.negate(filters.any_of(
        filters.service_prefix("grpc.health"), filters.service_prefix("grpc.reflection"),
        filters.full_method_name(SERVE_METHOD))))]


def client_interceptors() -> list:
    from opentelemetry.instrumentation.grpc import aio_client_interceptors, filters

    # Health checks (the gateway probes compute several times a second) make no spans,
    # nor does the long-lived Serve stream (its requests carry their trace context).
    return list(aio_client_interceptors(filter_=filters.negate(filters.any_of(
        filters.service_prefix("grpc.health"), filters.full_method_name(SERVE_METHOD)))))


def inject(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """W3C headers (traceparent, tracestate) of `ctx` (default: the current one)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def extract(carrier: Mapping[str, str]) -> otel_context.Context:
    return propagate.extract(dict(carrier))
