"""The kernel interface compute calls: CUDA kernels (CuPy) for tensors on a
CUDA device when CuPy imports, the PyTorch references otherwise.

`KVPOP_KERNELS=reference` forces the references everywhere (debugging, and the
benchmark's reference baseline)."""
from __future__ import annotations

import functools
import os

import torch

from kvkernels import reference


@functools.cache
def _cuda_module():
    """kvkernels.cuda if CuPy imports and sees a device, else None (cached)."""
    try:
        from kvkernels import cuda
    except ImportError:
        return None
    return cuda if cuda.available() else None


def cuda_available() -> bool:
    return torch.cuda.is_available() and _cuda_module() is not None


def backend_for(tensor: torch.Tensor) -> str:
    """'cuda' if the ops will run the CuPy kernels for this tensor, else 'reference'."""
    if os.environ.get("KVPOP_KERNELS", "").lower() == "reference":
        return "reference"
    if tensor.is_cuda and _cuda_module() is not None:
        return "cuda"
    return "reference"


def _impl(tensor: torch.Tensor):
    return _cuda_module() if backend_for(tensor) == "cuda" else reference


def paged_attention(q, k_pages, v_pages, page_table, num_blocks, last_block_len, scale):
    return _impl(q).paged_attention(q, k_pages, v_pages, page_table, num_blocks,
                                    last_block_len, scale)


def kv_append(k_pages, v_pages, k_new, v_new, page, offset):
    return _impl(k_pages).kv_append(k_pages, v_pages, k_new, v_new, page, offset)


def eviction_select(scores, evictable, num_evict: int):
    return _impl(scores).eviction_select(scores, evictable, int(num_evict))


def block_features(k_pages, v_pages, pages):
    return _impl(k_pages).block_features(k_pages, v_pages, pages)


def move_blocks(k_blocks, v_blocks, src, dst):
    """Compaction: block ``src[i]`` to ``dst[i]`` (all read before any is written)."""
    impl = _impl(k_blocks)
    return getattr(impl, "move_blocks", reference.move_blocks)(k_blocks, v_blocks, src, dst)
