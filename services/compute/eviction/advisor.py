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
class FeatureBatch:
    """Features of ``k`` blocks of one sequence, one row-aligned tensor per
    field (block order): what compute hands an advisor. An object per block
    was a few tensor views, numpy copies and a protobuf message per token on
    the step path at block size 1. Iterating gives BlockFeatures, for an
    advisor that takes blocks one by one."""
    request_id: str
    block: torch.Tensor           # [k] int64 logical block numbers
    position: torch.Tensor        # [k] first token position
    age: torch.Tensor             # [k] tokens since the block's first position
    key_mean: torch.Tensor        # [k, L, Hkv, d]
    value_norm: torch.Tensor      # [k, L, Hkv]
    attention: torch.Tensor       # [k, L, Hkv]
    reach: torch.Tensor           # [k, L, Hkv]
    prompt_tokens: int = 0

    FIELDS = ("block", "position", "age", "key_mean", "value_norm", "attention", "reach")

    def __len__(self) -> int:
        return len(self.block)

    def __iter__(self):
        for j, b in enumerate(self.block.tolist()):
            yield BlockFeatures(self.request_id, b, int(self.position[j]), self.key_mean[j], self.value_norm[j],
                                self.attention[j], int(self.age[j]), self.prompt_tokens, self.reach[j])

    def part(self, lo: int, hi: int) -> "FeatureBatch":
        return FeatureBatch(self.request_id, *(getattr(self, f)[lo:hi] for f in self.FIELDS), self.prompt_tokens)

    @staticmethod
    def cat(batches: list["FeatureBatch"]) -> "FeatureBatch":
        """One sequence's batches, in order, as one."""
        if len(batches) == 1:
            return batches[0]
        b = batches[0]
        return FeatureBatch(b.request_id, *(torch.cat([getattr(x, f) for x in batches]) for f in FeatureBatch.FIELDS),
                            b.prompt_tokens)

    @staticmethod
    def pack(features) -> list["FeatureBatch"]:
        """A FeatureBatch, or BlockFeatures of any sequences -> one batch per sequence."""
        if isinstance(features, FeatureBatch):
            return [features] if len(features) else []
        by_request: dict[str, list[BlockFeatures]] = {}
        for f in features:
            by_request.setdefault(f.request_id, []).append(f)
        out = []
        for rid, fs in by_request.items():
            f0 = fs[0]
            out.append(FeatureBatch(
                rid, torch.tensor([f.block for f in fs]), torch.tensor([f.position for f in fs]),
                torch.tensor([f.age for f in fs]), torch.stack([f.key_mean.float() for f in fs]),
                torch.stack([f.value_norm.float() for f in fs]), torch.stack([f.attention.float() for f in fs]),
                torch.stack([(torch.zeros_like(f.attention) if f.reach is None else f.reach).float() for f in fs]),
                f0.prompt_tokens))
        return out


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

    def submit(self, features: FeatureBatch | list[BlockFeatures], gone: torch.Tensor | None = None) -> None:
        """Features of one sequence's blocks (compute sends a FeatureBatch); ``gone``
        [L, Hkv, k]: blocks its rows evicted since its last submit (-1 pads), for
        plans to rank last."""
    def take_plans(self) -> dict[str, EvictionPlan]: ...
    def release(self, request_id: str) -> None: ...
