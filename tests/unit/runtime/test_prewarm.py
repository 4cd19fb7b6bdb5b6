"""Prewarm entries against a real redis-server."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from kvpop.runtime.prewarm import (
    COUNTS_KEY, TEXT_KEY, PrewarmCounter, candidate_prefixes, prefix_hash,
)
from kvpop.runtime.redis_client import RedisUnavailable, connect

SYSTEM = ("You are a careful assistant. Track every register, show each step of the "
          "arithmetic, and answer with the final value only. ") * 2   # 246 chars


def run(coro):
    return asyncio.run(coro)


def test_candidate_prefixes():
    assert candidate_prefixes("x" * 300) == ["x" * 64, "x" * 128, "x" * 256]
    assert candidate_prefixes("x" * 64) == []          # strictly shorter than the prompt
    assert candidate_prefixes("short", system_prompt="SYS") == ["SYS"]
    assert len(candidate_prefixes("y" * 100_000, max_chars=4096)[-1]) == 4096


def test_repeated_system_prompt_is_the_top_entry(redis_server):
    rng = random.Random(0)

    async def go():
        client = connect(redis_server.url)
        counter = PrewarmCounter(client)
        for i in range(40):
            user = " ".join(str(rng.randrange(1000)) for _ in range(rng.randrange(20, 60)))
            await counter.record(SYSTEM + f"[{i:02d}] " + user)
        for i in range(5):
            await counter.record(f"unrelated prompt number {i} " + "z" * 200)
        top = await counter.top_entries(3)
        # The 128-char prefix is the longest power of two inside the shared 246
        # chars; its 64-char prefix is covered by it and not listed twice.
        assert top[0].text == SYSTEM[:128] and top[0].count == 40
        assert all(not e.text.startswith(top[0].text[:64]) for e in top[1:])
        assert all(e.count >= 2 for e in top)
        # Stored as documented: plain JSON, namespaced keys.
        raw = json.loads(await client.hget(TEXT_KEY, prefix_hash(SYSTEM[:128])))
        assert raw["text"] == SYSTEM[:128] and raw["chars"] == 128
        assert await client.zscore(COUNTS_KEY, prefix_hash(SYSTEM[:128])) == 40
        await client.aclose()
    run(go())


def test_explicit_system_prompt_and_min_count(redis_server):
    async def go():
        client = connect(redis_server.url)
        counter = PrewarmCounter(client)
        await counter.record("hello", system_prompt="SYS-A")
        assert await counter.top_entries(5) == []          # seen once: below min_count
        await counter.record("again", system_prompt="SYS-A")
        await counter.record("x", system_prompt="SYS-B")
        top = await counter.top_entries(5, min_count=1)
        assert [(e.text, e.count) for e in top] == [("SYS-A", 2), ("SYS-B", 1)]
        assert await counter.top_entries(0) == []
        await counter.clear()
        assert await counter.top_entries(5, min_count=1) == []
        await client.aclose()
    run(go())


def test_trim_keeps_the_most_counted(redis_server):
    async def go():
        client = connect(redis_server.url)
        counter = PrewarmCounter(client, max_entries=5)
        for _ in range(3):
            await counter.record("", system_prompt="KEEP")
        for i in range(12):
            await counter.record("", system_prompt=f"once-{i}")
        assert await client.zcard(COUNTS_KEY) <= 10
        assert await client.hlen(TEXT_KEY) == await client.zcard(COUNTS_KEY)
        assert (await counter.top_entries(1))[0].text == "KEEP"
        await client.aclose()
    run(go())


def test_redis_down_is_a_clear_exception(redis_server):
    async def go():
        client = connect(redis_server.url, timeout_s=0.3)
        now = [0.0]     # the backoff's clock: it ends when the test says, however slow the machine
        counter = PrewarmCounter(client, backoff_s=0.5, clock=lambda: now[0])
        await counter.record("p" * 100)
        redis_server.stop()
        with pytest.raises(RedisUnavailable):
            await counter.record("p" * 100)
        with pytest.raises(RedisUnavailable):
            await counter.top_entries(3)
        # Within the backoff after a failure, records are skipped without touching Redis
        # (it is down: touching it would raise).
        now[0] += 0.4
        assert await counter.record("p" * 100) == 0 and counter.skipped == 1
        redis_server.start()   # appendonly: the counts survive the restart
        now[0] += 0.2
        assert await counter.record("p" * 100) == 1
        assert (await counter.top_entries(1))[0].count == 2
        await client.aclose()
    run(go())
