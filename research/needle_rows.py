"""Where a real-text needle is lost under `learned`: plan by plan, how many
(layer, kv-head) rows still hold every token of the expected value, and at the
end, per row, how many of those tokens it holds next to how much the dense
model's answer reads them there (docs/design/estimator.md, "Tried and not shipped": spans).

    .venv/bin/python research/needle_rows.py --seed 1 --index 0 --length 8192 --compression 0.875

The request runs through the eval's in-process engine and the cache-manager's
own planner (LocalAdvisor); the script only reads the scores each plan uses.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpop.evaluation.harness import Harness, Setting  # noqa: E402
from kvpop.evaluation.local_advisor import LocalAdvisor  # noqa: E402
from kvpop.evaluation.oracle import answer_attention  # noqa: E402
from kvpop.models.fetch import model_arg  # noqa: E402
from kvpop.tasks import ruler  # noqa: E402
from services.compute.engine.engine import EngineConfig, LLMEngine  # noqa: E402


def value_positions(inst) -> list[int]:
    """Prompt positions of the first expected value's tokens (its first occurrence)."""
    ids, want = inst.prompt_ids, inst.decoder.encode(inst.answers[0], add_bos=False)
    for s in range(len(ids) - len(want) + 1):
        if ids[s:s + len(want)] == want:
            return list(range(s, s + len(want)))
    raise SystemExit(f"the value {inst.answers[0]} is not tokenized alone in the prompt")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", type=model_arg)
    p.add_argument("--family", default="needle", choices=ruler.FAMILIES)
    p.add_argument("--seed", type=int, default=1, help="test-set seed (as kvpop eval --seed)")
    p.add_argument("--index", type=int, default=0, help="which of the seed's prompts (0 or 1 with --n 2)")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--compression", type=float, default=0.875)
    p.add_argument("--policy", default="learned", help="a policy label as kvpop eval takes it")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    inst = ruler.model_test_set(model_dir, args.index + 1, [args.length], [args.family], seed=args.seed)[args.index]
    pos = value_positions(inst)
    print(f"{len(inst.prompt_ids)} prompt tokens; value {inst.answers[0]} at positions {pos[0]}-{pos[-1]}")

    advisor, plans = LocalAdvisor(str(model_dir)), []
    for scorer in advisor.planner.scorers:
        def read(seq, score=scorer.score):
            s = score(seq)
            a = seq.arrays()
            mine = np.isin(a["position"], pos)
            if mine.sum() == len(pos):
                held = ~a["gone"] if "gone" in a else np.ones(s.shape, bool)
                plans.append((int(a["position"].max()) + 1, held[mine].all(axis=0), held[mine].sum(axis=0)))
            return s
        scorer.score = read
    longest = len(inst.prompt_ids) + len(inst.solution_ids) + 64
    engine = LLMEngine(EngineConfig(str(model_dir), block_size=1, max_num_seqs=1, max_model_len=max(4096, longest),
                                    cleanup_threshold=float("inf")), advisor=advisor)
    out = Harness(engine).run([Setting(args.policy, args.compression)], [inst], desc=args.policy, forcing=False)[0]
    print(f"{args.policy} at {args.compression:.2%}: {'right' if out.correct else 'wrong'}: {out.text!r}")
    if not plans:
        print("no plan ranked the value's tokens (a policy the network does not rank, or no eviction)")
        return 0
    print("\ntokens known | rows holding the whole value")
    for known, whole, _ in plans:
        print(f"{known:12,} | {int(whole.sum()):3d} of {whole.size}")

    read = answer_attention(engine.model, inst.prompt_ids + inst.solution_ids, len(inst.prompt_ids))[:, :, pos]
    held = plans[-1][2]
    rows = sorted(((float(read[l, h].max()), l, h) for l in range(read.shape[0]) for h in range(read.shape[1])),
                  reverse=True)
    print(f"\nthe rows the dense answer reads the value from most (peak attention on it; tokens of {len(pos)} held at "
          "the last plan)")
    for peak, l, h in rows[:10]:
        print(f"layer {l:2d} kv-head {h}: {peak:.3f}, holds {int(held[l, h])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
