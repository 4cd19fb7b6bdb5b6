"""Compute replica registry in Redis: replicas heartbeat, the gateway picks.

Keys (all JSON, all under `kvpop:v1:`):

- `kvpop:v1:replica:<id>` — string, JSON object
  `{"id", "address", "capacity", "load", "model", "started_at", "updated_at"}`
  (`load`: sequences running + waiting on the replica; `capacity`: its
  `max_num_seqs`; times are Unix seconds). Written with a TTL of
  `interval_s`, so a replica that stops heartbeating disappears from Redis
  (Redis's own clock, no cross-host skew) at most `interval_s` after its last
  beat. Heartbeats go out every `interval_s / 3`, so one lost beat is harmless.
- `kvpop:v1:replicas` — set of replica ids; an id whose key has expired is
  dropped from it lazily by the next reader.

`pick()` returns the healthy replica with the lowest load / capacity, after
adding the caller's own in-flight streams per replica (a heartbeat is up to
`interval_s / 3` old, and a burst of requests must not all land on one
replica). A session sticks to its replica while that replica is healthy.

Every Redis call here ends within `op_timeout_s` (RedisUnavailable if Redis
has not answered by then), and a cancelled caller always gets CancelledError:
a Redis restart must cost the gateway and the replicas an error, never a hang.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable, Mapping

import redis.asyncio as aioredis

from kvpop.runtime.redis_client import KEY_PREFIX, deadline_s, unavailable_as

log = logging.getLogger(__name__)

INDEX_KEY = KEY_PREFIX + "replicas"
DEFAULT_INTERVAL_S = 3.0


def replica_key(replica_id: str) -> str:
    return f"{KEY_PREFIX}replica:{replica_id}"


@dataclass
class Replica:
    id: str
    address: str
    capacity: int = 1
    load: int = 0
    model: str = ""
    started_at: float = field(default_factory=time.time)
    updated_at: float = 0.0

    @property
    def utilisation(self) -> float:
        return self.load / max(1, self.capacity)


class NoReplicaAvailable(LookupError):
    """No compute replica has heartbeated within the last interval."""


class ReplicaRegistry:
    def __init__(self, client: aioredis.Redis, interval_s: float = DEFAULT_INTERVAL_S,
                 op_timeout_s: float | None = None):
        """op_timeout_s: the most one registry call may take; by default what
        the client's own timeouts and retries add up to."""
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        self.redis = client
        self.interval_s = interval_s
        self.op_timeout_s = op_timeout_s if op_timeout_s is not None else deadline_s(client)
        if self.op_timeout_s <= 0:
            raise ValueError("op_timeout_s must be > 0")

    async def register(self, replica: Replica) -> None:
        """Write (or refresh) the replica's entry with a TTL of one interval."""
        replica.updated_at = time.time()
        async with unavailable_as("registering replica", self.op_timeout_s):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(replica_key(replica.id), json.dumps(asdict(replica)),
                         px=int(self.interval_s * 1000))
                pipe.sadd(INDEX_KEY, replica.id)
                await pipe.execute()

    async def deregister(self, replica_id: str) -> None:
        """Drop the replica now (draining on SIGTERM), not one interval later."""
        async with unavailable_as("deregistering replica", self.op_timeout_s):
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(replica_key(replica_id))
                pipe.srem(INDEX_KEY, replica_id)
                await pipe.execute()

    async def healthy_replicas(self) -> list[Replica]:
        async with unavailable_as("listing replicas", self.op_timeout_s):
            ids = sorted(await self.redis.smembers(INDEX_KEY))
            if not ids:
                return []
            values = await self.redis.mget([replica_key(i) for i in ids])
            gone = [i for i, v in zip(ids, values) if v is None]
            if gone:
                await self.redis.srem(INDEX_KEY, *gone)
        replicas = []
        for v in values:
            if v is None:
                continue
            try:
                replicas.append(Replica(**json.loads(v)))
            except (ValueError, TypeError) as e:
                # A foreign or corrupt entry must not break routing to the others.
                log.warning("ignoring malformed replica entry: %s", e)
        return replicas

    async def pick(self, session_affinity: str | None = None,
                   inflight: Mapping[str, int] | None = None,
                   exclude: frozenset[str] | set[str] = frozenset()) -> Replica:
        """The replica for the next request.

        session_affinity: id of the replica that holds the session's KV; it is
        returned if it is still healthy. inflight: streams this caller has open
        per replica id, added to the (older) heartbeat load. exclude: ids the
        caller just failed to reach. Raises NoReplicaAvailable or
        RedisUnavailable."""
        candidates = [r for r in await self.healthy_replicas() if r.id not in exclude]
        if not candidates:
            raise NoReplicaAvailable("no healthy compute replica registered")
        return choose(candidates, session_affinity, inflight)


def choose(candidates: list[Replica], session_affinity: str | None = None,
           inflight: Mapping[str, int] | None = None) -> Replica:
    """The session's replica if it is among `candidates`, else the least
    utilised one (heartbeat load plus the caller's in-flight streams, over
    capacity; ties by id so equal replicas fill in a stable order)."""
    for r in candidates:
        if r.id == session_affinity:
            return r
    inflight = inflight or {}
    return min(candidates, key=lambda r: ((r.load + inflight.get(r.id, 0)) / max(1, r.capacity), r.id))


class Heartbeat:
    """Keeps one replica registered while the owning event loop runs.

    `load` is called before each beat (e.g. running + waiting from
    `engine.stats()`). A beat that fails because Redis is down is logged and
    retried at the next period: the replica keeps serving its streams.
    `stop()` returns within about one registry call, wherever it lands."""

    def __init__(self, registry: ReplicaRegistry, replica: Replica,
                 load: Callable[[], int | Awaitable[int]] | None = None):
        self.registry = registry
        self.replica = replica
        self.load = load
        self.beats = 0
        self.failures = 0
        self.last_ok: bool | None = None     # whether the last beat reached Redis (None: none yet)
        self._task: asyncio.Task | None = None
        self._stopping = False

    async def beat(self) -> None:
        if self.load is not None:
            value = self.load()
            if asyncio.iscoroutine(value):
                value = await value
            self.replica.load = int(value)
        try:
            await self.registry.register(self.replica)
        except BaseException:
            self.last_ok = False
            raise
        self.last_ok = True
        self.beats += 1

    async def _run(self) -> None:
        period = self.registry.interval_s / 3
        while not self._stopping:
            started = time.monotonic()
            try:
                await self.beat()
            except Exception as e:  # noqa: BLE001 — never let the heartbeat task die
                self.failures += 1
                log.warning("replica heartbeat failed: %s", e)
            # A cancel swallowed by code outside the registry (a `load`
            # callable, a library) must still end the loop, not beat forever.
            if self._stopping:
                return
            await asyncio.sleep(max(0.0, period - (time.monotonic() - started)))

    def start(self) -> "Heartbeat":
        self._stopping = False
        self._task = asyncio.get_running_loop().create_task(self._run(), name="replica-heartbeat")
        return self

    async def stop(self, deregister: bool = True) -> None:
        task, self._task = self._task, None
        if task is not None:
            self._stopping = True
            task.cancel()
            # asyncio.wait, not `await task` under suppress(CancelledError):
            # that would also swallow a cancel of stop()'s own caller, and
            # it waits without a bound.
            limit = self.registry.op_timeout_s + 1.0
            done, _ = await asyncio.wait({task}, timeout=limit)
            if not done:
                log.error("replica heartbeat still running %.1f s after stop(); "
                          "it ends after its current beat", limit)
            elif not task.cancelled() and task.exception() is not None:
                log.warning("replica heartbeat ended with %r", task.exception())
        if deregister:
            try:
                await self.registry.deregister(self.replica.id)
            except Exception as e:  # noqa: BLE001 — the entry expires within one interval anyway
                log.warning("replica %s not deregistered: %s", self.replica.id, e)
