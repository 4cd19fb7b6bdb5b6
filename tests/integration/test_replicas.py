"""Two real compute replicas registered in a real Redis: least-loaded routing,
session affinity, and one replica killed mid-run (no request that had not
started streaming fails; the ones streaming from it get UNAVAILABLE; it is
out of the registry within one heartbeat interval)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import uuid

import grpc
import pytest
import redis as redis_sync

from kvpop.stack.up import free_port
from kvpop.runtime.paths import REPO_ROOT as REPO
from kvpop.runtime.pb import compute_pb2
from kvpop.runtime.redis_client import connect
from kvpop.runtime.replica_registry import ReplicaRegistry
from services.gateway.routing import Router
from helpers.common import stop_processes, wait_until

HEARTBEAT_S = 1.0
pytestmark = pytest.mark.slow


class Replicas:
    def __init__(self, redis, tmp):
        self.redis = redis
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.addresses: dict[str, str] = {}

    def start(self, rid: str, **extra_env: str) -> None:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOP_", "OTEL_"))}
        env.update(KVPOP_COMPUTE_PORT=str(port), KVPOP_METRICS_PORT="-1", KVPOP_REDIS_URL=self.redis.url,
                   KVPOP_HEARTBEAT_S=str(HEARTBEAT_S), KVPOP_REPLICA_ID=rid, KVPOP_DEVICE="cpu",
                   KVPOP_MAX_MODEL_LEN="512", KVPOP_NUM_PAGES="4096", KVPOP_LOG_LEVEL="WARNING",
                   KVPOP_GRACE_S="30", OTEL_TRACES_EXPORTER="none", PYTHONPATH=str(REPO))
        env.update(extra_env)
        log = open(self.tmp / f"{rid}.log", "w")
        self.procs[rid] = subprocess.Popen([sys.executable, "-m", "services.compute"], env=env, cwd=REPO,
                                           stdout=log, stderr=subprocess.STDOUT)
        self.addresses[rid] = f"127.0.0.1:{port}"

    def kill(self, rid: str) -> None:
        self.procs[rid].send_signal(signal.SIGKILL)
        self.procs[rid].wait(10)

    def close(self) -> None:
        stop_processes(self.procs.values())


def gateway_env(redis_url: str, gw_port: int, log_level: str = "WARNING") -> dict[str, str]:
    """A gateway routing over the Redis registry (its static compute address
    points nowhere, so only registered replicas can serve)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOP_", "OTEL_"))}
    env.update(KVPOP_GATEWAY_PORT=str(gw_port), KVPOP_METRICS_PORT="-1", KVPOP_REDIS_URL=redis_url,
               KVPOP_HEARTBEAT_S=str(HEARTBEAT_S), KVPOP_COMPUTE_ADDRESS=f"127.0.0.1:{free_port()}",
               KVPOP_DEFAULT_POLICY="dense", KVPOP_LOG_LEVEL=log_level, OTEL_TRACES_EXPORTER="none",
               PYTHONPATH=str(REPO))
    return env


def request(max_tokens: int) -> compute_pb2.ComputeRequest:
    return compute_pb2.ComputeRequest(
        request_id=uuid.uuid4().hex, prompt="the sky is blue . the grass is green .",
        sampling=compute_pb2.Sampling(max_tokens=max_tokens, ignore_eos=True, top_p=1.0,
                                      repetition_penalty=1.0),
        eviction=compute_pb2.Eviction(policy="dense"))


class OutageLog(logging.Handler):
    """Counts the router's "registry unavailable" warnings: one per Redis timeout paid."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        self.count += "registry unavailable" in record.getMessage()


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

    # Redis stops answering (frozen: it accepts connections and never replies, the
    # outage that costs a full timeout): routing goes on over the replicas seen
    # last, and only the first request pays the registry's timeout. The registry
    # would be asked on every request (refresh_s 0) but for the outage backoff,
    # which outlasts the three requests however slow the machine.
    router.refresh_s, router.outage_backoff_s = 0.0, 600.0
    router._fresh_until = 0.0        # the list read last is stale: the next request asks Redis
    outages = OutageLog()
    logging.getLogger("services.gateway.routing").addHandler(outages)
    redis.proc.send_signal(signal.SIGSTOP)
    try:
        for _ in range(3):
            s = router.open(request(2), timeout=60)
            assert await drain(s) == 2
    finally:
        redis.proc.send_signal(signal.SIGCONT)
        logging.getLogger("services.gateway.routing").removeHandler(outages)
    assert outages.count == 1, outages.count
    router.refresh_s, router.outage_backoff_s = registry.interval_s / 10, 1.0
    router._fresh_until = 0.0
    await wait_for(both_up, 30, "the replicas to heartbeat again after Redis resumed")

    # One long stream on each replica, then r-b dies mid-stream.
    on_a = router.open(request(400), timeout=120, session_replica="r-a")
    on_b = router.open(request(400), timeout=120, session_replica="r-b")
    it_a, it_b = on_a.__aiter__(), on_b.__aiter__()
    # A message may carry several tokens (the server batches when its loop lags),
    # so what was read before the kill is counted in tokens, not messages.
    read_a = 0
    for it in (it_a, it_b):
        for _ in range(3):
            msg = await it.__anext__()
            assert msg.response.HasField("chunk")
            if it is it_a:
                read_a += len(msg.response.chunk.token_ids)
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
    assert read_a + await drain(it_a) == 400

    assert await gone - killed <= HEARTBEAT_S + 0.25
    # The router lists replicas at most refresh_s late: from then on r-b is never chosen.
    async def routed_to_a():
        return (await router.pick(session_replica="r-b")).replica_id == "r-a"
    await wait_for(routed_to_a, router.refresh_s + 0.5, "the router to stop choosing r-b", step=0.01)
    assert (await router.pick(session_replica="r-b")).replica_id == "r-a"
    # Its channel is closed once the registry no longer lists it.
    assert reps.addresses["r-b"] not in router._channels and reps.addresses["r-a"] in router._channels

    # SIGTERM drains r-a: it leaves the registry at once (well before its
    # entry could expire), and its in-flight stream still finishes.
    last = router.open(request(400), timeout=60)
    it = last.__aiter__()
    first = await it.__anext__()
    assert first.response.HasField("chunk")
    reps.procs["r-a"].send_signal(signal.SIGTERM)
    sent = time.monotonic()

    async def a_gone():
        return "r-a" not in await ids()
    assert await wait_for(a_gone, 5, "r-a to deregister", step=0.005) - sent < 0.3
    # A new request on r-a's still-open Serve stream is refused before anything
    # streams (UNAVAILABLE: a router moves it), while its in-flight one goes on.
    refused = router.open(request(4), timeout=10, pinned=router.target("r-a", reps.addresses["r-a"]))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await drain(refused)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
    assert len(first.response.chunk.token_ids) + await drain(it) == 400
    assert await asyncio.to_thread(reps.procs["r-a"].wait, 30) == 0
    await router.close()
    await client.aclose()


@contextlib.contextmanager
def sessions_stack(redis, tmp, model, gateway_extra: dict | None = None, **replica_env):
    """A gateway over the Redis registry and replica ``r-a`` on ``model``, both
    SERVING; yields (replicas, gateway address, Redis client, an in-process
    dense reference engine on the same model). Stops both at exit."""
    from services.compute.engine.engine import EngineConfig, LLMEngine

    reps = Replicas(redis, tmp)
    gw_port = free_port()
    env = {**gateway_env(redis.url, gw_port, log_level="INFO"), **(gateway_extra or {})}
    gw = None
    try:
        reps.start("r-a", KVPOP_MODEL_DIR=str(model), **replica_env)
        gw = subprocess.Popen([sys.executable, "-m", "services.gateway"], env=env, cwd=REPO,
                              stdout=open(tmp / "gateway.log", "w"), stderr=subprocess.STDOUT)
        address = f"127.0.0.1:{gw_port}"
        reference = LLMEngine(EngineConfig(str(model), max_model_len=512, max_num_seqs=1, prefix_cache_fraction=0))

        def up():
            assert gw.poll() is None, (tmp / "gateway.log").read_text()[-2000:]
            assert reps.procs["r-a"].poll() is None, (tmp / "r-a.log").read_text()[-2000:]
            return _serving(address) and _serving(reps.addresses["r-a"])
        wait_until(up, 120, "gateway and r-a SERVING")
        yield reps, address, redis_sync.Redis.from_url(redis.url, decode_responses=True), reference
    finally:
        if gw is not None and gw.poll() is None:
            gw.terminate()
            gw.wait(20)
        reps.close()


def _serving(address: str) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(address) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


def _finished(address: str) -> float:
    from kvpop.runtime.pb import compute_pb2_grpc
    with grpc.insecure_channel(address) as ch:
        info = compute_pb2_grpc.ComputeStub(ch).Info(compute_pb2.InfoRequest(), timeout=5)
    return info.stats.extra["finished_requests"]


def test_gateway_routes_sessions_counts_prefixes_and_survives_a_replica(redis_server, tmp_path):
    import json

    from kvpop.runtime.pb import generate_pb2, generate_pb2_grpc
    from kvpop.runtime.prewarm import PrewarmCounter

    reps = Replicas(redis_server, tmp_path)
    gw_port = free_port()
    env = gateway_env(redis_server.url, gw_port)
    gw = None
    try:
        reps.start("r-a")
        reps.start("r-b")
        gw = subprocess.Popen([sys.executable, "-m", "services.gateway"], env=env, cwd=REPO,
                              stdout=open(tmp_path / "gateway.log", "w"), stderr=subprocess.STDOUT)
        address = f"127.0.0.1:{gw_port}"
        deadline = time.monotonic() + 120
        while not (_serving(address) and all(_serving(a) for a in reps.addresses.values())):
            assert gw.poll() is None, (tmp_path / "gateway.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "stack not SERVING"
            time.sleep(0.2)
        r = redis_server.url
        import redis as redis_sync
        rc = redis_sync.Redis.from_url(r, decode_responses=True)
        deadline = time.monotonic() + 10
        while len(rc.smembers("kvpop:v1:replicas")) < 2:
            assert time.monotonic() < deadline, "replicas not registered"
            time.sleep(0.05)

        with grpc.insecure_channel(address) as ch:
            stub = generate_pb2_grpc.KVpopStub(ch)

            def gen(prompt, n, **kw):
                return generate_pb2.GenerateRequest(prompt=prompt, max_tokens=n, ignore_eos=True, **kw)

            # A session stays on one replica across turns.
            before = {rid: _finished(a) for rid, a in reps.addresses.items()}
            for turn in range(3):
                out = list(stub.Generate(gen(f"turn {turn} of the chat", 4, session_id="s1"), timeout=60))
                assert out[-1].finished.usage.completion_tokens == 4
                # The turn is stored before the next one picks its replica.
                deadline = time.monotonic() + 5
                while json.loads(rc.get("kvpop:v1:session:s1") or "{}").get("turns", 0) < turn + 1:
                    assert time.monotonic() < deadline, "session turn not stored"
                    time.sleep(0.02)
            home = json.loads(rc.get("kvpop:v1:session:s1"))["replica"]
            other = ({"r-a", "r-b"} - {home}).pop()
            assert _finished(reps.addresses[home]) - before[home] == 3
            assert _finished(reps.addresses[other]) == before[other]

            # The gateway counts prompt prefixes for prewarm.
            system = "You are a terse assistant. Answer with one number. " * 4
            for i in range(5):
                list(stub.Generate(gen(system + f"question {i}: what is {i} + {i}?", 2), timeout=60))

            async def top():
                from kvpop.runtime.redis_client import connect as aconnect
                c = aconnect(redis_server.url)
                try:
                    return await PrewarmCounter(c).top_entries(1)
                finally:
                    await c.aclose()
            deadline = time.monotonic() + 5
            while not (entries := asyncio.run(top())) or entries[0].count < 5:
                assert time.monotonic() < deadline, entries
                time.sleep(0.05)
            assert entries[0].text == system[:128]

            # The session's replica dies while streaming to it.
            it = iter(stub.Generate(gen("a long answer", 400, session_id="s1"), timeout=120))
            for _ in range(3):
                assert next(it).HasField("chunk")
            reps.kill(home)
            with pytest.raises(grpc.RpcError) as e:
                for _ in it:
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            # Requests that had not started all succeed, the session's next turn too.
            for i in range(6):
                out = list(stub.Generate(gen(f"after the crash {i}", 8), timeout=60))
                assert out[-1].finished.usage.completion_tokens == 8
            out = list(stub.Generate(gen("the next turn", 8, session_id="s1"), timeout=60))
            assert out[-1].finished.usage.completion_tokens == 8
    finally:
        if gw is not None and gw.poll() is None:
            gw.terminate()
            gw.wait(20)
        reps.close()
