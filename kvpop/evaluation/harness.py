"""Runs test instances through the in-process engine under each (policy,
compression): free greedy generation (accuracy, generated length) and a
teacher-forced pass over the reference solution (next-token distributions
for the KL to dense). Requests of every configuration share one engine, so
they are batched together."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from kvpop.evaluation.forcing import ForcingRunner
from kvpop.evaluation.oracle import OraclePolicy
from kvpop.tasks.checker import is_correct
from kvpop.tasks.instance import Instance


@dataclass(frozen=True)
class Setting:
    policy: str                 # a policy name, or "<name>+recent<P>" (see policy_spec)
    compression: float          # 0 = dense


AFTER = "+after"
PREFILL = "+prefill"


def _default() -> tuple[bool, float]:
    from kvpop.runtime import prefill_protocol
    from kvpop.runtime.config import DEFAULT_PREFILL
    return prefill_protocol.parse(DEFAULT_PREFILL)


def after_prompt(label: str) -> bool:
    """"keydiff+after": the budget holds from the end of the prompt on (the
    request's `evict_after_prompt`; kvpress's protocol), not during prefill.
    A label without a protocol suffix: the default protocol's (as served)."""
    if label.endswith(AFTER):
        return True
    return False if PREFILL in label else _default()[0]


def prefill_allowance(label: str) -> float:
    """"learned+prefill4x" -> 4.0: during prefill the request holds up to 4x its
    budget, then the round at the prompt's end brings it down (the request's
    `prefill_allowance`); "+prefill1x" is the budget itself from the first chunk
    on. Without a suffix: the default protocol's."""
    _, sep, tail = label.rpartition(PREFILL)
    if not sep:
        return 1.0 if label.endswith(AFTER) else _default()[1]
    try:
        if not tail.endswith("x"):
            raise ValueError
        return float(tail[:-1])
    except ValueError:
        raise ValueError(f"{label!r}: write the prefill allowance as {PREFILL}<N>x, e.g. learned{PREFILL}4x") from None


def set_protocol(req, label: str) -> None:
    """A GenerateRequest's fields for the label's suffix: evict_after_prompt,
    prefill_allowance. Without a suffix neither is set: the stack's default
    protocol (KVPOP_DEFAULT_PREFILL) applies, as for any client."""
    if label.endswith(AFTER):
        req.evict_after_prompt = True
    elif PREFILL in label:
        req.prefill_allowance = prefill_allowance(label)


def base_label(label: str) -> str:
    """The label without its protocol suffix (+after, +prefill<N>x)."""
    label = label.removesuffix(AFTER)
    head, sep, _ = label.rpartition(PREFILL)
    return head if sep else label


def policy_spec(label: str) -> tuple[str, float | None]:
    """"h2o+recent50" -> ("h2o", 0.5): the policy with a recent window of 50% of
    each request's budget instead of the run's fixed --recent (H2O's paper keeps
    half its budget for recent tokens). A plain name -> (name, None). The
    served request is the same policy with `recent_tokens` set: no eval-only path.
    A trailing "+after" or "+prefill<N>x" (see after_prompt, prefill_allowance)
    is not part of either."""
    label = base_label(label)
    name, _, rest = label.partition("+recent")
    if not rest:
        return label, None
    share = int(rest) / 100
    if not 0 < share < 1:
        raise ValueError(f"{label!r}: the recent share must be between 1 and 99 (percent of the budget)")
    return name, share


def recent_tokens(label: str, budget: int | None, default: int, sink: int, block_size: int) -> int:
    """The recent window of a request under `label` (at least `default`; room left for sink + one block)."""
    _, share = policy_spec(label)
    if share is None or budget is None:
        return default
    return max(default, min(int(budget * share), budget - sink - block_size))


@dataclass
class Outcome:
    setting: Setting
    instance: Instance
    correct: bool = False
    generated: int = 0
    text: str = ""
    logprobs: list = field(default_factory=list)   # teacher-forced rows (kept for dense only)
    kl: list = field(default_factory=list)         # per solution position, KL(dense || this)
    budget: int | None = None
    error: str = ""            # served only: the request failed ("CODE: details"); counted as not correct
    # KV measured by compute (Usage): tokens a (layer, kv-head) row held at the end, and the
    # request's peak KV bytes (all rows; the prompt's prefill included). None: not measured.
    held_tokens: float | None = None
    peak_bytes: int | None = None


def record_kv(o: Outcome, usage, rows: int, block_size: int, block_bytes: int) -> None:
    """KV held and peak from a finished request's usage (blocks summed over rows)."""
    if usage is not None and usage.kv_blocks_peak:
        o.held_tokens = usage.kv_blocks_resident * block_size / rows
        o.peak_bytes = usage.kv_blocks_peak * block_bytes


def count_decisions(decisions: dict, o: Outcome, usage) -> None:
    """Adds a finished request's evicted blocks, by who ranked them, to its setting's counts."""
    if usage is None:
        return
    d = decisions.setdefault((o.setting.policy, o.setting.compression), {})
    for k, v in (("evicted", usage.kv_blocks_evicted), ("network", usage.network_evictions),
                 ("advisor_heuristic", usage.advisor_heuristic_evictions), ("fallback", usage.fallback_evictions)):
        d[k] = d.get(k, 0) + v


def budget_tokens(inst: Instance, compression: float, minimum: int) -> int:
    """Compression = 1 - budget / sequence length (prompt + reference solution)."""
    total = len(inst.prompt_ids) + len(inst.solution_ids)
    return max(minimum, int(round((1.0 - compression) * total)))


class Harness:
    def __init__(self, engine, sink: int = 4, recent: int = 8, block_size: int = 1, margin: int = 16,
                 advisor_policy: str = "learned"):
        self.engine, self.sink, self.recent, self.bs, self.margin = engine, sink, recent, block_size, margin
        self.forcing = ForcingRunner(engine.runner)
        engine.runner = self.forcing
        from services.compute.eviction.budget import min_budget_blocks
        self.min_budget = min_budget_blocks(-(-sink // block_size), recent, block_size) * block_size
        self._oracle_attention: dict = {}
        from services.compute.engine.kv_pool import KVPool
        m = engine.model
        self.rows = m.config.num_layers * m.config.num_kv_heads
        self.block_bytes = KVPool.page_bytes(block_size, m.config.head_dim, m.dtype)
        self.decisions: dict[tuple[str, float], dict[str, int]] = {}

    def _answer_attention(self, inst):
        """The oracle's view of the future, one dense forward per instance."""
        key = (inst.family, inst.seed, len(inst.prompt_ids))
        if key not in self._oracle_attention:
            from kvpop.evaluation.oracle import answer_attention
            self._oracle_attention[key] = answer_attention(self.engine.model, inst.prompt_ids + inst.solution_ids,
                                                           len(inst.prompt_ids))
        return self._oracle_attention[key]

    def _make(self, rid: str, o: Outcome, forced: bool):
        from services.compute.engine.engine import EvictionParams, SamplingParams
        inst, s = o.instance, o.setting
        sol = inst.solution_ids
        sampling = SamplingParams(max_tokens=len(sol) if forced else len(sol) + self.margin, temperature=0.0)
        if s.policy == "dense":
            ev = EvictionParams("dense", sink=self.sink, recent=self.recent, block_size=self.bs)
        else:
            o.budget = budget_tokens(inst, s.compression, self.min_budget)
            # The oracle rides on the streaming protection rules with its own scores.
            name = "streaming" if s.policy == "oracle" else policy_spec(s.policy)[0]
            recent = recent_tokens(s.policy, o.budget, self.recent, self.sink, self.bs)
            ev = EvictionParams(name, budget=o.budget, sink=self.sink, recent=recent, block_size=self.bs,
                                after_prompt=after_prompt(s.policy), prefill_allowance=prefill_allowance(s.policy))
        seq = self.engine.make_sequence(rid, inst.prompt_ids, sampling, ev)
        if s.policy == "oracle":
            seq.policy = OraclePolicy(inst.depends, self.bs, self._answer_attention(inst))
        if forced:
            self.forcing.forced[rid] = sol
        return seq

    def run(self, settings: list[Setting], instances: list[Instance], desc: str = "eval",
            reference: dict | None = None, forcing: bool = True) -> list[Outcome]:
        """reference: (family, seed) -> dense teacher-forced rows; when given,
        each outcome gets its per-position KL and its own rows are dropped.
        forcing=False: generation only (no teacher-forced pass, no KL): half the work."""
        outcomes = [Outcome(s, inst) for s in settings for inst in instances]
        kinds = ("gen", "tf") if forcing else ("gen",)
        jobs = deque((f"{k}:{kind}", o, kind == "tf") for k, o in enumerate(outcomes) for kind in kinds)
        live: dict[str, tuple[Outcome, bool, list[int], list[str]]] = {}
        eng = self.engine
        cap = eng.config.max_num_seqs
        bar = tqdm(total=len(jobs), desc=desc, dynamic_ncols=True, mininterval=2)
        while jobs or live:
            while jobs and len(live) < cap:
                rid, o, forced = jobs.popleft()
                eng.add_sequence(self._make(rid, o, forced))
                live[rid] = (o, forced, [], [])
            for out in eng.step():
                o, forced, toks, text = live[out.request_id]
                if out.token_id is not None:
                    toks.append(out.token_id)
                text.append(out.text_delta)
                if not out.finished:
                    continue
                del live[out.request_id]
                bar.update(1)
                if out.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"request {out.request_id} ended with {out.finish_reason}")
                if forced:
                    rows = self.forcing.logprobs.pop(out.request_id, [])
                    self.forcing.forced.pop(out.request_id, None)
                    if reference is None:
                        o.logprobs = rows
                    else:
                        o.kl = kl_to_dense(reference[(o.instance.family, o.instance.seed)], rows)
                else:
                    inst = o.instance
                    # The text compute streams (what a client of the stack reads), so a served
                    # run's outcomes.jsonl compares line for line.
                    o.text = "".join(text)
                    o.generated = len(toks)
                    o.correct = is_correct(inst, o.text)
                    record_kv(o, out.usage, self.rows, self.bs, self.block_bytes)
                    count_decisions(self.decisions, o, out.usage)
        bar.close()
        return outcomes


def kl_to_dense(dense: list[torch.Tensor], other: list[torch.Tensor]) -> list[float]:
    """KL(dense || other) per teacher-forced position."""
    out = []
    for p, q in zip(dense, other):
        out.append(max(0.0, float((p.exp() * (p - q)).sum())))  # >= 0; float error can dip below
    return out
