"""One real stack per test session: redis + cache-manager + compute + gateway
as subprocesses on free ports, started by the same code as `kvpop up` (its
internal token included), on the embedded (placeholder) model, exporting
traces to an in-test OTLP receiver. Unsupervised: these tests stop and
restart services by hand (tests/reliability runs the supervised `kvpop up`)."""
from __future__ import annotations

import grpc
import pytest

from kvpop.stack.up import Stack, free_port, start_stack
from kvpop.stack.down import stop_stack
from kvpop.runtime.pb import compute_pb2_grpc, generate_pb2_grpc
from kvpop.runtime.security import sync_channel
from .otlp_receiver import start_receiver
from .stack_helpers import BLOCK_SIZE, stack_env



@pytest.fixture(scope="session")
def otlp():
    server, receiver = start_receiver(port := free_port())
    receiver.port = port
    yield receiver
    server.stop(0)


@pytest.fixture(scope="session")
def placeholder_model(tmp_path_factory):
    # These tests rely on the placeholder's byte-level tokenizer (any text is
    # valid, one token per byte); models/default is the trained task model.
    from kvpop.models.default_model import build_placeholder
    return build_placeholder(tmp_path_factory.mktemp("placeholder-model"), seed=0)


@pytest.fixture(scope="session")
def stack(tmp_path_factory, otlp, placeholder_model) -> Stack:
    env = stack_env(otlp.port)
    st = start_stack(tmp_path_factory.mktemp("kvpop-stack"), model=str(placeholder_model), env=env, timeout=120,
                     service_args={"compute": ["--block-size", str(BLOCK_SIZE), "--device", "cpu",
                                               "--num-pages", "8192"]}, supervise=False)
    yield st
    stop_stack(st, grace=10)


@pytest.fixture(scope="session")
def gateway(stack):
    with grpc.insecure_channel(stack.gateway) as ch:
        yield generate_pb2_grpc.KVpopStub(ch)


@pytest.fixture(scope="session")
def compute(stack):
    # The stack's internal token: compute refuses calls without it.
    with sync_channel(stack.proc("compute").address, stack.security()) as ch:
        yield compute_pb2_grpc.ComputeStub(ch)
