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

    # Tables start at min(max_position_embeddings, this): a 128k-context model
    # would otherwise hold ~130 MB of tables it rarely touches.
    INITIAL_POSITIONS = 16384

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int):
        self.head_dim = head_dim
        self.inv_freq = inv_frequencies(head_dim, theta, scaling)
        self.reserved = min(max_positions, self.INITIAL_POSITIONS)
        self._tables: dict[tuple, tuple[Tensor, Tensor]] = {}

    def reserve(self, positions: int) -> None:
        """Make positions [0, positions) valid without a check per step; engines
        on an accelerator call this with their max_model_len."""
        self.reserved = max(self.reserved, positions)

    def tables(self, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos [N, d] and sign-folded sin [N, d] (first half negated) so that
        rotate_half(x) * sin == x.roll(d/2) * sin_signed: one op fewer per call.
        Values equal transformers' (fp32 angles, then cast to the model dtype)."""
        key = (device, dtype)
        cached = self._tables.get(key)
        if cached is not None and cached[0].shape[0] >= self.reserved:
            return cached
        pos = torch.arange(self.reserved, dtype=torch.float32, device="cpu")
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : self.head_dim // 2].neg_()
        cached = (emb.cos().to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype))
        self._tables[key] = cached
        return cached

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Per-position cos/sin [*positions.shape, d]. On CPU the tables grow
        on demand (checking is free); elsewhere that would cost a device sync
        per step, so positions must stay below reserve()."""
        if positions.device.type == "cpu" and positions.numel():
            top = int(positions.max()) + 1
            if top > self.reserved:
                self.reserve(max(top, 2 * self.reserved))
        cos, sin = self.tables(positions.device, dtype)
        return cos[positions], sin[positions]


def apply_rotary(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x [..., H, d]; cos/sin [..., 1, d] broadcast over heads."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed
