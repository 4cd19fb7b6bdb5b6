"""Continuous batching: who runs in the next step, and with how many tokens.

Every step mixes, in one forward, one decode token for every running sequence
past its prompt and prefill chunks of sequences still in their prompt (at most
``prefill_chunk`` prompt tokens per step in total, so a long prompt never
stalls the decodes). Sequences join and leave between steps.

Admission is by reservation: a sequence reserves the most pages it can ever
hold (its budgeted footprint), so a running sequence never runs out of pages
and nothing is ever preempted. A budgeted sequence reserves its budget (plus
slack and one block), not its prefill peak: the blocks a prefill chunk puts
over budget, until its round evicts them (a learned one may wait for its
plan), come from one shared **overshoot headroom** of a few chunks, and a chunk
is only scheduled when all sequences' overshoot still fits in it (set aside
only while a running budget holds during prefill). A request
whose prompt goes in above its budget (the budget after the prompt, or a
prefill allowance) draws the difference from a shared **prompt headroom**:
the largest such difference among the running, or a sixteenth of the pool if
that is more. Its prompt starts only when its whole difference fits beside
the prompts already going in, so a started prompt always completes; several
short prompts go in at once, a long one alone. So concurrency scales with the
budget, not with the chunk size or the prompt. A budgeted
prompt is cut at fixed positions (multiples of its chunk) whatever else
runs, so where its eviction rounds fall does not depend on the load. When admitting would push reservations past
``cleanup_threshold`` of the pool, running budgets are first shrunk toward
their floor (docs/design/architecture.md, protocol step 6; a shrunk budget is not restored later),
unless the request's prompt would only queue for the prompt headroom; a request that still does
not fit waits.

Pages held outside running sequences (the prefix cache, parked sessions:
``holders``) count against the pool too: admission keeps
``reserved + held <= capacity``, and a request that would not fit first makes
the holders drop their least recently used entries.
"""
from __future__ import annotations

import math
from collections import deque

from services.compute.eviction.evict import shrink_budget
from services.compute.engine.kv_pool import KVPool
from services.compute.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, pool: KVPool, rows: int, max_num_seqs: int, prefill_chunk: int,
                 cleanup_threshold: float, window: int | None = None, headroom_chunks: int = 2):
        self.pool, self.rows = pool, rows   # rows = layers x kv-heads: pages per page of every row
        self.headroom_chunks = headroom_chunks
        self.window = window                # sliding window of the model (dense rows stay within it)
        self.max_num_seqs, self.prefill_chunk = max_num_seqs, prefill_chunk
        self.cleanup_threshold = cleanup_threshold
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.budget_shrinks = 0
        # Objects with .num_pages and .drop_lru() -> bool, dropped from first to last.
        self.holders: list = []
        self.on_admit = None   # callback(seq) right after a sequence is admitted
        self.prompting: list[Sequence] = []   # prompts drawing on the prompt headroom

    @staticmethod
    def dense_blocks(seq: Sequence) -> int:
        return math.ceil((seq.num_prompt + seq.sampling.max_tokens) / seq.block_size)

    def reservation(self, seq: Sequence) -> int:
        """Pages ``seq`` may hold from now on, outside the overshoot headroom."""
        st, bs = seq.eviction, seq.block_size
        dense = self.dense_blocks(seq)
        if st.budget_blocks is None:
            # Blocks shared from the prefix cache are counted by the cache, which
            # keeps them while a sequence holds them.
            blocks = dense - seq.shared_prefix_blocks
            if self.window is not None and not seq.prefix_blocks and not seq.prewarm:
                # The engine frees blocks behind the window after every step
                # (drop_outside_window): at most the window plus one chunk, and
                # a partial block at each end.
                # Behind the window whole pages only go: one more page.
                return min(seq.pages_for(blocks),
                           seq.pages_for(math.ceil((self.window + self.prefill_chunk) / bs) + 2) + 1) * self.rows
            return seq.pages_for(blocks) * self.rows
        return seq.pages_for(self.budget_blocks(seq)) * self.rows

    @staticmethod
    def budget_blocks(seq: Sequence) -> int:
        """The budget, the round slack, the decode slack of a learned sequence,
        and the block a decode step opens."""
        st = seq.eviction
        return min(Scheduler.dense_blocks(seq), st.budget_blocks + st.round_slack + st.slack_blocks + 1)

    @staticmethod
    def base_blocks(seq: Sequence) -> int:
        """A budgeted sequence's blocks outside prefill overshoot: its budget_blocks,
        or its prefill budget (the whole prompt with after_prompt, its allowance)
        until the round that follows its prefill has run."""
        base = Scheduler.budget_blocks(seq)
        pb = seq.eviction.prefill_blocks
        if pb is not None and (seq.in_prefill or seq.num_blocks > base):
            # Until the round after its prompt evicts it down, it holds its prefill budget.
            return max(base, pb)
        return base

    @staticmethod
    def prompt_extra(seq: Sequence) -> int:
        """Pages per row ``seq``'s prefill budget holds above its budget until the
        round that follows its prompt (0 once that round has run, or without one)."""
        st = seq.eviction
        if st.budget_blocks is None or st.prefill_blocks is None:
            return 0
        base = Scheduler.budget_blocks(seq)
        if not (seq.in_prefill or seq.num_blocks > base):
            return 0
        return max(0, seq.pages_for(st.prefill_blocks) - seq.pages_for(base))

    def prompt_headroom(self, largest: int) -> int:
        """Pages per row the prompt headroom holds, given the largest pending
        prompt_extra: at least that (one prompt always fits), or a sixteenth of the
        pool if more (several short prompts at once)."""
        if largest <= 0:
            return 0
        return max(largest, self.pool.capacity // self.rows // 16)

    def may_overshoot(self, seq: Sequence) -> bool:
        """Whether ``seq`` can ever hold more than its base (its budget is below its length)."""
        if seq.eviction.budget_blocks is None:
            return False
        return self.budget_blocks(seq) < self.dense_blocks(seq)

    def overshoots(self, seq: Sequence) -> bool:
        """Whether ``seq`` may hold a prompt chunk above its base: a budget held
        during prefill, which the shared prefill headroom is for. A budget that
        holds from the end of the prompt never does (its prompt is its base until
        the round after it, and the prompt headroom holds that), so a pool of such
        requests sets no prefill headroom aside."""
        return self.may_overshoot(seq) and not seq.eviction.after_prompt

    def headroom_used(self, seq: Sequence) -> int:
        """Pages per row ``seq`` holds beyond its base (a prefill chunk not yet evicted)."""
        if seq.eviction.budget_blocks is None:
            return 0
        return max(0, seq.num_row_pages - seq.pages_for(self.base_blocks(seq)))

    def headroom_pages(self, seq: Sequence) -> int:
        """Pages per row all budgeted sequences together may hold over their
        base: ``headroom_chunks`` prefill chunks (so several prompts' chunks can
        wait for their plans at once), or an eighth of the pool if that is less
        (a budgeted chunk is then shorter; two pages always make progress)."""
        chunk = seq.pages_for(math.ceil(self.prefill_chunk / seq.block_size)) + 1
        return min(self.headroom_chunks * chunk, max(2, self.pool.capacity // self.rows // 8))

    def reserved(self, candidate: Sequence | None = None) -> int:
        """Pages promised to the running sequences (and ``candidate``), headroom included."""
        return self._reserve(self.running + ([candidate] if candidate is not None else []))

    def _reserve(self, seqs: list[Sequence]) -> int:
        return self._pages(self._tally(seqs))

    def _tally(self, seqs: list[Sequence], tally=(0, 0, None)) -> tuple:
        """(reservations, largest prompt_extra, a sequence that overshoots) of
        ``seqs`` added to ``tally``: one pass (admission asks at every step)."""
        total, extra, chunks = tally
        for s in seqs:
            total += self.reservation(s)
            extra = max(extra, self.prompt_extra(s))
            if chunks is None and self.overshoots(s):
                chunks = s
        return total, extra, chunks

    def _pages(self, tally: tuple) -> int:
        total, extra, chunks = tally
        if chunks is not None:
            total += self.headroom_pages(chunks) * self.rows
        return total + self.prompt_headroom(extra) * self.rows

    def held(self) -> int:
        return sum(h.num_pages for h in self.holders)

    def room(self) -> int:
        """Pages that may still be promised to someone (a holder, a new sequence)."""
        return self.pool.capacity - self.reserved() - self.held()

    def make_room(self, pages: int) -> bool:
        """Drop holders' LRU entries until ``pages`` fit; False if they cannot."""
        while self.room() < pages:
            if not any(h.drop_lru() for h in self.holders):
                return False
        return True

    def add(self, seq: Sequence) -> None:
        alone = self._reserve([seq])
        if alone > self.pool.capacity:
            raise ValueError(f"request needs up to {alone} KV pages, the pool has "
                             f"{self.pool.capacity}: lower max_tokens or set a smaller budget")
        self.waiting.append(seq)

    def _shrink_one(self) -> bool:
        """Shrink one running budget so that the reservations go down. Each
        candidate budget is priced from the others' reservations summed once
        (a step under pressure tries every running sequence: no rescans)."""
        res = [self.reservation(s) for s in self.running]
        extra = [self.prompt_extra(s) for s in self.running]
        total = sum(res)
        budgeted = sum(1 for s in self.running if self.overshoots(s))
        before = self.reserved()
        # The largest prompt_extra among the others: the runner-up's for the largest.
        first, second = (sorted(extra, reverse=True) + [0, 0])[:2]
        for i in sorted(range(len(self.running)), key=lambda i: -(self.running[i].eviction.budget_blocks or 0)):
            seq = self.running[i]
            others = budgeted - self.overshoots(seq)
            others_extra = second if extra[i] == first else first
            target = self._lowering_budget(seq, before, total - res[i], others, others_extra)
            if target is not None:
                shrink_budget(seq, self.pool, target)
                self.budget_shrinks += 1
                return True
        return False

    def _lowering_budget(self, seq: Sequence, before: int, rest: int, others_budgeted: int,
                         others_extra: int = 0) -> int | None:
        """The first budget on the way to the floor (halving) at which the
        reservations fall below ``before``, or None. ``rest``: the other running
        sequences' reservations; ``others_budgeted``: how many of them may
        overshoot (then the shared prefill headroom counts whatever ``seq`` does);
        ``others_extra``: the largest prompt_extra among them (a lower budget
        raises ``seq``'s own, and with it maybe the prompt headroom).
        A smaller budget does not always lower the total: below a sequence's
        length it may overshoot, and the headroom then counts."""
        st = seq.eviction
        if st.budget_blocks is None:
            return None
        old = b = st.budget_blocks
        allowance = st.prefill_blocks
        if not st.after_prompt:
            st.prefill_blocks = None      # shrink_budget drops an allowance first
        try:
            # The headroom is the same for every sequence of an engine (one block and page size).
            headroom = self.headroom_pages(seq) * self.rows
            while b > st.floor_blocks:
                b = max(st.floor_blocks, (b + st.floor_blocks) // 2)
                st.budget_blocks = b
                total = rest + self.reservation(seq)
                if others_budgeted or self.overshoots(seq):
                    total += headroom
                total += self.prompt_headroom(max(others_extra, self.prompt_extra(seq))) * self.rows
                if total < before:
                    return b
            return None
        finally:
            st.budget_blocks, st.prefill_blocks = old, allowance

    def _admit(self) -> None:
        cap = self.pool.capacity
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Cleanup trades running budgets for a request that runs now. One whose prompt
            # would queue behind the prompts ahead of it in the prompt headroom would not:
            # it is admitted only as it fits.
            running = self._tally(self.running)
            with_it = self._pages(self._tally([seq], running))
            while with_it > self.cleanup_threshold * cap and not self._queues_for_prompt(seq) and self._shrink_one():
                running = self._tally(self.running)
                with_it = self._pages(self._tally([seq], running))
            # Holders give pages back only when the request does not fit beside them.
            if with_it > cap or (with_it + self.held() > cap and not self.make_room(with_it - self._pages(running))):
                return
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if self.on_admit is not None:
                self.on_admit(seq)

    def _queues_for_prompt(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prompt would not fit the prompt headroom beside the
        running requests' pending prompts (started or ahead of it in line)."""
        extra = self.prompt_extra(seq)
        if not extra:
            return False
        pending = [self.prompt_extra(s) for s in self.running]
        return sum(pending) + extra > self.prompt_headroom(max(pending + [extra]))

    def schedule(self) -> list[tuple[Sequence, int]]:
        self._admit()
        batch, chunk_left = [], self.prefill_chunk
        used = sum(self.headroom_used(s) for s in self.running)
        running = set(map(id, self.running))
        self.prompting = [s for s in self.prompting if id(s) in running and self.prompt_extra(s) > 0]
        prompt_room = (self.prompt_headroom(max((self.prompt_extra(s) for s in self.running), default=0))
                       - sum(self.prompt_extra(s) for s in self.prompting))
        for seq in self.running:
            if seq.holding:   # a learned sequence waiting for its eviction plan (only it waits)
                continue
            todo = seq.num_tokens - seq.num_cached
            if not seq.in_prefill:
                batch.append((seq, todo))
                continue
            if chunk_left <= 0:
                continue
            extra = self.prompt_extra(seq)
            if extra and all(s is not seq for s in self.prompting):
                # Its whole prompt must fit beside those going in: once started, it completes.
                if extra > prompt_room:
                    continue
                self.prompting.append(seq)
                prompt_room -= extra
            t = min(todo, chunk_left)
            if self.may_overshoot(seq):
                # A budgeted prompt is cut at fixed positions (multiples of its chunk),
                # whatever else runs: its eviction rounds, and so what it keeps, do not
                # depend on the load. A chunk that does not fit this step waits.
                unit = self.budgeted_chunk(seq)
                t = min(todo, unit - seq.num_cached % unit)
                if t > chunk_left or self._headroom_after(seq, t) > self._room(seq, used):
                    continue
                used += self._headroom_after(seq, t) - self.headroom_used(seq)
            chunk_left -= t
            batch.append((seq, t))
        return batch

    def _headroom_after(self, seq: Sequence, t: int) -> int:
        bs = seq.block_size
        added = math.ceil((seq.num_cached + t) / bs) - math.ceil(seq.num_cached / bs)
        return max(0, seq.pages_for(seq.num_blocks + added) - seq.pages_for(self.base_blocks(seq)))

    def _room(self, seq: Sequence, used: int) -> int:
        """Overshoot pages per row ``seq`` may reach, given everyone else's."""
        return self.headroom_pages(seq) - (used - self.headroom_used(seq))

    def budgeted_chunk(self, seq: Sequence) -> int:
        """Prefill chunk of a budgeted sequence: ``prefill_chunk``, or less when the
        headroom is smaller (a tiny pool), in whole pages. Fixed per engine."""
        fit = (self.headroom_pages(seq) - 1) * seq.block_size * seq.page_blocks   # >= one page (headroom >= 2)
        return min(self.prefill_chunk, fit)

    def remove(self, seq: Sequence) -> None:
        """Finish or abort: its pages go back to the pool now."""
        self.detach(seq)
        self.pool.free(seq.pages())
        seq.page_table = seq.page_table[:, :, :0]

    def detach(self, seq: Sequence) -> None:
        """Leave the schedule, keeping the pages (a parked session)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
