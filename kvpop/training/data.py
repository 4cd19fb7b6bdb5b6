"""Training batches from the task generators: one length per batch (little
padding), every family in every batch, loss mask on the tokens the model must
produce (the solution, plus answers already written into the prompt)."""
from __future__ import annotations

import random

import torch

from kvpop.tasks.suite import TRAIN_SEEDS, generate
from kvpop.tasks.instance import Instance
from kvpop.tasks.vocab import BOS_ID, EOS_ID, KEYS, LABELS, NUMBERS, PAD_ID, VOCAB, encode_words

# Training-only auxiliary family: a random token string, then the same string
# again. Every token of the repeat is a look-up, so the induction heads every
# task relies on get a dense gradient from the first steps.
COPY = "copy"
_COPY_POOL = NUMBERS + KEYS + LABELS

ASK, COMMIT = VOCAB["?"], VOCAB[":="]


def train_instance(family: str, seed: int, length: int, rng: random.Random) -> Instance:
    if seed not in TRAIN_SEEDS:
        raise ValueError(f"seed {seed} is outside the training range")
    if family == "registers":
        return generate(family, seed, length, n_queries=rng.randint(1, 4))
    if family == "recall":
        return generate(family, seed, length, n_queries=rng.randint(2, 6))
    return generate(family, seed, length)


def copy_sequence(length: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """-> (prompt ids, solution ids) of about `length` tokens."""
    n = max(4, min(len(_COPY_POOL), (length - 4) // 2))
    seg = rng.sample(_COPY_POOL, n)
    prompt = [BOS_ID] + encode_words(seg + [";"])
    return prompt, encode_words(seg + ["."]) + [EOS_ID]


def answered_in_prompt(ids: list[int]) -> list[int]:
    """Positions of answers already written in the prompt (`? c := 41`): also supervised."""
    return [i + 3 for i in range(len(ids) - 3) if ids[i] == ASK and ids[i + 2] == COMMIT and i + 3 < len(ids)]


def make_batch(families: list[str], length: int, batch_size: int, rng: random.Random):
    """-> input_ids [B, S], target ids [B, S] (-100 = no loss), families, solution spans."""
    rows, fams = [], []
    for b in range(batch_size):
        fam = families[b % len(families)]
        if fam == COPY:
            p, s = copy_sequence(length, rng)
        else:
            inst = train_instance(fam, rng.randrange(TRAIN_SEEDS.stop), length, rng)
            p, s = inst.prompt_ids, inst.solution_ids
        ids = p + s
        tgt = [-100] * len(ids)
        for i in range(len(p) - 1, len(ids) - 1):  # logits at i predict ids[i + 1]
            tgt[i] = ids[i + 1]
        for j in answered_in_prompt(p):
            tgt[j - 1] = p[j]
        rows.append((ids, tgt, len(p) - 1))
        fams.append(fam)
    S = max(len(r[0]) for r in rows)
    x = torch.full((batch_size, S), PAD_ID, dtype=torch.long)
    y = torch.full((batch_size, S), -100, dtype=torch.long)
    sol = torch.zeros((batch_size, S), dtype=torch.bool)
    for b, (ids, tgt, start) in enumerate(rows):
        x[b, : len(ids)] = torch.tensor(ids)
        y[b, : len(tgt)] = torch.tensor(tgt)
        sol[b, start: len(ids) - 1] = True
    return x, y, sol, fams
