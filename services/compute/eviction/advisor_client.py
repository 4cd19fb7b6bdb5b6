"""The engine's EvictionAdvisor over the cache-manager's bidi `Advise` stream.

The engine thread calls `submit`, `take_plans` and `release`; none of them
blocks: `submit`/`release` hand messages to the asyncio loop with
`call_soon_threadsafe`, `take_plans` empties the plan mailbox. The stream runs
as a task on the server's loop and reconnects quickly (backoff capped at
`MAX_BACKOFF_S`, gRPC's own reconnect backoff capped likewise). While the cache-manager is absent (`connected` is False)
messages are dropped and the engine evicts with its local fallback policy at
once; each new stream bumps `epoch`, so the engine re-sends the features of
its running sequences to the (possibly restarted) cache-manager.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque

import grpc
import torch

from kvpop.runtime import security
from kvpop.runtime.metrics import get_metrics
from kvpop.runtime.arrays import from_int_array, to_float_array, to_int_array
from kvpop.runtime.pb import cache_manager_pb2 as pb
from kvpop.runtime.pb import cache_manager_pb2_grpc as pb_grpc
from services.compute.eviction.advisor import MALFORMED_PLAN, BlockFeatures, EvictionPlan, FeatureBatch, PlanMailbox

log = logging.getLogger(__name__)

MAX_QUEUED = 4096   # messages waiting for the stream; the oldest go first when full
# A features batch goes in parts of at most this many bytes of block arrays:
# under the cache-manager's default 4 MB message limit, whatever the model.
MAX_PART_BYTES = 1 << 21
MAX_BACKOFF_S = 0.25
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", -1),
    # gRPC's own reconnect backoff defaults to 1 s growing to 120 s: a restarted
    # cache-manager would wait that long for compute to come back.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", int(1000 * MAX_BACKOFF_S)),
    # No client keepalive pings: servers answer pings more frequent than they
    # allow (5 min by default) with GOAWAY "too many pings", which broke the
    # stream under load. A dead peer shows as a broken stream anyway.
]


class AdvisorClient:
    def __init__(self, address: str, loop: asyncio.AbstractEventLoop):
        self.address, self.loop = address, loop
        self._lock = threading.Lock()      # guards _contexts
        self._plans = PlanMailbox()
        self._contexts: dict[str, dict[str, str]] = {}
        self._outbox: deque[pb.AdvisorMessage] = deque(maxlen=MAX_QUEUED)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.connected = False
        self.epoch = 0
        self.on_plan = None
        # What the cache-manager's networks read; until it says, measure everything.
        self.reads_reach = True
        # request id -> (blocks sent up to, when) of its feature batches not yet answered by a plan
        self._sent_at: dict[str, deque[tuple[int, float]]] = {}
        self.stats = {"features_sent": 0, "plans_received": 0, "reconnects": 0, "dropped": 0,
                      "malformed_plans": 0, "reads_reach": 1, "inputs_heard": 0}

    # ------------------------------------------------ engine thread side
    def set_context(self, request_id: str, carrier: dict[str, str]) -> None:
        """The request's trace context, carried on each message about it."""
        with self._lock:
            self._contexts[request_id] = carrier

    def forget(self, request_id: str) -> None:
        """Drop the request's trace context (the stream is over; idempotent)."""
        with self._lock:
            self._contexts.pop(request_id, None)

    def submit(self, features: FeatureBatch | list[BlockFeatures], gone: torch.Tensor | None = None) -> None:
        self.loop.call_soon_threadsafe(self._enqueue_features, features, gone)

    def take_plans(self) -> dict[str, EvictionPlan]:
        return self._plans.take()

    def release(self, request_id: str) -> None:
        self._plans.drop(request_id)
        with self._lock:
            self._contexts.pop(request_id, None)
        msg = pb.AdvisorMessage(finished=pb.SequenceFinished(request_id=request_id))
        self.loop.call_soon_threadsafe(self._finish, msg)

    def _finish(self, msg: pb.AdvisorMessage) -> None:
        self._sent_at.pop(msg.finished.request_id, None)
        self._enqueue(msg)

    # ------------------------------------------------ loop side
    def _enqueue(self, msg: pb.AdvisorMessage) -> None:
        if not self.connected:
            self.stats["dropped"] += 1
            return
        if len(self._outbox) == self._outbox.maxlen:
            self.stats["dropped"] += 1
        self._outbox.append(msg)
        self._wake.set()

    def _enqueue_features(self, features, gone: torch.Tensor | None = None) -> None:
        for batch in FeatureBatch.pack(features):
            rid = batch.request_id
            with self._lock:
                ctx = self._contexts.get(rid, {})
            k = len(batch)
            per_block = 4 * (batch.key_mean[0].numel() + 3 * batch.value_norm[0].numel())
            step = max(1, MAX_PART_BYTES // per_block)
            parts = [(i, min(k, i + step)) for i in range(0, k, step)]
            if gone is not None and 4 * gone.numel() + per_block * (parts[0][1] - parts[0][0]) > MAX_PART_BYTES:
                parts.insert(0, (0, 0))     # a long context's evicted-block list travels in a part of its own
            ints = lambda t: to_int_array(t.numpy())
            floats = lambda t: to_float_array(t.float().numpy())
            for i, (lo, hi) in enumerate(parts):
                part = batch.part(lo, hi)
                msg = pb.FeaturesBatch(request_id=rid, more=i < len(parts) - 1, prompt_tokens=batch.prompt_tokens)
                if hi > lo:
                    msg.arrays.CopyFrom(pb.BlockArrays(
                        block=ints(part.block), position=ints(part.position), age=ints(part.age),
                        key_mean=floats(part.key_mean), value_norm=floats(part.value_norm),
                        attention=floats(part.attention), reach=floats(part.reach)))
                if gone is not None and i == 0:
                    msg.gone.CopyFrom(to_int_array(gone.numpy().astype("int32")))
                self._enqueue(pb.AdvisorMessage(features=msg, traceparent=ctx.get("traceparent", ""),
                                                tracestate=ctx.get("tracestate", "")))
            if self.connected:
                self._sent_at.setdefault(rid, deque(maxlen=256)).append((int(batch.block.max()) + 1, time.monotonic()))
            self.stats["features_sent"] += k

    async def _requests(self, outbox: deque, wake: asyncio.Event):
        # Its own outbox per stream: a broken stream's iterator may live on in
        # gRPC for a while and must not take the messages meant for the next one.
        while True:
            while outbox:
                yield outbox.popleft()
            wake.clear()
            await wake.wait()

    def _on_reply(self, reply: pb.AdvisorReply) -> None:
        if reply.HasField("inputs"):     # once per stream, and after a reload that changed it
            self.reads_reach = "reach" in reply.inputs.reads
            self.stats["reads_reach"] = int(self.reads_reach)
            self.stats["inputs_heard"] += 1
            log.info("the cache-manager's networks %s", "read reach: reach measured for learned sequences"
                     if self.reads_reach else "do not read reach: reach not measured")
        if not reply.HasField("plan"):
            return
        p = reply.plan
        try:
            evict = torch.from_numpy(from_int_array(p.evict).copy())
            plan = EvictionPlan(p.request_id, evict, p.covers, p.ranker or "network", p.estimator)
        except ValueError as e:
            # The sequence falls back now (reason malformed_plan) instead of waiting out its bound.
            log.warning("malformed plan for %s: %s", p.request_id, e)
            self.stats["malformed_plans"] += 1
            plan = EvictionPlan(p.request_id, None, p.covers, p.ranker, error=MALFORMED_PLAN)
        metrics = get_metrics()
        sent = self._sent_at.get(p.request_id)
        answered = None
        while sent and sent[0][0] <= p.covers:
            answered = sent.popleft()[1]
        if answered is not None:      # the latest batch this plan covers: what it answers
            metrics.plan_latency.observe(time.monotonic() - answered)
        # The newest plan wins; one for a finished request is ignored by the engine.
        if self._plans.put(plan):
            metrics.plans_late.labels(reason="superseded").inc()
        self.stats["plans_received"] += 1
        metrics.plans_received.inc()
        if self.on_plan is not None:
            self.on_plan()

    async def _run(self) -> None:
        delay = 0.05
        channel = security.aio_channel(self.address, options=CHANNEL_OPTIONS)
        stub = pb_grpc.CacheManagerStub(channel)
        try:
            while True:
                try:
                    await channel.channel_ready()
                    self._outbox, self._wake = deque(maxlen=MAX_QUEUED), asyncio.Event()
                    call = stub.Advise(self._requests(self._outbox, self._wake), wait_for_ready=True)
                    self.epoch += 1         # before `connected`: the engine re-sends what this stream lacks
                    self.connected = True
                    log.info("advisor stream to %s open (epoch %d)", self.address, self.epoch)
                    delay = 0.05
                    async for reply in call:
                        self._on_reply(reply)
                    log.warning("advisor stream to %s ended", self.address)
                except grpc.aio.AioRpcError as e:
                    log.warning("advisor stream to %s broke: %s %s", self.address, e.code().name, e.details())
                self.connected = False
                self._outbox.clear()
                self._sent_at.clear()       # a new stream re-sends everything: no answer will come for these
                self.stats["reconnects"] += 1
                await asyncio.sleep(delay)
                delay = min(2 * delay, MAX_BACKOFF_S)
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
