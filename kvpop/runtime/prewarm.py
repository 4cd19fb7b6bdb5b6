"""Prewarm entries: the prompt prefixes the gateway sees most often, counted
in Redis, so compute can prefill them at start (before reporting SERVING).

Keys (under `kvpop:v1:`):

- `kvpop:v1:prewarm:counts` — sorted set, member = prefix hash (32 hex chars,
  blake2b-128 of the UTF-8 text), score = how many requests started with it.
- `kvpop:v1:prewarm:text` — hash, field = prefix hash, value = JSON
  `{"hash", "text", "chars", "first_seen"}` (Unix seconds).

Which prefixes of a prompt are counted: an explicit system prompt when the
request has one; otherwise the prompt's first 64, 128, 256, … characters (up
to `max_chars`, strictly shorter than the prompt). A shared system prompt is
thus counted at every power of two it covers, while text that differs per
request never repeats. `top_entries` drops an entry that is a prefix of a
better-ranked one: the prefix cache serves it from the longer entry's blocks.

At most `max_entries` prefixes are kept; the least counted are trimmed.
Counting is best effort: after Redis fails, `record` skips Redis for
`backoff_s` so a gateway under load does not pile up waiting writes.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from kvpop.runtime.redis_client import KEY_PREFIX, RedisUnavailable, unavailable_as

COUNTS_KEY = KEY_PREFIX + "prewarm:counts"
TEXT_KEY = KEY_PREFIX + "prewarm:text"


def prefix_hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()


def candidate_prefixes(prompt: str, system_prompt: str | None = None,
                       min_chars: int = 64, max_chars: int = 4096) -> list[str]:
    if system_prompt:
        return [system_prompt]
    out = []
    n = min_chars
    while n <= max_chars and n < len(prompt):
        out.append(prompt[:n])
        n *= 2
    return out


@dataclass(frozen=True)
class PrewarmEntry:
    hash: str
    text: str
    count: int


class PrewarmCounter:
    def __init__(self, client: aioredis.Redis, max_entries: int = 1000,
                 min_chars: int = 64, max_chars: int = 4096, backoff_s: float = 1.0, clock=time.monotonic):
        """clock: what the backoff is measured on (a test's own clock)."""
        self.redis = client
        self.clock = clock
        self.max_entries = max_entries
        self.min_chars = min_chars
        self.max_chars = max_chars
        self.backoff_s = backoff_s
        self.skipped = 0
        self._skip_until = 0.0

    async def record(self, prompt: str, system_prompt: str | None = None) -> int:
        """Count the prompt's prefixes; returns how many were counted (0 while
        backing off after a failure). Raises RedisUnavailable on the failure."""
        prefixes = candidate_prefixes(prompt, system_prompt, self.min_chars, self.max_chars)
        if not prefixes:
            return 0
        if self.clock() < self._skip_until:
            self.skipped += 1
            return 0
        now = time.time()
        try:
            async with unavailable_as("counting prewarm prefixes"):
                async with self.redis.pipeline(transaction=True) as pipe:
                    for text in prefixes:
                        h = prefix_hash(text)
                        pipe.zincrby(COUNTS_KEY, 1, h)
                        pipe.hsetnx(TEXT_KEY, h, json.dumps(
                            {"hash": h, "text": text, "chars": len(text), "first_seen": now}))
                    pipe.zcard(COUNTS_KEY)
                    size = (await pipe.execute())[-1]
                if size > self.max_entries * 2:
                    await self._trim()
        except RedisUnavailable:
            self._skip_until = self.clock() + self.backoff_s
            raise
        return len(prefixes)

    async def _trim(self) -> None:
        # Trim in batches (at 2x) so the common path costs one round trip.
        drop = await self.redis.zrange(COUNTS_KEY, 0, -self.max_entries - 1)
        if drop:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.zrem(COUNTS_KEY, *drop)
                pipe.hdel(TEXT_KEY, *drop)
                await pipe.execute()

    async def top_entries(self, k: int, min_count: int = 2) -> list[PrewarmEntry]:
        """The k best prefixes: most counted first, the longer of equal counts
        first, none that is a prefix of one already chosen, none seen fewer
        than `min_count` times."""
        if k <= 0:
            return []
        async with unavailable_as("reading prewarm entries"):
            # Look deeper than k: nested prefixes of a chosen entry are skipped.
            ranked = await self.redis.zrevrangebyscore(
                COUNTS_KEY, "+inf", min_count, start=0, num=k * 8, withscores=True)
            if not ranked:
                return []
            values = await self.redis.hmget(TEXT_KEY, [h for h, _ in ranked])
        entries = []
        for (h, score), v in zip(ranked, values):
            if v is None:
                continue
            try:
                text = json.loads(v)["text"]
            except (ValueError, KeyError, TypeError):
                continue
            entries.append(PrewarmEntry(h, text, int(score)))
        entries.sort(key=lambda e: (-e.count, -len(e.text)))
        chosen: list[PrewarmEntry] = []
        for e in entries:
            if any(c.text.startswith(e.text) for c in chosen):
                continue
            chosen.append(e)
            if len(chosen) == k:
                break
        return chosen

    async def clear(self) -> None:
        async with unavailable_as("clearing prewarm entries"):
            await self.redis.delete(COUNTS_KEY, TEXT_KEY)
