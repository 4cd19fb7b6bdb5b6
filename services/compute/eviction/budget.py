"""A request's eviction parameters and what they resolve to: the budget in
blocks per (layer, kv-head), the protected sink and recent window, the
learned policy's plan slack. Everything is checked here, with one clear
message per problem, before a sequence exists."""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvpop.runtime.config import MAX_PREFILL_ALLOWANCE
from services.compute.eviction.policies import LEARNED, POLICY_NAMES
from services.compute.engine.sequence import EvictionState


@dataclass(frozen=True)
class EvictionParams:
    policy: str = "dense"
    budget: int | float | None = None  # tokens (int) or fraction of prompt + max_tokens (float)
    sink: int = 4
    # 8, as the eval runs every policy: at 93.75% of a ~1k-token prompt a 32-token window would take half
    # the budget and leave the ranking half as much to choose (docs/guides/policies-and-budgets.md).
    recent: int = 8
    block_size: int | None = None      # None: the engine's block size
    after_prompt: bool = False         # hold the budget from the end of the prompt on (prefill in full)
    prefill_allowance: float = 1.0     # during prefill hold up to this multiple of the budget


def min_budget_blocks(sink_blocks: int, recent: int, block_size: int) -> int:
    """Smallest budget a round can always meet: every protected block
    (sink, the blocks overlapping the recent window, the newest block) plus
    the one block a decode step may add."""
    return sink_blocks + max(math.ceil(recent / block_size), 1) + 1


def resolve_eviction(p: EvictionParams, *, block_size: int, prompt_len: int, max_tokens: int,
                     plan_slack_blocks: int = 2, cleanup_floor: float = 0.5,
                     round_slack: int = 0) -> EvictionState:
    """round_slack: blocks a budgeted row may run over its budget between
    rounds (the engine's: one page less one block)."""
    if p.policy not in POLICY_NAMES:
        raise ValueError(f"unknown policy {p.policy!r}; choose one of {', '.join(POLICY_NAMES)}")
    if p.block_size is not None and p.block_size != block_size:
        raise ValueError(f"block_size {p.block_size} is not supported by this engine; "
                         f"its KV pool uses block_size {block_size}")
    if p.sink < 0 or p.recent < 0:
        raise ValueError(f"sink ({p.sink}) and recent ({p.recent}) must be >= 0")
    if not (math.isfinite(p.prefill_allowance) and 1.0 <= p.prefill_allowance <= MAX_PREFILL_ALLOWANCE):
        raise ValueError(f"prefill_allowance must be in [1, {MAX_PREFILL_ALLOWANCE:g}] (a multiple of the budget), "
                         f"got {p.prefill_allowance!r}")
    if p.after_prompt and p.prefill_allowance > 1.0:
        raise ValueError("prefill_allowance and evict_after_prompt exclude each other: evict_after_prompt already "
                         "holds the whole prompt during prefill")
    sink_blocks = math.ceil(p.sink / block_size)
    minimum = min_budget_blocks(sink_blocks, p.recent, block_size)
    if p.policy == "dense":
        return EvictionState("dense", None, minimum, sink_blocks, p.recent)
    if p.budget is None:
        raise ValueError(f"policy {p.policy!r} needs a budget (tokens, or a fraction in (0, 1])")
    if isinstance(p.budget, bool) or not isinstance(p.budget, (int, float)):
        raise ValueError(f"budget must be an int (tokens) or a float fraction, got {p.budget!r}")
    if isinstance(p.budget, float):
        if not 0.0 < p.budget <= 1.0:
            raise ValueError(f"fractional budget must be in (0, 1], got {p.budget}")
        # A fraction of a short request may be smaller than the protected
        # blocks; it is a relative request, so it is raised to the minimum.
        blocks = max(minimum, int(p.budget * (prompt_len + max_tokens)) // block_size)
    else:
        blocks = p.budget // block_size
        if blocks < minimum:
            raise ValueError(
                f"budget {p.budget} tokens is too small: with block_size {block_size}, sink {p.sink} "
                f"and recent {p.recent} it must be at least {minimum * block_size} tokens "
                f"(sink + recent + 1 block, in whole blocks)")
    floor = max(minimum, math.ceil(blocks * cleanup_floor))
    slack = plan_slack_blocks if p.policy == LEARNED else 0
    # A round evicts at most an eighth of the budget at once: a small budget's rows
    # (30 tokens at 93.75% of a short prompt) would otherwise turn over by half between
    # rounds, and lost answers there (arithmetic, 2 of 32 on held-out seeds).
    round_slack = min(round_slack, blocks // 8)
    # What holds while the prompt goes in: after_prompt is the whole prompt, an allowance
    # a multiple of the budget (past the prompt, the prompt); neither above the budget: the budget.
    whole_prompt = math.ceil(prompt_len / block_size) + 1
    prefill = whole_prompt if p.after_prompt else min(math.ceil(blocks * p.prefill_allowance), whole_prompt)
    return EvictionState(p.policy, blocks, floor, sink_blocks, p.recent, slack, round_slack, p.after_prompt,
                         prefill if prefill > blocks else None)
