"""Teacher forcing through the serving engine: wraps the engine's model runner
so that chosen sequences record their next-token log-distribution and are fed
the reference solution instead of their own sample. Forward pass, paging and
eviction stay the engine's own."""
from __future__ import annotations

import torch


class ForcingRunner:
    def __init__(self, runner):
        self.inner = runner
        self.forced: dict[str, list[int]] = {}       # request id -> tokens to feed
        self.logprobs: dict[str, list[torch.Tensor]] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, batch):
        logits, sampled = self.inner.run(batch)
        for row, seq in enumerate(sampled):
            tokens = self.forced.get(seq.request_id)
            if tokens is None:
                continue
            i = len(seq.output_ids)
            self.logprobs.setdefault(seq.request_id, []).append(torch.log_softmax(logits[row].float(), -1).cpu())
            forced = torch.full_like(logits[row], float("-inf"))
            forced[tokens[min(i, len(tokens) - 1)]] = 0.0
            logits[row] = forced                     # greedy now picks the reference token
        return logits, sampled
