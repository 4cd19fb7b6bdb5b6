"""An in-process EvictionAdvisor running the cache-manager's own Planner
(same scoring state, network and plans as the service), for evaluation and
tests: deterministic, no gRPC, no timing.

Each ``submit`` is answered at once with the plan the service would send for
that batch; ``take_plans`` (the engine's next step boundary) hands it over,
exactly as the remote client does when the cache-manager keeps up: the engine
drives both through one protocol (a sequence needing a plan is held until
the next step boundary, where this one always has it).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from services.cache_manager.planner import Planner
from services.cache_manager.scoring_state import BlockRecord


@dataclass
class EvictionPlan:
    """compute's EvictionPlan, by shape (services do not import each other)."""
    request_id: str
    evict: torch.Tensor           # [L, Hkv, k] block numbers, most evictable first
    covers: int = 0
    ranker: str = "network"
    error: str = ""

    @property
    def source(self) -> str:
        return "network" if self.ranker == "network" else "advisor_heuristic"


class LocalAdvisor:
    connected = True   # in process: never down
    epoch = 0          # never loses its state
    on_plan = None

    def __init__(self, checkpoint: str | Path | None = "", max_plan_blocks: int = 1024, model=None):
        self.planner = Planner(checkpoint, max_plan_blocks, model=model)
        self._lock = threading.Lock()
        self._plans: dict[str, EvictionPlan] = {}
        self.plans_sent = 0
        self.score_seconds = 0.0

    @property
    def policy_name(self) -> str:
        return self.planner.policy_name

    def reload(self) -> str:
        with self._lock:
            return self.planner.reload()

    def submit(self, features, gone=None) -> None:
        """features: compute's BlockFeatures (torch tensors) of one sequence;
        gone: [L, Hkv, k] blocks its rows evicted since its last submit."""
        by_request: dict[str, list[BlockRecord]] = {}
        for f in features:
            by_request.setdefault(f.request_id, []).append(BlockRecord(
                block=int(f.block), position=int(f.position), age=int(f.age),
                key_mean=f.key_mean.float().numpy(), value_norm=f.value_norm.float().numpy(),
                attention=f.attention.float().numpy()))
        with self._lock:
            for rid, records in by_request.items():
                t0 = time.perf_counter()
                self.planner.add(rid, records, None if gone is None else gone.numpy())
                plan = self.planner.plan(rid)
                self.score_seconds += time.perf_counter() - t0
                self._plans[rid] = EvictionPlan(rid, torch.from_numpy(plan.evict.astype("int32")),
                                                plan.covers, plan.ranker)
                self.plans_sent += 1

    def take_plans(self) -> dict[str, EvictionPlan]:
        with self._lock:
            plans, self._plans = self._plans, {}
        return plans

    def release(self, request_id: str) -> None:
        with self._lock:
            self._plans.pop(request_id, None)
            self.planner.drop(request_id)
