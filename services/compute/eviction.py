"""The eviction round (budgets: budget.py; block features: block_features.py).

Protection is decided here, once, for every policy: sink blocks, blocks that
overlap the ``recent`` window and the newest (possibly partial) block are never
evicted. A round frees the same number of blocks in every (layer, kv-head) row
(which ones is per row) and compacts rows keeping block order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from services.compute.advisor import CLEANUP, FALLBACK, LOCAL, NO_PLAN, SHAPE_MISMATCH, UNRANKED, EvictionPlan
from services.compute.kv_pool import KVPool
from services.compute.policies import LEARNED
from services.compute.sequence import COLUMN_FIELDS, Sequence


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
    named) .. -1, +inf where the plan does not name it."""
    return _plan_ranks(block_index, [block_index.shape[2]], [EvictionPlan("", names)])


def _plan_ranks(block_index: torch.Tensor, sizes: list[int], plans: list[EvictionPlan | None]) -> torch.Tensor:
    """``plan_rank`` of several sequences at once: ``block_index`` [L, Hkv,
    sum NB] holds their columns side by side (``sizes`` of each). Each plan's
    lookup table (indexed by block number, built once per plan: O(k +
    highest name) per row) is read at the resident blocks; comparing every
    block with every name cost O(NB * k) (at 8k tokens of 1-token blocks, a
    billion comparisons a round). A resident block past a plan's highest
    name is unnamed; the sizes come from the host, no device value is read."""
    L, H, N = block_index.shape
    parts = []
    for bi, plan in zip(block_index.split(sizes, 2), plans):
        bi = bi.reshape(L * H, -1).long()
        if plan is None or not plan.width:
            parts.append(torch.full(bi.shape, torch.inf, device=bi.device))
        else:
            parts.append(plan.rank_table(bi.device).gather(1, bi.clamp(max=plan.width)))
    return (torch.cat(parts, 1) if len(parts) > 1 else parts[0]).view(L, H, N)


@dataclass
class Round:
    """One sequence's eviction round: free ``num_evict`` blocks from every row."""
    seq: Sequence
    num_evict: int
    plan: EvictionPlan | None = None
    reason: str = ""
    scores: torch.Tensor | None = None        # [L, Hkv, NB]; None: the sequence's policy scores


def evict_blocks(seq: Sequence, pool: KVPool, num_evict: int, scores: torch.Tensor,
                 plan: EvictionPlan | None = None, reason: str = "") -> None:
    """Free ``num_evict`` evictable blocks from every row: the first resident
    evictable blocks named by ``plan`` (if any), then the lowest ``scores``."""
    evict_rounds([Round(seq, num_evict, plan, reason, scores)], pool)


def evict_rounds(rounds: list[Round], pool: KVPool) -> None:
    """Run several sequences' rounds as one: their rows' columns side by side,
    one sort and one gather per field for all of them. At block size 1 every
    budgeted sequence evicts at every decode step, and a round per sequence
    (a few dozen small tensor operations each) cost more than the forward.
    Per row the order is: blocks the plan names, by first place; then the
    rest by lowest score (ties: the older block); never a protected block.
    Every freed block is counted with where its ranking came from."""
    rounds = [r for r in rounds if r.num_evict > 0]
    if not rounds:
        return
    seqs = [r.seq for r in rounds]
    L, H = seqs[0].page_table.shape[:2]
    R, dev = L * H, seqs[0].page_table.device
    sizes = [s.num_blocks for s in seqs]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    N = sum(sizes)
    cat = lambda ts: torch.cat(ts, 2) if len(ts) > 1 else ts[0]
    bi = cat([s.block_index for s in seqs])
    # Protection (sink, recent window, newest block), per column of its sequence.
    col = torch.arange(N, device=dev)
    seg = torch.repeat_interleave(torch.arange(len(seqs), device=dev), torch.tensor(sizes, device=dev), output_size=N)
    per = lambda vals: torch.tensor(vals, device=dev)[seg]
    BIG = 1 << 62
    cut = [(s.num_cached - s.eviction.recent) // s.block_size if s.eviction.recent > 0 else BIG for s in seqs]
    protected = ((bi < per([s.eviction.sink_blocks for s in seqs])) | (bi >= per(cut))
                 | (col == per([st + n - 1 for st, n in zip(starts, sizes)])))
    scores = cat([(r.scores if r.scores is not None else r.seq.policy.score(r.seq)).float() for r in rounds])
    rank = _plan_ranks(bi, sizes, [r.plan for r in rounds])
    # Stable sorts, least significant key first: score, plan place, protected, sequence.
    order = torch.sort(scores, dim=2, stable=True).indices
    for key in (rank, protected.to(torch.uint8), seg.expand(L, H, N)):
        order = order.gather(2, torch.sort(key.gather(2, order), dim=2, stable=True).indices)
    # Each sequence's columns now come in its own span, evictable first, lowest first.
    take = torch.tensor([st + j for st, r in zip(starts, rounds) for j in range(r.num_evict)], device=dev)
    chosen = order.index_select(2, take)                                   # [L, Hkv, sum k]
    if bool(protected.gather(2, chosen).any()):
        raise ValueError(f"an eviction round asks more blocks than a row has evictable "
                         f"({', '.join(f'{r.seq.request_id}: {r.num_evict}' for r in rounds)})")
    pool.free(cat([s.page_table for s in seqs]).gather(2, chosen))
    ks = [r.num_evict for r in rounds]
    per_chosen = torch.repeat_interleave(torch.arange(len(rounds), device=dev), torch.tensor(ks, device=dev),
                                         output_size=sum(ks))
    unnamed = (~torch.isfinite(rank.gather(2, chosen))).sum((0, 1))
    unranked = torch.zeros(len(rounds), dtype=torch.long, device=dev).index_add_(0, per_chosen, unnamed).tolist()
    gone = bi.gather(2, chosen).cpu().split(ks, 2)
    # Compact: every row keeps its other columns in order, each sequence's still side by side.
    drop = torch.zeros(L, H, N, dtype=torch.bool, device=dev).scatter_(2, chosen, True)
    keep = col.expand(L, H, N)[~drop].view(L, H, N - sum(ks))
    left = [n - k for n, k in zip(sizes, ks)]
    own = None
    for name in COLUMN_FIELDS:
        ts = [getattr(s, name) for s in seqs]
        if any(t.shape[3:] != ts[0].shape[3:] for t in ts):
            # Trailing sizes differ (a policy's own window length): each sequence gathers its own.
            own = own or [(k - st).long() for k, st in zip(keep.split(left, 2), starts)]
            parts = [t.gather(2, k if t.dim() == 3 else k[..., None].expand(*k.shape, t.shape[3]))
                     for t, k in zip(ts, own)]
        else:
            t = cat(ts)
            idx = keep if t.dim() == 3 else keep[..., None].expand(L, H, keep.shape[2], t.shape[3])
            parts = t.gather(2, idx).split(left, 2)
        for s, part in zip(seqs, parts):
            setattr(s, name, part)
    for r, k, u, g in zip(rounds, ks, unranked, gone):
        seq = r.seq
        if seq.eviction.policy == LEARNED:
            seq.gone.append(g)
        if r.plan is not None:
            seq.count_evictions(r.plan.source, "", R * k - u)
            seq.count_evictions(FALLBACK, UNRANKED, u)
        elif seq.eviction.policy == LEARNED:
            seq.count_evictions(FALLBACK, r.reason or NO_PLAN, R * k)
        else:
            seq.count_evictions(LOCAL, "", R * k)
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
        evict_rounds([Round(seq, over, plan, reason)], pool)


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
