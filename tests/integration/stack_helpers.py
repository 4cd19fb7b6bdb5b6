"""Helpers of the integration tests. Test files import them from here: a
`from conftest import ...` is ambiguous once several conftest modules exist."""
from __future__ import annotations

import time

from kvpop.pb import compute_pb2

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


def wait_until(cond, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
