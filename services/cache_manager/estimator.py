"""The value-estimation network: predicted future importance (log-scale) of
every known block of one (layer, kv-head) row of one sequence.

Input per block = exactly what compute streams (key_mean, value_norm,
attention received so far, position, age at submission) + layer and kv-head
embeddings. A small pre-LN self-attention stack runs over the blocks of each
row (rows batched), so a block is judged against the others (an old
``a := 5`` whose key matches a later ``a := 7`` can learn to drop).

The per-block features never change after submission, so the attention part
is cached per sequence. At depth 1 (what we ship) live_attention keeps it exact
and incremental: each plan merges in only the newcomers' keys, and blocks a row
has evicted stop being queries; the MLP after the attention is re-run for the
blocks already held every ``rescore_every`` new blocks. Deeper networks re-run
the whole stack every ``rescore_every`` new blocks (newcomers in between attend
over everything known, exact for them, stale for the others). The head turns
each block's hidden state into a small per-block curve over time features
(time since the block, its relative position), evaluated at every plan in
O(n): scores keep moving as the context grows without re-running attention.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from services.cache_manager.live_attention import LiveRows, gone_rows, update_many

N_SCALARS = 7
N_TIME = 3


@dataclass
class EstimatorConfig:
    num_layers: int               # of the served model
    num_kv_heads: int
    head_dim: int
    d_model: int = 32
    n_heads: int = 2
    depth: int = 1                # self-attention layers
    rescore_every: int = 16       # new blocks before the attention part is recomputed for all
    # The longest prompt (tokens) it was trained on; 0 = not stated. With several
    # networks loaded, a sequence goes to the one trained on the shortest prompts
    # that still cover its own (planner.route).
    max_context: int = 0
    # The block sizes it serves; empty = any. A network can be best at one block size and
    # worse at another (the previous-block input reads a value's key at block size 1 but
    # unrelated text at 16): with several loaded, a sequence goes to one made for its
    # block size first (planner.route).
    block_sizes: list = field(default_factory=list)
    # Each block also sees a small summary of its features in every row (layer x kv-head)
    # of the sequence: a row alone cannot tell which of its values a question asked for,
    # other rows' keys and attention can (docs/design/estimator.md, "Network").
    cross_rows: bool = False
    cross_dim: int = 8
    # Each block also sees its "reach" (compute's peak block mass of the block's own
    # queries outside their recent window): a recall value that just found its key's
    # earlier mention in the question reaches far back; its neighbours do not
    # (docs/design/estimator.md, "Network").
    reach: bool = False
    # Each block also sees the cross-row summary of the block just before it: at block
    # size 1 a recall value's predecessor is its key, whose deeper-layer features say
    # more about "was this pair asked" than the value's own (docs/design/estimator.md,
    # "Network"). Needs cross_rows.
    prev_block: bool = False
    trained: dict = field(default_factory=dict)   # provenance + held-out metrics (informational)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "EstimatorConfig":
        d = json.loads(text)
        unserved = sorted(k for k in RESEARCH_OPTIONS if d.get(k))
        if unserved:
            raise ValueError(f"a network with {', '.join(unserved)} is a research variant (research/README.md): "
                             f"the served network has no such part")
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


# Parts of research networks (research/README.md) that a served network never has; a
# checkpoint that sets one is refused rather than loaded without it.
RESEARCH_OPTIONS = ("key_diff", "reach_skip")


def reach_feature(reach: torch.Tensor) -> torch.Tensor:
    """The reach column of ``scalar_features`` (what a network with ``reach`` reads)."""
    return torch.log(reach.clamp_min(0) + 1e-4) / 4


def scalar_features(position, age, attention, value_norm, key_mean, block, reach=None) -> torch.Tensor:
    """[..., N_SCALARS + 1] from per-block arrays (any leading shape, broadcast):
    position/age/block [...], attention/value_norm/reach [...], key_mean [..., d]. Logs
    keep the scales of short and long contexts, 1- and 16-token blocks, close. The
    last column (reach; zeros when not given) is read only by networks with ``reach``."""
    att = torch.log(attention.clamp_min(0) + 1e-4)
    la = torch.log1p(age.clamp_min(0))
    if reach is None:
        reach = torch.zeros_like(attention)
    return torch.stack([
        att / 4,
        (att - la) / 4,                                    # mass per query since the block existed (h2o/age)
        la / 8,
        torch.log1p(position) / 8,
        torch.log(value_norm.clamp_min(0) + 1e-4) / 4,
        torch.log(torch.linalg.vector_norm(key_mean, dim=-1) + 1e-4) / 4,
        torch.log1p(position) - torch.log1p(block),        # ~ log block size
        reach_feature(reach),
    ], -1)


def time_features(position, age, now) -> torch.Tensor:
    """[..., N_TIME] of each block at sequence length ``now`` (a scalar or broadcastable)."""
    since = (now - position).clamp_min(1)
    return torch.stack([torch.log1p(since) / 8, position / now.clamp_min(1),
                        torch.log1p((since - age).clamp_min(0)) / 8], -1)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.SiLU(), nn.Linear(2 * d, d))

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of blocks h [R, n, D] -> 2 x [R, heads, n, D/heads] (cacheable)."""
        R, n, D = h.shape
        k, v = self.kv(self.ln1(h)).view(R, n, 2, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        return k, v

    def query(self, h: torch.Tensor) -> torch.Tensor:
        """Queries of blocks h [R, m, D] -> [R, heads, m, D/heads]."""
        R, m, D = h.shape
        return self.q(self.ln1(h)).view(R, m, self.heads, D // self.heads).transpose(1, 2)

    def finish(self, hq: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Residual + MLP from the attention output a [R, heads, m, D/heads]."""
        R, m, D = hq.shape
        h = hq + self.o(a.transpose(1, 2).reshape(R, m, D))
        return h + self.mlp(self.ln2(h))

    def forward(self, hq: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_mask: torch.Tensor | None = None) -> torch.Tensor:
        """hq [R, m, D] attends over projected blocks k, v (kv_mask [R, n] True = a real block)."""
        mask = None if kv_mask is None else kv_mask[:, None, None, :]
        return self.finish(hq, F.scaled_dot_product_attention(self.query(hq), k, v, attn_mask=mask))


class ValueEstimator(nn.Module):
    def __init__(self, cfg: EstimatorConfig):
        super().__init__()
        self.cfg = cfg
        D = cfg.d_model
        self.n_scalars = N_SCALARS + int(cfg.reach)
        self.key_in = nn.Sequential(nn.LayerNorm(cfg.head_dim), nn.Linear(cfg.head_dim, D))
        self.scalar_in = nn.Sequential(nn.Linear(self.n_scalars, D), nn.SiLU(), nn.Linear(D, D))
        self.layer_emb = nn.Embedding(cfg.num_layers, D)
        self.head_emb = nn.Embedding(cfg.num_kv_heads, D)
        if cfg.cross_rows:
            self.cross_in = nn.Linear(cfg.head_dim + self.n_scalars, cfg.cross_dim)
            self.cross_out = nn.Linear(cfg.num_layers * cfg.num_kv_heads * cfg.cross_dim, D)
            # Zero: a network continued with cross rows starts as the one it continues.
            nn.init.zeros_(self.cross_out.weight)
            nn.init.zeros_(self.cross_out.bias)
        if cfg.prev_block:
            if not cfg.cross_rows:
                raise ValueError("prev_block needs cross_rows (it reads the previous block's cross-row summary)")
            self.prev_out = nn.Linear(cfg.num_layers * cfg.num_kv_heads * cfg.cross_dim, D)
            nn.init.zeros_(self.prev_out.weight)
            nn.init.zeros_(self.prev_out.bias)
        self.blocks = nn.ModuleList(_Block(D, cfg.n_heads) for _ in range(cfg.depth))
        # Per block: a bias and one coefficient per time feature (a learned decay curve).
        self.out = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D), nn.SiLU(),
                                 nn.Linear(D, 1 + N_TIME))

    # ------------------------------------------------------------ pieces
    def embed(self, key_mean, scalars, layer, head, context: int = 0) -> torch.Tensor:
        """key_mean [R, n, d], scalars [R, n, S], layer/head [R] -> h0 [R, n - context, D]:
        the first ``context`` blocks (0 or 1) are the ones just before the blocks
        embedded, given only for prev_block. With cross_rows, R must be every row of
        one sequence (L * Hkv, layer-major)."""
        return self.embed_many([(key_mean, scalars, context)], layer, head)[0]

    def embed_many(self, parts: list, layer, head) -> list[torch.Tensor]:
        """``embed`` of several sequences' blocks [(key_mean, scalars, context), ...]
        (the same rows) in one pass: every layer's call is per block, so each
        sequence's h0 is what ``embed`` gives it alone; only prev_block looks
        across blocks, and never across two sequences."""
        sizes = [p[0].shape[1] for p in parts]
        cat = lambda ts: torch.cat(ts, 1) if len(ts) > 1 else ts[0]
        key_mean, scalars = cat([p[0] for p in parts]), cat([p[1] for p in parts])
        scalars = scalars[..., :self.n_scalars]                              # the reach column if it reads it
        rowe = self.layer_emb(layer) + self.head_emb(head)
        key = self.key_in[0](key_mean)                                     # LayerNorm, shared with the cross rows
        h = self.key_in[1](key) + self.scalar_in(scalars) + rowe[:, None, :]
        if self.cfg.cross_rows:
            R, n, _ = key_mean.shape
            if R != self.cfg.num_layers * self.cfg.num_kv_heads:
                raise ValueError(f"cross-row embedding needs all {self.cfg.num_layers * self.cfg.num_kv_heads} "
                                 f"rows of a sequence, got {R}")
            u = self.cross_in(torch.cat([key, scalars], -1)).permute(1, 0, 2).reshape(n, -1)   # [n, R * e]
            h = h + self.cross_out(u)[None]                                  # the same for every row
            if self.cfg.prev_block:
                before = torch.cat([u.new_zeros(1, u.shape[1]), u[:-1]])    # the first known block has none
                if len(parts) > 1:   # nor does each sequence's first here (its context, if any, is dropped)
                    before[torch.tensor(list(itertools.accumulate(sizes[:-1])))] = 0
                h = h + self.prev_out(before)[None]
        return [x[:, p[2]:] for x, p in zip(h.split(sizes, 1), parts)]

    def curve(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out(hidden)                                             # [R, n, 1 + N_TIME]

    @staticmethod
    def apply_curve(curve: torch.Tensor, tfeat: torch.Tensor) -> torch.Tensor:
        return curve[..., 0] + (curve[..., 1:] * tfeat).sum(-1)

    # ------------------------------------------------------------ full pass
    def forward(self, key_mean, scalars, tfeat, layer, head, mask=None, queries=None) -> torch.Tensor:
        """Training / full re-score. key_mean [R, n, d], scalars [R, n, S],
        tfeat [R, n, T], layer/head [R], mask [R, n] -> scores [R, n].
        queries [R, m] (depth 1 only): score just those blocks of each row,
        every block still a key -> [R, m]. What a long trace's training step
        can afford (O(m n), not O(n^2)), and what serving computes for the
        blocks a row still holds."""
        h = self.embed(key_mean, scalars, layer, head)
        if queries is not None:
            if len(self.blocks) != 1:
                raise ValueError("scoring a subset of blocks needs a depth-1 network")
            blk = self.blocks[0]
            k, v = blk.project(h)
            pick = lambda t: t.gather(1, queries[..., None].expand(-1, -1, t.shape[2]))
            hq = pick(h)
            mask4 = None if mask is None else mask[:, None, None, :]
            a = F.scaled_dot_product_attention(blk.query(hq), k, v, attn_mask=mask4)
            score = self.apply_curve(self.curve(blk.finish(hq, a)), pick(tfeat))
        else:
            for blk in self.blocks:
                h = blk(h, *blk.project(h), mask)
            score = self.apply_curve(self.curve(h), tfeat)
        return score


# ---------------------------------------------------------------- checkpoints
def save(model: ValueEstimator, path: str | Path) -> Path:
    """``estimator.safetensors`` (config in its metadata too) + ``estimator.json``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(tmp), metadata={"kvpop_estimator": model.cfg.to_json()})
    tmp.replace(path)   # atomic: a reloading server never reads half a file
    path.with_suffix(".json").write_text(model.cfg.to_json() + "\n")
    return path


def load(path: str | Path) -> ValueEstimator:
    """ValueError with a message for a missing or unreadable checkpoint."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no estimator checkpoint at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = (f.metadata() or {}).get("kvpop_estimator")
            if meta is None:
                raise ValueError(f"{path} has no kvpop_estimator config in its metadata")
            cfg = EstimatorConfig.from_json(meta)
            state = {k: f.get_tensor(k) for k in f.keys()}
        model = ValueEstimator(cfg)
        model.load_state_dict(state)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file is a config error, not a crash
        raise ValueError(f"cannot load estimator {path}: {e}") from None
    return model.eval()


# ---------------------------------------------------------------- rows
def row_ids(L: int, H: int) -> tuple[torch.Tensor, torch.Tensor]:
    layer = torch.arange(L).repeat_interleave(H)
    head = torch.arange(H).repeat(L)
    return layer, head


def block_inputs(a: dict, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scoring-state arrays (block [n], position [n], age [n], key_mean [n, L, H, d],
    value_norm/attention/reach [n, L, H]) of blocks ``start:`` -> key_mean [R, m, d] and
    scalars [R, m, S], R = L*H rows (layer-major)."""
    t = lambda x: torch.as_tensor(np.asarray(x[start:]), dtype=torch.float32)
    km = t(a["key_mean"])
    m, L, H, d = km.shape
    km = km.permute(1, 2, 0, 3).reshape(L * H, m, d)
    vn = t(a["value_norm"]).permute(1, 2, 0).reshape(L * H, m)
    att = t(a["attention"]).permute(1, 2, 0).reshape(L * H, m)
    reach = t(a["reach"]).permute(1, 2, 0).reshape(L * H, m) if "reach" in a else None   # older traces: none
    pos, age, blk = (t(a[f]).expand(L * H, m) for f in ("position", "age", "block"))
    return km, scalar_features(pos, age, att, vn, km, blk, reach)


def block_times(a: dict, now: float | None = None) -> torch.Tensor:
    """[n, N_TIME] time features at sequence length ``now`` (default: the newest
    submission's position + age, i.e. the length when the latest features were sent)."""
    pos = torch.as_tensor(np.asarray(a["position"]), dtype=torch.float32)
    age = torch.as_tensor(np.asarray(a["age"]), dtype=torch.float32)
    if now is None:
        now = float((pos + age).max()) if len(pos) else 0.0
    return time_features(pos, age, torch.tensor(float(now)))


def rows_from_arrays(a: dict, now: float | None = None):
    """-> (key_mean [R, n, d], scalars [R, n, S], tfeat [R, n, T]) for a full pass."""
    km, sc = block_inputs(a)
    return km, sc, block_times(a, now).expand(km.shape[0], -1, -1)


class LearnedScorer:
    """The cache-manager policy backed by the network (kvpop-style: one ``score``).
    Keeps each sequence's cached hidden states on its SequenceState."""
    name = "learned"

    def __init__(self, model: ValueEstimator, live: bool = True):
        """live=False: depth-1 networks too take the generic path (full passes
        every ``rescore_every`` blocks), for `kvpop bench scoring` to compare."""
        self.model = model.eval()
        self.rescore_every = max(1, model.cfg.rescore_every)
        self.live = live and model.cfg.depth == 1

    @staticmethod
    def _times(a: dict) -> torch.Tensor:
        return block_times(a)[None]                                        # [1, n, T], same for every row

    def compatible(self, L: int, H: int, d: int) -> bool:
        c = self.model.cfg
        return (c.num_layers, c.num_kv_heads, c.head_dim) == (L, H, d)

    @torch.no_grad()
    def score_many(self, seqs: list) -> list[np.ndarray]:
        """``score`` of several sequences, their newcomers' network passes batched
        into one call per layer (each sequence's attention stays its own). A plan
        round of many short plans was a few dozen small tensor operations per
        sequence; a sequence's scores are what ``score`` gives it alone."""
        if not self.live or len(seqs) < 2:
            return [self.score(s) for s in seqs]
        todo = []
        for seq in seqs:
            a = self._arrays(seq)
            n = len(a["key_mean"])
            live, have = self._live(seq, n)
            ctx = int(self.model.cfg.prev_block and have > 0)
            todo.append((seq, a, live, (*block_inputs(a, have - ctx), gone_rows(a), ctx)))
        update_many([t[2] for t in todo], [t[3] for t in todo])
        out = []
        for seq, a, live, _ in todo:
            n, L, H = a["value_norm"].shape
            seq.cache["n"] = n
            s = self.model.apply_curve(live.curves(), self._times(a))   # [R, n]
            out.append(s.view(L, H, n).permute(2, 0, 1).numpy())
        return out

    def _arrays(self, seq) -> dict:
        """The sequence's feature arrays, refused when they are not this network's shape."""
        a = seq.arrays()
        _, L, H, d = a["key_mean"].shape
        if not self.compatible(L, H, d):
            raise ValueError(f"estimator is for L={self.model.cfg.num_layers} Hkv={self.model.cfg.num_kv_heads} "
                             f"d={self.model.cfg.head_dim}, features have L={L} Hkv={H} d={d}")
        return a

    def _live(self, seq, n: int):
        """The sequence's LiveRows (new if its cache is stale) and how many blocks it has seen."""
        c = seq.cache
        if c.get("model") is not self.model or c.get("revision") != seq.revision or c.get("n", 0) > n:
            c.clear()
        live = c.get("live")
        if live is None:
            L, H = self.model.cfg.num_layers, self.model.cfg.num_kv_heads
            live = LiveRows(self.model, *row_ids(L, H), self.rescore_every)
            c.update(model=self.model, revision=seq.revision, live=live)
        return live, c.get("n", 0)

    @torch.no_grad()
    def score(self, seq) -> np.ndarray:
        """[n, L, Hkv] predicted log future importance; low = evict first."""
        a = self._arrays(seq)
        n, L, H, _ = a["key_mean"].shape
        layer, head = row_ids(L, H)
        c = seq.cache
        if c.get("model") is not self.model or c.get("revision") != seq.revision or c.get("n", 0) > n:
            c.clear()
        have = c.get("n", 0)
        if self.live:
            # Exact and incremental: see live_attention.
            live, have = self._live(seq, n)
            ctx = int(self.model.cfg.prev_block and have > 0)
            live.update(*block_inputs(a, have - ctx), gone_rows(a), context=ctx)
            c["n"] = n
            s = self.model.apply_curve(live.curves(), self._times(a))   # [R, n]
            return s.view(L, H, n).permute(2, 0, 1).numpy()
        if not have or n - c["fresh"] >= self.rescore_every:
            # Full pass: every block attends over every other.
            km, sc = block_inputs(a)
            h, kvs = self.model.embed(km, sc, layer, head), []
            for blk in self.model.blocks:
                kvs.append(blk.project(h))
                h = blk(h, *kvs[-1])
            c.update(model=self.model, revision=seq.revision, n=n, fresh=n, kv=kvs, curve=self.model.curve(h))
        elif n > have:
            # New blocks only: at each layer they attend over every known block's
            # cached keys/values (the old ones' deeper layers are stale until the next full pass).
            ctx = int(self.model.cfg.prev_block)
            km, sc = block_inputs(a, have - ctx)
            h = self.model.embed(km, sc, layer, head, context=ctx)
            for i, blk in enumerate(self.model.blocks):
                k, v = blk.project(h)
                c["kv"][i] = (torch.cat([c["kv"][i][0], k], 2), torch.cat([c["kv"][i][1], v], 2))
                h = blk(h, *c["kv"][i])
            c.update(n=n, curve=torch.cat([c["curve"], self.model.curve(h)], 1))
        s = self.model.apply_curve(c["curve"], self._times(a))   # [R, n]
        return s.view(L, H, n).permute(2, 0, 1).numpy()
