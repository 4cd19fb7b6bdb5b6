"""Cache-manager gRPC service: one bidi `Advise` stream per compute process.

Features batches update per-sequence scoring state; each batch is answered with
an eviction plan for that sequence. A malformed message is logged and skipped:
failing the stream would drop the plans of every other sequence on it.

Blocks are ranked by the value-estimation network loaded at start from
``KVPOP_ESTIMATOR`` (default: ``models/default/estimator.safetensors``), or by
the h2o attention-per-age heuristic when there is no usable checkpoint.
SIGHUP reloads the checkpoint without a restart (new plans use it at once;
a broken file keeps the current policy).
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import AsyncIterator

import grpc

from kvpop import telemetry
from kvpop.arrays import from_float_array, to_int_array
from kvpop.config import CacheManagerConfig
from kvpop.grpc_server import GrpcService
from kvpop.metrics import get_metrics
from kvpop.pb import cache_manager_pb2 as pb
from kvpop.pb import cache_manager_pb2_grpc as pb_grpc
from services.cache_manager.planner import Planner
from services.cache_manager.scoring_state import BlockRecord

log = logging.getLogger(__name__)
_tracer = telemetry.tracer("kvpop.cache_manager")


class CacheManagerServicer(pb_grpc.CacheManagerServicer):
    def __init__(self, cfg: CacheManagerConfig):
        self.cfg = cfg
        self.planner = Planner(cfg.estimator, cfg.max_plan_blocks)
        self.state = self.planner.state
        self.plans_sent = 0
        self.closing = asyncio.Event()

    async def _until_closing(self, request_iterator):
        """The stream's messages until it ends or this service starts draining: a
        long-lived Advise stream would otherwise hold the drain for its whole grace."""
        it = request_iterator.__aiter__()
        closing = asyncio.ensure_future(self.closing.wait())
        try:
            while True:
                nxt = asyncio.ensure_future(it.__anext__())
                await asyncio.wait({nxt, closing}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    return
                try:
                    yield nxt.result()
                except StopAsyncIteration:
                    return
        finally:
            closing.cancel()

    def _apply(self, batch: pb.FeaturesBatch) -> pb.AdvisorReply:
        records = [BlockRecord(block=b.block, position=b.position, age=b.age,
                               key_mean=from_float_array(b.key_mean),
                               value_norm=from_float_array(b.value_norm),
                               attention=from_float_array(b.attention)) for b in batch.blocks]
        plan = self.planner.apply(batch.request_id, records)
        self.plans_sent += 1
        return pb.AdvisorReply(plan=pb.EvictionPlan(request_id=batch.request_id, evict=to_int_array(plan.evict),
                                                    covers=plan.covers, ranker=plan.ranker))

    async def Advise(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.AdvisorReply]:
        seen: set[str] = set()
        try:
            async for msg in self._until_closing(request_iterator):
                kind = msg.WhichOneof("kind")
                if kind == "finished":
                    self.state.drop(msg.finished.request_id)
                    seen.discard(msg.finished.request_id)
                    continue
                if kind != "features" or not msg.features.request_id:
                    continue
                parent = telemetry.extract({"traceparent": msg.traceparent, "tracestate": msg.tracestate})
                with _tracer.start_as_current_span("cache_manager.plan", context=parent) as span:
                    span.set_attribute("kvpop.request_id", msg.features.request_id)
                    span.set_attribute("kvpop.blocks", len(msg.features.blocks))
                    try:
                        with get_metrics().scoring_latency.time():
                            reply = self._apply(msg.features)
                    except ValueError as e:
                        log.warning("skipping features for %s: %s", msg.features.request_id, e)
                        span.set_attribute("kvpop.error", str(e))
                        continue
                seen.add(msg.features.request_id)
                yield reply
        finally:
            # The compute process went away: its sequences will never finish here.
            for rid in seen:
                self.state.drop(rid)


class CacheManagerApp:
    def __init__(self, servicer: CacheManagerServicer):
        self.servicer = servicer

    async def ready(self) -> None:
        return None

    async def drain(self) -> None:
        self.servicer.closing.set()

    async def close(self) -> None:
        return None


async def build(cfg: CacheManagerConfig, service: GrpcService) -> CacheManagerApp:
    servicer = CacheManagerServicer(cfg)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, servicer.planner.reload)
    pb_grpc.add_CacheManagerServicer_to_server(servicer, service.server)
    service.add(pb.DESCRIPTOR.services_by_name["CacheManager"].full_name)
    return CacheManagerApp(servicer)
