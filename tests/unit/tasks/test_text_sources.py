"""The `real` suite's haystack text sources (kvpop/tasks/sources/): each is
there without a hub, reads the same units in the same order every time, an
instance's run of text is fixed by its seed, and the held-out sources share
no text with the training ones."""
from __future__ import annotations

import random

import pytest

from kvpop.tasks.sources import catalog as sources


@pytest.mark.parametrize("name", [s for s in sources.SOURCES if s != "generator"])
def test_a_corpus_is_real_text_in_a_fixed_order(name):
    units = sources.corpus(name).units
    assert len(units) >= 1000, (name, len(units))
    # Enough text for the longest prompt SmolLM2 holds (8k tokens ~ 32k characters) many times over.
    assert sum(map(len, units)) > 150_000
    assert all(u.strip() for u in units)
    assert sources.reader(name)() == units       # read afresh: the same units in the same order


@pytest.mark.parametrize("name", sources.SOURCES)
def test_the_seed_fixes_the_run_of_text(name):
    take = lambda seed: (lambda nxt: [nxt() for _ in range(40)])(sources.stream(name, random.Random(seed)))
    assert take(3) == take(3)
    assert take(3) != take(4)
    if name != "generator":      # a contiguous run: the units in the corpus's order, from one offset
        units, run = sources.corpus(name).units, take(3)
        starts = [i for i, u in enumerate(units) if u == run[0]]      # a unit may recur (dialogue)
        assert any(run == [units[(s + i) % len(units)] for i in range(40)] for s in starts)


def test_held_out_sources_share_no_text_with_training_sources():
    assert set(sources.HELD_OUT).isdisjoint(sources.TRAINING) and len(sources.HELD_OUT) >= 2
    assert len([s for s in sources.TRAINING if s != "generator"]) >= 3
    held = {u for s in sources.HELD_OUT for u in sources.corpus(s).units}
    train = {u for s in sources.TRAINING if s != "generator" for u in sources.corpus(s).units}
    shared = held & train
    # Boilerplate sentences may recur across unrelated texts; text is not shared.
    assert len(shared) <= 0.002 * len(held), sorted(shared)[:5]


def test_units_are_bounded_steps_of_prompt_length():
    from kvpop.tasks.sources.corpus import MAX_CHARS, sentences
    long = "word " * 400
    assert all(len(s) <= MAX_CHARS for s in sentences(long + ". Next sentence here is short."))
    assert sentences("Short.\n\nIt costs e.g. a penny. Then Another one follows.") == [
        "It costs e.g. a penny.", "Then Another one follows."]


def test_an_unknown_source_names_the_choices_and_labels_say_held_out():
    with pytest.raises(sources.SourceError, match="choose from generator.*held out of training: reference"):
        sources.check("wikipedia")
    assert sources.label("licenses") == "licenses (held out of training)"
    assert sources.label("code") == "code (a training source)"
    with pytest.raises(sources.SourceError, match="writes its text"):
        sources.corpus("generator")


@pytest.mark.parametrize("asked", [("licenses",), ("code", "reference"), ()])
def test_traces_refuse_held_out_text(asked):
    """The held-out sources are the yardstick: `kvpop train-estimator --sources`
    refuses them before any model runs."""
    from kvpop.training.traces import real_traces
    with pytest.raises(ValueError, match="held out of training"):
        real_traces(None, None, 4, [], text_sources=asked)
