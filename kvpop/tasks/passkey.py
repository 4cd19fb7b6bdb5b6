"""Passkey: three numbers after `key` hidden at a random depth in filler,
asked for at the end with `? key`."""
from __future__ import annotations

import random

from kvpop.tasks.instance import Builder, Instance
from kvpop.tasks.vocab import NUMBERS


def generate(seed: int, length: int = 512, n_numbers: int = 3) -> Instance:
    rng = random.Random(f"passkey:{seed}")
    key = [rng.choice(NUMBERS) for _ in range(n_numbers)]
    body = max(0, length - 1 - 2 - (n_numbers + 2) - 2)
    before = rng.randint(0, body)
    b = Builder(rng)
    b.add("pass")
    b.filler(before)
    b.add("key", *key, mark=True)
    b.add(".")
    b.filler(body - before)
    b.add("?", "key")
    answer = " ".join(key)
    return Instance("passkey", seed, b.text(), f"{answer} .", answer, b.depends)
