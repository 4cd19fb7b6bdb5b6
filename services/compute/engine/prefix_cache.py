"""Prefix cache: the KV of frequent prompt prefixes (system prompts), shared
by reference (vLLM style).

Full pages only. Page ``i`` of a prompt is keyed by a hash chain,
``key_i = hash((key_{i-1}, its page_size token ids))``, so one key names the
whole prefix up to the end of that page; the token ids are kept and compared
as well, so a hash collision is a miss, never wrong KV. An entry holds one
page per (layer, kv-head) and the policy statistics of its blocks (so a
budgeted sequence ranks reused blocks as if it had computed them itself).

A sequence that hits takes one reference per page (``KVPool.share``) and
never writes those pages: they are full, and it appends into new pages of its
own. Finishing or evicting drops its reference; the cache's own reference keeps
the page for the next request. A budgeted sequence whose pages hold several
blocks compacts its rows in place, so it takes copies instead. At most ``max_pages`` pages are cached;
least-recently-used blocks go first and a lookup refreshes a chain from its
end back to its start, so a prefix's first blocks outlive its later ones (a
chain never loses its head while its tail stays unreachable).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from kvkernels import ops
from services.compute.engine.kv_pool import KVPool
from services.compute.engine.sequence import Sequence

STATS = ("acc_mass", "last_mass", "win_mass", "key_mean", "value_norm", "reach")


@dataclass
class CachedBlock:
    key: int
    tokens: tuple[int, ...]
    pages: torch.Tensor                 # [L, Hkv] int32
    stats: dict[str, torch.Tensor]      # [L, Hkv, c, ...]: the page's blocks' columns of Sequence's statistics
    has_stats: bool                     # attention statistics were collected (else zeros)


class PrefixCache:
    def __init__(self, pool: KVPool, block_size: int, rows: int, max_pages: int):
        self.pool, self.rows = pool, rows   # rows = layers x kv-heads
        self.block_size = block_size
        self.bs = pool.page_size            # tokens per entry
        self.c = pool.page_size // block_size   # blocks per entry
        self.max_pages = max_pages
        self.blocks: OrderedDict[int, CachedBlock] = OrderedDict()   # LRU first
        self.queries = self.hits = self.query_tokens = self.hit_tokens = 0

    @property
    def num_pages(self) -> int:
        return len(self.blocks) * self.rows

    def chain(self, tokens: list[int], n_blocks: int) -> list[tuple[int, tuple[int, ...]]]:
        out, key = [], 0
        for i in range(n_blocks):
            block = tuple(tokens[i * self.bs:(i + 1) * self.bs])
            key = hash((key, block))
            out.append((key, block))
        return out

    # ------------------------------------------------------------ lookup
    def lookup(self, tokens: list[int], max_blocks: int, need_stats: bool = False,
               count: bool = True) -> list[CachedBlock]:
        """The longest cached run of full blocks at the start of ``tokens``
        (at most ``max_blocks``), most-recently-used afterwards."""
        found = []
        for key, block in self.chain(tokens, max(0, min(max_blocks, len(tokens) // self.bs))):
            b = self.blocks.get(key)
            if b is None or b.tokens != block or (need_stats and not b.has_stats):
                break
            found.append(b)
        for b in reversed(found):
            self.blocks.move_to_end(b.key)
        if count:
            self.count(len(tokens), len(found))
        return found

    def admit(self, seq: Sequence, reservation) -> None:
        """A fresh sequence starts from the longest cached prefix of its prompt
        (leaving at least one token to prefill, for its logits). A budgeted one
        takes at most its budget of blocks, and only blocks with statistics.
        ``reservation(seq)``: pages the scheduler reserves for it."""
        if seq.num_cached or seq.num_blocks:
            return
        limit = (seq.num_prompt - 1) // self.bs
        budgeted = seq.eviction.budget_blocks is not None and not seq.prewarm
        if budgeted:
            limit = min(limit, seq.eviction.budget_blocks // self.c)
        blocks = self.lookup(seq.prompt_ids, limit, need_stats=budgeted, count=False)
        # Admission reserved for the sequence as it was; sharing may only lower that
        # (it can raise it for a sliding-window model, whose dense rows otherwise stay small).
        before = reservation(seq)
        seq.prefix_blocks = len(blocks) * self.c
        if reservation(seq) > before:
            seq.prefix_blocks, blocks = 0, []
        if not seq.prewarm:
            self.count(seq.num_prompt, len(blocks))
        self.attach(seq, blocks)

    def count(self, prompt_tokens: int, hit_blocks: int) -> None:
        self.queries += 1
        self.query_tokens += prompt_tokens
        self.hits += hit_blocks > 0
        self.hit_tokens += hit_blocks * self.bs

    def attach(self, seq: Sequence, blocks: list[CachedBlock]) -> None:
        """Start a fresh sequence from cached blocks: shared pages, copied statistics."""
        if not blocks:
            return
        k = len(blocks)
        pages = torch.stack([b.pages for b in blocks], -1).to(seq.page_table.device)
        if self.c > 1 and seq.eviction.budget_blocks is not None:
            own = self.pool.alloc(pages.numel()).to(pages.device)
            ops.move_blocks(self.pool.k_pages, self.pool.v_pages, pages.reshape(-1), own)
            pages = own.view(pages.shape)
        else:
            self.pool.share(pages)
        seq.append_blocks(pages, 0, k * self.c)
        k *= self.c
        for name in STATS:
            src, dst = torch.cat([b.stats[name] for b in blocks], 2), getattr(seq, name)[:, :, :k]
            if src.shape != dst.shape:   # a snapkv ring (64 slots) meets a one-slot one:
                src = src.sum(-1, keepdim=True)   # the window's total lands in one slot
                dst = dst[..., :1]
            dst.copy_(src)
        seq.num_cached = k * self.block_size
        seq.feat_upto = k          # key summaries came along
        seq.prefix_blocks = k

    # ------------------------------------------------------------ insert
    def insert(self, seq: Sequence, n_blocks: int, room_pages: int, has_stats: bool) -> int:
        """Cache the first ``n_blocks`` full pages of ``seq``, whose columns
        must still be blocks 0.. in every row (nothing evicted). Never holds
        more than ``max_pages``, nor takes more than ``room_pages`` (pool pages
        nobody has reserved) beyond what it drops. Returns how many pages from
        the start of the prompt are cached now."""
        if n_blocks <= 0 or seq.evicted_blocks or seq.num_blocks < n_blocks * self.c:
            return 0
        chain = self.chain(seq.tokens, n_blocks)
        protect, todo, done = {key for key, _ in chain}, [], 0
        for i, (key, block) in enumerate(chain):
            b = self.blocks.get(key)
            if b is not None:
                if b.tokens != block:     # hash collision: the chain stops here
                    break
            else:
                need = (len(todo) + 1) * self.rows
                while (self.num_pages + need > self.max_pages or need > room_pages) and self._drop_lru(protect):
                    room_pages += self.rows
                if self.num_pages + need > self.max_pages or need > room_pages:
                    break
                todo.append(i)
            done = i + 1
        if todo:
            cols = torch.tensor(todo, device=seq.page_table.device)
            pages = seq.page_table[:, :, cols]                                 # [L, Hkv, k]
            L, H, k = pages.shape
            c = self.c
            blocks = (cols[:, None] * c + torch.arange(c, device=cols.device)).flatten()
            km, vn = ops.block_features(*self.pool.blocks_view(self.block_size),
                                        seq.block_address(blocks).reshape(-1))
            km, vn = km.view(L, H, k, c, -1), vn.view(L, H, k, c)
            self.pool.share(pages)
            for j, i in enumerate(todo):
                stats = {name: getattr(seq, name)[:, :, i * c:(i + 1) * c].clone() for name in STATS}
                stats["key_mean"] = km[:, :, j].to(stats["key_mean"].device, stats["key_mean"].dtype)
                stats["value_norm"] = vn[:, :, j].to(stats["value_norm"].device, stats["value_norm"].dtype)
                key, block = chain[i]
                self.blocks[key] = CachedBlock(key, block, pages[:, :, j].clone(), stats, has_stats)
        for key, _ in reversed(chain[:done]):
            self.blocks.move_to_end(key)
        return done

    # ------------------------------------------------------------ dropping
    def _drop_lru(self, protect=frozenset()) -> bool:
        """Release the least recently used block that no sequence holds (a
        held block stays: sequences do not reserve the cached blocks they use)."""
        for key, b in self.blocks.items():
            if key not in protect and int(self.pool.refs[b.pages.reshape(-1).long().cpu()].max()) == 1:
                self.pool.free(self.blocks.pop(key).pages)
                return True
        return False

    def drop_lru(self) -> bool:
        """Release the least recently used unheld block (pool pressure)."""
        return self._drop_lru()

    def clear(self) -> None:
        while self._drop_lru():
            pass

    def stats(self) -> dict:
        return {"prefix_cache_blocks": len(self.blocks), "prefix_cache_pages": self.num_pages,
                "prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_hit_rate": self.hits / self.queries if self.queries else 0.0,
                "prefix_cache_hit_tokens": self.hit_tokens, "prefix_cache_query_tokens": self.query_tokens}
