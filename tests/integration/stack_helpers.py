"""Helpers of the integration tests. Test files import them from here: a
`from conftest import ...` is ambiguous once several conftest modules exist."""
from __future__ import annotations


from helpers.common import wait_until  # noqa: F401  (re-exported)
from kvpop.runtime.pb import compute_pb2

BLOCK_SIZE = 8


def stack_env(otlp_port: int) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "KVPOP_GRACE_S": "2",
    }


def compute_info(compute) -> compute_pb2.InfoResponse:
    return compute.Info(compute_pb2.InfoRequest(), timeout=5)


