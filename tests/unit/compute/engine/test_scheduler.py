"""Continuous batching: admission by pages, max_num_seqs, mixed prefill and
decode steps with a bounded prefill chunk, cleanup shrinking budgets."""
import pytest

from helpers.engine import dense_greedy, random_prompt, run_all, tiny_engine, tiny_model
from helpers.engine import one_thread  # noqa: F401  (autouse: single-threaded tiny tensors)
from services.compute.engine.engine import EvictionParams, SamplingParams

ROWS = 2 * 2  # layers x kv-heads of the tiny model: pages per block


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


def test_admission_by_free_pages(model):
    # Each dense request reserves ceil((10 + 10) / 4) = 5 blocks x 4 rows = 20 pages.
    engine = tiny_engine(model, page_size=4, num_pages=41, cleanup_threshold=1.0)
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = [random_prompt(10, seed=i) for i in range(3)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sp)
    engine.step()
    assert (engine.stats()["running"], engine.stats()["waiting"]) == (2, 1)
    outs = run_all(engine)
    assert [o.token_id for o in outs["2"]] == dense_greedy(model, prompts[2], 10)
    assert engine.pool.peak_used <= 40 and engine.pool.num_free == engine.pool.capacity


def test_request_larger_than_pool_is_refused(model):
    engine = tiny_engine(model, page_size=4, num_pages=41)
    with pytest.raises(ValueError, match="KV pages"):
        engine.add_request("big", random_prompt(50, 1), SamplingParams(max_tokens=50))


def test_max_num_seqs(model):
    engine = tiny_engine(model, max_num_seqs=2)
    for i in range(5):
        engine.add_request(str(i), random_prompt(5 + i, i), SamplingParams(max_tokens=4, ignore_eos=True))
    seen = 0
    while engine.has_unfinished():
        engine.step()
        assert len(engine.scheduler.running) <= 2
        seen = max(seen, len(engine.scheduler.running))
    assert seen == 2 and engine.stats()["finished_requests"] == 5


def test_prefill_chunks_and_decodes_share_a_step(model):
    engine = tiny_engine(model, prefill_chunk=8)
    engine.add_request("a", random_prompt(5, 1), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()                                    # a: whole prompt, first token
    engine.add_request("b", random_prompt(40, 2), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("c", random_prompt(40, 3), SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(5):
        before = {r: s.num_cached for r, s in engine.seqs.items()}
        outs = engine.step()
        fed = {r: s.num_cached - before.get(r, 0) for r, s in engine.seqs.items()}
        assert any(o.request_id == "a" for o in outs), "a decodes in every step"
        assert fed["a"] == 1 and fed["b"] + fed["c"] == 8, fed   # one chunk budget per step
    run_all(engine)


def test_cleanup_shrinks_running_budgets_before_queueing(model):
    """A (decoding, budget 16 blocks) reserves 68 pages (budget + the block a
    decode step opens), B as much, and both share one chunk of overshoot
    headroom (12 pages). 68 + 68 + 12 > 121: without cleanup B would wait.
    With it, A's budget shrinks to its floor (8 blocks), its blocks are
    evicted at once, B runs."""
    engine = tiny_engine(model, page_size=4, num_pages=121, prefill_chunk=8, cleanup_threshold=0.7)
    ev = EvictionParams("h2o", budget=64, sink=4, recent=8)
    sp = SamplingParams(max_tokens=60, ignore_eos=True)
    engine.add_request("a", random_prompt(60, 1), sp, ev)
    while engine.seqs["a"].in_prefill:
        engine.step()
    a = engine.seqs["a"]
    assert a.eviction.budget_blocks == 16 and engine.scheduler.reservation(a) == 68
    engine.add_request("b", random_prompt(60, 2), sp, ev)
    engine.step()
    assert engine.stats()["running"] == 2 and engine.stats()["budget_shrinks"] > 0
    assert a.eviction.budget_blocks == a.eviction.floor_blocks == 8
    assert a.num_blocks <= 8
    outs = run_all(engine)
    assert outs["a"][-1].usage.completion_tokens == outs["b"][-1].usage.completion_tokens == 60
    assert engine.pool.peak_used <= engine.pool.capacity
    assert engine.pool.num_free == engine.pool.capacity


def test_dense_requests_are_queued_not_shrunk(model):
    engine = tiny_engine(model, page_size=4, num_pages=41, cleanup_threshold=0.5)
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    engine.add_request("a", random_prompt(10, 1), sp)
    engine.add_request("b", random_prompt(10, 2), sp, EvictionParams("h2o", budget=16, sink=0, recent=4))
    engine.step()
    # a (20 pages) fills the threshold; b is dense-free but a cannot shrink: b fits anyway in capacity.
    assert engine.stats()["running"] == 2 and engine.stats()["budget_shrinks"] == 0
    run_all(engine)
    assert engine.pool.num_free == engine.pool.capacity


def test_shrink_prices_each_budget_as_a_full_rescan_would(model):
    """_shrink_one prices a candidate budget from the others' reservations
    summed once; in a pressured run (dense, budgeted, in prefill, decoding,
    after_prompt, a budget over the sequence's length) every price it asks
    for equals lowering that budget and recomputing every reservation."""
    engine = tiny_engine(model, page_size=4, num_pages=321, prefill_chunk=8, cleanup_threshold=0.6)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    kinds = [EvictionParams("h2o", budget=32, sink=4, recent=8), None,
             EvictionParams("tova", budget=24, sink=4, recent=8, after_prompt=True),
             EvictionParams("h2o", budget=40, sink=0, recent=4),
             EvictionParams("h2o", budget=240, sink=4, recent=8)]   # twice its length: halved, still whole
    for i in range(10):
        engine.add_request(str(i), random_prompt(30 + 5 * i, i), sp, kinds[i % len(kinds)])
    sched, priced_fast = engine.scheduler, engine.scheduler._lowering_budget
    calls = []

    def rescanned(seq, before, rest, others_budgeted, others_extra):
        st = seq.eviction
        want = None
        if st.budget_blocks is not None:
            old, allowance, b = st.budget_blocks, st.prefill_blocks, st.budget_blocks
            if not st.after_prompt:
                st.prefill_blocks = None
            while b > st.floor_blocks and want is None:
                b = max(st.floor_blocks, (b + st.floor_blocks) // 2)
                st.budget_blocks = b
                if sched.reserved() < before:
                    want = b
            st.budget_blocks, st.prefill_blocks = old, allowance
        got = priced_fast(seq, before, rest, others_budgeted, others_extra)
        assert before == sched.reserved() and got == want, (seq.request_id, got, want)
        calls.append((st.budget_blocks is not None and not sched.may_overshoot(seq), others_budgeted))
        return got

    sched._lowering_budget = rescanned
    run_all(engine)
    assert len(calls) > 20 and sched.budget_shrinks > 0
    assert any(within and others for within, others in calls)   # the shared headroom's case was priced
