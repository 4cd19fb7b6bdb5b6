"""One forward pass over a mixed batch: prefill chunks and decode tokens of
many sequences, flattened into one varlen token list (nano-vllm style).

The AttentionFn writes each new K/V into the sequence's pages (kv_append),
then attends over resident pages only:
- one-token rows (decode) go through ``paged_attention`` in one batched call,
  and its ``block_mass`` feeds the per-block statistics of the policies; off
  the CUDA kernels (CPU) the runner gathers pages itself with step-invariant
  indices and masks built once per step, not once per layer, and a batch of
  dense sequences uses the fused SDPA kernel (no probabilities needed);
- Mistral's sliding window masks keys older than ``window`` positions, from
  each slot's absolute position, at decode (torch path) and prefill;
- prefill chunks attend over their resident pages + themselves with a causal
  mask from absolute slot positions (``block_index * bs + offset``, in the
  packed order of sequence.py; a page's unused tail is masked); for
  evicting sequences the probabilities (chunk x resident, never the whole
  prompt) also give the block mass; dense ones use the fused SDPA kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvkernels import ops
from services.compute.engine.kv_pool import KVPool
from services.compute.engine.sequence import Sequence, append_blocks, observe_decode


@dataclass
class _Prefill:
    seq: Sequence
    start: int          # first row in the flat batch
    length: int
    slot_pos: torch.Tensor  # [L, Hkv, NP*page] absolute position of every page slot (unused: past every query)
    q_pos: torch.Tensor     # [t]
    acc: list = None
    last: list = None
    window: list = None
    fresh: bool = False     # the sequence's first tokens: nothing cached before this chunk
    reach: list = None      # learned: per layer [Hkv, t], each query's reach (Sequence.reach_peak)


@dataclass
class _Decode:
    rows: torch.Tensor      # [B] rows of the decode tokens in the flat batch
    tables: torch.Tensor    # [L, B, Hkv, NP] int32 page tables, padded with page 0
    stats: bool             # some sequence evicts: block mass is needed
    kernel: bool            # ops.paged_attention (CUDA); else the torch path below
    nblk: torch.Tensor = None      # kernel: pages per sequence
    last_len: torch.Tensor = None  # kernel: written slots of the last page
    nbmax: int = 0                 # most resident blocks (columns) of a sequence
    by_block: bool = False         # kernel over the pool's blocks view: tables name blocks, mass per block
    index: torch.Tensor = None     # tables as int64 (gather index)
    block_index: torch.Tensor = None  # torch path: [L, B, Hkv, nbmax] int64 block numbers, padded past every query
    visible: torch.Tensor = None   # [L, B, Hkv, 1, S] bool
    length: int = 0                # one dense sequence holding positions 0..length-1 in order: exact attention


def stack_columns(ts: list[torch.Tensor], width: int, fill: int) -> torch.Tensor:
    """Stack [L, Hkv, NB_i] tensors as [L, B, Hkv, width], each padded with
    ``fill``: one cat and one gather whatever B (a pad per sequence was a
    kernel launch per sequence per step on a GPU). Sizes come from the host."""
    sizes = [t.shape[2] for t in ts]
    if all(n == width for n in sizes):
        return torch.stack(ts, 1)
    flat = torch.cat(ts, 2)                                                    # [L, Hkv, sum NB]
    if not flat.shape[2]:
        return flat.new_full((flat.shape[0], len(ts), flat.shape[1], width), fill)
    dev = flat.device
    lens = torch.tensor(sizes, device=dev)
    starts = torch.cumsum(lens, 0) - lens
    col = torch.arange(width, device=dev)
    valid = col < lens[:, None]                                                # [B, width]
    idx = torch.where(valid, starts[:, None] + col, 0).flatten()
    out = flat.index_select(2, idx).view(flat.shape[0], flat.shape[1], len(ts), width)
    return out.masked_fill(~valid, fill).transpose(1, 2).contiguous()


def slot_positions(block_index: torch.Tensor, bs: int, slots: int) -> torch.Tensor:
    """[..., NB] block numbers -> [..., slots] absolute position of every page
    slot in packed order; slots past the resident blocks get a position past
    every query (masked as the future)."""
    pos = (block_index.long()[..., None] * bs + torch.arange(bs, device=block_index.device)).flatten(-2)
    if pos.shape[-1] < slots:
        pos = torch.cat([pos, pos.new_full(pos.shape[:-1] + (slots - pos.shape[-1],), 1 << 40)], -1)
    return pos


class ModelRunner:
    def __init__(self, model, pool: KVPool, block_size: int | None = None):
        cfg = model.config
        self.model, self.pool = model, pool
        self.L, self.Hq, self.Hkv, self.d = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.G = self.Hq // self.Hkv
        self.bs = pool.page_size if block_size is None else block_size     # eviction unit
        self.page = pool.page_size                                          # memory unit
        if self.page % self.bs:
            raise ValueError(f"page size {self.page} is not a multiple of block size {self.bs}")
        self.c = self.page // self.bs                                       # blocks per page
        # Per-block writes and summaries address blocks in this view of the pool (KVPool.blocks_view).
        self.k_blocks, self.v_blocks = pool.blocks_view(self.bs)
        self.scale = 1.0 / math.sqrt(self.d)
        self.device = model.device
        self.window = cfg.sliding_window
        self.fused = ops.backend_for(pool.k_pages) != "reference"   # CUDA kernels
        # Learned sequences' reach (Sequence.reach_peak) is measured only while the
        # advisor's networks read it: the engine follows what the advisor says.
        self.measure_reach = True

    # ------------------------------------------------------------ pages
    def _grow(self, batch: list[tuple[Sequence, int]]) -> None:
        """Open the blocks (and the pages they need) this step's tokens need,
        every sequence's at once."""
        grow = []
        for seq, t in batch:
            have = math.ceil(seq.num_cached / self.bs)
            need = math.ceil((seq.num_cached + t) / self.bs)
            if need > have:
                new_pages = seq.pages_for(seq.num_blocks + need - have) - seq.num_row_pages
                grow.append((seq, need - have, have, new_pages))
        if not grow:
            return
        rows = self.L * self.Hkv
        pages = self.pool.alloc(rows * sum(p for *_, p in grow)).split([rows * p for *_, p in grow])
        append_blocks([g[0] for g in grow], [p.view(self.L, self.Hkv, g[3]) for p, g in zip(pages, grow)],
                      [g[2] for g in grow], [g[1] for g in grow])

    # ------------------------------------------------------------ step
    @torch.no_grad()
    def run(self, batch: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Feed ``t`` new tokens of each sequence. Returns logits [S, V] for
        the sequences whose tokens are now all cached (they need a next token)."""
        bs, c, dev = self.bs, self.c, self.device
        ids, pos, write_pages, write_slots, last_rows, sampled = [], [], [], [], [], []
        decode, prefill = [], []
        self._grow(batch)
        for seq, t in batch:
            n0, n1 = seq.num_cached, seq.num_cached + t
            row = len(ids)
            ids.extend(seq.tokens[n0:n1])
            pos.extend(range(n0, n1))
            # New tokens live in the trailing columns, identical in every row.
            # Pages come as views (no launch per decoding sequence); the slot within the page from the host.
            if t == 1:
                decode.append((seq, row))
                col = seq.num_blocks - 1
                write_pages.append(seq.page_table[:, :, col // c:col // c + 1])
                write_slots.append(col % c)
            else:
                first = seq.num_blocks - 1 - ((n1 - 1) // bs - n0 // bs)
                cols = [first + p // bs - n0 // bs for p in range(n0, n1)]
                write_pages.append(seq.page_table[:, :, [col // c for col in cols]])
                write_slots.extend(col % c for col in cols)
                slot = slot_positions(seq.block_index, bs, seq.num_row_pages * self.page)
                prefill.append(_Prefill(seq, row, t, slot, torch.arange(n0, n1, device=dev), [], [], [], n0 == 0, []))
            if n1 == seq.num_tokens:
                last_rows.append(len(ids) - 1)
                sampled.append(seq)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        # int64 once per step: the reference kv_append would convert in every layer.
        write_pages = torch.cat(write_pages, 2).permute(0, 2, 1).long()        # [L, T, Hkv]
        if c > 1:   # the block's address in the pool's blocks view
            write_pages = write_pages * c + torch.tensor(write_slots, device=dev).view(1, -1, 1)
        offsets = (positions % bs).repeat_interleave(self.Hkv)

        dec = self._decode_meta(decode)
        dec_mass = []

        def attention(layer, q, k, v):
            T = q.shape[0]
            ops.kv_append(self.k_blocks, self.v_blocks, k.reshape(T * self.Hkv, self.d),
                          v.reshape(T * self.Hkv, self.d), write_pages[layer].reshape(-1), offsets)
            out = torch.empty_like(q)
            if decode:
                only_decode = not prefill   # then rows are exactly 0..T-1: skip the gather/scatter
                qd = q if only_decode else q[dec.rows]
                if dec.kernel:
                    kp, vp = (self.k_blocks, self.v_blocks) if dec.by_block else (self.pool.k_pages, self.pool.v_pages)
                    o, mass = ops.paged_attention(qd, kp, vp, dec.tables[layer], dec.nblk, dec.last_len, self.scale)
                    mass = mass.view(len(decode), self.Hkv, self.G, -1).mean(2) if dec.stats else None
                else:
                    o, mass = self._decode_attention(layer, qd, dec)
                if only_decode:
                    out = o
                else:
                    out[dec.rows] = o
                if dec.stats:
                    dec_mass.append(mass)
            for pf in prefill:
                out[pf.start:pf.start + pf.length] = self._prefill_attention(layer, pf, q, k, v)
            return out

        hidden = self.model(input_ids, positions, attention)
        logits = self.model.compute_logits(hidden[last_rows]) if last_rows else None

        for seq, t in batch:
            seq.num_cached += t
        # Dense sequences never evict: their statistics would go unused.
        if dec_mass:
            mass = torch.stack(dec_mass)                                       # [L, B, Hkv, NBmax]
            obs = [(b, seq) for b, (seq, _) in enumerate(decode) if seq.eviction.budget_blocks is not None]
            if obs:
                observe_decode([s for _, s in obs], [mass[:, b, :, :s.num_blocks] for b, s in obs])
            learned = [(b, seq) for b, seq in obs if seq.eviction.policy == "learned"]
            if learned and self.measure_reach:
                self._decode_reach(mass, learned, dec)
        for pf in prefill:
            if pf.seq.eviction.budget_blocks is not None:
                pf.seq.observe(torch.stack(pf.acc), torch.stack(pf.last), torch.stack(pf.window))
                if pf.reach:
                    pf.seq.observe_reach(torch.stack(pf.reach), int(pf.q_pos[0]))
        return logits, sampled

    def _decode_reach(self, mass: torch.Tensor, learned: list[tuple[int, Sequence]], dec: "_Decode") -> None:
        """Sequence.reach_peak of each learned sequence's decode query, folded into
        its newest block (the last column), for the whole batch at once: a few
        launches per step whatever the batch (a call per sequence was a few each).
        The block numbers the torch path stacked for attention are reused."""
        seqs = [s for _, s in learned]
        dev, width = mass.device, mass.shape[3]
        # mass holds every decoding sequence; pick the learned ones unless they are all of them.
        pick = None if len(learned) == mass.shape[1] else torch.tensor([b for b, _ in learned], device=dev)
        m = mass if pick is None else mass.index_select(1, pick)                          # [L, n, Hkv, NB]
        if dec.block_index is not None:
            bidx = dec.block_index[..., :width]
            bidx = bidx if pick is None else bidx.index_select(1, pick)
        else:
            bidx = stack_columns([s.block_index for s in seqs], width, 1 << 30).long()
        last_token = (bidx + 1) * self.bs - 1
        reach_from = torch.tensor([s.num_cached - 1 - s.eviction.recent for s in seqs], device=dev)
        far = last_token < reach_from.view(1, -1, 1, 1)
        peak = torch.where(far, m, torch.zeros((), device=dev)).amax(-1)                 # [L, n, Hkv]
        torch._foreach_maximum_([s.reach[:, :, -1] for s in seqs], list(peak.unbind(1)))

    def _decode_meta(self, decode) -> "_Decode | None":
        if not decode:
            return None
        B, bs, dev = len(decode), self.bs, self.device
        nbmax = max(s.num_blocks for s, _ in decode)
        npmax = max(s.num_row_pages for s, _ in decode)
        stats = any(s.eviction.budget_blocks is not None for s, _ in decode)
        # The new token is written before attention, so it counts too.
        cur = [s.num_cached for s, _ in decode]
        windowed = self.window is not None and max(cur) >= self.window
        # The CUDA kernel has no window.
        kernel = self.fused and not windowed
        # Padding names page 0 at a block number past every query (so the torch path masks it).
        seqs = [s for s, _ in decode]
        tables = stack_columns([s.page_table for s in seqs], npmax, 0)              # [L, B, Hkv, NP]
        bidx = None if kernel else stack_columns([s.block_index for s in seqs], nbmax, 1 << 30).long()
        meta = _Decode(torch.tensor([r for _, r in decode], device=dev), tables, stats, kernel, nbmax=nbmax)
        if kernel and stats and self.c > 1:
            # The kernel's mass is per page of its tables: give it the blocks view, a table
            # entry per block (built from the page tables for the whole batch at once).
            cols = torch.arange(nbmax, device=dev)
            meta.tables = (tables.long()[..., cols // self.c] * self.c + cols % self.c).to(torch.int32)
            meta.by_block = True
            meta.nblk = torch.tensor([s.num_blocks for s, _ in decode], dtype=torch.int32, device=dev)
            meta.last_len = torch.tensor([c % bs + 1 for c in cur], dtype=torch.int32, device=dev)
            return meta
        if kernel:
            meta.nblk = torch.tensor([s.num_row_pages for s, _ in decode], dtype=torch.int32, device=dev)
            meta.last_len = torch.tensor([(s.num_blocks - 1) * bs + c % bs + 1 - (s.num_row_pages - 1) * self.page
                                          for (s, _), c in zip(decode, cur)], dtype=torch.int32, device=dev)
            return meta
        # Torch path: what every layer needs is built here once. A slot is
        # visible if its absolute position is at most the query's (padding
        # columns and the unwritten tail of the last block are not) and, with
        # a sliding window, within it.
        meta.index = tables.long().flatten(1)                                  # [L, B*Hkv*NP]
        meta.block_index = bidx
        slot = slot_positions(bidx, bs, npmax * self.page)                     # [L, B, Hkv, S]
        q_pos = torch.tensor(cur, device=dev).view(1, B, 1, 1)
        visible = slot <= q_pos
        if self.window is not None:
            visible &= slot > q_pos - self.window
        meta.visible = visible.unsqueeze(3)                                    # [L, B, Hkv, 1, S]
        if B == 1 and not stats and self.window is None:
            seq = decode[0][0]
            nb = seq.block_index.shape[-1]
            if int(seq.block_index.min()) == 0 and int(seq.block_index.max()) == nb - 1:
                meta.length = cur[0] + 1    # sorted, distinct, 0..nb-1: every position, in order
        return meta

    def _decode_attention(self, layer: int, q: torch.Tensor, dec: "_Decode"):
        """One query per sequence over its gathered pages; block mass only when
        some sequence evicts."""
        B, Hkv, G, d = q.shape[0], self.Hkv, self.G, self.d
        idx = dec.index[layer]
        S = dec.tables.shape[3] * self.page
        # index_select on the flat index: ~1.5x faster than advanced indexing on CPU.
        k = self.pool.k_pages.index_select(0, idx).view(B, Hkv, S, d)
        v = self.pool.v_pages.index_select(0, idx).view(B, Hkv, S, d)
        if dec.length:
            # One dense sequence: its keys are exactly positions 0..n-1, so attend
            # to them unmasked, as transformers' decode step does (same call, same logits).
            n = dec.length
            o = F.scaled_dot_product_attention(q.view(1, self.Hq, 1, d), k[:, :, :n], v[:, :, :n],
                                               scale=self.scale, enable_gqa=G > 1)
            return o.view(1, self.Hq, d), None
        qh = q.view(B, Hkv, G, d)     # the G query heads of a kv-head act as G queries
        mask = dec.visible[layer]
        if not dec.stats:
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=self.scale)
            return o.reshape(B, self.Hq, d), None
        logits = torch.matmul(qh.float(), k.float().transpose(-1, -2)) * self.scale
        probs = torch.softmax(logits.masked_fill_(~mask, float("-inf")), -1)   # [B, Hkv, G, S]
        o = torch.matmul(probs, v.float()).to(q.dtype).reshape(B, self.Hq, d)
        return o, self._per_block(probs, dec.nbmax).mean(2)

    def _per_block(self, p: torch.Tensor, nb: int) -> torch.Tensor:
        """[..., slots] probabilities in packed order -> [..., nb] per resident block."""
        p = p[..., :nb * self.bs]
        return p if self.bs == 1 else p.reshape(*p.shape[:-1], nb, self.bs).sum(-1)

    def _prefill_attention(self, layer: int, pf: _Prefill, q: torch.Tensor, k_new: torch.Tensor,
                           v_new: torch.Tensor) -> torch.Tensor:
        seq, t, G, d = pf.seq, pf.length, self.G, self.d
        if seq.eviction.budget_blocks is None and pf.fresh and (self.window is None or t <= self.window):
            # A dense sequence's first chunk attends only to itself: plain causal
            # attention over its own new keys, the very call transformers makes
            # (no gather, no padded slots, no mask), so the logits match it bit for bit.
            rows = slice(pf.start, pf.start + t)
            out = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], k_new[rows].transpose(0, 1)[None],
                v_new[rows].transpose(0, 1)[None], is_causal=True, scale=self.scale, enable_gqa=G > 1)
            return out[0].transpose(0, 1)
        pages = seq.page_table[layer].long()                                   # [Hkv, NP]
        NB, S = seq.num_blocks, pages.shape[1] * self.page
        k = self.pool.k_pages[pages].reshape(self.Hkv, S, d)
        v = self.pool.v_pages[pages].reshape(self.Hkv, S, d)
        # Slots past the last written token have positions > every query: masked too.
        visible = lambda cols: pf.slot_pos[layer][:, None, None, cols] <= pf.q_pos[None, None, :, None]
        causal = None
        if self.window is not None or seq.eviction.budget_blocks is None:
            causal = visible(slice(None))
        if self.window is not None:
            causal &= pf.slot_pos[layer][:, None, None, :] > pf.q_pos[None, None, :, None] - self.window
        if seq.eviction.budget_blocks is None:
            # Dense: every row holds the same blocks and no statistics are
            # needed, so the fused kernel does it without materialising probs.
            out = F.scaled_dot_product_attention(
                q[pf.start:pf.start + t].transpose(0, 1), k, v, attn_mask=causal[0, 0],
                scale=self.scale, enable_gqa=G > 1)
            return out.transpose(0, 1)
        k, v = k.float(), v.float()
        qh = q[pf.start:pf.start + t].float().view(t, self.Hkv, G, d).permute(1, 2, 0, 3) * self.scale
        logits = torch.einsum("hgtd,hsd->hgts", qh, k)                         # [Hkv, G, t, S]
        if self.window is None:
            # Blocks wholly before the chunk are visible to all of its queries: only the
            # trailing columns (the chunk's own blocks, never evicted yet) and the
            # last page's unused slots need the mask.
            own = math.ceil((seq.num_cached + t) / self.bs) - seq.num_cached // self.bs
            tail = S - (NB - own) * self.bs
            logits[..., -tail:].masked_fill_(~visible(slice(-tail, None)), float("-inf"))
        else:
            logits.masked_fill_(~causal, float("-inf"))
        probs = torch.softmax(logits, -1)
        out = torch.einsum("hgts,hsd->hgtd", probs, v)
        # Block mass summed over the chunk's queries, and of the newest queries the
        # ring keeps, without a [Hkv, t, NB] copy of every query's (at block size 1
        # and a 4k context that copy and its sums were a quarter of a prefill).
        blocks = lambda p: self._per_block(p, NB).mean(1)
        window = blocks(probs[:, :, -seq.win_mass.shape[3]:])                  # [Hkv, W, NB]
        pf.acc.append(blocks(probs.sum(2)))
        pf.last.append(window[:, -1])
        pf.window.append(window)
        if seq.eviction.policy == "learned" and self.measure_reach:
            pf.reach.append(seq.reach_peak(blocks(probs), int(pf.q_pos[0]), layer))
        return out.permute(2, 0, 1, 3).reshape(t, self.Hq, d).to(q.dtype)
