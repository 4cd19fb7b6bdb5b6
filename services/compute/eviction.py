"""The eviction round (budgets: budget.py; block features: block_features.py).

Protection is decided here, once, for every policy: sink blocks, blocks that
overlap the ``recent`` window and the newest (possibly partial) block are never
evicted. A round frees the same number of blocks in every (layer, kv-head) row
(which ones is per row) and compacts rows keeping block order.
"""
from __future__ import annotations

import torch

from kvkernels import ops
from services.compute.advisor import CLEANUP, FALLBACK, LOCAL, NO_PLAN, SHAPE_MISMATCH, UNRANKED, EvictionPlan
from services.compute.kv_pool import KVPool
from services.compute.policies import LEARNED
from services.compute.sequence import Sequence


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


def plan_rank(block_index: torch.Tensor, names: torch.Tensor) -> torch.Tensor:
    """[L, Hkv, NB] place of each resident block in its row's plan ``names``
    [L, Hkv, k] (-1 pads; as the advisor sent it, on the host) as -k (first
    named) .. -1, +inf where the plan does not name it. A per-row lookup table
    indexed by block number: O(NB + k + highest name) per row, where comparing
    every block with every name cost O(NB * k) (at 8k tokens of 1-token blocks,
    a billion comparisons a round). Sized from the names alone (read on the
    host, no device sync): a resident block past the highest name is unnamed."""
    L, H, NB = block_index.shape
    k = names.shape[-1]
    scratch = (int(names.max()) if names.numel() else -1) + 1       # pads and unnamed blocks look here
    dev = block_index.device
    names = names.reshape(L * H, k).long().to(dev)
    table = torch.full((L * H, scratch + 1), torch.inf, device=dev)
    place = (torch.arange(k, device=dev) - k).float().expand(L * H, k)
    named = names >= 0
    table.scatter_reduce_(1, torch.where(named, names, scratch), torch.where(named, place, torch.inf), "amin")
    return table.gather(1, block_index.reshape(L * H, NB).long().clamp(max=scratch)).view(L, H, NB)


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
        rank = plan_rank(seq.block_index, plan.evict)                   # plan blocks in [-k, -1]
        in_plan = torch.isfinite(rank)
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
    if st.budget_blocks is None or (st.after_prompt and seq.in_prefill):
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


def shrink_budget(seq: Sequence, pool: KVPool, to: int) -> None:
    """Cleanup (docs/design.md, protocol step 6): lower the budget to ``to``
    (the scheduler chooses it, at or above the floor) and evict now."""
    st = seq.eviction
    st.budget_blocks = to
    # The pool needs the pages now: a learned sequence uses its plan if it is fresh.
    eviction_round(seq, pool, usable_plan(seq) if st.policy == LEARNED else None, CLEANUP)
