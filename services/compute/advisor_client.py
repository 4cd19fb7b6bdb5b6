"""The engine's EvictionAdvisor over the cache-manager's bidi `Advise` stream.

The engine thread calls `submit`, `take_plans` and `release`; none of them
blocks: `submit`/`release` hand messages to the asyncio loop with
`call_soon_threadsafe`, `take_plans` swaps a dict under a lock. The stream runs
as a task on the server's loop and reconnects with backoff. While the
cache-manager is absent, late or dead, messages are dropped and no plans come:
the engine evicts with its local fallback policy (bounded by its slack).
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque

import grpc
import torch

from kvpop import security
from kvpop.arrays import from_int_array, to_float_array
from kvpop.pb import cache_manager_pb2 as pb
from kvpop.pb import cache_manager_pb2_grpc as pb_grpc
from services.compute.eviction import BlockFeatures, EvictionPlan

log = logging.getLogger(__name__)

MAX_QUEUED = 4096   # messages waiting for the stream; the oldest go first when full


class AdvisorClient:
    def __init__(self, address: str, loop: asyncio.AbstractEventLoop):
        self.address, self.loop = address, loop
        self._lock = threading.Lock()
        self._plans: dict[str, EvictionPlan] = {}
        self._contexts: dict[str, dict[str, str]] = {}
        self._outbox: deque[pb.AdvisorMessage] = deque(maxlen=MAX_QUEUED)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.connected = False
        self.stats = {"features_sent": 0, "plans_received": 0, "reconnects": 0, "dropped": 0}

    # ------------------------------------------------ engine thread side
    def set_context(self, request_id: str, carrier: dict[str, str]) -> None:
        """The request's trace context, carried on each message about it."""
        with self._lock:
            self._contexts[request_id] = carrier

    def forget(self, request_id: str) -> None:
        """Drop the request's trace context (the stream is over; idempotent)."""
        with self._lock:
            self._contexts.pop(request_id, None)

    def submit(self, features: list[BlockFeatures]) -> None:
        self.loop.call_soon_threadsafe(self._enqueue_features, features)

    def take_plans(self) -> dict[str, EvictionPlan]:
        with self._lock:
            plans, self._plans = self._plans, {}
        return plans

    def release(self, request_id: str) -> None:
        with self._lock:
            self._plans.pop(request_id, None)
            self._contexts.pop(request_id, None)
        msg = pb.AdvisorMessage(finished=pb.SequenceFinished(request_id=request_id))
        self.loop.call_soon_threadsafe(self._enqueue, msg)

    # ------------------------------------------------ loop side
    def _enqueue(self, msg: pb.AdvisorMessage) -> None:
        if not self.connected:
            self.stats["dropped"] += 1
            return
        if len(self._outbox) == self._outbox.maxlen:
            self.stats["dropped"] += 1
        self._outbox.append(msg)
        self._wake.set()

    def _enqueue_features(self, features: list[BlockFeatures]) -> None:
        by_request: dict[str, list[BlockFeatures]] = {}
        for f in features:
            by_request.setdefault(f.request_id, []).append(f)
        for rid, feats in by_request.items():
            with self._lock:
                ctx = self._contexts.get(rid, {})
            batch = pb.FeaturesBatch(request_id=rid, blocks=[pb.BlockFeatures(
                block=f.block, position=f.position, age=f.age,
                key_mean=to_float_array(f.key_mean.float().numpy()),
                value_norm=to_float_array(f.value_norm.float().numpy()),
                attention=to_float_array(f.attention.float().numpy())) for f in feats])
            self._enqueue(pb.AdvisorMessage(features=batch, traceparent=ctx.get("traceparent", ""),
                                            tracestate=ctx.get("tracestate", "")))
            self.stats["features_sent"] += len(feats)

    async def _requests(self):
        while True:
            while self._outbox:
                yield self._outbox.popleft()
            self._wake.clear()
            await self._wake.wait()

    def _on_reply(self, reply: pb.AdvisorReply) -> None:
        p = reply.plan
        try:
            evict = torch.from_numpy(from_int_array(p.evict).copy())
        except ValueError as e:
            log.warning("ignoring malformed plan for %s: %s", p.request_id, e)
            return
        if evict.dim() != 3:
            log.warning("ignoring plan for %s with shape %s", p.request_id, tuple(evict.shape))
            return
        with self._lock:
            # The newest plan wins; one for a finished request is ignored by the engine.
            self._plans[p.request_id] = EvictionPlan(p.request_id, evict)
        self.stats["plans_received"] += 1

    async def _run(self) -> None:
        delay = 0.1
        channel = security.aio_channel(self.address, options=[("grpc.max_receive_message_length", -1)])
        stub = pb_grpc.CacheManagerStub(channel)
        try:
            while True:
                try:
                    await channel.channel_ready()
                    call = stub.Advise(self._requests())
                    self.connected = True
                    log.info("advisor stream to %s open", self.address)
                    delay = 0.1
                    async for reply in call:
                        self._on_reply(reply)
                    log.warning("advisor stream to %s ended", self.address)
                except grpc.aio.AioRpcError as e:
                    log.warning("advisor stream to %s broke: %s %s", self.address, e.code().name, e.details())
                self.connected = False
                self._outbox.clear()
                self.stats["reconnects"] += 1
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
        finally:
            self.connected = False
            await channel.close()

    def start(self) -> None:
        self._task = self.loop.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
