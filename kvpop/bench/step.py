"""`kvpop bench step`: what one decode step costs the host, per policy and
number of sequences, in process (no gRPC, no other process on the cores).

On a GPU a small model's decode step is bound by the host: every tensor
operation is a kernel launch and every read of a device value a sync
(docs/benchmarks.md, "On a GPU"). This reports, for each (policy,
sequences): milliseconds per step (the device synchronised around the timed
steps), that time per sequence, and the operations dispatched per step that
launch a kernel (views excluded) and that read a device value back. The
counts are the same on any device, so a CPU run already shows a change that
adds per-sequence launches; the milliseconds need the device itself.

`learned` runs the cache-manager's planner in process (LocalAdvisor); the
time it spends scoring is measured apart and left out of the step's, since a
served stack runs it in another process.
"""
from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operations that only make a view of existing memory: no kernel.
VIEWS = frozenset({"view", "slice", "select", "expand", "permute", "t", "unsqueeze", "squeeze", "_unsafe_view",
                   "split_with_sizes", "split", "transpose", "as_strided", "alias", "detach", "lift_fresh",
                   "unbind", "reshape", "flatten", "_reshape_alias", "narrow"})
# Operations whose result size or value the host must read from the device.
READS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive"})


class DispatchCounter(TorchDispatchMode):
    """Counts the aten operations dispatched inside it, by name, views apart."""

    def __init__(self):
        super().__init__()
        self.launches: collections.Counter = collections.Counter()
        self.views = 0
        self.paused = False     # set while work that belongs to another process runs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            name = func.overloadpacket.__name__
            if name in VIEWS:
                self.views += 1
            else:
                self.launches[name] += 1
        return func(*args, **(kwargs or {}))


def add_arguments(p) -> None:
    from kvpop.models.fetch import model_arg
    from kvpop.runtime.paths import DEFAULT_MODEL_DIR
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), type=model_arg)
    p.add_argument("--policies", default="dense,h2o,learned")
    p.add_argument("--sequences", default="14,96", help="decoding sequences per step, comma-separated")
    p.add_argument("--budget", type=float, default=0.125, help="budget fraction of non-dense policies")
    p.add_argument("--block-size", type=int, default=1, help="positions per block (eviction); pages hold 16")
    p.add_argument("--steps", type=int, default=48, help="timed steps (and as many counted)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--json", type=Path, default=None)


def _measure(args, model_dir: str, policy: str, n: int, device: str) -> dict:
    from kvpop.bench.serve import workload
    from services.compute.eviction.budget import EvictionParams
    from services.compute.engine.engine import EngineConfig, LLMEngine, page_tokens
    from services.compute.model.sampler import SamplingParams

    counter = DispatchCounter()
    advisor = None
    if policy == "learned":
        from kvpop.evaluation.local_advisor import LocalAdvisor
        advisor = LocalAdvisor(model_dir)

        def uncounted(call):
            def wrapped(*a, **k):
                counter.paused = True
                try:
                    return call(*a, **k)
                finally:
                    counter.paused = False
            return wrapped
        # The planner (folding in submit, scoring in take_plans) is the cache-manager's work.
        advisor.submit, advisor.take_plans = uncounted(advisor.submit), uncounted(advisor.take_plans)
    warm = 20
    from services.compute.model.config import ModelConfig
    from services.compute.model.tokenizer import Tokenizer
    mc = ModelConfig.from_hf(model_dir)
    tok = Tokenizer(model_dir)
    prompts = [tok.encode(inst.prompt) for inst in workload(n, 0)]
    # Prompts are prefilled a chunk per step while the first ones already decode:
    # every sequence must outlast all prefills, the warm-up and both measured passes.
    prefill_steps = -(-sum(map(len, prompts)) // 512) + n
    max_tokens = prefill_steps + warm + 2 * args.steps + 8
    # Every sequence held dense at once (pages are per row and block), so none waits for another.
    page = page_tokens(args.block_size, EngineConfig.page_size)
    pages = sum(-(-(len(p) + max_tokens) // page) + 1 for p in prompts) \
        * mc.num_layers * mc.num_kv_heads
    eng = LLMEngine(EngineConfig(model_dir, block_size=args.block_size, device=device, num_pages=pages,
                                 max_num_seqs=max(256, n), cleanup_threshold=float("inf")), advisor=advisor,
                    tokenizer=tok)
    assert eng.config.prefill_chunk == 512, eng.config.prefill_chunk
    for i, ids in enumerate(prompts):
        eng.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                        EvictionParams(policy=policy, budget=None if policy == "dense" else args.budget,
                                       sink=4, recent=8))
    while any(s.num_cached < s.num_prompt for s in eng.seqs.values()):
        eng.step()
    for _ in range(warm):
        eng.step()
    if len(eng.seqs) != n:
        raise RuntimeError(f"{n - len(eng.seqs)} of {n} sequences finished before the measured steps")
    with counter:
        for _ in range(args.steps):
            eng.step()
    sync = torch.cuda.synchronize if eng.model.device.type == "cuda" else (lambda: None)
    scored = advisor.score_seconds if advisor else 0.0
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    sync()
    wall = (time.perf_counter() - t0) / args.steps
    if len(eng.seqs) != n:
        raise RuntimeError(f"{n - len(eng.seqs)} of {n} sequences finished during the measured steps")
    planner = ((advisor.score_seconds if advisor else 0.0) - scored) / args.steps
    step = wall - planner
    launches = sum(counter.launches.values()) / args.steps
    return {"policy": policy, "sequences": n, "device": str(eng.model.device), "step_ms": round(step * 1e3, 3),
            "per_sequence_ms": round(step * 1e3 / n, 4), "planner_ms": round(planner * 1e3, 3),
            "launches": round(launches, 1), "launches_per_sequence": round(launches / n, 2),
            "reads": round(sum(counter.launches[k] for k in READS) / args.steps, 2),
            "views": round(counter.views / args.steps, 1),
            "top": {k: round(v / args.steps, 1) for k, v in counter.launches.most_common(12)}}


def run(args) -> int:
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    from services.compute.model.loader import resolve_device
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        print(f"kvpop bench step: {e}")
        return 2
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    counts = [int(x) for x in args.sequences.split(",") if x.strip()]
    if not policies or not counts or min(counts) < 1 or args.steps < 1:
        print("kvpop bench step: --policies non-empty, --sequences >= 1, --steps >= 1")
        return 2
    rows = []
    for policy, n in tqdm([(p, n) for p in policies for n in counts], desc="bench step", dynamic_ncols=True):
        rows.append(_measure(args, str(args.model), policy, n, device))
    print(f"\ndecode step, in process, device {rows[0]['device']}, block size {args.block_size}, "
          f"{args.steps} steps each\n")
    print("| policy | sequences | step ms | per sequence ms | planner ms (apart) | launches | per sequence | "
          "device reads |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['policy']} | {r['sequences']} | {r['step_ms']:.2f} | {r['per_sequence_ms']:.3f} | "
              f"{r['planner_ms']:.2f} | {r['launches']:.0f} | {r['launches_per_sequence']:.2f} | {r['reads']:.1f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"block_size": args.block_size, "steps": args.steps, "rows": rows},
                                        indent=1))
        print(f"wrote {args.json}")
    return 0
