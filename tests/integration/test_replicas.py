"""Two real compute replicas registered in a real Redis: least-loaded routing,
session affinity, and one replica killed mid-run (no request that had not
started streaming fails; the ones streaming from it get UNAVAILABLE; it is
out of the registry within one heartbeat interval)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid

import grpc
import pytest

from kvpop.launcher import free_port
from kvpop.paths import REPO_ROOT as REPO
from kvpop.pb import compute_pb2
from kvpop.redis_client import connect
from kvpop.registry import ReplicaRegistry
from services.gateway.routing import Router

HEARTBEAT_S = 1.0
pytestmark = pytest.mark.slow


class Replicas:
    def __init__(self, redis, tmp):
        self.redis = redis
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.addresses: dict[str, str] = {}

    def start(self, rid: str) -> None:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOP_", "OTEL_"))}
        env.update(KVPOP_COMPUTE_PORT=str(port), KVPOP_METRICS_PORT="-1", KVPOP_REDIS_URL=self.redis.url,
                   KVPOP_HEARTBEAT_S=str(HEARTBEAT_S), KVPOP_REPLICA_ID=rid, KVPOP_DEVICE="cpu",
                   KVPOP_MAX_MODEL_LEN="512", KVPOP_NUM_PAGES="4096", KVPOP_LOG_LEVEL="WARNING",
                   OTEL_TRACES_EXPORTER="none", PYTHONPATH=str(REPO))
        log = open(self.tmp / f"{rid}.log", "w")
        self.procs[rid] = subprocess.Popen([sys.executable, "-m", "services.compute"], env=env, cwd=REPO,
                                           stdout=log, stderr=subprocess.STDOUT)
        self.addresses[rid] = f"127.0.0.1:{port}"

    def kill(self, rid: str) -> None:
        self.procs[rid].send_signal(signal.SIGKILL)
        self.procs[rid].wait(10)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def request(max_tokens: int) -> compute_pb2.ComputeRequest:
    return compute_pb2.ComputeRequest(
        request_id=uuid.uuid4().hex, prompt="the sky is blue . the grass is green .",
        sampling=compute_pb2.Sampling(max_tokens=max_tokens, ignore_eos=True, top_p=1.0,
                                      repetition_penalty=1.0),
        eviction=compute_pb2.Eviction(policy="dense"))


async def wait_for(cond, timeout: float, what: str, step: float = 0.02) -> float:
    deadline = time.monotonic() + timeout
    while True:
        if await cond():
            return time.monotonic()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(step)


async def drain(stream) -> int:
    n = 0
    async for resp in stream:
        n += len(resp.response.chunk.token_ids)
    return n


def test_routing_affinity_and_a_replica_killed_mid_run(redis_server, tmp_path):
    reps = Replicas(redis_server, tmp_path)
    try:
        reps.start("r-a")
        reps.start("r-b")
        asyncio.run(_scenario(redis_server, reps))
    finally:
        reps.close()


async def _scenario(redis, reps: Replicas) -> None:
    client = connect(redis.url)
    registry = ReplicaRegistry(client, interval_s=HEARTBEAT_S)
    # The static address is a closed port: every request here must be routed by the registry.
    router = Router(f"127.0.0.1:{free_port()}", registry)

    async def ids():
        return {r.id for r in await registry.healthy_replicas()}

    async def both_up():
        for rid, p in reps.procs.items():
            if p.poll() is not None:
                raise AssertionError(f"{rid} exited:\n" + (reps.tmp / f"{rid}.log").read_text()[-2000:])
        return await ids() == {"r-a", "r-b"}
    await wait_for(both_up, 120, "both replicas to register")
    assert {r.address for r in await registry.healthy_replicas()} == set(reps.addresses.values())

    # Least loaded: concurrent streams spread over both replicas (the gateway's
    # own in-flight counts break the tie before any heartbeat reports load).
    streams = [router.open(request(48), timeout=60) for _ in range(4)]
    iters = [s.__aiter__() for s in streams]
    for it in iters:
        assert (await it.__anext__()).response.HasField("chunk")
    served = sorted(s.target.replica_id for s in streams)
    assert served == ["r-a", "r-a", "r-b", "r-b"]
    assert router.inflight == {"r-a": 2, "r-b": 2}
    await asyncio.gather(*(drain(it) for it in iters))
    assert not router.inflight

    # Affinity: a session stays on its replica even when the other is idle.
    for _ in range(2):
        s = router.open(request(4), timeout=60, session_replica="r-b")
        assert await drain(s) == 4 and s.target.replica_id == "r-b"

    # One long stream on each replica, then r-b dies mid-stream.
    on_a = router.open(request(400), timeout=120, session_replica="r-a")
    on_b = router.open(request(400), timeout=120, session_replica="r-b")
    it_a, it_b = on_a.__aiter__(), on_b.__aiter__()
    for it in (it_a, it_b):
        for _ in range(3):
            assert (await it.__anext__()).response.HasField("chunk")
    reps.kill("r-b")
    killed = time.monotonic()

    async def b_gone():
        return "r-b" not in await ids()
    # Watched from now on, beside the traffic below.
    gone = asyncio.create_task(wait_for(b_gone, 5 * HEARTBEAT_S, "r-b to leave the registry", step=0.01))
    # Requests that had not started: all succeed, some after being refused by r-b.
    fresh = [router.open(request(8), timeout=60) for _ in range(6)]
    fresh += [router.open(request(8), timeout=60, session_replica="r-b")]
    counts = await asyncio.gather(*(drain(s) for s in fresh))
    assert counts == [8] * len(fresh)
    assert {s.target.replica_id for s in fresh} == {"r-a"}
    # The stream that was on r-b fails with a clear UNAVAILABLE ...
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await drain(it_b)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # ... while the one on r-a finishes.
    assert 3 + await drain(it_a) == 400

    assert await gone - killed <= HEARTBEAT_S + 0.25
    assert (await router.pick(session_replica="r-b")).replica_id == "r-a"
    await router.close()
    await client.aclose()
