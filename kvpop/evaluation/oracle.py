"""The `oracle` policy (evaluation only): keeps exactly the blocks holding the
positions the instance's answer depends on; among the rest, the newest. The
engine's shared protection adds the same sink and recent window as every
other policy, so it is the upper bound in every table."""
from __future__ import annotations

import torch

from services.compute.policies import Policy


class OraclePolicy(Policy):
    name = "oracle"

    def __init__(self, depends: list[int], block_size: int):
        self.blocks = sorted({p // block_size for p in depends})

    def score(self, seq):
        bi = seq.block_index
        needed = torch.isin(bi, torch.tensor(self.blocks, dtype=bi.dtype, device=bi.device))
        # Needed blocks first; then recency (an old block is the cheapest to lose).
        return needed.to(torch.float32) * 1e9 + bi.to(torch.float32)
