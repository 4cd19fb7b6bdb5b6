"""Each policy ranks what it claims; protection is shared; plans are applied
with gone names ignored and shortfalls counted as fallback."""
import pytest
import torch

from kvkernels import ops
from services.compute.eviction.advisor import EvictionPlan
from services.compute.eviction.block_features import update_features
from services.compute.eviction.evict import Round, evict_rounds, protected_mask
from services.compute.engine.sequence import EvictionState
from services.compute.engine.kv_pool import KVPool
from services.compute.eviction.policies import POLICIES, POLICY_NAMES, SnapKVPolicy, get_policy
from services.compute.model.sampler import SamplingParams
from services.compute.engine.sequence import SNAPKV_WINDOW, Sequence

BS, D = 4, 8


def make_seq(nblocks, policy="h2o", L=1, H=2, sink_blocks=0, recent=0, rid="r"):
    pool = KVPool(200, BS, D)
    st = EvictionState(policy, budget_blocks=4, floor_blocks=2, sink_blocks=sink_blocks, recent=recent)
    seq = Sequence(rid, list(range(3, 3 + nblocks * BS)), SamplingParams(), st, L, H, D, BS)
    seq.append_blocks(pool.alloc(L * H * nblocks).view(L, H, nblocks), 0)
    seq.num_cached = nblocks * BS
    seq.policy = get_policy(policy)
    return seq, pool


def evict(seq, pool, k):
    evict_rounds([Round(seq, k)], pool)
    return [row.tolist() for row in seq.block_index.reshape(-1, seq.num_blocks)]


def test_registry():
    assert set(POLICIES) == {"dense", "streaming", "h2o", "tova", "snapkv", "knorm", "keydiff", "random"}
    assert "learned" in POLICY_NAMES and not get_policy("dense").evicts
    with pytest.raises(ValueError, match="unknown policy"):
        get_policy("lru")


def test_protection_sink_recent_newest():
    seq, _ = make_seq(8, sink_blocks=1, recent=6)   # n = 32: recent covers positions 26..31
    prot = protected_mask(seq)[0, 0].tolist()
    assert prot == [True, False, False, False, False, False, True, True]


def test_streaming_evicts_oldest_after_sink():
    seq, pool = make_seq(6, "streaming", sink_blocks=1)
    free0 = pool.num_free
    assert evict(seq, pool, 2) == [[0, 3, 4, 5]] * 2
    assert pool.num_free == free0 + 2 * 2 and seq.evicted_blocks == 4


def test_h2o_keeps_accumulated_attention_per_row():
    seq, pool = make_seq(6, "h2o")
    seq.acc_mass[0, 0, 2] = 5.0    # row 0 keeps block 2
    seq.acc_mass[0, 1, 3] = 5.0    # row 1 keeps block 3
    seq.last_mass[0, :, 1] = 9.0   # h2o must not look at the last query only
    assert evict(seq, pool, 4) == [[2, 5], [3, 5]]


def test_tova_keeps_the_last_querys_attention():
    seq, pool = make_seq(6, "tova")
    seq.acc_mass[0, :, 0] = 9.0
    seq.last_mass[0, :, 1] = 1.0
    assert evict(seq, pool, 4) == [[1, 5]] * 2


def test_snapkv_window_is_pooled_over_neighbours():
    seq, pool = make_seq(12, "snapkv")
    seq.win_mass[0, :, 6, 0] = 1.0    # one window query put its mass on block 6
    seq.acc_mass[0, :, 0] = 9.0       # old accumulated attention is ignored
    s = seq.policy.score(seq)[0, 0]
    k = SnapKVPolicy.kernel
    assert torch.allclose(s[6 - k // 2:6 + k // 2 + 1], torch.full((k,), 1.0 / k))   # neighbours share it
    assert s[:6 - k // 2].sum() == 0 and s[6 + k // 2 + 1:].sum() == 0
    kept = evict(seq, pool, 12 - k - 1)   # the newest block is protected
    assert all(set(range(6 - k // 2, 6 + k // 2 + 1)) <= set(row) for row in kept)


def test_snapkv_window_forgets_old_queries():
    seq, pool = make_seq(5, "snapkv", L=1, H=1)
    assert seq.win_mass.shape[3] == SNAPKV_WINDOW
    old = torch.zeros(1, 1, 1, 5); old[..., 0] = 1.0
    seq.observe(old.sum(2), old[:, :, -1], old)
    new = torch.zeros(1, 1, SNAPKV_WINDOW, 5); new[..., 2] = 0.1   # newer queries fill the window
    seq.observe(new.sum(2), new[:, :, -1], new)
    assert seq.acc_mass[0, 0, 0] == 1.0 and seq.win_mass[0, 0, 0].sum() == 0
    assert seq.win_mass[0, 0, 2].sum() == pytest.approx(0.1 * SNAPKV_WINDOW)


def test_only_snapkv_sequences_pay_for_the_window():
    assert make_seq(3, "snapkv")[0].win_mass.shape[3] == SNAPKV_WINDOW
    assert all(make_seq(3, p)[0].win_mass.shape[3] == 1 for p in ("h2o", "tova", "keydiff", "streaming"))


def _write_keys(seq, pool, keys):
    """keys[L, H, NB, d]: every slot of a block gets its block's key."""
    pages = seq.page_table.long()
    pool.k_pages[pages] = keys[..., None, :].expand(*keys.shape[:3], BS, D)
    update_features([seq], pool)


def test_knorm_keeps_low_norm_keys():
    seq, pool = make_seq(6, "knorm")
    norms = torch.tensor([[5.0, 1.0, 4.0, 2.0, 3.0, 9.0], [1.0, 5.0, 2.0, 4.0, 3.0, 9.0]])
    keys = torch.zeros(1, 2, 6, D)
    keys[..., 0] = norms
    _write_keys(seq, pool, keys)
    assert evict(seq, pool, 3) == [[1, 3, 5], [0, 2, 5]]


def test_keydiff_keeps_distinctive_keys():
    seq, pool = make_seq(6, "keydiff", H=1)
    keys = torch.zeros(1, 1, 6, D)
    keys[..., 0] = 1.0
    keys[0, 0, 2] = torch.tensor([0.0, 1.0] + [0.0] * (D - 2))   # orthogonal to the rest
    keys[0, 0, 4, 1] = -0.5                                      # off the mean, other side
    _write_keys(seq, pool, keys)
    assert evict(seq, pool, 3) == [[2, 4, 5]]


def test_random_is_reproducible_per_request_and_respects_protection():
    picks = []
    for rid in ("a", "a", "b"):
        seq, pool = make_seq(12, "random", sink_blocks=1, recent=8, rid=rid)
        picks.append(evict(seq, pool, 6))
    assert picks[0] == picks[1] and picks[0] != picks[2]
    for kept in picks:
        for row in kept:
            assert row[0] == 0 and row[-2:] == [10, 11]


def test_plan_first_gone_names_ignored_shortfall_is_fallback():
    seq, pool = make_seq(8, "h2o")
    seq.acc_mass[0, :, :] = torch.arange(8, dtype=torch.float32)  # fallback: evict oldest first
    seq.acc_mass[0, :, 0] = 100.0
    names = torch.tensor([[[99, 4, 7, 2], [6, 99, -1, -1]]], dtype=torch.int32)   # 7 is protected
    seq.eviction.policy = "learned"
    evict_rounds([Round(seq, 3, EvictionPlan("r", names, covers=100))], pool)
    kept = [row.tolist() for row in seq.block_index[0]]
    assert kept[0] == [0, 3, 5, 6, 7] and kept[1] == [0, 3, 4, 5, 7]
    # Row 0: 4 and 2 from the plan, then block 1 (lowest h2o score) as fallback;
    # row 1: 6 from the plan, then 1 and 2 as fallback.
    assert seq.evictions == {("fallback", "unranked"): 3, ("network", ""): 3}


def test_eviction_select_contract_used_by_rounds():
    scores = torch.tensor([[0.5, 0.1, 0.9, 0.2]])
    evictable = torch.tensor([[True, False, True, True]])
    assert ops.eviction_select(scores, evictable, 2).tolist() == [[3, 0]]


def test_batched_decode_observe_equals_one_by_one():
    from services.compute.engine.sequence import observe_decode
    torch.manual_seed(0)
    a = [make_seq(n, p)[0] for n, p in ((3, "snapkv"), (5, "h2o"))]
    b = [make_seq(n, p)[0] for n, p in ((3, "snapkv"), (5, "h2o"))]
    for step in range(SNAPKV_WINDOW + 3):   # more steps than the window: the ring wraps
        masses = [torch.rand(1, 2, s.num_blocks) for s in a]
        for s, m in zip(a, masses):
            s.observe(m, m, m[:, :, None])
        observe_decode(b, masses)
    for x, y in zip(a, b):
        assert torch.equal(x.acc_mass, y.acc_mass) and torch.equal(x.last_mass, y.last_mass)
        assert torch.equal(x.win_mass, y.win_mass) and x.win_ptr == y.win_ptr
