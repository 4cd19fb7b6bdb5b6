"""A text source read once per process: its units, in their fixed order."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, ClassVar

# A sentence ends at . ! or ? followed by space and a capital, digit or quote:
# abbreviations such as "e.g. the" stay whole.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")
MIN_CHARS = 20        # shorter fragments (headings, list markers) are dropped
MAX_CHARS = 600       # longer ones are cut at a space: a unit stays a small step of prompt length


@dataclass
class Corpus:
    name: str
    units: list[str]
    _cache: ClassVar[dict[str, "Corpus"]] = {}

    @classmethod
    def of(cls, name: str, read: Callable[[], list[str]]) -> "Corpus":
        if name not in cls._cache:
            units = read()
            if len(units) < 100:
                raise OSError(f"only {len(units)} units of text found")
            cls._cache[name] = cls(name, units)
        return cls._cache[name]


def sentences(text: str) -> list[str]:
    """Prose split into sentences, whitespace made single spaces."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        flat = " ".join(para.split())
        for s in _SENTENCE_END.split(flat):
            out.extend(bounded(s))
    return out


def bounded(s: str) -> list[str]:
    s = s.strip()
    if len(s) < MIN_CHARS:
        return []
    pieces = []
    while len(s) > MAX_CHARS:
        cut = s.rfind(" ", 0, MAX_CHARS)
        cut = cut if cut > MIN_CHARS else MAX_CHARS
        pieces.append(s[:cut])
        s = s[cut:].strip()
    return pieces + ([s] if len(s) >= MIN_CHARS else [])
