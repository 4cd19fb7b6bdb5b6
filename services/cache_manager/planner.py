"""What the cache-manager service and the in-process LocalAdvisor share:
per-sequence scoring state, the policy that ranks blocks (the value-estimation
network, or the attention-per-age heuristic when no usable checkpoint exists)
and the plan built from its scores. One code path, so an evaluation through
LocalAdvisor measures exactly what the service would answer."""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvpop.runtime.paths import DEFAULT_MODEL_DIR
from services.cache_manager.heuristic import AttentionPerAge, plan
from services.cache_manager.scoring_state import BlockRecord, ScoringState

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "estimator.safetensors"
# More networks for the same model, trained on other prompt lengths (e.g. estimator-long.safetensors).
CHECKPOINT_GLOB = "estimator-*.safetensors"


def resolve_checkpoints(setting: str | Path | None) -> list[Path]:
    """The checkpoints a setting names, primary first: '' / None -> the default
    model's folder; 'none' -> none (heuristic only); a folder -> its
    estimator.safetensors, then every estimator-*.safetensors in it; a
    comma-separated list -> each of its parts in turn."""
    if setting is None or str(setting) == "":
        setting = DEFAULT_MODEL_DIR
    if str(setting).lower() == "none":
        return []
    paths: list[Path] = []
    for part in filter(None, (s.strip() for s in str(setting).split(","))):
        p = Path(part)
        if p.is_dir():
            found = [p / CHECKPOINT_NAME] if (p / CHECKPOINT_NAME).is_file() else []
            # A folder without any says "no estimator checkpoint at FOLDER/estimator.safetensors".
            paths += found + sorted(p.glob(CHECKPOINT_GLOB)) or [p / CHECKPOINT_NAME]
        else:
            paths.append(p)
    return paths


def route(scorers: list, prompt_tokens: int, block_size: int = 0):
    """Which network ranks a sequence. Those made for its block size come first,
    then those that state none (an unknown block size, 0, takes the latter).
    Among them: the one trained on the shortest prompts that still cover its
    prompt; past all of them, one with no stated limit, else the one trained
    longest. An unknown length (0) takes the first (the primary). Networks fit
    for short prompts lose answers on long ones and the other way round
    (docs/design/estimator.md, "Several networks")."""
    if len(scorers) > 1:
        made_for = [s for s in scorers if block_size > 0 and block_size in s.model.cfg.block_sizes]
        scorers = made_for or [s for s in scorers if not s.model.cfg.block_sizes] or scorers
    if len(scorers) <= 1 or prompt_tokens <= 0:
        return scorers[0] if scorers else None
    bounded = sorted((s for s in scorers if s.model.cfg.max_context > 0), key=lambda s: s.model.cfg.max_context)
    for s in bounded:
        if prompt_tokens <= s.model.cfg.max_context:
            return s
    unbounded = [s for s in scorers if s.model.cfg.max_context <= 0]
    return unbounded[0] if unbounded else bounded[-1]


@dataclass
class Plan:
    evict: np.ndarray    # [L, Hkv, k] block numbers, most evictable first
    covers: int          # one past the highest block number known for the sequence
    ranker: str          # "network" or "heuristic"
    estimator: str = ""  # the network's checkpoint file name ("" for the heuristic)


class Planner:
    def __init__(self, checkpoint: str | Path | None = "", max_plan_blocks: int = 8192, model=None):
        """checkpoint: path setting (see resolve_checkpoints); model: a ValueEstimator
        to use directly (tests, training-time evaluation)."""
        self.paths = resolve_checkpoints(checkpoint) if model is None else []
        self.max_plan_blocks = max_plan_blocks
        self.state = ScoringState()
        self.heuristic = AttentionPerAge()
        self.scorers: list = []   # LearnedScorer per network, primary first
        self.loaded = ""          # what the networks came from ('' = heuristic)
        self.loads = 0
        self._checked: set[tuple] = set()   # shapes and block sizes already checked (each said once)
        if model is not None:
            self._use([(model, "in-memory model")])
        else:
            self.reload()

    @property
    def scorer(self):
        """The primary network (None: the heuristic ranks)."""
        return self.scorers[0] if self.scorers else None

    @property
    def reads(self) -> tuple[str, ...]:
        """The optional BlockFeatures inputs a loaded network reads (compute
        skips measuring the others)."""
        return ("reach",) if any(sc.model.cfg.reach for sc in self.scorers) else ()

    def _use(self, models: list[tuple], source: str | None = None) -> None:
        from services.cache_manager.estimator import LearnedScorer

        scorers = []
        for model, label in models:
            sc = LearnedScorer(model)
            sc.label = label
            self._warm_up(sc)
            scorers.append(sc)
        self.scorers = scorers
        self.loaded = source or " + ".join(label for _, label in models)
        self.loads += 1
        self._checked.clear()   # other networks: shapes and block sizes are checked against them anew

    @staticmethod
    def _warm_up(scorer) -> None:
        """Score a throwaway sequence once: torch's first calls are slow, and the
        first plans after a (re)start must not come later than compute waits."""
        from services.cache_manager.scoring_state import SequenceState

        c = scorer.model.cfg
        seq, rng = SequenceState("\x00warm-up"), np.random.default_rng(0)
        for b in range(2 * scorer.rescore_every + 1):
            seq.add(BlockRecord(b, 16 * b, 16, rng.standard_normal((c.num_layers, c.num_kv_heads, c.head_dim),
                                                                   dtype=np.float32),
                                np.ones((c.num_layers, c.num_kv_heads), np.float32),
                                np.ones((c.num_layers, c.num_kv_heads), np.float32)))
            if b % 4 == 0:
                scorer.score(seq)

    def reload(self) -> str:
        """(Re)load the checkpoints. A missing or broken file keeps the current
        policy (the heuristic at start) and says so; returns the log line."""
        from services.cache_manager.estimator import load

        if not self.paths:
            msg = "no estimator configured: ranking blocks with the attention-per-age heuristic"
            log.info(msg)
            return msg
        models = []
        try:
            for path in self.paths:
                models.append((load(path), path))
        except ValueError as e:
            now = "the network from " + self.loaded if self.scorers else "the attention-per-age heuristic"
            msg = f"estimator not loaded ({e}); ranking blocks with {now}"
            log.warning(msg)
            return msg
        labels = [f"{path} sha256:{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}" for _, path in models]
        self._use([(m, path.name) for m, path in models], " + ".join(labels))
        lines = []
        for (model, path), label in zip(models, labels):
            c = model.cfg
            lines.append(f"estimator loaded from {label} (L={c.num_layers} Hkv={c.num_kv_heads} d={c.head_dim}, "
                         f"d_model={c.d_model} depth={c.depth}, {sum(p.numel() for p in model.parameters())} "
                         f"parameters, prompts up to {c.max_context or 'any length'}, "
                         f"block sizes {c.block_sizes or 'any'})")
        msg = "\n".join(lines)
        for line in lines:
            log.info(line)
        return msg

    @property
    def policy_name(self) -> str:
        return "learned" if self.scorers else self.heuristic.name

    def apply(self, request_id: str, records: list[BlockRecord], prompt_tokens: int = 0) -> Plan:
        """Fold in a batch of features and rank every known block of the
        sequence (most evictable first), saying what ranked them. ValueError
        for features inconsistent with the sequence's earlier ones."""
        self.add(request_id, records, prompt_tokens=prompt_tokens)
        return self.plan(request_id)

    def add(self, request_id: str, records: list[BlockRecord], gone: np.ndarray | None = None,
            prompt_tokens: int = 0) -> None:
        """Fold in a batch of features and the blocks compute's rows evicted
        since its last batch (ValueError if inconsistent)."""
        for r in records:
            km, vn, att, reach = (np.shape(r.key_mean), np.shape(r.value_norm), np.shape(r.attention),
                                  np.shape(r.reach))
            if len(km) != 3 or vn != km[:2] or att != km[:2] or reach != km[:2]:
                raise ValueError(f"block {r.block}: key_mean {km}, value_norm {vn}, attention {att}, reach {reach} "
                                 f"do not fit [L, Hkv, d], [L, Hkv], [L, Hkv], [L, Hkv]")
        seq = self.state.get(request_id)
        for r in records:
            seq.add(r)
        self._added(seq, len(records), prompt_tokens, gone)

    def add_arrays(self, request_id: str, a: dict[str, np.ndarray], gone: np.ndarray | None = None,
                   prompt_tokens: int = 0) -> None:
        """``add`` of blocks as arrays (compute's FeatureBatch: block, position, age
        [k]; key_mean [k, L, Hkv, d]; value_norm, attention, reach [k, L, Hkv])."""
        km = np.shape(a["key_mean"])
        k = len(a["block"])
        if k:
            if len(km) != 4 or km[0] != k or any(np.shape(a[f]) != km[:3] for f in ("value_norm", "attention", "reach")) \
                    or any(np.shape(a[f]) != (k,) for f in ("position", "age")):
                raise ValueError(f"features of {k} blocks: key_mean {km}, "
                                 + ", ".join(f"{f} {np.shape(a[f])}" for f in ("value_norm", "attention", "reach",
                                                                               "position", "age"))
                                 + " do not fit [k, L, Hkv, d], [k, L, Hkv] and [k]")
        seq = self.state.get(request_id)
        seq.add_many(a)
        self._added(seq, k, prompt_tokens, gone)

    def _added(self, seq, blocks: int, prompt_tokens: int, gone: np.ndarray | None) -> None:
        """What follows new blocks either way: the prompt's length, the rows'
        evictions since the last batch, the block-size check."""
        if prompt_tokens > 0:
            seq.prompt_tokens = int(prompt_tokens)
        if gone is not None:
            seq.mark_gone(gone)
        if blocks and seq.block_size:
            self._check_block_size(seq.block_size)

    def _check_block_size(self, block_size: int) -> None:
        """Say once per block size when the network was trained on others: at block
        sizes 2 and 4 the default model's estimator (trained on 1 and 16) ranked
        below the keydiff heuristic in our eval (docs/results/eviction-quality.md)."""
        key = ("block_size", block_size)
        if key in self._checked:   # every features batch comes here: check each block size once
            return
        self._checked.add(key)
        trained = sorted({b for sc in self.scorers for b in sc.model.cfg.trained.get("block_sizes") or []})
        if trained and block_size not in trained:
            log.warning("estimator %s was trained at block sizes %s; features arrive at block size %d, where "
                        "its rankings are untested (retrain with `kvpop train-estimator --block-sizes %d`)",
                        self.loaded, trained, block_size, block_size)

    def plan(self, request_id: str) -> Plan:
        """Rank every known block of the sequence, most evictable first."""
        return self.plan_many([request_id])[0]

    def plan_many(self, request_ids: list[str]) -> list[Plan]:
        """``plan`` of several sequences; those one network ranks are scored in one
        call (LearnedScorer.score_many): a round of plans costs a network pass,
        not one per sequence. Each plan is what ``plan`` gives alone."""
        seqs = [self.state.get(rid) for rid in request_ids]
        chosen, groups = [], {}
        for seq in seqs:
            scorer = None
            if self.scorers:
                shape = seq.arrays()["key_mean"].shape[1:]
                scorer = route([s for s in self.scorers if s.compatible(*shape)], seq.prompt_tokens, seq.block_size)
                if scorer is None and shape not in self._checked:
                    self._checked.add(shape)
                    log.warning("estimator %s does not fit features of shape (L, Hkv, d)=%s: using the heuristic "
                                "for such sequences", self.loaded, shape)
            chosen.append(scorer)
            if scorer is not None:
                groups.setdefault(id(scorer), (scorer, []))[1].append(seq)
        scores = {}
        for scorer, group in groups.values():
            try:
                scores.update(zip(map(id, group), scorer.score_many(group)))
            except Exception:  # noqa: BLE001 - a network failure must not cost the plans
                for seq in group:
                    seq.cache.clear()
                log.exception("estimator failed on %s; ranking them with the heuristic",
                              ", ".join(s.request_id for s in group))
        return [self._plan_from(seq, scores.get(id(seq)), scorer) for seq, scorer in zip(seqs, chosen)]

    def _plan_from(self, seq, scores, scorer) -> Plan:
        ranker, estimator = "network", scorer.label if scorer is not None else ""
        if scores is None:
            scores, ranker, estimator = self.heuristic.score(seq), "heuristic", ""
        a = seq.arrays()
        # Blocks a row no longer holds go last: the plan's first names are ones it can evict.
        scores = np.where(a["gone"], np.inf, scores) if "gone" in a else scores
        blocks = a["block"]
        return Plan(plan(seq, scores, self.max_plan_blocks), int(blocks.max()) + 1 if len(blocks) else 0, ranker,
                    estimator)

    def drop(self, request_id: str) -> None:
        self.state.drop(request_id)
