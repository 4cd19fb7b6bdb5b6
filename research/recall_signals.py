"""Which signals in the served model's own attention point at the values a
`recall` question asks for, while the prompt is still streaming in (the
budget is held during prefill, and the question comes first)?

For each asked value token, its rank among every later prompt token under:
- bank: max q.k (before RoPE) of the first W tokens' queries against the
  token's key, per kv-head: "what the prompt's opening looks for";
- reach: the peak attention weight the token's own query pays to any single
  token outside an 8-token recent window, per query head: "this token just
  retrieved something from far back".

Reach, as compute measures it, is the estimator's `reach` input; the bank is not
an input (docs/design/estimator.md, "Network").

    .venv/bin/python research/recall_signals.py [--n 12] [--seed 5]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvpop.tasks.suite import test_set  # noqa: E402
from services.compute.model.loader import load_model  # noqa: E402

RECENT = 8


def ranks(score: torch.Tensor, first: int, targets: list[int]) -> list[int]:
    cand = torch.arange(first, score.shape[0])
    order = torch.argsort(score[cand], descending=True).tolist()
    at = {int(cand[o]): r for r, o in enumerate(order)}
    return [at[t] for t in targets if t in at]


def forward_with_probs(lm, ids: list[int], keep) -> None:
    """Run the prompt once, calling keep(layer, q, k, probs [Hq, T, T]) with each
    layer's (rotated) queries, keys and exact attention weights."""
    T = len(ids)

    def attention(layer, q, k, v):
        G = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        logits = torch.einsum("thd,shd->hts", q.float(), kk.float()) / q.shape[-1] ** 0.5
        logits.masked_fill_(torch.ones(T, T, dtype=torch.bool).triu(1)[None], float("-inf"))
        keep(layer, q, k, torch.softmax(logits, -1))
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), is_causal=True).transpose(0, 1)

    lm(torch.tensor(ids), torch.arange(T), attention)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/default")
    p.add_argument("--n", type=int, default=12, help="recall prompts")
    p.add_argument("--seed", type=int, default=5, help="test-set seed")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    lm = load_model(args.model, dtype="float32", device="cpu")
    found: dict[tuple, list[int]] = {}
    for inst in test_set(args.n, ["recall"], seed=args.seed):
        ids = inst.prompt_ids
        T = len(ids)
        cap = {}
        cos, sin = lm.rotary.tables(torch.device("cpu"), torch.float32)
        cos, sin = cos[:T, None, :], sin[:T, None, :]
        unrotate = lambda x: x.float() * cos - x.float().roll(x.shape[-1] // 2, dims=-1) * sin  # noqa: E731
        forward_with_probs(lm, ids, lambda layer, q, k, probs: cap.__setitem__(layer, (unrotate(q), unrotate(k), probs)))
        words = ["<s>"] + inst.prompt.split()
        header_end = words.index(".")
        asked = set(words[2:header_end])
        values = [i + 1 for i in range(header_end + 1, T - 1) if words[i] in asked]
        for layer, (q, k, probs) in cap.items():
            G = q.shape[1] // k.shape[1]
            for W in (8, 32):
                for h in range(k.shape[1]):
                    bank = (q[:W, h * G:(h + 1) * G].reshape(-1, q.shape[-1]) @ k[:, h].T).amax(0)
                    found.setdefault(("bank", W, layer, f"kv-head {h}"), []).extend(ranks(bank, W, values))
            far = probs.clone()
            for i in range(T):
                far[:, i, max(0, i - RECENT):i + 1] = 0
            reach = far.amax(-1)                                          # [Hq, T]
            for h in range(reach.shape[0]):
                found.setdefault(("reach", 0, layer, f"q-head {h}"), []).extend(ranks(reach[h], 12, values))
            found.setdefault(("reach", 0, layer, "max"), []).extend(ranks(reach.amax(0), 12, values))
    print("signal | bank W | layer | head | median rank | in top 8 | in top 32 | asked values")
    for (sig, W, layer, head), r in sorted(found.items()):
        r = np.asarray(r)
        print(f"{sig} | {W or '-'} | {layer} | {head} | {int(np.median(r))} | {(r < 8).mean():.2f} | "
              f"{(r < 32).mean():.2f} | {len(r)}")


if __name__ == "__main__":
    main()
