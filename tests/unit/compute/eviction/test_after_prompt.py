"""When the budget holds. `evict_after_prompt`: from the end of the prompt on.
The prompt is prefilled in full (its pages reserved), its first token sees
all of it, then one round brings every row down to the budget. By default
the budget holds during prefill too (bounded peak); `prefill_allowance` N
holds up to N x the budget during prefill, then the budget."""
import math

import pytest

from helpers.engine import ScriptedAdvisor, dense_greedy, random_prompt, tiny_engine, tiny_model
from helpers.engine import one_thread  # noqa: F401  (autouse: single-threaded tiny tensors)
from services.compute.engine.engine import EvictionParams, SamplingParams

BS, BUDGET, PROMPT = 4, 32, 120
SP = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def alone(model, prompt, ev) -> list[int]:
    """The tokens a request decodes with an engine to itself."""
    engine = tiny_engine(model, block_size=BS, page_size=BS, prefill_chunk=16)
    engine.add_request("r", prompt, SP, ev)
    got = []
    while engine.has_unfinished():
        got += [o.token_id for o in engine.step() if o.token_id is not None]
    return got


def trace(engine, ev):
    """Step a lone request to the end: (tokens, [(in_prefill, tokens out, blocks per row)] after every step, usage)."""
    engine.add_request("r", random_prompt(PROMPT, seed=5), SP, ev)
    tokens, seen, usage = [], [], None
    while engine.has_unfinished():
        for o in engine.step():
            if o.token_id is not None:
                tokens.append(o.token_id)
            if o.finished:
                usage = o.usage
        seq = engine.seqs.get("r")
        if seq is not None:
            seen.append((seq.in_prefill, len(seq.output_ids), seq.num_blocks))
    assert engine.pool.num_free == engine.pool.capacity
    return tokens, seen, usage


@pytest.mark.parametrize("policy", ["h2o", "keydiff", "learned"])
def test_budget_after_prompt_keeps_the_whole_prompt_then_evicts_once(model, policy):
    advisor = ScriptedAdvisor() if policy == "learned" else None
    engine = tiny_engine(model, block_size=BS, page_size=BS, prefill_chunk=16, advisor=advisor)
    ev = EvictionParams(policy, budget=BUDGET, sink=4, recent=8, after_prompt=True)
    tokens, seen, usage = trace(engine, ev)
    prompt_blocks = math.ceil(PROMPT / BS)
    during = [n for pre, _, n in seen if pre]
    # From the second token on (a learned sequence waits for its plan after the last chunk).
    after = [n for pre, out, n in seen if out >= 2]
    # Nothing is evicted while the prompt goes in: every chunk adds its blocks.
    assert during == sorted(during) and during[-1] > BUDGET // BS
    assert engine.pool.peak_used >= prompt_blocks * engine.scheduler.rows
    # The request's own peak (usage) is that whole prompt too, and what it ends with is the budget.
    assert usage.kv_blocks_peak == prompt_blocks * engine.scheduler.rows == engine.pool.peak_used
    assert usage.kv_blocks_resident < usage.kv_blocks_peak
    # Once it is in, the budget holds (plus a learned sequence's decode slack).
    slack = engine.config.plan_slack_blocks if policy == "learned" else 0
    assert max(after) <= BUDGET // BS + slack
    # The first token saw the whole prompt: it is the dense first token.
    assert tokens[0] == dense_greedy(model, random_prompt(PROMPT, seed=5), 1)[0]
    assert usage.kv_blocks_evicted > 0
    if policy == "learned":
        assert usage.network_evictions == usage.kv_blocks_evicted, usage


def test_budget_during_prefill_bounds_the_peak(model):
    engine = tiny_engine(model, block_size=BS, page_size=BS, prefill_chunk=16)
    _, seen, usage = trace(engine, EvictionParams("h2o", budget=BUDGET, sink=4, recent=8))
    chunk_blocks = 16 // BS
    assert max(n for _, _, n in seen) <= BUDGET // BS + chunk_blocks
    # usage reports the peak the request reached between a chunk's arrival and its round
    # (steps above see it after the round): above the budget, within budget + one chunk.
    rows = engine.scheduler.rows
    assert BUDGET // BS * rows < usage.kv_blocks_peak <= (BUDGET // BS + chunk_blocks) * rows
    assert usage.kv_blocks_peak == engine.pool.peak_used
    assert engine.pool.peak_used < math.ceil(PROMPT / BS) * engine.scheduler.rows


def test_a_smaller_prefill_chunk_lowers_the_peak(model):
    """The peak of a budget held during prefill is the budget plus one chunk
    (KVPOP_PREFILL_CHUNK): halving the chunk lowers it by that much."""
    peaks = {}
    for chunk in (8, 32):
        engine = tiny_engine(model, block_size=BS, page_size=BS, prefill_chunk=chunk)
        _, _, usage = trace(engine, EvictionParams("h2o", budget=BUDGET, sink=4, recent=8))
        rows = engine.scheduler.rows
        peaks[chunk] = usage.kv_blocks_peak // rows
        assert BUDGET // BS < peaks[chunk] <= BUDGET // BS + chunk // BS, (chunk, peaks)
    assert peaks[8] < peaks[32]


def test_after_prompt_reserves_the_prompt_at_admission(model):
    """A pool too small for the whole prompt refuses an after-prompt request
    that fits when the budget holds during prefill (the peak is the price)."""
    rows = 2 * 2
    engine = tiny_engine(model, block_size=BS, page_size=BS, prefill_chunk=16, num_pages=24 * rows)
    prompt = random_prompt(PROMPT, seed=5)
    engine.add_request("during", prompt, SP, EvictionParams("h2o", budget=BUDGET, sink=4, recent=8))
    with pytest.raises(ValueError, match="KV pages"):
        engine.add_request("after", prompt, SP, EvictionParams("h2o", budget=BUDGET, sink=4, recent=8,
                                                              after_prompt=True))


def test_gateway_passes_evict_after_prompt_to_compute():
    from kvpop.runtime.pb import generate_pb2
    from kvpop.runtime.config import GatewayConfig
    from services.gateway.validation import validate

    info = generate_pb2.ModelInfo(policies=["dense", "h2o"], max_model_len=2048)
    req = generate_pb2.GenerateRequest(prompt="hi", policy="h2o", budget_tokens=64, evict_after_prompt=True)
    assert validate(req, GatewayConfig(default_prefill="held"), info).eviction.evict_after_prompt
    req.evict_after_prompt = False
    assert not validate(req, GatewayConfig(default_prefill="held"), info).eviction.evict_after_prompt


@pytest.mark.parametrize("policy", ["h2o", "learned"])
def test_prefill_allowance_holds_a_multiple_during_prefill_then_the_budget(model, policy):
    advisor = ScriptedAdvisor() if policy == "learned" else None
    engine = tiny_engine(model, block_size=BS, page_size=BS, prefill_chunk=16, advisor=advisor)
    _, seen, usage = trace(engine, EvictionParams(policy, budget=BUDGET, sink=4, recent=8, prefill_allowance=2.0))
    rows, chunk_blocks, budget = engine.scheduler.rows, 16 // BS, BUDGET // BS
    slack = engine.config.plan_slack_blocks if policy == "learned" else 0
    during = [n for pre, _, n in seen if pre]
    after = [n for pre, out, n in seen if out >= 2]
    # During prefill the rows grow past the budget (+ one chunk) and stop at twice it (+ one chunk):
    # rounds did run, at the allowance, not at the budget.
    assert budget + chunk_blocks < max(during) <= 2 * budget + chunk_blocks + slack, during
    assert 2 * budget * rows < usage.kv_blocks_peak <= (2 * budget + chunk_blocks + slack) * rows, usage
    assert usage.kv_blocks_peak < math.ceil(PROMPT / BS) * rows
    # From the prompt's end on: the budget.
    assert max(after) <= budget + slack, after
    assert usage.kv_blocks_resident <= (budget + slack) * rows
    if policy == "learned":
        assert usage.kv_blocks_evicted > 0 and usage.network_evictions == usage.kv_blocks_evicted, usage


def test_the_peak_follows_the_allowance(model):
    """Budget during prefill < 2x < 3x < the whole prompt (evict_after_prompt), same prompt and budget."""
    peaks = []
    for kw in ({}, {"prefill_allowance": 2.0}, {"prefill_allowance": 3.0}, {"after_prompt": True}):
        engine = tiny_engine(model, block_size=BS, page_size=BS, prefill_chunk=16)
        _, _, usage = trace(engine, EvictionParams("keydiff", budget=BUDGET, sink=4, recent=8, **kw))
        peaks.append(usage.kv_blocks_peak)
    assert peaks == sorted(set(peaks)), peaks


def test_an_allowance_past_the_prompt_holds_the_prompt_and_reserves_only_it(model):
    """64x a small budget is more than the prompt: the sequence holds its whole prompt during
    prefill, and admission reserves the prompt, not 64x the budget."""
    rows = 2 * 2
    engine = tiny_engine(model, block_size=BS, page_size=BS, prefill_chunk=16, num_pages=40 * rows)
    engine.add_request("big", random_prompt(PROMPT, seed=5), SP,
                       EvictionParams("h2o", budget=BUDGET, sink=4, recent=8, prefill_allowance=64.0))
    seq = engine.seqs["big"]
    assert seq.eviction.prefill_blocks == math.ceil(PROMPT / BS) + 1
    assert engine.scheduler.reservation(seq) <= 40 * rows


@pytest.mark.parametrize("kw, message", [
    ({"prefill_allowance": 0.5}, "prefill_allowance must be in"),
    ({"prefill_allowance": float("nan")}, "prefill_allowance must be in"),
    ({"prefill_allowance": 65.0}, "prefill_allowance must be in"),
    ({"prefill_allowance": 2.0, "after_prompt": True}, "exclude each other"),
])
def test_a_bad_allowance_is_refused_before_a_sequence_exists(model, kw, message):
    engine = tiny_engine(model, block_size=BS, page_size=BS, prefill_chunk=16)
    with pytest.raises(ValueError, match=message):
        engine.add_request("r", random_prompt(PROMPT, seed=5), SP,
                           EvictionParams("h2o", budget=BUDGET, sink=4, recent=8, **kw))
    assert not engine.has_unfinished()


def test_gateway_checks_and_passes_the_prefill_allowance():
    import grpc

    from kvpop.runtime.config import GatewayConfig
    from kvpop.runtime.pb import generate_pb2
    from services.gateway.validation import Invalid, validate

    info = generate_pb2.ModelInfo(policies=["dense", "h2o"], max_model_len=2048)
    req = generate_pb2.GenerateRequest(prompt="hi", policy="h2o", budget_tokens=64)
    assert validate(req, GatewayConfig(), info).eviction.prefill_allowance == 0.0      # unset: compute's 1
    req.prefill_allowance = 2.5
    assert validate(req, GatewayConfig(), info).eviction.prefill_allowance == 2.5
    for bad in (0.0, 0.99, 65.0, float("inf"), float("nan")):
        req.prefill_allowance = bad
        with pytest.raises(Invalid, match="prefill_allowance must be in") as e:
            validate(req, GatewayConfig(), info)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    req.prefill_allowance, req.evict_after_prompt = 2.0, True
    with pytest.raises(Invalid, match="exclude each other"):
        validate(req, GatewayConfig(), info)


@pytest.mark.parametrize("default, after, allowance", [("held", False, 0.0), ("after", True, 0.0),
                                                       ("4x", False, 4.0), ("", None, None)])
def test_a_request_that_says_nothing_gets_the_stacks_default_protocol(default, after, allowance):
    """KVPOP_DEFAULT_PREFILL decides when the budget holds for a request that
    sets neither field; a request that sets one gets what it asked, whatever the
    default ('' is kvpop/runtime/config.py's DEFAULT_PREFILL)."""
    from kvpop.runtime import prefill_protocol
    from kvpop.runtime.config import DEFAULT_PREFILL, GatewayConfig
    from kvpop.runtime.pb import generate_pb2
    from services.gateway.validation import validate

    if default == "":
        after, n = prefill_protocol.parse(DEFAULT_PREFILL)
        allowance = n if n > 1 else 0.0
    cfg = GatewayConfig(default_prefill=default)
    cfg.validate()
    info = generate_pb2.ModelInfo(policies=["dense", "learned"], max_model_len=2048)
    ev = validate(generate_pb2.GenerateRequest(prompt="hi", policy="learned", budget_tokens=64), cfg, info).eviction
    assert (ev.evict_after_prompt, ev.prefill_allowance) == (after, allowance)
    held = validate(generate_pb2.GenerateRequest(prompt="hi", policy="learned", budget_tokens=64,
                                                 prefill_allowance=1.0), cfg, info).eviction
    assert (held.evict_after_prompt, held.prefill_allowance) == (False, 1.0)      # compute: the budget itself
    asked = validate(generate_pb2.GenerateRequest(prompt="hi", policy="learned", budget_tokens=64,
                                                  evict_after_prompt=True), cfg, info).eviction
    assert asked.evict_after_prompt and asked.prefill_allowance == 0.0


@pytest.mark.parametrize("bad", ["during", "0.5x", "65x", "x"])
def test_a_bad_default_protocol_fails_at_start_naming_the_variable(bad):
    from kvpop.runtime.config import ConfigError, GatewayConfig
    with pytest.raises(ConfigError, match="KVPOP_DEFAULT_PREFILL"):
        GatewayConfig(default_prefill=bad).validate()


def test_eval_labels_follow_the_default_protocol_and_suffixes_override_it():
    from kvpop.runtime import prefill_protocol
    from kvpop.runtime.config import DEFAULT_PREFILL
    from kvpop.evaluation.harness import after_prompt, prefill_allowance, set_protocol
    from kvpop.runtime.pb import generate_pb2

    assert (after_prompt("learned"), prefill_allowance("learned")) == prefill_protocol.parse(DEFAULT_PREFILL)
    assert (after_prompt("keydiff+after"), prefill_allowance("keydiff+after")) == (True, 1.0)
    assert (after_prompt("learned+prefill1x"), prefill_allowance("learned+prefill1x")) == (False, 1.0)
    assert (after_prompt("learned+prefill4x"), prefill_allowance("learned+prefill4x")) == (False, 4.0)
    plain, held = generate_pb2.GenerateRequest(), generate_pb2.GenerateRequest()
    set_protocol(plain, "learned")          # nothing set: the stack's default, as any client gets it
    set_protocol(held, "learned+prefill1x")
    assert not plain.evict_after_prompt and not plain.HasField("prefill_allowance")
    assert held.HasField("prefill_allowance") and held.prefill_allowance == 1.0


def test_after_prompt_requests_share_a_prompt_headroom(model):
    """Prompts that go in above their budget draw the difference from one shared
    prompt headroom, not each from its own reservation: a pool that holds three
    whole prompts runs more requests than that at once, a prompt starts only when
    its whole difference fits beside the ones going in (so every started prompt
    completes), nothing is over-promised, and each request decodes as it does alone."""
    rows = 2 * 2
    prompt_blocks = math.ceil(PROMPT / BS) + 1
    pages = 3 * (prompt_blocks + 8) * rows                   # three whole prompts and change
    ev = EvictionParams("h2o", budget=BUDGET, sink=4, recent=8, after_prompt=True)
    prompts = [random_prompt(PROMPT - 4 * i, seed=20 + i) for i in range(8)]
    engine = tiny_engine(model, block_size=BS, page_size=BS, prefill_chunk=16, num_pages=pages,
                         cleanup_threshold=float("inf"))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SP, ev)
    sched, most, tokens = engine.scheduler, 0, {str(i): [] for i in range(8)}
    while engine.has_unfinished():
        for o in engine.step():
            if o.token_id is not None:
                tokens[o.request_id].append(o.token_id)
        most = max(most, len(sched.running))
        assert sched.reserved() <= engine.pool.capacity
        started = sum(sched.prompt_extra(s) for s in sched.prompting)
        assert started <= sched.prompt_headroom(max((sched.prompt_extra(s) for s in sched.running), default=0))
        # A prompt that has begun is among those drawing on the headroom.
        assert all(any(s is q for q in sched.prompting) for s in sched.running
                   if sched.prompt_extra(s) and s.num_cached)
    assert most > 3, most
    assert engine.pool.num_free == engine.pool.capacity
    for i, p in enumerate(prompts):
        assert tokens[str(i)] == alone(model, p, ev), i


def test_cleanup_does_not_shrink_budgets_for_a_prompt_that_would_only_queue(model):
    """With prompts waiting for the prompt headroom, shrinking running budgets to
    admit another after-prompt request buys nothing (its prompt queues behind
    them) and costs those requests their answers: no shrink. The same requests
    with the budget held during prefill do shrink (cleanup as before)."""
    rows = 2 * 2
    prompt_blocks = math.ceil(PROMPT / BS) + 1
    shrinks = {}
    for after in (True, False):
        engine = tiny_engine(model, block_size=BS, page_size=BS, prefill_chunk=16,
                             num_pages=2 * (prompt_blocks + 8) * rows, cleanup_threshold=0.3)
        ev = EvictionParams("h2o", budget=BUDGET, sink=4, recent=8, after_prompt=after)
        for i in range(6):
            engine.add_request(str(i), random_prompt(PROMPT, seed=40 + i), SP, ev)
        while engine.has_unfinished():
            engine.step()
        shrinks[after] = engine.scheduler.budget_shrinks
        assert engine.pool.num_free == engine.pool.capacity
    assert shrinks[True] == 0 and shrinks[False] > 0, shrinks


def test_budgets_after_the_prompt_set_no_chunk_headroom_aside(model):
    """The shared chunk headroom is for prompts that go over a budget held
    during prefill; a prompt whose budget holds after it never goes over what it
    holds. A pool of exactly K budgets and one prompt runs K after-prompt
    requests at once (no page is ever missing: the pool would refuse the
    allocation), each decoding as it does alone; one request holding its budget
    during prefill brings the chunk headroom back."""
    rows, K = 2 * 2, 5
    ev = EvictionParams("h2o", budget=BUDGET, sink=4, recent=8, after_prompt=True)
    prompts = [random_prompt(PROMPT, seed=60 + i) for i in range(K)]
    probe = tiny_engine(model, block_size=BS, page_size=BS, prefill_chunk=16)
    for i, p in enumerate(prompts):
        probe.add_request(str(i), p, SP, ev)
    sched, seqs = probe.scheduler, list(probe.scheduler.waiting)
    budgets = sum(sched.reservation(s) for s in seqs)
    prompt = sched.prompt_headroom(max(sched.prompt_extra(s) for s in seqs)) * rows
    assert sched._reserve(seqs) == budgets + prompt
    probe.add_request("held", random_prompt(PROMPT, seed=70), SP,
                      EvictionParams("h2o", budget=BUDGET, sink=4, recent=8))
    held = sched.waiting[-1]
    assert sched._reserve(seqs + [held]) == budgets + sched.reservation(held) + prompt \
        + sched.headroom_pages(held) * rows

    engine = tiny_engine(model, block_size=BS, page_size=BS, prefill_chunk=16, num_pages=budgets + prompt,
                         cleanup_threshold=float("inf"))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SP, ev)
    most, tokens = 0, {str(i): [] for i in range(K)}
    while engine.has_unfinished():
        for o in engine.step():
            if o.token_id is not None:
                tokens[o.request_id].append(o.token_id)
        most = max(most, len(engine.scheduler.running))
    assert most == K
    assert engine.pool.num_free == engine.pool.capacity
    for i, p in enumerate(prompts):
        assert tokens[str(i)] == alone(model, p, ev), i
