"""CUDA-Graph capture of a fixed-shape step (the decode step), with an eager fallback.

A decode step launches hundreds of small kernels (per layer: norms, GEMMs,
RoPE, kv_append, paged attention...); at small batch their launch overhead,
not memory bandwidth, bounds tokens/s. Capturing the step once per shape
bucket and replaying it removes that overhead.

Contract for the captured callable `fn(*inputs) -> outputs`: it reads only
its tensor inputs and tensors that stay at the same address (weights, the KV
pool), does no host sync and no host-side branching on tensor values, and
has the same shapes for a given bucket key. The runner copies each call's
inputs into static buffers, replays, and returns the static outputs, which
the next call for that key overwrites (copy them out if you keep them).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Hashable

import torch

log = logging.getLogger(__name__)


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """Smallest bucket size >= n (callers pad to it); n itself past the largest."""
    for s in sorted(sizes):
        if s >= n:
            return s
    return n


def pow2_buckets(limit: int, start: int = 1) -> tuple[int, ...]:
    out, s = [], start
    while s < limit:
        out.append(s)
        s *= 2
    return tuple(out) + (limit,)


class _Captured:
    def __init__(self, graph, inputs, outputs):
        self.graph, self.inputs, self.outputs = graph, inputs, outputs


class GraphRunner:
    """Replays `fn` from a CUDA Graph per bucket key; eager where it cannot."""

    def __init__(self, fn: Callable[..., Any], enabled: bool = True, warmup: int = 2):
        self.fn = fn
        self.enabled = enabled
        self.warmup = warmup
        self.graphs: dict[Hashable, _Captured] = {}
        self.failed: dict[Hashable, str] = {}   # key -> why it runs eager
        self._pool = None

    def __call__(self, key: Hashable, *inputs: torch.Tensor):
        if not self._can_capture(inputs) or key in self.failed:
            return self.fn(*inputs)
        cap = self.graphs.get(key)
        if cap is None:
            try:
                cap = self._capture(inputs)
            except Exception as e:  # capture-illegal op, OOM...: remember and stay eager
                self.failed[key] = f"{type(e).__name__}: {e}"
                log.warning("CUDA graph capture failed for %r, running eager: %s", key, e)
                torch.cuda.synchronize()
                return self.fn(*inputs)
            self.graphs[key] = cap
        for static, x in zip(cap.inputs, inputs):
            if static.shape != x.shape:
                raise ValueError(f"bucket {key!r} was captured with shape {tuple(static.shape)}, "
                                 f"got {tuple(x.shape)}")
            static.copy_(x, non_blocking=True)
        cap.graph.replay()
        return cap.outputs

    def _can_capture(self, inputs) -> bool:
        return (self.enabled and torch.cuda.is_available()
                and all(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs))

    def _capture(self, inputs) -> _Captured:
        static = [x.clone() for x in inputs]
        # Warm up on a side stream (lazy inits, kernel compiles, cuBLAS
        # workspaces) so that none of it lands inside the capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            outputs = self.fn(*static)
        return _Captured(graph, static, outputs)

    def reset(self) -> None:
        self.graphs.clear()
        self.failed.clear()
