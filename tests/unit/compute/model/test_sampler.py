"""Sampler: greedy, temperature, top-k, top-p, seeds independent of the batch,
repetition penalty, logprobs."""
from types import SimpleNamespace

import pytest
import torch

from services.compute.model.sampler import SamplingParams, make_generator, sample


def seq(tokens=(), **kw):
    p = SamplingParams(**kw)
    return SimpleNamespace(sampling=p, tokens=list(tokens), generator=make_generator(p, "cpu"))


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    toks, lps = sample(logits, [seq(logprobs=True), seq()])
    assert toks == [1, 0]
    assert lps[0] == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))
    assert lps[1] is None


def test_seeded_sampling_is_independent_of_batch_composition():
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    alone = [sample(logits[i:i + 1], [seq(temperature=1.0, seed=i)])[0][0] for i in range(6)]
    batched, _ = sample(logits, [seq(temperature=1.0, seed=i) for i in range(6)])
    shuffled, _ = sample(logits.flip(0), [seq(temperature=1.0, seed=i) for i in reversed(range(6))])
    assert batched == alone == shuffled[::-1]


def test_seed_sequence_reproducible_and_seeds_differ():
    logits = torch.zeros(1, 1000)
    def draw(s):
        q = seq(temperature=1.0, seed=s)
        return [sample(logits, [q])[0][0] for _ in range(20)]
    assert draw(7) == draw(7) != draw(8)


def test_top_k_and_top_p_truncate():
    logits = torch.tensor([[4.0, 3.9, 3.8, -1.0, -2.0]])
    for s in range(30):
        assert sample(logits, [seq(temperature=5.0, top_k=2, seed=s)])[0][0] in (0, 1)
    # Probabilities ~[.34, .31, .28, .002, .0008]: top_p 0.5 keeps the first two.
    got = {sample(logits, [seq(temperature=1.0, top_p=0.5, seed=s)])[0][0] for s in range(60)}
    assert got == {0, 1}
    assert {sample(logits, [seq(temperature=1.0, top_p=1e-6, seed=s)])[0][0] for s in range(10)} == {0}


def test_temperature_spreads_choices():
    logits = torch.tensor([[1.0, 0.9, 0.8, 0.7]])
    got = {sample(logits, [seq(temperature=1.0, seed=s)])[0][0] for s in range(60)}
    assert len(got) == 4


def test_repetition_penalty_discourages_seen_tokens():
    logits = torch.tensor([[2.0, 1.8, -1.0]])
    assert sample(logits, [seq(tokens=[0])])[0] == [0]
    assert sample(logits, [seq(tokens=[0], repetition_penalty=1.5)])[0] == [1]
    # Negative logits are pushed further down, not up.
    logits = torch.tensor([[-1.0, -1.2]])
    assert sample(logits, [seq(tokens=[0], repetition_penalty=1.5)])[0] == [1]


@pytest.mark.parametrize("kw,words", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(seed=-1), "seed"),
    (dict(stop=("",)), "stop"), (dict(stop="x"), "stop")])
def test_validation(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw).validate()
