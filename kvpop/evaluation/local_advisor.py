"""An in-process EvictionAdvisor running the cache-manager's own Planner
(same scoring state, network and plans as the service), for evaluation and
tests: deterministic, no gRPC, no timing. A tool: it joins compute's advisor
protocol to the cache-manager's planner, which the services never do.

Each ``submit`` is folded at once; ``take_plans`` (the engine's next step
boundary) plans every sequence submitted since, in one network call as the
service plans the messages waiting in a round, and hands the plans over,
exactly as the remote client does when the cache-manager keeps up: the engine
drives both through one protocol (a sequence needing a plan is held until
the next step boundary, where this one always has it).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from services.cache_manager.planner import Planner
from services.compute.eviction.advisor import EvictionPlan, FeatureBatch, PlanMailbox


class LocalAdvisor:
    connected = True   # in process: never down
    epoch = 0          # never loses its state
    on_plan = None

    def __init__(self, checkpoint: str | Path | None = "", max_plan_blocks: int = 8192, model=None):
        self.planner = Planner(checkpoint, max_plan_blocks, model=model)
        self._lock = threading.Lock()      # guards the planner
        self._plans = PlanMailbox()
        self._due: dict[str, None] = {}    # submitted since the last take_plans, in order
        self.plans_sent = 0
        self.score_seconds = 0.0

    @property
    def reads_reach(self) -> bool:
        return "reach" in self.planner.reads

    @property
    def policy_name(self) -> str:
        return self.planner.policy_name

    def reload(self) -> str:
        with self._lock:
            return self.planner.reload()

    def submit(self, features, gone=None) -> None:
        """features: compute's FeatureBatch (or BlockFeatures) of one sequence;
        gone: [L, Hkv, k] blocks its rows evicted since its last submit."""
        with self._lock:
            for batch in FeatureBatch.pack(features):
                t0 = time.perf_counter()
                self.planner.add_arrays(batch.request_id, {f: getattr(batch, f).numpy() for f in FeatureBatch.FIELDS},
                                        None if gone is None else gone.numpy(), batch.prompt_tokens)
                self.score_seconds += time.perf_counter() - t0
                self._due[batch.request_id] = None

    def take_plans(self) -> dict[str, EvictionPlan]:
        with self._lock:
            due, self._due = list(self._due), {}
            if due:
                t0 = time.perf_counter()
                for rid, plan in zip(due, self.planner.plan_many(due)):
                    self._plans.put(EvictionPlan(rid, torch.from_numpy(plan.evict.astype("int32")),
                                                 plan.covers, plan.ranker, plan.estimator))
                self.score_seconds += time.perf_counter() - t0
                self.plans_sent += len(due)
        return self._plans.take()

    def release(self, request_id: str) -> None:
        self._plans.drop(request_id)
        with self._lock:
            self._due.pop(request_id, None)
            self.planner.drop(request_id)
