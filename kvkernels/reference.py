"""PyTorch references for the four kernel ops (docs/design/internals.md, "Kernel ops").

They run on any device and are what CPU runs use; the CUDA kernels in
`kvkernels/cuda.py` are tested against them. Everything is batched over
sequences, heads and blocks: one call handles one layer's page tables.
"""
from __future__ import annotations

import torch


def _valid_positions(num_blocks: torch.Tensor, last_block_len: torch.Tensor,
                     nb: int, bs: int) -> torch.Tensor:
    """[B, NB, bs] bool: which (slot, offset) hold a real token.

    Slots before the last resident one are full; the last one holds
    `last_block_len` tokens; slots past `num_blocks` are padding."""
    dev = num_blocks.device
    slot = torch.arange(nb, device=dev).view(1, nb, 1)
    off = torch.arange(bs, device=dev).view(1, 1, bs)
    n = num_blocks.to(torch.long).view(-1, 1, 1)
    last = last_block_len.to(torch.long).view(-1, 1, 1)
    return (slot < n - 1) | ((slot == n - 1) & (off < last))


def paged_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                    page_table: torch.Tensor, num_blocks: torch.Tensor,
                    last_block_len: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query per sequence over its resident blocks.

    Returns `out[B, Hq, d]` in q's dtype and `block_mass[B, Hq, NB]` (fp32):
    the softmax probability each query head put on each resident block, read
    off the same probabilities that produce `out` (no second pass)."""
    B, Hq, d = q.shape
    _, Hkv, NB = page_table.shape
    bs = k_pages.shape[1]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    G = Hq // Hkv
    valid = _valid_positions(num_blocks, last_block_len, NB, bs)  # [B, NB, bs]
    # Padding columns may name any page (the engine uses page 0): read page 0.
    idx = page_table.to(torch.long).masked_fill(~valid[:, None, :, 0], 0)
    # Gather in the storage dtype, then widen: fp32 accumulation for bf16/fp16.
    k = k_pages[idx].to(torch.float32)  # [B, Hkv, NB, bs, d]
    # Padding and the unwritten tail of the last block may hold anything
    # (torch.empty pools, stale pages): zero them so 0 * NaN never reaches out.
    v = v_pages[idx].to(torch.float32).masked_fill(~valid.view(B, 1, NB, bs, 1), 0.0)
    valid = valid.view(B, 1, 1, NB, bs)
    qf = q.to(torch.float32).view(B, Hkv, G, d)
    logits = torch.einsum("bhgd,bhnpd->bhgnp", qf, k) * scale  # [B, Hkv, G, NB, bs]
    logits = logits.masked_fill(~valid, float("-inf"))
    flat = logits.reshape(B, Hkv, G, NB * bs)
    probs = torch.softmax(flat, dim=-1)
    # A sequence with no resident token would give NaN (all -inf); define it as zero.
    probs = torch.where(valid.reshape(B, 1, 1, NB * bs), probs, torch.zeros((), device=q.device))
    probs = probs.view(B, Hkv, G, NB, bs)
    out = torch.einsum("bhgnp,bhnpd->bhgd", probs, v).reshape(B, Hq, d).to(q.dtype)
    block_mass = probs.sum(-1).reshape(B, Hq, NB)
    return out, block_mass


def kv_append(k_pages: torch.Tensor, v_pages: torch.Tensor, k_new: torch.Tensor,
              v_new: torch.Tensor, page: torch.Tensor, offset: torch.Tensor) -> None:
    """Write row i of k_new/v_new to (page[i], offset[i]) in place."""
    p = page.to(device=k_pages.device, dtype=torch.long)
    o = offset.to(device=k_pages.device, dtype=torch.long)
    k_pages[p, o] = k_new.to(k_pages.dtype)
    v_pages[p, o] = v_new.to(v_pages.dtype)


def check_eviction_args(scores: torch.Tensor, evictable: torch.Tensor, num_evict: int) -> None:
    if scores.dim() != 2 or scores.shape != evictable.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and evictable "
                         f"{tuple(evictable.shape)} must be the same [R, NB] shape")
    if num_evict < 0 or num_evict > scores.shape[1]:
        raise ValueError(f"num_evict={num_evict} outside [0, NB={scores.shape[1]}]")
    if num_evict and scores.shape[0]:
        short = evictable.sum(dim=1) < num_evict
        if bool(short.any()):
            row = int(short.nonzero()[0, 0])
            raise ValueError(f"row {row} has {int(evictable[row].sum())} evictable "
                             f"columns, fewer than num_evict={num_evict}")


def eviction_select(scores: torch.Tensor, evictable: torch.Tensor, num_evict: int) -> torch.Tensor:
    """Per row, the `num_evict` lowest-scored evictable columns, lowest first;
    equal scores go to the lower column (the older block)."""
    check_eviction_args(scores, evictable, num_evict)
    R, NB = scores.shape
    if num_evict == 0:
        return torch.empty(R, 0, dtype=torch.long, device=scores.device)
    # Two stable sorts give the key (not evictable, score, column) without
    # sentinel values, so +inf / NaN scores of evictable blocks stay evictable.
    order = torch.sort(scores.to(torch.float32), dim=1, stable=True).indices
    blocked = (~evictable.gather(1, order)).to(torch.uint8)
    order = order.gather(1, torch.sort(blocked, dim=1, stable=True).indices)
    return order[:, :num_evict].contiguous()


def block_features(k_pages: torch.Tensor, v_pages: torch.Tensor, pages: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summaries of full blocks: mean key [N, d] and mean value L2 norm [N] (fp32)."""
    idx = pages.to(device=k_pages.device, dtype=torch.long)
    k = k_pages[idx].to(torch.float32)  # [N, bs, d]
    v = v_pages[idx].to(torch.float32)
    return k.mean(dim=1), torch.linalg.vector_norm(v, dim=-1).mean(dim=1)


def move_blocks(k_blocks: torch.Tensor, v_blocks: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy block ``src[i]`` to block ``dst[i]`` in place, as if every source
    were read before any destination is written (a compaction's sources and
    destinations overlap)."""
    s = src.to(device=k_blocks.device, dtype=torch.long)
    d = dst.to(device=k_blocks.device, dtype=torch.long)
    k_blocks.index_copy_(0, d, k_blocks.index_select(0, s))
    v_blocks.index_copy_(0, d, v_blocks.index_select(0, s))
