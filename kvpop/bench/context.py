"""`kvpop bench context`: KV memory and decode speed of one sequence as its
context grows, dense vs a fixed budget, in one run.

For each context length (default 512 to 8,192 tokens at the end of the run:
a prompt of random ids from the vocabulary's ordinary range, then
`--new-tokens` decoded greedily, EOS ignored), one sequence runs, first
dense, then with `--policy` at a budget of `--budget` per (layer,
kv-head). Reported per (length, policy): KV bytes held at the end and the peak
during the run (the pool's own accounting: pages x page bytes), prefill time,
and decode tokens/s. Dense KV grows linearly with the context; a budgeted
sequence's stays flat, and so does its per-token attention cost.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from kvpop.bench import outputs
from kvpop.flags import add_budget
from kvpop.models.fetch import model_arg


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m", type=model_arg,
                   help="model folder or a fetched name (default: smollm2-135m; `kvpop fetch-model` first)")
    p.add_argument("--lengths", default="512,1024,2048,4096,8192",
                   help="context lengths at the end of each run (prompt + new tokens)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--policy", default="h2o")
    add_budget(p, type=int, default=512, help="tokens per (layer, kv-head) of the budgeted policy")
    p.add_argument("--block-size", type=int, default=1, help="positions per block (eviction); pages hold 16")
    p.add_argument("--prefill-chunks", default="512",
                   help="comma-separated prompt chunk sizes (compute's KVPOP_PREFILL_CHUNK) to run the budgeted "
                        "policy at: its peak is about budget + chunk, its prefill more rounds per prompt")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)


def _one(engine, prompt: list[int], new_tokens: int, eviction, tag: str) -> dict:
    from services.compute.engine.engine import SamplingParams

    engine.add_request(tag, prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True), eviction)
    stamps, usage = [], None
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_id is not None:
                stamps.append(time.perf_counter())
            if out.finished:
                usage = out.usage
    decode = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
    return {"prefill_s": stamps[0] - t0, "decode_tok_s": 1.0 / decode if decode else float("nan"),
            "resident_blocks": usage.kv_blocks_resident, "evicted_blocks": usage.kv_blocks_evicted,
            # The request's own high-water mark (a page per block per row), chunk before
            # its eviction round included: polling the pool after each step missed it.
            "peak_pages": usage.kv_blocks_peak}


def bench(args) -> dict:
    import torch
    from tqdm import tqdm

    from services.compute.engine.engine import EngineConfig, EvictionParams, LLMEngine, page_tokens
    from services.compute.engine.kv_pool import KVPool

    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    longest = max(lengths)
    if longest > cfg.get("max_position_embeddings", longest):
        raise ValueError(f"a context of {longest} tokens is past the model's "
                         f"{cfg['max_position_embeddings']} positions")
    if min(lengths) <= args.new_tokens:
        raise ValueError(f"every length must be more than --new-tokens ({args.new_tokens})")
    rows_of = cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    # Room for the longest dense context, and enough that the engine's headroom (an eighth
    # of the pool) never cuts a budgeted prompt chunk below the size asked for.
    chunks = [int(c) for c in args.prefill_chunks.split(",") if c.strip()]
    if not chunks or min(chunks) < 1:
        raise ValueError("--prefill-chunks takes positive token counts")
    pp = page_tokens(args.block_size, EngineConfig.page_size)
    pages = rows_of * max(longest // pp + 2, 8 * (max(chunks) // pp + 2)) + 64
    engine = LLMEngine(EngineConfig(model_dir=args.model, dtype="float32", device="cpu", block_size=args.block_size,
                                    num_pages=pages, max_num_seqs=2, max_model_len=longest + args.block_size))
    block = KVPool.page_bytes(args.block_size, engine.model.config.head_dim, engine.model.dtype)
    page = KVPool.page_bytes(engine.pool.page_size, engine.model.config.head_dim, engine.model.dtype)
    g = torch.Generator().manual_seed(args.seed)
    # Ordinary ids only (no specials at the low end), as text would give.
    lo, hi = 256, cfg["vocab_size"] - 1
    rows = []
    _one(engine, torch.randint(lo, hi, (64,), generator=g).tolist(), 4, EvictionParams("dense"), "warmup")
    runs = [(n, pol, c) for n in lengths for pol, cs in (("dense", chunks[:1]), (args.policy, chunks)) for c in cs]
    for n, pol, chunk in tqdm(runs, desc="bench context", unit="run"):
        prompt = torch.randint(lo, hi, (n - args.new_tokens,), generator=torch.Generator().manual_seed(args.seed + n)).tolist()
        ev = EvictionParams("dense") if pol == "dense" else EvictionParams(pol, args.budget)
        engine.scheduler.prefill_chunk = chunk
        r = _one(engine, prompt, args.new_tokens, ev, f"{pol}-{n}-{chunk}")
        rows.append({"length": n, "policy": pol, "prefill_chunk": chunk, "kv_bytes_at_end": r["resident_blocks"] * block,
                     "peak_kv_bytes": r["peak_pages"] * page, **r})
    for n in lengths:
        d = next(r for r in rows if r["length"] == n and r["policy"] == "dense")
        for b in (r for r in rows if r["length"] == n and r["policy"] != "dense"):
            b["kv_vs_dense"] = b["kv_bytes_at_end"] / d["kv_bytes_at_end"]
            b["decode_speedup"] = b["decode_tok_s"] / d["decode_tok_s"]
            b["prefill_vs_dense"] = b["prefill_s"] / d["prefill_s"]
    return {"command": "kvpop bench context", "model": str(args.model), "policy": args.policy,
            "budget_tokens": args.budget, "block_size": args.block_size, "new_tokens": args.new_tokens,
            "threads": torch.get_num_threads(), "rows": rows}


def print_table(res: dict) -> None:
    print(f"\none sequence, {res['new_tokens']} new tokens; {res['policy']} at {res['budget_tokens']} tokens "
          f"per (layer, kv-head), block size {res['block_size']}")
    print("| context | policy | prefill chunk | KV held at end (MiB) | peak KV (MiB) | prefill s | decode tok/s | "
          "KV vs dense | decode vs dense |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    mib = 1 / 2**20
    for r in res["rows"]:
        print(f"| {r['length']} | {r['policy']} | {r['prefill_chunk']} | {r['kv_bytes_at_end'] * mib:.1f} | "
              f"{r['peak_kv_bytes'] * mib:.1f} | {r['prefill_s']:.2f} | {r['decode_tok_s']:.1f} | "
              f"{r.get('kv_vs_dense', 1.0):.3f}x | {r.get('decode_speedup', 1.0):.2f}x |")


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    several = len({r["prefill_chunk"] for r in res["rows"]}) > 1
    for pol, chunk in dict.fromkeys((r["policy"], r["prefill_chunk"]) for r in res["rows"]):
        rs = [r for r in res["rows"] if (r["policy"], r["prefill_chunk"]) == (pol, chunk)]
        label = pol if pol == "dense" else f"{pol} @ {res['budget_tokens']} tokens"
        if several and pol != "dense":
            label += f", chunk {chunk}"
        axes[0].plot([r["length"] for r in rs], [r["kv_bytes_at_end"] / 2**20 for r in rs], marker="o", label=label)
        axes[1].plot([r["length"] for r in rs], [r["decode_tok_s"] for r in rs], marker="o", label=label)
    for ax, title in ((axes[0], "KV held per sequence (MiB)"), (axes[1], "decode tokens/s, one sequence")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title, fontsize=10)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> int:
    try:
        res = bench(args)
    except ValueError as e:
        print(f"kvpop bench context: error: {e}")
        return 2
    print_table(res)
    outputs.write(res, args, plot)
    return 0
