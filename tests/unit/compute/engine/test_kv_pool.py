"""KVPool: page accounting, page 0 reserved, reuse of freed pages."""
import pytest
import torch

from services.compute.engine.kv_pool import KVPool, OutOfPages


def test_alloc_free_accounting_and_page0_reserved():
    pool = KVPool(num_pages=9, page_size=4, head_dim=8)
    assert pool.capacity == 8 and pool.num_free == 8 and pool.num_used == 0
    assert pool.k_pages.shape == (9, 4, 8) and pool.v_pages.shape == (9, 4, 8)
    a = pool.alloc(5)
    b = pool.alloc(3)
    got = set(a.tolist()) | set(b.tolist())
    assert got == set(range(1, 9)), "every page but 0 is handed out exactly once"
    assert pool.num_free == 0 and pool.utilisation() == 1.0
    with pytest.raises(OutOfPages):
        pool.alloc(1)
    pool.free(a)
    assert pool.num_free == 5 and pool.num_used == 3
    c = pool.alloc(5)
    assert set(c.tolist()) == set(a.tolist()), "freed pages are reused"
    pool.free(b), pool.free(c)
    assert pool.num_free == pool.capacity
    assert pool.peak_used == 8


def test_alloc_zero_and_dtype():
    pool = KVPool(4, 2, 4, dtype=torch.bfloat16)
    assert pool.alloc(0).numel() == 0
    assert pool.k_pages.dtype == torch.bfloat16
    assert torch.count_nonzero(pool.v_pages) == 0


def test_sized_from_memory_budget():
    per_page = KVPool.page_bytes(16, 64, torch.float16)
    assert per_page == 2 * 16 * 64 * 2
    pool = KVPool.from_memory(per_page * 100 + 7, 16, 64, torch.float16)
    assert pool.num_pages == 100 and pool.capacity == 99
    with pytest.raises(ValueError):
        KVPool(1, 16, 64)


def test_free_drops_one_reference_per_occurrence():
    """Two sequences' rounds freed in one call may name a shared page twice."""
    pool = KVPool(num_pages=9, page_size=4, head_dim=8)
    a = pool.alloc(3)
    pool.share(a[:2])                                  # a second holder of two pages
    pool.free(torch.cat([a, a[:1]]))                   # both holders of a[0] let go at once
    assert pool.refs[a.long()].tolist() == [0, 1, 0] and pool.num_used == 1
    pool.free(a[1:2])
    assert pool.num_free == pool.capacity
