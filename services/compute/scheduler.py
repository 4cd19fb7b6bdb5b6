"""Continuous batching: who runs in the next step, and with how many tokens.

Every step mixes, in one forward, one decode token for every running sequence
past its prompt and prefill chunks of sequences still in their prompt (at most
``prefill_chunk`` prompt tokens per step in total, so a long prompt never
stalls the decodes). Sequences join and leave between steps.

Admission is by reservation: a sequence reserves the most pages it can ever
hold (its budgeted footprint), so a running sequence never runs out of pages
and nothing is ever preempted. When admitting would push reservations past
``cleanup_threshold`` of the pool, running budgets are first shrunk toward
their floor (docs/design.md, protocol step 6; a shrunk budget is not restored later); a
request that still does not fit waits.

Pages held outside running sequences (the prefix cache, parked sessions:
``holders``) count against the pool too: admission keeps
``reserved + held <= capacity``, and a request that would not fit first makes
the holders drop their least recently used entries.
"""
from __future__ import annotations

import math
from collections import deque

from services.compute.eviction import shrink_budget
from services.compute.kv_pool import KVPool
from services.compute.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, pool: KVPool, rows: int, max_num_seqs: int, prefill_chunk: int,
                 cleanup_threshold: float, window: int | None = None):
        self.pool, self.rows = pool, rows   # rows = layers x kv-heads: pages per block
        self.window = window                # sliding window of the model (dense rows stay within it)
        self.max_num_seqs, self.prefill_chunk = max_num_seqs, prefill_chunk
        self.cleanup_threshold = cleanup_threshold
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.budget_shrinks = 0
        # Objects with .num_pages and .drop_lru() -> bool, dropped from first to last.
        self.holders: list = []
        self.on_admit = None   # callback(seq) right after a sequence is admitted

    def reservation(self, seq: Sequence) -> int:
        """Pages ``seq`` may hold from now on (see eviction_round for the bounds)."""
        st, bs = seq.eviction, seq.block_size
        dense = math.ceil((seq.num_prompt + seq.sampling.max_tokens) / bs)
        if st.budget_blocks is None:
            # Blocks shared from the prefix cache are counted by the cache, which
            # keeps them while a sequence holds them.
            blocks = dense - seq.shared_prefix_blocks
            if self.window is not None and not seq.prefix_blocks and not seq.prewarm:
                # The engine frees blocks behind the window after every step
                # (drop_outside_window): at most the window plus one chunk, and
                # a partial block at each end.
                blocks = min(blocks, math.ceil((self.window + self.prefill_chunk) / bs) + 2)
        elif seq.in_prefill:
            blocks = min(dense, st.budget_blocks + st.slack_blocks + math.ceil(self.prefill_chunk / bs) + 1)
        else:
            # After its last chunk a sequence may hold the chunk's blocks until its plan comes.
            blocks = min(dense, max(st.budget_blocks + st.slack_blocks, seq.num_blocks))
        return blocks * self.rows

    def reserved(self) -> int:
        return sum(self.reservation(s) for s in self.running)

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
        if self.reservation(seq) > self.pool.capacity:
            raise ValueError(f"request needs up to {self.reservation(seq)} KV pages, the pool has "
                             f"{self.pool.capacity}: lower max_tokens or set a smaller budget")
        self.waiting.append(seq)

    def _shrink_one(self) -> bool:
        for seq in sorted(self.running, key=lambda s: -(s.eviction.budget_blocks or 0)):
            if shrink_budget(seq, self.pool):
                self.budget_shrinks += 1
                return True
        return False

    def _admit(self) -> None:
        cap = self.pool.capacity
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            need = self.reservation(seq)
            while self.reserved() + need > self.cleanup_threshold * cap and self._shrink_one():
                pass
            if self.reserved() + need > cap or not self.make_room(need):
                return
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if self.on_admit is not None:
                self.on_admit(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        self._admit()
        batch, chunk_left = [], self.prefill_chunk
        for seq in self.running:
            if seq.holding:   # a learned sequence waiting for its eviction plan (only it waits)
                continue
            todo = seq.num_tokens - seq.num_cached
            if not seq.in_prefill:
                batch.append((seq, todo))
            elif chunk_left > 0:
                t = min(todo, chunk_left)
                chunk_left -= t
                batch.append((seq, t))
        return batch

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
