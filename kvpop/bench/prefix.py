"""`kvpop bench prefix`: time to first token of requests sharing a system
prompt, with and without the prefix cache (alternating), and the cache's hit
rate."""
from __future__ import annotations

import statistics
import time

from kvpop.bench.engine import make_engine, prompts_for, sync, vocab_size


def bench_prefix(args) -> dict:
    """The same requests (one shared system prompt + a distinct user turn)
    one at a time through two engines, alternating: one with the system
    prompt prewarmed into its prefix cache, one without a prefix cache."""
    from tqdm import tqdm

    from services.compute.engine.engine import SamplingParams

    vocab = vocab_size(args.model)
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
            sync(args.device)
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
