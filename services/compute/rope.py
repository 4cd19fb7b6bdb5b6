"""Rotary position embedding in the Hugging Face (rotate-half) convention, with
cos/sin tables computed once per (device, dtype) and indexed by position."""
from __future__ import annotations

import math

import torch
from torch import Tensor


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    """float32 [head_dim // 2], bit-identical to transformers' rope init."""
    # Explicit cpu: the loader builds the model under torch.device("meta").
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope type {rope_type!r}")


class RotaryEmbedding:
    """Not an nn.Module: the tables are derived data, never saved or loaded,
    and must stay float32-exact whatever dtype the model is cast to."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int):
        self.head_dim = head_dim
        self.inv_freq = inv_frequencies(head_dim, theta, scaling)
        self.max_positions = max_positions
        self._tables: dict[tuple, tuple[Tensor, Tensor]] = {}

    def tables(self, device: torch.device, dtype: torch.dtype, needed: int) -> tuple[Tensor, Tensor]:
        """cos [N, d] and sign-folded sin [N, d] (first half negated) so that
        rotate_half(x) * sin == x.roll(d/2) * sin_signed: one op fewer per call."""
        key = (device, dtype)
        cached = self._tables.get(key)
        if cached is not None and cached[0].shape[0] >= needed:
            return cached
        n = max(needed, self.max_positions, 2 * (cached[0].shape[0] if cached else 0))
        pos = torch.arange(n, dtype=torch.float32, device="cpu")
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = self.head_dim // 2
        sin = emb.sin()
        sin[:, :half].neg_()
        cached = (emb.cos().to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype))
        self._tables[key] = cached
        return cached

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Per-position cos/sin [*positions.shape, d]. `needed` is taken from
        max_positions unless positions run past it, so no host sync per step."""
        cos, sin = self.tables(positions.device, dtype, self.max_positions)
        if positions.numel() and positions.device.type == "cpu" and int(positions.max()) >= cos.shape[0]:
            cos, sin = self.tables(positions.device, dtype, int(positions.max()) + 1)
        return cos[positions], sin[positions]


def apply_rotary(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x [..., H, d]; cos/sin [..., 1, d] broadcast over heads."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
