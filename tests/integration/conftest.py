"""One real stack per test session: redis + cache-manager + compute + gateway
as subprocesses on free ports, started by the same code as `kvpop up`, on the
embedded (placeholder) model, exporting traces to an in-test OTLP receiver."""
from __future__ import annotations

import time

import grpc
import pytest

from kvpop.launcher import Stack, free_port, start_stack
from kvpop.launcher_down import stop_stack
from kvpop.pb import compute_pb2, compute_pb2_grpc, generate_pb2_grpc
from otlp_receiver import start_receiver

BLOCK_SIZE = 8


@pytest.fixture(scope="session")
def otlp():
    server, receiver = start_receiver(port := free_port())
    receiver.port = port
    yield receiver
    server.stop(0)


def stack_env(otlp_port: int) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "KVPOP_GRACE_S": "2",
    }


@pytest.fixture(scope="session")
def stack(tmp_path_factory, otlp) -> Stack:
    env = stack_env(otlp.port)
    st = start_stack(tmp_path_factory.mktemp("kvpop-stack"), env=env, timeout=120,
                     service_args={"compute": ["--block-size", str(BLOCK_SIZE), "--device", "cpu",
                                               "--num-pages", "8192"]})
    yield st
    stop_stack(st, grace=10)


@pytest.fixture(scope="session")
def gateway(stack):
    with grpc.insecure_channel(stack.gateway) as ch:
        yield generate_pb2_grpc.KVpopStub(ch)


@pytest.fixture(scope="session")
def compute(stack):
    with grpc.insecure_channel(stack.proc("compute").address) as ch:
        yield compute_pb2_grpc.ComputeStub(ch)


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
