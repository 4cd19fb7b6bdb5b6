"""Block features: the per-block summaries compute keeps (mean key, value
norm) and the batches it sends the advisor when blocks leave the protected
recent window (the delayed decision point), or all at once for an advisor
that lost them."""
from __future__ import annotations

import torch

from kvkernels import ops
from services.compute.eviction.advisor import FeatureBatch
from services.compute.engine.kv_pool import KVPool
from services.compute.engine.sequence import Sequence, column_addresses


def update_features(seqs: list[Sequence], pool: KVPool) -> None:
    """Key/value summaries of the blocks that became full in the last step
    (they are still the trailing columns: rounds run after this), every
    sequence's in one kernel call: a call per sequence was a few launches per
    sequence per step on a GPU. Which columns come from the host."""
    todo = []
    for seq in seqs:
        full = seq.num_cached // seq.block_size
        if full > seq.feat_upto:
            last = (seq.num_cached - 1) // seq.block_size
            first = seq.num_blocks - 1 - (last - seq.feat_upto)
            todo.append((seq, first, full - seq.feat_upto))
            seq.feat_upto = full
    if not todo:
        return
    addr = column_addresses([(seq, range(a, a + k)) for seq, a, k in todo])    # [L, Hkv, sum k]
    km, vn = ops.block_features(*pool.blocks_view(todo[0][0].block_size), addr.reshape(-1))
    L, H, n = addr.shape
    ks = [k for _, _, k in todo]
    dst, src = [], []
    for (seq, a, k), m, v in zip(todo, km.view(L, H, n, -1).split(ks, 2), vn.view(L, H, n).split(ks, 2)):
        dst += [seq.key_mean[:, :, a:a + k], seq.value_norm[:, :, a:a + k]]
        src += [m, v]
    torch._foreach_copy_(dst, src)


def blocks_leaving(seq: Sequence, every: int = 1) -> range:
    """Blocks that just left the protected recent window: the delayed decision
    point. After the prompt they go in batches of ``every`` blocks (the
    engine's plan interval); the prompt's chunk ends always send. Marks them
    sent."""
    st, bs, n = seq.eviction, seq.block_size, seq.num_cached
    upto = max(0, (n - st.recent) // bs) if st.recent > 0 else n // bs
    start = max(seq.sent_upto, st.sink_blocks)
    if n > seq.num_prompt and upto - start < every:
        return range(0)
    seq.sent_upto = max(seq.sent_upto, upto)
    return range(start, upto)


def leaving_features(leaving: list[tuple[Sequence, range]]) -> list[FeatureBatch | None]:
    """Features of the blocks ``blocks_leaving`` named, one batch per entry
    (None for an empty range). They are resident in every row (never evicted
    while protected); each row finds a block at the number of its blocks older
    than it. One copy to the host for every sequence: a copy per field per
    block was a GPU sync each."""
    packed = []
    for seq, r in leaving:
        if not len(r):
            continue
        L, H, _ = seq.block_index.shape
        names = torch.arange(r.start, r.stop, device=seq.block_index.device, dtype=seq.block_index.dtype)
        # Rows keep their blocks in order: a binary search per name (comparing every
        # block with every name was [L, Hkv, NB, k]: 1.5 G at the end of a 4k prompt).
        col = torch.searchsorted(seq.block_index.contiguous(), names.expand(L, H, -1).contiguous())  # [L, Hkv, k]
        g = lambda t: t.gather(2, col).float()
        km = seq.key_mean.gather(2, col[..., None].expand(*col.shape, seq.head_dim)).float()
        packed.append(torch.cat([km, g(seq.value_norm)[..., None], g(seq.acc_mass)[..., None],
                                 g(seq.reach)[..., None]], 3)
                      .permute(2, 0, 1, 3).reshape(len(r), -1))               # [k, L*Hkv*(d+3)]
    host = torch.cat(packed).cpu() if packed else None
    out, at = [], 0
    for seq, r in leaving:
        if not len(r):
            out.append(None)
            continue
        L, H, d, bs, n = seq.num_layers, seq.num_kv_heads, seq.head_dim, seq.block_size, seq.num_cached
        x = host[at:at + len(r)].view(len(r), L, H, d + 3)
        at += len(r)
        block = torch.arange(r.start, r.stop)
        out.append(FeatureBatch(seq.request_id, block, block * bs, n - block * bs, x[..., :d], x[..., d],
                                x[..., d + 1], x[..., d + 2], seq.num_prompt))
    return out


def resident_block_features(seq: Sequence) -> FeatureBatch | None:
    """Features of every evictable block already sent, for an advisor that
    lost them (it restarted, or a session's next turn has a new request id).
    Rows that evicted a block get zeros for it; compute ignores plans' names
    of blocks a row no longer holds."""
    st, bs, n = seq.eviction, seq.block_size, seq.num_cached
    upto = seq.sent_upto
    first = st.sink_blocks
    if upto <= first:
        return None
    L, H, NB = seq.block_index.shape
    span = upto - first
    idx = (seq.block_index.long() - first)
    ok = (idx >= 0) & (idx < span)
    idx = torch.where(ok, idx, torch.full_like(idx, span))           # one scratch column for the rest
    dev, d = seq.key_mean.device, seq.head_dim
    km = torch.zeros(L, H, span + 1, d, device=dev).scatter_(2, idx[..., None].expand(L, H, NB, d), seq.key_mean.float())
    vn = torch.zeros(L, H, span + 1, device=dev).scatter_(2, idx, seq.value_norm.float())
    att = torch.zeros(L, H, span + 1, device=dev).scatter_(2, idx, seq.acc_mass.float())
    reach = torch.zeros(L, H, span + 1, device=dev).scatter_(2, idx, seq.reach.float())
    held = torch.zeros(L, H, span + 1, dtype=torch.bool, device=dev).scatter_(2, idx, ok)
    present = held[..., :span].any(0).any(0).nonzero().flatten().cpu()
    # What each row no longer holds, for the advisor to rank last (-1 pads the rows).
    lost = ~held[..., :span]
    k = int(lost.sum(-1).max()) if lost.numel() else 0
    names = torch.arange(first, upto, device=dev).expand(L, H, span)
    order = lost.to(torch.int8).argsort(dim=-1, descending=True, stable=True)[..., :k]
    gone = torch.where(lost.gather(2, order), names.gather(2, order), torch.full_like(order, -1))
    seq.gone = [gone.to(torch.int32).cpu()] if k else []
    if not len(present):
        return None
    pick = lambda t: t.cpu()[:, :, present].movedim(2, 0)                 # [k, L, Hkv (, d)]
    block = first + present
    return FeatureBatch(seq.request_id, block, block * bs, n - block * bs, pick(km), pick(vn), pick(att),
                        pick(reach), seq.num_prompt)
