"""One request inside the engine: its tokens, its page tables and the
per-block statistics the eviction policies rank by.

A **block** (``block_size`` positions, 1 by default) is the unit of eviction;
a **page** (``page_blocks`` blocks) is the unit of memory. Every per-block
tensor is rectangular ``[L, Hkv, NB]`` (+ trailing dims), one column per
resident block in position order; ``page_table[L, Hkv, NP]`` holds each row's
pages, packed: column ``j`` lives in page ``j // page_blocks``, slot
``j % page_blocks``, so a row of ``NB`` blocks holds ``ceil(NB / page_blocks)``
pages. ``append_blocks`` adds columns (and the pages they need),
``keep_columns`` compacts them after an eviction round (eviction.py moves the
survivors' K/V so the packing holds).
"""
from __future__ import annotations

import enum
import itertools
from collections import Counter
from dataclasses import dataclass, field

import torch

# SnapKV's observation window: how many of the latest queries' block mass a
# ``snapkv`` sequence remembers (a ring buffer). 64, as SnapKV's paper and
# kvpress: on a chat prompt the last 8 queries are the assistant header and
# "Answer briefly.", not the question. Other policies never read the ring, so
# they keep one slot (64 floats per block per row would cost 47 MB per 2k
# SmolLM2 sequence at block size 1).
SNAPKV_WINDOW = 64


# Per-(layer, kv-head, block) columns: an eviction keeps the same ones of each.
COLUMN_FIELDS = ("block_index", "acc_mass", "last_mass", "win_mass", "key_mean", "value_norm", "reach")


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class EvictionState:
    """Resolved eviction settings of one sequence (all in blocks except recent)."""
    policy: str
    budget_blocks: int | None      # None: dense, never evicts
    floor_blocks: int              # smallest budget cleanup may shrink to
    sink_blocks: int
    recent: int                    # tokens
    slack_blocks: int = 0          # learned only: overrun allowed while waiting for a plan
    # Blocks a row may hold over its budget between rounds: a round runs once a
    # row is this far over and evicts all of it (a page's worth at once, not a
    # token per step: eviction.overshoot). 0: every step brings rows back.
    round_slack: int = 0
    # The budget holds from the end of the prompt on: the prompt is prefilled
    # in full (its pages reserved), then one round evicts it down (kvpress-style).
    after_prompt: bool = False
    # While the prompt is prefilled, the budget is this many blocks: the whole
    # prompt (after_prompt) or the request's prefill_allowance x its budget; None:
    # the budget. The round at the prompt's end brings every row down to budget_blocks.
    prefill_blocks: int | None = None

    def target_blocks(self, in_prefill: bool) -> int | None:
        """The budget that holds now: prefill_blocks during prefill, else budget_blocks."""
        return self.prefill_blocks if in_prefill and self.prefill_blocks is not None else self.budget_blocks


@dataclass(eq=False)  # identity semantics: a sequence is compared by object, never by tensors
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: object               # SamplingParams
    eviction: EvictionState
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    device: torch.device | str = "cpu"
    page_blocks: int = 1           # blocks per page (the pool's page size / block_size)
    output_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached: int = 0            # tokens whose K/V are in pages
    finish_reason: str | None = None
    # counters
    eviction_rounds: int = 0
    peak_blocks: int = 0           # most columns (blocks per row) held at once: Usage.kv_blocks_peak
    # evicted blocks (summed over (layer, kv-head) rows) by (source, reason): advisor.py
    evictions: Counter = field(default_factory=Counter)
    # feature bookkeeping (logical block numbers, exclusive upper bounds)
    feat_upto: int = 0
    sent_upto: int = 0
    # learned only: the advisor's latest plan, since when the sequence has been
    # held for one (monotonic seconds; None: not held), the advisor epoch its
    # features were sent in, and the step each submission happened at
    pending_plan: object | None = None
    plan_counted: bool = False     # pending_plan already counted applied or late (metrics count each plan once)
    plan_wait_since: float | None = None
    advisor_epoch: int = 0
    submitted_at: dict = field(default_factory=dict)
    rounds: list = field(default_factory=list)   # eviction rounds since the last output (trace events)
    fallback_warned: bool = False
    plan_gave_up: bool = False     # its last wait ran out: no more waits until a plan comes
    gone: list = field(default_factory=list)     # learned: [L, Hkv, k] blocks evicted since the last submit
    # learned: FeatureBatches taken (sent_upto counts them) but not yet submitted:
    # with round_slack, batches wait for the round that needs a plan and go with it
    unsent: list = field(default_factory=list)
    # set by the engine
    policy: object | None = None   # Policy that ranks blocks (the fallback for "learned")
    generator: object | None = None
    decoder: object | None = None  # IncrementalDecoder
    text: str = ""                 # decoded output so far
    emitted: int = 0               # chars of ``text`` already streamed (stop-string holdback)
    prefix_blocks: int = 0         # leading blocks taken from the prefix cache
    prewarm: bool = False          # a prefix-cache fill: its output is never streamed
    session_base: int = 0          # context tokens continued from a parked session
    session_claim: bool = False    # a parked session waits for this sequence's admission

    def __post_init__(self):
        L, H, dev = self.num_layers, self.num_kv_heads, self.device
        self.tokens: list[int] = list(self.prompt_ids)
        self.page_table = torch.zeros(L, H, 0, dtype=torch.int32, device=dev)
        self.block_index = torch.zeros(L, H, 0, dtype=torch.int32, device=dev)
        self.acc_mass = torch.zeros(L, H, 0, device=dev)           # h2o
        self.last_mass = torch.zeros(L, H, 0, device=dev)          # tova
        ring = SNAPKV_WINDOW if self.eviction.policy == "snapkv" else 1
        self.win_mass = torch.zeros(L, H, 0, ring, device=dev)  # snapkv ring
        self.win_ptr = 0
        self.key_mean = torch.zeros(L, H, 0, self.head_dim, device=dev)
        self.value_norm = torch.zeros(L, H, 0, device=dev)
        self.reach = torch.zeros(L, H, 0, device=dev)              # the learned network's "reach" feature
        # field name -> (the field tensor, spare columns after it): append_blocks
        self.room: dict[str, tuple[torch.Tensor, int]] = {}

    # -- token bookkeeping --------------------------------------------------
    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_blocks(self) -> int:
        """Resident blocks per row (columns)."""
        return self.block_index.shape[2]

    @property
    def num_row_pages(self) -> int:
        """Pages per row."""
        return self.page_table.shape[2]

    def block_address(self, cols) -> torch.Tensor:
        """[L, Hkv, k]: where columns ``cols`` (a slice, a list or a tensor)
        live in the pool's blocks view (``KVPool.blocks_view``)."""
        if isinstance(cols, slice):
            cols = range(*cols.indices(self.num_blocks))
        cols = torch.as_tensor(cols, dtype=torch.long, device=self.page_table.device)
        return _address(self.page_table, cols // self.page_blocks, cols % self.page_blocks, self.page_blocks)

    def pages_for(self, blocks: int) -> int:
        """Pages per row that hold ``blocks`` packed blocks."""
        return -(-blocks // self.page_blocks)

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.num_prompt

    @property
    def shared_prefix_blocks(self) -> int:
        """Leading blocks still shared with the prefix cache, which pins them
        while they are held (and counts their pages). A dense sequence never
        evicts, so its first ``prefix_blocks`` columns are those blocks."""
        return self.prefix_blocks if self.eviction.budget_blocks is None else 0

    @property
    def evicted_blocks(self) -> int:
        return sum(self.evictions.values())

    @property
    def fallback_evictions(self) -> int:
        return sum(n for (source, _), n in self.evictions.items() if source == "fallback")

    def count_evictions(self, source: str, reason: str, n: int) -> None:
        if n > 0:
            self.evictions[(source, reason)] += n

    @property
    def holding(self) -> bool:
        """Held out of the batch until its plan comes (or its wait runs out)."""
        return self.plan_wait_since is not None

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.tokens.append(token_id)
        self.output_ids.append(token_id)

    # -- columns ------------------------------------------------------------
    def append_blocks(self, pages: torch.Tensor, first_block: int, num: int | None = None) -> None:
        """Add ``num`` newest blocks (logical ``first_block ...``) to every row,
        and ``pages[L, Hkv, p]`` after the row's pages (``num`` defaults to
        the blocks those pages hold)."""
        append_blocks([self], [pages], [first_block], None if num is None else [num])

    def keep_columns(self, keep: torch.Tensor) -> None:
        """Compact every row to the columns ``keep[L, Hkv, K]`` (ascending)."""
        keep_columns([self], keep.long(), [keep.shape[2]])

    def own_columns(self) -> None:
        """Copy out columns that are views into a batched round's tensors
        (eviction.evict_rounds): a sequence kept for long (a parked session)
        must not pin every other sequence's columns of that round."""
        for name in COLUMN_FIELDS + ("page_table",):
            t = getattr(self, name)
            if t._base is not None:
                setattr(self, name, t.clone())

    # -- statistics ---------------------------------------------------------
    def observe(self, acc: torch.Tensor, last: torch.Tensor, window: torch.Tensor) -> None:
        """Fold in the block mass of the latest queries (aggregated over the
        query heads of each kv-head): ``acc[L, Hkv, NB]`` summed over all of
        them, ``last[L, Hkv, NB]`` of the newest, ``window[L, Hkv, q, NB]``
        of the newest ``q`` in order."""
        self.acc_mass += acc
        self.last_mass = last.clone()
        ring = self.win_mass.shape[3]
        q = min(window.shape[2], ring)
        slots = (self.win_ptr + torch.arange(q, device=window.device)) % ring
        self.win_mass.index_copy_(3, slots, window[:, :, -q:].permute(0, 1, 3, 2).contiguous())
        self.win_ptr = (self.win_ptr + q) % ring

    def reach_peak(self, mass: torch.Tensor, first: int, layer: int | None = None) -> torch.Tensor:
        """The reach of queries at positions ``first ...`` from their block mass
        ``mass[(L,) Hkv, q, NB]`` over this sequence's columns (of ``layer`` only,
        if given) -> ``[(L,) Hkv, q]``: each query's peak mass on one block wholly
        outside its recent window, where a token that reads something from far
        back (a recall value finding its key's earlier mention) stands out."""
        q = mass.shape[-2]
        qpos = torch.arange(first, first + q, device=mass.device)
        index = self.block_index if layer is None else self.block_index[layer]
        last_token = (index.long() + 1) * self.block_size - 1                       # [(L,) Hkv, NB]
        far = last_token[..., None, :] < (qpos - self.eviction.recent)[:, None]
        return torch.where(far, mass, torch.zeros((), device=mass.device)).amax(-1)

    def observe_reach(self, peak: torch.Tensor, first: int) -> None:
        """Fold the reach ``peak[L, Hkv, q]`` of queries at positions ``first ...``
        into their own blocks (the trailing columns, the same in every row): a
        block's reach is the peak over its tokens' queries."""
        q, bs = peak.shape[2], self.block_size
        blocks = torch.arange(first, first + q, device=peak.device) // bs
        col = self.num_blocks - 1 - (int(blocks[-1]) - blocks)
        self.reach.scatter_reduce_(2, col.expand(*peak.shape[:2], q), peak.to(self.reach.dtype), "amax")

    def pages(self) -> torch.Tensor:
        return self.page_table.reshape(-1)


def _address(tables: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, c: int) -> torch.Tensor:
    """Blocks-view addresses of slot ``slots[j]`` of page column ``pages[j]`` of
    ``tables[L, Hkv, NP]`` (``c`` blocks per page) -> [L, Hkv, len(pages)]."""
    addr = tables.index_select(2, pages)
    return addr * c + slots.to(addr.dtype) if c > 1 else addr


def column_addresses(spans: list[tuple[Sequence, range]]) -> torch.Tensor:
    """``block_address`` of several sequences' columns, every sequence's side by
    side -> [L, Hkv, sum k]: one cat and one gather for all of them, the
    indices built on the host (a call per sequence was a few launches and a
    host-built index each, per decode step)."""
    seqs = [s for s, _ in spans]
    c = seqs[0].page_blocks
    tables = torch.cat([s.page_table for s in seqs], 2) if len(seqs) > 1 else seqs[0].page_table
    page, slot, at = [], [], 0
    for s, cols in spans:
        page.extend(at + j // c for j in cols)
        slot.extend(j % c for j in cols)
        at += s.num_row_pages
    dev = tables.device
    return _address(tables, torch.tensor(page, device=dev), torch.tensor(slot, device=dev), c)


def observe_decode(seqs: list[Sequence], mass: list[torch.Tensor]) -> None:
    """``observe`` of one decode query per sequence (``mass[i]`` is
    ``[L, Hkv, NB_i]``), batched: three multi-tensor ops for the whole batch
    instead of a few kernel launches per sequence."""
    torch._foreach_add_([s.acc_mass for s in seqs], mass)
    torch._foreach_copy_([s.last_mass for s in seqs], mass)
    torch._foreach_copy_([s.win_mass[..., s.win_ptr] for s in seqs], mass)
    for s in seqs:
        s.win_ptr = (s.win_ptr + 1) % s.win_mass.shape[3]


def _gather_columns(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[L, Hkv, NB, ...]`` at the block columns ``idx[L, Hkv, K]``."""
    return t.gather(2, idx if t.dim() == 3 else idx[..., None].expand(*idx.shape, t.shape[3]))


def _set_columns(seqs: list[Sequence], joint, alone, together: bool | None = None) -> None:
    """Give every column field of ``seqs`` its new value: ``joint(name, ts)``
    builds all sequences' in one tensor and returns one view per sequence;
    ``alone(name, i, t)`` builds sequence ``i``'s by itself, for a single
    sequence (unless ``together``) or fields whose trailing sizes differ (a
    policy's own window length). Joint views keep their base alive:
    ``own_columns`` copies them out for a sequence kept long."""
    together = len(seqs) > 1 if together is None else together
    for name in COLUMN_FIELDS:
        ts = [getattr(s, name) for s in seqs]
        if together and all(t.shape[3:] == ts[0].shape[3:] for t in ts):
            parts = joint(name, ts)
        else:
            parts = [alone(name, i, t) for i, t in enumerate(ts)]
        for s, part in zip(seqs, parts):
            setattr(s, name, part)


def keep_columns(seqs: list[Sequence], keep: torch.Tensor, left: list[int]) -> None:
    """``Sequence.keep_columns`` of several sequences as one: ``keep[L, Hkv,
    sum left]`` indexes their columns side by side (each sequence's ``left``
    kept columns, ascending, in its own span)."""
    starts = list(itertools.accumulate([s.num_blocks for s in seqs[:-1]], initial=0))
    local = []           # each sequence's own column numbers, only if a field needs them

    def alone(name, i, t):
        if not local:
            local.extend(k - st for k, st in zip(keep.split(left, 2), starts))
        return _gather_columns(t, local[i])

    _set_columns(seqs, lambda name, ts: _gather_columns(torch.cat(ts, 2), keep).split(left, 2), alone)


# Spare columns a growing sequence gets when its fields are rebuilt: as many as
# it holds (so rebuilds are O(log n) over its life), between 16 and 1,024.
MIN_ROOM, MAX_ROOM = 16, 1024


def _fits(seq: Sequence, k: int) -> bool:
    """Every field of ``seq`` has ``k`` spare columns of its own."""
    room = seq.room
    for name in COLUMN_FIELDS:
        r = room.get(name)
        if r is None or r[1] < k or r[0] is not getattr(seq, name):
            return False
    return True


def _grows(seq: Sequence) -> bool:
    """A sequence that only grows for now (no round compacts it): dense, or
    a budget that holds from the end of a prompt still being prefilled."""
    st = seq.eviction
    return st.budget_blocks is None or (st.after_prompt and seq.in_prefill)


def _spare(seq: Sequence, size: int) -> int:
    """Spare columns a rebuilt sequence gets. One that only grows: as many as
    it holds (O(log n) rebuilds over its life). A budgeted one: what it may
    add before its next round compacts it, so the rebuild after a round is its
    only one (without them a budgeted row at block size 1 would copy every
    column at every decode step)."""
    if _grows(seq):
        return min(max(MIN_ROOM, size), MAX_ROOM)
    st = seq.eviction
    return min(st.round_slack + st.slack_blocks + 1, MAX_ROOM)


def append_blocks(seqs: list[Sequence], pages: list[torch.Tensor], first_block: list[int],
                  num: list[int] | None = None) -> None:
    """``Sequence.append_blocks`` of several sequences as one. At block size 1
    every decoding sequence grows by a block per step. Sequences with spare
    columns are written in place (a few multi-tensor ops for all of them);
    the others have every field rebuilt in one tensor (old columns and the
    new ones, each sequence's side by side, growing ones with spare columns
    after theirs) and split back. Rebuilding dense sequences at every step
    copied all their columns each step (13 of a 23 ms step for 14 dense
    1k-token sequences at block size 1)."""
    kl = [p.shape[2] * s.page_blocks for p, s in zip(pages, seqs)] if num is None else list(num)
    for s, p in zip(seqs, pages):
        if p.shape[2]:
            s.page_table = torch.cat([s.page_table, p.to(s.page_table)], 2) if s.page_table.shape[2] else p.to(
                s.page_table.device, s.page_table.dtype)
    grow = [i for i, k in enumerate(kl) if k > 0]
    fits = [_fits(seqs[i], kl[i]) for i in grow]
    for group, append in (([i for i, f in zip(grow, fits) if f], _append_in_place),
                          ([i for i, f in zip(grow, fits) if not f], _append_rebuilt)):
        if group:
            append([seqs[i] for i in group], *_new_columns([seqs[i] for i in group], [kl[i] for i in group],
                                                          [first_block[i] for i in group], seqs[0].page_table.device))
    for s in seqs:
        s.peak_blocks = max(s.peak_blocks, s.num_blocks)


def _new_columns(seqs: list[Sequence], kl: list[int], first_block: list[int], dev) -> tuple[list[int], dict]:
    """(blocks per sequence, {field: [L, Hkv, sum k]}) of the new columns that
    are not zeros: block numbers, every sequence's side by side. Sizes come
    from the host (and are given as output sizes): no device value is read."""
    L, H = seqs[0].num_layers, seqs[0].num_kv_heads
    n_new = sum(kl)
    if n_new == len(kl):     # a block each (decode at block size 1): the numbers are the first blocks
        return kl, {"block_index": torch.tensor(first_block, dtype=torch.int32, device=dev).expand(L, H, -1)}
    k_before = torch.tensor(list(itertools.accumulate(kl[:-1], initial=0)), device=dev)
    index = torch.arange(n_new, device=dev) + torch.repeat_interleave(
        torch.tensor(first_block, device=dev) - k_before, torch.tensor(kl, device=dev), output_size=n_new)
    return kl, {"block_index": index.to(torch.int32).expand(L, H, -1)}


def _append_in_place(seqs: list[Sequence], kl: list[int], new: dict) -> None:
    """Widen every field of each sequence over its spare columns. Those are
    zeros (``_append_rebuilt`` makes them with ``new_zeros`` and nothing writes
    past a field's last column), so only the new block numbers are written.
    Per sequence and field this is one view with host-side sizes: at block
    size 1 it runs for every decoding sequence at every step."""
    dst = []
    for s, k in zip(seqs, kl):
        room = s.room
        for name in COLUMN_FIELDS:
            t, spare = room[name]
            size = list(t.shape)
            size[2] += k
            wider = t.as_strided(size, t.stride(), t.storage_offset())
            room[name] = (wider, spare - k)
            setattr(s, name, wider)
        dst.append(s.block_index[:, :, -k:])
    torch._foreach_copy_(dst, list(new["block_index"].split(kl, 2)))


def _append_rebuilt(seqs: list[Sequence], kl: list[int], new: dict) -> None:
    dev = seqs[0].page_table.device
    L, H = seqs[0].num_layers, seqs[0].num_kv_heads
    nbs = [s.num_blocks for s in seqs]
    sizes = [n + k for n, k in zip(nbs, kl)]
    room = [_spare(s, n) for s, n in zip(seqs, sizes)]
    spans = [n + r for n, r in zip(sizes, room)]
    n_old, n_new = sum(nbs), sum(kl)
    # Where each sequence's old columns and new ones land in the joined layout.
    starts = torch.tensor(list(itertools.accumulate(spans[:-1], initial=0)), device=dev)
    old, ks = torch.tensor(nbs, device=dev), torch.tensor(kl, device=dev)
    old_before = torch.tensor(list(itertools.accumulate(nbs[:-1], initial=0)), device=dev)
    k_before = torch.tensor(list(itertools.accumulate(kl[:-1], initial=0)), device=dev)
    to_old = torch.arange(n_old, device=dev) + torch.repeat_interleave(starts - old_before, old, output_size=n_old)
    to_new = torch.arange(n_new, device=dev) + torch.repeat_interleave(starts + old - k_before, ks,
                                                                       output_size=n_new)

    def joint(name, ts):
        out = ts[0].new_zeros((L, H, sum(spans)) + ts[0].shape[3:])
        if n_old:
            out.index_copy_(2, to_old, torch.cat(ts, 2) if len(ts) > 1 else ts[0])
        if name in new:
            out.index_copy_(2, to_new, new[name].to(out.dtype))
        views = [part[:, :, :size] for part, size in zip(out.split(spans, 2), sizes)]
        for s, view, r in zip(seqs, views, room):
            s.room[name] = (view, r)
        return views

    def alone(name, i, t):
        seqs[i].room.pop(name, None)
        add = new[name].split(kl, 2)[i] if name in new else t.new_zeros(t.shape[:2] + (kl[i],) + t.shape[3:])
        return torch.cat([t, add.to(t.dtype)], 2)

    # One growing sequence is rebuilt jointly too: that is where its spare columns come from.
    _set_columns(seqs, joint, alone, together=len(seqs) > 1 or room[0] > 0)
