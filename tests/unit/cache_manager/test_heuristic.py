"""The cache-manager's scoring state and heuristic plan, without a server."""
from __future__ import annotations

import numpy as np
import pytest

from kvpop.runtime.arrays import from_float_array, from_int_array, to_float_array, to_int_array
from kvpop.runtime.pb import cache_manager_pb2 as pb
from services.cache_manager.heuristic import AttentionPerAge, plan
from services.cache_manager.scoring_state import BlockRecord, ScoringState

L, H, D = 2, 3, 4


def rec(block, attention, age):
    return BlockRecord(block=block, position=block * 16, age=age, key_mean=np.zeros((L, H, D), np.float32),
                       value_norm=np.ones((L, H), np.float32), attention=np.asarray(attention, np.float32))


def test_plan_ranks_lowest_attention_per_age_first_per_row():
    seq = ScoringState().get("r")
    rng = np.random.default_rng(0)
    att = rng.random((5, L, H)).astype(np.float32)
    ages = [50, 40, 30, 20, 10]
    for b in range(5):
        seq.add(rec(b + 1, att[b], ages[b]))
    evict = plan(seq, AttentionPerAge().score(seq), max_blocks=100)
    assert evict.shape == (L, H, 5)
    per_step = att / (np.array(ages, np.float32)[:, None, None] + 1)
    for l in range(L):
        for h in range(H):
            want = (np.argsort(per_step[:, l, h], kind="stable") + 1).tolist()
            assert evict[l, h].tolist() == want
    assert plan(seq, AttentionPerAge().score(seq), max_blocks=2).shape == (L, H, 2)


def test_old_block_with_same_mass_is_less_important_than_a_young_one():
    seq = ScoringState().get("r")
    seq.add(rec(1, np.full((L, H), 0.5), age=100))
    seq.add(rec(2, np.full((L, H), 0.5), age=5))
    assert (plan(seq, AttentionPerAge().score(seq), 10)[..., 0] == 1).all()


def test_mismatched_shapes_are_refused():
    seq = ScoringState().get("r")
    seq.add(rec(1, np.zeros((L, H)), 1))
    bad = rec(2, np.zeros((L, H + 1)), 1)
    with pytest.raises(ValueError, match="differs from earlier blocks"):
        seq.add(bad)


def test_packed_arrays_round_trip_and_reject_bad_sizes():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert np.array_equal(from_float_array(to_float_array(a)), a)
    i = np.arange(6, dtype=np.int32).reshape(2, 3)
    assert np.array_equal(from_int_array(to_int_array(i)), i)
    with pytest.raises(ValueError):
        from_float_array(pb.FloatArray(shape=[5], data=b"\0" * 8))


def test_state_grows_and_resent_blocks_replace_their_row():
    seq = ScoringState().get("r")
    for b in range(40):
        seq.add(rec(b, np.full((L, H), float(b)), age=1))
    seq.add(rec(3, np.full((L, H), 100.0), age=1))
    a = seq.arrays()
    assert len(seq) == 40 and a["attention"].shape == (40, L, H) and a["key_mean"].shape == (40, L, H, D)
    assert a["block"].tolist() == list(range(40)) and (a["attention"][3] == 100.0).all()


def test_plan_ranks_blocks_a_row_evicted_last():
    """compute reports what each row evicted (`gone`): a plan capped at a few
    names spends them on blocks that row still holds, per row."""
    import numpy as np

    from services.cache_manager.planner import Planner
    from services.cache_manager.scoring_state import BlockRecord

    p = Planner("none", max_plan_blocks=3)
    recs = [BlockRecord(b, b, 1, np.zeros((1, 2, 4), np.float32), np.ones((1, 2), np.float32),
                        np.full((1, 2), float(b + 1), np.float32)) for b in range(6)]
    first = p.apply("s", recs)
    assert first.evict[0, 0].tolist() == [0, 1, 2] and first.covers == 6 and first.ranker == "heuristic"
    p.add("s", [], gone=np.array([[[0, 1], [-1, -1]]], np.int32))
    again = p.plan("s").evict
    assert again[0, 0].tolist() == [2, 3, 4] and again[0, 1].tolist() == [0, 1, 2]
