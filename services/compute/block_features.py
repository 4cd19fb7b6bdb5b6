"""Block features: the per-block summaries compute keeps (mean key, value
norm) and the batches it sends the advisor when blocks leave the protected
recent window (the delayed decision point), or all at once for an advisor
that lost them."""
from __future__ import annotations

import torch

from kvkernels import ops
from services.compute.advisor import BlockFeatures
from services.compute.kv_pool import KVPool
from services.compute.sequence import Sequence


def update_features(seq: Sequence, pool: KVPool) -> None:
    """Key/value summaries of the blocks that became full in the last step
    (they are still the trailing columns: rounds run after this)."""
    bs, n = seq.block_size, seq.num_cached
    full = n // bs
    if full <= seq.feat_upto:
        return
    last = (n - 1) // bs
    cols = torch.arange(seq.feat_upto, full, device=seq.page_table.device)
    cols = seq.num_blocks - 1 - (last - cols)
    pages = seq.page_table[:, :, cols]                                  # [L, Hkv, k]
    km, vn = ops.block_features(pool.k_pages, pool.v_pages, pages.reshape(-1))
    L, H, k = pages.shape
    seq.key_mean[:, :, cols] = km.view(L, H, k, -1).to(seq.key_mean.device)
    seq.value_norm[:, :, cols] = vn.view(L, H, k).to(seq.value_norm.device)
    seq.feat_upto = full


def blocks_leaving_window(seq: Sequence, every: int = 1) -> list[BlockFeatures]:
    """Features of blocks that just left the protected recent window: the
    delayed decision point. They are resident in every row (never evicted
    while protected). After the prompt they go in batches of ``every`` blocks
    (the engine's plan interval); the prompt's chunk ends always send."""
    st, bs, n = seq.eviction, seq.block_size, seq.num_cached
    upto = max(0, (n - st.recent) // bs) if st.recent > 0 else n // bs
    start = max(seq.sent_upto, st.sink_blocks)
    if n > seq.num_prompt and upto - start < every:
        return []
    out = []
    for b in range(start, upto):
        col = (seq.block_index < b).sum(-1, keepdim=True).long()       # [L, Hkv, 1]
        gather = lambda t: t.gather(2, col).squeeze(2)
        km = seq.key_mean.gather(2, col[..., None].expand(*col.shape, seq.head_dim)).squeeze(2)
        out.append(BlockFeatures(seq.request_id, b, b * bs, km.cpu(), gather(seq.value_norm).cpu(),
                                 gather(seq.acc_mass).cpu(), n - b * bs))
    seq.sent_upto = max(seq.sent_upto, upto)
    return out


def resident_block_features(seq: Sequence) -> list[BlockFeatures]:
    """Features of every evictable block already sent, for an advisor that
    lost them (it restarted, or a session's next turn has a new request id).
    Rows that evicted a block get zeros for it; compute ignores plans' names
    of blocks a row no longer holds."""
    st, bs, n = seq.eviction, seq.block_size, seq.num_cached
    upto = seq.sent_upto
    first = st.sink_blocks
    if upto <= first:
        return []
    L, H, NB = seq.block_index.shape
    span = upto - first
    idx = (seq.block_index.long() - first)
    ok = (idx >= 0) & (idx < span)
    idx = torch.where(ok, idx, torch.full_like(idx, span))           # one scratch column for the rest
    dev, d = seq.key_mean.device, seq.head_dim
    km = torch.zeros(L, H, span + 1, d, device=dev).scatter_(2, idx[..., None].expand(L, H, NB, d), seq.key_mean.float())
    vn = torch.zeros(L, H, span + 1, device=dev).scatter_(2, idx, seq.value_norm.float())
    att = torch.zeros(L, H, span + 1, device=dev).scatter_(2, idx, seq.acc_mass.float())
    held = torch.zeros(L, H, span + 1, dtype=torch.bool, device=dev).scatter_(2, idx, ok)
    present = held[..., :span].any(0).any(0).nonzero().flatten().tolist()
    # What each row no longer holds, for the advisor to rank last (-1 pads the rows).
    lost = ~held[..., :span]
    k = int(lost.sum(-1).max()) if lost.numel() else 0
    names = torch.arange(first, upto, device=dev).expand(L, H, span)
    order = lost.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :k]
    gone = torch.where(lost.gather(2, order), names.gather(2, order), torch.full_like(order, -1))
    seq.gone = [gone.to(torch.int32).cpu()] if k else []
    km, vn, att = km.cpu(), vn.cpu(), att.cpu()
    return [BlockFeatures(seq.request_id, first + j, (first + j) * bs, km[:, :, j], vn[:, :, j], att[:, :, j],
                          n - (first + j) * bs) for j in present]
