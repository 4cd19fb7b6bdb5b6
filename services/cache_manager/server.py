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
from services.cache_manager.planner import Planner
from services.cache_manager.scoring_state import BlockRecord

log = logging.getLogger(__name__)
_tracer = telemetry.tracer("kvpop.cache_manager")


# Most new blocks one network call folds in: decode batches (a page's worth each) of many
# sequences share a call, while a prompt chunk (hundreds of blocks) goes on its own, so the
# plans answered first do not wait for every prompt of the round.
GROUP_BLOCKS = 256


def _num_blocks(batch: pb.FeaturesBatch) -> int:
    return len(batch.blocks) + (int(batch.arrays.block.shape[0]) if batch.HasField("arrays") and
                                batch.arrays.block.shape else 0)


def _groups(due: dict) -> list[list]:
    """The round's due sequences, fewest new blocks first (a decoding sequence's plan
    does not wait behind prompt chunks), in groups of at most GROUP_BLOCKS new
    blocks (a larger batch alone)."""
    groups, size = [], 0
    for item in sorted(due.items(), key=lambda item: item[1][2]):
        blocks = item[1][2]
        if not groups or size + blocks > GROUP_BLOCKS:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += blocks
    return groups


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

    def _fold(self, batch: pb.FeaturesBatch) -> None:
        records = [BlockRecord(block=b.block, position=b.position, age=b.age,
                               key_mean=from_float_array(b.key_mean),
                               value_norm=from_float_array(b.value_norm),
                               attention=from_float_array(b.attention),
                               reach=from_float_array(b.reach) if b.HasField("reach") else None)
                   for b in batch.blocks]
        gone = from_int_array(batch.gone) if batch.HasField("gone") else None
        self.planner.add(batch.request_id, records, None if batch.HasField("arrays") else gone, batch.prompt_tokens)
        if batch.HasField("arrays"):
            a = batch.arrays
            self.planner.add_arrays(batch.request_id, {
                "block": from_int_array(a.block), "position": from_int_array(a.position), "age": from_int_array(a.age),
                "key_mean": from_float_array(a.key_mean), "value_norm": from_float_array(a.value_norm),
                "attention": from_float_array(a.attention), "reach": from_float_array(a.reach)}, gone, batch.prompt_tokens)

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
        """Messages are read by a task into a queue; each round folds every
        message waiting and answers once per sequence with its newest plan,
        the round's sequences scored in few network calls (``_groups``).
        A backlog (many sequences, a slow network) thus costs one plan per
        sequence per round, never one per message, so plans do not fall
        further and further behind the features they answer."""
        seen: set[str] = set()
        parts: dict[str, tuple] = {}   # rid -> what its batch's earlier parts brought (no plan yet)
        inbox: asyncio.Queue = asyncio.Queue()

        async def read() -> None:
            try:
                async for msg in self._until_closing(request_iterator):
                    inbox.put_nowait(msg)
            finally:
                inbox.put_nowait(None)

        reader = asyncio.ensure_future(read())
        told = self.planner.reads
        try:
            yield pb.AdvisorReply(inputs=pb.AdvisorInputs(reads=told))
            while True:
                msgs = [await inbox.get()]
                while not inbox.empty():
                    msgs.append(inbox.get_nowait())
                due: dict[str, tuple[pb.AdvisorMessage, int, int]] = {}   # rid -> (last message, messages, blocks)
                for msg in msgs:
                    if msg is None:
                        break
                    kind = msg.WhichOneof("kind")
                    if kind == "finished":
                        rid = msg.finished.request_id
                        self.state.drop(rid)
                        seen.discard(rid)
                        due.pop(rid, None)
                        parts.pop(rid, None)
                        continue
                    if kind != "features" or not msg.features.request_id:
                        continue
                    rid = msg.features.request_id
                    try:
                        self._fold(msg.features)
                    except ValueError as e:
                        log.warning("skipping features for %s: %s", rid, e)
                        continue
                    seen.add(rid)
                    _, n, blocks = parts.pop(rid, None) or due.pop(rid, None) or (None, 0, 0)
                    # A part with more to come is folded, but planned only with its batch's last part.
                    (parts if msg.features.more else due)[rid] = (msg, n + 1, blocks + _num_blocks(msg.features))
                for group in _groups(due):
                    replies = self._plans([rid for rid, _ in group])
                    for (rid, (msg, n, blocks)), reply in zip(group, replies):
                        parent = telemetry.extract({"traceparent": msg.traceparent, "tracestate": msg.tracestate})
                        with _tracer.start_as_current_span("cache_manager.plan", context=parent) as span:
                            span.set_attribute("kvpop.request_id", rid)
                            span.set_attribute("kvpop.blocks", blocks)
                            span.set_attribute("kvpop.messages", n)
                            span.set_attribute("kvpop.planned_with", len(replies))
                            span.set_attribute("kvpop.ranker", reply.plan.ranker)
                            span.set_attribute("kvpop.estimator", reply.plan.estimator)
                        get_metrics().plans_sent.labels(reply.plan.estimator or "heuristic").inc()
                        yield reply
                if self.planner.reads != told:      # a reload changed what the networks read
                    told = self.planner.reads
                    yield pb.AdvisorReply(inputs=pb.AdvisorInputs(reads=told))
                if msgs[-1] is None:
                    return
        finally:
            reader.cancel()
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
    import torch

    torch.set_num_threads(max(1, cfg.scoring_threads))
    servicer = CacheManagerServicer(cfg)
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, servicer.planner.reload)
    pb_grpc.add_CacheManagerServicer_to_server(servicer, service.server)
    service.add(pb.DESCRIPTOR.services_by_name["CacheManager"].full_name)
    return CacheManagerApp(servicer)
