"""Every malformed request gets its documented status and a clear message; a
good request streaming alongside gets exactly the tokens it gets alone."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .stack_helpers import compute_info, wait_until
from kvpop.stack.up import free_port
from kvpop.runtime.paths import REPO_ROOT
from kvpop.runtime.pb import generate_pb2, generate_pb2_grpc

IA, RE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
P = "Count: one two three"
NAN = float("nan")

# (fields, status, words the message must contain)
BAD = [
    (dict(prompt=""), IA, "prompt must not be empty"),
    (dict(max_tokens=-1), IA, "max_tokens must be in [1, 4096], got -1"),
    (dict(max_tokens=0), IA, "max_tokens"),
    (dict(max_tokens=2_000_000_000), RE, "KVPOP_MAX_TOKENS_LIMIT"),
    (dict(temperature=-0.5), IA, "temperature must be in [0, 100]"),
    (dict(temperature=NAN), IA, "temperature"),
    (dict(top_p=0.0), IA, "top_p must be in (0, 1]"),
    (dict(top_p=1.5), IA, "top_p"),
    (dict(top_k=-3), IA, "top_k must be >= 0"),
    (dict(repetition_penalty=0.0), IA, "repetition_penalty"),
    (dict(policy="nope"), IA, "unknown policy 'nope'"),
    (dict(policy="h2o", budget_tokens=0), IA, "budget_tokens must be in [1, "),
    (dict(policy="h2o", budget_tokens=10**8), IA, "budget_tokens"),
    (dict(policy="h2o", budget_fraction=0.0), IA, "budget_fraction must be in (0, 1]"),
    (dict(policy="h2o", budget_fraction=1.5), IA, "budget_fraction"),
    (dict(policy="h2o", budget_fraction=NAN), IA, "budget_fraction"),
    # Passes the gateway, refused by the engine: below sink + recent + 1 block.
    (dict(policy="h2o", budget_tokens=8), IA, "too small"),
    (dict(stop=["x"] * 9), IA, "at most 8 stop strings"),
    (dict(stop=[""]), IA, "stop string"),
    (dict(session_id="bad id with spaces"), IA, "session_id"),
    (dict(request_id="x" * 200), IA, "request_id"),
    (dict(prompt="a" * 70_000), RE, "KVPOP_MAX_PROMPT_CHARS"),
    # Chats: the placeholder has no chat template.
    (dict(messages=[generate_pb2.ChatMessage(role="user", content="hi")]), IA,
     "set either prompt or messages, not both"),
    (dict(prompt="", messages=[generate_pb2.ChatMessage(role="user", content="hi")]), IA, "has no chat template"),
    (dict(prompt="a" * 5_000_000), RE, ""),          # over the 4 MiB message limit (gRPC itself)
    (dict(prompt="a" * 5000), RE, "max length"),     # more tokens than the model's max length
]


def _fields(kw):
    kw = dict(kw)
    kw.setdefault("prompt", P)
    return generate_pb2.GenerateRequest(**kw)


def _status(gateway, req, timeout=30):
    try:
        for _ in gateway.Generate(req, timeout=timeout):
            pass
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


GOOD = generate_pb2.GenerateRequest(prompt="Alongside: the good request.", max_tokens=800, ignore_eos=True,
                                    policy="h2o", budget_tokens=64)


def _tokens(gateway, req=GOOD):
    ids = []
    for r in gateway.Generate(req, timeout=120):
        ids.extend(r.chunk.token_ids)
    return ids


def test_bad_requests_get_clear_statuses_and_a_good_one_is_unaffected(gateway, compute):
    alone = _tokens(gateway)
    assert len(alone) == 800
    result: dict = {}

    def good():
        ids = []
        for r in gateway.Generate(GOOD, timeout=120):
            ids.extend(r.chunk.token_ids)
            result.setdefault("first", time.monotonic())
        result["ids"], result["end"] = ids, time.monotonic()

    t = threading.Thread(target=good)
    t.start()
    wait_until(lambda: "first" in result, 30, "the good stream to start")
    failures = []
    for kw, code, words in BAD:
        got, details = _status(gateway, _fields(kw))
        if got != code or words not in details:
            failures.append(f"{ {k: (v[:20] + '...' if isinstance(v, str) and len(v) > 20 else v) for k, v in kw.items()} }: "
                            f"{got.name} {details!r}, want {code.name} containing {words!r}")
        assert "Traceback" not in details
    bad_done = time.monotonic()
    t.join(120)
    assert not failures, "\n".join(failures)
    assert result["ids"] == alone, "the good stream changed while bad requests were refused"
    assert result["end"] > bad_done, "the good stream should still run while the bad ones are refused"
    assert compute_info(compute).stats.running == 0


def test_deadline_propagates_and_frees_the_sequence(gateway, compute):
    req = generate_pb2.GenerateRequest(prompt=P, max_tokens=3000, ignore_eos=True, policy="dense")
    code, _ = _status(gateway, req, timeout=0.5)
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: compute_info(compute).stats.running == 0, 10, "compute to drop the sequence")


def test_compute_down_is_unavailable(tmp_path):
    port, dead = free_port(), free_port()
    log = open(tmp_path / "gateway.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.gateway", "--port", str(port),
                             "--compute-address", f"127.0.0.1:{dead}"], cwd=REPO_ROOT, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)

            def listening():
                try:
                    return health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                except grpc.RpcError:
                    return None
            status = wait_until(listening, 30, "the gateway to listen", interval=0.1)
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING, "no compute: not ready"
            code, details = _status(generate_pb2_grpc.KVpopStub(ch), _fields({}), timeout=10)
            assert code == grpc.StatusCode.UNAVAILABLE and f"127.0.0.1:{dead}" in details, details
    finally:
        proc.terminate()
        assert proc.wait(15) == 0, (tmp_path / "gateway.log").read_text()
