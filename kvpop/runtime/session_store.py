"""Session metadata in Redis.

Keys (all under `kvpop:v1:`, values JSON):

- `kvpop:v1:session:<id>` — string, JSON object
  `{"session_id", "model", "replica", "budget", "turns", "tokens", "chat", "created_at", "last_used"}`
  (`replica`: the compute replica that served the last turn, which holds the
  session's KV; `budget`: the request's kv budget as `{"tokens": n}` or
  `{"fraction": f}` or null; `tokens`: length of the token history; times are
  Unix seconds; `chat`: its turns are chat messages, not prompts).
- `kvpop:v1:session:<id>:turns` — list, one JSON object per turn, oldest first:
  `{"request_id", "prompt", "completion", "prompt_token_ids", "completion_token_ids",
  "finish_reason", "messages", "at"}` (`messages`: a chat turn's new
  messages, `[{"role", "content"}]`; its reply is `completion`). The token
  history of the session is the concatenation of every turn's prompt and
  completion token ids.

Both keys expire `ttl_s` after the session's last use. A Redis outage must
never fail a stream: `record_turn` that cannot reach Redis keeps the turn in
memory and `flush_pending` (run periodically) writes it later, in order;
`get` and `token_history` include the turns still queued.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field

from kvpop.runtime.redis_client import KEY_PREFIX, RedisUnavailable, connect, unavailable_as

log = logging.getLogger(__name__)

MAX_PENDING = 10_000


def session_key(session_id: str) -> str:
    return f"{KEY_PREFIX}session:{session_id}"


def turns_key(session_id: str) -> str:
    return f"{KEY_PREFIX}session:{session_id}:turns"


@dataclass
class Turn:
    request_id: str
    prompt: str
    completion: str
    prompt_token_ids: list[int] = field(default_factory=list)
    completion_token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    messages: list[dict] = field(default_factory=list)
    at: float = field(default_factory=time.time)


@dataclass
class Session:
    session_id: str
    model: str = ""
    replica: str = ""
    budget: dict | None = None
    turns: int = 0
    tokens: int = 0
    chat: bool = False
    created_at: float = 0.0
    last_used: float = 0.0


def _length(turn: Turn) -> int:
    return len(turn.prompt_token_ids) + len(turn.completion_token_ids)


def _session(raw: dict) -> Session:
    # Fields a newer writer may add are ignored, not fatal.
    known = {f.name for f in dataclasses.fields(Session)}
    return Session(**{k: v for k, v in raw.items() if k in known})


class SessionStore:
    def __init__(self, url: str, ttl_s: int = 86400, timeout_s: float = 0.5):
        self.redis = connect(url, timeout_s=timeout_s)
        self.ttl_s = ttl_s
        self._pending: deque[tuple[Session, Turn]] = deque()
        self._lock = asyncio.Lock()

    async def get(self, session_id: str) -> Session | None:
        async with self._lock:      # a queued turn is either still queued or written, never neither
            async with unavailable_as("reading session"):
                raw = await self.redis.get(session_key(session_id))
            meta = None if raw is None else _session(json.loads(raw))
            for queued, turn in self._pending:
                if queued.session_id == session_id:
                    base = meta or Session(session_id, created_at=queued.created_at)
                    meta = dataclasses.replace(queued, turns=base.turns + 1, created_at=base.created_at,
                                               tokens=base.tokens + _length(turn))
        return meta

    async def history(self, session_id: str) -> list[Turn]:
        async with self._lock:
            async with unavailable_as("reading session turns"):
                raw = await self.redis.lrange(turns_key(session_id), 0, -1)
            queued = [t for m, t in self._pending if m.session_id == session_id]
        return [Turn(**json.loads(t)) for t in raw] + queued

    async def token_history(self, session_id: str) -> list[int]:
        """Every turn's prompt then completion token ids, oldest first: what a
        replica prefills to take the session over."""
        return [i for t in await self.history(session_id) for i in (*t.prompt_token_ids, *t.completion_token_ids)]

    async def _write(self, meta: Session, turn: Turn) -> None:
        key = session_key(meta.session_id)
        async with unavailable_as("writing session"):
            old = await self.redis.get(key)
            if old is not None:
                prev = json.loads(old)
                meta.created_at = prev.get("created_at") or meta.created_at
                meta.turns = int(prev.get("turns", 0)) + 1
                meta.tokens = int(prev.get("tokens", 0)) + _length(turn)
            else:
                meta.turns, meta.tokens = 1, _length(turn)
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.set(key, json.dumps(asdict(meta)), ex=self.ttl_s)
                pipe.rpush(turns_key(meta.session_id), json.dumps(asdict(turn)))
                pipe.expire(turns_key(meta.session_id), self.ttl_s)
                await pipe.execute()

    async def record_turn(self, session_id: str, turn: Turn, *, model: str = "", replica: str = "",
                          budget: dict | None = None) -> bool:
        """Append a turn and refresh the session; False if it was queued for later."""
        now = time.time()
        meta = Session(session_id=session_id, model=model, replica=replica, budget=budget,
                       chat=bool(turn.messages), created_at=now, last_used=now)
        async with self._lock:
            # Earlier turns that are still waiting go first, so turns stay in order.
            if self._pending or not await self._try_write(meta, turn):
                self._queue(meta, turn)
                return False
        return True

    async def _try_write(self, meta: Session, turn: Turn) -> bool:
        try:
            await self._write(meta, turn)
            return True
        except RedisUnavailable as e:
            log.warning("session %s not stored yet: %s", meta.session_id, e)
            return False

    def _queue(self, meta: Session, turn: Turn) -> None:
        if len(self._pending) >= MAX_PENDING:
            dropped, _ = self._pending.popleft()
            log.error("session store backlog full: dropped a turn of session %s", dropped.session_id)
        self._pending.append((meta, turn))

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def flush_pending(self) -> int:
        """Write queued turns in order; stops at the first failure. Returns how many were written."""
        written = 0
        async with self._lock:
            while self._pending:
                meta, turn = self._pending[0]
                if not await self._try_write(meta, turn):
                    break
                self._pending.popleft()
                written += 1
        return written

    async def ping(self) -> bool:
        try:
            async with unavailable_as("ping"):
                return bool(await self.redis.ping())
        except RedisUnavailable:
            return False

    async def close(self) -> None:
        await self.redis.aclose()
