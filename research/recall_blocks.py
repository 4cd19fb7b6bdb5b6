"""How far can one signal carry `recall` at block size 16 (`kvpop up`'s default)?

The question's keys come first, so a policy could keep the pairs' blocks the
question will ask for. Here the signal is reach, as compute measures it: a
query's peak block mass (mean over its kv-head's query heads) on one block
wholly outside its 8-token recent window, and a block's reach is the peak
over its own queries. The script prints, per row, how well reach separates the
blocks holding an asked pair from the other blocks after the header (AUC).
It then counts the prompts whose asked blocks all rank inside the blocks a
budget leaves free after the sink's and the recent window's, when the rows'
two layer-1 heads vote by their maximum. The full prompt is scored at once,
so the count is an upper bound for a budget held during prefill.

    .venv/bin/python research/recall_blocks.py [--seeds 0,11,23,45,77,89] [--n 16]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpop.tasks.suite import test_set  # noqa: E402
from recall_signals import forward_with_probs  # noqa: E402 - beside this script
from services.compute.model.loader import load_model  # noqa: E402

RECENT = 8


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(a positive outranks a negative), ties counted half (Mann-Whitney)."""
    allv = np.concatenate([pos, neg])
    order = allv.argsort(kind="mergesort")
    r = np.empty(len(allv))
    r[order] = np.arange(1, len(allv) + 1)
    for v in np.unique(allv):            # average ranks of ties
        m = allv == v
        r[m] = r[m].mean()
    return (r[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/default")
    p.add_argument("--seeds", default="0,11,23,45,77,89", help="test-set seeds (the six of the eval tables)")
    p.add_argument("--n", type=int, default=16, help="recall prompts per seed")
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args()
    torch.set_grad_enabled(False)
    lm = load_model(args.model, dtype="float32", device="cpu")
    bs = args.block_size
    per_row: dict[tuple[int, int], tuple[list, list]] = {}
    prompts = []                                   # (score per block after the header, asked mask, T)
    for seed in (int(s) for s in args.seeds.split(",")):
        for inst in test_set(args.n, ["recall"], seed=seed):
            ids = inst.prompt_ids
            T = len(ids)
            mass = {}
            nb = -(-T // bs)

            def keep(layer, q, k, probs):
                probs = probs.view(k.shape[1], -1, T, T).mean(1)                             # [Hkv, T, T]
                mass[layer] = torch.nn.functional.pad(probs, (0, nb * bs - T)).view(k.shape[1], T, nb, bs).sum(-1)

            forward_with_probs(lm, ids, keep)
            words = ["<s>"] + inst.prompt.split()
            header_end = words.index(".")
            asked_keys = set(words[2:header_end])
            asked_at = [i for i in range(header_end + 1, T) if words[i] in asked_keys]   # the pair's key token
            first = header_end // bs + 1                       # blocks wholly after the header
            y = np.zeros(nb, bool)
            y[[i // bs for i in asked_at]] = True
            last_token = (torch.arange(nb) + 1) * bs - 1
            far = last_token[None, :] < (torch.arange(T) - RECENT)[:, None]              # [T, nb]
            votes = []
            for layer, m in mass.items():
                reach_q = torch.where(far[None], m, torch.zeros(())).amax(-1)            # [Hkv, T]
                reach = torch.nn.functional.pad(reach_q, (0, nb * bs - T)).view(-1, nb, bs).amax(-1)
                for h in range(reach.shape[0]):
                    r = reach[h, first:].numpy()
                    per_row.setdefault((layer, h), ([], []))[0].append(r[y[first:]])
                    per_row[(layer, h)][1].append(r[~y[first:]])
                if layer == 1:
                    votes = reach[:, first:].amax(0).numpy()
            prompts.append((votes, y[first:], T))
    print(f"{len(prompts)} recall prompts, block size {bs}; reach of the blocks holding an asked pair "
          f"against the other blocks after the header:")
    print("layer | kv-head | AUC")
    for (layer, h), (pos, neg) in sorted(per_row.items()):
        print(f"{layer} | {h} | {auc(np.concatenate(pos), np.concatenate(neg)):.3f}")
    print("\ncompression | free blocks (median) | prompts whose asked blocks all rank inside them (layer-1 reach)")
    for c in (0.5, 0.75, 0.875, 0.9375):
        ok, free_all = 0, []
        for votes, y, T in prompts:
            free = max(0, int(round((1 - c) * T)) // bs - 2)  # less the sink's block and the recent window's
            free_all.append(free)
            top = set(np.argsort(-votes, kind="stable")[:free].tolist())
            ok += all(i in top for i in np.nonzero(y)[0])
        print(f"{c:.2%} | {int(np.median(free_all))} | {ok}/{len(prompts)} = {ok / len(prompts):.2f}")


if __name__ == "__main__":
    main()
