"""Local eviction policies: one small class per scoring rule (kvpress style).

``score(seq) -> Tensor[L, Hkv, NB]``, higher = keep. Sink, recent and newest
block protection is applied in one place (eviction.py), so policies differ
only in how they rank the evictable blocks. They are also the fallback of the
``learned`` policy when the cache-manager's plans are late or absent.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from services.compute.engine.sequence import Sequence


class Policy:
    name = "base"
    evicts = True
    uses_keys = False    # needs per-block key summaries (computed when a block fills)

    def score(self, seq: Sequence) -> torch.Tensor:
        raise NotImplementedError


class DensePolicy(Policy):
    name, evicts = "dense", False

    def score(self, seq):
        return torch.zeros_like(seq.acc_mass)


class StreamingPolicy(Policy):
    """StreamingLLM: sink + recent window only, so the oldest block goes first."""
    name = "streaming"

    def score(self, seq):
        return seq.block_index.to(seq.acc_mass.dtype)


class H2OPolicy(Policy):
    """Heavy hitters: attention accumulated over every query so far."""
    name = "h2o"

    def score(self, seq):
        return seq.acc_mass.clone()


class TOVAPolicy(Policy):
    """The latest query's attention only."""
    name = "tova"

    def score(self, seq):
        return seq.last_mass.clone()


class SnapKVPolicy(Policy):
    """Attention from the last W queries (prompt tail at prefill, latest decoded
    tokens later), average-pooled over neighbouring blocks so that a block next
    to an important one is kept too; re-scored at every round."""
    name = "snapkv"
    kernel = 5   # SnapKV's (and kvpress's) pooling

    def score(self, seq):
        s = seq.win_mass.sum(-1)                       # [L, Hkv, NB]
        L, H, NB = s.shape
        if NB == 0 or self.kernel <= 1:
            return s
        pooled = F.avg_pool1d(s.reshape(L * H, 1, NB), self.kernel, stride=1,
                              padding=self.kernel // 2)   # zero padding, as SnapKV
        return pooled.reshape(L, H, NB)


class KNormPolicy(Policy):
    """Keys with a low L2 norm attract attention: keep the lowest norms.
    Block level: the norm of the block's mean key."""
    name, uses_keys = "knorm", True

    def score(self, seq):
        return -torch.linalg.vector_norm(seq.key_mean, dim=-1)


class KeyDiffPolicy(Policy):
    """Keep the most distinctive keys: low cosine similarity to the row's mean key."""
    name, uses_keys = "keydiff", True

    def score(self, seq):
        anchor = seq.key_mean.mean(2, keepdim=True)
        return -F.cosine_similarity(seq.key_mean, anchor.expand_as(seq.key_mean), dim=-1)


class RandomPolicy(Policy):
    """Uniform random, reproducible per sequence (seeded by request id and round)."""
    name = "random"

    def score(self, seq):
        g = torch.Generator().manual_seed(_stable_hash(seq.request_id) + seq.eviction_rounds)
        return torch.rand(seq.acc_mass.shape, generator=g).to(seq.acc_mass.device)


def _stable_hash(text: str) -> int:
    # Python's hash() is salted per process; eviction must be reproducible across runs.
    h = 1469598103934665603
    for b in text.encode():
        h = ((h ^ b) * 1099511628211) % (1 << 61)
    return h


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (
    DensePolicy, StreamingPolicy, H2OPolicy, TOVAPolicy, SnapKVPolicy,
    KNormPolicy, KeyDiffPolicy, RandomPolicy)}
# "learned" is not a scoring rule: plans come from the cache-manager (eviction.py).
LEARNED = "learned"
POLICY_NAMES = tuple(POLICIES) + (LEARNED,)


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
