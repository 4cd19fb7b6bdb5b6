"""Per-sequence scoring state: every block of a sequence the cache-manager has
seen features for, stacked so a policy scores all of them in one array op.

State lives as long as the sequence (dropped on SequenceFinished or when the
compute stream that sent it ends), so scores can depend on the whole history
(delayed, stateful scoring)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class BlockRecord:
    block: int
    position: int
    age: int
    key_mean: np.ndarray    # [L, Hkv, d]
    value_norm: np.ndarray  # [L, Hkv]
    attention: np.ndarray   # [L, Hkv]


@dataclass
class SequenceState:
    request_id: str
    _records: dict[int, BlockRecord] = field(default_factory=dict)

    def add(self, rec: BlockRecord) -> None:
        if self._records:
            first = next(iter(self._records.values()))
            if rec.attention.shape != first.attention.shape or rec.key_mean.shape != first.key_mean.shape:
                raise ValueError(f"block {rec.block}: shapes differ from earlier blocks of {self.request_id}")
        # A block sent again (re-scored later) replaces its earlier features.
        self._records[rec.block] = rec

    def __len__(self) -> int:
        return len(self._records)

    def arrays(self) -> dict[str, np.ndarray]:
        recs = sorted(self._records.values(), key=lambda r: r.block)
        return {
            "block": np.array([r.block for r in recs], dtype=np.int32),
            "position": np.array([r.position for r in recs], dtype=np.int64),
            "age": np.array([r.age for r in recs], dtype=np.float32),
            "key_mean": np.stack([r.key_mean for r in recs]),      # [n, L, Hkv, d]
            "value_norm": np.stack([r.value_norm for r in recs]),  # [n, L, Hkv]
            "attention": np.stack([r.attention for r in recs]),    # [n, L, Hkv]
        }


class ScoringState:
    def __init__(self) -> None:
        self.sequences: dict[str, SequenceState] = {}

    def get(self, request_id: str) -> SequenceState:
        seq = self.sequences.get(request_id)
        if seq is None:
            seq = self.sequences[request_id] = SequenceState(request_id)
        return seq

    def drop(self, request_id: str) -> None:
        self.sequences.pop(request_id, None)
