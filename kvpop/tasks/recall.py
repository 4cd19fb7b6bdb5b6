"""Associative recall with the queries first: `recall K012 K007 .` lists the
keys asked for, then many `K033 88` pairs in filler, then `? recall` and the
model writes `K012 17 K007 9 .`. Writing the next key is a copy from the query
list, writing its value a copy from the pairs: one attention step each."""
from __future__ import annotations

import random

from kvpop.tasks.instance import Builder, Instance, spread
from kvpop.tasks.vocab import KEYS, NUMBERS


def generate(seed: int, length: int = 512, n_queries: int | None = None) -> Instance:
    rng = random.Random(f"recall:{seed}")
    nq = n_queries or max(2, min(4, length // 256))
    header = nq + 2
    n_pairs = max(nq, min(len(KEYS), (length - header - 3) * 2 // 3 // 2))
    filler = max(0, length - header - 3 - 2 * n_pairs - 1)
    keys = rng.sample(KEYS, n_pairs)
    value = {k: rng.choice(NUMBERS) for k in keys}
    asked = rng.sample(keys, nq)
    b = Builder(rng)
    b.add("recall")
    for k in asked:
        b.add(k, mark=True)
    b.add(".")
    chunks = spread(rng, filler, n_pairs)
    for k, n in zip(keys, chunks):
        b.filler(n)
        b.add(k, value[k], mark=k in asked)
    b.add("?", "recall")
    answer = " ".join(f"{k} {value[k]}" for k in asked)
    return Instance("recall", seed, b.text(), f"{answer} .", answer, b.depends)
