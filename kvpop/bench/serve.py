"""`kvpop bench serve`: a stream of requests arriving over time against one
fixed KV pool, through a running stack (like vLLM's serving benchmark).

A seeded workload, greedy, each request generating `--new-tokens` (EOS
ignored: long generations, decode-bound as chat serving is):
`--suite tasks` (default) the task suite's prompts for the default model (all
four families, 600–1,280 tokens; the answer is checked on the text up to its
end-of-solution mark); `--suite real` the real-text retrieval prompts of
`kvpop eval --suite real` at `--lengths`, sent as chat `messages` (the
model's template renders them), an answer counting when every expected value
appears in the text. A policy named `NAME+after` holds its budget from the
end of the prompt on (the request's `evict_after_prompt`), `NAME+prefill<N>x`
up to N x its budget during prefill (`prefill_allowance`). Each request is a distinct client
(x-client-id), as many users would be. Poisson arrivals at each offered rate (`inf`: everything at once, the
saturation point). Every policy runs the same requests on the same stack and
pool, one after the other. Reported per (policy, rate): requests/s, output
tokens/s, TTFT, time per output token and inter-token latency (p50/p99),
errors, peak pool pages and peak running sequences (polled from compute),
the network's share of `learned` evictions (the rest by reason: compute's
fallback with no plan in time, cleanup, ...), and answer accuracy.

The client is one asyncio loop (``grpc.aio``), every in-flight stream a task
on it: a thread per stream cost more CPU than the host could spare from the
stack being measured. It reports its own CPU seconds (``client_cpu_s``).

Writes DIR/results.json, DIR/summary.json (throughput_ratio, concurrency_ratio:
the first non-dense policy over dense at the highest rate; client_cpu_s),
DIR/results.md, DIR/outputs.jsonl (each request's text), DIR/throughput.png
and DIR/latency_cdf.png. With
`--prefill-chunks 512,128` the whole run repeats on one stack per prompt
chunk size (rows carry `prefill_chunk`; summary.json `by_prefill_chunk`).
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import resource
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
from tqdm import tqdm

from kvpop.bench.loadgen import AsyncStream, percentile, request
from kvpop.models.fetch import model_arg
from kvpop.runtime.paths import DEFAULT_MODEL_DIR
from kvpop.bench.peak_poller import PeakPoller


def add_arguments(p) -> None:
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), type=model_arg,
                   help="model folder for the stack it starts, or a fetched name (smollm2-135m)")
    p.add_argument("--via", metavar="HOST:PORT", help="a running gateway instead of starting a stack")
    p.add_argument("--compute", metavar="HOST:PORT", help="with --via: compute, for pool and running peaks")
    p.add_argument("--policies", default="dense,learned",
                   help="policies served by the stack; `hf` adds Hugging Face generate() on static batches "
                        "of what has arrived, in this process (needs transformers)")
    p.add_argument("--hf-max-batch", type=int, default=16, help="largest static batch of the `hf` baseline")
    p.add_argument("--budget", type=float, default=0.125, help="budget fraction of non-dense policies (0.125: 87.5%%)")
    p.add_argument("--rates", default="4,inf", help="offered requests/s, comma-separated; inf = all at once")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per request (EOS ignored)")
    p.add_argument("--requests", type=int, default=96, help="requests per (policy, rate)")
    p.add_argument("--num-pages", type=int, default=6000,
                   help="KV pool pages of the stack it starts, of --page-size positions (a layout with other "
                        "pages gets a pool of the same memory)")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--block-size", type=int, default=1, help="positions per block, the unit of eviction")
    p.add_argument("--page-size", type=int, default=16, help="positions per KV page, the unit of memory")
    p.add_argument("--layouts", metavar="B/P[,B/P]",
                   help="one stack per layout (block size / page size), every policy and rate on each, pools of "
                        "the same memory: e.g. 1/16,16/16,1/1 compares the default (token-level decisions, "
                        "16-token pages) with whole-block eviction and one page per token. Default: "
                        "--block-size/--page-size")
    p.add_argument("--sink", type=int, default=4, help="sink tokens of every request")
    p.add_argument("--recent", type=int, default=8, help="recent-window tokens of every request (the eval's 8)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--suite", choices=("tasks", "real"), default="tasks",
                   help="tasks: the default model's task prompts; real: real-text retrieval chats (SmolLM2)")
    p.add_argument("--lengths", default="1024,2048", help="--suite real: prompt lengths in the model's tokens")
    p.add_argument("--tasks", default="needle,multikey", help="--suite real: families")
    p.add_argument("--prefill-chunks", metavar="N[,N]",
                   help="one stack per prompt chunk size (compute's --prefill-chunk), every policy and rate on "
                        "each: what a smaller chunk (a lower peak when the budget holds during prefill) costs "
                        "under load. Default: compute's own")
    p.add_argument("--quick", action="store_true", help="a small run that checks the benchmark works")
    p.add_argument("--out", type=Path, required=True)


def cpu_seconds() -> float:
    """This process's CPU time (user + system); a stack it starts runs in child processes, not counted."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def workload(n: int, seed: int, lo: int = 600, hi: int = 1280):
    from kvpop.tasks import suite
    from kvpop.tasks.suite import FAMILIES
    per = math.ceil(n / len(FAMILIES))
    insts = suite.test_set(per, list(FAMILIES), seed, lo, hi)
    random.Random(seed).shuffle(insts)
    return insts[:n]


def real_workload(model_dir: str, n: int, seed: int, lengths: list[int], families: list[str]):
    """n real-text chats, families and lengths in turn (the eval's test sets: seeds no training draws)."""
    from kvpop.tasks import ruler
    unknown = sorted(set(families) - set(ruler.FAMILIES))
    if unknown:
        raise ValueError(f"unknown --tasks {unknown}; real-text families are {', '.join(ruler.FAMILIES)}")
    per = math.ceil(n / (len(families) * len(lengths)))
    insts = ruler.model_test_set(model_dir, per, lengths, families, seed)
    random.Random(seed).shuffle(insts)
    return insts[:n]


def make_request(pb, inst, policy: str, budget: float, new_tokens: int, sink: int, recent: int):
    """The request for one instance: a chat when it has messages, `+after` as
    evict_after_prompt, `+prefill<N>x` as prefill_allowance."""
    from kvpop.evaluation.harness import base_label, set_protocol
    req = request(pb, inst.prompt, base_label(policy), budget, new_tokens,
                  messages=getattr(inst, "messages", None))
    req.sink_tokens, req.recent_tokens = sink, recent
    set_protocol(req, policy)
    return req


async def send(stub, reqs, rate: float, seed: int, done=lambda s: None) -> list[AsyncStream]:
    """Each request at its seeded Poisson arrival (all at once when rate is inf), every one a task on
    this loop through the gateway's ``grpc.aio`` stub, request i as client ``bench-user-i``; returns
    them finished, calling ``done`` on each as it ends."""
    rng = random.Random(seed)
    streams = []
    arrival = time.perf_counter()
    for i, req in enumerate(reqs):
        if math.isfinite(rate):
            # Due times from the start, not sleeps back to back: a busy loop must not thin the offered rate.
            arrival += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
        streams.append(AsyncStream(req, client_id=f"bench-user-{i}").start(stub))
    for finished in asyncio.as_completed([s.task for s in streams]):
        done(await finished)
    return streams


async def run_one(stub, pb, insts, policy: str, budget: float, rate: float, compute: str | None, seed: int, bar,
                  sink: int = 4, recent: int = 8, new_tokens: int = 256, security=None) -> dict:
    reqs = [make_request(pb, inst, policy, budget, new_tokens, sink, recent) for inst in insts]
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    async with PeakPoller(compute, security=security) as peaks:
        streams = await send(stub, reqs, rate, seed, lambda s: bar.update(1))
    wall = max(s.t_end for s in streams) - t0
    return row(policy, rate, streams, insts, wall, peaks, cpu_seconds() - cpu0)


def row(policy: str, rate: float, streams: list[AsyncStream], insts, wall: float, peaks: PeakPoller,
        cpu: float) -> dict:
    from kvpop.tasks.checker import is_correct
    answered = [(s, inst) for s, inst in zip(streams, insts) if s.error is None and s.stamps]
    ok = [s for s, _ in answered]
    out_tokens = sum(len(s.stamps) for s in ok)
    evicted = sum(s.usage.kv_blocks_evicted for s in ok if s.usage)
    network = sum(s.usage.network_evictions for s in ok if s.usage)
    # What the network did not rank, by who did and why: compute's fallback per reason
    # (no plan in time, cleanup, ...) and the cache-manager's heuristic.
    others = Counter()
    for u in (s.usage for s in ok if s.usage):
        others.update(u.fallback_reasons)
        others["advisor_heuristic"] += u.advisor_heuristic_evictions
    ms = lambda xs, q: round(1000 * percentile(xs, q), 3)
    ttft, tpot = [s.ttft for s in ok], [s.tpot for s in ok if len(s.stamps) > 1]
    itl = [x for s in ok for x in s.itls()]
    return {
        "policy": policy, "rate": "inf" if not math.isfinite(rate) else rate, "requests": len(streams),
        "errors": len(streams) - len(ok), "error_sample": next((s.error for s in streams if s.error), None),
        "seconds": round(wall, 3), "requests_per_s": round(len(ok) / wall, 3),
        "output_tokens_per_s": round(out_tokens / wall, 2),
        "ttft_p50_ms": ms(ttft, 0.5), "ttft_p99_ms": ms(ttft, 0.99),
        "tpot_p50_ms": ms(tpot, 0.5), "tpot_p99_ms": ms(tpot, 0.99),
        "itl_p50_ms": ms(itl, 0.5), "itl_p99_ms": ms(itl, 0.99),
        "peak_running": peaks.running, "peak_pages": peaks.pages,
        "budget_shrinks": None if peaks.shrinks_last is None else peaks.shrinks_last - peaks.shrinks_first,
        "network_share": round(network / evicted, 4) if policy.startswith("learned") and evicted else None,
        "network_evictions": network, "evictions": evicted,
        "not_network": {k: n for k, n in sorted(others.items()) if n} if policy.startswith("learned") else {},
        "accuracy": round(sum(is_correct(inst, "".join(s.text)) for s, inst in answered) / max(1, len(ok)), 4),
        "client_cpu_s": round(cpu, 2), "_ttft": ttft, "_itl": itl,
        "_texts": [None if s.error else "".join(s.text) for s in streams],
    }


async def serve(args, insts, policies: list[str], rates: list[float], address: str, compute: str | None,
                security) -> tuple[list[dict], float]:
    """Every (rate, policy) row in turn over one gateway channel, and this client's CPU seconds for them."""
    from kvpop.runtime.pb import generate_pb2, generate_pb2_grpc
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generate_pb2_grpc.KVpopStub(ch)
        # Warm both paths (first calls are slow), not measured.
        for pol in policies:
            if pol != "hf":
                req = make_request(generate_pb2, insts[0], pol, args.budget, 4, args.sink, args.recent)
                await AsyncStream(req).start(stub).task
        cpu0 = cpu_seconds()
        bar = tqdm(total=len(policies) * len(rates) * len(insts), desc="bench serve", dynamic_ncols=True)
        rows = []
        for rate in rates:
            for pol in policies:
                if pol == "hf":
                    from kvpop.bench.hf_baseline import run_hf
                    # Blocks the loop, which has nothing else in flight meanwhile.
                    rows.append(run_hf(args.model, insts, rate, args.seed, bar, args.new_tokens, args.hf_max_batch))
                    continue
                rows.append(await run_one(stub, generate_pb2, insts, pol, args.budget, rate, compute, args.seed,
                                          bar, args.sink, args.recent, args.new_tokens, security=security))
        bar.close()
    return rows, round(cpu_seconds() - cpu0, 2)


def run(args) -> int:
    if args.quick:
        args.requests, args.rates, args.num_pages, args.new_tokens = 8, "inf", min(args.num_pages, 3000), 32
    rates = [float(r) for r in args.rates.split(",")]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if any(r <= 0 for r in rates) or args.requests < 1 or not policies:
        print("kvpop bench serve: --rates must be > 0, --requests >= 1, --policies non-empty")
        return 2
    try:
        insts = (workload(args.requests, args.seed) if args.suite == "tasks" else
                 real_workload(str(args.model), args.requests, args.seed,
                               [int(x) for x in args.lengths.split(",") if x.strip()],
                               [f.strip() for f in args.tasks.split(",") if f.strip()]))
    except ValueError as e:
        print(f"kvpop bench serve: {e}")
        return 2
    chunks = [c.strip() for c in (args.prefill_chunks or "").split(",") if c.strip()]
    if not all(c.isdigit() and int(c) > 0 for c in chunks) or (args.via and chunks):
        print("kvpop bench serve: --prefill-chunks takes positive token counts, and starts its own stacks "
              "(not with --via)")
        return 2
    try:
        layouts = parse_layouts(args.layouts) if args.layouts else [(args.block_size, args.page_size)]
    except ValueError as e:
        print(f"kvpop bench serve: {e}")
        return 2
    if args.via and args.layouts:
        print("kvpop bench serve: --layouts starts its own stacks (not with --via)")
        return 2
    rows, client_cpu = [], 0.0
    for layout in layouts:
        for chunk in [int(c) for c in chunks] or [None]:      # None: compute's own setting
            got, cpu = _serve_on_stack(args, insts, policies, rates, chunk, layout)
            rows += [{**r, "prefill_chunk": chunk, "layout": f"{layout[0]}/{layout[1]}"} for r in got]
            client_cpu += cpu
    write(args, rows, policies, rates, client_cpu)
    return 0


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """'1/16,16/16' -> [(1, 16), (16, 16)]: block size / page size, the page a multiple of the block."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        b, _, pg = part.partition("/")
        if not (b.isdigit() and pg.isdigit() and int(b) > 0 and int(pg) > 0 and int(pg) % int(b) == 0):
            raise ValueError(f"--layouts takes BLOCK/PAGE pairs, the page a multiple of the block; got {part!r}")
        out.append((int(b), int(pg)))
    return out


def _serve_on_stack(args, insts, policies, rates, chunk: int | None,
                    layout: tuple[int, int] | None = None) -> tuple[list[dict], float]:
    """serve() on --via's stack, or on one started for the run (with ``chunk`` as compute's prompt chunk,
    ``layout`` as its block and page sizes, and a pool of --num-pages pages of --page-size's memory)."""
    stack = None
    address, compute = args.via, args.compute
    if not args.via:
        from kvpop.stack.up import start_stack
        block, page = layout or (args.block_size, args.page_size)
        pages = max(2, args.num_pages * args.page_size // page)
        extra = ["--prefill-chunk", str(chunk)] if chunk is not None else []
        print(f"starting a stack on {args.model}: {pages} KV pages of {page} positions, block size {block}, "
              f"max {args.max_num_seqs} sequences{f', prefill chunk {chunk}' if chunk else ''} ...")
        stack = start_stack(Path(tempfile.mkdtemp(prefix="kvpop-bench-serve-")), model=args.model, timeout=180,
                            service_args={"compute": ["--block-size", str(block), "--page-size", str(page),
                                                      "--num-pages", str(pages),
                                                      "--max-num-seqs", str(args.max_num_seqs), *extra]})
        address, compute = stack.gateway, stack.proc("compute").address
    try:
        return asyncio.run(serve(args, insts, policies, rates, address, compute,
                                 stack.security() if stack is not None else None))
    finally:
        if stack is not None:
            from kvpop.stack.down import stop_stack
            stop_stack(stack, grace=5)


def variant(r: dict) -> str:
    """Which stack a row ran on: its layout (block/page) and prompt chunk, as far as they vary."""
    parts = [f"layout {r['layout']}" if r.get("layout") else "", f"chunk {r['prefill_chunk']}"
             if r.get("prefill_chunk") else ""]
    return ", ".join(p for p in parts if p)


def summary(rows: list[dict], policies: list[str], rates: list[float]) -> dict:
    """The ratios at the highest rate; with several stacks (layouts, prompt
    chunks), per stack (``by_variant``) and across them (``across``: each
    stack's tokens/s of the first non-dense policy over the first stack's), the
    first stack's at the top level."""
    names = list(dict.fromkeys(variant(r) for r in rows))
    if len(names) > 1:
        per = {n: _summary([r for r in rows if variant(r) == n], policies, rates) for n in names}
        top = "inf" if not math.isfinite(max(rates)) else max(rates)
        tps = {(variant(r), r["policy"]): r["output_tokens_per_s"] for r in rows if r["rate"] == top}
        across = {}
        for p in policies:
            base = tps.get((names[0], p))
            if base:
                across[p] = {n: round(tps[(n, p)] / base, 3) for n in names if (n, p) in tps}
        return {**per[names[0]], "by_variant": per, "tokens_per_s_over_first": across}
    return _summary(rows, policies, rates)


def _summary(rows: list[dict], policies: list[str], rates: list[float]) -> dict:
    top = "inf" if not math.isfinite(max(rates)) else max(rates)
    at = {r["policy"]: r for r in rows if r["rate"] == top}
    other = next((p for p in policies if p not in ("dense", "hf")), None)
    out = {"rate": top, "policies": policies}
    if "dense" in at and other in at:
        d, o = at["dense"], at[other]
        out.update(policy=other,
                   throughput_ratio=round(o["output_tokens_per_s"] / d["output_tokens_per_s"], 3)
                   if d["output_tokens_per_s"] else None,
                   concurrency_ratio=round(o["peak_running"] / d["peak_running"], 3) if d["peak_running"] else None,
                   p99_ttft_ratio=round(o["ttft_p99_ms"] / d["ttft_p99_ms"], 3) if d["ttft_p99_ms"] else None,
                   accuracy={"dense": d["accuracy"], other: o["accuracy"]})
    if "dense" in at and "hf" in at and at["hf"]["output_tokens_per_s"]:
        # Comparison 4: the served engine, dense, over transformers' static batches of the same arrivals.
        out["served_dense_over_hf"] = {
            "throughput_ratio": round(at["dense"]["output_tokens_per_s"] / at["hf"]["output_tokens_per_s"], 3),
            "ttft_p50_ratio": round(at["dense"]["ttft_p50_ms"] / at["hf"]["ttft_p50_ms"], 3)
            if at["hf"]["ttft_p50_ms"] else None}
    return out


def markdown(rows: list[dict]) -> str:
    head = ["policy", "layout", "prefill chunk", "rate (req/s)", "req/s", "out tok/s", "TTFT p50/p99 ms", "TPOT p50/p99 ms",
            "ITL p50/p99 ms", "peak running", "peak pages", "budget shrinks", "network", "accuracy", "errors"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        share = "-" if r["network_share"] is None else f"{100 * r['network_share']:.1f}%"
        if r.get("not_network") and r.get("evictions"):
            share += " (" + ", ".join(f"{k} {100 * n / r['evictions']:.1f}%" for k, n in r["not_network"].items()) + ")"
        out.append("| " + " | ".join(str(x) for x in [
            r["policy"], r.get("layout") or "-", r.get("prefill_chunk") or "-", r["rate"], r["requests_per_s"], r["output_tokens_per_s"],
            f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}", f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f}",
            f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f}", r["peak_running"], r["peak_pages"],
            "-" if r.get("budget_shrinks") is None else r["budget_shrinks"], share,
            f"{r['accuracy']:.3f}", r["errors"]]) + " |")
    return "\n".join(out) + "\n"


def write(args, rows: list[dict], policies: list[str], rates: list[float], client_cpu: float | None = None) -> None:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    clean = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    s = summary(clean, policies, rates)
    # The client shares the host with the stack it measures: its own CPU cost stays in view.
    s["client_cpu_s"] = client_cpu
    meta = {"command": "kvpop bench serve", "suite": args.suite, "requests": args.requests, "budget": args.budget,
            "new_tokens": args.new_tokens,
            "sink": args.sink, "recent": args.recent,
            "num_pages": None if args.via else args.num_pages, "block_size": args.block_size,
            "page_size": args.page_size, "layouts": args.layouts, "seed": args.seed}
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": clean}, indent=1) + "\n")
    with open(out / "outputs.jsonl", "w") as f:      # each request's text, in workload order
        for r in rows:
            for i, text in enumerate(r.get("_texts", [])):
                f.write(json.dumps({k: r.get(k) for k in ("policy", "rate", "layout", "prefill_chunk")}
                                   | {"request": i, "text": text}) + "\n")
    (out / "summary.json").write_text(json.dumps(s, indent=1) + "\n")
    md = markdown(clean)
    (out / "results.md").write_text(f"<!-- {json.dumps(meta)} -->\n" + md)
    plots(rows, policies, rates, out)
    print(md)
    print(json.dumps(s))
    print(f"wrote {out}/results.json, summary.json, results.md, outputs.jsonl, throughput.png, latency_cdf.png")


def plots(rows, policies, rates, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs = {r: (i, str(r)) for i, r in enumerate(sorted({row["rate"] for row in rows}, key=lambda v: float(v)))}
    several = len({variant(r) for r in rows}) > 1
    name = lambda r: f"{r['policy']}, {variant(r)}" if several else r["policy"]
    fig, ax = plt.subplots(figsize=(5, 3.4))
    if len(xs) == 1:
        # One rate: a bar per (stack, policy), its accuracy on top, so speed and quality read together.
        labels = list(dict.fromkeys(name(r) for r in rows))
        tps = [next(r["output_tokens_per_s"] for r in rows if name(r) == lb) for lb in labels]
        acc = [next(r["accuracy"] for r in rows if name(r) == lb) for lb in labels]
        bars = ax.bar(range(len(labels)), tps, color=["#888" if lb.startswith("dense") else "#3a7" for lb in labels])
        for b_, a_ in zip(bars, acc):
            ax.annotate(f"acc {a_:.2f}", (b_.get_x() + b_.get_width() / 2, b_.get_height()), ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(range(len(labels)), [lb.replace(", ", "\n") for lb in labels], fontsize=7)
        ax.set_title(f"all requests at once (rate {next(iter(xs))})", fontsize=9)
    else:
        for label in dict.fromkeys(name(r) for r in rows):
            pts = sorted((xs[r["rate"]][0], r["output_tokens_per_s"]) for r in rows if name(r) == label)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_xticks([v[0] for v in xs.values()], [v[1] for v in xs.values()])
        ax.set_xlabel("offered load (requests/s)")
        ax.legend()
    ax.set_ylabel("output tokens/s")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    plt.close(fig)
    top = max(xs, key=lambda v: float(v))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, key, title in ((axes[0], "_ttft", "time to first token (s)"), (axes[1], "_itl", "inter-token latency (s)")):
        for r in rows:
            if r["rate"] == top and r.get(key):
                v = sorted(r[key])
                ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=name(r))
        ax.set_xscale("log")
        ax.set_title(f"{title}, rate {top}", fontsize=10)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=120)
    plt.close(fig)
