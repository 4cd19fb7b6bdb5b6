"""`kvpop bench scoring`: what the cache-manager's network costs per plan as a
sequence grows, side by side in one run:

- live: what serves (services/cache_manager/live_attention.py: attention
  merged incrementally, evicted blocks no longer queries);
- full: the network's generic path (a full pass over every known block every
  ``rescore_every`` new blocks, newcomers incremental in between), which is
  what every network ran before.

A sequence is replayed as compute streams it: the prompt's blocks in prefill
chunks, then one block per decoded token (block size 1), each batch answered
with a plan; after each plan every row evicts its lowest-ranked blocks down
to the budget, and tells the cache-manager (as compute's `gone` does).
Features are random (the cost does not depend on their values).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np


def add_arguments(p) -> None:
    from kvpop.models.fetch import model_arg
    p.add_argument("--model", default="smollm2-135m", type=model_arg,
                   help="model folder holding estimator.safetensors, or a fetched name")
    p.add_argument("--lengths", default="2048,4096,8192", help="prompt lengths (tokens = blocks)")
    p.add_argument("--compression", type=float, default=0.875)
    p.add_argument("--decode", type=int, default=32, help="decoded tokens (one plan each)")
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)


def _replay(scorer, shape, length: int, args, rng) -> dict:
    from services.cache_manager.scoring_state import BlockRecord, SequenceState

    L, H, d = shape
    budget = max(1, int(round(length * (1 - args.compression))))
    seq = SequenceState("bench")
    prefill, decode = [], []

    def add(b):
        seq.add(BlockRecord(b, b, 1, rng.standard_normal((L, H, d), dtype=np.float32),
                            rng.random((L, H), dtype=np.float32) + 0.5, rng.random((L, H), dtype=np.float32)))

    def plan() -> float:
        t = time.perf_counter()
        s = scorer.score(seq)
        took = time.perf_counter() - t
        a = seq.arrays()
        s = np.where(a["gone"], np.inf, s)                     # [n, L, H]
        held = (~a["gone"]).sum(0)
        over = int(held.max()) - budget
        if over > 0:   # every row drops its `over` lowest (rows hold equal counts, as compute's do)
            order = np.argsort(s, axis=0, kind="stable")[:over]  # [over, L, H]
            seq.mark_gone(np.moveaxis(a["block"][order], 0, -1).astype(np.int32))
        return took

    b = 0
    while b < length:
        for _ in range(min(args.prefill_chunk, length - b)):
            add(b)
            b += 1
        prefill.append(plan())
    for _ in range(args.decode):
        add(b)
        b += 1
        decode.append(plan())
    held = int((~seq.arrays()["gone"]).sum(0).max())
    return {"prefill_s": sum(prefill), "prefill_plans": len(prefill), "budget": budget, "held_max": held,
            "decode_ms_median": 1000 * statistics.median(decode), "decode_ms_mean": 1000 * statistics.mean(decode)}


def run(args) -> int:
    import torch
    from tqdm import tqdm

    from services.cache_manager.estimator import LearnedScorer, load

    torch.set_num_threads(args.threads)
    path = Path(args.model) / "estimator.safetensors"
    try:
        net = load(path)
    except ValueError as e:
        print(e)
        return 2
    c = net.cfg
    shape = (c.num_layers, c.num_kv_heads, c.head_dim)
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    rows = []
    with tqdm(total=2 * len(lengths), desc="bench scoring", dynamic_ncols=True) as bar:
        for n in lengths:
            row = {"length": n}
            for name, live in (("live", True), ("full", False)):
                row[name] = _replay(LearnedScorer(net, live=live), shape, n, args, np.random.default_rng(n))
                bar.update()
            rows.append(row)
    print(f"\nestimator {path} ({c.num_layers * c.num_kv_heads} rows, depth {c.depth}), compression "
          f"{args.compression:.2%}, block size 1, prefill chunks of {args.prefill_chunk}, "
          f"{args.threads} torch threads\n")
    print("| prompt tokens | prefill plans | prefill, live (s) | prefill, full (s) | ratio | "
          "decode per token, live (ms, mean) | full (ms, mean) | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lv, fu = r["live"], r["full"]
        print(f"| {r['length']:,} | {lv['prefill_plans']} | {lv['prefill_s']:.2f} | {fu['prefill_s']:.2f} | "
              f"{fu['prefill_s'] / lv['prefill_s']:.1f}x | {lv['decode_ms_mean']:.1f} | "
              f"{fu['decode_ms_mean']:.1f} | {fu['decode_ms_mean'] / lv['decode_ms_mean']:.1f}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"estimator": str(path), "compression": args.compression,
                                         "threads": args.threads, "rows": rows}, indent=1) + "\n")
    return 0
