"""A second gateway process in front of the shared test stack's compute and
Redis, started the way a deployment starts one (its own KVPOP_* settings:
API keys, public TLS, limits), and a client of it that knows only what
server reflection tells it."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.common import stop_processes
from kvpop.stack.up import free_port
from kvpop.runtime.paths import REPO_ROOT
from kvpop.runtime.security import ENV_TOKEN_FILE


class PublicGateway:
    def __init__(self, stack, tmp: Path, env: dict[str, str], otlp_port: int | None = None):
        self.port, self.metrics_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOP_", "OTEL_"))}
        base.update(PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", KVPOP_GRACE_S="2",
                    KVPOP_GATEWAY_PORT=str(self.port), KVPOP_METRICS_PORT=str(self.metrics_port),
                    KVPOP_COMPUTE_ADDRESS=stack.proc("compute").address, KVPOP_REDIS_URL=stack.redis_url,
                    OTEL_TRACES_EXPORTER="none")
        base[ENV_TOKEN_FILE] = stack.token_file         # to reach compute
        if otlp_port is not None:
            base.update(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{otlp_port}",
                        OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_BSP_SCHEDULE_DELAY="200")
        self.log = tmp / f"gateway-{self.port}.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "services.gateway"], env={**base, **env}, cwd=REPO_ROOT,
                                     stdout=open(self.log, "w"), stderr=subprocess.STDOUT)

    def wait_serving(self, channel: grpc.Channel, timeout: float = 60) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"gateway exited:\n{self.log.read_text()[-3000:]}"
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"gateway not SERVING:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.1)

    def metrics(self) -> str:
        import urllib.request
        return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()

    def stop(self) -> None:
        stop_processes([self.proc])


def reflected_generate(channel: grpc.Channel, fields: dict, metadata=(), timeout: float = 60) -> list[dict]:
    """Call kvpop.v1.KVpop/Generate knowing nothing but the server's reflection
    (as grpcurl does): the request and response types come from the server."""
    from google.protobuf import descriptor_pool, json_format, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
    method = pool.FindServiceByName("kvpop.v1.KVpop").FindMethodByName("Generate")
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    call = channel.unary_stream("/kvpop.v1.KVpop/Generate", request_serializer=request_cls.SerializeToString,
                                response_deserializer=response_cls.FromString)
    return [json_format.MessageToDict(r) for r in call(request_cls(**fields), metadata=metadata, timeout=timeout)]


_BURST = r"""
import json, os, queue, sys, threading
import grpc
from kvpop.runtime.pb import generate_pb2, generate_pb2_grpc
os.nice(10)     # the load generator's own CPU is not the server's: on a shared test box it yields
address, key, width, n, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
lock, seen, commands = threading.Lock(), {"served": 0, "refused": {}}, queue.Queue()
threading.Thread(target=lambda: ([commands.put(c.strip()) for c in sys.stdin], commands.put("stop")),
                 daemon=True).start()
md = (("authorization", "Bearer " + key),)
req = generate_pb2.GenerateRequest(prompt="burst", max_tokens=n, ignore_eos=True, policy="dense")
with grpc.insecure_channel(address) as ch:
    stub = generate_pb2_grpc.KVpopStub(ch)
    def one():
        try:
            list(stub.Generate(req, metadata=md, timeout=60))
            with lock:
                seen["served"] += 1
        except grpc.RpcError as e:
            with lock:
                k = e.code().name + ": " + e.details()
                seen["refused"][k] = seen["refused"].get(k, 0) + 1
    running = False
    while True:
        try:
            command = commands.get(timeout=every) if running else commands.get()
        except queue.Empty:
            command = None
        if command == "stop":
            break
        if command in ("pause", "go"):
            running = command == "go"
            print(command, flush=True)      # between rounds: none of ours is in flight when paused
        if running:
            ts = [threading.Thread(target=one) for _ in range(width)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
print(json.dumps(seen), flush=True)
"""


class Burst:
    """Another process sending bursts of `width` concurrent Generate calls
    with `key`, the next `every` seconds after the last one ended, while
    going (`go()`; `pause()` returns once its last burst ended). stop():
    {"served": n, "refused": {status: n}}."""

    def __init__(self, address: str, key: str, width: int = 16, max_tokens: int = 32, every: float = 0.2):
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", _BURST, address, key, str(width), str(max_tokens),
                                      str(every)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=REPO_ROOT)

    def _say(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == command, f"the burst process did not {command}"

    def pause(self) -> None:
        self._say("pause")

    def go(self) -> None:
        self._say("go")

    def stop(self) -> dict:
        import json
        out, _ = self.proc.communicate(timeout=90)
        return json.loads(out.strip().splitlines()[-1])
