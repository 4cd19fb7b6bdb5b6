"""One forward pass over a mixed batch: prefill chunks and decode tokens of
many sequences, flattened into one varlen token list (nano-vllm style).

The AttentionFn writes each new K/V into the sequence's pages (kv_append),
then attends over resident pages only:
- one-token rows (decode) go through ``paged_attention`` in one batched call,
  and its ``block_mass`` feeds the per-block statistics of the policies;
- prefill chunks attend over their resident pages + themselves with a causal
  mask from absolute slot positions (``block_index * bs + offset``); for
  evicting sequences the probabilities (chunk x resident, never the whole
  prompt) also give the block mass; dense ones use the fused SDPA kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import ops
from services.compute.kv_pool import KVPool
from services.compute.sequence import SNAPKV_WINDOW, Sequence, observe_decode


@dataclass
class _Prefill:
    seq: Sequence
    start: int          # first row in the flat batch
    length: int
    slot_pos: torch.Tensor  # [L, Hkv, NB*bs] absolute position of every resident slot
    q_pos: torch.Tensor     # [t]
    acc: list = None
    last: list = None
    window: list = None


class ModelRunner:
    def __init__(self, model, pool: KVPool):
        cfg = model.config
        self.model, self.pool = model, pool
        self.L, self.Hq, self.Hkv, self.d = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.G = self.Hq // self.Hkv
        self.bs = pool.block_size
        self.scale = 1.0 / math.sqrt(self.d)
        self.device = model.device

    # ------------------------------------------------------------ pages
    def _grow(self, seq: Sequence, t: int) -> None:
        have = math.ceil(seq.num_cached / self.bs)
        need = math.ceil((seq.num_cached + t) / self.bs)
        if need > have:
            k = need - have
            seq.append_blocks(self.pool.alloc(self.L * self.Hkv * k).view(self.L, self.Hkv, k), have)

    # ------------------------------------------------------------ step
    @torch.no_grad()
    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Feed ``t`` new tokens of each sequence. Returns logits [S, V] for
        the sequences whose tokens are now all cached (they need a next token)."""
        bs, dev = self.bs, self.device
        ids, pos, write_pages, last_rows, sampled = [], [], [], [], []
        decode, prefill = [], []
        for seq, t in batch:
            self._grow(seq, t)
            n0, n1 = seq.num_cached, seq.num_cached + t
            row = len(ids)
            ids.extend(seq.tokens[n0:n1])
            pos.extend(range(n0, n1))
            # New tokens live in the trailing columns, identical in every row.
            if t == 1:
                decode.append((seq, row))
                write_pages.append(seq.page_table[:, :, -1:])
            else:
                first = seq.num_blocks - 1 - ((n1 - 1) // bs - n0 // bs)
                write_pages.append(seq.page_table[:, :, [first + p // bs - n0 // bs for p in range(n0, n1)]])
                slot = (seq.block_index.long()[..., None] * bs + torch.arange(bs, device=dev)).flatten(2)
                prefill.append(_Prefill(seq, row, t, slot, torch.arange(n0, n1, device=dev), [], [], []))
            if n1 == seq.num_tokens:
                last_rows.append(len(ids) - 1)
                sampled.append(seq)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        write_pages = torch.cat(write_pages, 2).permute(0, 2, 1)               # [L, T, Hkv]
        offsets = (positions % bs).repeat_interleave(self.Hkv)

        dec = self._decode_meta(decode)
        dec_mass = []

        def attention(layer, q, k, v):
            T = q.shape[0]
            ops.kv_append(self.pool.k_pages, self.pool.v_pages, k.reshape(T * self.Hkv, self.d),
                          v.reshape(T * self.Hkv, self.d), write_pages[layer].reshape(-1), offsets)
            out = torch.empty_like(q)
            if decode:
                rows, tables, nblk, last_len = dec
                only_decode = not prefill   # then rows are exactly 0..T-1: skip the gather/scatter
                o, mass = ops.paged_attention(q if only_decode else q[rows], self.pool.k_pages,
                                              self.pool.v_pages, tables[layer], nblk, last_len, self.scale)
                if only_decode:
                    out = o
                else:
                    out[rows] = o
                dec_mass.append(mass.view(len(decode), self.Hkv, self.G, -1).mean(2))
            for pf in prefill:
                out[pf.start:pf.start + pf.length] = self._prefill_attention(layer, pf, q)
            return out

        hidden = self.model(input_ids, positions, attention)
        logits = self.model.compute_logits(hidden[last_rows]) if last_rows else None

        for seq, t in batch:
            seq.num_cached += t
        # Dense sequences never evict: their statistics would go unused.
        if decode:
            mass = torch.stack(dec_mass)                                       # [L, B, Hkv, NBmax]
            obs = [(b, seq) for b, (seq, _) in enumerate(decode) if seq.eviction.budget_blocks is not None]
            if obs:
                observe_decode([s for _, s in obs], [mass[:, b, :, :s.num_blocks] for b, s in obs])
        for pf in prefill:
            if pf.seq.eviction.budget_blocks is not None:
                pf.seq.observe(torch.stack(pf.acc), torch.stack(pf.last), torch.stack(pf.window))
        return logits, sampled

    def _decode_meta(self, decode):
        if not decode:
            return None
        nbmax = max(s.num_blocks for s, _ in decode)
        tables = torch.zeros(self.L, len(decode), self.Hkv, nbmax, dtype=torch.int32, device=self.device)
        for b, (seq, _) in enumerate(decode):
            tables[:, b, :, :seq.num_blocks] = seq.page_table
        nblk = torch.tensor([s.num_blocks for s, _ in decode], dtype=torch.int32, device=self.device)
        # The new token is written before attention, so it counts in the last block.
        last_len = torch.tensor([(s.num_cached) % self.bs + 1 for s, _ in decode],
                                dtype=torch.int32, device=self.device)
        rows = torch.tensor([r for _, r in decode], device=self.device)
        return rows, tables, nblk, last_len

    def _prefill_attention(self, layer: int, pf: _Prefill, q: torch.Tensor) -> torch.Tensor:
        seq, t, G, d = pf.seq, pf.length, self.G, self.d
        pages = seq.page_table[layer].long()                                   # [Hkv, NB]
        NB = pages.shape[1]
        k = self.pool.k_pages[pages].reshape(self.Hkv, NB * self.bs, d)
        v = self.pool.v_pages[pages].reshape(self.Hkv, NB * self.bs, d)
        # Slots past the last written token have positions > every query: masked too.
        causal = pf.slot_pos[layer][:, None, None, :] <= pf.q_pos[None, None, :, None]
        if seq.eviction.budget_blocks is None:
            # Dense: every row holds the same blocks and no statistics are
            # needed, so the fused kernel does it without materialising probs.
            out = F.scaled_dot_product_attention(
                q[pf.start:pf.start + t].transpose(0, 1), k, v, attn_mask=causal[0, 0],
                scale=self.scale, enable_gqa=G > 1)
            return out.transpose(0, 1)
        k, v = k.float(), v.float()
        qh = q[pf.start:pf.start + t].float().view(t, self.Hkv, G, d).permute(1, 2, 0, 3)
        logits = torch.einsum("hgtd,hsd->hgts", qh, k) * self.scale            # [Hkv, G, t, S]
        probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
        out = torch.einsum("hgts,hsd->hgtd", probs, v)
        mass = probs.view(self.Hkv, G, t, NB, self.bs).sum(-1).mean(1)         # [Hkv, t, NB]
        pf.acc.append(mass.sum(1))
        pf.last.append(mass[:, -1])
        pf.window.append(mass[:, -SNAPKV_WINDOW:])
        return out.permute(2, 0, 1, 3).reshape(t, self.Hq, d).to(q.dtype)
