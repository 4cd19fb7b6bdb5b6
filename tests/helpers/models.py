"""Test helpers for the model runtime, shared by the model and engine tests:
tiny seeded Hugging Face checkpoints of each architecture, and a simple
contiguous (no paging, no eviction) KV cache behind the AttentionFn callback."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from services.compute.model.model import AttentionFn, TransformerModel

ARCHITECTURES = ("llama", "qwen2", "mistral")


def tiny_hf_config(arch: str = "llama", **overrides):
    """A transformers config small enough that a forward takes milliseconds.
    GQA (4 query heads over 2 kv-heads) unless overridden."""
    import transformers

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    common.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "mistral": transformers.MistralConfig}[arch]
    if arch == "mistral":
        common.setdefault("sliding_window", None)
    return cls(**common)


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.08) -> None:
    """HF's init (std 0.02, norms = 1, biases = 0) gives near-uniform logits and
    would hide bugs in norm weights, biases or attention; use larger, seeded
    weights instead."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(std * noise * 2.5)


def make_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A seeded tiny transformers *ForCausalLM in float32, eval mode."""
    import transformers

    cfg = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    randomize_(model, seed)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.float().eval()


def save_hf_model(path: Path, arch: str = "llama", seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Save a tiny HF model with save_pretrained(safe_serialization=True); returns the HF model."""
    model = make_hf_model(arch, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    return model


class ContiguousKVCache:
    """One growing K/V tensor per (sequence, layer): the simplest correct cache,
    used as the reference for paged/evicting caches."""

    def __init__(self, window: int | None = None) -> None:
        self.window = window  # Mistral's sliding window, when the model has one
        self.k: dict[tuple[object, int], Tensor] = {}
        self.v: dict[tuple[object, int], Tensor] = {}

    def length(self, seq_id: object) -> int:
        t = self.k.get((seq_id, 0))
        return 0 if t is None else t.shape[0]

    def attention(self, seq_ids: list[object], lens: list[int]) -> AttentionFn:
        """AttentionFn for one forward whose flat tokens are `lens[i]`
        consecutive new tokens of `seq_ids[i]`, in that order."""

        def fn(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            outs, start = [], 0
            for sid, n in zip(seq_ids, lens):
                key = (sid, layer)
                past = 0 if key not in self.k else self.k[key].shape[0]
                kk = k[start:start + n] if past == 0 else torch.cat([self.k[key], k[start:start + n]])
                vv = v[start:start + n] if past == 0 else torch.cat([self.v[key], v[start:start + n]])
                self.k[key], self.v[key] = kk, vv
                qpos = past + torch.arange(n)
                kpos = torch.arange(past + n)[None, :]
                mask = kpos <= qpos[:, None]  # [n, past+n], causal
                if self.window is not None:
                    mask &= kpos > qpos[:, None] - self.window
                o = F.scaled_dot_product_attention(
                    q[start:start + n].transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1),
                    attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
                outs.append(o.transpose(0, 1))
                start += n
            return torch.cat(outs)

        return fn


def run_step(model: TransformerModel, cache: ContiguousKVCache, chunks: list[tuple[object, list[int]]]) -> Tensor:
    """Feed each sequence's next tokens (one varlen batch); returns float32
    logits [len(chunks), vocab] for the last token of each chunk."""
    seq_ids = [sid for sid, _ in chunks]
    lens = [len(toks) for _, toks in chunks]
    ids = torch.tensor([t for _, toks in chunks for t in toks], dtype=torch.long, device=model.device)
    positions = torch.cat([cache.length(sid) + torch.arange(n) for sid, n in zip(seq_ids, lens)]).to(model.device)
    hidden = model(ids, positions, cache.attention(seq_ids, lens))
    last = torch.tensor(lens).cumsum(0) - 1
    return model.compute_logits(hidden[last.to(model.device)])


def hf_logits(hf_model, input_ids: Tensor) -> Tensor:
    """Full-sequence float32 logits [B, S, vocab] from a transformers model."""
    with torch.no_grad():
        return hf_model(input_ids=input_ids).logits.float()
