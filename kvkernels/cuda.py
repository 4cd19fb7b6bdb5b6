"""CUDA kernels for the kernel ops (docs/design/internals.md), launched with CuPy.

The sources live in `kvkernels/csrc/` and are compiled by NVRTC through
`cupy.RawModule`, one module per compile-time configuration (dtype, head dim,
block size, group size), cached in-process and on disk by CuPy.

Memory is shared with torch without copies: kernels receive the tensors' device
pointers (the same addresses DLPack / `__cuda_array_interface__` would expose,
minus the per-call wrapper objects, which cost more than a decode-step kernel)
and run on torch's current stream, so they order correctly with torch ops and
are recorded by CUDA-Graph capture.

This module imports without CuPy; `available()` says whether it can run.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np
import torch

from kvkernels import reference

_CSRC = Path(__file__).with_name("csrc")
_DT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# Rows longer than this go to torch.sort: the rank kernel is O(NB^2) per row.
EVICTION_SELECT_MAX_NB = 2048
_NW = 4          # warps per attention thread block
_SMEM_LIMIT = 48 * 1024


@functools.cache
def available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, or a CuPy build that cannot see the driver
        return False


def source(kind: str, **defines) -> str:
    """Full NVRTC source of one module: #defines, then common.cuh, then <kind>.cu."""
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    return head + (_CSRC / "common.cuh").read_text() + (_CSRC / f"{kind}.cu").read_text()


@functools.cache
def _function(kind: str, defines: tuple, name: str, device: int):
    import cupy
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=source(kind, **dict(defines)), options=("--std=c++14",))
        return module.get_function(name)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    return _sm_count(_index(device))


@functools.cache
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _stream(device: int):
    ptr = torch.cuda.current_stream(device).cuda_stream
    return _external_stream(ptr, device)


@functools.lru_cache(maxsize=64)
def _external_stream(ptr: int, device: int):
    import cupy
    with cupy.cuda.Device(device):
        return cupy.cuda.ExternalStream(ptr)


def _launch(kind: str, defines: dict, name: str, device: torch.device, grid, block, args,
            shared_mem: int = 0) -> None:
    _launcher(kind, tuple(sorted(defines.items())), name, device, grid, block, args, shared_mem)


def _cupy_launch(kind: str, defines: tuple, name: str, device: torch.device, grid, block, args,
                 shared_mem: int) -> None:
    import cupy
    dev = _index(device)
    fn = _function(kind, defines, name, dev)
    with cupy.cuda.Device(dev), _stream(dev):
        fn(grid, block, args, shared_mem=shared_mem)


# kernels.emulate swaps in a host launcher so CPU-only runs can test the sources.
_launcher = _cupy_launch


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _dtype_code(*tensors: torch.Tensor) -> int:
    dt = tensors[0].dtype
    if dt not in _DT or any(t.dtype != dt for t in tensors):
        raise TypeError(f"CUDA kernels need one of {list(_DT)} for all of "
                        f"{[str(t.dtype) for t in tensors]}")
    return _DT[dt]


def attention_config(D: int, BS: int, G: int, dtype: torch.dtype, ptrs=()) -> dict:
    """Compile-time configuration of the attention module for these shapes."""
    align = 16
    for p in ptrs:
        while p % align:
            align //= 2
    return dict(_attention_config(D, BS, G, dtype, max(align, 1)))


@functools.cache
def _attention_config(D: int, BS: int, G: int, dtype: torch.dtype, align: int) -> tuple:
    if not 1 <= G <= 32:
        raise ValueError(f"GQA group size {G} not in [1, 32]")
    es = dtype.itemsize
    dpl = -(-D // 32)
    gp = 1 << (G - 1).bit_length()
    vec = 0
    if D % 32 == 0:
        for v in (16, 8, 4):
            if (dpl * es) % v == 0 and (D * es) % v == 0 and align % v == 0:
                vec = v
                break
    nw = _NW
    while nw > 1 and (2 * nw * gp + nw * G * D) * 4 > _SMEM_LIMIT:
        nw //= 2
    # A tile's K and V rows live in registers: PT * DPL <= 32 floats each.
    pt = min(BS, max(1, 32 // dpl))
    return tuple(dict(DT=_DT[dtype], D=D, BS=BS, G=G, GP=gp, LOG2GP=gp.bit_length() - 1,
                      NW=nw, PT=pt, DPL=dpl, VEC=vec).items())


def splits(B: int, Hkv: int, NB: int, nw: int, sm_count: int) -> tuple[int, int]:
    """(S, chunk): split each sequence's blocks so the grid fills the GPU about
    twice over, but give every warp of a split at least one block."""
    want = max(1, math.ceil(2 * sm_count / max(1, B * Hkv)))
    s = max(1, min(want, math.ceil(NB / nw)))
    chunk = math.ceil(NB / s)
    return math.ceil(NB / chunk), chunk


def paged_attention(q, k_pages, v_pages, page_table, num_blocks, last_block_len, scale):
    B, Hq, D = q.shape
    P, BS, Dk = k_pages.shape
    _, Hkv, NB = page_table.shape
    if Dk != D or v_pages.shape != k_pages.shape or Hq % Hkv:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, pages {tuple(k_pages.shape)}/"
                         f"{tuple(v_pages.shape)}, page_table {tuple(page_table.shape)}")
    _dtype_code(q, k_pages, v_pages)
    dev = q.device
    q = q.contiguous()
    k_pages, v_pages = k_pages.contiguous(), v_pages.contiguous()
    page_table = page_table.to(device=dev, dtype=torch.int32).contiguous()
    num_blocks = num_blocks.to(device=dev, dtype=torch.int32).contiguous()
    last_block_len = last_block_len.to(device=dev, dtype=torch.int32).contiguous()
    out = torch.empty_like(q)
    block_mass = torch.empty(B, Hq, NB, dtype=torch.float32, device=dev)
    if B == 0 or NB == 0:
        out.zero_()
        return out, block_mass
    cfg = attention_config(D, BS, Hq // Hkv, q.dtype, (q.data_ptr(), k_pages.data_ptr(),
                                                      v_pages.data_ptr()))
    S, chunk = splits(B, Hkv, NB, cfg["NW"], sm_count(dev))
    # One scratch allocation for the split partials and the per-block maxima.
    n1, n2 = B * Hq * S, B * Hq * S * D
    work = torch.empty(2 * n1 + n2 + B * Hq * NB, dtype=torch.float32, device=dev)
    part_m, part_l = work[:n1], work[n1:2 * n1]
    part_acc, blk_max = work[2 * n1:2 * n1 + n2], work[2 * n1 + n2:]
    nw, gp, G = cfg["NW"], cfg["GP"], cfg["G"]
    smem = (2 * nw * gp + nw * G * D) * 4
    _launch("paged_attention", cfg, "paged_attn_partial", dev, (S, Hkv, B), (nw * 32,),
            (_ptr(q), _ptr(k_pages), _ptr(v_pages), _ptr(page_table), _ptr(num_blocks),
             _ptr(last_block_len), np.float32(scale * math.log2(math.e)), np.int32(Hkv),
             np.int32(NB), np.int32(S), np.int32(chunk), _ptr(part_m), _ptr(part_l),
             _ptr(part_acc), _ptr(blk_max), _ptr(block_mass)), shared_mem=smem)
    _launch("paged_attention", cfg, "paged_attn_combine", dev, (Hq, B), (128,),
            (_ptr(part_m), _ptr(part_l), _ptr(part_acc), _ptr(blk_max), _ptr(block_mass),
             _ptr(num_blocks), _ptr(out), np.int32(Hq), np.int32(NB), np.int32(S)))
    return out, block_mass


def kv_append(k_pages, v_pages, k_new, v_new, page, offset):
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        # In-place semantics: a kernel would write a copy; let torch index the views.
        return reference.kv_append(k_pages, v_pages, k_new, v_new, page, offset)
    N, D = k_new.shape
    P, BS, _ = k_pages.shape
    if N == 0:
        return None
    dev = k_pages.device
    k_new = k_new.to(k_pages.dtype)
    v_new = v_new.to(v_pages.dtype)
    if k_new.stride(-1) != 1:
        k_new = k_new.contiguous()
    if v_new.stride(-1) != 1:
        v_new = v_new.contiguous()
    page = page.to(device=dev, dtype=torch.int64).contiguous()
    offset = offset.to(device=dev, dtype=torch.int64).contiguous()
    threads = 256
    grid = min(math.ceil(N * D / threads), 32 * sm_count(dev))
    _launch("kv_ops", {"DT": _dtype_code(k_pages, v_pages, k_new, v_new)}, "kv_append", dev,
            (grid,), (threads,),
            (_ptr(k_pages), _ptr(v_pages), _ptr(k_new), _ptr(v_new), _ptr(page), _ptr(offset),
             np.int64(N), np.int32(D), np.int32(BS), np.int64(P), np.int64(k_new.stride(0)),
             np.int64(v_new.stride(0))))
    return None


def block_features(k_pages, v_pages, pages):
    P, BS, D = k_pages.shape
    dev = k_pages.device
    k_pages, v_pages = k_pages.contiguous(), v_pages.contiguous()
    pages = pages.to(device=dev, dtype=torch.int64).contiguous()
    N = pages.shape[0]
    key_mean = torch.empty(N, D, dtype=torch.float32, device=dev)
    value_norm = torch.empty(N, dtype=torch.float32, device=dev)
    if N == 0:
        return key_mean, value_norm
    _launch("kv_ops", {"DT": _dtype_code(k_pages, v_pages)}, "block_features", dev,
            (math.ceil(N / 4),), (128,),
            (_ptr(k_pages), _ptr(v_pages), _ptr(pages), np.int32(N), np.int32(D), np.int32(BS),
             _ptr(key_mean), _ptr(value_norm)))
    return key_mean, value_norm


def eviction_select(scores, evictable, num_evict: int):
    reference.check_eviction_args(scores, evictable, num_evict)
    R, NB = scores.shape
    if num_evict == 0 or R == 0 or NB > EVICTION_SELECT_MAX_NB:
        return reference.eviction_select(scores, evictable, num_evict)
    dev = scores.device
    scores = scores.to(torch.float32).contiguous()
    evictable = evictable.to(device=dev, dtype=torch.bool).contiguous()
    cols = torch.empty(R, num_evict, dtype=torch.int64, device=dev)
    threads = min(256, 32 * math.ceil(NB / 32))
    _launch("kv_ops", {"DT": 0}, "eviction_select", dev, (R,), (threads,),
            (_ptr(scores), _ptr(evictable), np.int32(NB), np.int32(num_evict), _ptr(cols)),
            shared_mem=NB * 5)
    return cols
