"""The estimator's set attention kept exact and cheap as a sequence grows
(networks of depth 1, which is what we ship).

A block's score depends on its embedding and on its attention over every known
block of its row. Re-running that attention for all n blocks at each plan costs
O(n^2) per plan: at 8k tokens with 1-token blocks, 0.6 s per decoded token on
2 cores. Two facts make it cheaper without changing a single score:

- a block a row has evicted gets no score that matters (the plan ranks it
  last), so it stops being a query; it stays a key, because the network was
  trained with every block of the context visible;
- softmax attention splits over keys: each live (row, block) keeps its output
  and log-sum-exp, and a plan merges in attention over only the keys of the
  blocks that arrived since the last one.

So a plan costs O(live x new + new x n) instead of O(n^2), and every live
block's attention is exactly what a full pass would give it. Only the small
MLP after the attention is re-run for the blocks already held every
``refresh_every`` new blocks (newcomers always get theirs), which bounds how
stale a score can be; ``refresh_every=1`` makes every score exact.
"""
from __future__ import annotations

import math

import numpy as np
import torch

# Bound on the score matrix of one chunk in the fallback without the fused kernel (floats): 64 MB.
_CHUNK_ELEMS = 1 << 24
# Score matrices up to this many floats (256 KB) skip the fused kernel: above it the fused kernel
# wins on the CPU (token-level prompt chunks of a few hundred blocks were a third of a plan's time).
_SMALL = 1 << 16


def _direct(q, k, v, scale):
    """Softmax attention of q [R, h, P, dh] over k, v [R, h, N, dh] -> (out [R, h, P, dh],
    log-sum-exp [R, h, P]), the whole score matrix at once."""
    s = (q @ k.transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ v, lse


def _attend_plain(q, k, v, scale):
    """As _direct, in key chunks merged as they come, so the score matrix stays bounded."""
    R, h, P, _ = q.shape
    step = max(1, _CHUNK_ELEMS // max(1, R * h * P))
    out, lse = _direct(q, k[:, :, :step], v[:, :, :step], scale)
    for j in range(step, k.shape[2], step):
        out, lse = _merge(out, lse, *_direct(q, k[:, :, j:j + step], v[:, :, j:j + step], scale))
    return out, lse


def _attend(q, k, v, scale):
    """Attention and its log-sum-exp: small products (a decode step's one
    newcomer, or the one new key for every held block) directly, where the fused
    kernel's per-call cost dominates; large ones through torch's fused CPU kernel
    (6x faster than the chunked loop) when this build has it."""
    R, h, P, _ = q.shape
    if R * h * P * k.shape[2] <= _SMALL:
        return _direct(q, k, v, scale)
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if flash is not None and q.device.type == "cpu":
        try:
            out, lse = flash(q, k, v, scale=scale)[:2]
            return out, lse
        except (RuntimeError, TypeError):
            pass
    return _attend_plain(q, k, v, scale)


def _merge(out1, lse1, out2, lse2):
    """Attention over keys A and over keys B -> attention over A and B."""
    lse = torch.logaddexp(lse1, lse2)
    return out1 * torch.exp(lse1 - lse)[..., None] + out2 * torch.exp(lse2 - lse)[..., None], lse


class LiveRows:
    """Per-sequence state: keys/values of every block, and per row the blocks
    it still holds (slots) with their queries, attention output and its log-sum-exp."""

    def __init__(self, model, layer: torch.Tensor, head: torch.Tensor, refresh_every: int = 1):
        self.model, self.layer, self.head = model, layer, head
        self.refresh_every, self.fresh = max(1, refresh_every), 0
        self.blk = model.blocks[0]
        R, D, nh = len(layer), model.cfg.d_model, model.cfg.n_heads
        dh = D // nh
        self.scale = 1.0 / math.sqrt(dh)
        self.n = 0
        self.k = torch.zeros(R, nh, 0, dh)
        self.v = torch.zeros(R, nh, 0, dh)
        # Slots [R, P]: idx = block's index in the sequence's arrays (-1 = empty).
        self.idx = torch.zeros(R, 0, dtype=torch.long)
        self.h0 = torch.zeros(R, 0, D)
        self.q = torch.zeros(R, nh, 0, dh)
        self.out = torch.zeros(R, nh, 0, dh)
        self.lse = torch.zeros(R, nh, 0)
        self.curve = torch.zeros(R, 0, model.out[-1].out_features)

    def _append_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        need = self.n + k.shape[2]
        if need > self.k.shape[2]:          # amortised growth: no re-stacking per plan
            cap = max(need, 2 * self.k.shape[2], 64)
            grow = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], cap - t.shape[2], t.shape[3])], 2)
            self.k, self.v = grow(self.k), grow(self.v)
        self.k[:, :, self.n:need] = k
        self.v[:, :, self.n:need] = v
        self.n = need

    def _take(self, cols: torch.Tensor) -> None:
        """Keep slot columns cols [R, P'] (per row)."""
        g2 = lambda t: t.gather(1, cols)
        g3 = lambda t: t.gather(1, cols[..., None].expand(-1, -1, t.shape[2]))
        c = cols[:, None].expand(-1, self.q.shape[1], -1)
        self.idx, self.h0, self.curve = g2(self.idx), g3(self.h0), g3(self.curve)
        self.lse = self.lse.gather(2, c)
        self.q = self.q.gather(2, c[..., None].expand(-1, -1, -1, self.q.shape[3]))
        self.out = self.out.gather(2, c[..., None].expand(-1, -1, -1, self.out.shape[3]))

    def _drop_gone(self, gone: torch.Tensor) -> None:
        """gone [R, n] True where the row evicted the block: those slots stop being
        queries. Emptied slots are compacted away once they are a quarter of the
        width (compacting at every decode step cost more than it saved)."""
        if self.idx.shape[1] == 0:
            return
        live = (self.idx >= 0) & ~gone.gather(1, self.idx.clamp_min(0))
        self.idx = torch.where(live, self.idx, torch.full_like(self.idx, -1))
        width = int(live.sum(1).max())
        if 4 * (self.idx.shape[1] - width) <= self.idx.shape[1]:
            return
        order = live.to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :width]
        self._take(order)

    def update(self, km: torch.Tensor, sc: torch.Tensor, gone: torch.Tensor, context: int = 0) -> None:
        """km [R, m, d], sc [R, m, S]: features of the blocks that arrived since the
        last update, after ``context`` blocks known before (ValueEstimator.embed);
        gone [R, n] (n = blocks known after them)."""
        update_many([self], [(km, sc, gone, context)])

    def _take_newcomers(self, h0, k, v, q, gone) -> torch.Tensor:
        """Fold in the newcomers' h0 [R, m, D] and projections: blocks held see their
        keys, they see every block known (themselves included). -> their attention
        output [R, heads, m, dh] (their curves are the caller's)."""
        if self.idx.shape[1]:               # blocks already held see the newcomers' keys
            self.out, self.lse = _merge(self.out, self.lse, *_attend(self.q, k, v, self.scale))
        first, m = self.n, h0.shape[1]
        self._append_kv(k, v)
        out, lse = _attend(q, self.k[:, :, :self.n], self.v[:, :, :self.n], self.scale)
        R = len(self.layer)
        new_idx = torch.arange(first, first + m).expand(R, m)
        new_idx = torch.where(gone[:, first:first + m], torch.full_like(new_idx, -1), new_idx)
        self.idx = torch.cat([self.idx, new_idx], 1)
        self.h0 = torch.cat([self.h0, h0], 1)
        self.q = torch.cat([self.q, q], 2)
        self.out, self.lse = torch.cat([self.out, out], 2), torch.cat([self.lse, lse], 2)
        return out

    def _curve(self, h0, out):
        return self.model.curve(self.blk.finish(h0, out))

    def curves(self) -> torch.Tensor:
        """[R, n, C] per-block curves; blocks a row evicted get zeros (ranked last anyway)."""
        R, P, C = self.curve.shape
        out = torch.zeros(R, self.n + 1, C)
        col = torch.where(self.idx >= 0, self.idx, torch.full_like(self.idx, self.n))   # a scratch column
        out.scatter_(1, col[..., None].expand(-1, -1, C), self.curve)
        return out[:, :self.n]


def update_many(lives: list[LiveRows], inputs: list[tuple]) -> None:
    """``LiveRows.update`` of several sequences (one network): inputs (km, sc,
    gone, context) each. The per-block layers (embedding, projections, the MLP
    and curve head) run once over every sequence's blocks together; each
    sequence's attention is its own. Per-block layers give a block the same
    output whatever else is in the call, so a sequence's scores do not depend
    on which others were planned with it."""
    for live, (_, _, gone, _) in zip(lives, inputs):
        live._drop_gone(gone[:, :live.n])
    todo = [(live, inp) for live, inp in zip(lives, inputs) if inp[0].shape[1] - inp[3] > 0]
    if not todo:
        return
    first = todo[0][0]
    model, blk = first.model, first.blk
    cat = lambda ts, dim: torch.cat(ts, dim) if len(ts) > 1 else ts[0]
    h0s = model.embed_many([(km, sc, ctx) for _, (km, sc, _, ctx) in todo], first.layer, first.head)
    sizes = [h.shape[1] for h in h0s]
    h0 = cat(h0s, 1)
    k, v = blk.project(h0)
    q = blk.query(h0)
    outs = [live._take_newcomers(h, kk, vv, qq, inp[2])
            for (live, inp), h, kk, vv, qq in zip(todo, h0s, k.split(sizes, 2), v.split(sizes, 2), q.split(sizes, 2))]
    # Every held block's curve is re-run every refresh_every new blocks (the newcomers' with
    # them); in between only the newcomers get theirs.
    fresh = [live.n - live.fresh >= live.refresh_every for live, _ in todo]
    new = [(live, h, o) for (live, _), h, o, f in zip(todo, h0s, outs, fresh) if not f]
    if new:
        curves = first._curve(cat([h for _, h, _ in new], 1), cat([o for _, _, o in new], 2))
        for (live, _, _), c in zip(new, curves.split([h.shape[1] for _, h, _ in new], 1)):
            live.curve = torch.cat([live.curve, c], 1)
    full = [live for (live, _), f in zip(todo, fresh) if f]
    if full:
        curves = first._curve(cat([lv.h0 for lv in full], 1), cat([lv.out for lv in full], 2))
        for live, c in zip(full, curves.split([lv.h0.shape[1] for lv in full], 1)):
            live.curve, live.fresh = c, live.n


def gone_rows(a: dict) -> torch.Tensor:
    """The scoring state's gone [n, L, H] as [R, n] (layer-major rows)."""
    g = a.get("gone")
    n, L, H = a["value_norm"].shape
    if g is None:
        return torch.zeros(L * H, n, dtype=torch.bool)
    return torch.from_numpy(np.ascontiguousarray(g)).permute(1, 2, 0).reshape(L * H, n)
