"""The eviction round (budgets: budget.py; block features: block_features.py).

Protection is decided here, once, for every policy: sink blocks, blocks that
overlap the ``recent`` window and the newest (possibly partial) block are never
evicted. A round frees the same number of blocks in every (layer, kv-head) row
(which ones is per row) and compacts rows keeping block order. When a page
holds several blocks, compaction moves each survivor's K/V down to its new
column (only those behind the row's first hole move) and frees the pages the
row no longer fills: a row of ``n`` blocks always holds ``ceil(n / c)`` pages.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvkernels import ops
from services.compute.eviction.advisor import CLEANUP, FALLBACK, LOCAL, NO_PLAN, SHAPE_MISMATCH, UNRANKED, EvictionPlan
from services.compute.engine.kv_pool import KVPool
from services.compute.eviction.policies import LEARNED
from services.compute.engine.sequence import Sequence, keep_columns


# ------------------------------------------------------------------- rounds
def protected_mask(seq: Sequence) -> torch.Tensor:
    """[L, Hkv, NB] bool: sink blocks, blocks overlapping the recent window, the newest block."""
    return _protected([seq], seq.block_index, _segments([seq.num_blocks], seq.block_index.device))


def _segments(sizes: list[int], dev) -> torch.Tensor:
    """[sum sizes]: which sequence each column side by side belongs to."""
    if len(sizes) == 1:      # served rounds often run one sequence's at a time
        return torch.zeros(sizes[0], dtype=torch.long, device=dev)
    return torch.repeat_interleave(torch.arange(len(sizes), device=dev), torch.tensor(sizes, device=dev),
                                   output_size=sum(sizes))


def _protected(seqs: list[Sequence], block_index: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """``protected_mask`` of several sequences, their columns side by side in
    ``block_index`` [L, Hkv, sum NB] (``seg``: each column's sequence); the
    thresholds come from the host."""
    dev, N = block_index.device, block_index.shape[2]
    sizes = [s.num_blocks for s in seqs]
    per = lambda vals: torch.tensor(vals, device=dev)[seg]
    cut = [(s.num_cached - s.eviction.recent) // s.block_size if s.eviction.recent > 0 else 1 << 62 for s in seqs]
    newest = list(itertools.accumulate(sizes))
    return ((block_index < per([s.eviction.sink_blocks for s in seqs])) | (block_index >= per(cut))
            | (torch.arange(N, device=dev) == per(newest) - 1))


def plan_ranks(block_index: torch.Tensor, sizes: list[int], plans: list[EvictionPlan | None]) -> torch.Tensor:
    """[L, Hkv, sum NB] place of each resident block in its row of its
    sequence's plan, as -k (first named) .. -1, +inf where the plan (or a
    missing one) does not name it. ``block_index`` holds the sequences'
    columns side by side (``sizes`` of each). Each plan's
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


def _order(scores: torch.Tensor, rank: torch.Tensor, protected: torch.Tensor, seg: torch.Tensor,
           num_seqs: int, max_named: int) -> torch.Tensor:
    """Columns [L, Hkv, N] ordered by sequence, then unprotected first, then
    plan place (``rank``: -max_named .. -1, +inf unnamed), then score, then
    column: one stable sort of a 64-bit key where the fields fit (four
    stable sorts were a tenth of a step at block size 1), else one stable
    sort per field, least significant first."""
    seg_bits, rank_bits = max(1, (num_seqs - 1).bit_length()), (max_named + 1).bit_length()
    if seg_bits + 1 + rank_bits <= 31:
        # A float32's bits as int32, negatives' magnitude bits flipped, orders as the float does
        # (+ 0.0 first: -0.0 and 0.0 tie, as in a float sort).
        bits = (scores.float() + 0.0).view(torch.int32)
        bits = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long() + (1 << 31)
        place = torch.where(torch.isfinite(rank), rank + max_named, max_named).long()
        high = (seg.long() << (1 + rank_bits)) + (protected.long() << rank_bits) + place
        return torch.sort((high << 32) + bits, dim=2, stable=True).indices
    order = torch.sort(scores, dim=2, stable=True).indices
    for key in (rank, protected.to(torch.uint8), seg.expand_as(scores)):
        order = order.gather(2, torch.sort(key.gather(2, order), dim=2, stable=True).indices)
    return order


@dataclass
class Round:
    """One sequence's eviction round: free ``num_evict`` blocks from every row."""
    seq: Sequence
    num_evict: int
    plan: EvictionPlan | None = None
    reason: str = ""


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
    starts = list(itertools.accumulate(sizes[:-1], initial=0))
    N = sum(sizes)
    cat = lambda ts: torch.cat(ts, 2) if len(ts) > 1 else ts[0]
    bi = cat([s.block_index for s in seqs])
    seg = _segments(sizes, dev)
    protected = _protected(seqs, bi, seg)
    scores = cat([s.policy.score(s).float() for s in seqs])
    rank = plan_ranks(bi, sizes, [r.plan for r in rounds])
    order = _order(scores, rank, protected, seg, len(rounds),
                   max((r.plan.evict.shape[2] for r in rounds if r.plan is not None and r.plan.width), default=0))
    # Each sequence's columns now come in its own span, evictable first, lowest first.
    take = torch.tensor([st + j for st, r in zip(starts, rounds) for j in range(r.num_evict)], device=dev)
    chosen = order.index_select(2, take)                                   # [L, Hkv, sum k]
    if bool(protected.gather(2, chosen).any()):
        raise ValueError(f"an eviction round asks more blocks than a row has evictable "
                         f"({', '.join(f'{r.seq.request_id}: {r.num_evict}' for r in rounds)})")
    ks = [r.num_evict for r in rounds]
    unnamed = (~torch.isfinite(rank.gather(2, chosen))).sum((0, 1))
    unranked = torch.zeros(len(rounds), dtype=torch.long, device=dev).index_add_(0, _segments(ks, dev), unnamed)
    unranked = unranked.tolist()
    gone = bi.gather(2, chosen).cpu().split(ks, 2)
    # Compact: every row keeps its other columns in order, each sequence's still side by side.
    drop = torch.zeros(L, H, N, dtype=torch.bool, device=dev).scatter_(2, chosen, True)
    keep = torch.arange(N, device=dev).expand(L, H, N)[~drop].view(L, H, N - sum(ks))
    left = [n - k for n, k in zip(sizes, ks)]
    compact_pages(seqs, keep, left, chosen, pool)
    keep_columns(seqs, keep, left)
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


def compact_pages(seqs: list[Sequence], keep: torch.Tensor, left: list[int], chosen: torch.Tensor,
                  pool: KVPool) -> None:
    """The pages' side of a round: ``keep`` / ``chosen`` index the sequences'
    columns side by side (each ``left`` kept, ascending). One block per page:
    the chosen blocks' pages go and the tables follow the kept columns.
    Several: survivors move to their new columns, emptied pages go."""
    cat = lambda ts: torch.cat(ts, 2) if len(ts) > 1 else ts[0]
    c = seqs[0].page_blocks
    if c == 1:
        tables = cat([s.page_table for s in seqs])
        pool.free(tables.gather(2, chosen))
        for s, t in zip(seqs, tables.gather(2, keep).split(left, 2)):
            s.page_table = t
        return
    # All sequences at once (a few ops per round, not per sequence): each kept column's
    # old and new column within its own sequence, and its sequence's first page.
    dev = keep.device
    starts = lambda sizes: torch.tensor(list(itertools.accumulate(sizes[:-1], initial=0)), device=dev)
    nps = [s.num_row_pages for s in seqs]
    keep_pages = [s.pages_for(k) for s, k in zip(seqs, left)]
    seg, page_seg = _segments(left, dev), _segments(nps, dev)   # each kept column's / page's sequence
    page_start = starts(nps)
    col = keep - starts([s.num_blocks for s in seqs])[seg]
    new = torch.arange(keep.shape[2], device=dev) - starts(left)[seg]
    tables = cat([s.page_table for s in seqs]).long()                        # [L, Hkv, sum NP]
    src = tables.gather(2, page_start[seg] + col // c) * c + col % c
    dst = tables.gather(2, (page_start[seg] + new // c).expand_as(col)) * c + new % c
    moved = src != dst
    k_blocks, v_blocks = pool.blocks_view(seqs[0].block_size)
    ops.move_blocks(k_blocks, v_blocks, src[moved], dst[moved])
    # Pages past what the kept columns fill go back; the rest stay each sequence's table.
    local = torch.arange(tables.shape[2], device=dev) - page_start[page_seg]
    stays = local < torch.tensor(keep_pages, device=dev)[page_seg]
    pool.free(tables[:, :, ~stays])
    for s, t in zip(seqs, tables[:, :, stays].to(torch.int32).split(keep_pages, 2)):
        s.page_table = t


def overshoot(seq: Sequence, now: bool = False) -> int:
    """Blocks per row over the budget, leaving room for the block the next
    decode step may open (0 for dense sequences). A decoding row runs up to
    ``round_slack`` blocks over before it counts (0 until then), so a round
    evicts a page's worth at once: per-step rounds of one token each were a
    sort, a gather per statistic and a compaction per step. Prefill has no
    slack: a chunk's round brings the rows back at once, so the peak stays the
    budget plus one chunk. ``now``: every block over counts (the pool needs
    the pages: cleanup)."""
    st = seq.eviction
    if st.budget_blocks is None:
        return 0
    n, bs = seq.num_cached, seq.block_size
    target = st.target_blocks(seq.in_prefill) - (1 if not seq.in_prefill and n % bs == 0 else 0)
    over = seq.num_blocks - target
    return max(0, over) if now or seq.in_prefill or over > st.round_slack else 0


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
    """Bring every row back to its budget now (its round slack too). A heuristic policy ranks with
    its own scores; a ``learned`` sequence with ``plan`` (the advisor's
    ranking), or with its fallback policy counted under ``reason``. When to
    run a learned round (wait for a plan or not) is the engine's decision."""
    over = overshoot(seq, now=True)
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
    dead_pages = dead // seq.page_blocks    # whole leading pages only: the packing holds
    if dead_pages > 0:
        pool.free(seq.page_table[:, :, :dead_pages])
        seq.page_table = seq.page_table[:, :, dead_pages:]
        L, H, NB = seq.block_index.shape
        dead = dead_pages * seq.page_blocks
        seq.keep_columns(torch.arange(dead, NB, device=seq.block_index.device).expand(L, H, NB - dead))


def shrink_budget(seq: Sequence, pool: KVPool, to: int) -> None:
    """Cleanup (docs/design/architecture.md, protocol step 6): lower the budget to ``to``
    (the scheduler chooses it, at or above the floor) and evict now."""
    st = seq.eviction
    st.budget_blocks = to
    if not st.after_prompt:
        st.prefill_blocks = None    # under memory pressure a prefill allowance is the first thing to go
    # The pool needs the pages now: a learned sequence uses its plan if it is fresh.
    eviction_round(seq, pool, usable_plan(seq) if st.policy == LEARNED else None, CLEANUP)
