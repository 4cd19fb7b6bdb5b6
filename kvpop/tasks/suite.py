"""The task mix: family registry, train/test seed ranges and the standard test set."""
from __future__ import annotations

import random

from kvpop.tasks import arithmetic, passkey, recall, registers
from kvpop.tasks.instance import Instance

FAMILIES = {
    "registers": registers.generate,
    "arithmetic": arithmetic.generate,
    "recall": recall.generate,
    "passkey": passkey.generate,
}
# Disjoint seed ranges: training never sees a test instance.
TRAIN_SEEDS = range(0, 1_000_000_000)
TEST_SEEDS = range(1_000_000_000, 1_000_100_000)
# Standard test lengths (prompt tokens): median ~860, tail past 1,024.
TEST_MIN_LEN, TEST_MAX_LEN = 448, 1280


def generate(family: str, seed: int, length: int = 512, **kw) -> Instance:
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; choose from {', '.join(FAMILIES)}")
    return FAMILIES[family](seed, length, **kw)


def test_set(n: int, families: list[str] | None = None, seed: int = 0,
             min_len: int = TEST_MIN_LEN, max_len: int = TEST_MAX_LEN) -> list[Instance]:
    """n instances per family, seeds from the test range, lengths spread
    uniformly over [min_len, max_len]."""
    fams = families or list(FAMILIES)
    out = []
    for fam in fams:
        rng = random.Random(f"test:{fam}:{seed}")
        for i in range(n):
            s = TEST_SEEDS.start + seed * 1000 + i
            if s not in TEST_SEEDS:
                most = (TEST_SEEDS.stop - TEST_SEEDS.start - n) // 1000
                raise ValueError(f"test-set seed {seed} with {n} per family leaves the test range: "
                                 f"use a seed from 0 to {most}")
            out.append(generate(fam, s, rng.randint(min_len, max_len)))
    return out
