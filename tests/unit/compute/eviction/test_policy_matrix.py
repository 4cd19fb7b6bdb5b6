"""Every policy (learned with a tiny value-estimation network behind the
cache-manager's own planner) x Llama / Qwen2 (attention biases) / Mistral
(sliding window) tiny models x block sizes 1 and 16, through the engine with
two requests batched together: between every two steps the budget holds and
sink, recent window and newest block are resident (check_invariants); every
page comes back; a second run gives the same tokens and the same evictions;
learned evicts only on the network's plans (no fallback)."""
from __future__ import annotations

import pytest
import torch

from helpers.engine import check_invariants, random_prompt, tiny_engine
from helpers.engine import one_thread  # noqa: F401  (autouse: single-threaded tiny tensors)
from helpers.models import randomize_
from services.compute.engine.engine import EvictionParams, SamplingParams
from services.compute.model.model import TransformerModel
from services.compute.model.config import ModelConfig
from services.compute.eviction.policies import POLICY_NAMES

ARCHS = {"llama": {}, "qwen2": {"attention_bias": True}, "mistral": {"sliding_window": 48}}
SP = SamplingParams(max_tokens=12, ignore_eos=True)


def model_of(arch: str) -> TransformerModel:
    cfg = ModelConfig(architecture=arch, vocab_size=259, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, **ARCHS[arch])
    torch.manual_seed(0)
    m = TransformerModel(cfg)
    randomize_(m, 0)
    return m.eval()


MODELS = {a: model_of(a) for a in ARCHS}


def advisor_for(policy: str, model: TransformerModel):
    if policy != "learned":
        return None
    from kvpop.evaluation.local_advisor import LocalAdvisor
    from services.cache_manager.estimator import EstimatorConfig, ValueEstimator
    mc = model.config
    torch.manual_seed(1)
    return LocalAdvisor(None, model=ValueEstimator(EstimatorConfig(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                                                   d_model=16)))


def run(arch: str, policy: str, bs: int):
    model = MODELS[arch]
    advisor = advisor_for(policy, model)
    if advisor is not None:
        assert advisor.policy_name == "learned", advisor.planner.loaded   # the network, not its heuristic
    engine = tiny_engine(model, advisor=advisor, block_size=bs, prefill_chunk=64, num_pages=4000)
    budget = 64 if bs == 16 else 24
    prompts = [random_prompt(n, seed=n) for n in (150, 97)] if bs == 16 else \
        [random_prompt(n, seed=n) for n in (80, 41)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SP, EvictionParams(policy, budget=None if policy == "dense" else budget,
                                                         sink=4, recent=bs if bs > 1 else 6))
    tokens, usage = {}, {}
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.token_id is not None:
                tokens.setdefault(o.request_id, []).append(o.token_id)
            if o.finished:
                usage[o.request_id] = o.usage
        check_invariants(engine)
    assert engine.pool.num_free == engine.pool.capacity
    assert set(usage) == {"0", "1"} and all(len(t) == SP.max_tokens for t in tokens.values())
    return tokens, usage


@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_policy_matrix(policy, arch, bs):
    tokens, usage = run(arch, policy, bs)
    again, usage2 = run(arch, policy, bs)
    assert again == tokens
    assert {r: u.kv_blocks_evicted for r, u in usage.items()} == {r: u.kv_blocks_evicted for r, u in usage2.items()}
    evicted = sum(u.kv_blocks_evicted for u in usage.values())
    if policy == "dense":
        assert evicted == 0
        return
    assert evicted > 0, "the budget is below every request's length: something must be evicted"
    if policy == "learned":
        for u in usage.values():
            assert u.network_evictions == u.kv_blocks_evicted and u.fallback_evictions == 0, u
