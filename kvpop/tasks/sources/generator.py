"""The project's own filler: short invented sentences drawn at random (the
text the `real` suite always used, and the SmolLM2 networks' first traces)."""
from __future__ import annotations

import random

SEP = " "

_SUBJECTS = ["The river", "A small village", "The old library", "Our neighbour", "The morning train", "A gardener",
             "The committee", "The lighthouse keeper", "A young painter", "The market", "The museum guide",
             "A fisherman", "The weather", "The city council", "A traveller", "The baker", "The school choir"]
_VERBS = ["watched", "described", "remembered", "repaired", "visited", "painted", "measured", "announced",
          "carried", "collected", "followed", "discussed", "welcomed", "explored", "ignored", "counted"]
_OBJECTS = ["the quiet harbour", "a basket of apples", "the northern hills", "an unfinished letter",
            "the spring festival", "a narrow bridge", "the evening news", "a field of barley", "the stone wall",
            "a wooden boat", "the clock tower", "a box of old maps", "the winter road", "a row of lanterns"]
_TAILS = ["before the rain began", "after a long week", "with great care", "without saying a word",
          "as the sun went down", "for the third time", "while the bells rang", "near the end of summer",
          "in the early afternoon", "despite the wind", "at the request of a friend", "on a quiet Sunday"]


def sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
