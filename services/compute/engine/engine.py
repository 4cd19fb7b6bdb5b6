"""LLMEngine: the in-process engine (docs/design/internals.md, "Engine API").

One ``step()`` = admit, run one mixed prefill/decode forward, sample, stream
text, then run the eviction rounds of every sequence it touched. Evaluation,
benchmarks and the compute gRPC server (through AsyncEngine) all use it.

At admission a sequence starts from a parked session (``session_id``) or from
the longest cached prefix of its prompt (``prewarm``); at finish a session's
sequence is parked instead of freed (prefix_cache.py, session_cache.py).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Iterator

import torch

from kvpop.runtime.config import PLAN_INTERVAL, PREFILL_CHUNK
from services.compute.model import detokenize
from services.compute.eviction.advisor import FALLBACK, NETWORK, NO_PLAN, EvictionAdvisor
from services.compute.eviction.budget import EvictionParams, resolve_eviction
from services.compute.eviction.evict import drop_outside_window, eviction_round, overshoot, usable_plan
from services.compute.eviction.rounds import EvictionRounds
from services.compute.engine.kv_pool import KVPool
from services.compute.model.runner import ModelRunner
from services.compute.eviction.policies import LEARNED, get_policy
from services.compute.engine.prefix_cache import PrefixCache
from services.compute.model.sampler import SamplingParams, make_generator, sample
from services.compute.engine.scheduler import Scheduler
from services.compute.engine.session_cache import SessionCache
from services.compute.engine.sequence import Sequence

log = logging.getLogger(__name__)

__all__ = ["EngineConfig", "EvictionParams", "LLMEngine", "SamplingParams", "StepOutput", "Usage"]


@dataclass
class EngineConfig:
    model_dir: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 1                   # positions per block: the unit of eviction (1: token level)
    page_size: int = 16                   # positions per page: the unit of memory (a multiple of block_size)
    num_pages: int | None = None          # None: from kv_cache_bytes
    kv_cache_bytes: int = 1 << 30         # used when num_pages is None
    max_num_seqs: int = 64
    max_model_len: int | None = None   # None: the model's own (max_position_embeddings)
    prefill_chunk: int = PREFILL_CHUNK
    cleanup_threshold: float = 0.7
    cleanup_floor: float = 0.5            # budgets shrink to at most this fraction of the request's
    prefill_headroom_chunks: int = 2      # prefill overshoot all budgeted sequences share (scheduler.py)
    # Decode: blocks a learned sequence may run over while its plan comes. Small
    # on purpose: a sequence held for its plan is the back-pressure that keeps
    # compute from outrunning the cache-manager, so under load the network still
    # ranks every eviction (more slack lets the fallback rank the overrun).
    plan_slack_blocks: int = 2
    plan_wait_s: float = 2.0              # most a learned sequence is held for a plan before the fallback
    # Decode: features go to the advisor (and a plan comes back) once this many tokens'
    # blocks have left the recent window; prompt chunk ends always send. A plan per token
    # would make the cache-manager the bottleneck at block size 1 under load; the plan in
    # hand ranks every older block, and the blocks not yet sent are kept until the next one.
    plan_interval: int = PLAN_INTERVAL
    # Decode rounds: False (default) holds the sequence for its plan as prefill does, so
    # served evictions are exactly the in-process ones (deterministic: the eval measures
    # what is served); True lets it decode within its slack while the plan comes.
    pipeline_decode_plans: bool = False
    # Blocks a budgeted row may run over its budget before a round evicts them all
    # (None: one page less one block, so a row stays within one page over its
    # budget's pages; never more than an eighth of the budget: budget.py). Rounds then run once a page's worth of tokens came, not at
    # every step, and a learned sequence's features go with the round that needs a
    # plan: one network call per page, not per plan interval. 0: a round whenever a
    # row is over (every step at block size 1).
    round_slack: int | None = None
    fallback_policy: str = "h2o"          # local ranking for "learned" when no plan can be used
    prefix_cache_fraction: float = 0.1    # most of the pool the prefix cache may hold (0 = off)
    session_ttl_s: float = 600.0          # a parked session idle this long is dropped


def page_tokens(block_size: int, page_size: int) -> int:
    """Positions per page: whole blocks, so ``page_size`` rounds down to a
    multiple of ``block_size`` (at least one block)."""
    return block_size * max(1, page_size // block_size)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    kv_blocks_resident: int
    kv_blocks_evicted: int
    policy: str
    fallback_evictions: int
    session_tokens: int = 0               # context continued from a parked session (0: started fresh)
    network_evictions: int = 0            # learned: blocks evicted on the network's plans
    advisor_heuristic_evictions: int = 0  # learned: on plans the cache-manager ranked with its heuristic
    fallback_reasons: dict = dataclasses.field(default_factory=dict)
    kv_blocks_peak: int = 0               # most blocks held at once (summed over rows, as kv_blocks_resident)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class StepOutput:
    request_id: str
    token_id: int | None                  # None on an abort or error notice
    text_delta: str
    logprob: float | None
    finished: bool
    finish_reason: str | None             # "stop" | "length" | "abort" | "error"
    usage: Usage | None = None
    rounds: list = dataclasses.field(default_factory=list)   # eviction rounds since the last output


class LLMEngine:
    def __init__(self, config: EngineConfig, advisor: EvictionAdvisor | None = None,
                 model=None, tokenizer=None):
        if model is None:
            from services.compute.model.loader import load_model
            from services.compute.model.tokenizer import Tokenizer
            model = load_model(config.model_dir, config.dtype, config.device)
            tokenizer = Tokenizer(config.model_dir) if tokenizer is None else tokenizer
        self.config = config
        self.model, self.tokenizer = model.eval(), tokenizer
        mc = model.config
        self.max_model_len = (mc.max_position_embeddings if config.max_model_len is None
                              else min(config.max_model_len, mc.max_position_embeddings))
        # Off CPU the RoPE tables cannot grow on demand without a sync per step.
        model.rotary.reserve(self.max_model_len)
        if config.block_size < 1 or config.page_size < 1:
            raise ValueError(f"block_size ({config.block_size}) and page_size ({config.page_size}) must be >= 1")
        self.page_size = page = page_tokens(config.block_size, config.page_size)
        if config.round_slack is not None and config.round_slack < 0:
            raise ValueError(f"round_slack ({config.round_slack}) must be >= 0 (blocks)")
        self.round_slack = page // config.block_size - 1 if config.round_slack is None else config.round_slack
        if config.num_pages is not None:
            self.pool = KVPool(config.num_pages, page, mc.head_dim, model.dtype, model.device)
        else:
            dense = (math.ceil(self.max_model_len / page) * mc.num_layers
                     * mc.num_kv_heads * config.max_num_seqs + 1)
            pages = min(dense, config.kv_cache_bytes // KVPool.page_bytes(page, mc.head_dim, model.dtype))
            self.pool = KVPool(pages, page, mc.head_dim, model.dtype, model.device)
        self.runner = ModelRunner(model, self.pool, config.block_size)
        self.scheduler = Scheduler(self.pool, mc.num_layers * mc.num_kv_heads, config.max_num_seqs,
                                   config.prefill_chunk, config.cleanup_threshold, mc.sliding_window,
                                   config.prefill_headroom_chunks)
        self.eos_ids = set(tokenizer.eos_token_ids) if tokenizer is not None else set(mc.eos_token_ids)
        rows = mc.num_layers * mc.num_kv_heads
        self.prefix_cache = None
        if config.prefix_cache_fraction > 0:
            self.prefix_cache = PrefixCache(self.pool, config.block_size, rows,
                                            int(config.prefix_cache_fraction * self.pool.capacity))
            self.scheduler.holders.append(self.prefix_cache)
        # Sessions are dropped before cached prefixes under pool pressure.
        self.sessions = SessionCache(self.pool, config.session_ttl_s)
        self.scheduler.holders.insert(0, self.sessions)
        self._next_expiry = 0.0
        self.scheduler.on_admit = self._on_admit
        # step() and prewarm() may be called from different threads (server start).
        self._lock = threading.RLock()
        self.seqs: dict[str, Sequence] = {}
        self._aborts: list[str] = []
        self._ids = itertools.count()
        self.counters = Counter()
        self.evictions_by_source: Counter = Counter()   # (policy, source, reason) -> blocks, finished requests
        self.idle = True                                # the last step had nothing to run
        self.rounds = EvictionRounds(config, advisor, self.scheduler, self.pool, self.seqs, self.counters)

    # ------------------------------------------------------------ requests
    def make_sequence(self, request_id: str, prompt_token_ids: list[int],
                      sampling: SamplingParams | None = None,
                      eviction: EvictionParams | None = None) -> Sequence:
        """Validate and build a sequence (raises ValueError); touches no engine state."""
        sampling = sampling or SamplingParams()
        eviction = eviction or EvictionParams()
        sampling.validate()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) + sampling.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({sampling.max_tokens}) "
                             f"exceeds the model's max length {self.max_model_len}")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        c, mc = self.config, self.model.config
        state = resolve_eviction(eviction, block_size=c.block_size, prompt_len=len(prompt),
                                 max_tokens=sampling.max_tokens, plan_slack_blocks=c.plan_slack_blocks,
                                 cleanup_floor=c.cleanup_floor, round_slack=self.round_slack)
        seq = Sequence(request_id, prompt, sampling, state, mc.num_layers, mc.num_kv_heads,
                       mc.head_dim, c.block_size, self.model.device, self.page_size // c.block_size)
        seq.policy = get_policy(c.fallback_policy if state.policy == LEARNED else state.policy)
        seq.generator = make_generator(sampling, self.model.device)
        if self.tokenizer is not None:
            seq.decoder = self.tokenizer.incremental_decoder(prompt)
        return seq

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling: SamplingParams | None = None,
                    eviction: EvictionParams | None = None, session_id: str | None = None) -> None:
        """``session_id`` (or ``sampling.session_id``): if that session is
        parked here, the prompt is its next turn (appended after everything the
        session holds, its last generated token included); else the request
        starts the session. Either way its KV is parked when it finishes."""
        if session_id is not None:
            sampling = dataclasses.replace(sampling or SamplingParams(), session_id=session_id)
        self.add_sequence(self.make_sequence(request_id, prompt_token_ids, sampling, eviction))

    def add_sequence(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            raise ValueError(f"request id {seq.request_id!r} is already running")
        sid = seq.sampling.session_id
        if sid is not None and not seq.session_claim:
            self.sessions.continue_turn(seq, self.max_model_len)
        try:
            self.scheduler.add(seq)
        except ValueError:
            if seq.session_claim:
                self.sessions.unclaim(sid)
            raise
        self.seqs[seq.request_id] = seq

    def has_session(self, session_id: str) -> bool:
        """Whether a next turn of ``session_id`` would continue from parked KV here."""
        return self.session_tokens(session_id) > 0

    def session_tokens(self, session_id: str) -> int:
        """Tokens a next turn of ``session_id`` would continue after (0: none parked)."""
        with self._lock:
            self.sessions.expire()
            seq = self.sessions.parked.get(session_id)
            return 0 if seq is None else seq.num_tokens

    def drop_session(self, session_id: str) -> bool:
        """Free a parked session's pages now (False if absent or its next turn is queued)."""
        with self._lock:
            if session_id in self.sessions.claimed:
                return False
            return self.sessions.drop(session_id)

    def _on_admit(self, seq: Sequence) -> None:
        if seq.session_claim:
            self.sessions.restore(seq, self.pool)
        elif self.prefix_cache is not None:
            self.prefix_cache.admit(seq, self.scheduler.reservation)

    def prewarm(self, prompts) -> int:
        """Prefill prompt prefixes into the prefix cache: one prompt (token
        ids) or a list of prompts (texts or token-id lists). Their full blocks
        are cached with attention statistics; nothing is streamed. Call it
        before serving: on an idle engine it runs to completion here,
        otherwise the prefills run within the next steps. Returns how many
        prompts were queued (those with at least one full block)."""
        if self.prefix_cache is None:
            return 0
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        seqs = []
        with self._lock:
            for p in prompts:
                if isinstance(p, str):
                    if self.tokenizer is None:
                        raise ValueError("a text prompt needs a tokenizer")
                    p = self.tokenizer.encode(p)
                ids = list(p)[:self.max_model_len - 1]
                n = len(ids) // self.page_size * self.page_size
                if n == 0:
                    continue
                # A budget above the prompt: the statistics path runs, nothing is evicted.
                try:
                    seq = self.make_sequence(f"\x00prewarm-{next(self._ids)}", ids[:n], SamplingParams(max_tokens=1),
                                             EvictionParams("h2o", budget=n + 2 * self.page_size,
                                                            sink=0, recent=0))
                    seq.prewarm = True
                    self.add_sequence(seq)
                except ValueError as e:   # a bad entry (ids out of range, too big for the pool) is skipped
                    log.warning("prewarm prompt skipped: %s", e)
                    continue
                seqs.append(seq)
            if all(s.prewarm for s in self.seqs.values()):
                while any(not s.is_finished for s in seqs):
                    steps = self.counters["steps"]
                    self.step()
                    if self.counters["steps"] == steps:   # nothing could run: leave them queued
                        break
        return len(seqs)

    def abort(self, request_id: str) -> None:
        """Pages are freed at the next step."""
        self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.seqs) or bool(self._aborts)

    # ------------------------------------------------------------ step
    @property
    def advisor(self) -> EvictionAdvisor | None:
        return self.rounds.advisor

    def next_plan_deadline(self) -> float | None:
        """Seconds until the earliest held sequence's plan wait runs out."""
        return self.rounds.next_plan_deadline()

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        with self._lock:
            return self._step()

    def _step(self) -> list[StepOutput]:
        outputs = []
        now = time.monotonic()
        if now >= self._next_expiry:
            self.sessions.expire()
            self._next_expiry = now + 1.0
        for rid in self._aborts:
            if rid in self.seqs:
                outputs.append(self._finish(self.seqs[rid], "abort", None, "", None))
        self._aborts.clear()
        self.rounds.take_plans()
        self.runner.measure_reach = self.advisor is not None and getattr(self.advisor, "reads_reach", True)
        batch = self.scheduler.schedule()
        self.idle = not batch
        if not batch:
            return outputs
        logits, sampled = self.runner.run(batch)
        window = self.model.config.sliding_window
        if window is not None:
            # Dense sequences keep O(window) KV. Prefix blocks (shared, counted by
            # the cache) and prewarm fills (cached whole) keep theirs.
            for seq, _ in batch:
                if seq.eviction.budget_blocks is None and not seq.prefix_blocks and not seq.prewarm:
                    drop_outside_window(seq, self.pool, window)
        for seq in sampled:
            if seq.prewarm and len(seq.output_ids) == 0:
                self.prefix_cache.insert(seq, seq.num_prompt // self.page_size, self.scheduler.room(), True)
        self.counters["steps"] += 1
        self.counters["prompt_tokens"] += sum(t for s, t in batch if s.num_cached <= s.num_prompt)
        if sampled:
            tokens, logprobs = sample(logits, sampled)
            for seq, tok, lp in zip(sampled, tokens, logprobs):
                out = self._emit(seq, tok, lp)
                if not seq.prewarm:
                    outputs.append(out)
        self.rounds.after_step([seq for seq, _ in batch
                                if not seq.is_finished and seq.eviction.budget_blocks is not None])
        self.rounds.flush()
        return outputs

    def _emit(self, seq: Sequence, tok: int, logprob) -> StepOutput:
        p = seq.sampling
        self.counters["generated_tokens"] += not seq.prewarm
        if tok in self.eos_ids and not p.ignore_eos:
            seq.append_token(tok)
            return self._finish(seq, "stop", tok, detokenize.flush(seq), logprob)
        seq.append_token(tok)
        delta, stopped = detokenize.push(seq, tok)
        if stopped:
            return self._finish(seq, "stop", tok, delta, logprob)
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return self._finish(seq, "length", tok, delta + detokenize.flush(seq), logprob)
        out = StepOutput(seq.request_id, tok, delta, logprob, False, None, rounds=seq.rounds)
        seq.rounds = []
        return out

    # ------------------------------------------------------------ finish
    def _finish(self, seq: Sequence, reason: str, tok, delta: str, logprob) -> StepOutput:
        sid = seq.sampling.session_id
        park = sid is not None and reason in ("stop", "length") and not seq.prewarm
        if park and overshoot(seq) > 0:
            # A sequence that ends in the step its last prompt chunk went in is over its
            # budget (its round had not run yet); a parked session holds only its budget.
            plan = usable_plan(seq) if seq.eviction.policy == LEARNED else None
            eviction_round(seq, self.pool, plan, "" if plan is not None else NO_PLAN)
        ev = seq.evictions
        usage = Usage(seq.num_prompt - seq.session_base, len(seq.output_ids), seq.block_index.numel(),
                      seq.evicted_blocks, seq.eviction.policy, seq.fallback_evictions, seq.session_base,
                      network_evictions=ev[(NETWORK, "")], advisor_heuristic_evictions=ev[("advisor_heuristic", "")],
                      fallback_reasons={r: n for (src, r), n in ev.items() if src == FALLBACK},
                      kv_blocks_peak=seq.peak_blocks * seq.num_layers * seq.num_kv_heads)
        seq.finish_reason = reason
        if seq.session_claim:            # finished before admission: the session stays parked
            self.sessions.unclaim(sid)
        if park:
            self.scheduler.detach(seq)
            self.sessions.park(sid, seq)
        else:
            self.scheduler.remove(seq)
        self.seqs.pop(seq.request_id, None)
        if seq.prewarm:
            return StepOutput(seq.request_id, tok, "", None, True, reason, usage)
        rounds, seq.rounds = seq.rounds, []
        if seq.eviction.policy == LEARNED and self.advisor is not None:
            self.rounds.advise(self.advisor.release, seq.request_id)
        self.counters["finished_requests"] += 1
        self.counters[f"finish_{reason}"] += 1
        for (src, why), n in seq.evictions.items():
            self.evictions_by_source[(seq.eviction.policy, src, why)] += n
        return StepOutput(seq.request_id, tok, delta, logprob, True, reason, usage, rounds)

    def fail_all(self, reason: str = "error") -> list[StepOutput]:
        """Finish every request (used when a step raised: the loop lives on)."""
        outs = [self._finish(s, reason, None, "", None) for s in list(self.seqs.values())]
        return [o for o in outs if not o.request_id.startswith("\x00prewarm-")]

    # ------------------------------------------------------------ helpers
    def generate(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                 eviction: EvictionParams | None = None) -> Iterator[StepOutput]:
        """Run one request to completion, yielding its outputs as they come.
        Drives ``step()`` itself: use add_request/step for many requests."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer")
            prompt = self.tokenizer.encode(prompt)
        rid = f"gen-{next(self._ids)}"
        self.add_request(rid, prompt, sampling, eviction)
        while True:
            for out in self.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return

    def stats(self) -> dict:
        # Finished requests' counts plus live ones': monotonic, and it includes
        # evictions made by cleanup shrinks between steps.
        by_source = Counter(self.evictions_by_source)
        for s in self.seqs.values():
            for (src, why), n in s.evictions.items():
                by_source[(s.eviction.policy, src, why)] += n
        evictions = Counter()
        for (policy, _, _), n in by_source.items():
            evictions[policy] += n
        return {
            "pages_total": self.pool.capacity,
            "pages_used": self.pool.num_used,
            "pages_free": self.pool.num_free,
            "pages_reserved": self.scheduler.reserved(),
            "pool_utilisation": self.pool.utilisation(),
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "evictions": dict(evictions),
            "evictions_by_source": dict(by_source),
            "fallback_evictions": sum(n for (_, src, _), n in by_source.items() if src == FALLBACK),
            "network_evictions": sum(n for (_, src, _), n in by_source.items() if src == NETWORK),
            "learned_evictions": sum(n for (p, _, _), n in by_source.items() if p == LEARNED),
            "held_for_plan": sum(1 for s in self.scheduler.running if s.holding),
            "features_resent": self.counters["features_resent"],
            "plan_waits_expired": self.counters["plan_waits_expired"],
            "plans_applied": self.counters["plans_applied"],
            # reason -> plans taken from the advisor but never applied
            "plans_late": {k.split("/", 1)[1]: n for k, n in self.counters.items() if k.startswith("plans_late/")},
            "plans_dropped": {k.split("/", 1)[1]: n for k, n in self.counters.items()
                              if k.startswith("plans_dropped/")},
            "generated_tokens": self.counters["generated_tokens"],
            "prompt_tokens": self.counters["prompt_tokens"],
            "steps": self.counters["steps"],
            "finished_requests": self.counters["finished_requests"],
            "budget_shrinks": self.scheduler.budget_shrinks,
            **(self.prefix_cache.stats() if self.prefix_cache is not None else {}),
            **self.sessions.stats(),
            "advisor_errors": self.counters["advisor_errors"],
        }
