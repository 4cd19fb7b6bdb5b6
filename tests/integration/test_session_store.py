"""The session store on a real Redis: the record counts turns and tokens and
names the last replica; turns queued while Redis was down are part of the
record and of the token history a re-prefill reads, before and after they are
flushed, never twice."""
from __future__ import annotations

import asyncio

from kvpop.runtime.session_store import SessionStore, Turn


def _turn(i: int, prompt: list[int], completion: list[int]) -> Turn:
    return Turn(request_id=f"r{i}", prompt=f"p{i}", completion=f"c{i}", prompt_token_ids=prompt,
                completion_token_ids=completion, finish_reason="length")


def test_queued_turns_are_in_the_record_and_history(redis_server):
    async def scenario():
        store = SessionStore(redis_server.url, ttl_s=60, timeout_s=0.3)
        try:
            assert await store.record_turn("s", _turn(1, [1, 5, 6], [7, 8]), replica="r-a")
            meta = await store.get("s")
            assert (meta.turns, meta.tokens, meta.replica) == (1, 5, "r-a")

            redis_server.stop()
            assert not await store.record_turn("s", _turn(2, [9], [10, 11]), replica="r-b")
            assert store.pending == 1
            redis_server.start()
            # Back, not flushed yet: the queued turn already counts.
            meta = await store.get("s")
            assert (meta.turns, meta.tokens, meta.replica) == (2, 8, "r-b")
            assert await store.token_history("s") == [1, 5, 6, 7, 8, 9, 10, 11]
            assert await store.flush_pending() == 1 and store.pending == 0
            meta = await store.get("s")
            assert (meta.turns, meta.tokens, meta.replica) == (2, 8, "r-b")
            assert await store.token_history("s") == [1, 5, 6, 7, 8, 9, 10, 11]
            assert await store.get("other") is None and await store.token_history("other") == []
        finally:
            await store.close()

    asyncio.run(scenario())
