"""Dense traces of the served model -> training examples for the estimator.

One forward over prompt + reference solution (TRAIN seeds only) with an
attention function that hands over its probabilities one query chunk at a
time, summed per block and folded into running sums over queries
C[h, t, b] = sum_{q < t} P[h, q, b], kept only at the times a feature or a
target reads (memory O(chunk x T), not O(T^2): 8k-token traces fit). Per block:

- features as compute sends them when the block leaves the protected recent
  window (same sink / recent / block size / prefill chunking as serving):
  attention = C at the submission step summed over the block, averaged over
  the G query heads (the engine's block mass), key_mean / value_norm of the
  post-RoPE keys / values, position, age, and reach (the peak mean block mass
  of the block's own queries on one block outside their recent window);
- at sampled decision times t (the steps at which features arrive, when the
  cache-manager re-plans; with ``every_step`` every decode step, knowing the
  blocks sent so far), the target of every known block = the attention
  mass it receives from the next ``horizon`` queries, averaged over those
  queries per query head (``target="mean"``, KVpop) or their peak
  (``"max"``), then the max over the G heads of its kv-head.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from kvpop.runtime.config import PREFILL_CHUNK


@dataclass
class TraceConfig:
    block_size: int = 1
    sink: int = 4
    recent: int = 8
    horizon: int = 128
    prefill_chunk: int = PREFILL_CHUNK      # compute's: chunk ends are where prompt rounds happen
    snapshots: int = 16          # decision times sampled per sequence
    query_chunk: int = 256
    target: str = "mean"         # over the horizon's queries: "mean" mass (KVpop) or "max" (peak need)
    decode_only: bool = False    # the horizon counts the queries that write the continuation only
    plan_interval: int = 1       # tokens: compute's plan interval (decode features go in batches this long)
    every_step: bool = False     # decode decisions at every step, not only where features arrive
    answer_weight: float = 0.0   # "mean" target + this x the mean over the continuation's queries alone


def step_ends(prompt_len: int, total: int, prefill_chunk: int) -> list[int]:
    """Sequence lengths at the end of each engine step: prompt chunks, then one token per step."""
    ends = list(range(min(prefill_chunk, prompt_len), prompt_len, prefill_chunk)) + [prompt_len]
    return sorted(set(ends)) + list(range(prompt_len + 1, total + 1))


def submission_times(ends: list[int], nblocks: int, cfg: TraceConfig, prompt_len: int = 0) -> np.ndarray:
    """[nblocks] step end at which each block is sent (-1: never / a sink block),
    following compute's ``blocks_leaving``: after ``prompt_len``, in
    batches of the plan interval's blocks."""
    bs, sink_blocks = cfg.block_size, math.ceil(cfg.sink / cfg.block_size)
    every = max(1, -(-cfg.plan_interval // bs))
    t_sub = np.full(nblocks, -1, np.int64)
    sent = sink_blocks
    for n in ends:
        upto = max(0, (n - cfg.recent) // bs) if cfg.recent > 0 else n // bs
        if n > prompt_len and upto - sent < every:
            continue
        upto = min(upto, nblocks)
        if upto > sent:
            t_sub[sent:upto] = n
            sent = upto
    return t_sub


class ChunkRecorder:
    """AttentionFn for TransformerModel.forward that hands each query chunk's
    attention, summed per block, to ``on_chunk(layer, start, mass [Hq, c,
    nblocks])`` and each layer's keys/values to ``on_layer(layer, k, v)``.
    Never holds more than one chunk's probabilities: [Hq, c, T], where the
    whole map was [Hq, T, T] (2.4 GB per layer at 8k tokens on SmolLM2)."""

    def __init__(self, on_chunk, on_layer, query_chunk: int, block_size: int, nblocks: int):
        self.on_chunk, self.on_layer, self.chunk = on_chunk, on_layer, query_chunk
        self.bs, self.nblocks = block_size, nblocks

    def __call__(self, layer, q, k, v):
        T, Hq, d = q.shape
        Hkv = k.shape[1]
        G = Hq // Hkv
        scale = 1.0 / math.sqrt(d)
        kf, vf = k.float().transpose(0, 1), v.float().transpose(0, 1)            # [Hkv, T, d]
        out = torch.empty(T, Hq, d, device=q.device)
        pos = torch.arange(T, device=q.device)
        span = self.nblocks * self.bs
        for s in range(0, T, self.chunk):
            e = min(T, s + self.chunk)
            qh = q[s:e].float().view(e - s, Hkv, G, d).permute(1, 2, 0, 3)         # [Hkv, G, c, d]
            logits = torch.einsum("hgcd,htd->hgct", qh, kf) * scale
            logits.masked_fill_(pos[None, None, None, :] > pos[s:e, None][None, None], float("-inf"))
            p = torch.softmax(logits, -1)
            out[s:e] = torch.einsum("hgct,htd->hgcd", p, vf).permute(2, 0, 1, 3).reshape(e - s, Hq, d)
            self.on_chunk(layer, s, p.reshape(Hq, e - s, T)[..., :span].reshape(Hq, e - s, self.nblocks, self.bs)
                          .sum(-1))
        self.on_layer(layer, k.float(), v.float())
        return out.to(q.dtype)


class _PrefixSums:
    """C[:, t] = block mass from the queries before t, kept only at the times
    asked for, and per window (only those asked for: the "max" target) the
    peak over its queries, from chunks in query order."""

    def __init__(self, Hq: int, nblocks: int, times: set[int], windows: list[tuple[int, int]], device="cpu"):
        self.colsum = torch.zeros(Hq, nblocks, device=device)
        self.times = sorted(times)
        self.at = {t: torch.zeros(Hq, nblocks, device=device) for t in self.times if t == 0}
        self.windows = windows
        self.peak = [torch.zeros(Hq, nblocks, device=device) for _ in windows]

    def add(self, s: int, mass: torch.Tensor) -> None:
        e = s + mass.shape[1]
        cs = mass.cumsum(1)
        for t in self.times:
            if s < t <= e:
                self.at[t] = self.colsum + cs[:, t - s - 1]
        for i, (w0, w1) in enumerate(self.windows):
            lo, hi = max(s, w0), min(e, w1)
            if lo < hi:
                self.peak[i] = torch.maximum(self.peak[i], mass[:, lo - s:hi - s].amax(1))
        self.colsum += cs[:, -1]


@torch.no_grad()
def trace(model, ids: list[int], prompt_len: int, cfg: TraceConfig, rng: random.Random,
          answer_len: int | None = None) -> dict | None:
    """One training example (dict of numpy arrays) or None if no decision has a future.
    ``answer_len``: how many continuation tokens are the answer's content (the
    answer weight counts only the queries that write them; default: all)."""
    mc = model.config
    L, Hq, Hkv, d = mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim
    G, bs, T = Hq // Hkv, cfg.block_size, len(ids)
    nblocks = T // bs                                      # full blocks only
    ends = step_ends(prompt_len, T, cfg.prefill_chunk)
    t_sub = submission_times(ends, nblocks, cfg, prompt_len)
    known = np.nonzero(t_sub >= 0)[0]
    if len(known) < 2:
        return None
    # Decision times: when features arrive and the future is not empty; the
    # prompt's chunk ends always (they decide what of the prompt survives).
    times = sorted({int(t) for t in t_sub[known] if t < T})
    chunk_ends = [t for t in times if t <= prompt_len]
    rest = [t for t in times if t > prompt_len]
    if cfg.every_step and times:
        # Every decode step, each with the blocks sent so far (features still
        # arrive in plan-interval batches): more decisions per trace.
        rest = [t for t in ends if t > prompt_len and times[0] <= t < T]
    pick = chunk_ends + sorted(rng.sample(rest, min(len(rest), max(0, cfg.snapshots - len(chunk_ends)))))
    if not pick:
        return None
    nk = [int((t_sub[known] <= t).sum()) for t in pick]
    first = int(known[0])
    att = np.zeros((len(known), L, Hkv), np.float32)
    rch = np.zeros((len(known), L, Hkv), np.float32)
    reach_q: dict[int, torch.Tensor] = {}                  # layer -> [Hkv, T] each query's reach
    km = np.zeros((len(known), L, Hkv, d), np.float32)
    vn = np.zeros((len(known), L, Hkv), np.float32)
    targets = [np.zeros((L, Hkv, k), np.float32) for k in nk]
    blocks = torch.as_tensor(known)
    # The future each decision is judged on: queries [s0, e).
    # The continuation's queries start at the prompt's last token: its query
    # writes the first answer token (a registers answer reads its value there,
    # in prefill). Starting at the prompt's end left that read out of the target.
    first_answer_query = prompt_len - 1
    # The answer's queries stop at its content: the queries that write an end marker
    # (`.`, EOS) and the EOS position's (never run in serving) look at the writes'
    # `;` and not at what the question asked, and weighing them paid `;` more than
    # the commits a question might ask (docs/design/estimator.md, "Training data").
    answer_end = T if answer_len is None else min(T, first_answer_query + max(1, answer_len))
    windows, answer = [], []
    for t in pick:
        s0 = max(t, first_answer_query) if cfg.decode_only else t
        windows.append((s0, min(T, s0 + cfg.horizon)))
        answer.append((max(t, first_answer_query), min(windows[-1][1], answer_end)))   # the answer's queries in it
    weigh = cfg.answer_weight > 0 and cfg.target == "mean"
    need = ({int(t) for t in t_sub[known]} | {w for win in windows for w in win}
            | ({w for win in answer for w in win} if weigh else set()))
    sums: dict[int, _PrefixSums] = {}

    far_end = torch.arange(1, nblocks + 1) * bs - 1                    # each block's last position

    def on_chunk(layer, s, mass):
        if layer not in sums:
            sums[layer] = _PrefixSums(Hq, nblocks, need, windows if cfg.target == "max" else [], mass.device)
            reach_q[layer] = torch.zeros(Hkv, T, device=mass.device)
        sums[layer].add(s, mass)
        # Reach as compute measures it (Sequence.reach_peak): the kv-head's mean block
        # mass of each query, its peak over blocks wholly outside the recent window.
        e = s + mass.shape[1]
        qpos = torch.arange(s, e, device=mass.device)
        far = far_end.to(mass.device)[None, :] < (qpos - cfg.recent)[:, None]       # [c, nblocks]
        m = mass.view(Hkv, G, e - s, nblocks).mean(1)
        reach_q[layer][:, s:e] = torch.where(far[None], m, torch.zeros((), device=m.device)).amax(-1)

    def on_layer(layer, k, v):
        ps = sums.pop(layer)
        # Features at submission: the engine averages block mass over the G heads.
        dev = k.device
        sub = torch.zeros(Hq, len(known), device=dev)
        for t in np.unique(t_sub[known]):
            j = np.nonzero(t_sub[known] == t)[0]
            sub[:, torch.as_tensor(j, device=dev)] = ps.at[int(t)][:, torch.as_tensor(known[j], device=dev)]
        att[:, layer] = sub.view(Hkv, G, -1).mean(1).T.cpu().numpy()
        on = blocks.to(dev)
        # A block's reach: the peak over its own tokens' queries.
        rq = reach_q.pop(layer)[:, : nblocks * bs].view(Hkv, nblocks, bs).amax(-1)
        rch[:, layer] = rq[:, on].T.cpu().numpy()
        kb = k[: nblocks * bs].view(nblocks, bs, Hkv, d).mean(1)[on]        # [nknown, Hkv, d]
        vb = torch.linalg.vector_norm(v[: nblocks * bs], dim=-1).view(nblocks, bs, Hkv).mean(1)[on]
        km[:, layer], vn[:, layer] = kb.cpu().numpy(), vb.cpu().numpy()
        for i, ((s0, e), k_) in enumerate(zip(windows, nk)):
            if cfg.target == "max":
                fut = ps.peak[i][:, on[:k_]]
            else:
                fut = (ps.at[e][:, on[:k_]] - ps.at[s0][:, on[:k_]]) / (e - s0)   # [Hq, k]
                a0, a1 = answer[i]
                if weigh and a0 < a1:
                    fut = fut + cfg.answer_weight * (ps.at[a1][:, on[:k_]] - ps.at[a0][:, on[:k_]]) / (a1 - a0)
            targets[i][layer] = fut.view(Hkv, G, k_).amax(1).cpu().numpy()

    rec = ChunkRecorder(on_chunk, on_layer, cfg.query_chunk, bs, nblocks)
    x = torch.as_tensor(ids, dtype=torch.long, device=model.device)
    model(x, torch.arange(T, device=model.device), rec)
    return {
        "block": known.astype(np.int32), "position": (known * bs).astype(np.int64),
        "age": (t_sub[known] - known * bs).astype(np.float32),
        "key_mean": km, "value_norm": vn, "attention": att, "reach": rch,
        "times": np.asarray(pick, np.int64), "known": np.asarray(nk, np.int64),
        "targets": targets, "block_size": bs, "first_block": first, "length": T, "prompt_len": prompt_len,
    }


def task_traces(model, n: int, cfg_choices: list[TraceConfig], seed: int = 0, min_len: int = 256,
                max_len: int = 1280, progress: bool = True, seconds: float | None = None,
                families: list[str] | None = None) -> list[dict]:
    """Traces of ``n`` task instances from the TRAIN seed range (every family in
    turn, or the ``families`` cycle, e.g. one with recall twice), each with one
    (block size, recent) setting drawn from ``cfg_choices``."""
    from kvpop.tasks.suite import FAMILIES
    from kvpop.tasks.vocab import EOS_ID, VOCAB
    from kvpop.training.data import train_instance

    PERIOD_ID = VOCAB["."]
    # A cycle of its own draws from a stream of its own (the recall-enriched traces
    # of the shipped default estimator were drawn from this one).
    rng = random.Random(f"estimator-traces:{seed}" if families is None else f"estimator-traces-mix:{seed}")
    fams = list(families or FAMILIES)

    def items():
        for i in range(n):
            inst = train_instance(fams[i % len(fams)], rng.randrange(1_000_000_000), rng.randint(min_len, max_len), rng)
            # depends: prompt positions the answer needs; the answer's content is the
            # solution less its end markers (`.`, EOS).
            sol = inst.solution_ids
            content = len(sol) - 2 if sol[-2:] == [PERIOD_ID, EOS_ID] else None
            yield inst.family, inst.prompt_ids, sol, inst.depends, content
    return _trace_all(model, items(), cfg_choices, rng, progress, "traces", n, seconds)


# Real-text instances for training come from seeds no test set uses (test sets
# draw seed * 100_000 + length * 10 + i, far below this).
REAL_TRAIN_SEED_BASE = 1_000_000_000


def _trace_all(model, items, cfg_choices, rng, progress: bool, desc: str, total: int | None = None,
               seconds: float | None = None) -> list[dict]:
    """items: iterable of (family, prompt ids, continuation ids, depends, answer_len) -> traces;
    with ``seconds``, what is traced by then (a budget on a machine lent for minutes)."""
    import time

    from tqdm import tqdm

    out, t0 = [], time.monotonic()
    for fam, prompt, cont, deps, answer_len in tqdm(items, desc=desc, total=total, disable=not progress,
                                                    dynamic_ncols=True, mininterval=2):
        if seconds is not None and time.monotonic() - t0 > seconds:
            print(f"trace budget of {seconds:.0f} s spent: {len(out)} traces")
            break
        ex = trace(model, prompt + cont, len(prompt), rng.choice(cfg_choices), rng, answer_len)
        if ex is not None:
            ex["family"] = fam
            if deps is not None:
                ex["depends"] = np.asarray(deps, np.int64)
            out.append(ex)
    return out


def real_traces(model, tokenizer, n: int, cfg_choices: list[TraceConfig], seed: int = 0, min_len: int = 512,
                max_len: int = 2048, progress: bool = True, seconds: float | None = None,
                text_sources: tuple[str, ...] = ("generator",)) -> list[dict]:
    """Traces of ``n`` real-text retrieval instances (kvpop/tasks/ruler.py, every
    family in turn, from training seeds, the haystack from each of
    ``text_sources`` in turn), chat-rendered for ``model``'s template, each the
    prompt followed by the reference answer. A held-out source is refused: it
    is the yardstick for text no network was trained on."""
    from kvpop.tasks import ruler
    from kvpop.tasks.sources import catalog as sources

    held = [s for s in text_sources if sources.check(s) in sources.HELD_OUT]
    if held or not text_sources:
        raise ValueError(f"trace from training sources ({', '.join(sources.TRAINING)}), not "
                         f"{', '.join(held) or 'none'}: {', '.join(sources.HELD_OUT)} are held out of training")
    rng = random.Random(f"estimator-real-traces:{seed}")
    fams = list(ruler.FAMILIES)

    def items():
        for i in range(n):
            inst = ruler.generate(fams[i % len(fams)], REAL_TRAIN_SEED_BASE + seed * 1_000_000 + i,
                                  rng.randint(min_len, max_len), tokenizer,
                                  source=text_sources[(i // len(fams)) % len(text_sources)])
            yield inst.family, inst.prompt_ids, inst.solution_ids, None, None
    return _trace_all(model, items(), cfg_choices, rng, progress, "real-text traces", n, seconds)


def prompt_file_traces(model, tokenizer, path, cfg_choices: list[TraceConfig], seed: int = 0,
                       progress: bool = True) -> list[dict]:
    """Traces of a user's own prompts: a JSONL file whose lines hold ``prompt``
    (text, completed as it is) or ``messages`` (a chat, rendered with the
    model's template), and optionally ``completion`` (text that follows: the
    answer the traces' targets look at; without it only the prompt's own
    later queries define a block's future need)."""
    import json

    rows = []
    with open(path) as f:
        for k, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{k}: not JSON ({e})") from None
            if "messages" in row:
                prompt = tokenizer.encode_chat(row["messages"])
            elif "prompt" in row:
                prompt = tokenizer.encode(row["prompt"])
            else:
                raise ValueError(f"{path}:{k}: needs 'prompt' or 'messages'")
            cont = tokenizer.encode(row["completion"], add_bos=False) if row.get("completion") else []
            rows.append(("prompts", prompt, cont, None, None))
    rng = random.Random(f"estimator-file-traces:{seed}")
    return _trace_all(model, rows, cfg_choices, rng, progress, "prompt-file traces")
