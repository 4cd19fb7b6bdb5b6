"""Sessions: a finished turn's KV is parked and the next turn continues from
it. Dense: exactly the greedy continuation of the whole conversation, pages
growing with it. Budgeted: 20 turns in the memory of the budget. Parked
sessions are dropped explicitly, by TTL and under pool pressure."""
from __future__ import annotations

import asyncio
import math

import pytest

from helpers.engine import dense_greedy, random_prompt, run_all, tiny_engine, tiny_model
from helpers.engine import one_thread  # noqa: F401  (autouse: single-threaded tiny tensors)
from services.compute.engine.async_engine import AsyncEngine
from services.compute.engine.engine import EvictionParams, SamplingParams

ROWS = 2 * 2   # layers x kv-heads of tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=7)


def _turn(engine, rid, prompt, sp, eviction=None, session="s"):
    engine.add_request(rid, prompt, sp, eviction, session_id=session)
    outs = run_all(engine)[rid]
    return [o.token_id for o in outs], outs[-1].usage


def test_dense_session_continues_exactly_and_grows(model):
    engine = tiny_engine(model, block_size=4)
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    history = []
    for turn in range(4):
        prompt = random_prompt(3 + 2 * turn, seed=turn)
        got, usage = _turn(engine, f"t{turn}", prompt, sp)
        # The whole conversation so far, recomputed from scratch, gives the same tokens.
        assert got == dense_greedy(model, history + prompt, sp.max_tokens), turn
        assert usage.session_tokens == len(history) and usage.prompt_tokens == len(prompt)
        history += prompt + got
        # Parked: every token but the last generated one is in pages.
        st = engine.stats()
        assert st["sessions_parked"] == 1
        assert st["session_pages"] == math.ceil((len(history) - 1) / engine.page_size) * ROWS == engine.pool.num_used
        assert engine.session_tokens("s") == len(history)
    assert engine.stats()["sessions_continued"] == 3
    assert engine.drop_session("s") and not engine.has_session("s")
    assert engine.pool.num_used == 0


def test_twenty_turns_run_in_the_memory_of_the_budget(model):
    engine = tiny_engine(model, block_size=4, prefill_chunk=16)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    ev = EvictionParams("h2o", budget=32, sink=4, recent=8)   # 8 blocks per row
    total = 0
    for turn in range(20):
        prompt = random_prompt(10, seed=50 + turn)
        engine.add_request(f"t{turn}", prompt, sp, ev, session_id="long")
        seq = engine.seqs[f"t{turn}"]
        while engine.has_unfinished():
            engine.step()
            # Even mid-turn: the parked budget plus one prefill chunk, never more.
            assert engine.pool.num_used <= (8 + math.ceil(16 / 4) + 1) * ROWS
        total += len(prompt) + 8
        assert seq.num_cached == total - 1                 # positions continue across turns
        assert engine.stats()["session_pages"] == engine.pool.num_used <= 8 * ROWS
    assert engine.stats()["sessions_continued"] == 19


def test_abort_drops_the_turn_and_a_queued_turn_keeps_its_session(model):
    engine = tiny_engine(model, block_size=4)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    _turn(engine, "a", random_prompt(9, seed=1), sp)
    assert engine.has_session("s")
    engine.add_request("b", random_prompt(4, seed=2), sp, session_id="s")   # claims it
    assert not engine.drop_session("s")            # queued turn: not dropped under it
    engine.abort("b")
    run_all(engine)
    assert engine.has_session("s")                 # aborted before admission: still parked
    engine.add_request("c", random_prompt(4, seed=3), SamplingParams(max_tokens=50, ignore_eos=True),
                       session_id="s")
    for _ in range(3):
        engine.step()
    engine.abort("c")
    run_all(engine)
    assert not engine.has_session("s") and engine.pool.num_used == 0   # an aborted turn is not kept


def test_ttl_and_pool_pressure_drop_parked_sessions(model):
    engine = tiny_engine(model, block_size=4, page_size=4, num_pages=400, session_ttl_s=30, prefix_cache_fraction=0)
    now = [0.0]     # the sessions' clock: a session expires when the test says, however slow the machine
    engine.sessions.clock = lambda: now[0]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(3):
        _turn(engine, f"p{i}", random_prompt(40, seed=i), sp, session=f"s{i}")
    used = engine.pool.num_used
    assert engine.stats()["sessions_parked"] == 3 and used == 3 * math.ceil(43 / engine.page_size) * ROWS
    # A request that needs most of the pool: the least recently used sessions go first.
    engine.add_request("big", random_prompt(300, seed=9), SamplingParams(max_tokens=20, ignore_eos=True))
    run_all(engine)
    assert not engine.has_session("s0") and engine.has_session("s2")
    assert engine.stats()["sessions_dropped"] >= 1
    now[0] += 29
    assert engine.has_session("s2")                  # within its TTL
    now[0] += 2
    assert not engine.has_session("s2") and engine.pool.num_used == 0
    assert engine.stats()["sessions_expired"] >= 1


def test_session_too_long_for_the_model_is_refused(model):
    engine = tiny_engine(model, block_size=4, max_model_len=40)
    _turn(engine, "a", random_prompt(20, seed=1), SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="session 's' holds 25 tokens"):
        engine.add_request("b", random_prompt(10, seed=2), SamplingParams(max_tokens=10), session_id="s")
    assert engine.has_session("s")


def test_async_engine_sessions(model):
    aengine = AsyncEngine(tiny_engine(model, block_size=4))
    sp = SamplingParams(max_tokens=4, ignore_eos=True, session_id="chat")

    async def turn(rid, prompt):
        return [o async for o in aengine.generate(rid, prompt, sp)]

    try:
        first = asyncio.run(turn("a", random_prompt(6, seed=1)))
        assert aengine.has_session("chat")
        second = asyncio.run(turn("b", random_prompt(5, seed=2)))
        assert second[-1].usage.session_tokens == 6 + len(first)
        assert aengine.drop_session("chat") and not aengine.has_session("chat")
        assert aengine.stats()["pages_used"] == 0
    finally:
        aengine.shutdown()
