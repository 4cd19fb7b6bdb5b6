"""Register tracking: a long stream of writes `c = 41 ;` over a few registers;
each register's last write is the commit `c := 41 ;`. The question `? c :=`
asks for the committed value, so only that one line matters and every
superseded write is dead weight. The `:=` marker makes the look-up one
attention step (match register + marker, copy the value): finding the latest
of several identical `c =` writes by recency alone did not train in the CPU
budget (see docs/guides/default-model.md)."""
from __future__ import annotations

import random

from kvpop.tasks.instance import Builder, Instance, spread
from kvpop.tasks.vocab import NUMBERS, REGISTERS


def generate(seed: int, length: int = 512, n_queries: int = 1, n_registers: int = 8) -> Instance:
    rng = random.Random(f"registers:{seed}")
    regs = rng.sample(REGISTERS, n_registers)
    tail = 4 * n_queries
    slots = max(n_registers, (length - 2 - tail) * 2 // 3 // 4)  # writes fill ~2/3, filler the rest
    filler = max(0, length - 2 - tail - 4 * slots)
    # Each register commits at a random slot, so the commit is anywhere in the stream.
    commit_slot = dict(zip(regs, rng.sample(range(slots), n_registers)))
    value = {r: rng.choice(NUMBERS) for r in regs}
    b = Builder(rng)
    b.add("regs")
    chunks = spread(rng, filler, slots)
    # Ask only registers that commit in the first 3/4 of the stream, so recency cannot answer.
    early = sorted(regs, key=commit_slot.get)[: max(n_queries, n_registers * 3 // 4)]
    queried = rng.sample(early, n_queries)
    for s in range(slots):
        b.filler(chunks[s])
        committing = [r for r in regs if commit_slot[r] == s]
        if committing:
            r = committing[0]
            value[r] = rng.choice(NUMBERS)
            b.add(r, ":=", value[r], ";", mark=r in queried)
            continue
        live = [r for r in regs if commit_slot[r] > s]
        if not live:
            b.filler(4)
            continue
        r = rng.choice(live)
        value[r] = rng.choice(NUMBERS)
        b.add(r, "=", value[r], ";")
    # Earlier questions are answered in the prompt (more supervision per sequence); the last is the task.
    for r in queried[:-1]:
        b.add("?", r, ":=", value[r], ";")
    last = queried[-1]
    b.add("?", last, ":=")
    return Instance("registers", seed, b.text(), f"{value[last]} .", value[last], b.depends)
