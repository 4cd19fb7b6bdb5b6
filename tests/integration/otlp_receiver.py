"""A tiny in-test OTLP/gRPC trace receiver: the services export to it and the
test reads back which services produced spans in which trace."""
from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list[tuple[str, str, str]] = []   # (trace_id hex, service.name, span name)
        self.events: list[tuple[str, str, str, dict]] = []   # (trace_id hex, service.name, event name, attributes)
        self.attributes: list[tuple[str, str, str, dict]] = []   # (trace_id hex, service.name, span name, attributes)

    def Export(self, request, context):
        with self.lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans.append((span.trace_id.hex(), service, span.name))
                        self.attributes.append((span.trace_id.hex(), service, span.name, {
                            a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}))
                        for ev in span.events:
                            attrs = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in ev.attributes}
                            self.events.append((span.trace_id.hex(), service, ev.name, attrs))
        return trace_service_pb2.ExportTraceServiceResponse()

    def services_in(self, trace_id: str) -> set[str]:
        with self.lock:
            return {svc for tid, svc, _ in self.spans if tid == trace_id}

    def span_names(self, trace_id: str) -> set[tuple[str, str]]:
        with self.lock:
            return {(svc, name) for tid, svc, name in self.spans if tid == trace_id}

    def events_in(self, trace_id: str, name: str) -> list[tuple[str, dict]]:
        with self.lock:
            return [(svc, attrs) for tid, svc, n, attrs in self.events if tid == trace_id and n == name]

    def span_attributes(self, trace_id: str, service: str, name: str) -> list[dict]:
        with self.lock:
            return [a for tid, svc, n, a in self.attributes if (tid, svc, n) == (trace_id, service, name)]

    def wait_for(self, trace_id: str, services: set[str], timeout: float) -> set[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.services_in(trace_id)
            if services <= got:
                return got
            time.sleep(0.1)
        return self.services_in(trace_id)


def start_receiver(port: int) -> tuple[grpc.Server, Receiver]:
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, receiver
