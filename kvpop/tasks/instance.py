"""One generated task instance and the word-list builder the generators share."""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

from kvpop.tasks.vocab import BOS_ID, EOS_ID, FILLER, encode_words


@dataclass
class Instance:
    family: str
    seed: int
    prompt: str          # words separated by single spaces (no <s>)
    solution: str        # the written steps and the answer, ending with "."
    answer: str          # the final answer the checker compares
    depends: list[int] = field(default_factory=list)  # indices into prompt_ids the answer needs

    @property
    def prompt_ids(self) -> list[int]:
        return [BOS_ID] + encode_words(self.prompt.split())

    @property
    def solution_ids(self) -> list[int]:
        return encode_words(self.solution.split()) + [EOS_ID]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["prompt_tokens"] = len(self.prompt_ids)
        d["solution_tokens"] = len(self.solution_ids)
        return d


class Builder:
    """Accumulates prompt words; `mark` records the prompt_ids index of the words
    just added (index 0 is <s>, so word i sits at token i + 1)."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.words: list[str] = []
        self.depends: list[int] = []

    def add(self, *words: str, mark: bool = False) -> None:
        """mark: the answer needs these words, and the one after them: the trained
        model reads a key/value pair from the position that follows it (a
        pair's successor carries it two tokens back), so an oracle without it
        fails (measured in docs/results/eviction-quality.md)."""
        start = len(self.words) + 1
        self.words.extend(words)
        if mark:
            self.depends.extend(i for i in range(start, start + len(words) + 1) if i not in self.depends)

    def filler(self, n: int) -> None:
        self.words.extend(self.rng.choice(FILLER) for _ in range(max(0, n)))

    def __len__(self) -> int:
        return len(self.words) + 1

    def text(self) -> str:
        return " ".join(self.words)


def spread(rng: random.Random, total: int, parts: int) -> list[int]:
    """Split `total` filler words into `parts` random non-negative chunks."""
    if parts <= 0:
        return []
    cuts = sorted(rng.randint(0, max(0, total)) for _ in range(parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [max(0, total)])]
