"""Which compute replica serves a request.

Replicas heartbeat into the Redis registry (kvpop/runtime/replica_registry.py); the router
asks it for the least-loaded healthy replica, counting the streams this
gateway already has open on each (heartbeats show them only later), and keeps
a session on the replica that holds its KV. With no Redis, or no replica
registered, it uses the configured static compute address, so a single-host
stack works unchanged. The healthy list is re-read at most every
`interval / 10` (Redis load stays flat under traffic). When Redis is down it
routes over the replicas it saw last and leaves Redis alone for a second:
a registry outage must neither stop traffic nor add its timeouts to every
request.

`Router.open()` streams one request: a replica that is unreachable (or
refuses: draining, still loading) before it streamed anything is excluded and
the request goes to the next one, so no request fails that had not started
streaming; a replica lost mid-stream surfaces as its gRPC error (UNAVAILABLE).

`Router.probe()` (the gateway's health watch, several times a second) asks
every candidate replica's grpc.health.v1 on the channel traffic uses; replicas
that do not answer SERVING are tried last. Channels reconnect with a backoff
capped at `MAX_RECONNECT_BACKOFF_MS`, so a replica that comes back is used
within a fraction of a second of reporting SERVING (gRPC's default backoff
grows to minutes).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import AsyncIterator, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpop.runtime import security

from kvpop.runtime import telemetry
from kvpop.runtime.pb import compute_pb2_grpc
from kvpop.runtime.redis_client import RedisUnavailable
from kvpop.runtime.replica_registry import NoReplicaAvailable, Replica, ReplicaRegistry, choose
from services.gateway.compute_mux import ComputeMux

log = logging.getLogger(__name__)

# Before the first response these mean "this replica cannot take it": try another.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN})
MAX_RECONNECT_BACKOFF_MS = 250
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
]


@dataclass(frozen=True)
class Target:
    replica_id: str       # the registry id, or "static" for the configured address
    address: str
    stub: compute_pb2_grpc.ComputeStub
    mux: ComputeMux       # this gateway's requests to the replica, on one stream


class Router:
    STATIC = "static"

    def __init__(self, static_address: str, registry: ReplicaRegistry | None = None):
        self.static_address = static_address
        self.registry = registry
        self.inflight: Counter[str] = Counter()
        self._open_streams: Counter[str] = Counter()   # by address
        self._channels: dict[str, tuple[grpc.aio.Channel, compute_pb2_grpc.ComputeStub, ComputeMux]] = {}
        self._last_known: list[Replica] = []
        self._fresh_until = 0.0     # monotonic time until which _last_known is reused
        self.refresh_s = registry.interval_s / 10 if registry is not None else 0.0
        self.outage_backoff_s = 1.0
        self.down: set[str] = set()     # addresses whose last probe was not SERVING

    def stub(self, address: str) -> compute_pb2_grpc.ComputeStub:
        if address not in self._channels:
            ch = security.aio_channel(address, options=CHANNEL_OPTIONS,
                                      interceptors=telemetry.client_interceptors())
            stub = compute_pb2_grpc.ComputeStub(ch)
            self._channels[address] = (ch, stub, ComputeMux(stub))
        return self._channels[address][1]

    def target(self, replica_id: str, address: str) -> Target:
        stub = self.stub(address)
        return Target(replica_id, address, stub, self._channels[address][2])

    async def candidates(self) -> dict[str, str]:
        """address -> replica id of every replica a request could go to now."""
        out: dict[str, str] = {}
        if self.registry is not None:
            out = {r.address: r.id for r in await self._replicas()}
        return out or {self.static_address: self.STATIC}

    async def probe(self, timeout: float = 1.0) -> dict[str, bool]:
        """address -> SERVING, for every candidate replica (its health on the traffic channel)."""
        targets = await self.candidates()

        async def one(address: str) -> bool:
            self.stub(address)
            stub = health_pb2_grpc.HealthStub(self._channels[address][0])
            try:
                r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
            except grpc.aio.AioRpcError:
                return False
            return r.status == health_pb2.HealthCheckResponse.SERVING

        serving = dict(zip(targets, await asyncio.gather(*(one(a) for a in targets))))
        self.down = {a for a, ok in serving.items() if not ok}
        return serving

    def _static(self) -> Target:
        return self.target(self.STATIC, self.static_address)

    async def pick(self, session_replica: str | None = None,
                   exclude: frozenset[str] | set[str] = frozenset()) -> Target:
        """Raises NoReplicaAvailable when every known replica is excluded."""
        if self.registry is not None:
            live = [r for r in await self._replicas() if r.id not in exclude]
            if not live and time.monotonic() < self._fresh_until:
                # Every replica known a moment ago is excluded: one that joined since
                # (a failover's target) must not be missed for a cached list.
                self._fresh_until = 0.0
                live = [r for r in await self._replicas() if r.id not in exclude]
            # Replicas the health watch saw SERVING first; the others only when none is.
            live = [r for r in live if r.address not in self.down] or live
            if live:
                chosen = choose(live, session_replica, self.inflight)
                return self.target(chosen.id, chosen.address)
        if self.STATIC in exclude:
            raise NoReplicaAvailable("no compute replica left to try")
        return self._static()

    async def _replicas(self) -> list[Replica]:
        now = time.monotonic()
        if now < self._fresh_until:
            return self._last_known
        try:
            self._last_known = await self.registry.healthy_replicas()
            self._fresh_until = time.monotonic() + self.refresh_s
        except RedisUnavailable as e:
            log.warning("replica registry unavailable, routing over the %d last known replicas: %s",
                        len(self._last_known), e)
            self._fresh_until = time.monotonic() + self.outage_backoff_s
            return self._last_known
        await self._prune({r.address for r in self._last_known})
        return self._last_known

    async def _prune(self, live: set[str]) -> None:
        """Close channels to replicas that left the registry once no stream uses them."""
        keep = live | {self.static_address} | set(self._open_streams)
        for address in [a for a in self._channels if a not in keep]:
            channel, _, mux = self._channels.pop(address)
            await mux.close()
            await channel.close()

    @contextlib.contextmanager
    def track(self, target: Target) -> Iterator[None]:
        """Count a stream open on `target` while the block runs."""
        self.inflight[target.replica_id] += 1
        self._open_streams[target.address] += 1
        try:
            yield
        finally:
            for counter, key in ((self.inflight, target.replica_id), (self._open_streams, target.address)):
                counter[key] -= 1
                if counter[key] <= 0:
                    del counter[key]

    async def info(self, timeout: float = 5.0):
        """Info from the first replica that answers; the last error if none does."""
        from kvpop.runtime.pb import compute_pb2

        tried: set[str] = set()
        last: grpc.aio.AioRpcError | None = None
        while True:
            try:
                target = await self.pick(exclude=tried)
            except NoReplicaAvailable:
                if last is None:
                    raise
                raise last from None
            try:
                with self.track(target):
                    return await target.stub.Info(compute_pb2.InfoRequest(), timeout=timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() not in RETRYABLE:
                    raise
                tried.add(target.replica_id)
                last = e

    def open(self, request, timeout: float | None = None, session_replica: str | None = None,
             exclude: frozenset[str] | set[str] = frozenset(), pinned: Target | None = None) -> "RoutedStream":
        """`exclude`: replica ids not to use; `pinned`: this replica only (no move on refusal)."""
        return RoutedStream(self, request, timeout, session_replica, exclude, pinned)

    async def close(self) -> None:
        for ch, _, mux in self._channels.values():
            await mux.close()
            await ch.close()
        self._channels.clear()


class RoutedStream:
    """One Generate call, moved to another replica while nothing was streamed.

    Iterate it for ComputeResponse messages; `target` is the replica that
    served (or last failed). Raises NoReplicaAvailable when every replica
    refused, or the last replica's AioRpcError. `aclose()` (or leaving the
    iteration early) cancels the compute call, which frees its sequence."""

    def __init__(self, router: Router, request, timeout: float | None, session_replica: str | None,
                 exclude: frozenset[str] | set[str] = frozenset(), pinned: Target | None = None):
        self.router = router
        self.request = request
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.session_replica = session_replica
        self.pinned = pinned
        self.target: Target | None = None
        self.tried: list[str] = list(exclude)
        self.started = False        # a response came: the request can no longer move
        self._gen = self._stream()

    def __aiter__(self):
        return self._gen

    async def aclose(self) -> None:
        await self._gen.aclose()

    async def _stream(self) -> AsyncIterator:
        while True:
            self.target = target = self.pinned or await self.router.pick(self.session_replica, set(self.tried))
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            call = target.mux.open(self.request, timeout)
            try:
                with self.router.track(target):
                    async for resp in call:
                        self.started = True
                        yield resp
                return
            except grpc.aio.AioRpcError as e:
                if self.started or e.code() not in RETRYABLE or self.pinned is not None:
                    raise
                self.tried.append(target.replica_id)
                log.warning("replica %s (%s) refused %s: %s; trying another", target.replica_id,
                            target.address, e.code().name, e.details())
            finally:
                if not call.done():
                    call.cancel()
