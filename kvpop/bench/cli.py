"""`kvpop bench`: the engine measured against a yardstick, side by side in one run.

    kvpop bench engine [--model DIR] [--batch 1 16] [--new-tokens 64] [--budget 0.25]
    kvpop bench prefix [--model DIR] [--requests 40]

engine: decode tokens/s of our LLMEngine vs Hugging Face ``transformers``
``generate()`` on the same model and prompts (greedy, a fixed number of new
tokens, EOS ignored on both sides), runs alternating, after a warm-up, median
of the repeats; then the KV bytes one sequence holds at ``--budget`` vs
dense, read from the pool's own accounting.

prefix: time to first token of requests sharing a system prompt, with and
without the prefix cache (alternating), and the cache's hit rate.

Decode tokens/s counts the tokens after the first one of each sequence, over
the time from the moment every sequence of the batch had its first token to
the last token: prefill is excluded on both sides the same way.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvpop.bench.machine import machine
from kvpop.flags import add_budget
from kvpop.models.fetch import model_arg
from kvpop.runtime.paths import DEFAULT_MODEL_DIR


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", required=True)
    e = sub.add_parser("engine", help="decode tokens/s vs transformers generate(), KV bytes at a budget")
    _common(e)
    e.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="batch sizes")
    e.add_argument("--prompt-len", type=int, default=64, help="mean prompt length (tokens); lengths vary by +-25%%")
    e.add_argument("--new-tokens", type=int, default=64)
    add_budget(e, type=float, default=0.25,
               help="budget for the KV-bytes row: a fraction of prompt + new tokens (<= 1) or tokens (> 1)")
    e.add_argument("--policy", default="h2o", help="policy for the KV-bytes row")
    e.add_argument("--kv-prompt-len", type=int, default=1024, help="prompt length for the KV-bytes row")
    e.add_argument("--skip-hf", action="store_true", help="engine only (no transformers)")
    x = sub.add_parser("prefix", help="time to first token with and without the prefix cache")
    _common(x)
    x.add_argument("--requests", type=int, default=40, help="requests per side and repeat")
    x.add_argument("--system-len", type=int, default=512, help="shared system prompt (tokens)")
    x.add_argument("--user-len", type=int, default=16, help="distinct user turn (tokens)")
    from kvpop.bench import context as bench_context
    from kvpop.bench import grpc_hops as bench_grpc
    from kvpop.bench import learned as bench_learned
    from kvpop.bench import scoring as bench_scoring
    from kvpop.bench import serve as bench_serve
    from kvpop.bench import step as bench_step
    bench_step.add_arguments(sub.add_parser(
        "step", help="one decode step's host cost per policy and sequences, in process: ms, launches, device reads"))
    bench_scoring.add_arguments(sub.add_parser(
        "scoring", help="the network's cost per plan as a sequence grows: incremental (served) vs full passes"))
    bench_context.add_arguments(sub.add_parser(
        "context", help="KV bytes and decode tok/s of one sequence as the context grows, dense vs a budget"))
    bench_grpc.add_arguments(sub.add_parser(
        "grpc", help="per-token cost of each hop: engine, asyncio, compute over gRPC, gateway"))
    bench_learned.add_arguments(sub.add_parser(
        "learned", help="cost of `learned` vs h2o through a running stack (TTFT, TPOT, others' ITL, plan time)"))
    bench_serve.add_arguments(sub.add_parser(
        "serve", help="requests arriving over time against one KV pool, per policy (throughput, latency, peaks)"))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), type=model_arg,
                   help="HF model folder or a fetched name (smollm2-135m)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (both sides)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG here")


def run(args) -> int:
    if args.bench in ("learned", "serve", "grpc", "context", "scoring", "step"):
        from kvpop.bench import context as bench_context
        from kvpop.bench import grpc_hops as bench_grpc
        from kvpop.bench import learned as bench_learned
        from kvpop.bench import scoring as bench_scoring
        from kvpop.bench import serve as bench_serve
        from kvpop.bench import step as bench_step
        return {"learned": bench_learned, "serve": bench_serve, "grpc": bench_grpc, "context": bench_context,
                "scoring": bench_scoring, "step": bench_step}[args.bench].run(args)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        _check(args)
        results = {"engine": bench_engine, "prefix": bench_prefix}[args.bench](args)
        results["machine"] = machine()
    except ValueError as e:   # a bad model folder, budget, length...: say so, no traceback
        print(f"kvpop bench {args.bench}: error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)   # run() is also called in process (tests)
    results["command"] = "kvpop bench " + args.bench
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"results: {args.json}")
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _check(args) -> None:
    """Refuse bad arguments before minutes of work, with a message."""
    if not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"{args.model} is not a model folder (no config.json)")
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError("--repeats must be >= 1 and --warmup >= 0")
    if args.bench == "engine":
        if min(args.batch) < 1 or args.new_tokens < 2 or args.prompt_len < 1 or args.kv_prompt_len < 1:
            raise ValueError("--batch and --prompt-len must be >= 1, --new-tokens >= 2 (decode needs a second token)")
        if args.budget <= 0:
            raise ValueError("--budget must be a fraction in (0, 1] or a number of tokens > 1")
    elif args.requests < 1 or args.system_len < 1 or args.user_len < 1:
        raise ValueError("--requests, --system-len and --user-len must be >= 1")


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def prompts_for(n: int, mean_len: int, vocab: int, seed: int) -> list[list[int]]:
    """Seeded random token ids (ids >= 3 skip the usual pad/bos/eos), lengths
    varying by +-25% so that batching has ragged rows to deal with."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = max(1, mean_len * 3 // 4), max(2, mean_len * 5 // 4 + 1)
    return [torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


# ------------------------------------------------------------ our engine
def make_engine(args, max_num_seqs: int, max_len: int, **config):
    from services.compute.engine import EngineConfig, LLMEngine
    return LLMEngine(EngineConfig(args.model, dtype=args.dtype, device=args.device, max_num_seqs=max_num_seqs,
                                  max_model_len=max_len, **config))


def engine_decode(engine, prompts, new_tokens: int, eviction=None, tag="b") -> dict:
    """One batch through the engine: decode tok/s, the outputs, usage per sequence."""
    from services.compute.engine import SamplingParams
    sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, sp, eviction)
    out = {rid: [] for rid in ids}
    usage, t_first = {}, None
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].append(o.token_id)
            if o.finished:
                usage[o.request_id] = o.usage
        if t_first is None and all(out.values()):
            _sync(engine.config.device)
            t_first = time.perf_counter()
    _sync(engine.config.device)
    t1 = time.perf_counter()
    n = sum(len(v) - 1 for v in out.values())
    return {"tok_s": n / (t1 - t_first), "total_s": t1 - t0, "outputs": [out[r] for r in ids],
            "usage": [usage[r] for r in ids], "peak_pages": engine.pool.peak_used}


# ------------------------------------------------------------ transformers
def load_hf(args):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise SystemExit("kvpop bench engine needs `transformers` for the yardstick "
                         "(pip install transformers), or pass --skip-hf") from None
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    # generate() falls back to the model config's EOS when the generation
    # config has none, so EOS is switched off in both (our side: ignore_eos).
    model.config.eos_token_id = model.generation_config.eos_token_id = None
    return model


def hf_decode(model, prompts, new_tokens: int, device: str) -> dict:
    """Greedy generate() of a left-padded batch. EOS is switched off in the
    generation config (not with min_new_tokens, which masks EOS logits and so
    changes which token wins); a stopping criterion only timestamps steps."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Clock(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kw):
            _sync(device)
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    S = max(map(len, prompts))
    pad = 0
    ids = torch.full((len(prompts), S), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), S), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, S - len(p):] = torch.tensor(p)
        mask[i, S - len(p):] = 1
    gc = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    gc.eos_token_id, gc.pad_token_id = None, pad
    gc.do_sample, gc.max_new_tokens, gc.min_new_tokens = False, new_tokens, None
    gc.temperature = gc.top_p = gc.top_k = None
    clock = Clock()
    with torch.no_grad():
        seqs = model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=gc,
                              stopping_criteria=StoppingCriteriaList([clock]))
    n_steps = len(clock.times)   # one call per generated token, the first after prefill
    out = seqs[:, S:].tolist()
    return {"tok_s": len(prompts) * (n_steps - 1) / (clock.times[-1] - clock.times[0]),
            "outputs": out, "generated": n_steps}


def hf_kv_bytes(model, total_len: int) -> int:
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * hd * total_len * model.dtype.itemsize


# ------------------------------------------------------------ engine bench
def bench_engine(args) -> dict:
    from tqdm import tqdm

    from services.compute.engine import EvictionParams
    from services.compute.kv_pool import KVPool

    max_batch = max(args.batch)
    prompts = prompts_for(max_batch, args.prompt_len, _vocab(args.model), args.seed)
    max_len = max(map(len, prompts)) + args.new_tokens
    engine = make_engine(args, max_batch, max_len)
    hf = None if args.skip_hf else load_hf(args)
    rows = []
    for B in args.batch:
        batch = prompts[:B]
        ours, theirs, match = [], [], None
        runs = [(r, side) for r in range(args.warmup + args.repeats) for side in ("ours", "hf")]
        for r, side in tqdm(runs, desc=f"batch {B}", leave=False):
            if side == "hf" and hf is None:
                continue
            if side == "ours":
                res = engine_decode(engine, batch, args.new_tokens, tag=f"b{B}r{r}")
                (ours if r >= args.warmup else []).append(res["tok_s"])
                our_out = res["outputs"]
            else:
                res = hf_decode(hf, batch, args.new_tokens, args.device)
                (theirs if r >= args.warmup else []).append(res["tok_s"])
                match = sum(a == b for a, b in zip(our_out, res["outputs"])) / B
        row = {"batch": B, "ours_tok_s": statistics.median(ours), "ours_best": max(ours), "ours_runs": ours}
        if theirs:
            # On a shared machine the load drifts between runs: the ratio of each
            # adjacent (ours, HF) pair cancels most of it, so its median is the headline.
            row.update(hf_tok_s=statistics.median(theirs), hf_best=max(theirs), hf_runs=theirs,
                       speedup=statistics.median(a / b for a, b in zip(ours, theirs)),
                       speedup_best=max(ours) / max(theirs), outputs_equal=match)
        rows.append(row)

    # KV bytes per sequence at the budget vs dense: the same prompts, the pool's accounting.
    page = KVPool.page_bytes(engine.pool.page_size, engine.model.config.head_dim, engine.model.dtype)
    block = KVPool.page_bytes(engine.config.block_size, engine.model.config.head_dim, engine.model.dtype)
    budget = args.budget if args.budget <= 1 else int(args.budget)
    kv, long_prompts = {}, prompts_for(4, args.kv_prompt_len, _vocab(args.model), args.seed + 1)
    for name, ev in (("dense", None), (args.policy, EvictionParams(args.policy, budget))):
        eng = make_engine(args, len(long_prompts), max(map(len, long_prompts)) + args.new_tokens)
        res = engine_decode(eng, long_prompts, args.new_tokens, ev, tag=name)
        resident = [u.kv_blocks_resident for u in res["usage"]]
        kv[name] = {"bytes_per_seq_at_finish": statistics.mean(resident) * block,
                    "peak_bytes_per_seq": res["peak_pages"] * page / len(long_prompts),
                    "evicted_blocks": sum(u.kv_blocks_evicted for u in res["usage"])}
    if hf is not None:
        kv["hf_dynamic_cache"] = {"bytes_per_seq_at_finish": statistics.mean(
            hf_kv_bytes(hf, len(p) + args.new_tokens) for p in long_prompts)}
    dense = kv["dense"]["bytes_per_seq_at_finish"]
    for v in kv.values():
        v["vs_dense"] = v["bytes_per_seq_at_finish"] / dense
    results = {"model": str(args.model), "dtype": args.dtype, "device": args.device,
               "prompt_len_mean": statistics.mean(map(len, prompts)), "new_tokens": args.new_tokens,
               "repeats": args.repeats, "decode": rows, "kv_budget": args.budget,
               "policy": args.policy, "kv_prompt_len_mean": statistics.mean(map(len, long_prompts)), "kv": kv}
    print_engine(results)
    return results


def _vocab(model_dir) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg["vocab_size"]


def print_engine(r: dict) -> None:
    print(f"\nmodel {r['model']} ({r['dtype']}, {r['device']}), prompts ~{r['prompt_len_mean']:.0f} tokens, "
          f"{r['new_tokens']} new tokens, greedy, EOS ignored, median of {r['repeats']}")
    print("tok/s: median (best); ours / HF: median of the ratios of adjacent runs (best / best)")
    print(f"{'batch':>5} | {'ours tok/s':>16} | {'HF generate tok/s':>17} | {'ours / HF':>15} | outputs equal")
    print("-" * 80)
    for x in r["decode"]:
        ours = f"{x['ours_tok_s']:7.0f} ({x['ours_best']:6.0f})"
        hf = (f"{x['hf_tok_s']:8.0f} ({x['hf_best']:6.0f}) | {x['speedup']:5.2f}x ({x['speedup_best']:.2f}x) | "
              f"{x['outputs_equal']:.0%}") if "hf_tok_s" in x else f"{'-':>17} | {'-':>15} | -"
        print(f"{x['batch']:>5} | {ours:>16} | {hf}")
    print(f"\nKV bytes per sequence, prompts ~{r['kv_prompt_len_mean']:.0f} tokens + {r['new_tokens']} new "
          f"(budget {r['kv_budget']}, policy {r['policy']}):")
    print(f"{'':>18} | {'at finish':>12} | {'pool peak / seq':>15} | vs dense")
    print("-" * 62)
    for name, v in r["kv"].items():
        peak = f"{v['peak_bytes_per_seq']:15,.0f}" if "peak_bytes_per_seq" in v else f"{'-':>15}"
        print(f"{name:>18} | {v['bytes_per_seq_at_finish']:12,.0f} | {peak} | {v['vs_dense']:.3f}")


# ------------------------------------------------------------ prefix bench
def bench_prefix(args) -> dict:
    """The same requests (one shared system prompt + a distinct user turn)
    one at a time through two engines, alternating: one with the system
    prompt prewarmed into its prefix cache, one without a prefix cache."""
    from tqdm import tqdm

    from services.compute.engine import SamplingParams

    vocab = _vocab(args.model)
    system = prompts_for(1, args.system_len, vocab, args.seed)[0][:args.system_len]
    users = prompts_for(args.requests, args.user_len, vocab, args.seed + 1)
    max_len = len(system) + args.user_len * 2 + 8
    # A pool for 4 such requests, half of it allowed to the cache (the default
    # fraction, 0.1, is sized for a serving pool of many sequences).
    cached = make_engine(args, 4, max_len, prefix_cache_fraction=0.5)
    plain = make_engine(args, 4, max_len, prefix_cache_fraction=0.0)
    t0 = time.perf_counter()
    cached.prewarm(system)
    prewarm_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    ttft = {"with": [], "without": []}
    same = 0
    runs = [(r, i) for r in range(args.warmup + args.repeats) for i in range(args.requests)]
    for r, i in tqdm(runs, desc="requests", leave=False):
        toks = {}
        for name, eng in (("with", cached), ("without", plain)):
            t = time.perf_counter()
            out = next(iter(eng.generate(system + users[i], sp)))
            _sync(args.device)
            if r >= args.warmup:
                ttft[name].append((time.perf_counter() - t) * 1e3)
            toks[name] = out.token_id
        same += toks["with"] == toks["without"]
    st = cached.stats()
    res = {"model": str(args.model), "dtype": args.dtype, "device": args.device, "system_tokens": len(system),
           "user_tokens_mean": statistics.mean(map(len, users)), "requests": len(ttft["with"]),
           "prewarm_s": prewarm_s,
           "ttft_ms_with": statistics.median(ttft["with"]), "ttft_ms_without": statistics.median(ttft["without"]),
           "ttft_ratio": statistics.median(a / b for a, b in zip(ttft["without"], ttft["with"])),
           "first_tokens_equal": same / len(runs), "prefix_cache_hit_rate": st["prefix_cache_hit_rate"],
           "prefix_cache_hit_tokens": st["prefix_cache_hit_tokens"], "prefix_cache_pages": st["prefix_cache_pages"]}
    print(f"\nmodel {res['model']} ({args.dtype}, {args.device}): system prompt {len(system)} tokens "
          f"+ user turn ~{res['user_tokens_mean']:.0f} tokens, {res['requests']} requests per side")
    print(f"time to first token, median: without prefix cache {res['ttft_ms_without']:.1f} ms, "
          f"with {res['ttft_ms_with']:.1f} ms -> {res['ttft_ratio']:.1f}x faster (median of paired ratios)")
    print(f"prefix hit rate {res['prefix_cache_hit_rate']:.0%}, first tokens equal {res['first_tokens_equal']:.0%}, "
          f"prewarm took {prewarm_s * 1e3:.0f} ms, cache holds {res['prefix_cache_pages']} pages")
    return res


# ------------------------------------------------------------ plot
def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    path.parent.mkdir(parents=True, exist_ok=True)
    if "decode" in results:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        rows = results["decode"]
        xs = range(len(rows))
        a.bar([x - 0.2 for x in xs], [r["ours_tok_s"] for r in rows], 0.4, label="kvpop engine")
        if all("hf_tok_s" in r for r in rows):
            a.bar([x + 0.2 for x in xs], [r["hf_tok_s"] for r in rows], 0.4, label="HF generate()")
        a.set_xticks(list(xs), [f"batch {r['batch']}" for r in rows])
        a.set_ylabel("decode tokens/s")
        a.legend()
        kv = results["kv"]
        b.bar(list(kv), [v["bytes_per_seq_at_finish"] / 1024 for v in kv.values()])
        b.set_ylabel("KV KiB per sequence at finish")
    else:
        fig, b = plt.subplots(figsize=(5, 4))
        b.bar(["no cache", "prefix cache"], [results["ttft_ms_without"], results["ttft_ms_with"]])
        b.set_ylabel("median time to first token (ms)")
    fig.suptitle(f"{results['command']} ({results['machine']['cpu_count']} CPUs)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
