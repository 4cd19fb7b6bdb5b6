"""Long-context retrieval on real text for a real chat model (the `real` suite
of `kvpop eval`), in the manner of RULER: facts hidden at random depths in
filler text, then a question at the end. The filler comes from a text source
(kvpop/tasks/sources/): the project's own generator by default, or real text
(documentation, code, dialogue; two sources held out of training).

Families:
- `needle`: one "special magic number" for a key; ask for it.
- `multikey`: four keys with a number each; ask for one of them.
- `multivalue`: one key given three numbers at three depths; ask for all.
- `vartrack`: a value assigned to a variable, then copied along a chain of
  variables with filler in between; ask which variables hold the value.

A prompt is one user message rendered with the model's chat template. An
answer is correct when every expected value appears in the generated text
(containment, as RULER scores): chat models phrase answers their own way.
Lengths are counted in the model's tokens (the chat-rendered prompt), within
2% of the target.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from kvpop.tasks.sources import catalog as sources

FAMILIES = ("needle", "multikey", "multivalue", "vartrack")
ANSWER_ROOM = 64   # a prompt leaves this much of the model's context for the answer

_KEYS = ["amber-falcon", "silent-orchard", "copper-lantern", "northern-meadow", "velvet-harbor", "crimson-anchor",
         "hollow-pine", "golden-ferry", "misty-quarry", "rapid-heron", "frozen-canyon", "pale-violet"]


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


@dataclass
class TextInstance:
    family: str
    seed: int
    messages: list[dict]
    answers: list[str]              # every one must appear in the generated text
    solution: str                   # a reference answer (teacher forcing: KL to dense)
    prompt_ids: list[int] = field(default_factory=list)
    solution_ids: list[int] = field(default_factory=list)
    depends: list[int] = field(default_factory=list)   # no dependency oracle on real text
    decoder: object = field(default=None, repr=False)
    length: int = 0                 # the length asked for (reports break results down by it)
    source: str = sources.DEFAULT   # where the filler text came from

    @property
    def prompt(self) -> str:
        return self.messages[-1]["content"]

    def decode(self, ids: list[int]) -> str:
        return self.decoder.decode(ids)

    def check(self, text: str) -> bool:
        return all(a in text for a in self.answers)

    def to_dict(self) -> dict:
        return {"family": self.family, "seed": self.seed, "source": self.source, "answers": self.answers,
                "prompt_tokens": len(self.prompt_ids), "solution_tokens": len(self.solution_ids)}


def _facts(family: str, rng: random.Random) -> tuple[list[str], str, list[str], str]:
    """(fact sentences in order, question, expected values, reference answer)."""
    keys = rng.sample(_KEYS, 4)
    if family == "needle":
        v = _number(rng)
        return ([f"The special magic number for {keys[0]} is: {v}."],
                f"What is the special magic number for {keys[0]} mentioned in the text?", [v],
                f"The special magic number for {keys[0]} is {v}.")
    if family == "multikey":
        vals = [_number(rng) for _ in keys]
        ask = rng.randrange(4)
        facts = [f"The special magic number for {k} is: {v}." for k, v in zip(keys, vals)]
        return (facts, f"What is the special magic number for {keys[ask]} mentioned in the text?", [vals[ask]],
                f"The special magic number for {keys[ask]} is {vals[ask]}.")
    if family == "multivalue":
        vals = [_number(rng) for _ in range(3)]
        facts = [f"One of the special magic numbers for {keys[0]} is: {v}." for v in vals]
        return (facts, f"What are all the special magic numbers for {keys[0]} mentioned in the text?", vals,
                f"The special magic numbers for {keys[0]} are {', '.join(vals)}.")
    if family == "vartrack":
        v = str(rng.randint(10_000, 99_999))
        names = [f"VAR {c}{rng.randint(10, 99)}" for c in rng.sample("ABCDEFGHJKLMNPQRSTUVWXYZ", 4)]
        facts = [f"{names[0]} = {v}."] + [f"{b} = {a}." for a, b in zip(names, names[1:])]
        return (facts, f"Which variables are assigned the value {v}, directly or through other variables? "
                       "List their names.", [n.split()[1] for n in names],
                "The variables are " + ", ".join(names) + ".")
    raise ValueError(f"unknown real-text family {family!r}; choose from {', '.join(FAMILIES)}")


QUESTION_AT = ("end", "first")


def generate(family: str, seed: int, length: int, tokenizer, limit: int | None = None,
             question_at: str = "end", source: str = sources.DEFAULT) -> TextInstance:
    """One instance whose chat-rendered prompt is `length` tokens (+-2%), and
    never more than ``limit`` (the model's context less room for the answer).
    ``question_at="first"`` asks the question before the text (the same facts,
    filler and depths for the same seed): a budget held during prefill then
    ranks the text with the question already in the context. ``source``
    names the filler's text (kvpop/tasks/sources/); the facts and the question
    are the same for the same seed whatever the source."""
    sep = sources.separator(source)
    rng = random.Random(f"real:{family}:{seed}")
    facts, question, answers, solution = _facts(family, rng)
    if question_at == "end":
        intro = "Read the text below carefully: some facts are hidden in it. Answer the question after it.\n\n"
        ask = f"\n\nQuestion: {question} Answer briefly."
    elif question_at == "first":
        intro = (f"Question: {question}\n\nRead the text below carefully: the answer is hidden in it. "
                 "Answer the question after reading it.\n\n")
        ask = "\n\nAnswer the question above briefly."
    else:
        raise ValueError(f"question_at must be one of {', '.join(QUESTION_AT)}, not {question_at!r}")

    def render(filler: list[str], slots: list[int]) -> list[int]:
        body = list(filler)
        for pos, fact in sorted(zip(slots, facts), reverse=True):
            body.insert(pos, fact)
        content = intro + sep.join(body) + ask
        return tokenizer.encode_chat([{"role": "user", "content": content}]), content

    base = len(render([], [0] * len(facts))[0])
    per = _tokens_per_unit(source, sep, tokenizer)
    n = max(len(facts), int((length - base) / per))
    unit = sources.stream(source, rng)
    filler = [unit() for _ in range(n)]
    for _ in range(8):      # a few corrections: sentence lengths vary
        # Facts keep their order (a variable chain must read forwards).
        slots = sorted(rng.sample(range(len(filler) + 1), len(facts)))
        ids, content = render(filler, slots)
        err = length - len(ids)
        if abs(err) <= 0.02 * length:
            break
        k = int(err / per)
        if k > 0:
            filler += [unit() for _ in range(k)]
        elif k < 0:
            del filler[max(len(facts), len(filler) + k):]
        else:
            break
    # Real text's units vary more: then one at a time, the facts where they are. (The generator's
    # prompts stay those every published number was measured on.)
    for _ in range(64 if source != sources.DEFAULT else 0):
        err = length - len(ids)
        if abs(err) <= 0.02 * length or (err < 0 and len(filler) <= len(facts)):
            break
        if err > 0:
            filler.append(unit())
        else:
            filler.pop()
        ids, content = render(filler, [min(x, len(filler)) for x in slots])
    while limit is not None and len(ids) > limit and len(filler) > len(facts):
        # As many sentences as the overshoot is long (at least one): one re-render per step, not per sentence.
        del filler[max(len(facts), len(filler) - max(1, math.ceil((len(ids) - limit) / per))):]
        ids, content = render(filler, [min(x, len(filler)) for x in slots])
    sol = tokenizer.encode(solution, add_bos=False) + [min(tokenizer.eos_token_ids)]
    return TextInstance(family, seed, [{"role": "user", "content": content}], answers, solution,
                        prompt_ids=ids, solution_ids=sol, decoder=tokenizer, length=length, source=source)


def _tokens_per_unit(source: str, sep: str, tokenizer) -> float:
    """Mean tokens per filler unit: a first guess of how many a length needs."""
    if source == sources.DEFAULT:
        sample = [sources.generator.sentence(random.Random(i)) for i in range(50)]
    else:
        units = sources.corpus(source).units
        sample = units[:: max(1, len(units) // 200)][:200]
    return max(1.0, len(tokenizer.encode(sep.join(sample), add_bos=False)) / len(sample))


def prompt_limit(model_dir) -> int:
    """Longest prompt for the model: its context less ANSWER_ROOM for the answer."""
    from services.compute.model.config import ModelConfig
    return ModelConfig.from_hf(Path(model_dir) / "config.json").max_position_embeddings - ANSWER_ROOM


def test_set(tokenizer, n: int, lengths: list[int], families: list[str] | None = None,
             seed: int = 0, limit: int | None = None, question_at: str = "end",
             source: str = sources.DEFAULT) -> list[TextInstance]:
    """n instances per (family, length); seeds depend on the test-set seed.
    ``limit`` caps every prompt (a length at the model's whole context leaves
    no room for the answer): such a length is generated as close below it as
    the limit allows."""
    return [generate(fam, seed * 100_000 + length * 10 + i, length, tokenizer, limit, question_at, source)
            for length in lengths for fam in (families or FAMILIES) for i in range(n)]


def model_test_set(model_dir, n: int, lengths: list[int], families: list[str] | None = None,
                   seed: int = 0, question_at: str = "end", source: str = sources.DEFAULT) -> list[TextInstance]:
    """The test set as every consumer must see it for ``model_dir`` (our eval,
    the serving benchmark, kvpress on the same prompts): rendered with the
    model's tokenizer and chat template, prompts capped at :func:`prompt_limit`.
    Without the cap an "8k" prompt runs past SmolLM2's context and is not the
    prompt the eval ran."""
    from services.compute.model.tokenizer import Tokenizer
    return test_set(Tokenizer(model_dir), n, lengths, families, seed, prompt_limit(model_dir), question_at, source)
