"""Eviction decided per block (a token by default), memory paged in larger
pages: rounds compact every row so that its survivors stay packed in
``ceil(blocks / page_blocks)`` pages (sequence.py, eviction.py)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.engine import ScriptedAdvisor, check_invariants, random_prompt, run_all, tiny_engine, tiny_model
from services.compute.engine.engine import EvictionParams, SamplingParams
from services.compute.eviction.evict import Round, evict_rounds
from services.compute.engine.kv_pool import KVPool
from services.compute.engine.sequence import COLUMN_FIELDS, EvictionState, Sequence, append_blocks

POLICIES = ["streaming", "h2o", "tova", "snapkv", "knorm", "keydiff", "learned"]


class _RandomScores:
    """Ranks blocks at random (from its own seeded generator)."""
    uses_keys = False

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def score(self, seq):
        return torch.rand(seq.block_index.shape, generator=self.g)


def _code(i: int, row: int, block: int, offset: int) -> float:
    # Exact in float32: which sequence, row, block and slot a K/V value was written for.
    return float(i * 1_000_000 + row * 10_000 + block * 10 + offset)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_compaction_keeps_every_survivors_kv_position_and_statistics(data):
    L, H, D = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), 2
    bs = data.draw(st.sampled_from([1, 2]))
    c = data.draw(st.sampled_from([1, 2, 4, 16]))
    pool = KVPool(3000, bs * c, D)
    kb, vb = pool.blocks_view(bs)
    seqs, nxt = [], []
    for i in range(data.draw(st.integers(1, 3))):
        # A round slack gives a budgeted sequence spare columns: appends then widen in place.
        state = EvictionState("h2o", budget_blocks=4, floor_blocks=1, sink_blocks=0, recent=0,
                              round_slack=data.draw(st.integers(0, 6)))
        s = Sequence(f"s{i}", [3] * 4, None, state, L, H, D, bs, "cpu", c)
        s.policy = _RandomScores(data.draw(st.integers(0, 99)))
        seqs.append(s)
        nxt.append(0)
    rows = torch.arange(L * H).view(L, H)
    for _ in range(data.draw(st.integers(1, 25))):
        grow = [i for i in range(len(seqs)) if data.draw(st.booleans())]
        if grow:
            ks = [data.draw(st.integers(1, 5)) for _ in grow]
            new_pages = [seqs[i].pages_for(seqs[i].num_blocks + k) - seqs[i].num_row_pages for i, k in zip(grow, ks)]
            pages = [pool.alloc(L * H * p).view(L, H, p) for p in new_pages]
            append_blocks([seqs[i] for i in grow], pages, [nxt[i] for i in grow], ks)
            for i, k in zip(grow, ks):
                s = seqs[i]
                # New columns start with no statistics, whether written in place or rebuilt.
                assert all(not getattr(s, name)[:, :, -k:].any() for name in COLUMN_FIELDS if name != "block_index")
                assert s.block_index[0, 0, -k:].tolist() == list(range(nxt[i], nxt[i] + k))
                cols = list(range(s.num_blocks - k, s.num_blocks))
                addr = s.block_address(cols)                                   # [L, H, k]
                for j, col in enumerate(cols):
                    block = nxt[i] + j
                    for o in range(bs):
                        val = torch.tensor([[_code(i, int(r), block, o) for r in rr] for rr in rows])
                        kb[addr[:, :, j].long(), o] = val[..., None].expand(L, H, D)
                        vb[addr[:, :, j].long(), o] = -val[..., None].expand(L, H, D)
                    s.acc_mass[:, :, col] = float(block)
                s.num_cached += k * bs
                nxt[i] += k
        rounds = [Round(s, data.draw(st.integers(0, s.num_blocks - 1))) for s in seqs if s.num_blocks > 1]
        if rounds and data.draw(st.booleans()):
            evict_rounds(rounds, pool)
        held = 0
        for i, s in enumerate(seqs):
            assert s.num_row_pages == s.pages_for(s.num_blocks)
            held += s.page_table.numel()
            assert torch.equal(s.acc_mass, s.block_index.float())             # statistics travel with their block
            assert bool((s.block_index[..., 1:] > s.block_index[..., :-1]).all())   # position order kept
            addr = s.block_address(slice(0, s.num_blocks)).long()
            for o in range(bs):
                want = (i * 1_000_000 + rows[..., None] * 10_000 + s.block_index.long() * 10 + o).float()
                assert torch.equal(kb[addr, o, 0], want) and torch.equal(vb[addr, o, 1], -want)
        pages = torch.cat([s.pages() for s in seqs])
        assert pool.num_used == held == pages.unique().numel()   # no page lost, none shared by mistake


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11)


def _serve(model, page_size, policy, prompts, budget, block_size=1, session=None, round_slack=0, **protocol):
    # round_slack=0: a round whenever a row is over, at any page size (the pages alone compared).
    advisor = ScriptedAdvisor() if policy == "learned" else None
    engine = tiny_engine(model, advisor=advisor, block_size=block_size, page_size=page_size, num_pages=20000,
                         prefill_chunk=24, round_slack=round_slack)
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp, EvictionParams(policy, budget=budget, sink=4, recent=8, **protocol),
                           session_id=session)
        if session is not None:   # turns one after the other: each continues the parked session
            outs.update(run_all(engine))
    outs.update(run_all(engine))
    if session is not None:
        assert engine.drop_session(session)
    assert engine.pool.num_free == engine.pool.capacity
    return {r: ([o.token_id for o in o_], o_[-1].usage) for r, o_ in outs.items()}


@pytest.mark.parametrize("policy", POLICIES)
def test_pages_of_16_decide_exactly_as_pages_of_one_token(model, policy):
    """Attention over compacted pages is the token-level reference: the same
    policy and budget over pages of 16 tokens and over pages of one token (no
    compaction at all) evict the same tokens and decode the same tokens."""
    prompts = [random_prompt(n, seed=n) for n in (70, 41, 96)]
    paged = _serve(model, 16, policy, prompts, 32)
    token = _serve(model, 1, policy, prompts, 32)
    for rid in token:
        assert paged[rid][0] == token[rid][0], rid
        assert paged[rid][1] == token[rid][1], rid
        assert paged[rid][1].kv_blocks_evicted > 0


@pytest.mark.parametrize("policy", ["h2o", "learned"])
@pytest.mark.parametrize("protocol", [{"after_prompt": True}, {"prefill_allowance": 2.0}, {"session": "s"}])
def test_every_protocol_decides_as_pages_of_one_token(model, policy, protocol):
    """The budget after the prompt (one round over the whole prompt), a
    prefill allowance, and a session's turns (parked rows continued) over
    16-token pages: the same tokens and usage as over one-token pages."""
    prompts = [random_prompt(n, seed=n) for n in (70, 41, 96)]
    paged = _serve(model, 16, policy, prompts, 32, **protocol)
    token = _serve(model, 1, policy, prompts, 32, **protocol)
    assert paged.keys() == token.keys()
    for rid in token:
        assert paged[rid] == token[rid], rid


def test_peak_is_the_budget_plus_one_chunk_and_pages_come_back(model):
    """Held during prefill, a row's pages never exceed those of its budget plus
    one prompt chunk (the pool's own accounting); after the prompt a row runs at
    most one page less one token over its budget (the round slack) before a
    round brings it back, so it holds at most one page more than its budget's;
    every page returns at the end."""
    chunk, budget, prompt = 24, 40, 150
    engine = tiny_engine(model, block_size=1, page_size=16, num_pages=2000, prefill_chunk=chunk)
    rows = engine.scheduler.rows
    engine.add_request("r", random_prompt(prompt, seed=3), SamplingParams(max_tokens=30, ignore_eos=True),
                       EvictionParams("h2o", budget=budget, sink=4, recent=8))
    seen = []
    while engine.has_unfinished():
        engine.step()
        check_invariants(engine)
        if engine.seqs:
            seen.append(engine.pool.num_used)
    assert max(seen) <= math.ceil((budget + chunk) / 16) * rows
    assert engine.pool.peak_used <= math.ceil((budget + chunk) / 16) * rows
    # After the prompt the rows stay within the budget's pages plus one at every step.
    decode = seen[-30:]
    assert max(decode) <= math.ceil((budget + 15) / 16) * rows
    assert min(decode) <= math.ceil(budget / 16) * rows      # and a round brings them back to the budget's
    assert engine.pool.num_used == 0


def test_prefix_cache_pages_are_copied_by_budgeted_sequences(model):
    """Cached pages are shared by dense sequences; a budgeted sequence, which
    compacts its rows in place, takes copies: the cache stays intact, so dense
    requests that come after budgeted ones on the same prefix decode exactly
    as without the cache. (A budgeted one starts from the prewarm's statistics,
    so its evictions may differ from a cold start.)"""
    system = random_prompt(48, seed=7)
    prompts = [system + random_prompt(30, seed=s) for s in (1, 2)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)

    def run(fraction):
        engine = tiny_engine(model, block_size=1, page_size=16, prefix_cache_fraction=fraction)
        if fraction:
            engine.prewarm(system)
        got = {}
        for i, p in enumerate(prompts):      # one after the other: the second hits what the first left
            for policy in ("h2o", "dense"):
                ev = EvictionParams(policy, budget=40 if policy != "dense" else None, sink=4, recent=8)
                engine.add_request(f"{policy}{i}", p, sp, ev)
                got[f"{policy}{i}"] = [o.token_id for o in run_all(engine)[f"{policy}{i}"]]
        return engine, got

    cached, with_cache = run(0.3)
    _, without = run(0.0)
    assert {r: t for r, t in with_cache.items() if r.startswith("dense")} == \
        {r: t for r, t in without.items() if r.startswith("dense")}
    assert cached.stats()["prefix_cache_hits"] == 4 and len(cached.prefix_cache.blocks) == 3


@pytest.mark.parametrize("policy", ["dense", "h2o", "learned"])
def test_the_kernel_path_over_blocks_decides_as_the_torch_path(model, policy):
    """The decode kernel's mass is per entry of its page table: over 16-token
    pages a budgeted batch hands it the pool's blocks view (a table entry per
    block). Run here with the kernels' PyTorch references, it decodes and
    evicts exactly as the torch path."""
    prompts = [random_prompt(n, seed=n) for n in (70, 41)]

    def run(fused):
        advisor = ScriptedAdvisor() if policy == "learned" else None
        engine = tiny_engine(model, advisor=advisor, block_size=1, page_size=16, prefill_chunk=24)
        engine.runner.fused = fused
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=10, ignore_eos=True),
                               EvictionParams(policy, budget=None if policy == "dense" else 32, sink=4, recent=8))
        return {r: ([o.token_id for o in o_], o_[-1].usage) for r, o_ in run_all(engine).items()}

    assert run(True) == run(False)


@pytest.mark.parametrize("policy", ["h2o", "learned"])
def test_rounds_evict_a_page_at_once_within_the_round_slack(model, policy):
    """At the defaults (1-token blocks in 16-token pages) a decoding row runs up
    to 15 tokens over its budget (an eighth of it at most) and a round then
    evicts all of them: a round per 16 decoded tokens, not per token. The row never holds more, and a
    learned sequence's plans come once per round, each ranking every block
    sent."""
    budget, new = 128, 64      # an eighth of the budget is a page: the round slack is a page less one
    advisor = ScriptedAdvisor() if policy == "learned" else None
    engine = tiny_engine(model, advisor=advisor, block_size=1, page_size=16, num_pages=20000, prefill_chunk=24)
    engine.add_request("r", random_prompt(180, seed=5), SamplingParams(max_tokens=new, ignore_eos=True),
                       EvictionParams(policy, budget=budget, sink=4, recent=8))
    held, rounds = [], []
    while engine.has_unfinished():
        engine.step()
        check_invariants(engine)
        seq = engine.seqs.get("r")
        if seq is not None and not seq.in_prefill and not seq.holding:   # held: its last chunk waits for a plan
            held.append(seq.num_blocks)
            rounds.append(seq.eviction_rounds)
    assert max(held) <= budget + 15
    assert min(held[len(held) // 2:]) <= budget        # rounds bring the rows back to the budget
    decode_rounds = rounds[-1] - rounds[0]
    assert 0 < decode_rounds <= -(-new // 16) + 1
    if policy == "learned":
        assert advisor.plans_sent <= -(-180 // 24) + decode_rounds + 2
        assert seq is None or not seq.fallback_evictions


def test_a_sequence_behind_its_plans_evicts_on_the_plan_in_hand(model):
    """Plans that come later than compute waits (here: none is waited for) make
    the first round fall back; later rounds evict along the plan in hand (it
    ranks every block it covers, newer ones are kept) instead of falling back
    for the rest of the request."""
    # Each plan comes 12 steps after its features: later than the next batch (8 tokens on).
    advisor = ScriptedAdvisor(delay=12)
    engine = tiny_engine(model, advisor=advisor, block_size=1, page_size=16, num_pages=20000, prefill_chunk=24,
                         plan_wait_s=0.0)
    engine.add_request("r", random_prompt(180, seed=6), SamplingParams(max_tokens=64, ignore_eos=True),
                       EvictionParams("learned", budget=128, sink=4, recent=8))
    usage = run_all(engine)["r"][-1].usage
    assert usage.fallback_evictions > 0, usage            # the waits ran out (the prompt's rounds)
    assert usage.network_evictions > 0, usage             # the decode rounds evicted along the plans
