"""Kernel and decode benchmarks; kvkernels/gpu_check.sh runs this on a GPU host.

    python -m kvpop.bench.kernels --out gpu_out            # on a CUDA device
    python -m kvpop.bench.kernels --dry-run --out /tmp/b   # tiny sizes on CPU: checks the code paths

1. attention: paged_attention time and achieved bandwidth (bytes of K/V read
   / time) against the GPU's peak memory bandwidth and a measured device
   copy, for our CUDA kernel, the PyTorch reference, and torch SDPA over a
   contiguous (unpaged) cache as a yardstick.
2. decode: tokens/s of a random-weight ~1B Llama (Llama-3.2-1B shapes) in a
   static-shape decode loop over our kernels, batch 1/16/64, dense vs h2o at
   87.5% compression, CUDA Graph off/on.
3. engine: the same model through services.compute.engine.engine.LLMEngine (public
   API only, eager), dense vs h2o.
Results: a printed table and <out>/bench.json (+ bench.png with matplotlib).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from kvkernels import cuda, graphs, ops, reference

try:
    from tqdm import tqdm
except ImportError:  # GPU hosts may have torch + CuPy only
    def tqdm(it, **_):
        return it

KNOWN_PEAK_BW = {"H200": 4.8e12, "H100 80GB HBM3": 3.35e12, "H100 PCIe": 2.0e12,
                 "H100": 3.35e12, "A100-SXM4-80GB": 2.04e12, "A100": 1.55e12, "L40S": 0.864e12}


# ---------------------------------------------------------------- timing
def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_ms(fn, dev: torch.device, iters: int, warmup: int = 3) -> float:
    """Median wall time of fn() in ms (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def peak_bandwidth(dev: torch.device) -> tuple[float | None, str]:
    """Theoretical DRAM bandwidth in bytes/s, and where the number came from."""
    if dev.type != "cuda":
        return None, "cpu"
    idx = dev.index or 0
    try:
        import cupy
        rt = cupy.cuda.runtime
        props = rt.getDeviceProperties(idx)
        clock_khz, bus_bits = props.get("memoryClockRate"), props.get("memoryBusWidth")
        if not clock_khz:  # CUDA 13 dropped the field from cudaDeviceProp
            clock_khz = rt.deviceGetAttribute(36, idx)   # cudaDevAttrMemoryClockRate
            bus_bits = rt.deviceGetAttribute(37, idx)    # cudaDevAttrGlobalMemoryBusWidth
        if clock_khz and bus_bits:
            return 2.0 * clock_khz * 1e3 * bus_bits / 8, "memory clock x bus width (DDR)"
    except Exception:
        pass
    name = torch.cuda.get_device_name(idx)
    for key, bw in KNOWN_PEAK_BW.items():
        if key in name:
            return bw, f"datasheet value for {key}"
    return None, "unknown"


def copy_bandwidth(dev: torch.device, nbytes: int) -> float:
    """Achieved device-to-device copy bandwidth (read + write bytes / s)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), dev, iters=10)
    return 2 * nbytes / (ms * 1e-3)


# ---------------------------------------------------------------- 1. attention
def attention_case(B, ctx, Hq, Hkv, d, bs, dtype, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    NB = math.ceil(ctx / bs)
    P = 1 + B * Hkv * NB
    k_pages = torch.randn(P, bs, d, device=dev, dtype=dtype)
    v_pages = torch.randn(P, bs, d, device=dev, dtype=dtype)
    page_table = (torch.randperm(P - 1, generator=g) + 1).view(B, Hkv, NB).to(dev, torch.int32)
    num_blocks = torch.full((B,), NB, dtype=torch.int32, device=dev)
    last = torch.full((B,), ctx - (NB - 1) * bs, dtype=torch.int32, device=dev)
    q = torch.randn(B, Hq, d, device=dev, dtype=dtype)
    return q, k_pages, v_pages, page_table, num_blocks, last


def bench_attention(args, dev, dtype, peak, copy_bw, results):
    Hq, Hkv, d, bs = (4, 2, 32, 4) if args.dry_run else (32, 8, 128, 16)
    # (batch, context, head_dim): long single sequences (split path), big batches,
    # and the decode benchmark's own shape (head_dim 64).
    shapes = ([(1, 64, d), (2, 37, d)] if args.dry_run else
              [(1, 8192, d), (1, 32768, d), (16, 4096, d), (64, 2048, d), (64, 8192, d), (64, 2048, 64)])
    impls = [("reference", reference)]
    if dev.type == "cuda" and cuda.available():
        impls.insert(0, ("cuda", cuda))
    for B, ctx, d in tqdm(shapes, desc="attention"):
        case = attention_case(B, ctx, Hq, Hkv, d, bs, dtype, dev)
        kv_bytes = 2 * B * Hkv * ctx * d * case[1].element_size()
        scale = 1 / math.sqrt(d)
        rows = []
        for name, impl in impls:
            if name == "reference" and kv_bytes > 2e9:
                continue  # the reference's fp32 gathers would need ~4x the cache
            ms = time_ms(lambda: impl.paged_attention(*case, scale), dev, args.iters)
            rows.append((name, ms))
        # Yardstick: torch SDPA over the same K/V already contiguous (no paging, no block mass).
        kc = case[1][case[3].long()].reshape(B, Hkv, -1, d)[:, :, :ctx]
        vc = case[2][case[3].long()].reshape(B, Hkv, -1, d)[:, :, :ctx]
        q4 = case[0][:, :, None]
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q4, kc, vc, enable_gqa=True)
        try:  # enable_gqa needs torch >= 2.5; the yardstick is optional
            rows.append(("torch_sdpa_contiguous", time_ms(sdpa, dev, args.iters)))
        except Exception as e:
            results["notes"].append(f"torch SDPA yardstick skipped: {type(e).__name__}: {e}")
        del kc, vc
        for name, ms in rows:
            bw = kv_bytes / (ms * 1e-3)
            results["attention"].append(dict(
                backend=name, batch=B, context=ctx, q_heads=Hq, kv_heads=Hkv, head_dim=d,
                block_size=bs, dtype=str(dtype).removeprefix("torch."), ms=round(ms, 4),
                kv_bytes=kv_bytes, achieved_GBps=round(bw / 1e9, 1),
                frac_of_peak=round(bw / peak, 3) if peak else None,
                frac_of_copy=round(bw / copy_bw, 3) if copy_bw else None))
        del case
        save(results, Path(args.out))


# ---------------------------------------------------------------- 2. decode loop
def build_model(args, dev, dtype):
    from services.compute.model.model import TransformerModel
    from services.compute.model.config import ModelConfig
    if args.dry_run:
        cfg = ModelConfig(architecture="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                          max_position_embeddings=4096)
    else:  # Llama-3.2-1B shapes, random weights
        cfg = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=2048,
                          intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                          head_dim=64, rope_theta=500000.0, tie_word_embeddings=True,
                          max_position_embeddings=131072, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with torch.device(dev):
        model = TransformerModel(cfg)
    model = model.to(dtype).eval()
    model.rotary.reserve(max(args.context + args.warmup_steps + args.steps,
                               args.engine_context + args.engine_steps) + 64)
    return model


class LocalDecoder:
    """Static-shape decode loop over the kernel ops, the engine's page layout.

    B sequences in lockstep, each already holding `context` tokens (random
    K/V: only the amount read matters for speed). dense keeps every block;
    h2o keeps `budget_blocks` per (layer, kv-head) row: at each block
    boundary one eviction round drops the lowest accumulated-attention
    evictable block per row (sink and recent blocks protected) and reuses its
    page for the new block, so shapes never change and the step replays from
    one CUDA Graph. All bookkeeping is device ops (no host sync per step)."""

    SINK_BLOCKS, RECENT_BLOCKS = 1, 2

    def __init__(self, model, B: int, context: int, steps: int, policy: str, compression: float,
                 block_size: int, use_graphs: bool):
        cfg = model.config
        self.model, self.B, self.bs, self.policy = model, B, block_size, policy
        self.L, self.Hq, self.Hkv, self.d = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.G = self.Hq // self.Hkv
        self.scale = 1 / math.sqrt(self.d)
        dev, dtype = model.device, model.dtype
        total = context + steps
        if policy == "dense":
            self.nb = math.ceil(context / block_size)
            cap = math.ceil(total / block_size)
        else:
            floor = self.SINK_BLOCKS + self.RECENT_BLOCKS + 1
            self.nb = cap = max(floor, int((1 - compression) * total) // block_size)
        self.cap = cap
        self.fill = context - (self.nb - 1) * block_size if policy == "dense" else block_size
        rows = self.L * B * self.Hkv
        pages = 1 + rows * cap
        self.k_pages = torch.randn(pages, block_size, self.d, device=dev, dtype=dtype)
        self.v_pages = torch.randn(pages, block_size, self.d, device=dev, dtype=dtype)
        self.page_table = (torch.arange(rows * cap, device=dev, dtype=torch.int32) + 1).view(
            self.L, B, self.Hkv, cap)
        self.scores = (torch.zeros(self.L, B, self.Hkv, cap, device=dev)
                       if policy != "dense" else None)
        self.ids = torch.randint(0, cfg.vocab_size, (B,), device=dev)
        self.pos = torch.full((B,), context, dtype=torch.long, device=dev)
        self.num_blocks = torch.full((B,), self.nb, dtype=torch.int32, device=dev)
        self.last_len = torch.full((B,), self.fill, dtype=torch.int32, device=dev)
        self.write_off = torch.zeros(B * self.Hkv, dtype=torch.long, device=dev)
        self.runner = graphs.GraphRunner(self._step, enabled=use_graphs)
        self.evictable = torch.zeros(cap, dtype=torch.bool, device=dev)
        self.evictable[self.SINK_BLOCKS:cap - self.RECENT_BLOCKS] = True
        self.rounds = 0

    def _step(self, ids, pos, page_table, num_blocks, last_len, write_page, write_off):
        def attention(i, q, k, v):
            ops.kv_append(self.k_pages, self.v_pages, k.reshape(-1, self.d), v.reshape(-1, self.d),
                          write_page[i], write_off)
            out, mass = ops.paged_attention(q, self.k_pages, self.v_pages, page_table[i],
                                            num_blocks, last_len, self.scale)
            if self.scores is not None:  # h2o: accumulated attention per block
                self.scores[i].add_(mass.view(self.B, self.Hkv, self.G, -1).sum(2))
            return out
        hidden = self.model(ids, pos, attention)
        return self.model.compute_logits(hidden).argmax(-1)

    def _new_block(self) -> None:
        if self.policy == "dense":
            self.nb += 1
        else:
            self._evict_one()
        self.fill = 0

    def _evict_one(self) -> None:
        R, NB = self.L * self.B * self.Hkv, self.cap
        scores = self.scores.view(R, NB)
        cols = ops.eviction_select(scores, self.evictable.expand(R, NB), 1)
        keep = torch.ones(R, NB, dtype=torch.bool, device=scores.device).scatter_(1, cols, False)
        # Survivors keep their order; the evicted page moves to the last column
        # and becomes the new block (its stale tail is masked by last_block_len).
        order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices
        self.page_table.copy_(self.page_table.view(R, NB).gather(1, order).view_as(self.page_table))
        new_scores = scores.gather(1, order)
        new_scores[:, -1] = 0
        self.scores.copy_(new_scores.view_as(self.scores))
        self.rounds += 1

    @torch.no_grad()
    def step(self) -> None:
        if self.fill == self.bs:
            self._new_block()
        self.fill += 1
        nb = self.nb
        nbb = nb if self.policy != "dense" else min(self.cap, 16 * math.ceil(nb / 16))  # graph bucket
        self.num_blocks.fill_(nb)
        self.last_len.fill_(self.fill)
        self.write_off.fill_(self.fill - 1)
        write_page = self.page_table[:, :, :, nb - 1].reshape(self.L, -1).long()
        self.ids = self.runner((self.B, nbb), self.ids, self.pos, self.page_table[..., :nbb],
                               self.num_blocks, self.last_len, write_page, self.write_off)
        if self.runner.graphs:
            self.ids = self.ids.clone()   # the graph's output buffer is reused by the next replay
        self.pos += 1


def save(results: dict, out_dir: Path) -> None:
    """Written after every run, so a run killed by its timeout keeps what it measured."""
    (out_dir / "bench.json").write_text(json.dumps(results, indent=2))


def bench_decode(args, model, results):
    dev = model.device
    use_graphs_opts = [False, True] if dev.type == "cuda" else [False]
    runs = [(B, pol, gr) for B in args.batches for pol in ("dense", "h2o") for gr in use_graphs_opts]
    for B, policy, use_graphs in tqdm(runs, desc="decode"):
        row = dict(mode="local_loop", batch=B, policy=policy, compression=0.0 if policy == "dense"
                   else args.compression, cuda_graph=use_graphs, context=args.context,
                   steps=args.steps, backend=ops.backend_for(model.model.embed_tokens.weight))
        try:
            dec = LocalDecoder(model, B, args.context, args.warmup_steps + args.steps, policy, args.compression,
                               args.block_size, use_graphs)
            for _ in range(args.warmup_steps):
                dec.step()
            sync(dev)
            t = time.perf_counter()
            for _ in range(args.steps):
                dec.step()
            sync(dev)
            dt = time.perf_counter() - t
            row.update(tokens_per_s=round(B * args.steps / dt, 1), ms_per_step=round(dt / args.steps * 1e3, 3),
                       resident_blocks_per_row=dec.nb, eviction_rounds=dec.rounds,
                       graphs_captured=len(dec.runner.graphs), graph_failures=dec.runner.failed or None)
            del dec
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            results["errors"].append(traceback.format_exc())
        results["decode"].append(row)
        save(results, Path(args.out))
        if dev.type == "cuda":
            torch.cuda.empty_cache()


# ---------------------------------------------------------------- 3. engine
def bench_engine(args, model, results, deadline):
    from services.compute.engine.engine import EngineConfig, EvictionParams, LLMEngine, SamplingParams
    dev = model.device
    ctx, steps, bs = args.engine_context, args.engine_steps, args.block_size
    for B in tqdm(args.batches, desc="engine"):
        for policy in ("dense", "h2o"):
            row = dict(mode="engine", batch=B, policy=policy, cuda_graph=False, context=ctx, steps=steps,
                       compression=0.0 if policy == "dense" else args.compression)
            if time.monotonic() > deadline:
                row["error"] = "skipped: bench time budget spent"
                results["engine"].append(row)
                continue
            try:
                cfg = model.config
                pages = 2 + B * cfg.num_layers * cfg.num_kv_heads * math.ceil((ctx + steps + bs) / bs)
                engine = LLMEngine(EngineConfig(device=str(dev), dtype=str(model.dtype).removeprefix("torch."),
                                                block_size=bs, num_pages=pages, max_num_seqs=B,
                                                max_model_len=ctx + steps + bs, prefill_chunk=512),
                                   model=model)
                budget = None if policy == "dense" else 1.0 - args.compression
                g = torch.Generator().manual_seed(B)
                for i in range(B):
                    prompt = torch.randint(0, cfg.vocab_size, (ctx,), generator=g).tolist()
                    engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=steps, ignore_eos=True),
                                       EvictionParams(policy=policy, budget=budget))
                started, done, decode_tokens, t_decode = set(), 0, 0, None
                t0 = time.perf_counter()
                while done < B:
                    outs = engine.step()
                    if t_decode is not None:
                        decode_tokens += sum(o.token_id is not None for o in outs)
                    for o in outs:
                        started.add(o.request_id)
                        done += o.finished
                    if t_decode is None and len(started) == B:
                        sync(dev)
                        t_decode = time.perf_counter()   # every prompt is prefilled: decode from here
                    if time.monotonic() > deadline + 60:
                        raise TimeoutError("bench time budget spent during this engine run")
                sync(dev)
                dt = time.perf_counter() - t_decode
                row.update(tokens_per_s=round(decode_tokens / dt, 1) if dt > 0 else None,
                           decode_tokens=decode_tokens, total_s=round(time.perf_counter() - t0, 2),
                           stats={k: v for k, v in engine.stats().items()
                                  if isinstance(v, (int, float, str))})
                del engine
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
                results["errors"].append(traceback.format_exc())
            results["engine"].append(row)
            save(results, Path(args.out))
            if dev.type == "cuda":
                torch.cuda.empty_cache()


# ---------------------------------------------------------------- report
def table(rows: list[dict], cols: list[str]) -> str:
    out = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        out.append(" | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols))
    return "\n".join(out)


def report(results: dict, out_dir: Path) -> str:
    parts = [f"device: {results['device']}; peak bandwidth {results['peak_GBps']} GB/s "
             f"({results['peak_source']}); device copy {results['copy_GBps']} GB/s"]
    if results["attention"]:
        parts += ["", "## paged attention", table(results["attention"], [
            "backend", "batch", "context", "head_dim", "dtype", "ms", "achieved_GBps", "frac_of_peak", "frac_of_copy"])]
    for key in ("decode", "engine"):
        if results[key]:
            parts += ["", f"## {key} tokens/s", table(results[key], [
                "mode", "batch", "policy", "compression", "cuda_graph", "context", "tokens_per_s",
                "ms_per_step", "error"])]
    text = "\n".join(parts)
    (out_dir / "bench.md").write_text(text + "\n")
    return text


def plot(results: dict, out_dir: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in results["decode"] + results["engine"] if r.get("tokens_per_s")]
    if not rows:
        return
    labels = [f"{r['mode'][:5]} B{r['batch']} {r['policy']}{' +graph' if r['cuda_graph'] else ''}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.5))
    ax.barh(labels, [r["tokens_per_s"] for r in rows])
    ax.set_xlabel("decode tokens/s")
    ax.set_title(f"~1B random Llama, {results['device']}")
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="gpu_out", help="folder for bench.json / bench.md / bench.png")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes; runs on CPU")
    p.add_argument("--sections", default="attention,decode,engine")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--context", type=int, default=2048, help="tokens already cached per sequence")
    p.add_argument("--steps", type=int, default=64, help="timed decode steps")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--compression", type=float, default=0.875, help="h2o: 1 - budget / length")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--engine-context", type=int, default=1024)
    p.add_argument("--engine-steps", type=int, default=32)
    p.add_argument("--iters", type=int, default=20, help="timed iterations per attention shape")
    p.add_argument("--time-budget", type=float, default=400, help="seconds; later engine runs are skipped")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.sections = set(args.sections.split(","))
    if args.dry_run:
        args.batches = [1, 2]
        args.context, args.steps, args.warmup_steps, args.iters = 40, 12, 3, 2
        args.block_size, args.engine_context, args.engine_steps = 4, 24, 6
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    use_cuda = torch.cuda.is_available() and not args.dry_run
    if not use_cuda and not args.dry_run:
        print("no CUDA device: the full-size benchmark needs one (use --dry-run on CPU)", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dtype = torch.bfloat16 if use_cuda else torch.float32
    peak, peak_src = peak_bandwidth(dev)
    copy_bw = copy_bandwidth(dev, 1 << 30) if use_cuda else None
    results = dict(device=torch.cuda.get_device_name(dev) if use_cuda else "cpu",
                   kernels_backend=ops.backend_for(torch.empty(0, device=dev)),
                   torch=torch.__version__, dtype=str(dtype).removeprefix("torch."),
                   peak_GBps=round(peak / 1e9, 1) if peak else None, peak_source=peak_src,
                   copy_GBps=round(copy_bw / 1e9, 1) if copy_bw else None,
                   args={k: sorted(v) if isinstance(v, set) else v for k, v in vars(args).items()},
                   attention=[], decode=[], engine=[], errors=[], notes=[])
    try:
        import cupy
        results["cupy"] = cupy.__version__
    except Exception:
        results["cupy"] = None
    with torch.no_grad():
        if "attention" in args.sections:
            try:
                bench_attention(args, dev, dtype, peak, copy_bw, results)
            except Exception:
                results["errors"].append(traceback.format_exc())
        model = None
        if args.sections & {"decode", "engine"}:
            model = build_model(args, dev, dtype)
            results["model_params"] = sum(p.numel() for p in model.parameters())
        if "decode" in args.sections:
            bench_decode(args, model, results)
        if "engine" in args.sections:
            try:
                bench_engine(args, model, results, t_start + args.time_budget)
            except Exception:
                results["errors"].append(traceback.format_exc())
    results["wall_s"] = round(time.monotonic() - t_start, 1)
    save(results, out_dir)
    print(report(results, out_dir))
    plot(results, out_dir)
    for err in results["errors"]:
        print(err, file=sys.stderr)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
