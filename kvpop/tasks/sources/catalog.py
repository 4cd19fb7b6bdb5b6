"""Haystack text for the `real` suite (kvpop/tasks/ruler.py): where the filler
between the hidden facts comes from.

Every source is available without a model hub: the project's own generator,
text shipped inside the Python standard library, a registry package (the
`text` extra) or the operating system. A source is a list of units (sentences,
lines or turns) in a fixed order; an instance reads a contiguous run of them
from an offset its seed picks, so the same seed gives the same prompt.

TRAINING sources may feed the estimator's traces (kvpop/training/traces.py);
HELD_OUT sources never do: they are the yardstick for text no network here was
trained on, and every table says which it used.
"""
from __future__ import annotations

import random
from typing import Callable, Iterator

from kvpop.tasks.sources import code, dialogue, docstrings, generator, licenses, reference
from kvpop.tasks.sources.corpus import Corpus

# name -> the module that reads it: each has `units() -> list[str]` (or, for the
# generator, `sentence(rng)`) and SEP, the text between two units.
_MODULES = {"generator": generator, "docstrings": docstrings, "code": code, "dialogue": dialogue,
            "reference": reference, "licenses": licenses}
TRAINING = ("generator", "docstrings", "code", "dialogue")
HELD_OUT = ("reference", "licenses")
SOURCES = TRAINING + HELD_OUT
DEFAULT = "generator"


class SourceError(ValueError):
    """An unknown source, or one whose text is not on this machine."""


def check(name: str) -> str:
    if name not in _MODULES:
        raise SourceError(f"unknown text source {name!r}; choose from {', '.join(SOURCES)} "
                          f"(held out of training: {', '.join(HELD_OUT)})")
    return name


def label(name: str) -> str:
    """The source as tables name it: held-out sources say so."""
    return f"{name} (held out of training)" if name in HELD_OUT else f"{name} (a training source)"


def separator(name: str) -> str:
    return _MODULES[check(name)].SEP


def reader(name: str) -> Callable[[], list[str]]:
    """The function that reads a corpus source's units from where they are shipped."""
    if check(name) == "generator":
        raise SourceError("the generator writes its text: it has no corpus")
    return _MODULES[name].units


def corpus(name: str) -> Corpus:
    """A corpus source's units, read once per process."""
    read = reader(name)
    try:
        return Corpus.of(name, read)
    except (OSError, ImportError) as e:
        raise SourceError(f"text source {name!r} is not available here: {e}") from e


def stream(name: str, rng: random.Random) -> Callable[[], str]:
    """The next unit of filler, each call. The generator draws sentences from
    ``rng`` itself (its prompts are those it always gave); a corpus draws one
    offset from ``rng`` and reads on from there, wrapping at its end."""
    if check(name) == "generator":
        return lambda: generator.sentence(rng)
    units = corpus(name).units
    it: Iterator[str] = _cycle(units, rng.randrange(len(units)))
    return lambda: next(it)


def _cycle(units: list[str], start: int) -> Iterator[str]:
    i = start
    while True:
        yield units[i % len(units)]
        i += 1
