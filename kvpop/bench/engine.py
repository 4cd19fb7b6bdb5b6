"""`kvpop bench engine`: decode tokens/s of our LLMEngine vs Hugging Face
``transformers`` ``generate()`` on the same model and prompts, then the KV
bytes one sequence holds at ``--budget`` vs dense (kvpop/bench/cli.py has the
flags and the method)."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch


def sync(device: str) -> None:
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
    from services.compute.engine.engine import EngineConfig, LLMEngine
    return LLMEngine(EngineConfig(args.model, dtype=args.dtype, device=args.device, max_num_seqs=max_num_seqs,
                                  max_model_len=max_len, **config))


def engine_decode(engine, prompts, new_tokens: int, eviction=None, tag="b") -> dict:
    """One batch through the engine: decode tok/s, the outputs, usage per sequence."""
    from services.compute.engine.engine import SamplingParams
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
            sync(engine.config.device)
            t_first = time.perf_counter()
    sync(engine.config.device)
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
            sync(device)
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

    from services.compute.engine.engine import EvictionParams
    from services.compute.engine.kv_pool import KVPool

    max_batch = max(args.batch)
    prompts = prompts_for(max_batch, args.prompt_len, vocab_size(args.model), args.seed)
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
    kv, long_prompts = {}, prompts_for(4, args.kv_prompt_len, vocab_size(args.model), args.seed + 1)
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


def vocab_size(model_dir) -> int:
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
