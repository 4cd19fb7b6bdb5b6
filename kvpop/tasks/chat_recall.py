"""Facts told early in a chat, asked for after other talk (the `chat` suite
of `kvpop eval`): the user gives three facts in the first three turns (a
pet's name, a number, a place, in a seeded order), then `gap` turns of
everyday talk (kvpop/tasks/small_talk.py), then asks for one of the facts.

The assistant's replies in the history are fixed text (a teacher-forced
history), so every policy reads the same conversation and only the final
answer is generated. Families are the fact asked for; an instance's `length`
is its gap in turns. An answer is correct when it contains the fact (chat
models phrase answers their own way). Instances are TextInstances: the
conversation's messages, its tokens with the model's chat template."""
from __future__ import annotations

import random
from pathlib import Path

from kvpop.tasks.ruler import TextInstance
from kvpop.tasks.small_talk import EXCHANGES

FAMILIES = ("pet", "number", "place")
GAPS = (5, 20)

_PETS = ["Biscuit", "Pepper", "Waffles", "Juniper", "Noodle", "Maple", "Pickles", "Clementine", "Bramble",
         "Tofu", "Marzipan", "Ziggy", "Hazel", "Rocket", "Sprout", "Dumpling", "Toffee", "Basil"]
_PLACES = ["Lisbon", "Krakow", "Valparaiso", "Halifax", "Nagasaki", "Tromso", "Cork", "Asheville", "Ljubljana",
           "Bergen", "Hobart", "Cusco", "Tallinn", "Galway", "Porto", "Oaxaca", "Dunedin", "Bruges"]
SYSTEM = "You are a helpful assistant. Remember what the user tells you about themselves."
_ACKS = ["Got it, thanks for telling me!", "Noted! I'll keep that in mind.", "Thanks for sharing that with me.",
         "Good to know. I'll remember that.", "Lovely, thanks for letting me know!"]


def _fact(family: str, rng: random.Random) -> tuple[str, str, str, str]:
    """(what the user says, the question, the value, a reference answer)."""
    if family == "pet":
        v, kind = rng.choice(_PETS), rng.choice(["dog", "cat"])
        return (rng.choice([f"My {kind} is called {v}.", f"By the way, my {kind}'s name is {v}."]),
                f"What is my {kind} called?", v, f"Your {kind} is called {v}.")
    if family == "number":
        v, thing = str(rng.randint(1000, 9999)), rng.choice(["gym locker", "apartment door code"])
        return (rng.choice([f"My {thing} number is {v}.", f"Just so you know, my {thing} number is {v}."]),
                f"What is my {thing} number?", v, f"Your {thing} number is {v}.")
    if family == "place":
        v = rng.choice(_PLACES)
        return (rng.choice([f"I grew up in {v}.", f"Something about me: I grew up in {v}."]),
                "In which city did I grow up?", v, f"You grew up in {v}.")
    raise ValueError(f"unknown chat family {family!r}; choose from {', '.join(FAMILIES)}")


def conversation(family: str, seed: int, gap: int) -> tuple[list[dict], str, str]:
    """(messages ending with the question, the value asked for, a reference answer)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown chat family {family!r}; choose from {', '.join(FAMILIES)}")
    if not 0 <= gap <= len(EXCHANGES):
        raise ValueError(f"a gap of {gap} turns: the chat suite has {len(EXCHANGES)} different exchanges")
    # The facts, their order and the talk follow from (family, seed) alone: a shorter gap's
    # talk is the start of a longer one's, so gaps compare on the same conversations.
    rng = random.Random(f"chat:{family}:{seed}")
    facts = {f: _fact(f, rng) for f in FAMILIES}
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    for f in rng.sample(FAMILIES, len(FAMILIES)):
        messages += [{"role": "user", "content": facts[f][0]}, {"role": "assistant", "content": rng.choice(_ACKS)}]
    for user, reply in rng.sample(EXCHANGES, len(EXCHANGES))[:gap]:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    _, question, value, solution = facts[family]
    messages.append({"role": "user", "content": f"Earlier I told you something. {question} Answer briefly."})
    return messages, value, solution


def generate(family: str, seed: int, gap: int, tokenizer) -> TextInstance:
    messages, value, solution = conversation(family, seed, gap)
    sol = tokenizer.encode(solution, add_bos=False) + [min(tokenizer.eos_token_ids)]
    return TextInstance(family, seed, messages, [value], solution, prompt_ids=tokenizer.encode_chat(messages),
                        solution_ids=sol, decoder=tokenizer, length=gap)


def test_set(tokenizer, n: int, gaps: list[int], families: list[str] | None = None,
             seed: int = 0) -> list[TextInstance]:
    """n instances per (family, gap); their seeds follow from the test-set seed."""
    return [generate(fam, seed * 100_000 + i, gap, tokenizer)
            for gap in gaps for fam in (families or FAMILIES) for i in range(n)]


def model_test_set(model_dir, n: int, gaps: list[int], families: list[str] | None = None,
                   seed: int = 0) -> list[TextInstance]:
    from services.compute.model.tokenizer import Tokenizer
    return test_set(Tokenizer(Path(model_dir)), n, gaps, families, seed)
