"""Resource limits of the public API, set by configuration: prompt length,
max_tokens and concurrent streams per client are refused beyond their limit
with RESOURCE_EXHAUSTED and a message naming the setting. A second gateway
with small limits runs in front of the suite's compute."""
from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .reliability_stack import clean_env, collect, request, tls_env, wait_until
from kvpop.stack.up import free_port
from kvpop.runtime.paths import REPO_ROOT
from kvpop.runtime.pb import generate_pb2_grpc

RE = grpc.StatusCode.RESOURCE_EXHAUSTED
MAX_CHARS, MAX_TOKENS, MAX_STREAMS = 300, 1000, 2


@pytest.fixture(scope="module")
def limited(secure_stack, tmp_path_factory):
    port = free_port()
    env = {**clean_env(), **tls_env(secure_stack.pki, "client"), "KVPOP_GATEWAY_PORT": str(port),
           "KVPOP_METRICS_PORT": "-1", "KVPOP_COMPUTE_ADDRESS": secure_stack.stack.proc("compute").address,
           "KVPOP_MAX_PROMPT_CHARS": str(MAX_CHARS), "KVPOP_MAX_TOKENS_LIMIT": str(MAX_TOKENS),
           "KVPOP_MAX_STREAMS_PER_CLIENT": str(MAX_STREAMS), "KVPOP_DEFAULT_MAX_TOKENS": "8"}
    log = tmp_path_factory.mktemp("limited-gateway") / "gateway.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "services.gateway"], env=env, cwd=REPO_ROOT,
                                stdout=f, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"

    def serving():
        assert proc.poll() is None, log.read_text()[-3000:]
        with grpc.insecure_channel(address) as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError:
                return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    try:
        wait_until(serving, 90, "the limited gateway to serve", interval=0.2)
        yield address
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, log.read_text()[-3000:]


def status(stub, req, metadata=()):
    try:
        _, _, final = collect(stub.Generate(req, timeout=120, metadata=metadata))
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    assert final is not None
    return grpc.StatusCode.OK, ""


def test_prompt_length_and_max_tokens_limits(limited, gateway):
    with grpc.insecure_channel(limited) as ch:
        stub = generate_pb2_grpc.KVpopStub(ch)
        assert status(stub, request(prompt="p" * MAX_CHARS, max_tokens=2, policy="dense"))[0] == grpc.StatusCode.OK
        code, details = status(stub, request(prompt="p" * (MAX_CHARS + 1), max_tokens=2, policy="dense"))
        assert code == RE and "KVPOP_MAX_PROMPT_CHARS" in details and str(MAX_CHARS) in details, details
        code, details = status(stub, request(max_tokens=MAX_TOKENS + 1, policy="dense"))
        assert code == RE and "KVPOP_MAX_TOKENS_LIMIT" in details and str(MAX_TOKENS) in details, details
        code, details = status(stub, request(max_tokens=2**31 - 1, policy="dense"))
        assert code == RE and "KVPOP_MAX_TOKENS_LIMIT" in details, details
    # Within the character limit but more tokens than the model's max length (the suite's compute: 1024).
    code, details = status(gateway, request(prompt="t" * 2000, max_tokens=2, policy="dense"))
    assert code == RE and "max length" in details, details


def test_concurrent_streams_per_client(limited, secure_stack):
    # Separate connections from one host: still one client (its IP address).
    channels = [grpc.insecure_channel(limited) for _ in range(MAX_STREAMS + 1)]
    stubs = [generate_pb2_grpc.KVpopStub(ch) for ch in channels]
    held = []
    try:
        for stub in stubs[:MAX_STREAMS]:
            # max_tokens at its limit is accepted: the stream starts.
            call = stub.Generate(request(max_tokens=MAX_TOKENS, ignore_eos=True, policy="dense"), timeout=120)
            assert next(call).HasField("chunk")
            held.append(call)
        code, details = status(stubs[-1], request(max_tokens=4, policy="dense"))
        assert code == RE and "KVPOP_MAX_STREAMS_PER_CLIENT" in details and str(MAX_STREAMS) in details, details
        # Clients named by x-client-id have their own allowance ...
        md = (("x-client-id", "tenant-7"),)
        assert status(stubs[-1], request(max_tokens=4, policy="dense"), md)[0] == grpc.StatusCode.OK
        # ... and a malformed name is refused, not counted.
        code, details = status(stubs[-1], request(max_tokens=4, policy="dense"), (("x-client-id", "a b"),))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "x-client-id" in details, details
        # A cancelled stream gives its slot back.
        held.pop(0).cancel()
        wait_until(lambda: status(stubs[-1], request(max_tokens=4, policy="dense"))[0] == grpc.StatusCode.OK,
                   30, "the cancelled stream's slot to be free", interval=0.1)
        assert all(h.is_active() for h in held), "the limit must not touch streams already running"
    finally:
        for h in held:
            h.cancel()
        for ch in channels:
            ch.close()
    wait_until(lambda: secure_stack.compute_info().stats.running == 0, 30, "compute to drop the cancelled streams")
