"""The value-estimation network: shapes, permutation behaviour, incremental
scoring against a full pass, checkpoints, and training on a synthetic set
whose answer is known."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.cache_manager.estimator import (N_SCALARS, EstimatorConfig, LearnedScorer, ValueEstimator, load, row_ids,
                                              rows_from_arrays, save)
from services.cache_manager.scoring_state import BlockRecord, ScoringState

L, H, D = 2, 2, 8


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors: a second thread only adds contention on the shared CI cores.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _net(seed=0, **kw) -> ValueEstimator:
    torch.manual_seed(seed)
    return ValueEstimator(EstimatorConfig(L, H, D, d_model=16, **kw)).eval()


def _arrays(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"block": np.arange(1, n + 1, dtype=np.int32), "position": np.arange(1, n + 1) * 4,
            "age": rng.integers(8, 200, n).astype(np.float32),
            "key_mean": rng.normal(size=(n, L, H, D)).astype(np.float32),
            "value_norm": rng.random((n, L, H)).astype(np.float32) + 0.5,
            "attention": rng.random((n, L, H)).astype(np.float32) * 5}


def _records(a, lo, hi):
    return [BlockRecord(int(a["block"][i]), int(a["position"][i]), int(a["age"][i]), a["key_mean"][i],
                        a["value_norm"][i], a["attention"][i]) for i in range(lo, hi)]


def test_shapes_and_blocks_are_a_set_per_row():
    net = _net(depth=2)
    a = _arrays(12)
    km, sc, tf = rows_from_arrays(a)
    layer, head = row_ids(L, H)
    with torch.no_grad():
        s = net(km, sc, tf, layer, head)
        assert s.shape == (L * H, 12) and torch.isfinite(s).all()
        perm = torch.randperm(12, generator=torch.Generator().manual_seed(1))
        sp = net(km[:, perm], sc[:, perm], tf[:, perm], layer, head)
        # Permuting a row's blocks permutes its scores: no hidden order dependence.
        assert torch.allclose(sp, s[:, perm], atol=1e-5)
        # Rows are independent: one row alone scores as in the batch.
        one = net(km[2:3], sc[2:3], tf[2:3], layer[2:3], head[2:3])
        assert torch.allclose(one, s[2:3], atol=1e-5)
        # ... but a block's score depends on the other blocks of its row (it is not a per-block MLP).
        drop = net(km[:, 1:], sc[:, 1:], tf[:, 1:], layer, head)
        assert not torch.allclose(drop, s[:, 1:], atol=1e-4)
        # Layer / head identity matters.
        assert not torch.allclose(s[0], net(km[0:1], sc[0:1], tf[0:1], layer[3:4], head[3:4])[0], atol=1e-4)


def test_padding_mask_matches_unpadded_rows():
    net = _net()
    km, sc, tf = rows_from_arrays(_arrays(10))
    layer, head = row_ids(L, H)
    pad = lambda x: torch.cat([x, torch.randn(x.shape[0], 3, *x.shape[2:])], 1)
    mask = torch.ones(L * H, 13, dtype=torch.bool)
    mask[:, 10:] = False
    with torch.no_grad():
        full = net(km, sc, tf, layer, head)
        padded = net(pad(km), pad(sc), pad(tf), layer, head, mask)[:, :10]
    assert torch.allclose(full, padded, atol=1e-5)


def test_scorer_incremental_matches_full_pass_for_new_blocks_and_refreshes():
    net = _net()
    net.cfg.rescore_every = 4
    scorer = LearnedScorer(net)
    a = _arrays(20)
    seq = ScoringState().get("r")
    layer, head = row_ids(L, H)
    for r in _records(a, 0, 10):
        seq.add(r)
    scorer.score(seq)                           # full pass over 10
    for r in _records(a, 10, 12):
        seq.add(r)
    inc = scorer.score(seq)                     # 2 new blocks, incremental
    with torch.no_grad():
        km, sc, tf = rows_from_arrays(seq.arrays())
        full = net(km, sc, tf, layer, head).view(L, H, 12).permute(2, 0, 1).numpy()
    # New blocks attend over everything known: exact (depth 1). Old ones wait for the refresh.
    assert np.allclose(inc[10:], full[10:], atol=1e-5)
    assert not np.allclose(inc[:10], full[:10], atol=1e-5)
    for r in _records(a, 12, 14):
        seq.add(r)
    assert scorer.score(seq).shape == (14, L, H)   # 4 new since the full pass: refreshed
    with torch.no_grad():
        km, sc, tf = rows_from_arrays(seq.arrays())
        full = net(km, sc, tf, layer, head).view(L, H, 14).permute(2, 0, 1).numpy()
    assert np.allclose(scorer.score(seq), full, atol=1e-5)
    # A re-sent block invalidates the cache: back to a full pass.
    seq.add(_records(_arrays(20, seed=5), 3, 4)[0])
    with torch.no_grad():
        km, sc, tf = rows_from_arrays(seq.arrays())
        full = net(km, sc, tf, layer, head).view(L, H, 14).permute(2, 0, 1).numpy()
    assert np.allclose(scorer.score(seq), full, atol=1e-5)


def test_scorer_stays_exact_for_what_rows_hold_while_rows_evict():
    """Blocks arrive in bursts and rows evict as serving does (mark_gone): every
    block a row still holds scores exactly as a full pass over all blocks, and
    evicted blocks stop costing query slots."""
    net = _net()
    net.cfg.rescore_every = 1
    scorer, seq = LearnedScorer(net), ScoringState().get("r")
    layer, head = row_ids(L, H)
    a, rng, known = _arrays(60, seed=3), np.random.default_rng(4), 0
    for burst in (7, 1, 0, 5, 1, 1, 12, 3, 1, 9, 1, 1, 1):
        for r in _records(a, known, known + burst):
            seq.add(r)
        known += burst
        # Each row forgets a few of the blocks it holds (names as compute sends them, -1 padded).
        held = ~seq.arrays()["gone"]
        names = np.full((L, H, 3), -1, np.int32)
        for li in range(L):
            for hi in range(H):
                cand = seq.arrays()["block"][held[:, li, hi]]
                pick = rng.choice(cand, size=min(len(cand) - 1, int(rng.integers(0, 4))), replace=False)
                names[li, hi, :len(pick)] = pick
        seq.mark_gone(names)
        got = scorer.score(seq)
        with torch.no_grad():
            km, sc, tf = rows_from_arrays(seq.arrays())
            full = net(km, sc, tf, layer, head).view(L, H, known).permute(2, 0, 1).numpy()
        held = ~seq.arrays()["gone"]
        assert held.sum() < held.size or known < 8
        assert np.abs(got - full)[held].max() < 1e-5
        live = seq.cache["live"]
        assert (live.idx >= 0).sum(1).max() <= held.sum(0).max()
        assert live.idx.shape[1] <= 4 * held.sum(0).max() // 3 + burst + 1


def test_scores_move_with_time_without_new_attention():
    net = _net()
    seq = ScoringState().get("r")
    a = _arrays(8)
    for r in _records(a, 0, 8):
        seq.add(r)
    s1 = LearnedScorer(net).score(seq)
    a2 = _arrays(8)
    # Same blocks, but the sequence has grown (a later submission with a larger position + age).
    seq2 = ScoringState().get("r")
    for r in _records(a2, 0, 8):
        seq2.add(r)
    seq2.add(BlockRecord(500, 2000, 10, a["key_mean"][0], a["value_norm"][0], a["attention"][0]))
    s2 = LearnedScorer(net).score(seq2)
    assert not np.allclose(s1, s2[:8], atol=1e-4)


def test_checkpoint_round_trip_and_bad_files(tmp_path):
    net = _net(depth=2)
    p = save(net, tmp_path / "estimator.safetensors")
    assert p.with_suffix(".json").exists()
    back = load(p)
    assert back.cfg.depth == 2 and back.cfg.num_layers == L
    km, sc, tf = rows_from_arrays(_arrays(6))
    layer, head = row_ids(L, H)
    with torch.no_grad():
        assert torch.equal(net(km, sc, tf, layer, head), back(km, sc, tf, layer, head))
    with pytest.raises(ValueError, match="no estimator checkpoint"):
        load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot load estimator"):
        load(tmp_path / "junk.safetensors")


def _synthetic(n_seq, rng):
    """Traces whose true future mass is exp(3 * key_mean[..., 0]) of the block, for rows
    where the h2o statistic (attention so far) is pure noise."""
    out = []
    for _ in range(n_seq):
        n = int(rng.integers(16, 40))
        a = _arrays(n, seed=int(rng.integers(1 << 30)))
        tgt = np.exp(3 * a["key_mean"][..., 0]).transpose(1, 2, 0).astype(np.float32)   # [L, H, n]
        out.append({**a, "times": np.array([n * 4 + 200]), "known": np.array([n]), "targets": [tgt / tgt.sum()]})
    return out


def test_training_learns_a_known_ranking():
    from kvpop.training.train_estimator import evaluate, train

    rng = np.random.default_rng(0)
    tr, va = _synthetic(48, rng), _synthetic(8, rng)
    torch.manual_seed(0)
    net = ValueEstimator(EstimatorConfig(L, H, D, d_model=16))
    before = evaluate(net, va)
    hist = train(net, tr, va, minutes=1.0, lr=3e-3, seed=0, eval_every_s=1e9, progress=False, max_steps=250)
    after = evaluate(net, va)
    assert hist[-1][1] < hist[0][1] * 0.7
    assert after["loss"] < before["loss"] * 0.7
    m = after["mass_at_k"]
    # The network finds the key direction; attention-so-far (random here) cannot.
    assert m["learned"]["mean"] > 0.85, m
    assert m["learned"]["mean"] > m["h2o"]["mean"] + 0.2, m
    # A warm start that training only makes worse (a wild learning rate) ends where it started.
    train(net, tr, va, minutes=1.0, lr=50.0, seed=1, eval_every_s=1e9, progress=False, max_steps=30)
    assert evaluate(net, va)["loss"] == pytest.approx(after["loss"], rel=1e-6)


def test_train_estimator_command_writes_a_loadable_checkpoint(tmp_path):
    from helpers.models import save_hf_model
    from kvpop.cli import main
    from kvpop.tasks.vocab import WORDS
    from services.cache_manager.planner import Planner

    save_hf_model(tmp_path / "m", vocab_size=len(WORDS), max_position_embeddings=1024)
    out = tmp_path / "m" / "estimator.safetensors"
    # Tracing alone: the traces file and no checkpoint (and it needs a file to write).
    assert main(["train-estimator", "--model", str(tmp_path / "m"), "--trace-only"]) == 2
    assert main(["train-estimator", "--model", str(tmp_path / "m"), "--prefill-chunk", "0"]) == 2
    # Traced at compute's prompt chunk: a 32-token chunk puts decision points inside 64-96-token prompts
    # (at the default 512 the prompt's only one is its end).
    rc = main(["train-estimator", "--model", str(tmp_path / "m"), "--n", "6", "--min-len", "64", "--max-len", "96",
               "--block-sizes", "1,4", "--threads", "1", "--traces", str(tmp_path / "traces.pt"), "--trace-only",
               "--prefill-chunk", "32"])
    assert rc == 0 and (tmp_path / "traces.pt").exists() and not out.exists()
    import torch
    traced = torch.load(tmp_path / "traces.pt", weights_only=False)
    # 32 is before every prompt's end (>= 63 tokens): only a chunk end can put a decision there.
    assert sum(32 in e["times"].tolist() for e in traced) >= 2, [e["times"] for e in traced]
    assert not (tmp_path / "traces.pt.part").exists()      # written aside, then renamed into place
    # A truncated traces file (a run killed mid-write before writes were atomic) is one line, not a traceback.
    cut = tmp_path / "cut.pt"
    cut.write_bytes((tmp_path / "traces.pt").read_bytes()[:1000])
    assert main(["train-estimator", "--model", str(tmp_path / "m"), "--threads", "1", "--traces", str(cut)]) == 2
    rc = main(["train-estimator", "--model", str(tmp_path / "m"), "--n", "6", "--minutes", "0.05",
               "--min-len", "64", "--max-len", "96", "--block-sizes", "1,4", "--threads", "1",
               "--traces", str(tmp_path / "traces.pt")])
    assert rc == 0 and out.exists() and (tmp_path / "m" / "estimator_loss.png").exists()
    cfg = load(out).cfg
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (2, 2, 16)
    assert cfg.trained["held_out"]["decisions"] > 0 and cfg.trained["traces"] >= 5
    # The longest traced prompt: what the cache-manager routes by (about --max-len).
    assert 64 * 0.9 <= cfg.max_context <= 96 * 1.1, cfg.max_context
    assert Planner(tmp_path / "m").policy_name == "learned"     # a model folder resolves to its checkpoint
    assert (tmp_path / "traces.pt").exists()
    # --init continues from that checkpoint (its shape wins over --d-model) on the cached traces.
    out2 = tmp_path / "again.safetensors"
    rc = main(["train-estimator", "--model", str(tmp_path / "m"), "--minutes", "0.05", "--d-model", "8",
               "--threads", "1", "--traces", str(tmp_path / "traces.pt"), "--init", str(out), "--out", str(out2),
               "--serves-block-sizes", "4,1"])
    again = load(out2).cfg
    assert rc == 0 and again.d_model == cfg.d_model and again.trained["init"]["path"] == str(out)
    assert again.max_context == cfg.max_context and cfg.block_sizes == [] and again.block_sizes == [1, 4]
    # The continuation keeps what its init was traced on (lengths here; sources for real-text runs).
    assert again.trained["init"]["lengths"] == [64, 96], again.trained["init"]
    assert main(["train-estimator", "--model", str(tmp_path / "m"), "--serves-block-sizes", "0", "--threads", "1",
                 "--traces", str(tmp_path / "traces.pt"), "--out", str(out2)]) == 2
    # A family cycle: an unknown family is one line, not a traceback.
    assert main(["train-estimator", "--model", str(tmp_path / "m"), "--n", "4", "--families", "recall,nope",
                 "--threads", "1", "--traces", str(tmp_path / "mix.pt"), "--trace-only"]) == 2
    assert not (tmp_path / "mix.pt").exists()
    # --cross-rows added to a trained network: it starts as that network and keeps its shape.
    out3 = tmp_path / "cross.safetensors"
    rc = main(["train-estimator", "--model", str(tmp_path / "m"), "--minutes", "0.05", "--threads", "1",
               "--traces", str(tmp_path / "traces.pt"), "--init", str(out), "--cross-rows", "--out", str(out3)])
    crossed = load(out3).cfg
    assert rc == 0 and crossed.cross_rows and crossed.d_model == cfg.d_model and crossed.trained["cross_rows"]
    # A checkpoint for another model's shape is refused with a message, not a traceback.
    other = tmp_path / "other.safetensors"
    save(ValueEstimator(EstimatorConfig(3, 2, 16, d_model=8)), other)
    assert main(["train-estimator", "--model", str(tmp_path / "m"), "--minutes", "0.05", "--threads", "1",
                 "--traces", str(tmp_path / "traces.pt"), "--init", str(other), "--out", str(out2)]) == 2


def test_scoring_a_subset_of_blocks_matches_the_full_pass_there():
    """Training on long traces scores a sample of each row's blocks against all
    of them as keys: exactly the full pass's scores for those blocks."""
    from kvpop.training.train_estimator import query_sample

    net = _net()
    km, sc, tf = rows_from_arrays(_arrays(40))
    layer, head = row_ids(L, H)
    gen = torch.Generator().manual_seed(0)
    target = torch.rand(L * H, 40, generator=gen)
    assert query_sample(target, gen, m=40) is None                    # short rows: every block
    q = query_sample(target, gen, m=16)
    assert q.shape == (L * H, 16)
    for r in range(L * H):
        assert len(set(q[r].tolist())) == 16                          # no block twice
        assert set(target[r].topk(2).indices.tolist()) <= set(q[r].tolist())   # the row's top is always in
    with torch.no_grad():
        full = net(km, sc, tf, layer, head)
        sub = net(km, sc, tf, layer, head, queries=q)
    assert torch.allclose(sub, full.gather(1, q), atol=1e-5)
    with pytest.raises(ValueError, match="depth-1"):
        _net(depth=2)(km, sc, tf, layer, head, queries=q)


def test_attention_paths_agree_on_output_and_log_sum_exp():
    """The scorer's three ways to attend (whole matrix, key chunks merged, torch's
    fused kernel) give the same output and log-sum-exp, which merging relies on."""
    from services.cache_manager import live_attention as la

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, n, 8, generator=g) for n in (5, 37, 37))
    want_out = torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1) @ v
    want_lse = torch.logsumexp(q @ k.transpose(-1, -2) * 0.3, -1)
    old = la._CHUNK_ELEMS
    la._CHUNK_ELEMS = 3 * 2 * 5 * 4                 # chunks of 4 keys: 10 merges
    try:
        paths = [la._direct(q, k, v, 0.3), la._attend_plain(q, k, v, 0.3)]
    finally:
        la._CHUNK_ELEMS = old
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is not None:
        paths.append(flash(q, k, v, scale=0.3)[:2])
    for out, lse in paths:
        assert torch.allclose(out, want_out, atol=1e-5) and torch.allclose(lse, want_lse, atol=1e-5)


def test_planner_warns_once_about_a_block_size_the_network_was_not_trained_on(caplog):
    """The shipped estimator records the block sizes it was trained on; features
    at another block size are ranked all the same, and the log says so once."""
    import logging

    from services.cache_manager.planner import Planner
    from services.cache_manager.scoring_state import BlockRecord

    planner = Planner("")
    trained = planner.scorer.model.cfg.trained["block_sizes"]
    c = planner.scorer.model.cfg
    rng = np.random.default_rng(0)

    def send(rid, bs, blocks):
        planner.add(rid, [BlockRecord(b, b * bs, 8, rng.standard_normal((c.num_layers, c.num_kv_heads, c.head_dim),
                                                                         dtype=np.float32),
                                      np.ones((c.num_layers, c.num_kv_heads), np.float32),
                                      np.ones((c.num_layers, c.num_kv_heads), np.float32)) for b in blocks])
        return planner.plan(rid)

    untrained = next(b for b in range(2, 64) if b not in trained)
    with caplog.at_level(logging.WARNING, logger="services.cache_manager.planner"):
        for rid, bs in (("a", trained[-1]), ("b", untrained), ("c", untrained)):
            assert send(rid, bs, range(1, 12)).ranker == "network"
    said = [r.getMessage() for r in caplog.records if "trained at block sizes" in r.getMessage()]
    assert len(said) == 1 and f"block size {untrained}," in said[0], said


def test_planner_routes_each_sequence_to_the_network_trained_for_its_prompt_length(tmp_path):
    """A folder's estimator.safetensors and estimator-*.safetensors load
    together; each sequence is ranked by the network trained on the shortest
    prompts that cover its own (past all of them, the one trained longest; an
    unknown length, the primary), exactly as that network alone ranks it."""
    from services.cache_manager.planner import Planner, resolve_checkpoints

    short, long_ = _net(1, max_context=100), _net(2, max_context=1000)
    save(short, tmp_path / "estimator.safetensors")
    save(long_, tmp_path / "estimator-long.safetensors")
    assert resolve_checkpoints(tmp_path) == [tmp_path / "estimator.safetensors", tmp_path / "estimator-long.safetensors"]
    assert resolve_checkpoints("none") == []
    planner = Planner(tmp_path)
    assert planner.policy_name == "learned" and len(planner.scorers) == 2 and " + " in planner.loaded
    a = _arrays(40, seed=5)
    recs = _records(a, 0, 40)
    alone = {net: Planner(model=net).apply("x", recs).evict for net in (short, long_)}
    assert not np.array_equal(alone[short], alone[long_])
    for rid, prompt_tokens, want, name in (("s", 80, short, "estimator.safetensors"),
                                            ("edge", 100, short, "estimator.safetensors"),
                                            ("l", 101, long_, "estimator-long.safetensors"),
                                            ("past", 5000, long_, "estimator-long.safetensors"),
                                            ("unknown", 0, short, "estimator.safetensors")):
        got = planner.apply(rid, recs, prompt_tokens)
        assert got.estimator == name and np.array_equal(got.evict, alone[want]), rid
    # A comma-separated list: its first is the primary; a network with no stated
    # limit takes what the bounded ones do not cover.
    save(_net(3), tmp_path / "any.safetensors")
    anyp = Planner(f"{tmp_path / 'any.safetensors'},{tmp_path / 'estimator.safetensors'}")
    assert [anyp.apply(r, recs, n).estimator for r, n in (("u", 0), ("s", 80), ("l", 500))] == \
        ["any.safetensors", "estimator.safetensors", "any.safetensors"]
    # A network for another model's rows never takes a sequence, however it fits the length.
    torch.manual_seed(4)
    save(ValueEstimator(EstimatorConfig(L + 1, H, D, d_model=16, max_context=50)), tmp_path / "estimator-x.safetensors")
    mixed = Planner(tmp_path)
    assert len(mixed.scorers) == 3 and mixed.apply("s", recs, 40).estimator == "estimator.safetensors"


def test_planner_routes_a_sequence_to_the_network_made_for_its_block_size(tmp_path):
    """A network that states block sizes takes the sequences at those only, routed
    by prompt length among its peers; the networks that state none take every other
    sequence, and one whose block size is not known yet (only block 0 seen)."""
    from services.cache_manager.planner import Planner

    any_ = _net(1, max_context=1000)
    bs4, bs4_long = _net(2, block_sizes=[4], max_context=100), _net(3, block_sizes=[4, 2], max_context=1000)
    save(any_, tmp_path / "estimator.safetensors")
    save(bs4, tmp_path / "estimator-bs4.safetensors")
    save(bs4_long, tmp_path / "estimator-bs4long.safetensors")
    assert load(tmp_path / "estimator-bs4long.safetensors").cfg.block_sizes == [4, 2]
    planner = Planner(tmp_path)
    assert len(planner.scorers) == 3
    a4 = _arrays(40, seed=6)                                   # positions 4 x block: block size 4
    a8 = dict(a4, position=a4["block"].astype(np.int64) * 8)
    alone = {(net, bs): Planner(model=net).apply("x", _records(a, 0, 40)).evict
             for net in (any_, bs4, bs4_long) for bs, a in ((4, a4), (8, a8))}
    assert not np.array_equal(alone[(any_, 4)], alone[(bs4, 4)])
    for rid, a, bs, prompt_tokens, want, name in (
            ("s4", a4, 4, 80, bs4, "estimator-bs4.safetensors"),
            ("l4", a4, 4, 500, bs4_long, "estimator-bs4long.safetensors"),
            ("u4", a4, 4, 0, bs4, "estimator-bs4.safetensors"),
            ("s8", a8, 8, 80, any_, "estimator.safetensors"),
            ("l8", a8, 8, 500, any_, "estimator.safetensors")):
        got = planner.apply(rid, _records(a, 0, 40), prompt_tokens)
        assert got.estimator == name and np.array_equal(got.evict, alone[(want, bs)]), rid
    first = BlockRecord(0, 0, 3, a4["key_mean"][0], a4["value_norm"][0], a4["attention"][0])
    assert planner.apply("one", [first], 80).estimator == "estimator.safetensors"


def test_the_default_model_routes_block_sizes_1_and_16_to_their_own_networks():
    """models/default ships three networks (docs/design/estimator.md, "The shipped
    networks"): estimator-bs1 (reads reach and the
    previous block, made for block size 1), estimator-bs16 (traced at block size 16
    only) and the primary for every other block size."""
    import json

    from kvpop.runtime.paths import DEFAULT_MODEL_DIR
    from services.cache_manager.planner import Planner

    planner = Planner("")
    mc = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    shape = (mc["num_hidden_layers"], mc["num_key_value_heads"], mc["head_dim"])
    by_name = {sc.label: sc.model.cfg for sc in planner.scorers}
    assert set(by_name) == {"estimator.safetensors", "estimator-bs1.safetensors", "estimator-bs16.safetensors"}
    bs1 = by_name["estimator-bs1.safetensors"]
    assert bs1.block_sizes == [1] and bs1.prev_block and bs1.reach and bs1.cross_rows
    assert by_name["estimator-bs16.safetensors"].block_sizes == [16]
    assert not by_name["estimator.safetensors"].block_sizes
    rng = np.random.default_rng(0)
    for bs, want in ((1, "estimator-bs1.safetensors"), (16, "estimator-bs16.safetensors"),
                     (4, "estimator.safetensors")):
        recs = [BlockRecord(b, b * bs, 8, rng.standard_normal(shape, dtype=np.float32),
                            np.ones(shape[:2], np.float32), np.ones(shape[:2], np.float32)) for b in range(64)]
        got = planner.apply(f"bs{bs}", recs, 64 * bs)
        assert got.ranker == "network" and got.estimator == want, bs


def _cross_synthetic(n_seq, rng):
    """Traces whose true future mass of a block, in every row, is set by its key in
    the last row only: the other rows' own features are noise for their targets."""
    out = []
    for _ in range(n_seq):
        n = int(rng.integers(16, 40))
        a = _arrays(n, seed=int(rng.integers(1 << 30)))
        t = np.exp(3 * a["key_mean"][:, L - 1, H - 1, 0]).astype(np.float32)          # [n]
        tgt = np.broadcast_to(t, (L, H, n)).copy()
        out.append({**a, "times": np.array([n * 4 + 200]), "known": np.array([n]), "targets": [tgt / t.sum()]})
    return out


def test_cross_rows_let_a_row_use_what_only_another_row_shows():
    """With cross_rows each block's embedding also sees its features in every
    row: it learns a ranking carried by another row's key, which a row-local
    network cannot; added to a trained network it starts as that network, and
    the incremental scorer stays exact."""
    from kvpop.training.train_estimator import evaluate, train

    rng = np.random.default_rng(1)
    tr, va = _cross_synthetic(48, rng), _cross_synthetic(8, rng)
    mass = {}
    for cross in (False, True):
        torch.manual_seed(0)
        net = ValueEstimator(EstimatorConfig(L, H, D, d_model=16, cross_rows=cross))
        train(net, tr, va, minutes=1.0, lr=3e-3, seed=0, eval_every_s=1e9, progress=False, max_steps=250)
        mass[cross] = evaluate(net, va)["mass_at_k"]["learned"]["mean"]
    assert mass[True] > mass[False] + 0.1, mass

    from kvpop.training.train_estimator import with_parts

    plain = _net(2)
    grown = with_parts(plain, cross_rows=True).eval()
    a = _arrays(30, seed=3)
    layer, head = row_ids(L, H)
    with torch.no_grad():
        assert torch.equal(plain(*rows_from_arrays(a), layer, head), grown(*rows_from_arrays(a), layer, head))
        torch.nn.init.normal_(grown.cross_out.weight, std=0.3)
        full = grown(*rows_from_arrays(a), layer, head)                  # [R, n]
    seq = ScoringState().get("x")
    for r in _records(a, 0, 30):
        seq.add(r)
    live = LearnedScorer(grown).score(seq)                              # [n, L, H]
    assert np.allclose(live, full.view(L, H, 30).permute(2, 0, 1).numpy(), atol=1e-4)
    with pytest.raises(ValueError, match="all 4 rows"):
        grown.embed(torch.zeros(3, 5, D), torch.zeros(3, 5, N_SCALARS), torch.zeros(3, dtype=torch.long),
                    torch.zeros(3, dtype=torch.long))


def test_a_checkpoint_with_a_research_part_is_refused(tmp_path):
    """key_diff and reach_skip are research variants (research/README.md): a
    checkpoint that sets one is refused with the reason, never loaded without it."""
    from safetensors.torch import save_file

    net = _net(4)
    for part in ("key_diff", "reach_skip"):
        meta = json.loads(net.cfg.to_json()) | {part: True}
        path = tmp_path / f"{part}.safetensors"
        save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path),
                  metadata={"kvpop_estimator": json.dumps(meta)})
        with pytest.raises(ValueError, match=f"{part} is a research variant"):
            load(path)
    # Off, as the shipped configs write it: loads as the network it is.
    path = tmp_path / "off.safetensors"
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path),
              metadata={"kvpop_estimator": json.dumps(json.loads(net.cfg.to_json()) | {"key_diff": False})})
    a = _arrays(12, seed=6)
    layer, head = row_ids(L, H)
    with torch.no_grad():
        assert torch.equal(load(path)(*rows_from_arrays(a), layer, head), net.eval()(*rows_from_arrays(a), layer, head))


def test_reach_input_starts_as_the_network_it_grows_and_is_read_served_as_in_training(tmp_path):
    """--reach added to a trained (cross-row) network scores as that network
    until its weight moves; then a block's reach changes its score, the live
    scorer over BlockRecords (what the cache-manager holds) equals a full pass
    over the same arrays, and a checkpoint round-trips. Records without reach
    (an older compute) read as zeros, as the arrays without it do."""
    from kvpop.training.train_estimator import with_reach

    plain = _net(5, cross_rows=True)
    grown = with_reach(plain).eval()
    assert grown.cfg.reach and not plain.cfg.reach
    a = _arrays(30, seed=7)
    a["reach"] = np.random.default_rng(8).random((30, L, H)).astype(np.float32)
    layer, head = row_ids(L, H)
    with torch.no_grad():
        assert torch.equal(plain(*rows_from_arrays(a), layer, head), grown(*rows_from_arrays(a), layer, head))
        grown.scalar_in[0].weight[:, -1].normal_(std=2.0)
        grown.cross_in.weight[:, -1].normal_(std=2.0)
        full = grown(*rows_from_arrays(a), layer, head)
        flat = dict(a, reach=np.zeros_like(a["reach"]))
        assert not torch.allclose(full, grown(*rows_from_arrays(flat), layer, head), atol=1e-3)
    seq = ScoringState().get("r")
    for i in range(30):
        r = _records(a, i, i + 1)[0]
        r.reach = a["reach"][i]
        seq.add(r)
    got = LearnedScorer(grown).score(seq)
    assert np.allclose(got, full.view(L, H, 30).permute(2, 0, 1).numpy(), atol=1e-4)
    old = ScoringState().get("old")
    for r in _records(a, 0, 30):
        old.add(r)                                   # no reach: zeros
    with torch.no_grad():
        want = grown(*rows_from_arrays(flat), layer, head).view(L, H, 30).permute(2, 0, 1).numpy()
    assert np.allclose(LearnedScorer(grown).score(old), want, atol=1e-4)
    back = load(save(grown, tmp_path / "reach.safetensors"))
    assert back.cfg.reach
    with torch.no_grad():
        assert torch.equal(back(*rows_from_arrays(a), layer, head), full)


def test_prev_block_input_starts_as_the_network_it_grows_and_scores_exactly_incrementally(tmp_path):
    """--prev-block added to a trained cross-row network scores as that network
    until its weight moves; then a block's score depends on the block before it
    (and on no later one), and the incremental scorer, live (with rows evicting)
    or not, matches a full pass over every known block after each burst."""
    from kvpop.training.train_estimator import with_parts

    plain = _net(6, cross_rows=True)
    grown = with_parts(plain, prev_block=True).eval()
    assert grown.cfg.prev_block and not plain.cfg.prev_block
    a = _arrays(40, seed=9)
    layer, head = row_ids(L, H)
    with torch.no_grad():
        assert torch.equal(plain(*rows_from_arrays(a), layer, head), grown(*rows_from_arrays(a), layer, head))
        grown.prev_out.weight.normal_(std=1.0)
        full = grown(*rows_from_arrays(a), layer, head)
        assert not torch.allclose(plain(*rows_from_arrays(a), layer, head), full, atol=1e-3)
        # Changing block 10's features moves block 11's embedding (it is block 11's predecessor) ...
        b = {k: v.copy() for k, v in a.items()}
        b["key_mean"][10] += 3.0
        km_a, sc_a, _ = rows_from_arrays(a)
        km_b, sc_b, _ = rows_from_arrays(b)
        ea, eb = grown.embed(km_a, sc_a, layer, head), grown.embed(km_b, sc_b, layer, head)
        assert not torch.allclose(ea[:, 11], eb[:, 11], atol=1e-4)
        # ... and no other block's but its own: the input looks one block back, never ahead.
        others = [i for i in range(40) if i not in (10, 11)]
        assert torch.allclose(ea[:, others], eb[:, others], atol=1e-6)
        # With context=1 the first block only feeds the next one's input.
        assert torch.allclose(grown.embed(km_a[:, 9:], sc_a[:, 9:], layer, head, context=1), ea[:, 10:], atol=1e-6)
    with pytest.raises(ValueError, match="cross_rows"):
        with_parts(_net(6), prev_block=True)
    grown.cfg.rescore_every = 1
    rng = np.random.default_rng(10)
    for live in (True, False):
        scorer, seq, known = LearnedScorer(grown, live=live), ScoringState().get(f"p{live}"), 0
        for burst in (9, 1, 1, 5, 1, 12, 2, 1, 8):
            for r in _records(a, known, known + burst):
                seq.add(r)
            known += burst
            if live:          # rows evict as served: what a row holds must stay exact
                names = np.full((L, H, 2), -1, np.int32)
                held = ~seq.arrays()["gone"]
                for li in range(L):
                    for hi in range(H):
                        cand = seq.arrays()["block"][held[:, li, hi]]
                        pick = rng.choice(cand, size=min(len(cand) - 1, 2), replace=False)
                        names[li, hi, :len(pick)] = pick
                seq.mark_gone(names)
            got = scorer.score(seq)
            with torch.no_grad():
                want = grown(*rows_from_arrays(seq.arrays()), layer, head).view(L, H, known).permute(2, 0, 1)
            held = ~seq.arrays()["gone"] if live else np.ones(got.shape, bool)
            assert np.abs(got - want.numpy())[held].max() < 1e-4, (live, known)
    back = load(save(grown, tmp_path / "prev.safetensors"))
    assert back.cfg.prev_block
    with torch.no_grad():
        assert torch.equal(back(*rows_from_arrays(a), layer, head), full)


def test_needed_blocks_are_the_blocks_of_the_answers_depends():
    from kvpop.training.train_estimator import needed_blocks

    ex = {"depends": np.array([3, 17, 18]), "block_size": 16}
    assert needed_blocks(ex, np.array([0, 1, 2])).tolist() == [True, True, False]
    assert not needed_blocks({"block_size": 16}, np.array([0, 1])).any()


@pytest.mark.parametrize("kw", [{}, {"cross_rows": True, "reach": True, "prev_block": True}])
def test_sequences_scored_together_score_as_each_alone(kw):
    """score_many (one network call for every sequence due in a round) gives each
    sequence bit for bit the scores it gets scored alone, whichever sequences
    share its calls: served plans must not depend on what else was due."""
    net = _net(**kw)
    net.cfg.rescore_every = 4
    together, alone = LearnedScorer(net), LearnedScorer(net)
    names = ["a", "b", "c"]
    arrays = {rid: _arrays(70, seed=i) for i, rid in enumerate(names)}
    for rid in names:
        arrays[rid]["reach"] = np.random.default_rng(9).random((70, L, H)).astype(np.float32)
    states = {side: {rid: ScoringState().get(rid) for rid in names} for side in ("together", "alone")}
    known, rng = dict.fromkeys(names, 0), np.random.default_rng(5)
    for step in range(12):
        # A round's due sequences change from round to round, and so do their bursts.
        due = [rid for rid in names if rng.random() < 0.7] or ["a"]
        for rid in due:
            burst = int(rng.choice([1, 3, 8, 20]))
            a, lo = arrays[rid], known[rid]
            recs = [BlockRecord(int(a["block"][i]), int(a["position"][i]), int(a["age"][i]), a["key_mean"][i],
                                a["value_norm"][i], a["attention"][i], a["reach"][i]) for i in range(lo, min(70, lo + burst))]
            known[rid] = min(70, lo + burst)
            gone = np.full((L, H, 2), -1, np.int32)
            if lo > 4:
                gone[..., 0] = rng.integers(1, lo, size=(L, H))
            for side in states:
                for r in recs:
                    states[side][rid].add(r)
                states[side][rid].mark_gone(gone)
        got = together.score_many([states["together"][rid] for rid in due])
        for rid, g in zip(due, got):
            np.testing.assert_array_equal(g, alone.score(states["alone"][rid]))
