"""Compute gRPC service: the engine behind the narrow internal API.

Each Generate stream is one engine request; when the gateway cancels the call
(client gone, deadline) the engine iterator is closed, which aborts the
sequence and frees its pages at the next step.

Compute holds every caller to its own limits (prompt characters, max_tokens,
concurrent streams: KVPOP_MAX_PROMPT_CHARS, KVPOP_MAX_TOKENS_LIMIT,
KVPOP_MAX_COMPUTE_STREAMS), whatever a gateway checked before.

Health: "" and `kvpop.compute.v1.Compute` are SERVING once the model is
loaded; `kvpop.compute.advisor` while the cache-manager stream is up (without
it `learned` runs on compute's fallback: degraded, not down);
`kvpop.compute.redis` while registry heartbeats reach Redis.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

import grpc
from opentelemetry import trace

from kvpop.runtime import telemetry
from kvpop.runtime.config import ComputeConfig
from kvpop.runtime.grpc_server import GrpcService
from kvpop.runtime.metrics import EngineStatsRefresher, get_metrics
from kvpop.runtime.pb import compute_pb2, compute_pb2_grpc, generate_pb2

log = logging.getLogger(__name__)
_tracer = telemetry.tracer(__name__)

MAX_ROUND_EVENTS = 128   # span events per request; the span's attributes carry the totals
HEALTH_ADVISOR = "kvpop.compute.advisor"
HEALTH_REDIS = "kvpop.compute.redis"
WATCH_PERIOD_S = 0.1



def resolve_dtype_name(dtype: str, device: str) -> str:
    # CPU matmuls in bf16 are slow and gain nothing here; GPUs get the checkpoint's dtype.
    if dtype == "auto" and device == "cpu":
        return "float32"
    return dtype


class Refusal(Exception):
    """A request ends with this gRPC status (Generate aborts with it; Serve sends it as an event)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


def _failed(request_id: str, code: grpc.StatusCode, details: str) -> compute_pb2.ServeEvent:
    return compute_pb2.ServeEvent(request_id=request_id, status_code=code.value[0], status_message=details)


class ComputeServicer(compute_pb2_grpc.ComputeServicer):
    def __init__(self, cfg: ComputeConfig):
        self.cfg = cfg
        self.engine = None          # AsyncEngine once ready
        self.advisor = None
        self.model_info: generate_pb2.ModelInfo | None = None
        self.replica_id = cfg.replica_id or f"{cfg.host}:{cfg.port}"
        self.open_streams = 0
        self.draining = False       # set at SIGTERM: the Serve stream stays open, but takes no new request

    def load(self, loop: asyncio.AbstractEventLoop) -> None:
        """Load the model and start the engine (runs in a worker thread)."""
        from services.compute.eviction.advisor_client import AdvisorClient
        from services.compute.engine.async_engine import AsyncEngine
        from services.compute.engine.engine import EngineConfig
        from services.compute.model.loader import resolve_device
        from services.compute.eviction.policies import POLICY_NAMES

        cfg = self.cfg
        device = resolve_device(cfg.device)
        dtype = resolve_dtype_name(cfg.dtype, device)
        ec = EngineConfig(model_dir=cfg.model, dtype=dtype, device=device, block_size=cfg.block_size,
                          page_size=cfg.page_size, num_pages=cfg.num_pages, max_num_seqs=cfg.max_num_seqs,
                          session_ttl_s=cfg.session_kv_ttl_s, plan_wait_s=cfg.plan_wait_ms / 1000.0,
                          pipeline_decode_plans=cfg.pipeline_decode_plans, cleanup_threshold=cfg.cleanup_threshold,
                          plan_interval=cfg.plan_interval, prefill_chunk=cfg.prefill_chunk)
        if cfg.max_model_len is not None:
            ec.max_model_len = cfg.max_model_len
        if cfg.cache_manager_address:
            self.advisor = AdvisorClient(cfg.cache_manager_address, loop)
        self.engine = AsyncEngine(ec, advisor=self.advisor)
        eng = self.engine.engine
        mc = eng.model.config
        raw = json.loads((Path(cfg.model) / "config.json").read_text())
        self.model_info = generate_pb2.ModelInfo(
            name=Path(cfg.model).resolve().name, architecture=mc.architecture, num_layers=mc.num_layers,
            num_heads=mc.num_heads, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim,
            max_model_len=eng.max_model_len, block_size=cfg.block_size, page_size=eng.page_size,
            policies=list(POLICY_NAMES),
            placeholder=bool(raw.get("kvpop_placeholder", False)), vocab_size=mc.vocab_size,
            dtype=str(eng.model.dtype).removeprefix("torch."), device=device,
            chat_template=eng.tokenizer.chat_template is not None, plan_interval=cfg.plan_interval)
        log.info("model %s loaded (%s, %s on %s, %d pages)", cfg.model, mc.architecture,
                 self.model_info.dtype, device, eng.pool.capacity)

    # ------------------------------------------------------------ RPCs
    async def Info(self, request, context):
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        stats = await asyncio.to_thread(self.engine.stats)
        evictions = stats.get("evictions", {})
        ps = compute_pb2.PoolStats(
            pages_total=stats["pages_total"], pages_free=stats["pages_free"], pages_used=stats["pages_used"],
            running=stats["running"], waiting=stats["waiting"],
            evictions=sum(evictions.values()) if isinstance(evictions, dict) else int(evictions),
            fallback_evictions=stats["fallback_evictions"])
        for k, v in stats.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                ps.extra[k] = float(v)
        if self.advisor is not None:
            for k, v in self.advisor.stats.items():
                ps.extra[f"advisor_{k}"] = float(v)
        return compute_pb2.InfoResponse(model=self.model_info, stats=ps, replica_id=self.replica_id,
                                        advisor_connected=bool(self.advisor and self.advisor.connected))

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        try:
            async for resp in self._one(request):
                yield resp
        except Refusal as e:
            await context.abort(e.code, e.details)

    async def Serve(self, request_iterator, context: grpc.aio.ServicerContext):
        """Many requests on one stream (the gateway's): each runs as its own task,
        as a Generate call would; their responses are gathered into one
        ServeEvents message per write, so N streams cost one message per step."""
        outbox: asyncio.Queue = asyncio.Queue()
        running: dict[str, asyncio.Task] = {}

        async def run(start: compute_pb2.ComputeRequest, timeout: float, carrier) -> None:
            rid = start.request_id
            with _tracer.start_as_current_span("kvpop.compute.v1.Compute/Serve", context=telemetry.extract(carrier),
                                               kind=trace.SpanKind.SERVER):
                try:
                    async with asyncio.timeout(timeout or None):
                        async for resp in self._one(start):
                            outbox.put_nowait(compute_pb2.ServeEvent(request_id=rid, response=resp))
                except Refusal as e:
                    outbox.put_nowait(_failed(rid, e.code, e.details))
                except TimeoutError:
                    outbox.put_nowait(_failed(rid, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))
                except Exception:   # noqa: BLE001 - one request's bug must not end the others' stream
                    log.exception("request %s failed", rid)
                    outbox.put_nowait(_failed(rid, grpc.StatusCode.INTERNAL, "compute failed on this request"))

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    if msg.HasField("start"):
                        rid = msg.start.request_id
                        if not rid or rid in running:
                            outbox.put_nowait(_failed(rid, grpc.StatusCode.INVALID_ARGUMENT,
                                                      f"request id {rid!r} is empty or already running on this stream"))
                            continue
                        task = asyncio.create_task(run(msg.start, msg.timeout_s, dict(msg.trace_context)))
                        running[rid] = task
                        task.add_done_callback(lambda t, rid=rid: ended(rid))
                    elif msg.HasField("cancel") and msg.cancel in running:
                        running[msg.cancel].cancel()
            finally:
                outbox.put_nowait(None)     # wake the writer: the stream may be over

        def ended(rid: str) -> None:
            running.pop(rid, None)
            outbox.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while True:
                # None only wakes this loop up (a request or the reader ended).
                events = [ev for ev in [await outbox.get()] if ev is not None]
                while not outbox.empty():
                    ev = outbox.get_nowait()
                    if ev is not None:
                        events.append(ev)
                if events:
                    yield compute_pb2.ServeEvents(events=events)
                if reader.done() and not running:
                    if not reader.cancelled() and reader.exception() is not None:
                        raise reader.exception()
                    return      # the gateway closed its side and every request has ended
        finally:
            reader.cancel()
            for task in list(running.values()):
                task.cancel()   # the gateway is gone: abort what it asked for

    async def _one(self, request):
        """One request's responses; raises Refusal for what Generate ends with a status."""
        if self.engine is None:
            raise Refusal(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        if self.draining:
            # Refused before anything streamed: the gateway moves it to another replica.
            raise Refusal(grpc.StatusCode.UNAVAILABLE, f"compute replica {self.replica_id} is draining")
        refused = self._refusal(request)
        if refused is not None:
            raise Refusal(*refused)
        if self.open_streams >= self.cfg.max_streams:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"compute replica {self.replica_id} has {self.open_streams} streams open, its limit "
                          f"(KVPOP_MAX_COMPUTE_STREAMS={self.cfg.max_streams})")
        self.open_streams += 1
        try:
            async for resp in self._generate(request):
                yield resp
        finally:
            self.open_streams -= 1

    def _refusal(self, request) -> tuple[grpc.StatusCode, str] | None:
        """Compute's own limits, whoever the caller (checked before anything runs)."""
        cfg, s = self.cfg, request.sampling
        if s.max_tokens > cfg.max_tokens_limit:
            return (grpc.StatusCode.RESOURCE_EXHAUSTED, f"max_tokens {s.max_tokens} is over this replica's limit "
                    f"(KVPOP_MAX_TOKENS_LIMIT={cfg.max_tokens_limit})")
        if s.max_tokens < 1:
            return grpc.StatusCode.INVALID_ARGUMENT, f"max_tokens must be >= 1, got {s.max_tokens}"
        if len(request.prompt) > cfg.max_prompt_chars:
            return (grpc.StatusCode.RESOURCE_EXHAUSTED, f"prompt is {len(request.prompt)} characters, over this "
                    f"replica's limit (KVPOP_MAX_PROMPT_CHARS={cfg.max_prompt_chars})")
        return None

    def _chat_turn(self, request, continues: bool) -> list[int]:
        """The tokens of a chat turn: the whole chat rendered, or, continuing a
        session, only the template's difference its new messages make."""
        as_dicts = lambda ms: [{"role": m.role, "content": m.content} for m in ms]  # noqa: E731
        if continues != bool(request.chat_history):
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"session {request.session_id!r}: a chat turn with the conversation so far needs the "
                          f"session's KV or token history" if request.chat_history else
                          f"session {request.session_id!r} holds tokens on replica {self.replica_id} but its "
                          f"turn brings no conversation so far: continue it with a prompt, or start a chat "
                          f"under another session_id")
        tok = self.engine.engine.tokenizer
        try:
            if not request.chat_history:
                return tok.encode_chat(as_dicts(request.messages))
            end = request.reply_end_token_id if request.HasField("reply_end_token_id") else None
            return tok.encode_chat_turn(as_dicts(request.chat_history), as_dicts(request.messages), end)
        except ValueError as e:     # no chat template, or the template refused the conversation
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _prompt(self, request, sid: str | None) -> tuple[list[int], int, list[int]]:
        """(stored history re-prefilled, tokens parked for the session here, this turn's
        tokens). A re-prefill replaces whatever KV this replica parked for the session;
        a parked session continues after its tokens, so its turn gets no second BOS."""
        history = list(request.history_token_ids) if sid else []
        if sid and (request.prompt_token_ids or history):
            await asyncio.to_thread(self.engine.drop_session, sid)
        fresh = not sid or request.prompt_token_ids or history
        held = 0 if fresh else await asyncio.to_thread(self.engine.session_tokens, sid)
        if request.continue_session and not fresh and not held:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"session {sid!r} has no KV parked on replica {self.replica_id} "
                          "(expired or dropped): re-prefill it from its history")
        if request.messages:
            turn = self._chat_turn(request, continues=bool(held or history))
        else:
            turn = list(request.prompt_token_ids) or self.engine.engine.tokenizer.encode(
                request.prompt, add_bos=not (held or history))
        limit = self.engine.engine.max_model_len
        n = len(history) + len(turn)
        if held + n >= limit:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"prompt is {n} tokens after a session context of {held}; the model's max length is "
                          f"{limit}" if held else f"prompt is {n} tokens; the model's max length is {limit}")
        return history, held, turn

    def _refusal_for(self, e: Exception) -> Refusal:
        """The status of an engine error: a session gone from this replica, a request
        the engine refused, or the engine shutting down (try elsewhere) or failing."""
        from services.compute.engine.async_engine import EngineError
        from services.compute.engine.session_cache import SessionNotParked

        if isinstance(e, SessionNotParked):
            return Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                           f"{e} (replica {self.replica_id}): re-prefill it from its history")
        if isinstance(e, EngineError):
            return Refusal(grpc.StatusCode.UNAVAILABLE if "shut" in str(e) else grpc.StatusCode.INTERNAL, str(e))
        return Refusal(grpc.StatusCode.ALREADY_EXISTS if "already running" in str(e)
                       else grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _generate(self, request):
        from services.compute import convert
        from services.compute.engine.async_engine import EngineError
        from services.compute.engine.session_cache import SessionNotParked

        rid, sid = request.request_id, request.session_id or None
        history, held, turn = await self._prompt(request, sid)
        ids = history + turn
        sampling = convert.sampling_params(request.sampling, self.engine.engine.max_model_len - held - len(ids),
                                           resume_session=held > 0)
        eviction = convert.eviction_params(request.eviction)
        span = RequestSpan(trace.get_current_span(), rid, len(ids), eviction, held)
        advised = self.advisor is not None and eviction.policy == "learned"
        if advised:
            self.advisor.set_context(rid, telemetry.inject())
        stream = self.engine.generate_batches(rid, ids, sampling, eviction, session_id=sid)
        timer = get_metrics().request()
        try:
            async for batch in stream:
                resp = convert.chunk(rid, batch, sampling.logprobs)
                if turn is not None:
                    resp.prompt_token_ids.extend(turn)     # on the first message only
                    turn = None
                span.rounds(batch)
                for _ in range(len(resp.response.chunk.token_ids)):
                    timer.token()
                last = batch[-1]
                if not last.finished:
                    yield resp
                    continue
                timer.finish(last.finish_reason or "")
                if resp.response.HasField("chunk"):
                    yield resp
                    resp = convert.response(rid)
                if last.finish_reason == "error":
                    raise Refusal(grpc.StatusCode.INTERNAL, "the engine failed on this request")
                reason = convert.finish_reason(last, self.engine.engine.eos_ids, sampling.ignore_eos)
                convert.finish(resp, reason, last.usage, reprefilled=len(history))
                span.usage(last.usage)
                yield resp
        except (SessionNotParked, ValueError, EngineError) as e:
            refusal = self._refusal_for(e)
            timer.fail(refusal.code.name)
            raise refusal from None
        finally:
            timer.fail("cancelled")     # no-op when the stream finished
            # Closing the engine stream early aborts the sequence (pages freed next step).
            await stream.aclose()
            if advised:
                self.advisor.forget(rid)


class RequestSpan:
    """A request's span attributes and eviction-round events (bounded: a long
    token-level stream has a round per token), and its KV peak in /metrics."""

    def __init__(self, span, rid: str, prompt_tokens: int, eviction, held: int):
        from services.compute.convert import budget_holds

        self.span, self.events = span, 0
        span.set_attribute("kvpop.request_id", rid)
        span.set_attribute("kvpop.prompt_tokens", prompt_tokens)
        span.set_attribute("kvpop.policy", eviction.policy)
        span.set_attribute("kvpop.session_context_tokens", held)
        # When the budget holds decides the request's peak: visible beside kvpop.kv_blocks_peak.
        span.set_attribute("kvpop.budget_holds", budget_holds(eviction))

    def rounds(self, batch) -> None:
        for out in batch:
            for r in out.rounds:
                if self.events < MAX_ROUND_EVENTS:
                    self.span.add_event("eviction_round", r)
                self.events += 1

    def usage(self, u) -> None:
        if u is None:
            return
        self.span.set_attribute("kvpop.eviction_rounds", self.events)
        self.span.set_attribute("kvpop.evicted_blocks", u.kv_blocks_evicted)
        self.span.set_attribute("kvpop.kv_blocks_peak", u.kv_blocks_peak)
        get_metrics().kv_peak.labels(policy=u.policy).observe(u.kv_blocks_peak)
        if u.policy == "learned":
            self.span.set_attribute("kvpop.network_evictions", u.network_evictions)
            self.span.set_attribute("kvpop.fallback_evictions", u.fallback_evictions)


class ComputeApp:
    def __init__(self, servicer: ComputeServicer, service: GrpcService | None = None):
        self.servicer = servicer
        self.service = service
        self.refresher: EngineStatsRefresher | None = None
        self.reporter = None        # ReplicaReporter when KVPOP_REDIS_URL is set

    async def ready(self) -> None:
        await asyncio.to_thread(self.servicer.load, asyncio.get_running_loop())
        if self.servicer.advisor is not None:
            self.servicer.advisor.start()
        # Token counts, pool pages and evictions come from the engine's own stats.
        self.refresher = EngineStatsRefresher(self.servicer.engine.stats).start()
        # A scrape reads the engine then: the periodic copy above lags it by up to its period.
        get_metrics().refresh_engine_on_scrape(self.servicer.engine.stats)
        if self.servicer.cfg.redis_url:
            await self._join_replicas()

    async def _join_replicas(self) -> None:
        """Prefill the prewarm entries, then register in the replica registry."""
        from services.compute.replica import ReplicaReporter

        cfg, s = self.servicer.cfg, self.servicer
        port = self.service.port if self.service is not None else cfg.port
        address = cfg.advertise_address or f"{cfg.host}:{port}"
        # The id the gateway stores in sessions for affinity: the same in Info and the registry.
        s.replica_id = cfg.replica_id or address
        self.reporter = ReplicaReporter(cfg.redis_url, s.replica_id, address, cfg.max_num_seqs,
                                        s.model_info.name, lambda: self.refresher.last, cfg.heartbeat_s)
        entries = await self.reporter.prewarm_entries(cfg.prewarm_top_k)
        prewarm = getattr(s.engine, "prewarm", None)   # AsyncEngine: between steps
        if entries and prewarm is not None:
            # Most counted first, one at a time, within a time budget: a restarted replica must not
            # stay out of service for long to warm its cache (on a GPU all of them fit in it).
            t0, n, done = time.monotonic(), 0, 0
            for e in entries:
                if done and time.monotonic() - t0 >= cfg.prewarm_max_s:
                    break
                n += await asyncio.to_thread(prewarm, [e.text])
                done += 1
            log.info("prewarmed %d of %d prefixes in %.2f s%s", n, len(entries), time.monotonic() - t0,
                     "" if done == len(entries) else f" (KVPOP_PREWARM_MAX_S={cfg.prewarm_max_s:g}: "
                     f"{len(entries) - done} skipped)")
        elif entries:
            log.info("%d prewarm entries found; this engine has no prefix cache to load them", len(entries))
        await self.reporter.start()

    async def watch(self, service: GrpcService) -> None:
        """Keep the capability health names true (the engine serves whatever they say)."""
        while True:
            try:
                advisor = self.servicer.advisor
                await service.set_status(HEALTH_ADVISOR, bool(advisor is not None and advisor.connected))
                if self.reporter is not None and self.reporter.heartbeat is not None:
                    await service.set_status(HEALTH_REDIS, self.reporter.heartbeat.last_ok is True)
            except Exception:  # noqa: BLE001 - health reporting must never take the service down
                log.exception("health watch failed")
            await asyncio.sleep(WATCH_PERIOD_S)

    async def drain(self) -> None:
        self.servicer.draining = True
        if self.reporter is not None:
            await self.reporter.leave()

    async def close(self) -> None:
        if self.reporter is not None:
            await self.reporter.stop()
        if self.refresher is not None:
            await self.refresher.stop()
        s = self.servicer
        if s.advisor is not None:
            await s.advisor.close()
        if s.engine is not None:
            await asyncio.to_thread(s.engine.shutdown)


async def build(cfg: ComputeConfig, service: GrpcService) -> ComputeApp:
    servicer = ComputeServicer(cfg)
    compute_pb2_grpc.add_ComputeServicer_to_server(servicer, service.server)
    service.add(compute_pb2.DESCRIPTOR.services_by_name["Compute"].full_name)
    return ComputeApp(servicer, service)
