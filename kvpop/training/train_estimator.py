"""`kvpop train-estimator`: dense traces of the served model on TRAIN-seed
task instances -> the value-estimation network, trained with a rank-aware
loss within each (layer, kv-head) row of each decision:

- listwise: KL from the true future-attention distribution over the row's
  blocks to softmax(scores) (what matters most is the top, which holds the mass);
- pairwise logistic on sampled block pairs, weighted by their log-target gap
  (orders the tail too).

Held out: whole sequences. Metric: mass@k = future attention kept by the
predicted top-k / kept by the true top-k, at k = 1/2, 1/4, 1/8, 1/16 of the
known blocks (the eval's compressions), for the network and for the
heuristics it must beat (h2o = attention so far, attention per age, recency).
Writes the checkpoint + its JSON config, and a loss-curve PNG beside it.
"""
from __future__ import annotations

import argparse
import json
import math
import pickle
import random
import time
from pathlib import Path

import numpy as np

from kvpop.runtime.config import PLAN_INTERVAL, PREFILL_CHUNK
from kvpop.models.fetch import model_arg

KEEP_FRACTIONS = (0.5, 0.25, 0.125, 0.0625)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="models/default", type=model_arg,
                   help="served model folder (HF layout), or a fetched name (smollm2-135m)")
    p.add_argument("--out", default=None, help="checkpoint path (default: MODEL/estimator.safetensors)")
    p.add_argument("--sources", default="generator",
                   help="--suite real: comma-separated haystack text sources, each in turn (kvpop/tasks/sources/): "
                        "generator, docstrings, code, dialogue; the held-out reference and licenses are refused")
    p.add_argument("--suite", choices=("tasks", "real"), default="tasks",
                   help="what to trace: tasks (the default model's task families) or real (long-context "
                        "retrieval on real text for a chat model, as `kvpop eval --suite real`, training seeds)")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                   help="trace your own prompts instead: one JSON object per line with 'prompt' or 'messages', "
                        "and optionally 'completion'")
    p.add_argument("--n", type=int, default=160, help="instances to trace (TRAIN seeds)")
    p.add_argument("--minutes", type=float, default=10.0, help="training wall-clock budget")
    p.add_argument("--block-sizes", default="1,16", help="block sizes to trace (one drawn per sequence)")
    p.add_argument("--serves-block-sizes", default=None, metavar="B[,B]",
                   help="the block sizes this network is for, beside others in the model folder (the cache-manager "
                        "routes a sequence at one of them to it; the others take the rest); default: any, or --init's")
    p.add_argument("--recent", default="8,32", help="recent windows to trace (one drawn per sequence)")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--horizon", type=int, default=1024,
                   help="future queries that define a block's importance (1024: the rest of a task sequence, as KVpop)")
    p.add_argument("--target", choices=("mean", "max"), default="mean",
                   help="aggregate of a block's attention over the horizon's queries")
    p.add_argument("--decode-only", action="store_true",
                   help="targets count only generated positions' attention (not the rest of the prompt)")
    p.add_argument("--answer-weight", type=float, default=0.0, metavar="W",
                   help="mean targets add W x the mean attention of the queries that write the answer (from "
                        "the prompt's last token on; in task traces its content, not the `.` and EOS after it): weights what the answer needs at the prompt's earlier "
                        "chunk ends (the shipped default network: 8)")
    p.add_argument("--plan-interval", type=int, default=PLAN_INTERVAL,
                   help="compute's plan interval in tokens (decode features are sent in batches this long)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help="compute's prompt chunk in tokens (KVPOP_PREFILL_CHUNK): the prompt's decision points; "
                        "a network serves best at the chunk it was traced with")
    p.add_argument("--decisions", type=int, default=16, help="decode-time decisions sampled per traced sequence")
    p.add_argument("--every-step", action="store_true",
                   help="decode-time decisions at every decode step (each knowing the blocks sent so far), "
                        "not only at the steps where features arrive (one in --plan-interval)")
    p.add_argument("--min-len", type=int, default=256, help="shortest traced prompt")
    p.add_argument("--max-len", type=int, default=1280, help="longest traced prompt")
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--depth", type=int, default=1, help="self-attention layers")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--pair-weight", type=float, default=1.0, metavar="P",
                   help="weight of the pairwise term beside the listwise one (it orders the tail; with a "
                        "two-valued target, e.g. an answer that is asked or not, it pulls toward the median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--traces", default=None, help="cache file: loaded if it exists, else written after tracing")
    p.add_argument("--trace-only", action="store_true",
                   help="write the --traces file and stop (trace once, train later, e.g. with several settings)")
    p.add_argument("--held-out", type=int, default=None, metavar="K",
                   help="sequences held out for validation (default: an eighth of the traces)")
    p.add_argument("--device", default="cpu", help="where tracing and training run: cpu, cuda or auto")
    p.add_argument("--trace-minutes", type=float, default=None,
                   help="stop tracing after this long and train on what was traced (of --n at most)")
    p.add_argument("--families", default=None, metavar="F1,F2,...",
                   help="--suite tasks: the family cycle traced in turn (default: every family once; e.g. "
                        "registers,arithmetic,recall,passkey,recall for 40%% recall)")
    p.add_argument("--cross-rows", action="store_true",
                   help="each block also sees a summary of its features in every row of the sequence "
                        "(with --init: added to that network, starting as it was)")
    p.add_argument("--reach", action="store_true",
                   help="each block also sees its reach: the peak attention its own queries paid to one block "
                        "outside their recent window (with --init: added to that network, starting as it was)")
    p.add_argument("--prev-block", action="store_true",
                   help="each block also sees the cross-row summary of the block before it (needs --cross-rows or "
                        "an --init network with it; with --init: added to that network, starting as it was)")
    p.add_argument("--init", default=None, metavar="CHECKPOINT",
                   help="continue training from this estimator (its d_model and depth win); it is kept "
                        "unless training beats it on the held-out traces")


# ------------------------------------------------------------------ data
def decision(ex: dict, i: int):
    """Inputs and target of decision i of a trace: (arrays of the known blocks, now, target [L, H, k])."""
    k = int(ex["known"][i])
    a = {f: ex[f][:k] for f in ("block", "position", "age", "key_mean", "value_norm", "attention", "reach")
         if f in ex}                                                     # traces before reach have none
    return a, float(ex["times"][i]), ex["targets"][i]


def as_rows(target: np.ndarray):
    import torch
    L, H, k = target.shape
    return torch.as_tensor(target).reshape(L * H, k)


def losses(scores, target, gen=None):
    """scores, target [R, n] -> (listwise KL, pairwise logistic)."""
    import torch
    import torch.nn.functional as F

    p = target.clamp_min(0) + 1e-9
    p = p / p.sum(-1, keepdim=True)
    kl = (p * (p.log() - F.log_softmax(scores, -1))).sum(-1).mean()
    R, n = target.shape
    P = min(8 * n, 2048)
    i = torch.randint(n, (R, P), generator=gen, device=target.device)
    j = torch.randint(n, (R, P), generator=gen, device=target.device)
    ly = torch.log(target.clamp_min(0) + 1e-6)
    d = ly.gather(1, i) - ly.gather(1, j)
    w = d.abs().clamp(max=2.0)
    ds = scores.gather(1, i) - scores.gather(1, j)
    pair = (w * F.softplus(-torch.sign(d) * ds)).sum() / w.sum().clamp_min(1e-6)
    return kl, pair


QUERY_SAMPLE = 1024   # blocks per row a training step scores (a long trace's decisions know up to 8k)


def needed_blocks(ex: dict, blocks) -> np.ndarray:
    """Which of ``blocks`` hold a token the trace's answer needs (none without depends)."""
    deps = ex.get("depends")
    if deps is None:
        return np.zeros(len(blocks), bool)
    return np.isin(blocks, np.unique(np.asarray(deps) // ex["block_size"]))


def query_sample(target, gen, m: int = QUERY_SAMPLE):
    """[R, m] blocks of each row to score in a training step, or None when the row
    has at most m: the row's top m/8 by target (where the listwise loss's mass
    is) and the rest drawn at random. Keys stay every block, so each scored
    block sees the context it sees in serving; the step costs O(m n), not O(n^2)."""
    import torch

    R, n = target.shape
    if n <= m:
        return None
    top = target.topk(m // 8, dim=1).indices
    rest = torch.rand(R, n, generator=gen, device=target.device)
    rest.scatter_(1, top, -1.0)                       # never drawn twice
    return torch.cat([top, rest.topk(m - m // 8, dim=1).indices], 1)


def mass_at_k(pred: np.ndarray, target: np.ndarray) -> dict[float, float]:
    """pred, target [R, n]: mean over rows of (true mass of the predicted top-k) /
    (true mass of the true top-k), per keep fraction."""
    out = {}
    R, n = target.shape
    best = -np.sort(-target, axis=1)
    order = np.argsort(-pred, axis=1, kind="stable")
    for f in KEEP_FRACTIONS:
        k = max(1, int(round(f * n)))
        got = np.take_along_axis(target, order[:, :k], 1).sum(1)
        top = best[:, :k].sum(1)
        out[f] = float(np.mean(np.where(top > 0, got / np.maximum(top, 1e-12), 1.0)))
    return out


def needed_at_k(pred: np.ndarray, needed: np.ndarray) -> dict[float, float]:
    """pred [R, n], needed [n] bool (blocks holding positions the task's answer
    depends on): mean over rows of the share of needed blocks in the predicted top-k."""
    R, n = pred.shape
    order = np.argsort(-pred, axis=1, kind="stable")
    out = {}
    for f in KEEP_FRACTIONS:
        k = max(1, int(round(f * n)))
        out[f] = float(needed[order[:, :k]].sum(1).mean() / needed.sum())
    return out


def baselines(a: dict, now: float) -> dict[str, np.ndarray]:
    """Heuristic scores [R, n] on the same rows (higher = keep)."""
    n, L, H = a["attention"].shape
    att = a["attention"].transpose(1, 2, 0).reshape(L * H, n)
    age = a["age"][None, :]
    return {"h2o": att, "attention_per_age": att / (age + 1.0),
            "recency": np.broadcast_to(a["position"][None, :].astype(np.float32), (L * H, n))}


def _on(device, *xs):
    return [x.to(device, non_blocking=True) for x in xs]


def evaluate(model, data: list[dict], pair_weight: float = 1.0) -> dict:
    import torch

    from services.cache_manager.estimator import row_ids, rows_from_arrays

    sums: dict[str, dict[float, float]] = {}
    needs: dict[str, dict[float, float]] = {}
    count, n_needed, total_loss = 0, 0, 0.0
    model.eval()
    dev = next(model.parameters()).device
    with torch.no_grad():
        for ex in data:
            for i in range(len(ex["times"])):
                a, now, tgt = decision(ex, i)
                L, H = tgt.shape[:2]
                km, sc, tf, layer, head, y = _on(dev, *rows_from_arrays(a, now), *row_ids(L, H), as_rows(tgt))
                s = model(km, sc, tf, layer, head)
                kl, pair = losses(s, y, torch.Generator(dev).manual_seed(i))
                total_loss += float(kl + pair_weight * pair)
                needed = needed_blocks(ex, a["block"])
                y = y.cpu()
                preds = {"learned": s.cpu().numpy(), **baselines(a, now)}
                for name, pr in preds.items():
                    m = mass_at_k(pr, y.numpy())
                    acc = sums.setdefault(name, {f: 0.0 for f in KEEP_FRACTIONS})
                    for f in KEEP_FRACTIONS:
                        acc[f] += m[f]
                    if needed.any():
                        r = needed_at_k(pr, needed)
                        nacc = needs.setdefault(name, {f: 0.0 for f in KEEP_FRACTIONS})
                        for f in KEEP_FRACTIONS:
                            nacc[f] += r[f]
                n_needed += bool(needed.any())
                count += 1
    model.train()
    res = {name: {str(f): v / max(count, 1) for f, v in acc.items()} for name, acc in sums.items()}
    nres = {name: {str(f): v / max(n_needed, 1) for f, v in acc.items()} for name, acc in needs.items()}
    for r in (res, nres):
        for name in r:
            r[name]["mean"] = float(np.mean([r[name][str(f)] for f in KEEP_FRACTIONS]))
    return {"loss": total_loss / max(count, 1), "decisions": count, "mass_at_k": res,
            "needed_at_k": nres, "decisions_with_needed_blocks": n_needed}


def with_parts(net, **flags):
    """The same network with the modules ``flags`` turn on (cross_rows=True,
    prev_block=True), whose output layers start at zero: it scores exactly as
    before until training moves them. ValueError for a combination the network
    cannot have (prev_block without cross_rows)."""
    import dataclasses

    from services.cache_manager.estimator import ValueEstimator

    grown = ValueEstimator(dataclasses.replace(net.cfg, **flags))
    missing, unexpected = grown.load_state_dict(net.state_dict(), strict=False)
    new = tuple(f"{f.split('_')[0]}_" for f in flags)          # cross_in/cross_out, prev_out
    assert not unexpected and all(k.startswith(new) for k in missing), (missing, unexpected)
    return grown


def with_reach(net):
    """The same network reading the reach column too, through a zero weight: it
    scores exactly as before until training moves that weight."""
    import dataclasses

    import torch

    from services.cache_manager.estimator import ValueEstimator

    grown = ValueEstimator(dataclasses.replace(net.cfg, reach=True))
    state = net.state_dict()
    for name in ("scalar_in.0.weight", "cross_in.weight"):
        if name in state:
            w = state[name]
            state[name] = torch.cat([w, torch.zeros(w.shape[0], 1)], 1)
    grown.load_state_dict(state)
    return grown


# ------------------------------------------------------------------ training
def train(model, train_data: list[dict], val_data: list[dict], minutes: float, lr: float, seed: int = 0,
          eval_every_s: float = 60.0, progress: bool = True, max_steps: int | None = None,
          pair_weight: float = 1.0):
    """-> history: list of (step, train loss (EMA), val loss or None, val mass@k mean or None).
    Every ``eval_every_s`` the held-out loss is measured on (up to) 8 sequences
    and the best state so far is kept; the model ends in that state (the
    traces are few, so later steps can overfit)."""
    import torch
    from tqdm import tqdm

    from services.cache_manager.estimator import row_ids, rows_from_arrays

    rng = random.Random(seed)
    dev = next(model.parameters()).device
    gen = torch.Generator(dev).manual_seed(seed)
    items = [(e, i) for e in range(len(train_data)) for i in range(len(train_data[e]["times"]))]
    if not items:
        raise ValueError("no training decisions (traces too short for the recent window?)")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    budget = minutes * 60.0
    t0 = last_eval = time.monotonic()
    history, ema, step, eval_cost = [], None, 0, 0.0
    probe, best, best_state = val_data[:8], float("inf"), None
    if probe:   # a warm start must beat where it started, not just its own later steps
        best = evaluate(model, probe, pair_weight)["loss"]
        best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    bar = tqdm(total=round(budget), desc="train-estimator", unit="s", disable=not progress,
               dynamic_ncols=True, mininterval=2, bar_format="{l_bar}{bar}| {n:.0f}/{total}s {postfix}")
    model.train()
    while True:
        el = time.monotonic() - t0
        if el >= budget or (max_steps is not None and step >= max_steps):
            break
        for g in opt.param_groups:   # cosine over the wall-clock budget
            g["lr"] = lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, el / budget))))
        e, i = rng.choice(items)
        a, now, tgt = decision(train_data[e], i)
        L, H = tgt.shape[:2]
        km, sc, tf, layer, head, y = _on(dev, *rows_from_arrays(a, now), *row_ids(L, H), as_rows(tgt))
        q = query_sample(y, gen) if model.cfg.depth == 1 else None
        s = model(km, sc, tf, layer, head, queries=q)
        yq = y if q is None else y.gather(1, q)
        kl, pair = losses(s, yq, gen)
        loss = kl + pair_weight * pair
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        lv = loss.item()
        ema = lv if ema is None else 0.98 * ema + 0.02 * lv
        vl = vm = None
        now_t = time.monotonic()
        if probe and now_t - last_eval >= max(eval_every_s, 3 * eval_cost):
            ev = evaluate(model, probe, pair_weight)
            eval_cost = time.monotonic() - now_t    # long traces: held-out checks stay a quarter of the time
            vl, vm = ev["loss"], ev["mass_at_k"]["learned"]["mean"]
            if vl < best:   # NaN never wins
                best, best_state = vl, {k: v.detach().clone() for k, v in model.state_dict().items()}
            last_eval = time.monotonic()
            bar.set_postfix(step=step, loss=f"{ema:.3f}", val=f"{vl:.3f}", mass=f"{vm:.3f}")
        elif step % 20 == 0:
            bar.set_postfix(step=step, loss=f"{ema:.3f}")
        history.append((step, ema, vl, vm))
        if step % 20 == 0:
            bar.n = min(round(now_t - t0), round(budget))
            bar.refresh()
    bar.close()
    if probe:
        vl = evaluate(model, probe, pair_weight)["loss"]
        if best_state is not None and not vl <= best:   # worse, or diverged to NaN
            model.load_state_dict(best_state)
            print(f"kept the held-out best (loss {best:.4f} < final {vl:.4f})")
    return history


def plot(history, baselines_mass: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    a1.plot([h[0] for h in history], [h[1] for h in history], label="train (EMA)")
    v = [(h[0], h[2]) for h in history if h[2] is not None]
    if v:
        a1.plot([x for x, _ in v], [y for _, y in v], "o-", label="held-out")
    a1.set_xlabel("step"); a1.set_ylabel("listwise KL + pairwise"); a1.legend()
    m = [(h[0], h[3]) for h in history if h[3] is not None]
    if m:
        a2.plot([x for x, _ in m], [y for _, y in m], "o-", label="learned")
    for name, val in baselines_mass.items():
        a2.axhline(val, ls="--", lw=1, label=name, color={"h2o": "C1", "attention_per_age": "C2"}.get(name, "C3"))
    a2.set_xlabel("step"); a2.set_ylabel("held-out mass@k (mean)"); a2.legend(fontsize=7)
    fig.tight_layout(); fig.savefig(path, dpi=90); plt.close(fig)


def lineage(trained: dict) -> dict:
    """The text sources and prompt lengths a network and every network it
    continues were traced on (what a held-out table is held out against), for
    the ``init`` record of a network continued from it. Real-suite runs that
    recorded no sources were traced on the generator, the only source then."""
    earlier = trained.get("init") or {}
    sources = trained.get("sources") or (["generator"] if trained.get("suite") == "real" else [])
    sources = list(dict.fromkeys(sources + list(earlier.get("sources") or [])))
    spans = [x for x in (trained.get("lengths"), earlier.get("lengths")) if x]
    out = {"sources": sources} if sources else {}
    if spans:
        out["lengths"] = [min(x[0] for x in spans), max(x[1] for x in spans)]
    return out


def run(args) -> int:
    import torch

    from services.cache_manager.estimator import EstimatorConfig, ValueEstimator, load, save
    from kvpop.training.traces import TraceConfig, task_traces
    from services.compute.model.loader import load_model

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_dir = Path(args.model)
    out = Path(args.out) if args.out else model_dir / "estimator.safetensors"
    try:
        bss = [int(x) for x in args.block_sizes.split(",") if x.strip()]
        recents = [int(x) for x in args.recent.split(",") if x.strip()]
        serves = None if args.serves_block_sizes is None else \
            sorted({int(x) for x in args.serves_block_sizes.split(",") if x.strip()})
    except ValueError:
        print("--block-sizes, --serves-block-sizes and --recent take comma-separated integers")
        return 2
    if not bss or not recents or min(bss + (serves or [])) < 1 or min(recents) < 0 or args.n < 2:
        print("need block sizes (--block-sizes, --serves-block-sizes) >= 1, recent >= 0 and --n >= 2")
        return 2
    if args.prefill_chunk < 1:
        print(f"--prefill-chunk must be >= 1 token, got {args.prefill_chunk}")
        return 2
    if args.trace_only and not args.traces:
        print("--trace-only needs --traces FILE (where the traces go)")
        return 2
    from services.compute.model.loader import resolve_device
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        print(e)
        return 2
    seconds = None if args.trace_minutes is None else 60.0 * args.trace_minutes
    try:
        lm = load_model(model_dir, dtype="float32", device=device)
    except ValueError as e:
        print(f"cannot load the model: {e}")
        return 2
    cache = Path(args.traces) if args.traces else None
    if cache is not None and cache.exists():
        try:
            data = torch.load(cache, weights_only=False)
        except (EOFError, RuntimeError, pickle.UnpicklingError) as e:
            print(f"cannot read the traces in {cache} ({type(e).__name__}: {e}); delete it to trace again")
            return 2
        print(f"loaded {len(data)} traces from {cache}")
        if args.reach and any("reach" not in e for e in data):
            print(f"{cache} was traced before traces recorded reach: trace again for --reach")
            return 2
    else:
        choices = [TraceConfig(block_size=b, sink=args.sink, recent=r, horizon=args.horizon, snapshots=args.decisions,
                              target=args.target, decode_only=args.decode_only, plan_interval=args.plan_interval,
                              every_step=args.every_step, answer_weight=args.answer_weight,
                              prefill_chunk=args.prefill_chunk)
                   for b in bss for r in recents]
        if args.prompts or args.suite == "real":
            from kvpop.training.traces import prompt_file_traces, real_traces
            from services.compute.model.tokenizer import Tokenizer
            tok = Tokenizer(model_dir)
            try:
                data = (prompt_file_traces(lm, tok, args.prompts, choices, args.seed) if args.prompts else
                        real_traces(lm, tok, args.n, choices, args.seed, args.min_len, args.max_len,
                                    seconds=seconds, text_sources=tuple(args.sources.split(","))))
            except (OSError, ValueError) as e:
                print(f"cannot trace: {e}")
                return 2
        else:
            from kvpop.tasks.suite import FAMILIES
            fams = args.families.split(",") if args.families else None
            if fams and not set(fams) <= set(FAMILIES):
                print(f"--families: unknown {sorted(set(fams) - set(FAMILIES))}; known: {', '.join(FAMILIES)}")
                return 2
            data = task_traces(lm, args.n, choices, args.seed, args.min_len, args.max_len, seconds=seconds,
                               families=fams)
        if len(data) < 2:
            print(f"only {len(data)} usable traces (prompts too short for sink + recent?): need at least 2")
            return 2
        if cache is not None:
            # Whole or not at all: a run killed while writing (or a reader started too early) must
            # not find a truncated file at the name a later run loads.
            part = Path(f"{cache}.part")
            torch.save(data, part)
            part.replace(cache)
    if args.trace_only:
        print(f"{len(data)} traces in {cache}")
        return 0
    n_val = max(1, len(data) // 8) if args.held_out is None else max(1, min(args.held_out, len(data) - 1))
    train_data, val_data = data[:-n_val], data[-n_val:]
    mc = lm.config
    if args.init:
        try:
            net = load(args.init)
        except (OSError, ValueError, KeyError) as e:
            print(f"cannot load --init {args.init}: {e}")
            return 2
        cfg = net.cfg
        if (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) != (mc.num_layers, mc.num_kv_heads, mc.head_dim):
            print(f"--init {args.init} was trained for {cfg.num_layers} layers x {cfg.num_kv_heads} kv-heads x "
                  f"head_dim {cfg.head_dim}; this model has {mc.num_layers} x {mc.num_kv_heads} x {mc.head_dim}")
            return 2
        prior = dict(cfg.trained or {})
        if args.cross_rows and not cfg.cross_rows:
            net = with_parts(net, cross_rows=True)
            cfg = net.cfg
        if args.reach and not cfg.reach:
            net = with_reach(net)
            cfg = net.cfg
        if args.prev_block and not cfg.prev_block:
            try:
                net = with_parts(net, prev_block=True)
            except ValueError as e:
                print(f"--prev-block: {e}; add --cross-rows")
                return 2
            cfg = net.cfg
    else:
        cfg = EstimatorConfig(mc.num_layers, mc.num_kv_heads, mc.head_dim, d_model=args.d_model, depth=args.depth,
                              cross_rows=args.cross_rows, reach=args.reach, prev_block=args.prev_block)
        try:
            net = ValueEstimator(cfg)
        except ValueError as e:   # a part without the input it reads (prev_block)
            print(f"train-estimator: {e}")
            return 2
        prior = {}
    del lm
    net.to(device)
    print(f"{len(train_data)} train / {len(val_data)} held-out sequences, "
          f"{sum(len(e['times']) for e in train_data)} train decisions; "
          f"estimator {sum(p.numel() for p in net.parameters())} parameters")
    history = train(net, train_data, val_data, args.minutes, args.lr, args.seed, eval_every_s=30.0,
                    pair_weight=args.pair_weight)
    ev = evaluate(net, val_data, args.pair_weight)
    cfg.trained = {"model": str(model_dir), "suite": "prompts" if args.prompts else args.suite, "traces": len(data), "steps": history[-1][0] if history else 0,
                   "minutes": args.minutes, "block_sizes": bss, "recent": recents, "horizon": args.horizon,
                   "target": args.target, "decode_only": args.decode_only, "every_step": args.every_step,
                   "prefill_chunk": args.prefill_chunk,
                   "answer_weight": args.answer_weight, "pair_weight": args.pair_weight,
                   "cross_rows": cfg.cross_rows, "reach": cfg.reach, "prev_block": cfg.prev_block,
                   "families": args.families,
                   # Which text the traces read: a held-out table is only held out against these.
                   "sources": args.sources.split(",") if args.suite == "real" and not args.prompts else None,
                   "lengths": [args.min_len, args.max_len],
                   "held_out": ev}
    if prior:
        cfg.trained["init"] = {"path": str(args.init), "steps": prior.get("steps"), "minutes": prior.get("minutes"),
                               "held_out_mass": prior.get("held_out", {}).get("mass_at_k", {}).get("learned", {}).get("mean"),
                               **lineage(prior)}
    # Traces cached before they recorded their prompt's length stand at --max-len.
    longest = max(int(e.get("prompt_len", args.max_len)) for e in data)
    cfg.max_context = max(longest, cfg.max_context if args.init else 0)
    if serves is not None:
        cfg.block_sizes = serves
    save(net.cpu(), out)
    png = out.with_name(out.stem + "_loss.png")
    plot(history, {k: v["mean"] for k, v in ev["mass_at_k"].items() if k != "learned"}, png)
    print(json.dumps(ev["mass_at_k"], indent=1))
    print(f"wrote {out}, {out.with_suffix('.json')}, {png}")
    return 0
