"""Our TransformerModel against Hugging Face transformers on tiny seeded
checkpoints of each supported architecture, saved with save_pretrained and
read back by load_model.

Tolerances: float32 max |logit diff| <= 1e-4 (logits are O(1..10));
bfloat16: measured against the fp32 reference, our mean error <= 1.25x
transformers' bf16 mean error + 0.005 and our max error <= 2x its max error
(observed: both ~0.03 mean, 0.2-0.7 max on logits of magnitude ~5).
"""
from __future__ import annotations

import copy

import pytest
import torch

from services.compute.model.loader import load_model
from helpers.models import ContiguousKVCache, hf_logits, run_step, save_hf_model

FP32_ATOL = 1e-4
BF16_MEAN_FACTOR, BF16_MAX_FACTOR = 1.25, 2.0

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

CASES = {
    "llama_gqa": ("llama", {}, None),
    "llama3_rope_tied": ("llama", {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": True}, None),
    "llama_sharded": ("llama", {"num_key_value_heads": 1}, "100KB"),
    "qwen2_bias": ("qwen2", {}, None),
    # Longer than both max_position_embeddings (RoPE tables must grow, as HF's
    # on-the-fly rope does) and the sliding window.
    "mistral_long": ("mistral", {"max_position_embeddings": 32, "sliding_window": 12}, None),
}

SEQ_LEN = 48


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    arch, overrides, shard = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(path, arch, seed=len(request.param), max_shard_size=shard, **overrides)
    ids = torch.randint(0, hf.config.vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(7))
    return request.param, path, hf, ids, hf_logits(hf, ids)


def test_config_is_read(checkpoint):
    name, path, hf, _, _ = checkpoint
    cfg = load_model(path).config
    assert cfg.num_kv_heads == hf.config.num_key_value_heads
    assert cfg.attention_bias == (name == "qwen2_bias")
    assert cfg.tie_word_embeddings == (name == "llama3_rope_tied")
    assert (cfg.rope_scaling or {}).get("rope_type") == ("llama3" if name == "llama3_rope_tied" else None)
    if name == "llama_sharded":
        assert len(list(path.glob("model-*-of-*.safetensors"))) > 1


@torch.inference_mode()
def test_dense_prefill_fp32(checkpoint):
    _, path, _, ids, ref = checkpoint
    model = load_model(path, dtype="float32")
    out = model.forward_dense(ids)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert (out - ref).abs().max().item() <= FP32_ATOL


@torch.inference_mode()
def test_varlen_prefill_then_decode_fp32(checkpoint):
    """Two sequences of different lengths prefilled in one flat batch, then
    decoded one token per sequence per step through the callback cache; every
    step's logits equal HF's full-sequence logits at that position."""
    _, path, _, ids, ref = checkpoint
    model = load_model(path, dtype="float32")
    cache = ContiguousKVCache(model.config.sliding_window)
    prompt = {"a": 17, "b": 5}
    logits = run_step(model, cache, [(s, ids[i, :prompt[s]].tolist()) for i, s in enumerate("ab")])
    for i, s in enumerate("ab"):
        assert (logits[i] - ref[i, prompt[s] - 1]).abs().max().item() <= FP32_ATOL
    for t in range(5, SEQ_LEN):
        chunks = [(s, [ids[i, t].item()]) for i, s in enumerate("ab") if t >= prompt[s]]
        logits = run_step(model, cache, chunks)
        for j, (s, _) in enumerate(chunks):
            i = "ab".index(s)
            assert (logits[j] - ref[i, t]).abs().max().item() <= FP32_ATOL, (s, t)


@torch.inference_mode()
def test_chunked_prefill_matches_dense(checkpoint):
    """A prompt fed in three uneven chunks (the engine's chunked prefill)."""
    _, path, _, ids, ref = checkpoint
    model = load_model(path)
    cache = ContiguousKVCache(model.config.sliding_window)
    for lo, hi in [(0, 10), (10, 11), (11, 30)]:
        logits = run_step(model, cache, [("x", ids[1, lo:hi].tolist())])
        assert (logits[0] - ref[1, hi - 1]).abs().max().item() <= FP32_ATOL


@torch.inference_mode()
def test_bf16_prefill_and_decode(checkpoint):
    """bf16 has ~3 significant digits, so two correct bf16 implementations
    differ by more than either differs from the truth. The bar: against the
    fp32 reference, our bf16 error is no worse than transformers' own bf16."""
    _, path, hf, ids, ref = checkpoint
    hf_err = (hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids) - ref).abs()
    model = load_model(path, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    dense_err = (model.forward_dense(ids) - ref).abs()
    cache = ContiguousKVCache(model.config.sliding_window)
    run_step(model, cache, [("a", ids[0, :8].tolist())])
    steps = torch.stack([run_step(model, cache, [("a", [ids[0, t].item()])])[0] for t in range(8, SEQ_LEN)])
    decode_err = (steps - ref[0, 8:]).abs()
    for err in (dense_err, decode_err):
        assert err.mean().item() <= BF16_MEAN_FACTOR * hf_err.mean().item() + 0.005
        assert err.max().item() <= BF16_MAX_FACTOR * hf_err.max().item()


@torch.inference_mode()
def test_dense_padding_mask(checkpoint):
    """Left- and right-padded rows give the unpadded row's logits on real tokens."""
    _, path, _, ids, ref = checkpoint
    model = load_model(path)
    n, pad = 20, 6
    row = ids[0, :n]
    left = torch.cat([torch.zeros(pad, dtype=torch.long), row])
    right = torch.cat([row, torch.zeros(pad, dtype=torch.long)])
    mask_left = torch.cat([torch.zeros(pad), torch.ones(n)]).long()
    mask_right = torch.cat([torch.ones(n), torch.zeros(pad)]).long()
    out = model.forward_dense(torch.stack([left, right]), torch.stack([mask_left, mask_right]))
    assert torch.isfinite(out).all()
    assert (out[0, pad:] - ref[0, :n]).abs().max().item() <= FP32_ATOL
    assert (out[1, :n] - ref[0, :n]).abs().max().item() <= FP32_ATOL


def test_dense_forward_trains(checkpoint):
    """forward_dense is differentiable (it is the training path)."""
    _, path, _, ids, _ = checkpoint
    model = load_model(path).train()
    logits = model.forward_dense(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


@torch.inference_mode()
def test_attention_callback_contract(checkpoint):
    """The engine's callback gets contiguous q/k/v of the documented shapes, in
    the model dtype, once per layer in order; its output is what o_proj sees."""
    _, path, _, ids, _ = checkpoint
    model = load_model(path)
    cfg = model.config
    seen = []
    cache = ContiguousKVCache(model.config.sliding_window)
    inner = cache.attention(["a", "b"], [3, 4])

    def attention(layer, q, k, v):
        seen.append(layer)
        T = q.shape[0]
        assert q.shape == (T, cfg.num_heads, cfg.head_dim) and q.is_contiguous()
        assert k.shape == v.shape == (T, cfg.num_kv_heads, cfg.head_dim)
        assert k.is_contiguous() and v.is_contiguous() and q.dtype == model.dtype
        return inner(layer, q, k, v)

    ids7 = torch.cat([ids[0, :3], ids[1, :4]])
    hidden = model(ids7, torch.tensor([0, 1, 2, 0, 1, 2, 3]), attention)
    assert seen == list(range(cfg.num_layers))
    assert hidden.shape == (7, cfg.hidden_size)
