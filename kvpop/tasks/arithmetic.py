"""Multi-step arithmetic with written steps: labelled digits `x3 7` scattered
through filler; `? sum` asks for their running sum mod 10, which the model
writes step by step (`x1 4 = 4 ; x2 7 = 1 ; ... x4 ans 1 .`). The pair
`x4 ans` in the prompt marks the end, so stopping is a look-up too. Each step copies
one operand (one look-up by its label) and adds it to the previous step's
result, so old steps become dead weight as the solution grows (decode-heavy,
as in math reasoning)."""
from __future__ import annotations

import random

from kvpop.tasks.instance import Builder, Instance, spread
from kvpop.tasks.vocab import LABELS


def generate(seed: int, length: int = 512, n_operands: int | None = None) -> Instance:
    rng = random.Random(f"arithmetic:{seed}")
    k = n_operands or max(3, min(len(LABELS) - 1, length // 112))
    digits = [rng.randrange(10) for _ in range(k)]
    filler = max(0, length - 1 - 1 - 2 * (k + 1) - 2)
    order = rng.sample(range(k + 1), k + 1)  # operands (and the end mark) appear shuffled
    b = Builder(rng)
    b.add("sum")
    chunks = spread(rng, filler, k + 2)
    for i, n in zip(order, chunks):
        b.filler(n)
        b.add(LABELS[i], str(digits[i]) if i < k else "ans", mark=True)
    b.filler(chunks[-1])
    b.add("?", "sum")
    steps, acc = [], 0
    for i, d in enumerate(digits):
        acc = (acc + d) % 10
        steps.append(f"{LABELS[i]} {d} = {acc} ;")
    solution = " ".join(steps) + f" {LABELS[k]} ans {acc} ."
    return Instance("arithmetic", seed, b.text(), solution, str(acc), b.depends)
