"""The chat suite's conversations (kvpop/tasks/chat_recall.py): the asked
fact is told once, early, and nothing else in the chat gives it away; the
same seed gives the same chat, a shorter gap's talk is the start of a longer
one's; answers count by containment."""
from __future__ import annotations

import re

import pytest

from kvpop.tasks import chat_recall
from kvpop.tasks.small_talk import EXCHANGES


@pytest.mark.parametrize("family", chat_recall.FAMILIES)
def test_the_fact_is_told_once_early_and_asked_last(family):
    for seed in range(20):
        messages, value, solution = chat_recall.conversation(family, seed, 20)
        assert messages[0]["role"] == "system"
        roles = [m["role"] for m in messages[1:]]
        assert roles == ["user", "assistant"] * 23 + ["user"]
        told = [i for i, m in enumerate(messages) if value in m["content"]]
        assert len(told) == 1 and told[0] in (1, 3, 5), (family, seed, told)
        assert value not in messages[-1]["content"] and value in solution
        assert len({m["content"] for m in messages[7:-1:2]}) == 20     # no exchange twice


def test_same_seed_same_chat_and_gaps_share_their_start():
    a, b = chat_recall.conversation("pet", 3, 20), chat_recall.conversation("pet", 3, 20)
    assert a == b and chat_recall.conversation("pet", 4, 20) != a
    short, value, _ = chat_recall.conversation("pet", 3, 5)
    assert value == a[1] and short[:-1] == a[0][:len(short) - 1] and short[-1] == a[0][-1]
    with pytest.raises(ValueError):
        chat_recall.conversation("pet", 0, len(EXCHANGES) + 1)
    with pytest.raises(ValueError):
        chat_recall.conversation("colour", 0, 5)


def test_small_talk_gives_no_fact_away():
    names = chat_recall._PETS + chat_recall._PLACES
    for user, reply in EXCHANGES:
        text = f"{user} {reply}"
        assert not re.search(r"\d", text), text
        assert not any(re.search(rf"\b{n}\b", text) for n in names), text
    assert len({u for u, _ in EXCHANGES}) == len(EXCHANGES)


def test_answers_count_by_containment():
    from kvpop.tasks.ruler import TextInstance
    messages, value, solution = chat_recall.conversation("number", 1, 5)
    inst = TextInstance("number", 1, messages, [value], solution)
    assert inst.check(f"It is {value}.") and not inst.check("I do not remember.")
