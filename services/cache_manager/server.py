"""Cache-manager gRPC service: one bidi `Advise` stream per compute process.

Features batches update per-sequence scoring state; each batch is answered with
an eviction plan for that sequence. A malformed message is logged and skipped:
failing the stream would drop the plans of every other sequence on it.

Blocks are ranked by the value-estimation network(s) loaded at start from
``KVPOP_ESTIMATOR`` (default: the networks in ``models/default``), or by the
attention-per-age heuristic when there is no usable checkpoint. With several
networks, each sequence is ranked by the one made for its block size and
trained for its prompt's length (planner.route). SIGHUP reloads them without
a restart (new plans use them at once; a broken file keeps the current policy).
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import AsyncIterator

import grpc

from kvpop.runtime import telemetry
from kvpop.runtime.arrays import from_float_array, from_int_array, to_int_array
from kvpop.runtime.config import CacheManagerConfig
from kvpop.runtime.grpc_server import GrpcService
from kvpop.runtime.metrics import get_metrics
from kvpop.runtime.pb import cache_manager_pb2 as pb
from kvpop.runtime.pb import cache_manager_pb2_grpc as pb_grpc
from services.cache_manager.inbox import Due, Inbox, Rounds, groups
from services.cache_manager.planner import Planner
from services.cache_manager.scoring_state import BlockRecord

log = logging.getLogger(__name__)
_tracer = telemetry.tracer("kvpop.cache_manager")


def _trace_plan(rid: str, due: Due, reply: pb.AdvisorReply, planned_with: int) -> None:
    """A span under the features' trace (compute's step) and the plan counted by ranker."""
    parent = telemetry.extract({"traceparent": due.message.traceparent, "tracestate": due.message.tracestate})
    with _tracer.start_as_current_span("cache_manager.plan", context=parent) as span:
        span.set_attribute("kvpop.request_id", rid)
        span.set_attribute("kvpop.blocks", due.blocks)
        span.set_attribute("kvpop.messages", due.messages)
        span.set_attribute("kvpop.planned_with", planned_with)
        span.set_attribute("kvpop.ranker", reply.plan.ranker)
        span.set_attribute("kvpop.estimator", reply.plan.estimator)
    get_metrics().plans_sent.labels(reply.plan.estimator or "heuristic").inc()


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
        nxt = None
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
            if nxt is not None and not nxt.done():
                nxt.cancel()
                nxt.add_done_callback(lambda f: f.cancelled() or f.exception())   # retrieved: no "never retrieved" noise

    def _fold(self, batch: pb.FeaturesBatch) -> bool:
        """Folds a features batch into the scoring state; False when it is malformed (logged and skipped)."""
        try:
            records = [BlockRecord(block=b.block, position=b.position, age=b.age,
                                   key_mean=from_float_array(b.key_mean),
                                   value_norm=from_float_array(b.value_norm),
                                   attention=from_float_array(b.attention),
                                   reach=from_float_array(b.reach) if b.HasField("reach") else None)
                       for b in batch.blocks]
            gone = from_int_array(batch.gone) if batch.HasField("gone") else None
            if records or not batch.HasField("arrays"):   # arrays alone: add_arrays does all of it
                self.planner.add(batch.request_id, records, None if batch.HasField("arrays") else gone,
                                 batch.prompt_tokens)
            if batch.HasField("arrays"):
                a = batch.arrays
                self.planner.add_arrays(batch.request_id, {
                    "block": from_int_array(a.block), "position": from_int_array(a.position),
                    "age": from_int_array(a.age), "key_mean": from_float_array(a.key_mean),
                    "value_norm": from_float_array(a.value_norm), "attention": from_float_array(a.attention),
                    "reach": from_float_array(a.reach)}, gone, batch.prompt_tokens)
        except ValueError as e:
            log.warning("skipping features for %s: %s", batch.request_id, e)
            return False
        return True

    def _plans(self, request_ids: list[str]) -> list[pb.AdvisorReply]:
        """One network call for every sequence due in the round (Planner.plan_many)."""
        with get_metrics().scoring_latency.time():
            plans = self.planner.plan_many(request_ids)
        self.plans_sent += len(plans)
        return [pb.AdvisorReply(plan=pb.EvictionPlan(request_id=rid, evict=to_int_array(plan.evict),
                                                     covers=plan.covers, ranker=plan.ranker,
                                                     estimator=plan.estimator))
                for rid, plan in zip(request_ids, plans)]

    async def Advise(self, request_iterator, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.AdvisorReply]:
        """Each round folds every message waiting (``Inbox``, ``Rounds``) and
        answers once per sequence with its newest plan, the round's sequences
        scored in few network calls (``groups``)."""
        inbox = Inbox(self._until_closing(request_iterator))
        rounds = Rounds(self._fold, self.state.drop)
        told = self.planner.reads
        try:
            yield pb.AdvisorReply(inputs=pb.AdvisorInputs(reads=told))
            while not inbox.ended:
                for group in groups(rounds.fold(await inbox.take())):
                    replies = self._plans([rid for rid, _ in group])
                    for (rid, due), reply in zip(group, replies):
                        _trace_plan(rid, due, reply, len(replies))
                        yield reply
                if self.planner.reads != told:      # a reload changed what the networks read
                    told = self.planner.reads
                    yield pb.AdvisorReply(inputs=pb.AdvisorInputs(reads=told))
        finally:
            inbox.close()
            rounds.close()


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
    import torch

    torch.set_num_threads(max(1, cfg.scoring_threads))
    servicer = CacheManagerServicer(cfg)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, servicer.planner.reload)
    pb_grpc.add_CacheManagerServicer_to_server(servicer, service.server)
    service.add(pb.DESCRIPTOR.services_by_name["CacheManager"].full_name)
    return CacheManagerApp(servicer)
