"""The engine's side of the eviction protocol (docs/design/architecture.md, "The eviction
protocol"): after each step, budgeted sequences' eviction rounds; for
`learned` ones also the features sent to the advisor, the plans taken from
it, the bounded wait for a plan and the local fallback when none comes.
One object per engine; the step calls take_plans() before scheduling and
after_step() + flush() after the forward pass."""
from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from services.compute.eviction.advisor import ADVISOR_DOWN, FALLBACK, NO_PLAN, EvictionAdvisor, FeatureBatch
from services.compute.eviction.block_features import (blocks_leaving, leaving_features, resident_block_features,
                                             update_features)
from services.compute.eviction.evict import Round, evict_rounds, overshoot, plan_problem, usable_plan
from services.compute.engine.kv_pool import KVPool
from services.compute.eviction.policies import LEARNED
from services.compute.engine.scheduler import Scheduler
from services.compute.engine.sequence import Sequence

log = logging.getLogger(__name__)


def posted_upto(seq: Sequence) -> int:
    """One past the highest block submitted to the advisor (``sent_upto`` less
    the batches still waiting for a round)."""
    return int(seq.unsent[0].block[0]) if seq.unsent else seq.sent_upto


class EvictionRounds:
    def __init__(self, config, advisor: EvictionAdvisor | None, scheduler: Scheduler, pool: KVPool,
                 seqs: dict[str, Sequence], counters: Counter):
        """config: the engine's (plan_interval, plan_wait_s, pipeline_decode_plans);
        seqs and counters are the engine's own, shared."""
        self.config, self.advisor = config, advisor
        self.scheduler, self.pool, self.seqs, self.counters = scheduler, pool, seqs, counters
        self._advisor_failed = False
        self._due: list = []          # rounds of this step, run together

    def advise(self, call, *args):
        """Call an advisor method; a failing advisor is like an absent one (the
        fallback policy keeps memory bounded), never a failed request."""
        try:
            out = call(*args)
            self._advisor_failed = False
            return out
        except Exception:
            self.counters["advisor_errors"] += 1
            self._advisor_failed = True     # no plan will come from it: do not wait for one
            log.exception("eviction advisor %s failed", getattr(call, "__name__", call))
            return None

    def advisor_up(self) -> bool:
        return (self.advisor is not None and not self._advisor_failed
                and getattr(self.advisor, "connected", True))

    def take_plans(self) -> None:
        """Top of a step: hand out the advisor's plans, re-send features to an
        advisor that lost them, and run the learned rounds that can run now
        (or must: their wait ran out), before anything is scheduled."""
        learned = [s for s in self.scheduler.running if s.eviction.policy == LEARNED
                   and s.eviction.budget_blocks is not None and s.num_blocks]
        if self.advisor is not None:
            for rid, plan in (self.advise(self.advisor.take_plans) or {}).items():
                seq = self.seqs.get(rid)
                if seq is None or seq.eviction.policy != LEARNED:
                    self.counters["plans_dropped/finished"] += 1     # its request ended before the plan came
                    continue
                if seq.pending_plan is not None and not seq.plan_counted:
                    self.counters["plans_late/superseded"] += 1      # a newer plan came before it was used
                seq.pending_plan, seq.plan_counted = plan, False
                problem = plan_problem(seq)
                if problem:
                    self.counters[f"plans_dropped/{problem}"] += 1
                    seq.plan_counted = True
                elif plan.covers < posted_upto(seq):
                    # Ranks fewer blocks than were sent since: a round needs a newer one.
                    self.counters["plans_late/stale"] += 1
                    seq.plan_counted = True
            if self.advisor_up():
                for seq in learned:
                    self._sync(seq)
        now = time.monotonic()
        for seq in learned:
            if seq.holding or overshoot(seq) > 0:
                self._learned_round(seq, now)
        self.flush()

    def _sync(self, seq: Sequence) -> None:
        """An advisor that restarted (or a session turn under a new request id)
        knows none of the sequence's blocks: send the resident ones again."""
        epoch = getattr(self.advisor, "epoch", 0)
        if seq.advisor_epoch == epoch:
            return
        seq.advisor_epoch = epoch
        seq.unsent = []     # among the resident ones sent now
        feats = resident_block_features(seq)
        if feats:
            seq.submitted_at[seq.sent_upto] = self.counters["steps"]
            self.advise(self.advisor.submit, feats, self._take_gone(seq))
            self.counters["features_resent"] += len(feats)

    @staticmethod
    def _take_gone(seq: Sequence):
        """Blocks the rows evicted since the last submit, [L, Hkv, k] (-1 pads), or None."""
        gone, seq.gone = seq.gone, []
        if not gone:
            return None
        return torch.cat(gone, -1)

    def plan_wait(self, seq: Sequence) -> float:
        """How long a sequence is held for its plan: plan_wait_s per prefill
        chunk's worth of blocks its round must rank. The planner's work grows
        with them, and the round at the end of an evict_after_prompt prompt
        ranks the whole prompt at once, not one chunk."""
        chunk_blocks = max(1, self.config.prefill_chunk // max(1, self.config.block_size))
        return self.config.plan_wait_s * max(1.0, overshoot(seq) / chunk_blocks)

    def next_plan_deadline(self) -> float | None:
        """Seconds until the earliest held sequence's plan wait runs out."""
        held = [s.plan_wait_since + self.plan_wait(s) for s in self.scheduler.running if s.holding]
        if not held:
            return None
        return max(0.0, min(held) - time.monotonic())

    def after_step(self, seqs: list[Sequence]) -> None:
        """Budgeted sequences after a step, all at once: block summaries, the
        features that left the recent window (one copy to the host for all),
        then each one's round (queued; flush runs them together)."""
        update_features([s for s in seqs if s.eviction.policy == LEARNED or s.policy.uses_keys], self.pool)
        learned = []
        for seq in seqs:
            if seq.eviction.policy == LEARNED:
                learned.append(seq)
            elif overshoot(seq) > 0:
                self._queue(seq, None, "")
        if not learned:
            return
        if self.advisor_up():
            for seq in learned:
                self._sync(seq)
            leaving = [(seq, blocks_leaving(seq, self._plan_every(seq))) for seq in learned]
            for (seq, _), feats in zip(leaving, leaving_features(leaving)):
                if feats is not None:
                    seq.unsent.append(feats)
                # With a round slack only a round needs a plan: batches wait for it (their
                # features as taken now) and go together, planned once. A sequence whose
                # wait ran out sends each batch at once until a plan is in time again.
                if seq.unsent and (not seq.eviction.round_slack or overshoot(seq) > 0 or seq.plan_gave_up):
                    self._post(seq)
        else:
            for seq in learned:
                blocks_leaving(seq)   # advances sent_upto: re-sent in full when the advisor is back
                seq.unsent = []
        now = time.monotonic()
        for seq in learned:
            self._learned_round(seq, now)

    def _post(self, seq: Sequence) -> None:
        """Submit the sequence's features not yet sent (a plan answers them)."""
        if len(seq.submitted_at) > 256:   # plans stopped coming: keep the bookkeeping bounded
            seq.submitted_at.clear()
        seq.submitted_at[seq.sent_upto] = self.counters["steps"]
        feats, seq.unsent = FeatureBatch.cat(seq.unsent), []
        self.advise(self.advisor.submit, feats, self._take_gone(seq))

    def _plan_every(self, seq: Sequence) -> int:
        """Blocks per features batch: the plan interval's, or 1 (send now) when
        the plan in hand is about to run out of blocks it may evict (a small
        budget: rounds would otherwise evict blocks no plan ranked)."""
        every = max(1, -(-self.config.plan_interval // seq.block_size))
        if every > 1 and seq.eviction.budget_blocks is not None:
            # Blocks past sent_upto are in every row (no plan names them), so every
            # row holds the same number of sent blocks; sink blocks never go.
            total, sink = -(-seq.num_cached // seq.block_size), seq.eviction.sink_blocks
            named = seq.num_blocks - (total - max(seq.sent_upto, sink)) - sink
            if named < 2:
                return 1
        return every

    def _learned_round(self, seq: Sequence, now: float) -> None:
        """A learned sequence over its budget evicts on a fresh plan; without
        one it is held (alone) until the plan comes or ``plan_wait_s`` passes,
        then the fallback ranks (with ``pipeline_decode_plans`` a decoding
        sequence first keeps going within its slack)."""
        over = overshoot(seq)
        plan = usable_plan(seq)
        if over <= 0:
            # Lockstep: every submitted features batch is planned before the sequence
            # runs on, as in process, so the network sees the same batches served or not.
            if (plan is None and not self.config.pipeline_decode_plans and self.advisor_up() and not seq.plan_gave_up
                    and posted_upto(seq) > max(seq.eviction.sink_blocks, getattr(seq.pending_plan, "covers", 0))
                    and not plan_problem(seq)):
                if seq.plan_wait_since is None:
                    seq.plan_wait_since = now
                elif now - seq.plan_wait_since >= self.config.plan_wait_s:
                    seq.plan_wait_since = None      # nothing to evict: just run on
                    self.counters["plan_waits_expired"] += 1
                return
            seq.plan_wait_since = None
            return
        if plan is not None:
            seq.plan_gave_up = False
            if not seq.plan_counted:
                self.counters["plans_applied"] += 1
                seq.plan_counted = True
            self._queue(seq, plan, "")
            return
        reason = plan_problem(seq) or ("" if self.advisor_up() else ADVISOR_DOWN)
        if not reason and seq.plan_gave_up:
            if seq.pending_plan is not None:
                # Behind, not stuck: the plan in hand ranks every block it covers (the newer
                # ones are kept, or counted unranked if the round needs them).
                self._queue(seq, seq.pending_plan, "")
                return
            reason = NO_PLAN    # a live but stuck advisor stalls a sequence once, not every round
        if not reason:
            if seq.unsent:
                self._post(seq)              # the round needs a plan: the waiting batches go now
            if (self.config.pipeline_decode_plans and over <= seq.eviction.round_slack + seq.eviction.slack_blocks
                    and not seq.in_prefill):
                return                       # pipelined: the plan has a few decode steps to come
            if seq.plan_wait_since is None:
                seq.plan_wait_since = now    # held from the next schedule on
                return
            if now - seq.plan_wait_since < self.plan_wait(seq):
                return
            reason, seq.plan_gave_up = NO_PLAN, True
        self._queue(seq, None, reason)

    def _queue(self, seq: Sequence, plan, reason: str) -> None:
        """Queue the sequence's round; flush() runs all of them at once."""
        self._due.append((seq, plan, reason))

    def flush(self) -> None:
        due, self._due = self._due, []
        if not due:
            return
        before = [Counter(seq.evictions) for seq, _, _ in due]
        evict_rounds([Round(seq, overshoot(seq), plan, reason) for seq, plan, reason in due], self.pool)
        step = self.counters["steps"]
        for (seq, plan, reason), was in zip(due, before):
            waited = seq.plan_wait_since
            seq.plan_wait_since = None
            delta = seq.evictions - was
            if not delta:
                continue
            event = {"blocks": sum(delta.values()), "step": step,
                     "sources": ",".join(f"{src}:{why}" if why else src for src, why in sorted(delta))}
            if plan is not None:
                at = seq.submitted_at.get(plan.covers)
                event["plan_age_steps"] = -1 if at is None else step - at
                for k in [k for k in seq.submitted_at if k < plan.covers]:
                    del seq.submitted_at[k]
            if waited is not None:
                event["held_ms"] = round(1000 * (time.monotonic() - waited), 2)
            if len(seq.rounds) < 256:
                seq.rounds.append(event)
            fell_back = sum(n for (src, _), n in delta.items() if src == FALLBACK)
            if fell_back and not seq.fallback_warned:
                seq.fallback_warned = True
                why = sorted({r for (src, r) in delta if src == FALLBACK})
                log.warning("request %s (learned): %d blocks evicted by the local fallback (%s); "
                            "warned once per request", seq.request_id, fell_back, ",".join(why))
