"""Gateway: the public KVpop API. Validates, forwards to compute, streams back.

Cancellation and deadlines propagate: the compute call carries the client's
remaining time and is cancelled when the client goes away, so compute aborts
the sequence. Sessions are written to Redis after the stream, off the
response path: a Redis outage delays them (queued, retried), never a stream.
A session's turn continues its resident KV or is re-prefilled from its stored
history (sessions.py); a chat session's turn also brings compute the
conversation so far, read from the store (chats.py).

Access: with API keys (auth.py) each call runs as its key: that key's limits
(admission.py) and its own sessions (ownership.py: stored and continued
under the key's name; another key naming the id gets NOT_FOUND).

Health: "" and `kvpop.v1.KVpop` are SERVING while at least one compute replica
answers SERVING (probed every `PROBE_PERIOD_S` on the channels traffic uses),
so a gateway with no compute behind it says so within a second, and says
SERVING again within a second of one coming back. `kvpop.gateway.redis` is
SERVING while Redis answers (sessions are stored at once rather than queued).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict

import grpc

from kvpop.runtime.config import GatewayConfig
from kvpop.runtime.grpc_server import GrpcService
from kvpop.runtime.metrics import get_metrics
from kvpop.runtime.pb import compute_pb2, generate_pb2, generate_pb2_grpc
from kvpop.runtime.prewarm import PrewarmCounter
from kvpop.runtime.redis_client import RedisUnavailable, connect
from kvpop.runtime.replica_registry import NoReplicaAvailable, ReplicaRegistry
from kvpop.runtime.session_store import Session, SessionStore, Turn
from services.gateway.admission import Admission, Admitted, Refused
from services.gateway.auth import CALLER
from services.gateway.chats import check_kind, continue_chat
from services.gateway.decoding import Malformed, add_kvpop_servicer
from services.gateway.ownership import SessionOwners, scoped
from services.gateway.rates import RETRY_AFTER
from services.gateway.routing import Router
from services.gateway.sessions import HistoryUnavailable, SessionTurn
from services.gateway.streamed import Streamed
from services.gateway.validation import Invalid, validate

log = logging.getLogger(__name__)

# Statuses from compute that mean "compute is not there"; the rest pass through.
_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN}
MAX_OWNERS = 100_000     # sessions whose last replica this gateway remembers
PROBE_PERIOD_S = 0.25    # compute health probes
REDIS_PROBE_PERIOD_S = 1.0
HEALTH_REDIS = "kvpop.gateway.redis"


class GatewayServicer(generate_pb2_grpc.KVpopServicer):
    def __init__(self, cfg: GatewayConfig, store: SessionStore | None):
        self.cfg = cfg
        self.store = store
        # One client for the replica registry and prewarm counts (sessions have their own).
        self.redis = connect(cfg.redis_url) if cfg.redis_url else None
        registry = ReplicaRegistry(self.redis, cfg.heartbeat_s) if self.redis is not None else None
        self.router = Router(cfg.compute_address, registry)
        self.prewarm = PrewarmCounter(self.redis) if self.redis is not None else None
        self.info: compute_pb2.InfoResponse | None = None
        self.admission = Admission(cfg)
        self.owners = SessionOwners(self.redis, cfg.session_ttl_s)
        self._background: set[asyncio.Task] = set()
        self._recording: dict[str, asyncio.Task] = {}      # session id -> its last turn being stored
        # Session id -> replica that served its last turn here: affinity while Redis is unreadable.
        self._owners: OrderedDict[str, str] = OrderedDict()

    async def fetch_info(self, timeout: float = 5.0) -> compute_pb2.InfoResponse:
        self.info = await self.router.info(timeout=timeout)
        return self.info

    async def _session(self, session_id: str) -> Session | None:
        """The session's record (None: new, or unreadable while Redis is down)."""
        if self.store is None:
            return None
        await self._recorded(session_id)
        try:
            return await self.store.get(session_id)
        except RedisUnavailable:
            return None

    async def _recorded(self, session_id: str) -> None:
        """Wait (briefly) until the session's previous turn is stored or queued:
        the next turn reads its owner and history from the store."""
        task = self._recording.get(session_id)
        if task is not None:
            await asyncio.wait({task}, timeout=2.0)

    async def _history(self, session_id: str) -> list[int]:
        if self.store is None:
            raise RedisUnavailable("no session store (KVPOP_REDIS_URL is not set)")
        await self._recorded(session_id)
        return await self.store.token_history(session_id)

    async def _count_prefixes(self, prompt: str) -> None:
        try:
            await self.prewarm.record(prompt)
        except RedisUnavailable as e:
            log.debug("prewarm prefixes not counted: %s", e)

    async def _model_info(self, context) -> generate_pb2.ModelInfo:
        if self.info is None:
            try:
                await self.fetch_info()
            except grpc.aio.AioRpcError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"compute at {self.cfg.compute_address} is unavailable: {e.details()}")
        return self.info.model

    async def GetModelInfo(self, request, context):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        info = generate_pb2.ModelInfo()
        info.CopyFrom(await self._model_info(context))
        info.default_policy = self.cfg.default_policy
        return info

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        info = await self._model_info(context)
        key = CALLER.get()
        try:
            creq = validate(request, self.cfg, info)
            admitted = self.admission.admit(context, key, creq, request.HasField("max_tokens"))
        except Refused as e:
            retry = ((RETRY_AFTER, str(e.retry_after_s)),) if e.retry_after_s else ()
            await context.abort(e.code, e.message, trailing_metadata=retry)
        except Invalid as e:
            await context.abort(e.code, e.message)
        # Started before any await: a client that goes away while its session is
        # looked up is counted like one that goes away mid-stream.
        timer = get_metrics().request()
        inner = self._generate(request, creq, context, timer, admitted)
        try:
            async for r in inner:
                yield r
        except (asyncio.CancelledError, GeneratorExit):
            timer.fail("cancelled")
            raise
        finally:
            timer.fail("incomplete")    # no-op when finish() or fail() already ran
            # Now, not whenever the suspended generator is collected: compute frees the sequence at once.
            await inner.aclose()
            self.admission.release(admitted)

    async def _generate(self, request, creq: compute_pb2.ComputeRequest, context: grpc.aio.ServicerContext,
                        timer, admitted: Admitted):
        remaining = context.time_remaining()
        if self.prewarm is not None and request.prompt:     # chats are not counted (yet)
            self._spawn(self._count_prefixes(request.prompt))
        sid, record, new_messages = await self._open_session(request, creq, context, timer, admitted)
        # Moves to another replica while nothing was streamed (routing.py); a session
        # continues its resident KV or is re-prefilled from its history (sessions.py).
        call = SessionTurn(self.router, creq, remaining, record, self._owners.get(sid),
                           lambda: self._history(sid)) if sid else self.router.open(creq, remaining)
        got = Streamed()
        try:
            async for resp in call:
                n = got.add(resp)
                if n:
                    timer.token(n)
                    self.admission.generated(admitted, n)
                elif resp.response.HasField("finished"):
                    timer.finish(got.finish, got.usage.prompt_tokens, got.usage.completion_tokens)
                yield resp.response
        except (asyncio.CancelledError, GeneratorExit):
            timer.fail("cancelled")
            raise
        except (NoReplicaAvailable, HistoryUnavailable, grpc.aio.AioRpcError) as e:
            code, details = self._status_for(e, call)
            timer.fail(code.name)
            await context.abort(code, details)
        finally:
            # Client cancelled or deadline hit: tell compute so it frees the sequence now.
            await call.aclose()
        log.info("request %s: %s, %d tokens, policy %s, %.0f ms%s", creq.request_id, got.finish or "no final message",
                 len(got.ids), creq.eviction.policy, 1000 * (time.perf_counter() - timer.start),
                 got.note(sid, admitted.key))
        if sid:
            self._turn_done(sid, call, got.turn(creq.request_id, request.prompt, new_messages), creq.eviction)

    async def _open_session(self, request, creq: compute_pb2.ComputeRequest, context, timer,
                            admitted: Admitted) -> tuple[str, Session | None, list[dict]]:
        """(the session id as stored: the key's own (ownership.py), its record, the chat
        messages its turn stores); ("", None, []) without a session."""
        if not request.session_id:
            return "", None, []
        sid = scoped(admitted.key, request.session_id)
        if admitted.key is not None and not await self.owners.claim(request.session_id, admitted.key):
            self.admission.session_refused(admitted)
            timer.fail("NOT_FOUND")
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"API key {admitted.key!r} has no session {request.session_id!r}; session ids "
                                f"are per key and this one is taken: choose another")
        creq.session_id = sid
        record = await self._session(sid)
        return sid, record, await self._chat_turn(request, creq, record, context, timer)

    def _status_for(self, e: Exception, call) -> tuple[grpc.StatusCode, str]:
        """The client's status for a stream that failed: compute's own, or UNAVAILABLE
        (with where) when no replica could take it or the one streaming went away."""
        if isinstance(e, NoReplicaAvailable):
            return grpc.StatusCode.UNAVAILABLE, f"no compute replica can take the request: {e}"
        if isinstance(e, HistoryUnavailable):
            return grpc.StatusCode.UNAVAILABLE, str(e)
        code = e.code()
        if code in _UNAVAILABLE:
            self.info = None    # compute may come back with another model: ask again
            where = call.target.address if call.target else self.cfg.compute_address
            return grpc.StatusCode.UNAVAILABLE, f"compute at {where} is unavailable: {e.details()}"
        return code, e.details() or code.name

    def _turn_done(self, sid: str, call, turn: Turn, ev: compute_pb2.Eviction) -> None:
        """Remembers the replica that served the session's turn and stores the turn, off the response path."""
        replica = call.target.replica_id if call.target and call.target.replica_id != Router.STATIC \
            else (self.info.replica_id if self.info else "")
        self._owners[sid] = replica
        self._owners.move_to_end(sid)
        if len(self._owners) > MAX_OWNERS:
            self._owners.popitem(last=False)
        if self.store is not None:
            task = self._spawn(self._record(sid, turn, ev, replica))
            self._recording[sid] = task
            task.add_done_callback(lambda t: self._recording.pop(sid, None) if self._recording.get(sid) is t
                                   else None)

    async def _chat_turn(self, request, creq: compute_pb2.ComputeRequest, record: Session | None,
                         context, timer) -> list[dict]:
        """A session's turn as a chat (chats.py): the conversation so far from
        the store, only the new messages to render; the messages the turn stores."""
        try:
            check_kind(request, record)
            if not request.messages:
                return []
            if self.store is None:
                raise Invalid("chat sessions need the session store (KVPOP_REDIS_URL is not set): send the "
                              "whole conversation as messages without session_id", grpc.StatusCode.FAILED_PRECONDITION)
            await self._recorded(creq.session_id)
            try:
                turns = await self.store.history(creq.session_id)
            except RedisUnavailable as e:
                raise Invalid(f"the conversation of session {request.session_id!r} cannot be read: {e}",
                              grpc.StatusCode.UNAVAILABLE) from e
            return continue_chat(creq, turns)
        except Invalid as e:
            timer.fail(e.code.name)
            await context.abort(e.code, e.message)

    async def _record(self, session_id: str, turn: Turn, ev: compute_pb2.Eviction, replica: str) -> None:
        which = ev.WhichOneof("budget")
        budget = None if which is None else {"tokens": ev.budget_tokens} if which == "budget_tokens" \
            else {"fraction": ev.budget_fraction}
        info = self.info
        await self.store.record_turn(session_id, turn, model=info.model.name if info else "",
                                     replica=replica, budget=budget)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def close(self) -> None:
        for t in list(self._background):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 2.0)
        await self.router.close()
        if self.redis is not None:
            await self.redis.aclose()


class GatewayApp:
    def __init__(self, cfg: GatewayConfig, servicer: GatewayServicer, store: SessionStore | None):
        self.cfg, self.servicer, self.store = cfg, servicer, store
        self._flusher: asyncio.Task | None = None

    async def ready(self) -> None:
        # SERVING only once compute answered: before that every request would fail.
        delay, last_log = 0.1, 0.0
        while True:
            try:
                info = await self.servicer.fetch_info(timeout=2.0)
                log.info("compute %s serves %s (%s)", self.cfg.compute_address, info.model.name,
                         "placeholder weights" if info.model.placeholder else "trained")
                break
            except grpc.aio.AioRpcError as e:
                if time.monotonic() - last_log > 10:
                    log.info("waiting for compute at %s: %s", self.cfg.compute_address, e.code().name)
                    last_log = time.monotonic()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        if self.store is not None:
            self._flusher = asyncio.create_task(self._flush_loop())

    async def watch(self, service: GrpcService) -> None:
        """Readiness follows compute: SERVING while a replica answers SERVING."""
        loops = [self._watch_compute(service)]
        if self.servicer.redis is not None:
            loops.append(self._watch_redis(service))
        await asyncio.gather(*loops)

    async def _watch_compute(self, service: GrpcService) -> None:
        router = self.servicer.router
        while True:
            started = time.monotonic()
            try:
                serving = await router.probe(timeout=1.0)
                await service.set_serving(any(serving.values()))
            except Exception:  # noqa: BLE001 - the watch must outlive any one failure
                log.exception("compute health probe failed")
            await asyncio.sleep(max(0.0, PROBE_PERIOD_S - (time.monotonic() - started)))

    async def _watch_redis(self, service: GrpcService) -> None:
        while True:
            started = time.monotonic()
            try:
                ok = bool(await asyncio.wait_for(self.servicer.redis.ping(), 1.5))
            except Exception:  # noqa: BLE001 - any failure means "not reachable"
                ok = False
            await service.set_status(HEALTH_REDIS, ok)
            await asyncio.sleep(max(0.0, REDIS_PROBE_PERIOD_S - (time.monotonic() - started)))

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self.store.pending:
                n = await self.store.flush_pending()
                if n:
                    log.info("stored %d queued session turns", n)

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        await self.servicer.close()
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.flush_pending()
            await self.store.close()


async def build(cfg: GatewayConfig, service: GrpcService) -> GatewayApp:
    store = SessionStore(cfg.redis_url, ttl_s=cfg.session_ttl_s) if cfg.redis_url else None
    if store is None:
        log.warning("KVPOP_REDIS_URL is not set: sessions are not stored")
    servicer = GatewayServicer(cfg, store)
    add_kvpop_servicer(servicer, service.server)
    service.add(generate_pb2.DESCRIPTOR.services_by_name["KVpop"].full_name)
    return GatewayApp(cfg, servicer, store)
