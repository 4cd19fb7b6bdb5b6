"""Parked sessions: a finished turn's sequence kept with its resident KV.

When a request with a ``session_id`` finishes (stop or length), its sequence
is parked here instead of freed: its pages (already compressed to its budget),
page tables and policy statistics. The next turn of the same session starts
from it (positions continue), so a conversation of any length runs in the
memory of its budget. A parked session is claimed when its next turn is
added and restored when that turn is admitted; a claimed session is never
dropped. Unclaimed ones go least-recently-used first under pool pressure and
after ``ttl_s`` idle.
"""
from __future__ import annotations

import time
from collections import OrderedDict

from services.compute.eviction.evict import eviction_round
from services.compute.engine.kv_pool import KVPool
from services.compute.engine.sequence import Sequence


class SessionNotParked(ValueError):
    """A turn that must continue a parked session found none (expired or dropped
    since it was checked): the caller re-prefills from the session's history."""


class SessionCache:
    def __init__(self, pool: KVPool, ttl_s: float, clock=time.monotonic):
        self.pool, self.ttl_s, self.clock = pool, ttl_s, clock
        self.parked: OrderedDict[str, Sequence] = OrderedDict()   # LRU first
        self.last_used: dict[str, float] = {}
        self.claimed: set[str] = set()
        self.parks = self.continued = self.dropped = self.expired = 0

    @property
    def num_pages(self) -> int:
        """Pages parked here, less those the prefix cache already counts."""
        return sum(s.page_table.numel() - s.shared_prefix_blocks // s.page_blocks * s.num_layers * s.num_kv_heads
                   for s in self.parked.values())

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.parked

    def park(self, session_id: str, seq: Sequence) -> None:
        """Keep ``seq`` (detached from the scheduler, pages still allocated)."""
        if session_id in self.parked:   # two turns ran at once: the later one wins
            self.drop(session_id)
        seq.own_columns()
        self.parked[session_id] = seq
        self.last_used[session_id] = self.clock()
        self.parks += 1

    def claim(self, session_id: str) -> Sequence | None:
        seq = self.parked.get(session_id)
        if seq is not None:
            self.claimed.add(session_id)
        return seq

    def continue_turn(self, seq: Sequence, max_model_len: int) -> None:
        """A new turn of ``seq.sampling.session_id``: if that session is parked,
        claim it and make ``seq``'s prompt its whole context (tokens now, pages
        at admission: until then the session's pages stay counted as held);
        else ``seq`` starts the session, unless it was tokenized as a
        continuation (SessionNotParked: never start such a turn fresh)."""
        sid = seq.sampling.session_id
        parked = self.claim(sid)
        if parked is None:
            if seq.sampling.resume_session:
                raise SessionNotParked(f"session {sid!r} is no longer parked here")
            return
        context = parked.tokens + seq.prompt_ids
        if len(context) + seq.sampling.max_tokens > max_model_len:
            self.unclaim(sid)
            raise ValueError(f"session {sid!r} holds {len(parked.tokens)} tokens; with this prompt "
                             f"({seq.num_prompt}) and max_tokens ({seq.sampling.max_tokens}) it exceeds "
                             f"the model's max length {max_model_len}")
        seq.session_base, seq.session_claim = len(parked.tokens), True
        if parked.eviction.budget_blocks is None:   # its leading blocks are still the cached ones
            seq.prefix_blocks = parked.prefix_blocks  # (set now: admission reserves with it)
        seq.prompt_ids = context
        seq.tokens = list(context)
        seq.advisor_epoch = -1   # a new request id: the advisor knows none of its blocks yet

    def restore(self, seq: Sequence, pool: KVPool) -> None:
        """At admission: ``seq`` takes over its parked session's pages and statistics."""
        old = self.take(seq.sampling.session_id)
        seq.session_claim = False
        for name in ("page_table", "block_index", "acc_mass", "last_mass", "win_mass", "key_mean", "reach",
                     "value_norm", "win_ptr", "num_cached", "feat_upto", "sent_upto"):
            setattr(seq, name, getattr(old, name))
        if seq.eviction.budget_blocks is not None:
            # A turn may bring a smaller budget than the parked KV holds (e.g. after
            # a dense turn): back within it now, as its reservation assumes.
            eviction_round(seq, pool)

    def unclaim(self, session_id: str) -> None:
        self.claimed.discard(session_id)
        if session_id in self.parked:
            self.last_used[session_id] = self.clock()
            self.parked.move_to_end(session_id)

    def take(self, session_id: str) -> Sequence | None:
        """Hand a parked sequence over to its next turn (its pages move with it)."""
        self.claimed.discard(session_id)
        self.last_used.pop(session_id, None)
        seq = self.parked.pop(session_id, None)
        self.continued += seq is not None
        return seq

    def drop(self, session_id: str) -> bool:
        seq = self.parked.pop(session_id, None)
        self.last_used.pop(session_id, None)
        self.claimed.discard(session_id)
        if seq is None:
            return False
        self.pool.free(seq.pages())
        seq.page_table = seq.page_table[:, :, :0]
        return True

    def drop_lru(self) -> bool:
        """Pool pressure: drop the least recently used unclaimed session."""
        for sid in self.parked:
            if sid not in self.claimed:
                self.dropped += 1
                return self.drop(sid)
        return False

    def expire(self) -> int:
        """Drop unclaimed sessions idle for longer than the TTL."""
        now, n = self.clock(), 0
        for sid in [s for s, t in self.last_used.items() if now - t > self.ttl_s and s not in self.claimed]:
            n += self.drop(sid)
        self.expired += n
        return n

    def stats(self) -> dict:
        return {"sessions_parked": len(self.parked), "session_pages": self.num_pages,
                "sessions_continued": self.continued, "sessions_dropped": self.dropped,
                "sessions_expired": self.expired}
