"""Reference kernel ops against naive, loop-per-head dense implementations."""
from __future__ import annotations

import math
import shutil

import pytest
import torch

from kvkernels import ops, reference


def make_case(B, Hq, Hkv, d, bs, NB, dtype, seed, garbage=0.0):
    """Random pool + ragged page tables; unused slots and tails hold `garbage`."""
    g = torch.Generator().manual_seed(seed)
    P = 1 + B * Hkv * NB
    k_pages = torch.randn(P, bs, d, generator=g).to(dtype)
    v_pages = torch.randn(P, bs, d, generator=g).to(dtype)
    q = torch.randn(B, Hq, d, generator=g).to(dtype)
    num_blocks = torch.randint(1, NB + 1, (B,), generator=g, dtype=torch.int32)
    last_len = torch.randint(1, bs + 1, (B,), generator=g, dtype=torch.int32)
    # Distinct pages per (b, h, slot), shuffled so that the table really indirects.
    perm = (torch.randperm(P - 1, generator=g) + 1)[: B * Hkv * NB]
    page_table = perm.view(B, Hkv, NB).to(torch.int32)
    for b in range(B):
        n, last = int(num_blocks[b]), int(last_len[b])
        page_table[b, :, n:] = 0
        tail = page_table[b, :, n - 1].long()
        k_pages[tail, last:] = garbage
        v_pages[tail, last:] = garbage
    k_pages[0] = garbage
    v_pages[0] = garbage
    return q, k_pages, v_pages, page_table, num_blocks, last_len


def naive_attention(q, k_pages, v_pages, page_table, num_blocks, last_len, scale):
    """Per (sequence, query head): gather its tokens in order, dense softmax in fp64."""
    B, Hq, d = q.shape
    Hkv, NB = page_table.shape[1:]
    bs = k_pages.shape[1]
    out = torch.zeros(B, Hq, d, dtype=torch.float64)
    mass = torch.zeros(B, Hq, NB, dtype=torch.float64)
    for b in range(B):
        n, last = int(num_blocks[b]), int(last_len[b])
        for h in range(Hq):
            kv = h // (Hq // Hkv)
            ks, vs, owner = [], [], []
            for j in range(n):
                page = int(page_table[b, kv, j])
                length = last if j == n - 1 else bs
                ks.append(k_pages[page, :length].double())
                vs.append(v_pages[page, :length].double())
                owner += [j] * length
            K, V = torch.cat(ks), torch.cat(vs)
            p = torch.softmax(K @ q[b, h].double() * scale, dim=0)
            out[b, h] = p @ V
            mass[b, h].index_add_(0, torch.tensor(owner), p)
    return out, mass


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                        (torch.float16, 2e-3)])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_paged_attention_matches_dense(dtype, atol, group):
    for seed in range(3):
        Hkv = 2
        case = make_case(B=4, Hq=Hkv * group, Hkv=Hkv, d=32, bs=4, NB=6, dtype=dtype, seed=seed)
        scale = 1 / math.sqrt(32)
        out, mass = reference.paged_attention(*case, scale)
        want_out, want_mass = naive_attention(*case, scale)
        assert out.dtype == dtype and mass.dtype == torch.float32
        torch.testing.assert_close(out.double(), want_out, atol=atol, rtol=atol)
        # The mass is accumulated in fp32 from the (widened) inputs: tight even for bf16.
        torch.testing.assert_close(mass.double(), want_mass, atol=1e-5, rtol=1e-4)


def test_block_mass_is_a_distribution_with_zero_padding():
    q, kp, vp, pt, nb, last = make_case(B=5, Hq=8, Hkv=2, d=16, bs=8, NB=7,
                                        dtype=torch.float32, seed=7)
    _, mass = reference.paged_attention(q, kp, vp, pt, nb, last, 0.3)
    torch.testing.assert_close(mass.sum(-1), torch.ones(5, 8))
    for b in range(5):
        assert torch.all(mass[b, :, int(nb[b]):] == 0)
        assert torch.all(mass[b, :, : int(nb[b])] > 0)


def test_garbage_in_padding_and_tails_is_never_read():
    clean = make_case(B=3, Hq=4, Hkv=1, d=16, bs=4, NB=5, dtype=torch.float32, seed=3)
    dirty = make_case(B=3, Hq=4, Hkv=1, d=16, bs=4, NB=5, dtype=torch.float32, seed=3,
                      garbage=float("nan"))
    out_c, mass_c = reference.paged_attention(*clean, 0.25)
    out_d, mass_d = reference.paged_attention(*dirty, 0.25)
    assert torch.isfinite(out_d).all() and torch.isfinite(mass_d).all()
    torch.testing.assert_close(out_d, out_c)
    torch.testing.assert_close(mass_d, mass_c)


def test_sequence_with_no_resident_tokens_gives_zeros():
    q, kp, vp, pt, nb, last = make_case(B=2, Hq=4, Hkv=2, d=8, bs=4, NB=3,
                                        dtype=torch.float32, seed=1)
    nb[1] = 0
    out, mass = reference.paged_attention(q, kp, vp, pt, nb, last, 1.0)
    assert torch.all(out[1] == 0) and torch.all(mass[1] == 0)
    assert torch.isfinite(out).all()


def test_kv_append_writes_exactly_the_named_slots():
    g = torch.Generator().manual_seed(0)
    kp, vp = torch.randn(10, 4, 8, generator=g), torch.randn(10, 4, 8, generator=g)
    k0, v0 = kp.clone(), vp.clone()
    page = torch.tensor([3, 3, 7, 1])
    offset = torch.tensor([0, 3, 2, 1])
    kn, vn = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    reference.kv_append(kp, vp, kn, vn, page, offset)
    for i in range(4):
        assert torch.equal(kp[page[i], offset[i]], kn[i])
        assert torch.equal(vp[page[i], offset[i]], vn[i])
        k0[page[i], offset[i]] = kn[i]
        v0[page[i], offset[i]] = vn[i]
    assert torch.equal(kp, k0) and torch.equal(vp, v0)


def test_kv_append_casts_to_pool_dtype():
    kp = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    vp = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    kn = torch.randn(2, 8)
    reference.kv_append(kp, vp, kn, -kn, torch.tensor([1, 2]), torch.tensor([1, 0]))
    assert torch.equal(kp[1, 1], kn[0].bfloat16()) and torch.equal(vp[2, 0], (-kn[1]).bfloat16())


def naive_select(scores, evictable, k):
    rows = []
    for s, e in zip(scores.tolist(), evictable.tolist()):
        cands = sorted((sc, c) for c, (sc, ok) in enumerate(zip(s, e)) if ok)
        rows.append([c for _, c in cands[:k]])
    return torch.tensor(rows, dtype=torch.long).view(len(rows), k)


def test_eviction_select_matches_sort_with_ties():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        R, NB = 12, 1 + trial * 3
        # Small integer scores force many ties: the older (lower) column must win.
        scores = torch.randint(0, 4, (R, NB), generator=g).float()
        evictable = torch.rand(R, NB, generator=g) < 0.7
        k = int(evictable.sum(1).min())
        got = reference.eviction_select(scores, evictable, k)
        assert got.dtype == torch.long and got.shape == (R, k)
        assert torch.equal(got, naive_select(scores, evictable, k))


def test_eviction_select_keeps_infinite_scores_evictable():
    scores = torch.tensor([[float("inf"), 0.0, float("nan"), -1.0]])
    evictable = torch.tensor([[True, False, True, False]])
    got = reference.eviction_select(scores, evictable, 2)
    assert got.tolist() == [[0, 2]]


def test_eviction_select_rejects_impossible_requests():
    scores = torch.zeros(2, 4)
    evictable = torch.tensor([[True, True, True, False], [True, False, False, False]])
    with pytest.raises(ValueError, match="row 1"):
        reference.eviction_select(scores, evictable, 2)
    with pytest.raises(ValueError):
        reference.eviction_select(scores, evictable, 5)
    with pytest.raises(ValueError):
        reference.eviction_select(scores, evictable[:, :3], 1)
    assert reference.eviction_select(scores, evictable, 0).shape == (2, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_features_match_loop(dtype):
    g = torch.Generator().manual_seed(0)
    kp = torch.randn(9, 16, 32, generator=g).to(dtype)
    vp = torch.randn(9, 16, 32, generator=g).to(dtype)
    pages = torch.tensor([4, 1, 8, 4])
    key_mean, value_norm = reference.block_features(kp, vp, pages)
    assert key_mean.dtype == torch.float32 and value_norm.dtype == torch.float32
    for i, p in enumerate(pages.tolist()):
        torch.testing.assert_close(key_mean[i], kp[p].float().mean(0))
        want = sum(vp[p, t].float().norm() for t in range(16)) / 16
        torch.testing.assert_close(value_norm[i], want)


def test_ops_dispatch_to_reference_on_cpu(monkeypatch):
    case = make_case(B=2, Hq=4, Hkv=2, d=8, bs=4, NB=3, dtype=torch.float32, seed=0)
    assert ops.backend_for(case[0]) == "reference"
    out, mass = ops.paged_attention(*case, 0.5)
    want_out, want_mass = reference.paged_attention(*case, 0.5)
    assert torch.equal(out, want_out) and torch.equal(mass, want_mass)
    monkeypatch.setenv("KVPOP_KERNELS", "reference")
    assert ops.backend_for(case[0]) == "reference"


def test_cuda_module_imports_without_cupy_and_plans_consistent_launches():
    from kvkernels import cuda
    for NB in (1, 5, 64, 300, 4097):
        for B, Hkv in ((1, 1), (1, 8), (16, 8), (64, 8)):
            S, chunk = cuda.splits(B, Hkv, NB, 4, 132)
            # every block in exactly one split, no empty trailing split
            assert S * chunk >= NB and (S - 1) * chunk < NB and S >= 1
    cfg = cuda.attention_config(128, 16, 4, torch.bfloat16, (0, 256))
    assert cfg["VEC"] == 8 and cfg["DPL"] == 4 and cfg["GP"] == 4
    cfg = cuda.attention_config(80, 16, 3, torch.float16, (0,))
    assert cfg["VEC"] == 0 and cfg["GP"] == 4 and cfg["LOG2GP"] == 2   # guarded scalar loads
    cfg = cuda.attention_config(256, 16, 32, torch.float32, (0,))
    assert (2 * cfg["NW"] * cfg["GP"] + cfg["NW"] * 32 * 256) * 4 <= 48 * 1024
    src = cuda.source("paged_attention", **cfg)
    assert src.startswith("#define DT 0\n") and "paged_attn_partial" in src


def test_bench_dry_run_on_cpu(tmp_path):
    import json

    from kvpop.bench import kernels as bench
    rc = bench.main(["--dry-run", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 0, results["errors"]
    assert {r["backend"] for r in results["attention"]} >= {"reference", "torch_sdpa_contiguous"}
    for key in ("decode", "engine"):
        assert len(results[key]) == 4 and all(r.get("tokens_per_s", 0) > 0 for r in results[key])
    assert all(r["eviction_rounds"] > 0 for r in results["decode"] if r["policy"] == "h2o")


def test_bench_h2o_rounds_keep_page_tables_valid():
    from kvpop.bench import kernels as bench
    args = bench.parse_args(["--dry-run"])
    model = bench.build_model(args, torch.device("cpu"), torch.float32)
    dec = bench.LocalDecoder(model, 2, 40, 30, "h2o", 0.5, 4, use_graphs=False)
    before = dec.page_table.clone()
    for _ in range(30):
        dec.step()
    rows = dec.page_table.view(-1, dec.cap)
    assert dec.rounds == 8
    # Each row still names distinct pages, the same set, and the sink block stayed.
    assert all(len(set(r.tolist())) == dec.cap for r in rows)
    assert torch.equal(rows.sort(1).values, before.view(-1, dec.cap).sort(1).values)
    assert torch.equal(dec.page_table[..., 0], before[..., 0])


# ---- the CUDA sources themselves, run on the CPU through the host emulation
# (kvkernels/emulate.py): the GPU tests in test_cuda.py cover the real
# device; these keep the kernels' logic checked on machines without one.
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ for the host emulation")


@needs_gxx
@pytest.mark.parametrize("dtype,group,d,bs", [(torch.bfloat16, 4, 64, 16), (torch.float16, 8, 32, 4),
                                              (torch.float32, 3, 48, 1)])
def test_cuda_attention_source_under_host_emulation(dtype, group, d, bs):
    from kvkernels import cuda, emulate
    # NaN in every padding slot and block tail; 16 "SMs" make the kernel split each sequence.
    case = make_case(B=3, Hq=2 * group, Hkv=2, d=d, bs=bs, NB=12, dtype=dtype, seed=0,
                     garbage=float("nan"))
    assert cuda.splits(3, 2, 12, 4, 16)[0] > 1
    with emulate.emulated(sm_count=16):
        out, mass = cuda.paged_attention(*case, 0.2)
    want_out, want_mass = reference.paged_attention(*case, 0.2)
    tol = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(mass, want_mass, atol=2e-6, rtol=1e-4)


@needs_gxx
def test_cuda_kv_ops_sources_under_host_emulation():
    from kvkernels import cuda, emulate
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (9, 64), generator=g).float()   # ties
    scores[0, ::3] = float("nan")
    scores[1, ::2] = float("inf")
    evictable = torch.rand(9, 64, generator=g) < 0.6
    evictable[:, 0] = True
    k = int(evictable.sum(1).min())
    kp = torch.randn(12, 8, 96, generator=g).half()
    vp = torch.randn(12, 8, 96, generator=g).half()
    pages = torch.tensor([3, 11, 1, 3])
    pool_k = torch.randn(10, 4, 64, generator=g).bfloat16()
    pool_v = pool_k.clone()
    want_k, want_v = pool_k.clone(), pool_v.clone()
    qkv = torch.randn(5, 3, 64, generator=g).bfloat16()             # strided k/v rows
    page, offset = torch.tensor([1, 9, 4, 4, 2]), torch.tensor([0, 3, 1, 2, 3])
    with emulate.emulated():
        cols = cuda.eviction_select(scores, evictable, k)
        key_mean, value_norm = cuda.block_features(kp, vp, pages)
        cuda.kv_append(pool_k, pool_v, qkv[:, 1], qkv[:, 2], page, offset)
    assert torch.equal(cols, reference.eviction_select(scores, evictable, k))
    want_mean, want_norm = reference.block_features(kp, vp, pages)
    torch.testing.assert_close(key_mean, want_mean)
    torch.testing.assert_close(value_norm, want_norm)
    reference.kv_append(want_k, want_v, qkv[:, 1], qkv[:, 2], page, offset)
    assert torch.equal(pool_k, want_k) and torch.equal(pool_v, want_v)
