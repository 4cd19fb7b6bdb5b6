"""The paged KV pool: one preallocated K and V tensor for the whole model.

A page holds ``page_size`` consecutive resident positions of one (layer,
kv-head) of one sequence: one block, or several when eviction is finer than
paging (sequence.py). Keys are stored post-RoPE, so any freed page can be reused by any
sequence at any position. Page 0 is never handed out: page tables pad with it
and gathers from it are harmless.

Pages are reference counted so that full blocks of a cached prefix can sit in
several page tables at once (prefix cache, parked sessions): ``alloc`` hands a
page out with one reference, ``share`` adds one, ``free`` drops one, and a page
is back in the free list when its count reaches 0.
"""
from __future__ import annotations

import torch


class OutOfPages(RuntimeError):
    pass


class KVPool:
    def __init__(self, num_pages: int, page_size: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.head_dim = head_dim
        # zeros, not empty: padding slots are masked, but 0 * NaN would still poison outputs.
        self.k_pages = torch.zeros(num_pages, page_size, head_dim, dtype=dtype, device=device)
        self.v_pages = torch.zeros(num_pages, page_size, head_dim, dtype=dtype, device=device)
        # A stack: recently freed pages are handed out first (warm in cache).
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self.refs = torch.zeros(num_pages, dtype=torch.int32)   # host side: bookkeeping only
        self.peak_used = 0

    @staticmethod
    def page_bytes(page_size: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * page_size * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def from_memory(cls, memory_bytes: int, page_size: int, head_dim: int,
                    dtype: torch.dtype = torch.float32, device="cpu") -> "KVPool":
        return cls(max(2, memory_bytes // cls.page_bytes(page_size, head_dim, dtype)),
                   page_size, head_dim, dtype, device)

    @property
    def capacity(self) -> int:
        """Pages that can be handed out (page 0 excluded)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def utilisation(self) -> float:
        return self.num_used / self.capacity

    def alloc(self, n: int) -> torch.Tensor:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        if n == 0:
            return torch.empty(0, dtype=torch.int32)
        pages = torch.tensor(self._free[-n:], dtype=torch.int32)
        del self._free[-n:]
        self.refs[pages.long()] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return pages

    def share(self, pages: torch.Tensor) -> None:
        """One more reference to each (distinct, allocated) page."""
        if pages.numel():
            self.refs[pages.reshape(-1).long().cpu()] += 1

    def blocks_view(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as ``[num_pages * page_size / block_size, block_size, d]``:
        block ``j`` of a row lives at ``page_table[j // c] * c + j % c`` (``c``
        blocks per page), so every per-block kernel runs on this view unchanged."""
        c = self.page_size // block_size
        return (self.k_pages.view(self.num_pages * c, block_size, -1),
                self.v_pages.view(self.num_pages * c, block_size, -1))

    def free(self, pages: torch.Tensor) -> None:
        """Drop one reference per occurrence of each page (a page shared by
        several sequences comes once per sequence when their rounds run
        together); pages nobody holds any more go back to the free list."""
        if not pages.numel():
            return
        p, n = torch.unique(pages.reshape(-1).long().cpu(), return_counts=True)
        left = self.refs[p] - n.to(self.refs.dtype)
        self.refs[p] = left
        self._free.extend(p[left == 0].tolist())
