"""Llama-family decoder (Llama, Qwen2, Mistral) in plain PyTorch.

Module names follow the Hugging Face weight layout, so loading a checkpoint is a
plain state_dict load. The forward pass works on a flat, varlen batch of tokens
from several sequences (nano-vllm style); attention is a callback so the engine
owns the KV cache (paged, with eviction) and this file stays cache-agnostic.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from services.compute.model.config import ModelConfig
from services.compute.model.rope import RotaryEmbedding, apply_rotary

# (layer_idx, q[T, Hq, d], k[T, Hkv, d], v[T, Hkv, d]) -> out[T, Hq, d]; q and k carry RoPE.
AttentionFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # fp32 statistics and the cast-before-scale order match HF, which matters in bf16.
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused op
        # Low precision: normalise in fp32, cast, then scale, in HF's order (it shows in bf16 logits).
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [..., hidden] -> q [..., Hq, d], k/v [..., Hkv, d], RoPE applied to q and k."""
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Backbone(nn.Module):
    """Named `model` inside TransformerModel, as in HF (`model.layers.N...`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TransformerModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling,
                                      config.max_position_embeddings)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(self, input_ids: Tensor, positions: Tensor, attention: AttentionFn) -> Tensor:
        """input_ids, positions: [T] (tokens of several sequences, flattened).
        Returns the final-norm hidden states [T, hidden]; call compute_logits
        only on the rows that need a next token."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
        T = input_ids.shape[0]
        for i, layer in enumerate(self.model.layers):
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)
            o = attention(i, q, k, v)
            x = x + attn.o_proj(o.reshape(T, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden).float()

    def forward_dense(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """Causal full-sequence forward, no cache: training and the
        full-recomputation reference. input_ids [B, S]; attention_mask [B, S]
        (1 = token, 0 = padding; left or right padding). With a mask, positions
        count real tokens only (cumsum - 1), so a left-padded row matches the
        same row unpadded. Returns float32 logits [B, S, vocab]."""
        B, S = input_ids.shape
        dev = input_ids.device
        x = self.model.embed_tokens(input_ids)
        window = self.config.sliding_window
        windowed = window is not None and S > window
        if attention_mask is None:
            positions = torch.arange(S, device=dev).expand(B, S)
        else:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        mask = None
        if attention_mask is not None or windowed:
            idx = torch.arange(S, device=dev)
            allowed = idx[None, :] <= idx[:, None]  # causal [S, S]
            if windowed:  # Mistral: a query sees only the last `window` keys, itself included
                allowed = allowed & (idx[None, :] > idx[:, None] - window)
            if attention_mask is not None:
                # A padding query still sees itself, so its softmax row is never empty (no NaN).
                allowed = allowed & (attention_mask.bool()[:, None, :] | torch.eye(S, dtype=torch.bool, device=dev))
            mask = allowed.expand(B, S, S)[:, None]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        gqa = self.config.num_heads != self.config.num_kv_heads
        for layer in self.model.layers:
            attn = layer.self_attn
            q, k, v = attn.qkv(layer.input_layernorm(x), cos, sin)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(B, S, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.compute_logits(self.model.norm(x))
