"""Replica registry against a real redis-server: heartbeats, expiry, routing,
and a clear, quick error when Redis dies."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from kvpop.runtime.redis_client import RedisUnavailable, connect
from kvpop.runtime.replica_registry import (
    INDEX_KEY, Heartbeat, NoReplicaAvailable, Replica, ReplicaRegistry, replica_key,
)


def run(coro):
    return asyncio.run(coro)


async def ends_within(aw, timeout: float, what: str) -> asyncio.Task:
    """The task running `aw`, once done; a test failure (not a hang until
    pytest-timeout) if it is still running after `timeout` seconds."""
    task = asyncio.ensure_future(aw)
    await asyncio.wait({task}, timeout=timeout)
    if not task.done():
        task.cancel()
        pytest.fail(f"{what} still running after {timeout} s")
    return task


async def wait_for(predicate, timeout: float, step: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await predicate():
            return time.monotonic()
        await asyncio.sleep(step)
    raise AssertionError(f"condition not met within {timeout} s")


def test_register_is_plain_json_under_the_namespace(redis_server):
    async def go():
        client = connect(redis_server.url)
        reg = ReplicaRegistry(client, interval_s=5)
        await reg.register(Replica("c1", "10.0.0.1:50052", capacity=8, load=3, model="tiny"))
        raw = await client.get(replica_key("c1"))
        assert replica_key("c1") == "kvpop:v1:replica:c1"
        data = json.loads(raw)
        assert data["address"] == "10.0.0.1:50052" and data["capacity"] == 8 and data["load"] == 3
        assert await client.smembers(INDEX_KEY) == {"c1"}
        ttl_ms = await client.pttl(replica_key("c1"))
        assert 0 < ttl_ms <= 5000
        [r] = await reg.healthy_replicas()
        assert (r.id, r.model, r.utilisation) == ("c1", "tiny", 3 / 8)
        await client.aclose()
    run(go())


def test_pick_least_loaded_affinity_inflight_exclude(redis_server):
    async def go():
        client = connect(redis_server.url)
        reg = ReplicaRegistry(client, interval_s=5)
        with pytest.raises(NoReplicaAvailable):
            await reg.pick()
        await reg.register(Replica("a", "h:1", capacity=4, load=3))   # 0.75
        await reg.register(Replica("b", "h:2", capacity=16, load=8))  # 0.5
        await reg.register(Replica("c", "h:3", capacity=2, load=2))   # 1.0
        assert (await reg.pick()).id == "b"
        # The gateway's own open streams count before the next heartbeat shows them.
        assert (await reg.pick(inflight={"b": 6})).id == "a"
        assert (await reg.pick(session_affinity="c")).id == "c"
        # Affinity to a replica that is gone falls back to the least loaded.
        assert (await reg.pick(session_affinity="zzz")).id == "b"
        assert (await reg.pick(exclude={"b"})).id == "a"
        with pytest.raises(NoReplicaAvailable):
            await reg.pick(exclude={"a", "b", "c"})
        await reg.deregister("b")
        assert {r.id for r in await reg.healthy_replicas()} == {"a", "c"}
        await client.aclose()
    run(go())


def test_dead_replica_disappears_within_one_interval(redis_server):
    interval = 0.6

    async def go():
        client = connect(redis_server.url)
        reg = ReplicaRegistry(client, interval_s=interval)
        live = {"load": 1}
        hb_a = Heartbeat(reg, Replica("a", "h:1", capacity=4), load=lambda: live["load"]).start()
        hb_b = Heartbeat(reg, Replica("b", "h:2", capacity=4), load=lambda: 0).start()

        async def both():
            return {r.id for r in await reg.healthy_replicas()} == {"a", "b"}
        await wait_for(both, 2)
        # Stays registered across several TTLs while it keeps beating.
        await asyncio.sleep(interval * 2.5)
        assert await both()
        # Load reported through the heartbeat reaches the router.
        live["load"] = 4

        async def a_loaded():
            return any(r.id == "a" and r.load == 4 for r in await reg.healthy_replicas())
        await wait_for(a_loaded, interval)
        assert (await reg.pick()).id == "b"

        # "Kill" b: its heartbeat stops without deregistering (a crash). Its entry
        # expires on Redis's clock at most one interval after its last beat.
        await hb_b.stop(deregister=False)
        ttl_ms = await client.pttl(replica_key("b"))
        assert ttl_ms == -2 or 0 < ttl_ms <= interval * 1000, ttl_ms     # -2: already expired

        async def b_gone():
            return "b" not in {r.id for r in await reg.healthy_replicas()}
        await wait_for(b_gone, 30 * interval, step=0.01)
        assert (await reg.pick()).id == "a"
        assert "b" not in await client.smembers(INDEX_KEY)  # lazily pruned
        assert hb_a.failures == 0 and hb_a.beats >= 5
        await hb_a.stop()
        assert await reg.healthy_replicas() == []
        await client.aclose()
    run(go())


def test_malformed_entry_is_ignored(redis_server):
    async def go():
        client = connect(redis_server.url)
        reg = ReplicaRegistry(client, interval_s=5)
        await reg.register(Replica("good", "h:1"))
        await client.set(replica_key("bad"), "{not json", px=5000)
        await client.sadd(INDEX_KEY, "bad")
        assert [r.id for r in await reg.healthy_replicas()] == ["good"]
        await client.aclose()
    run(go())


def test_redis_killed_mid_use_raises_quickly_and_recovers(redis_server):
    async def go():
        client = connect(redis_server.url, timeout_s=0.5)
        reg = ReplicaRegistry(client, interval_s=0.6)
        hb = Heartbeat(reg, Replica("a", "h:1")).start()

        async def a_up():
            return bool(await reg.healthy_replicas())
        await wait_for(a_up, 2)
        redis_server.stop()
        t0 = time.monotonic()
        with pytest.raises(RedisUnavailable) as exc:
            await reg.pick()
        assert time.monotonic() - t0 < 3
        assert "redis unavailable" in str(exc.value)
        # The heartbeat task survives the outage (it counts failures) ...
        deadline = time.monotonic() + 5
        while hb.failures == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert hb.failures > 0 and not hb._task.done()
        # ... and re-registers the replica once Redis is back.
        redis_server.start()
        await wait_for(a_up, 5)
        assert (await reg.pick()).id == "a"
        # The entry may be a stale one from the append-only file, so stop()
        # can land while the heartbeat is still reconnecting: it must end.
        task = hb._task
        await ends_within(hb.stop(), 3, "Heartbeat.stop() after a Redis restart")
        assert task.done() and await reg.healthy_replicas() == []
        await ends_within(client.aclose(), 3, "client.aclose()")
    run(go())


def test_stop_and_cancel_end_wherever_the_cancel_lands(redis_server):
    """redis-py writes each command under asyncio.wait_for, which on Python
    3.11 drops a cancel landing in the loop step where the write completes
    (CPython gh-86296). Cancel at every step of a beat / a pick on a fresh
    connection (connect, handshake, command): the task must end, cancelled."""
    async def go():
        stopped = []
        for k in range(40):
            client = connect(redis_server.url, timeout_s=0.5)
            reg = ReplicaRegistry(client, interval_s=0.6)
            hb = Heartbeat(reg, Replica("a", "h:1")).start()
            for _ in range(k):
                await asyncio.sleep(0)
            task = hb._task
            await ends_within(hb.stop(deregister=False), 3,
                              f"Heartbeat.stop() cancelling {k} loop steps into a beat")
            assert task.done()
            stopped.append((k, hb, hb.beats + hb.failures))
            await client.aclose()

            client = connect(redis_server.url, timeout_s=0.5)
            reg = ReplicaRegistry(client, interval_s=0.6)
            pick = asyncio.ensure_future(reg.pick())
            for _ in range(k):
                await asyncio.sleep(0)
            if pick.cancel():
                await ends_within(pick, 3, f"pick() cancelled {k} loop steps in")
                assert pick.cancelled(), f"pick() cancelled {k} loop steps in ran on to {pick!r}"
            await client.aclose()
        await asyncio.sleep(0.3)   # more than one heartbeat period
        assert [(k, hb.beats + hb.failures) for k, hb, _ in stopped] == [(k, n) for k, _, n in stopped]
    run(go())


def test_registry_call_has_a_deadline(redis_server):
    """Whatever a Redis call waits on, it ends within op_timeout_s."""
    import signal

    async def go():
        client = connect(redis_server.url, timeout_s=5)
        reg = ReplicaRegistry(client, interval_s=5, op_timeout_s=0.3)
        await reg.register(Replica("a", "h:1"))
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(RedisUnavailable, match="no answer within 0.3 s"):
                await reg.pick()
            assert time.monotonic() - t0 < 1.5
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        # The connection that timed out is not handed out half-read.
        assert (await reg.pick()).id == "a"
        await client.aclose()
    run(go())


def test_frozen_redis_times_out_instead_of_hanging(redis_server):
    """A Redis that accepts connections but never answers (SIGSTOP) must
    still give the caller an error within the socket timeouts."""
    import signal

    async def go():
        client = connect(redis_server.url, timeout_s=0.3)
        reg = ReplicaRegistry(client, interval_s=5)
        await reg.register(Replica("a", "h:1"))
        redis_server.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(RedisUnavailable):
                await reg.pick()
            # 0.3 s per try, 3 tries, short backoff.
            assert time.monotonic() - t0 < 2.5
        finally:
            redis_server.proc.send_signal(signal.SIGCONT)
        await client.aclose()
    run(go())
