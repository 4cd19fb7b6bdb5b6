"""Prefix cache: a prewarmed system prompt is reused by reference across
requests (hit rate, identical greedy outputs, pages back), shared pages are
never written or freed under a holder, the cache stays within its bound and
gives its pages up under pool pressure."""
from __future__ import annotations

import torch

from helpers.engine import dense_greedy, random_prompt, run_all, tiny_engine, tiny_model
from helpers.engine import one_thread  # noqa: F401  (autouse: single-threaded tiny tensors)
from services.compute.engine.engine import EvictionParams, SamplingParams

import pytest

SP = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


def _serve(engine, prompts, sp=SP, eviction=None):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp, eviction)
    outs = run_all(engine)
    return [[o.token_id for o in outs[f"r{i}"]] for i in range(len(prompts))]


def test_repeated_system_prompt_hits_and_changes_nothing(model):
    system = random_prompt(42, seed=1)
    prompts = [system + random_prompt(1 + i % 7, seed=100 + i) for i in range(100)]
    plain = tiny_engine(model, page_size=4, prefix_cache_fraction=0.0)
    expected = _serve(plain, prompts)

    engine = tiny_engine(model, page_size=4, prefix_cache_fraction=0.2)
    assert engine.prewarm(system) == 1
    cache = engine.prefix_cache
    assert len(cache.blocks) == 42 // engine.page_size and engine.pool.num_used == cache.num_pages
    before = engine.counters["prompt_tokens"]
    assert _serve(engine, prompts) == expected
    st = engine.stats()
    assert st["prefix_cache_queries"] == 100 and st["prefix_cache_hit_rate"] >= 0.95
    # Every request reused the 10 full blocks: only its own tokens were prefilled.
    assert engine.counters["prompt_tokens"] - before == sum(len(p) for p in prompts) - 100 * 40
    # Pages all back, except the cache's own, each held once (by the cache).
    assert engine.pool.num_used == cache.num_pages == st["prefix_cache_pages"]
    held = torch.stack([b.pages for b in cache.blocks.values()]).long().flatten()
    assert engine.pool.refs[held].eq(1).all()
    assert int(engine.pool.refs.sum()) == cache.num_pages


def test_budgeted_request_gets_the_statistics_and_evicts_shared_pages(model):
    system = random_prompt(64, seed=2)
    engine = tiny_engine(model, page_size=4, prefix_cache_fraction=0.2)
    engine.prewarm([system])
    cache = engine.prefix_cache
    pages_before = {b.key: b.pages.clone() for b in cache.blocks.values()}
    seq = engine.make_sequence("b", system + random_prompt(30, seed=3), SamplingParams(max_tokens=20, ignore_eos=True),
                               EvictionParams("h2o", budget=32, sink=4, recent=8))
    engine.add_sequence(seq)
    engine.step()   # admitted: starts from cached blocks with their statistics
    assert seq.prefix_blocks == 8 and seq.acc_mass[:, :, :seq.prefix_blocks].sum() > 0
    outs = run_all(engine)
    assert outs["b"][-1].usage.kv_blocks_evicted > 0
    # The cache's blocks survived the sequence evicting and finishing, unchanged.
    assert {b.key: b.pages for b in cache.blocks.values()}.keys() == pages_before.keys()
    for b in cache.blocks.values():
        assert torch.equal(b.pages, pages_before[b.key])
    assert engine.pool.num_used == cache.num_pages


def test_shared_pages_are_never_written(model):
    system = random_prompt(16, seed=4)
    engine = tiny_engine(model, page_size=4, prefix_cache_fraction=0.2)
    engine.prewarm(system)
    pages = torch.stack([b.pages for b in engine.prefix_cache.blocks.values()]).long().flatten()
    k_before = engine.pool.k_pages[pages].clone()
    # Prompts equal to the prefix (one token short of a hit on the last block) and longer ones.
    _serve(engine, [system, system + [7], system + random_prompt(9, seed=5)], SamplingParams(max_tokens=9, ignore_eos=True))
    assert torch.equal(engine.pool.k_pages[pages], k_before)


def test_bounded_lru_and_released_under_pool_pressure(model):
    engine = tiny_engine(model, page_size=4, num_pages=600, prefix_cache_fraction=0.25)   # 4 pages per block
    cache = engine.prefix_cache
    assert cache.max_pages == 149
    for i in range(6):
        engine.prewarm(random_prompt(40, seed=20 + i))   # 10 blocks = 40 pages each
        assert cache.num_pages <= cache.max_pages
    assert len(cache.blocks) == 37
    # The most recent prompt is whole; the oldest ones lost their tails first.
    last = random_prompt(40, seed=25)
    assert len(cache.lookup(last, 10, count=False)) == 10
    # A dense request needing most of the pool: the cache gives its pages up.
    big = random_prompt(500, seed=9)
    out = _serve(engine, [big], SamplingParams(max_tokens=40, ignore_eos=True))
    assert len(out[0]) == 40
    assert engine.pool.num_used == cache.num_pages < 149


def test_async_engine_prewarm_texts_then_hits(model):
    import asyncio

    from helpers.engine import default_tokenizer
    from services.compute.engine.async_engine import AsyncEngine

    tok = default_tokenizer()
    aengine = AsyncEngine(tiny_engine(model, page_size=4, tokenizer=tok, prefix_cache_fraction=0.2))
    system = "You are a careful assistant. Answer briefly. "
    try:
        # "ab" + BOS: no full block; out-of-vocabulary ids: skipped, never raised
        assert aengine.prewarm([system, "ab", [10**6] * 8]) == 1
        assert aengine.stats()["prefix_cache_blocks"] == len(tok.encode(system)) // aengine.engine.page_size

        async def ask(rid, text):
            return [o async for o in aengine.generate(rid, tok.encode(system + text), SP)]

        asyncio.run(ask("q", "What is 2+2?"))
        st = aengine.stats()
        assert st["prefix_cache_hits"] == 1 and st["prefix_cache_hit_tokens"] == st["prefix_cache_blocks"] * 4
        assert st["generated_tokens"] == SP.max_tokens and st["finished_requests"] == 1   # prewarm not counted
    finally:
        aengine.shutdown()


def test_prewarm_beside_running_requests_loses_no_output(model):
    engine = tiny_engine(model, page_size=4, prefix_cache_fraction=0.2)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    prompt = random_prompt(10, seed=8)
    engine.add_request("busy", prompt, sp)
    first = engine.step()
    assert engine.prewarm(random_prompt(20, seed=9)) == 1      # queued, not driven here
    assert not engine.prefix_cache.blocks
    outs = run_all(engine)
    assert list(outs) == ["busy"]                              # the prewarm streamed nothing
    assert [o.token_id for o in first + outs["busy"]] == dense_greedy(model, prompt, sp.max_tokens)
    assert len(engine.prefix_cache.blocks) == 5


def test_snapkv_request_on_a_prewarmed_prefix_carries_the_window_mass(model):
    """Prewarmed blocks keep a one-slot window (their prefill ran as h2o); a
    snapkv request's ring has SNAPKV_WINDOW slots: the cached window mass
    lands in one slot, so its score (the ring's sum) is what was cached."""
    from services.compute.engine.sequence import SNAPKV_WINDOW
    system = random_prompt(64, seed=2)
    engine = tiny_engine(model, page_size=4, prefix_cache_fraction=0.2)
    engine.prewarm([system])
    cached = sum(float(b.stats["win_mass"].sum()) for b in engine.prefix_cache.blocks.values())
    assert cached > 0
    seq = engine.make_sequence("s", system + random_prompt(30, seed=3), SamplingParams(max_tokens=20, ignore_eos=True),
                               EvictionParams("snapkv", budget=32, sink=4, recent=8))
    assert seq.win_mass.shape[3] == SNAPKV_WINDOW
    probe = engine.make_sequence("p", list(seq.prompt_ids), SamplingParams(max_tokens=1),
                                 EvictionParams("snapkv", budget=32, sink=4, recent=8))
    blocks = engine.prefix_cache.lookup(probe.prompt_ids, 8, need_stats=True, count=False)
    engine.prefix_cache.attach(probe, blocks)
    carried = sum(float(b.stats["win_mass"].sum()) for b in blocks)
    assert len(blocks) == 8 and carried > 0 and float(probe.win_mass.sum()) == pytest.approx(carried, rel=1e-5)
    engine.pool.free(probe.pages())
    engine.add_sequence(seq)
    outs = run_all(engine)
    assert seq.prefix_blocks == 8 and outs["s"][-1].usage.kv_blocks_evicted > 0
    assert engine.pool.num_used == engine.prefix_cache.num_pages
