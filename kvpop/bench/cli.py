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
import sys
from pathlib import Path

import torch

from kvpop.bench import outputs
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
    from kvpop.bench import chat as bench_chat
    from kvpop.bench import step as bench_step
    bench_chat.add_arguments(sub.add_parser(
        "chat", help="a long chat turn by turn: a session at a budget vs a client re-sending the whole chat"))
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
    if args.bench in ("chat", "learned", "serve", "grpc", "context", "scoring", "step"):
        from kvpop.bench import chat as bench_chat
        from kvpop.bench import context as bench_context
        from kvpop.bench import grpc_hops as bench_grpc
        from kvpop.bench import learned as bench_learned
        from kvpop.bench import scoring as bench_scoring
        from kvpop.bench import serve as bench_serve
        from kvpop.bench import step as bench_step
        return {"chat": bench_chat, "learned": bench_learned, "serve": bench_serve, "grpc": bench_grpc,
                "context": bench_context, "scoring": bench_scoring, "step": bench_step}[args.bench].run(args)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        _check(args)
        from kvpop.bench.engine import bench_engine
        from kvpop.bench.prefix import bench_prefix
        results = {"engine": bench_engine, "prefix": bench_prefix}[args.bench](args)
        results["machine"] = machine()
    except ValueError as e:   # a bad model folder, budget, length...: say so, no traceback
        print(f"kvpop bench {args.bench}: error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)   # run() is also called in process (tests)
    results["command"] = "kvpop bench " + args.bench
    outputs.write(results, args, plot)
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
