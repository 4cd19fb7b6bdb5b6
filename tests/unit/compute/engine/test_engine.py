"""LLMEngine and AsyncEngine on tiny random models: exactness against
no-cache recomputation, batch invariance, stop conditions, bounded memory with
eviction, the advisor protocol, cancellation."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch

from helpers.engine import (ScriptedAdvisor, dense_greedy, default_tokenizer, random_prompt, run_all, tiny_engine,
                            tiny_model)
from helpers.engine import one_thread  # noqa: F401  (autouse: single-threaded tiny tensors)
from services.compute.engine.async_engine import AsyncEngine
from services.compute.engine.engine import EvictionParams, SamplingParams
from services.compute.eviction.evict import overshoot

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=0)


@pytest.mark.parametrize("block_size,prefill_chunk", [(1, 7), (4, 8), (16, 512), (5, 16)])
def test_greedy_dense_equals_recomputation(model, block_size, prefill_chunk):
    engine = tiny_engine(model, block_size=block_size, prefill_chunk=prefill_chunk)
    for n in (1, 9, 37):
        prompt = random_prompt(n, seed=n)
        got = [o.token_id for o in engine.generate(prompt, GREEDY)]
        assert got == dense_greedy(model, prompt, GREEDY.max_tokens), (n, block_size)
    assert engine.pool.num_free == engine.pool.capacity


@pytest.mark.parametrize("policy", ["h2o", "snapkv", "learned"])
def test_eviction_machinery_with_room_to_spare_changes_nothing(model, policy):
    """A budget larger than the sequence: the statistics path (attention with
    block mass, rounds, features) runs but evicts nothing, and decoding is
    still exactly the no-cache greedy continuation."""
    engine = tiny_engine(model, block_size=4, prefill_chunk=8, advisor=ScriptedAdvisor())
    prompt = random_prompt(30, seed=11)
    outs = list(engine.generate(prompt, GREEDY, EvictionParams(policy, budget=64, sink=4, recent=8)))
    assert [o.token_id for o in outs] == dense_greedy(model, prompt, GREEDY.max_tokens)
    assert outs[-1].usage.kv_blocks_evicted == 0


@pytest.mark.parametrize("block_size", [3, 5, 16])
def test_budgeted_prefill_with_room_to_spare_gives_dense_logprobs(model, block_size):
    """The statistics path of a prefill chunk masks only the chunk's own blocks
    (older blocks are visible to all its queries): with chunks that start
    inside a block, every step's logprob still equals the dense path's (greedy
    tokens alone would not see a wrongly masked slot)."""
    sampling = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=True)
    prompt = random_prompt(41, seed=5)
    got = {}
    for policy, budget in (("dense", None), ("h2o", 256)):
        engine = tiny_engine(model, block_size=block_size, prefill_chunk=8)
        outs = list(engine.generate(prompt, sampling, EvictionParams(policy, budget=budget, sink=4, recent=8)))
        assert outs[-1].usage.kv_blocks_evicted == 0
        got[policy] = ([o.token_id for o in outs], [o.logprob for o in outs])
    assert got["h2o"][0] == got["dense"][0]
    assert max(abs(a - b) for a, b in zip(got["h2o"][1], got["dense"][1])) < 1e-5


def test_batch_of_16_equals_alone(model):
    """Different prompt lengths, joining at different steps, greedy and seeded
    sampling: every request gets exactly the tokens it gets alone."""
    params = [SamplingParams(max_tokens=10, ignore_eos=True) if i % 2 else
              SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=100 + i,
                             ignore_eos=True)
              for i in range(16)]
    prompts = [random_prompt(3 + 5 * i, seed=i) for i in range(16)]
    alone = []
    for p, sp in zip(prompts, params):
        engine = tiny_engine(model, prefill_chunk=16)
        alone.append([o.token_id for o in engine.generate(p, sp)])

    engine = tiny_engine(model, prefill_chunk=16)
    outs: dict[str, list[int]] = {}
    joined = 0
    for step in range(1000):
        # Two requests join every step: they meet others mid-prefill and mid-decode.
        for _ in range(2):
            if joined < 16:
                engine.add_request(str(joined), prompts[joined], params[joined])
                joined += 1
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o.token_id)
        if joined == 16 and not engine.has_unfinished():
            break
    assert max(engine.scheduler.running.__len__(), 0) == 0
    for i in range(16):
        assert outs[str(i)] == alone[i], i
    assert engine.pool.num_free == engine.pool.capacity


def test_stop_string_is_not_emitted_and_text_matches_tokens(model):
    tok = default_tokenizer()
    engine = tiny_engine(model, tokenizer=tok)
    prompt = tok.encode("hello")
    free = list(engine.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True)))
    text = "".join(o.text_delta for o in free)
    assert text == tok.decode([o.token_id for o in free])
    assert len(text) >= 6
    stop = text[3:5]
    cut = text.index(stop)
    outs = list(engine.generate(prompt, SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,))))
    assert "".join(o.text_delta for o in outs) == text[:cut]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert len(outs) < 30


def test_held_back_stop_prefix_is_released(model):
    """Text that starts a stop string is held back, and released once it can
    no longer become one (or at the end)."""
    tok = default_tokenizer()
    engine = tiny_engine(model, tokenizer=tok)
    prompt = tok.encode("abc")
    sp = SamplingParams(max_tokens=25, ignore_eos=True)
    free = list(engine.generate(prompt, sp))
    text = "".join(o.text_delta for o in free)
    i = next(i for i, o in enumerate(free) if o.text_delta)
    upto = "".join(o.text_delta for o in free[:i + 1])
    never = upto[-1] + "\u2603"        # its first char occurs, the snowman never does
    outs = list(engine.generate(prompt, SamplingParams(max_tokens=25, ignore_eos=True, stop=(never, "\u2604"))))
    assert "".join(o.text_delta for o in outs) == text
    assert outs[-1].finish_reason == "length"
    # Token i streams upto[-1] without a stop string, and holds it back with one.
    assert "".join(o.text_delta for o in outs[:i + 1]) == upto[:-1]


def test_max_tokens_eos_and_usage(model):
    engine = tiny_engine(model)
    prompt = random_prompt(10, seed=3)
    outs = list(engine.generate(prompt, SamplingParams(max_tokens=7, ignore_eos=True)))
    assert len(outs) == 7 and outs[-1].finish_reason == "length"
    u = outs[-1].usage
    assert (u.prompt_tokens, u.completion_tokens, u.policy, u.kv_blocks_evicted) == (10, 7, "dense", 0)
    # 16 tokens cached (the 7th is sampled, never fed back) in blocks of 4, x 2 layers x 2 kv-heads.
    assert u.kv_blocks_resident == math.ceil(16 / 4) * 2 * 2
    assert u.kv_blocks_peak == u.kv_blocks_resident          # dense only grows
    # Make EOS the greedy first token: the request stops there, with reason "stop".
    first = outs[0].token_id
    engine.eos_ids = {first}
    outs = list(engine.generate(prompt, SamplingParams(max_tokens=7)))
    assert [o.token_id for o in outs] == [first] and outs[0].finish_reason == "stop"


def test_invalid_requests_raise_clear_errors(model):
    engine = tiny_engine(model)
    bad = [
        (dict(prompt_token_ids=[]), "empty"),
        (dict(prompt_token_ids=[5, 999]), "token ids"),
        (dict(sampling=SamplingParams(max_tokens=0)), "max_tokens"),
        (dict(sampling=SamplingParams(top_p=0.0)), "top_p"),
        (dict(sampling=SamplingParams(max_tokens=5000)), "max length"),
        (dict(eviction=EvictionParams("nope", budget=64)), "unknown policy"),
        (dict(eviction=EvictionParams("h2o")), "needs a budget"),
        (dict(eviction=EvictionParams("h2o", budget=8, sink=4, recent=8)), "too small"),
        (dict(eviction=EvictionParams("h2o", budget=1.5)), "fraction"),
        (dict(eviction=EvictionParams("h2o", budget=64, block_size=8)), "block_size"),
    ]
    for kwargs, words in bad:
        args = dict(request_id="x", prompt_token_ids=[5, 6, 7]) | kwargs
        with pytest.raises(ValueError, match=words):
            engine.add_request(**args)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "learned"])
def test_long_prompt_is_served_in_bounded_memory(model, policy):
    """A 600-token prompt with a 48-token budget: eviction between prefill
    chunks keeps the pool footprint at budget + one chunk + slack."""
    bs, chunk, budget = 4, 32, 48
    engine = tiny_engine(model, block_size=bs, prefill_chunk=chunk, num_pages=4000)
    outs = list(engine.generate(random_prompt(600, seed=9), SamplingParams(max_tokens=20, ignore_eos=True),
                                EvictionParams(policy, budget=budget, sink=4, recent=8)))
    assert len(outs) == 20
    rows = 2 * 2
    slack = engine.config.plan_slack_blocks if policy == "learned" else 0
    bound = (budget // bs + chunk // bs + 1 + slack) * rows
    assert engine.pool.peak_used <= bound
    dense_pages = math.ceil(620 / bs) * rows
    assert engine.pool.peak_used < dense_pages / 4
    assert outs[-1].usage.kv_blocks_resident <= (budget // bs + slack) * rows
    assert outs[-1].usage.kv_blocks_evicted > 0
    assert engine.pool.num_free == engine.pool.capacity


def test_abort_frees_pages_at_next_step(model):
    engine = tiny_engine(model)
    engine.add_request("a", random_prompt(20, 1), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", random_prompt(20, 2), SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        engine.step()
    used = engine.pool.num_used
    assert used > 0
    engine.abort("a")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert aborted and aborted[0].finish_reason == "abort" and aborted[0].finished
    assert "a" not in engine.seqs
    run_all(engine)
    assert engine.pool.num_free == engine.pool.capacity
    assert engine.stats()["finished_requests"] == 2


def test_learned_waits_for_plans_and_counts_fallback_by_reason(model):
    """One protocol for every advisor: a learned sequence over its budget is
    held (alone) until a fresh plan comes, so a plan three steps late gives
    exactly the evictions and tokens of a prompt one, all from the network.
    A silent advisor is waited out (reason no_plan), a down or absent one is
    not waited for (advisor_down); no row ever exceeds budget + slack + one
    prefill chunk, and every page comes back."""
    prompt = random_prompt(80, seed=4)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    ev = EvictionParams("learned", budget=32, sink=4, recent=8)
    results, tokens = {}, {}
    for name, advisor in [("prompt", ScriptedAdvisor()), ("late", ScriptedAdvisor(delay=3)),
                          ("silent", ScriptedAdvisor(silent=True)), ("down", ScriptedAdvisor(connected=False)),
                          ("absent", None)]:
        engine = tiny_engine(model, advisor=advisor, prefill_chunk=8, plan_wait_s=0.0 if name == "silent" else 60.0)
        engine.add_request("r", prompt, sp, ev)
        worst, outs = 0, []
        while engine.has_unfinished():
            outs += engine.step()
            seq = engine.seqs.get("r")
            if seq is not None:
                worst = max(worst, seq.num_blocks)
        usage = outs[-1].usage
        results[name], tokens[name] = usage, [o.token_id for o in outs]
        assert worst <= 32 // 4 + engine.config.plan_slack_blocks + 8 // 4, name
        assert usage.kv_blocks_evicted > 0, name
        assert engine.pool.num_free == engine.pool.capacity
        assert usage.kv_blocks_evicted == (usage.network_evictions + usage.fallback_evictions
                                           + usage.advisor_heuristic_evictions), usage
    for name in ("prompt", "late"):
        assert results[name].network_evictions == results[name].kv_blocks_evicted, results[name]
        assert results[name].fallback_reasons == {}
    assert tokens["late"] == tokens["prompt"]
    assert results["late"].kv_blocks_evicted == results["prompt"].kv_blocks_evicted
    assert results["silent"].fallback_reasons == {"no_plan": results["silent"].kv_blocks_evicted}
    for name in ("down", "absent"):
        assert results[name].fallback_reasons == {"advisor_down": results[name].kv_blocks_evicted}, name
    # Fallback ranks with h2o: the same evictions as a plain h2o request.
    h2o = tiny_engine(model, prefill_chunk=8)
    ref = list(h2o.generate(prompt, sp, EvictionParams("h2o", budget=32, sink=4, recent=8)))
    assert [o.token_id for o in ref] == tokens["absent"]


def test_learned_round_events_and_stats(model):
    """Eviction rounds are reported on the outputs (trace events) with their
    source and plan age, and the engine's stats split evictions by source."""
    # A plan per block (plan interval = block size): every round waits for its own plan.
    engine = tiny_engine(model, advisor=ScriptedAdvisor(delay=1), prefill_chunk=8, plan_interval=4)
    outs = list(engine.generate(random_prompt(60, seed=7), SamplingParams(max_tokens=20, ignore_eos=True),
                                EvictionParams("learned", budget=24, sink=4, recent=4)))
    rounds = [r for o in outs for r in o.rounds]
    assert rounds and all(r["sources"] == "network" for r in rounds), rounds
    assert sum(r["blocks"] for r in rounds) == outs[-1].usage.kv_blocks_evicted
    # Held until its plan comes, every round runs before the next forward: age 0.
    assert all(r["plan_age_steps"] == 0 and r["held_ms"] >= 0 for r in rounds), rounds
    s = engine.stats()
    assert s["evictions_by_source"] == {("learned", "network", ""): outs[-1].usage.kv_blocks_evicted}
    assert s["network_evictions"] == s["learned_evictions"] == outs[-1].usage.kv_blocks_evicted


def test_stats(model):
    engine = tiny_engine(model)
    engine.add_request("a", random_prompt(30, 1), SamplingParams(max_tokens=10, ignore_eos=True),
                       EvictionParams("h2o", budget=16, sink=0, recent=4))
    engine.add_request("b", random_prompt(5, 2), SamplingParams(max_tokens=10, ignore_eos=True))
    engine.step()
    s = engine.stats()
    assert s["running"] == 2 and s["waiting"] == 0
    assert s["pages_used"] + s["pages_free"] == s["pages_total"] and s["pages_used"] > 0
    run_all(engine)
    s = engine.stats()
    assert s["generated_tokens"] == 20 and s["evictions"]["h2o"] > 0
    assert s["pages_used"] == 0 and s["running"] == 0


# ---------------------------------------------------------------- async
def test_async_engine_streams_cancels_and_survives_bad_requests(model):
    engine = tiny_engine(model)
    aengine = AsyncEngine(engine)
    prompt = random_prompt(12, seed=5)
    expected = dense_greedy(model, prompt, 8)

    async def collect(rid, **kw):
        return [o async for o in aengine.generate(rid, prompt, **kw)]

    async def cancel_after(rid, n):
        got = 0
        async for _ in aengine.generate(rid, prompt, SamplingParams(max_tokens=500, ignore_eos=True)):
            got += 1
            if got == n:
                break  # closing the iterator aborts the request
        return got

    async def bad():
        with pytest.raises(ValueError, match="top_p"):
            await collect("bad", sampling=SamplingParams(top_p=2.0))
        return "raised"

    async def main():
        results = await asyncio.gather(
            collect("good1", sampling=SamplingParams(max_tokens=8, ignore_eos=True)),
            cancel_after("cancelled", 3), bad(),
            collect("good2", sampling=SamplingParams(max_tokens=8, ignore_eos=True)))
        return results

    try:
        good1, n, raised, good2 = asyncio.run(main())
        assert [o.token_id for o in good1] == expected == [o.token_id for o in good2]
        assert n == 3 and raised == "raised"
        # The abort is applied by the loop thread: poll for it with a deadline.
        deadline = asyncio.run(_wait_until(lambda: aengine.stats()["pages_used"] == 0))
        assert deadline, aengine.stats()
        assert aengine.stats()["running"] == 0
        assert aengine.is_alive()
    finally:
        aengine.shutdown()
    assert not aengine.is_alive()


async def _wait_until(cond, timeout: float = 10.0) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


class BrokenAdvisor(ScriptedAdvisor):
    """An advisor whose every call raises: it must count as absent."""

    def submit(self, features, gone=None):
        raise ConnectionError("advisor down")

    def take_plans(self):
        raise ConnectionError("advisor down")


def test_failing_advisor_is_treated_as_absent(model):
    engine = tiny_engine(model, advisor=BrokenAdvisor())
    outs = list(engine.generate(random_prompt(60, 1), SamplingParams(max_tokens=10, ignore_eos=True),
                                EvictionParams("learned", budget=24, sink=4, recent=4)))
    u = outs[-1].usage
    assert len(outs) == 10 and u.kv_blocks_evicted > 0
    assert u.fallback_reasons == {"advisor_down": u.kv_blocks_evicted}
    assert engine.stats()["advisor_errors"] > 0


def test_async_engine_survives_a_failing_step(model):
    """Fault injection: one step raises. The requests in it get EngineError;
    the loop keeps serving new requests and frees their pages."""
    from services.compute.engine.async_engine import EngineError

    engine = tiny_engine(model)
    aengine = AsyncEngine(engine)
    real_run, calls = engine.runner.run, {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real_run(batch)

    engine.runner.run = flaky
    prompt = random_prompt(9, seed=2)

    async def first():
        with pytest.raises(EngineError, match="injected"):
            async for _ in aengine.generate("victim", prompt, SamplingParams(max_tokens=20, ignore_eos=True)):
                pass

    async def second():
        return [o.token_id async for o in aengine.generate("after", prompt, SamplingParams(max_tokens=6, ignore_eos=True))]

    try:
        asyncio.run(first())
        assert asyncio.run(second()) == dense_greedy(model, prompt, 6)
        assert aengine.is_alive() and aengine.stats()["pages_used"] == 0
    finally:
        aengine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_on_cuda(dtype):
    """The same engine on a GPU (CUDA kernels when CuPy is there): dense greedy
    equals recomputation in fp32, evicting policies stay in budget, pages return."""
    model = tiny_model(seed=0).to("cuda", dtype)
    engine = tiny_engine(model, prefill_chunk=8, advisor=ScriptedAdvisor())
    prompt = random_prompt(40, seed=1)
    got = [o.token_id for o in engine.generate(prompt, GREEDY)]
    if dtype == torch.float32:
        assert got == dense_greedy(model, prompt, GREEDY.max_tokens)
    for policy in ("streaming", "h2o", "tova", "snapkv", "knorm", "keydiff", "random", "learned"):
        outs = list(engine.generate(prompt, SamplingParams(max_tokens=30, temperature=0.7, seed=3, ignore_eos=True),
                                    EvictionParams(policy, budget=24, sink=4, recent=4)))
        u = outs[-1].usage
        assert len(outs) == 30 and u.kv_blocks_evicted > 0, policy
        slack = engine.config.plan_slack_blocks if policy == "learned" else 0
        assert u.kv_blocks_resident <= (24 // 4 + slack) * 4, policy
    assert engine.pool.num_free == engine.pool.capacity


def test_pipelined_decode_plans_run_within_the_slack(model):
    """pipeline_decode_plans: a decoding sequence keeps going within its slack
    while a late plan comes (rounds then use older plans), still all network."""
    engine = tiny_engine(model, advisor=ScriptedAdvisor(delay=3), prefill_chunk=8, pipeline_decode_plans=True)
    outs = list(engine.generate(random_prompt(60, seed=7), SamplingParams(max_tokens=30, ignore_eos=True),
                                EvictionParams("learned", budget=24, sink=4, recent=4)))
    rounds = [r for o in outs for r in o.rounds]
    assert outs[-1].usage.network_evictions == outs[-1].usage.kv_blocks_evicted > 0
    assert max(r["plan_age_steps"] for r in rounds) >= 1, rounds


def test_restarted_advisor_gets_the_resident_blocks_again(model):
    """A new advisor epoch (a restarted cache-manager): compute re-sends the
    features of every block a running learned sequence still holds in some
    row, with the blocks each row evicted, and plans resume."""
    adv = ScriptedAdvisor()
    engine = tiny_engine(model, advisor=adv, prefill_chunk=8)
    engine.add_request("r", random_prompt(80, seed=4), SamplingParams(max_tokens=30, ignore_eos=True),
                       EvictionParams("learned", budget=32, sink=4, recent=8))
    for _ in range(25):
        engine.step()
    seq = engine.seqs["r"]
    assert seq.evicted_blocks > 0
    sent = adv.submitted
    resident = {int(b) for b in seq.block_index.unique() if seq.eviction.sink_blocks <= b < seq.sent_upto}
    adv.release("r")                 # the restarted advisor knows nothing of r
    adv.epoch += 1
    engine.step()
    resent = engine.stats()["features_resent"]   # (the step may also send a block leaving the window)
    assert adv.submitted - sent >= resent == len(resident) > 0
    outs = run_all(engine)["r"]
    u = outs[-1].usage
    assert u.network_evictions == u.kv_blocks_evicted


def test_the_plan_wait_grows_with_the_blocks_a_round_ranks(model):
    """A round that ranks the whole prompt at once (evict_after_prompt) is held
    for its plan plan_wait_s per prefill chunk of overshoot, a chunk's round
    plan_wait_s: the planner's work grows with the blocks it ranks."""
    prompt = random_prompt(80, seed=4)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    waits = {}
    for after in (False, True):
        # Plans come three steps late: the sequence is held over its budget, waiting.
        engine = tiny_engine(model, advisor=ScriptedAdvisor(delay=3), prefill_chunk=8, plan_wait_s=60.0)
        engine.add_request("r", prompt, sp, EvictionParams("learned", budget=32, sink=4, recent=8,
                                                           after_prompt=after))
        seq = engine.seqs.get("r")
        for _ in range(200):          # until the sequence is held over its budget for a plan
            engine.step()
            seq = engine.seqs["r"]
            if seq.holding and overshoot(seq) > 0:
                break
        waits[after] = (engine.rounds.plan_wait(seq), overshoot(seq))
        engine.abort("r")
        engine.step()
    assert waits[False][0] == 60.0
    wait, over = waits[True]
    assert over > 2 * 8 // engine.config.block_size and wait == 60.0 * over / (8 // engine.config.block_size)
