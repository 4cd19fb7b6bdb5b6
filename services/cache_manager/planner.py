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

from kvpop.paths import DEFAULT_MODEL_DIR
from services.cache_manager.heuristic import AttentionPerAge, plan
from services.cache_manager.scoring_state import BlockRecord, ScoringState

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "estimator.safetensors"


def resolve_checkpoint(setting: str | Path | None) -> Path | None:
    """'' / None -> the default model's checkpoint; 'none' -> no network (heuristic only)."""
    if setting is None or str(setting) == "":
        return Path(DEFAULT_MODEL_DIR) / CHECKPOINT_NAME
    if str(setting).lower() == "none":
        return None
    p = Path(setting)
    return p / CHECKPOINT_NAME if p.is_dir() else p


@dataclass
class Plan:
    evict: np.ndarray    # [L, Hkv, k] block numbers, most evictable first
    covers: int          # one past the highest block number known for the sequence
    ranker: str          # "network" or "heuristic"


class Planner:
    def __init__(self, checkpoint: str | Path | None = "", max_plan_blocks: int = 8192, model=None):
        """checkpoint: path setting (see resolve_checkpoint); model: a ValueEstimator
        to use directly (tests, training-time evaluation)."""
        self.path = resolve_checkpoint(checkpoint) if model is None else None
        self.max_plan_blocks = max_plan_blocks
        self.state = ScoringState()
        self.heuristic = AttentionPerAge()
        self.scorer = None
        self.loaded = ""          # what the network came from ('' = heuristic)
        self.loads = 0
        self._warned: set[tuple] = set()
        if model is not None:
            self._use(model, "in-memory model")
        else:
            self.reload()

    def _use(self, model, source: str) -> None:
        from services.cache_manager.estimator import LearnedScorer

        self.scorer = LearnedScorer(model)
        self.loaded = source
        self.loads += 1
        self._warm_up()

    def _warm_up(self) -> None:
        """Score a throwaway sequence once: torch's first calls are slow, and the
        first plans after a (re)start must not come later than compute waits."""
        from services.cache_manager.scoring_state import SequenceState

        c = self.scorer.model.cfg
        seq, rng = SequenceState("\x00warm-up"), np.random.default_rng(0)
        for b in range(2 * self.scorer.rescore_every + 1):
            seq.add(BlockRecord(b, 16 * b, 16, rng.standard_normal((c.num_layers, c.num_kv_heads, c.head_dim),
                                                                   dtype=np.float32),
                                np.ones((c.num_layers, c.num_kv_heads), np.float32),
                                np.ones((c.num_layers, c.num_kv_heads), np.float32)))
            if b % 4 == 0:
                self.scorer.score(seq)

    def reload(self) -> str:
        """(Re)load the checkpoint. A missing or broken file keeps the current
        policy (the heuristic at start) and says so; returns the log line."""
        from services.cache_manager.estimator import load

        if self.path is None:
            msg = "no estimator configured: ranking blocks with the attention-per-age heuristic"
            log.info(msg)
            return msg
        try:
            model = load(self.path)
        except ValueError as e:
            now = "the network from " + self.loaded if self.scorer else "the attention-per-age heuristic"
            msg = f"estimator not loaded ({e}); ranking blocks with {now}"
            log.warning(msg)
            return msg
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()[:12]
        self._use(model, f"{self.path} sha256:{digest}")
        c = model.cfg
        msg = (f"estimator loaded from {self.loaded} (L={c.num_layers} Hkv={c.num_kv_heads} d={c.head_dim}, "
               f"d_model={c.d_model} depth={c.depth}, {sum(p.numel() for p in model.parameters())} parameters)")
        log.info(msg)
        return msg

    @property
    def policy_name(self) -> str:
        return "learned" if self.scorer is not None else self.heuristic.name

    def apply(self, request_id: str, records: list[BlockRecord]) -> Plan:
        """Fold in a batch of features and rank every known block of the
        sequence (most evictable first), saying what ranked them. ValueError
        for features inconsistent with the sequence's earlier ones."""
        self.add(request_id, records)
        return self.plan(request_id)

    def add(self, request_id: str, records: list[BlockRecord], gone: np.ndarray | None = None) -> None:
        """Fold in a batch of features and the blocks compute's rows evicted
        since its last batch (ValueError if inconsistent)."""
        for r in records:
            km, vn, att = np.shape(r.key_mean), np.shape(r.value_norm), np.shape(r.attention)
            if len(km) != 3 or vn != km[:2] or att != km[:2]:
                raise ValueError(f"block {r.block}: key_mean {km}, value_norm {vn}, attention {att} do not "
                                 f"fit [L, Hkv, d], [L, Hkv], [L, Hkv]")
        seq = self.state.get(request_id)
        for r in records:
            seq.add(r)
        if gone is not None:
            seq.mark_gone(gone)
        if records and records[-1].block > 0:
            self._check_block_size(records[-1].position // records[-1].block)

    def _check_block_size(self, block_size: int) -> None:
        """Say once per block size when the network was trained on others: at block
        sizes 2 and 4 the default model's estimator (trained on 1 and 16) ranked
        below the keydiff heuristic in our eval (docs/evaluation.md)."""
        trained = (self.scorer.model.cfg.trained.get("block_sizes") or []) if self.scorer is not None else []
        key = ("block_size", block_size)
        if trained and block_size not in trained and key not in self._warned:
            self._warned.add(key)
            log.warning("estimator %s was trained at block sizes %s; features arrive at block size %d, where "
                        "its rankings are untested (retrain with `kvpop train-estimator --block-sizes %d`)",
                        self.loaded, trained, block_size, block_size)

    def plan(self, request_id: str) -> Plan:
        """Rank every known block of the sequence, most evictable first."""
        seq = self.state.get(request_id)
        scores = None
        if self.scorer is not None:
            shape = seq.arrays()["key_mean"].shape[1:]
            if self.scorer.compatible(*shape):
                try:
                    scores = self.scorer.score(seq)
                except Exception:  # noqa: BLE001 - a network failure must not cost the plan
                    seq.cache.clear()
                    log.exception("estimator failed on %s; ranking it with the heuristic", request_id)
            elif shape not in self._warned:
                self._warned.add(shape)
                log.warning("estimator %s does not fit features of shape (L, Hkv, d)=%s: using the heuristic "
                            "for such sequences", self.loaded, shape)
        ranker = "network"
        if scores is None:
            scores, ranker = self.heuristic.score(seq), "heuristic"
        a = seq.arrays()
        # Blocks a row no longer holds go last: the plan's first names are ones it can evict.
        scores = np.where(a["gone"], np.inf, scores) if "gone" in a else scores
        blocks = a["block"]
        return Plan(plan(seq, scores, self.max_plan_blocks), int(blocks.max()) + 1 if len(blocks) else 0, ranker)

    def drop(self, request_id: str) -> None:
        self.state.drop(request_id)
