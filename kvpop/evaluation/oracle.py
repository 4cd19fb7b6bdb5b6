"""The `oracle` policy (evaluation only): it knows the future. Per (layer,
kv-head) row it keeps, first, the blocks holding the positions the task's
answer depends on (the dependency list, where the suite has one); then the
blocks the dense model itself attends to most while writing the reference
answer (the peak attention any answer query of that kv-head's query heads
pays to a position of the block, from one dense teacher-forced forward);
recency breaks ties. The engine's shared protection adds the same sink and
recent window as every other policy.

The dependency list alone was not an upper bound: it misses what the model
reads while writing intermediate steps or ending its answer (arithmetic and
registers at 93.75%). The dense attention over the answer covers those, per
row, so the oracle is the bar the learned policy is measured against."""
from __future__ import annotations

import math

import torch

from services.compute.eviction.policies import Policy

QUERY_CHUNK = 512


class _AnswerAttention:
    """AttentionFn: causal attention for every query (SDPA, no probabilities
    kept), and the probabilities of the answer queries ``first .. T - 2``
    only, as their peak per position. Materialising [Hq, T, T] for an 8k
    prompt would be 2.4 GB per layer to read ~30 rows of it."""

    def __init__(self, first: int, out: torch.Tensor):
        self.first, self.out = first, out

    def __call__(self, layer, q, k, v):
        (T, Hq, d), Hkv = q.shape, k.shape[1]
        G, scale = Hq // Hkv, d ** -0.5
        kh, vh = k.transpose(0, 1), v.transpose(0, 1)
        o = torch.empty(Hq, T, d, dtype=q.dtype, device=q.device)
        pos = torch.arange(T, device=q.device)
        for s in range(0, T, QUERY_CHUNK):   # in chunks, as prefill: a whole causal mask is T x T per head
            e = min(T, s + QUERY_CHUNK)
            o[:, s:e] = torch.nn.functional.scaled_dot_product_attention(
                q[s:e].transpose(0, 1), kh[:, :e], vh[:, :e], attn_mask=pos[None, :e] <= pos[s:e, None],
                scale=scale, enable_gqa=G > 1)
        n = T - 1 - self.first
        if n > 0:
            qa = q[self.first:T - 1].float().view(n, Hkv, G, d).permute(1, 2, 0, 3)       # [Hkv, G, n, d]
            logits = torch.einsum("hgnd,htd->hgnt", qa, k.float().transpose(0, 1)) * scale
            qpos = torch.arange(self.first, T - 1, device=q.device)
            logits.masked_fill_(torch.arange(T, device=q.device)[None, :] > qpos[:, None], float("-inf"))
            self.out[layer] = torch.softmax(logits, -1).amax(2).amax(1).cpu()      # [Hkv, T]
        return o.transpose(0, 1)


@torch.no_grad()
def answer_attention(model, ids: list[int], prompt_len: int) -> torch.Tensor:
    """[L, Hkv, T]: the peak attention the queries that write the answer
    (positions prompt_len - 1 .. T - 2) pay to each position, max over the
    query heads of each kv-head, in the dense model."""
    mc = model.config
    T = len(ids)
    out = torch.zeros(mc.num_layers, mc.num_kv_heads, T)
    x = torch.as_tensor(ids, dtype=torch.long, device=model.device)
    model(x, torch.arange(T, device=model.device), _AnswerAttention(max(0, prompt_len - 1), out))
    return out


class OraclePolicy(Policy):
    name = "oracle"

    def __init__(self, depends: list[int], block_size: int, attention: torch.Tensor | None = None):
        self.blocks = sorted({p // block_size for p in depends})
        self.block_att = None
        if attention is not None:   # [L, Hkv, T] -> per block: the peak over its positions
            L, H, T = attention.shape
            nb = math.ceil(T / block_size)
            padded = torch.zeros(L, H, nb * block_size)
            padded[..., :T] = attention
            self.block_att = padded.view(L, H, nb, block_size).amax(-1)

    def score(self, seq):
        bi = seq.block_index
        needed = torch.isin(bi, torch.tensor(self.blocks, dtype=bi.dtype, device=bi.device)).float()
        att = torch.zeros(bi.shape)
        if self.block_att is not None:
            nb = self.block_att.shape[-1]
            idx = bi.long().clamp(max=nb - 1).cpu()
            att = torch.where(bi.cpu() < nb, self.block_att.gather(-1, idx), 0.0)
        recency = bi.float().cpu() / (float(bi.max()) + 1 if bi.numel() else 1.0)
        # Needed blocks first (att <= 1), then the dense answer's attention, then recency.
        return (2.0 * needed.cpu() + att * (1 - 1e-3) + 1e-3 * recency).to(bi.device)
