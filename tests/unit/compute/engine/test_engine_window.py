"""Mistral's sliding window in the engine: keys older than the window are
masked at decode and at prefill, so greedy decoding equals full recomputation
(forward_dense applies the window) well past the window."""
from __future__ import annotations

import pytest

from helpers.engine import dense_greedy, random_prompt, run_all, tiny_engine, tiny_model
from helpers.engine import one_thread  # noqa: F401  (autouse: single-threaded tiny tensors)
from services.compute.engine.engine import SamplingParams

WINDOW = 8


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, sliding_window=WINDOW)


def test_window_changes_the_outputs(model):
    """Guard: the same weights without the window decode differently, so the
    equality tests below could fail."""
    plain = tiny_model(seed=3)
    prompt = random_prompt(30, seed=1)
    assert dense_greedy(model, prompt, 12) != dense_greedy(plain, prompt, 12)


@pytest.mark.parametrize("block_size,prefill_chunk", [(4, 8), (5, 512), (1, 3)])
def test_greedy_with_window_equals_recomputation(model, block_size, prefill_chunk):
    engine = tiny_engine(model, block_size=block_size, prefill_chunk=prefill_chunk)
    sp = SamplingParams(max_tokens=14, ignore_eos=True)
    prompts = [random_prompt(n, seed=n) for n in (3, 8, 9, 30)]
    for i, p in enumerate(prompts):   # batched: rows past and within the window decode together
        engine.add_request(str(i), p, sp)
    peak = 0
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        # Blocks no future query can see are freed: each row holds O(window), not O(length),
        # and never more than the sequence reserved.
        peak = max([peak] + [s.num_row_pages for s in engine.seqs.values() if not s.in_prefill])
        for s in engine.scheduler.running:
            assert s.page_table.numel() <= engine.scheduler.reservation(s)
    for i, p in enumerate(prompts):
        assert [o.token_id for o in outs[str(i)]] == dense_greedy(model, p, sp.max_tokens), (i, block_size)
        assert outs[str(i)][-1].usage.kv_blocks_evicted == 0
    # In pages: the window's blocks and a partial one at each end, plus the page only partly behind the window.
    c = engine.page_size // block_size
    assert peak <= -(-(-(-WINDOW // block_size) + 2) // c) + 1
    assert engine.pool.num_free == engine.pool.capacity


def test_window_with_prefix_cache_and_sessions(model):
    """A cached prefix is shared only where that does not raise what the
    sequence reserved (long prompts of a windowed model stay O(window) instead);
    outputs are the recomputation's either way, also across a session's turns."""
    engine = tiny_engine(model, block_size=4, page_size=4, prefill_chunk=8, prefix_cache_fraction=0.3)
    system = random_prompt(12, seed=40)
    engine.prewarm(system)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    short, long_ = system + random_prompt(2, seed=41), system + random_prompt(40, seed=42)
    engine.add_request("short", short, sp)
    engine.add_request("long", long_, sp)
    engine.add_request("chat", short, sp, session_id="s")
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o.token_id)
        for s in engine.scheduler.running:   # own pages (shared ones are the cache's)
            assert s.page_table.numel() - s.shared_prefix_blocks * 4 <= engine.scheduler.reservation(s)
    assert engine.stats()["prefix_cache_hits"] == 2          # short and chat; long stayed windowed
    assert outs["short"] == dense_greedy(model, short, 3) and outs["long"] == dense_greedy(model, long_, 3)
    turn = random_prompt(30, seed=43)
    engine.add_request("chat2", turn, SamplingParams(max_tokens=4, ignore_eos=True), session_id="s")
    got = [o.token_id for o in run_all(engine)["chat2"]]
    assert got == dense_greedy(model, short + outs["chat"] + turn, 4)
