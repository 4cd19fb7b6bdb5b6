"""CUDA kernels (kvkernels/cuda.py) against the PyTorch references.

Needs a CUDA device and CuPy; skipped otherwise. kvkernels/gpu_check.sh runs it
with pytest, or as a plain script (`python tests/unit/kernels/test_cuda.py`)
where pytest is not installed.

Tolerances (outputs vs the reference run on the same GPU):
- out: fp32 1e-4, fp16 2e-3, bf16 1.6e-2 absolute and relative. Both sides
  accumulate in fp32 and round once to the storage dtype, so they differ by
  at most about one ulp of that dtype (bf16: 2^-8 relative).
- block_mass (always fp32): 2e-5 absolute, 1e-3 relative: only the summation
  order differs.
"""
from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from kvkernels import cuda, graphs, ops, reference  # noqa: E402

CUDA_OK = cuda.available()
REASON = "needs a CUDA device and CuPy"
try:
    import pytest
    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA_OK, reason=REASON)]
except ImportError:  # the GPU host may have torch + CuPy only: see __main__ below
    pytest = None

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DEV = "cuda"


def make_case(B, Hq, Hkv, d, bs, NB, dtype, seed, lengths=None):
    """Ragged sequences over a shuffled pool; every unused slot holds NaN, so
    a kernel that reads padding or a block's unwritten tail fails loudly."""
    g = torch.Generator().manual_seed(seed)
    P = 1 + B * Hkv * NB
    k_pages = torch.randn(P, bs, d, generator=g)
    v_pages = torch.randn(P, bs, d, generator=g)
    q = torch.randn(B, Hq, d, generator=g)
    if lengths is None:
        lengths = torch.randint(1, NB * bs + 1, (B,), generator=g).tolist()
    num_blocks = torch.tensor([math.ceil(n / bs) for n in lengths], dtype=torch.int32)
    last_len = torch.tensor([n - (math.ceil(n / bs) - 1) * bs if n else 0 for n in lengths],
                            dtype=torch.int32)
    perm = (torch.randperm(P - 1, generator=g) + 1)[: B * Hkv * NB]
    page_table = perm.view(B, Hkv, NB).to(torch.int32)
    for b in range(B):
        n, last = int(num_blocks[b]), int(last_len[b])
        page_table[b, :, n:] = 0
        if n:
            tail = page_table[b, :, n - 1].long()
            k_pages[tail, last:] = float("nan")
            v_pages[tail, last:] = float("nan")
        unused = perm.view(B, Hkv, NB)[b, :, n:].reshape(-1).long()
        k_pages[unused] = float("nan")
        v_pages[unused] = float("nan")
    k_pages[0] = float("nan")
    v_pages[0] = float("nan")
    return [q.to(DEV, dtype), k_pages.to(DEV, dtype), v_pages.to(DEV, dtype),
            page_table.to(DEV), num_blocks.to(DEV), last_len.to(DEV)]


def check_attention(case, dtype, scale=None):
    d = case[0].shape[-1]
    scale = scale or 1 / math.sqrt(d)
    out, mass = cuda.paged_attention(*case, scale)
    # The reference masks by index too (tests/unit/kernels/test_reference.py
    # checks it ignores NaN padding), so it sees the same NaN-filled pool.
    want_out, want_mass = reference.paged_attention(*case, scale)
    assert out.dtype == dtype and out.shape == want_out.shape
    assert mass.dtype == torch.float32 and mass.shape == want_mass.shape
    assert torch.isfinite(out).all() and torch.isfinite(mass).all()
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(mass, want_mass, atol=2e-5, rtol=1e-3)


def test_paged_attention_random_shapes_gqa_and_dtypes():
    rng = random.Random(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for group in (1, 4, 8):
            for trial in range(2):
                Hkv = rng.choice([1, 2, 4])
                d = rng.choice([64, 128]) if trial == 0 else rng.choice([32, 48, 80, 128])
                bs = rng.choice([1, 4, 16]) if trial else 16
                NB = rng.randint(1, 40 if bs > 1 else 200)
                B = rng.randint(1, 9)
                case = make_case(B, Hkv * group, Hkv, d, bs, NB, dtype, seed=trial)
                check_attention(case, dtype)


def test_paged_attention_long_context_uses_splits():
    # B * Hkv far below the SM count: the kernel splits each sequence's blocks.
    NB = 300
    S, _ = cuda.splits(1, 2, NB, 4, torch.cuda.get_device_properties(0).multi_processor_count)
    assert S > 1
    for dtype in (torch.bfloat16, torch.float16):
        case = make_case(2, 16, 2, 128, 16, NB, dtype, seed=1, lengths=[NB * 16, NB * 16 - 21])
        check_attention(case, dtype)


def test_paged_attention_large_batch_and_odd_group():
    case = make_case(64, 24, 8, 128, 16, 20, torch.bfloat16, seed=2)   # G = 3 (padded to 4)
    check_attention(case, torch.bfloat16)


def test_paged_attention_sharp_softmax_and_empty_sequence():
    case = make_case(3, 8, 2, 64, 8, 12, torch.float32, seed=3, lengths=[96, 0, 5])
    # A large scale makes the softmax nearly one-hot: the online max matters.
    check_attention(case, torch.float32, scale=4.0)
    out, mass = cuda.paged_attention(*case, 4.0)
    assert torch.all(out[1] == 0) and torch.all(mass[1] == 0)


def test_paged_attention_block_mass_sums_to_one():
    case = make_case(5, 32, 8, 128, 16, 30, torch.bfloat16, seed=4)
    _, mass = cuda.paged_attention(*case, 0.1)
    torch.testing.assert_close(mass.sum(-1), torch.ones(5, 32, device=DEV), atol=1e-5, rtol=0)


def test_kv_append_matches_reference_including_strided_rows():
    for dtype in (torch.bfloat16, torch.float32):
        g = torch.Generator().manual_seed(0)
        kp = torch.randn(50, 16, 64, generator=g).to(DEV, dtype)
        vp = torch.randn(50, 16, 64, generator=g).to(DEV, dtype)
        kr, vr = kp.clone(), vp.clone()
        N = 37
        slots = torch.randperm(49 * 16, generator=g)[:N] + 16   # distinct, page >= 1
        page, offset = (slots // 16).to(DEV), (slots % 16).to(DEV, torch.int32)
        qkv = torch.randn(N, 3, 64, generator=g).to(DEV, dtype)   # k/v are strided views
        cuda.kv_append(kp, vp, qkv[:, 1], qkv[:, 2], page, offset)
        reference.kv_append(kr, vr, qkv[:, 1], qkv[:, 2], page, offset)
        assert torch.equal(kp, kr) and torch.equal(vp, vr)


def test_eviction_select_matches_reference():
    g = torch.Generator().manual_seed(0)
    for NB in (1, 7, 64, 300, cuda.EVICTION_SELECT_MAX_NB + 5):
        R = 33
        scores = torch.randint(0, 5, (R, NB), generator=g).float()   # many ties
        scores[0, :: 3] = float("nan")
        scores[1, :: 2] = float("inf")
        evictable = torch.rand(R, NB, generator=g) < 0.6
        evictable[:, 0] = True
        k = int(evictable.sum(1).min())
        got = cuda.eviction_select(scores.to(DEV), evictable.to(DEV), k)
        want = reference.eviction_select(scores, evictable, k)
        assert torch.equal(got.cpu(), want), NB


def test_eviction_select_rejects_impossible_requests():
    scores = torch.zeros(2, 4, device=DEV)
    evictable = torch.tensor([[True] * 4, [True, False, False, False]], device=DEV)
    try:
        cuda.eviction_select(scores, evictable, 2)
    except ValueError:
        return
    raise AssertionError("expected ValueError")


def test_block_features_match_reference():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        g = torch.Generator().manual_seed(0)
        kp = torch.randn(40, 16, 96, generator=g).to(DEV, dtype)
        vp = torch.randn(40, 16, 96, generator=g).to(DEV, dtype)
        pages = torch.tensor([3, 39, 1, 3, 17], device=DEV)
        km, vn = cuda.block_features(kp, vp, pages)
        rkm, rvn = reference.block_features(kp, vp, pages)
        torch.testing.assert_close(km, rkm, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vn, rvn, atol=1e-5, rtol=1e-5)


def test_ops_dispatch_picks_cuda():
    x = torch.zeros(1, device=DEV)
    assert ops.backend_for(x) == "cuda"
    assert ops.backend_for(x.cpu()) == "reference"


def test_graph_replay_matches_eager():
    case = make_case(4, 16, 4, 128, 16, 24, torch.bfloat16, seed=5)
    q, kp, vp, pt, nb, last = case
    kp, vp = torch.nan_to_num(kp), torch.nan_to_num(vp)

    def step(q, k_new, page, offset, pt, nb, last):
        ops.kv_append(kp, vp, k_new, k_new, page, offset)
        return ops.paged_attention(q, kp, vp, pt, nb, last, 0.09)

    runner = graphs.GraphRunner(step)
    page = pt[:, :, 0].reshape(-1).long()
    offset = torch.zeros_like(page)
    for i in range(3):
        qi = torch.randn_like(q)
        k_new = torch.randn(page.shape[0], 128, device=DEV, dtype=torch.bfloat16)
        out, mass = runner((4, 24), qi, k_new, page, offset, pt, nb, last)
        out, mass = out.clone(), mass.clone()
        want_out, want_mass = step(qi, k_new, page, offset, pt, nb, last)
        assert torch.equal(out, want_out) and torch.equal(mass, want_mass), i
    assert (4, 24) in runner.graphs and not runner.failed


if __name__ == "__main__":
    if not CUDA_OK:
        print(f"SKIPPED: {REASON}")
        sys.exit(0)
    failed = 0
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and callable(fn):
            try:
                fn()
                print(f"PASS {name}")
            except Exception as e:  # report every test, then fail the run
                failed += 1
                print(f"FAIL {name}: {type(e).__name__}: {e}")
    sys.exit(1 if failed else 0)
