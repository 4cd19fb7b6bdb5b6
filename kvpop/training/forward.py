"""The training forward: the same math as TransformerModel.forward_dense (no
padding mask: batches are right-padded, which causal attention never sees),
but with the RoPE tables sliced rather than gathered, so torch.compile makes
one graph of it, and logits only where there is a loss."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def hidden_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    B, S = input_ids.shape
    x = model.model.embed_tokens(input_ids)
    cos, sin = model.rotary.tables(input_ids.device, x.dtype)
    cos, sin = cos[:S, None, :], sin[:S, None, :]
    gqa = model.config.num_heads != model.config.num_kv_heads
    for layer in model.model.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).view(B, S, attn.num_heads, attn.head_dim)
        k = attn.k_proj(h).view(B, S, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(h).view(B, S, attn.num_kv_heads, attn.head_dim)
        q = q * cos + q.roll(attn.head_dim // 2, dims=-1) * sin
        k = k * cos + k.roll(attn.head_dim // 2, dims=-1) * sin
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=gqa)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(B, S, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.model.norm(x)
