"""`kvpop bench learned`: what serving `learned` costs next to `h2o`, through
a running stack (real gRPC, the cache-manager's network deciding).

1. Load: 16 concurrent streams of ~1,200-token prompts, the same prompts for
   both policies, rounds interleaved (h2o, learned, h2o, ...): time to first
   token, time per output token, inter-token latency, and the network's share
   of learned evictions.
2. A newcomer: 15 h2o streams decoding, then one 1,200-token request arrives
   (h2o or learned): the 15 streams' inter-token latency while the newcomer
   prefills. A learned newcomer waits for its plans alone; the others must not.
3. The network's time per plan (cache-manager histogram) next to one decode
   step of a 135M Llama-shaped model (SmolLM2-135M's shape, random weights).
"""
from __future__ import annotations

import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from tqdm import tqdm

from kvpop.bench import outputs
from kvpop.bench.loadgen import Stream, percentile as _pct, request
from kvpop.models.fetch import model_arg
from kvpop.runtime.paths import DEFAULT_MODEL_DIR


def add_arguments(p) -> None:
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), type=model_arg,
                   help="model folder for the stack it starts, or a fetched name (smollm2-135m)")
    p.add_argument("--via", metavar="HOST:PORT", help="use this running gateway instead of starting a stack")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1200)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-size", type=int, default=1, help="block size of the stack it starts")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None)


def _prompts(n: int, length: int, seed: int) -> list[str]:
    from kvpop.tasks import suite
    from kvpop.tasks.suite import FAMILIES
    fams = list(FAMILIES)
    return [suite.generate(fams[i % len(fams)], 10_000 + seed * 100 + i, length).prompt for i in range(n)]


def _scoring(metrics_url: str | None) -> tuple[float, float]:
    if not metrics_url:
        return 0.0, 0.0
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    get = lambda name: sum(float(m) for m in re.findall(rf"^{name} (\S+)$", text, re.M))
    return get("kvpop_scoring_latency_seconds_sum"), get("kvpop_scoring_latency_seconds_count")


def step_135m_ms(repeats: int = 5) -> float:
    """One batch-1 decode step (64-token context) of a Llama with SmolLM2-135M's shape."""
    import torch

    from services.compute.engine.engine import EngineConfig, EvictionParams, LLMEngine, SamplingParams
    from services.compute.model.model import TransformerModel
    from services.compute.model.config import ModelConfig

    cfg = ModelConfig(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = TransformerModel(cfg).eval()
    engine = LLMEngine(EngineConfig(block_size=16, num_pages=4096, max_model_len=512), model=model)
    engine.add_request("s", list(range(3, 67)), SamplingParams(max_tokens=repeats + 3, ignore_eos=True),
                       EvictionParams("dense"))
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[2:])


def run(args) -> int:
    from kvpop.runtime.pb import generate_pb2, generate_pb2_grpc

    stack = None
    if args.via:
        address, cm_metrics = args.via, None
    else:
        from kvpop.stack.up import start_stack
        print(f"starting a stack on {args.model} (block size {args.block_size}) ...")
        stack = start_stack(Path(tempfile.mkdtemp(prefix="kvpop-bench-learned-")), model=args.model, timeout=180,
                            service_args={"compute": ["--block-size", str(args.block_size)]})
        address, cm_metrics = stack.gateway, stack.metrics.get("cache-manager")
    try:
        with grpc.insecure_channel(address) as ch:
            stub = generate_pb2_grpc.KVpopStub(ch)
            results = _measure(args, stub, generate_pb2, cm_metrics)
    finally:
        if stack is not None:
            from kvpop.stack.down import stop_stack
            stop_stack(stack, grace=5)
    results["step_135m_ms"] = round(step_135m_ms(), 2)
    plan = results.get("plan_ms")
    if plan:
        results["plan_over_135m_step"] = round(plan / results["step_135m_ms"], 3)
    print_results(results)
    outputs.write(results, args, plot)
    return 0


def _measure(args, stub, pb, cm_metrics) -> dict:
    prompts = _prompts(args.streams, args.prompt_len, 0)
    # Warm-up: first calls of each path (and the cache-manager's) are slow.
    for pol in ("h2o", "learned"):
        Stream(stub, request(pb, prompts[0], pol, args.budget, 8)).start().thread.join()
    load = {p: {"ttft": [], "tpot": [], "itl": [], "evicted": 0, "network": 0} for p in ("h2o", "learned")}
    plan_s = plan_n = 0.0
    bar = tqdm(total=4 * args.repeats, desc="bench learned", dynamic_ncols=True)
    for r in range(args.repeats):
        for pol in ("h2o", "learned"):
            s0, n0 = _scoring(cm_metrics)
            streams = [Stream(stub, request(pb, p, pol, args.budget, args.new_tokens)).start() for p in prompts]
            for s in streams:
                s.thread.join()
            s1, n1 = _scoring(cm_metrics)
            if pol == "learned":
                plan_s, plan_n = plan_s + s1 - s0, plan_n + n1 - n0
            errors = [s.error for s in streams if s.error]
            if errors:
                raise RuntimeError(f"{pol}: {errors[0]}")
            d = load[pol]
            d["ttft"] += [s.ttft for s in streams]
            d["tpot"] += [s.tpot for s in streams]
            d["itl"] += [x for s in streams for x in s.itls()]
            d["evicted"] += sum(s.usage.kv_blocks_evicted for s in streams)
            d["network"] += sum(s.usage.network_evictions for s in streams)
            bar.update(1)
        for pol in ("h2o", "learned"):
            # Scenario 2: 15 h2o streams decoding, one newcomer of policy `pol`.
            back = [Stream(stub, request(pb, p, "h2o", args.budget, 400)).start() for p in prompts[1:args.streams]]
            while min(len(s.stamps) for s in back) < 8 and not any(s.error for s in back):
                time.sleep(0.01)
            new = Stream(stub, request(pb, prompts[0], pol, args.budget, 2)).start()
            new.thread.join()
            for s in back:
                s.thread.join()
            lo, hi = new.t0, new.stamps[0]
            key = f"newcomer_{pol}"
            d = load.setdefault(key, {"ttft": [], "itl": []})
            d["ttft"].append(new.ttft)
            d["itl"] += [x for s in back for x in s.itls(lo, hi)]
            bar.update(1)
    bar.close()
    res = {"streams": args.streams, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
           "budget": args.budget, "repeats": args.repeats}
    for pol in ("h2o", "learned"):
        d = load[pol]
        res[pol] = {"ttft_p50_ms": 1000 * _pct(d["ttft"], 0.5), "tpot_p50_ms": 1000 * _pct(d["tpot"], 0.5),
                    "itl_p50_ms": 1000 * _pct(d["itl"], 0.5), "itl_p99_ms": 1000 * _pct(d["itl"], 0.99),
                    "network_share": d["network"] / d["evicted"] if d["evicted"] else None}
        n = load[f"newcomer_{pol}"]
        res[f"newcomer_{pol}"] = {"ttft_p50_ms": 1000 * _pct(n["ttft"], 0.5),
                                  "others_itl_p50_ms": 1000 * _pct(n["itl"], 0.5),
                                  "others_itl_p99_ms": 1000 * _pct(n["itl"], 0.99)}
    res["ttft_ratio"] = res["learned"]["ttft_p50_ms"] / res["h2o"]["ttft_p50_ms"]
    res["tpot_ratio"] = res["learned"]["tpot_p50_ms"] / res["h2o"]["tpot_p50_ms"]
    res["others_itl_p50_ratio"] = (res["newcomer_learned"]["others_itl_p50_ms"]
                                   / res["newcomer_h2o"]["others_itl_p50_ms"])
    if plan_n:
        res["plan_ms"] = round(1000 * plan_s / plan_n, 3)
        res["plans"] = int(plan_n)
    return res


def print_results(r: dict) -> None:
    print(f"\n{r['streams']} concurrent streams, ~{r['prompt_len']}-token prompts, {r['new_tokens']} new tokens, "
          f"budget {r['budget']}, {r['repeats']} interleaved rounds per policy\n")
    print("| policy | TTFT p50 ms | TPOT p50 ms | ITL p50 ms | ITL p99 ms | network share |")
    print("|---|---|---|---|---|---|")
    for pol in ("h2o", "learned"):
        d = r[pol]
        share = "-" if d["network_share"] is None or pol != "learned" else f"{100 * d['network_share']:.2f}%"
        print(f"| {pol} | {d['ttft_p50_ms']:.1f} | {d['tpot_p50_ms']:.2f} | {d['itl_p50_ms']:.2f} | "
              f"{d['itl_p99_ms']:.2f} | {share} |")
    print(f"\nlearned / h2o: TTFT {r['ttft_ratio']:.2f}x, TPOT {r['tpot_ratio']:.2f}x")
    print("\n| newcomer (15 h2o streams decoding) | its TTFT p50 ms | others' ITL p50 ms | others' ITL p99 ms |")
    print("|---|---|---|---|")
    for pol in ("h2o", "learned"):
        d = r[f"newcomer_{pol}"]
        print(f"| {pol} | {d['ttft_p50_ms']:.1f} | {d['others_itl_p50_ms']:.2f} | {d['others_itl_p99_ms']:.2f} |")
    print(f"others' ITL p50 with a learned newcomer / with an h2o one: {r['others_itl_p50_ratio']:.2f}x")
    if "plan_ms" in r:
        print(f"\nnetwork: {r['plan_ms']:.2f} ms per plan ({r['plans']} plans); one decode step of a 135M "
              f"Llama (SmolLM2 shape, batch 1): {r['step_135m_ms']:.1f} ms; ratio {r['plan_over_135m_step']:.3f}")


def plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    pols = ["h2o", "learned"]
    for ax, key, title in ((axes[0], "ttft_p50_ms", "TTFT p50 (ms), 16 streams"),
                           (axes[1], "tpot_p50_ms", "time per output token p50 (ms)")):
        ax.bar(pols, [r[p][key] for p in pols], color=["#888", "#c33"])
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
