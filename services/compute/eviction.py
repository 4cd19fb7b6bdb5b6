"""Eviction: request parameters and the eviction round.

Protection is decided here, once, for every policy: sink blocks, blocks that
overlap the ``recent`` window and the newest (possibly partial) block are never
evicted. A round frees the same number of blocks in every (layer, kv-head) row
(which ones is per row) and compacts rows keeping block order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvkernels import ops
from services.compute.advisor import (CLEANUP, FALLBACK, LOCAL, NO_PLAN, SHAPE_MISMATCH, UNRANKED,
                                      BlockFeatures, EvictionPlan)
from services.compute.kv_pool import KVPool
from services.compute.policies import LEARNED, POLICY_NAMES
from services.compute.sequence import EvictionState, Sequence


# ---------------------------------------------------------------- parameters
@dataclass(frozen=True)
class EvictionParams:
    policy: str = "dense"
    budget: int | float | None = None  # tokens (int) or fraction of prompt + max_tokens (float)
    sink: int = 4
    recent: int = 32
    block_size: int | None = None      # None: the engine's block size


def min_budget_blocks(sink_blocks: int, recent: int, block_size: int) -> int:
    """Smallest budget a round can always meet: every protected block
    (sink, the blocks overlapping the recent window, the newest block) plus
    the one block a decode step may add."""
    return sink_blocks + max(math.ceil(recent / block_size), 1) + 1


def resolve_eviction(p: EvictionParams, *, block_size: int, prompt_len: int, max_tokens: int,
                     plan_slack_blocks: int = 2, cleanup_floor: float = 0.5) -> EvictionState:
    if p.policy not in POLICY_NAMES:
        raise ValueError(f"unknown policy {p.policy!r}; choose one of {', '.join(POLICY_NAMES)}")
    if p.block_size is not None and p.block_size != block_size:
        raise ValueError(f"block_size {p.block_size} is not supported by this engine; "
                         f"its KV pool uses block_size {block_size}")
    if p.sink < 0 or p.recent < 0:
        raise ValueError(f"sink ({p.sink}) and recent ({p.recent}) must be >= 0")
    sink_blocks = math.ceil(p.sink / block_size)
    minimum = min_budget_blocks(sink_blocks, p.recent, block_size)
    if p.policy == "dense":
        return EvictionState("dense", None, minimum, sink_blocks, p.recent)
    if p.budget is None:
        raise ValueError(f"policy {p.policy!r} needs a budget (tokens, or a fraction in (0, 1])")
    if isinstance(p.budget, bool) or not isinstance(p.budget, (int, float)):
        raise ValueError(f"budget must be an int (tokens) or a float fraction, got {p.budget!r}")
    if isinstance(p.budget, float):
        if not 0.0 < p.budget <= 1.0:
            raise ValueError(f"fractional budget must be in (0, 1], got {p.budget}")
        # A fraction of a short request may be smaller than the protected
        # blocks; it is a relative request, so it is raised to the minimum.
        blocks = max(minimum, int(p.budget * (prompt_len + max_tokens)) // block_size)
    else:
        blocks = p.budget // block_size
        if blocks < minimum:
            raise ValueError(
                f"budget {p.budget} tokens is too small: with block_size {block_size}, sink {p.sink} "
                f"and recent {p.recent} it must be at least {minimum * block_size} tokens "
                f"(sink + recent + 1 block, in whole blocks)")
    floor = max(minimum, math.ceil(blocks * cleanup_floor))
    slack = plan_slack_blocks if p.policy == LEARNED else 0
    return EvictionState(p.policy, blocks, floor, sink_blocks, p.recent, slack)


# ------------------------------------------------------------------- rounds
def protected_mask(seq: Sequence) -> torch.Tensor:
    """[L, Hkv, NB] bool: sink blocks, blocks overlapping the recent window, the newest block."""
    bi = seq.block_index
    bs, n, st = seq.block_size, seq.num_cached, seq.eviction
    prot = bi < st.sink_blocks
    if st.recent > 0:
        prot |= bi >= (n - st.recent) // bs
    prot[..., -1] = True
    return prot


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


def blocks_leaving_window(seq: Sequence) -> list[BlockFeatures]:
    """Features of blocks that just left the protected recent window: the
    delayed decision point. They are resident in every row (never evicted
    while protected)."""
    st, bs, n = seq.eviction, seq.block_size, seq.num_cached
    upto = max(0, (n - st.recent) // bs) if st.recent > 0 else n // bs
    start = max(seq.sent_upto, st.sink_blocks)
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


def evict_blocks(seq: Sequence, pool: KVPool, num_evict: int, scores: torch.Tensor,
                 plan: EvictionPlan | None = None, reason: str = "") -> None:
    """Free ``num_evict`` evictable blocks from every row: the first resident
    evictable blocks named by ``plan`` (if any), then the lowest ``scores``.
    Every freed block is counted with where its ranking came from."""
    if num_evict <= 0:
        return
    L, H, NB = seq.page_table.shape
    R = L * H
    evictable = ~protected_mask(seq)
    scores = scores.float()
    in_plan = None
    if plan is not None:
        names = plan.evict.to(seq.block_index.device)
        match = seq.block_index[..., :, None] == names[..., None, :]    # [L, Hkv, NB, k]
        in_plan = match.any(-1)
        rank = match.float().argmax(-1).float() - names.shape[-1]       # plan blocks in [-k, -1]
        local = scores.argsort(-1).argsort(-1).float()                  # others in [0, NB-1]
        scores = torch.where(in_plan, rank, local)
    cols = ops.eviction_select(scores.reshape(R, NB), evictable.reshape(R, NB), num_evict)
    pages = seq.page_table.reshape(R, NB).gather(1, cols)
    if seq.eviction.policy == LEARNED:
        seq.gone.append(seq.block_index.reshape(R, NB).gather(1, cols).view(L, H, num_evict).cpu())
    drop = torch.zeros(R, NB, dtype=torch.bool, device=cols.device).scatter_(1, cols, True)
    keep = torch.arange(NB, device=cols.device).expand(R, NB)[~drop].view(L, H, NB - num_evict)
    if in_plan is not None:
        unranked = int((~in_plan.reshape(R, NB).gather(1, cols)).sum())
        seq.count_evictions(plan.source, "", R * num_evict - unranked)
        seq.count_evictions(FALLBACK, UNRANKED, unranked)
    elif seq.eviction.policy == LEARNED:
        seq.count_evictions(FALLBACK, reason or NO_PLAN, R * num_evict)
    else:
        seq.count_evictions(LOCAL, "", R * num_evict)
    seq.keep_columns(keep)
    pool.free(pages)
    seq.eviction_rounds += 1


def overshoot(seq: Sequence) -> int:
    """Blocks per row over the budget, leaving room for the block the next
    decode step may open (0 for dense sequences)."""
    st = seq.eviction
    if st.budget_blocks is None:
        return 0
    n, bs = seq.num_cached, seq.block_size
    target = st.budget_blocks - (1 if not seq.in_prefill and n % bs == 0 else 0)
    return max(0, seq.num_blocks - target)


def plan_problem(seq: Sequence) -> str:
    """Why the latest plan cannot be used ('' when there is none or it is usable
    once fresh): a fallback reason."""
    p = seq.pending_plan
    if p is None:
        return ""
    if p.error:
        return p.error
    if p.evict is None or p.evict.dim() != 3 or tuple(p.evict.shape[:2]) != (seq.num_layers, seq.num_kv_heads):
        return SHAPE_MISMATCH
    return ""


def usable_plan(seq: Sequence) -> EvictionPlan | None:
    """The latest plan if it fits the sequence and ranks every block sent so far (fresh)."""
    p = seq.pending_plan
    if p is None or plan_problem(seq) or p.covers < seq.sent_upto:
        return None
    return p


def eviction_round(seq: Sequence, pool: KVPool, plan: EvictionPlan | None = None, reason: str = "") -> None:
    """Bring every row back to its budget now. A heuristic policy ranks with
    its own scores; a ``learned`` sequence with ``plan`` (the advisor's
    ranking), or with its fallback policy counted under ``reason``. When to
    run a learned round (wait for a plan or not) is the engine's decision."""
    over = overshoot(seq)
    if over > 0:
        evict_blocks(seq, pool, over, seq.policy.score(seq), plan, reason)


def drop_outside_window(seq: Sequence, pool: KVPool, window: int) -> None:
    """Sliding-window models: free the leading blocks no future query can see
    (every position <= next query position - window). Dense sequences only:
    their rows are identical and start at their oldest block, and these are
    not policy evictions (not counted)."""
    if not seq.num_blocks:
        return
    first = int(seq.block_index[0, 0, 0])
    dead = min(seq.num_blocks - 1, (seq.num_cached - window + 1) // seq.block_size - first)
    if dead > 0:
        pool.free(seq.page_table[:, :, :dead])
        L, H, NB = seq.page_table.shape
        seq.keep_columns(torch.arange(dead, NB, device=seq.page_table.device).expand(L, H, NB - dead))


def shrink_budget(seq: Sequence, pool: KVPool) -> bool:
    """Cleanup (docs/design.md, protocol step 6): halve the way to the floor and evict now.
    Returns False when the sequence is already at its floor or is dense."""
    st = seq.eviction
    if st.budget_blocks is None or st.budget_blocks <= st.floor_blocks:
        return False
    st.budget_blocks = max(st.floor_blocks, (st.budget_blocks + st.floor_blocks) // 2)
    # The pool needs the pages now: a learned sequence uses its plan if it is fresh.
    eviction_round(seq, pool, usable_plan(seq) if st.policy == LEARNED else None, CLEANUP)
    return True
