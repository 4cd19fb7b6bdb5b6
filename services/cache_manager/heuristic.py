"""The policy the cache-manager runs until the learned network exists:
accumulated attention (what h2o ranks by), normalised by how long the block has been
attendable (older blocks had more queries to collect mass from), so a block
is judged by the attention it gets per step rather than by its age."""
from __future__ import annotations

import numpy as np

from services.cache_manager.scoring_state import SequenceState


class AttentionPerAge:
    name = "attention_per_age"   # not h2o: h2o ranks by attention so far (compute's policy)

    def score(self, seq: SequenceState) -> np.ndarray:
        """[n, L, Hkv] importance of each known block; low = evict first."""
        a = seq.arrays()
        return a["attention"] / (a["age"][:, None, None] + 1.0)


def plan(seq: SequenceState, scores: np.ndarray, max_blocks: int) -> np.ndarray:
    """[L, Hkv, k] block numbers per row, most evictable (lowest score) first."""
    blocks = seq.arrays()["block"]
    # Stable sort over arrival order (= block order): ties go to the older block, as in h2o.
    order = np.argsort(scores, axis=0, kind="stable")[:max_blocks]   # [k, L, Hkv]
    return np.ascontiguousarray(blocks[order].transpose(1, 2, 0))
