"""The advisor protocol: what compute tells whoever ranks blocks for
``learned`` sequences (features of blocks leaving the recent window), what it
gets back (eviction plans), and where each evicted block's ranking came from.

The engine runs one protocol for every advisor: the remote cache-manager
(advisor_client.AdvisorClient) and the in-process one the evaluation uses
(kvpop.evaluation.local_advisor.LocalAdvisor) are driven the same way.
Plans are taken at the top of a step; a sequence whose round needs a plan it
does not have yet is held (it alone), up to ``plan_wait_s``.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

# Where the ranking behind an evicted block came from (metric label `source`).
NETWORK = "network"                       # a plan ranked by the cache-manager's value-estimation network
ADVISOR_HEURISTIC = "advisor_heuristic"   # a plan the cache-manager ranked by attention per age (no estimator fits)
LOCAL = "local"                           # a heuristic policy's own ranking (not `learned`)
FALLBACK = "fallback"                     # compute's local fallback ranking for a `learned` sequence

# Why a `learned` sequence's blocks were evicted by the fallback (metric label `reason`).
NO_PLAN = "no_plan"                 # no fresh plan within plan_wait_s
ADVISOR_DOWN = "advisor_down"       # no advisor, or its stream is not connected
MALFORMED_PLAN = "malformed_plan"   # the plan could not be decoded
SHAPE_MISMATCH = "shape_mismatch"   # the plan's (layers, kv-heads) are not the model's
CLEANUP = "cleanup"                 # pool pressure shrank the budget: the pages were needed at once
UNRANKED = "unranked"               # the plan named fewer evictable blocks than the round needed
FALLBACK_REASONS = (NO_PLAN, ADVISOR_DOWN, MALFORMED_PLAN, SHAPE_MISMATCH, CLEANUP, UNRANKED)


@dataclass
class BlockFeatures:
    request_id: str
    block: int                    # logical block number
    position: int                 # first token position of the block
    key_mean: torch.Tensor        # [L, Hkv, d]
    value_norm: torch.Tensor      # [L, Hkv]
    attention: torch.Tensor       # [L, Hkv] accumulated attention received so far
    age: int                      # tokens since the block's first position
    prompt_tokens: int = 0        # the sequence's prompt length: picks the network trained for it
    reach: torch.Tensor | None = None   # [L, Hkv] peak mass of its queries outside their recent window (None: zeros)


@dataclass
class EvictionPlan:
    request_id: str
    evict: torch.Tensor | None    # [L, Hkv, k] logical block numbers, most evictable first (-1 = pad)
    covers: int = 0               # one past the highest block the advisor knew when it ranked
    ranker: str = "network"       # "network" | "heuristic"
    estimator: str = ""           # which network ranked it (checkpoint file name)
    error: str = ""               # a fallback reason (MALFORMED_PLAN) when the plan is unusable

    @property
    def source(self) -> str:
        return NETWORK if self.ranker == "network" else ADVISOR_HEURISTIC

    @functools.cached_property
    def width(self) -> int:
        """One past the highest block it names (0: none); a plan is used for many rounds."""
        return 0 if self.evict is None or not self.evict.numel() else int(self.evict.max()) + 1

    def rank_table(self, device) -> torch.Tensor:
        """[L * Hkv, width + 1]: each block number's first place in its row's
        plan as -k .. -1, +inf where unnamed (the last column: blocks past the
        highest name). Built once per plan: a plan serves the rounds of a
        whole plan interval, and rebuilding it per round from every name was
        most of a batched round's cost."""
        table = getattr(self, "_table", None)
        if table is None or table.device != torch.device(device):
            L, H, k = self.evict.shape
            names = self.evict.reshape(L * H, k).long().to(device)
            table = torch.full((L * H, self.width + 1), torch.inf, device=device)
            named = names >= 0
            place = (torch.arange(k, device=device) - k).float().expand(L * H, k)
            table.scatter_reduce_(1, torch.where(named, names, self.width),
                                  torch.where(named, place, torch.inf), "amin")
            self._table = table
        return table


class PlanMailbox:
    """The newest plan per request, put by whoever ranks (any thread) and taken
    by the engine at a step boundary, all at once. Both advisors use it."""

    def __init__(self):
        self._lock = threading.Lock()
        self._plans: dict[str, EvictionPlan] = {}

    def put(self, plan: EvictionPlan) -> bool:
        """Store the plan; True when it replaced one the engine never took."""
        with self._lock:
            replaced = plan.request_id in self._plans
            self._plans[plan.request_id] = plan
        return replaced

    def take(self) -> dict[str, EvictionPlan]:
        with self._lock:
            plans, self._plans = self._plans, {}
        return plans

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._plans.pop(request_id, None)


class EvictionAdvisor(Protocol):
    connected: bool               # False: no plan can come now (the engine falls back at once)
    epoch: int                    # bumped when the advisor lost its state (reconnect): features are re-sent
    on_plan: Callable[[], None] | None   # set by the engine's loop: called (any thread) when a plan arrives
    reads_reach: bool             # its networks read BlockFeatures.reach (False: compute need not measure it)

    def submit(self, features: list[BlockFeatures], gone: torch.Tensor | None = None) -> None:
        """Features of one sequence's blocks; ``gone`` [L, Hkv, k]: blocks its rows
        evicted since its last submit (-1 pads), for plans to rank last."""
    def take_plans(self) -> dict[str, EvictionPlan]: ...
    def release(self, request_id: str) -> None: ...
