"""Task generators, vocabulary and answer checker."""
from __future__ import annotations

import json
import statistics

import pytest
from tokenizers import Tokenizer

from kvpop.tasks import suite
from kvpop.tasks.suite import FAMILIES, TEST_SEEDS, TRAIN_SEEDS, generate
from kvpop.tasks.checker import extract_answer, is_correct
from kvpop.tasks.vocab import BOS_ID, EOS_ID, save_tokenizer
from kvpop.training.data import make_batch, train_instance


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generator_is_deterministic_per_seed(family):
    a, b = generate(family, 123, 600), generate(family, 123, 600)
    assert a == b
    c = generate(family, 124, 600)
    assert (c.prompt, c.solution) != (a.prompt, a.solution)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("length", [448, 900, 1280])
def test_instance_is_well_formed(family, length):
    inst = generate(family, 7, length)
    ids = inst.prompt_ids
    assert ids[0] == BOS_ID and inst.solution_ids[-1] == EOS_ID
    assert abs(len(ids) - length) <= 8, len(ids)
    assert inst.depends and all(0 < p < len(ids) for p in inst.depends)
    # The design rule: at 93.75% compression the needed tokens fit in the budget
    # next to the evaluation's 4-token sink and 8-token recent window ...
    budget = (len(ids) + len(inst.solution_ids)) // 16
    assert len(set(inst.depends)) + 4 + 8 <= budget
    # ... but keeping only recent tokens cannot answer.
    assert min(inst.depends) < len(ids) - budget
    assert is_correct(inst, inst.solution)


def test_answer_depends_on_marked_positions():
    words = ["<s>"]
    inst = generate("registers", 99, 700)
    words += inst.prompt.split()
    line = [words[p] for p in inst.depends]
    assert line[1] == ":=" and line[2] == inst.answer
    pk = generate("passkey", 99, 700)
    assert [(["<s>"] + pk.prompt.split())[p] for p in pk.depends] == ["key"] + pk.answer.split() + ["."]


def test_train_and_test_seeds_are_disjoint():
    assert TRAIN_SEEDS.stop <= TEST_SEEDS.start or TEST_SEEDS.stop <= TRAIN_SEEDS.start
    assert all(i.seed in TEST_SEEDS for i in suite.test_set(5))
    with pytest.raises(ValueError):
        train_instance("passkey", TEST_SEEDS.start, 200, __import__("random").Random(0))


def test_standard_test_set_lengths():
    lengths = [len(i.prompt_ids) for i in suite.test_set(25)]
    assert statistics.median(lengths) >= 512
    assert max(lengths) > 1024


def test_checker_exact_match_and_malformed_output():
    inst = generate("arithmetic", 5, 500)
    assert extract_answer("arithmetic", inst.solution) == inst.answer
    wrong = str((int(inst.answer) + 1) % 10)
    for bad in ["", "ans", "ans .", f"ans {wrong} .", f"ans {inst.answer}", "x1 3 = 3 ; . ans 4 .",
                f"ans {inst.answer} {inst.answer} .", "\x00\ufffd garbage <unk> .", None, 42]:
        assert not is_correct(inst, bad), bad
    assert is_correct(inst, f"some steps ans {inst.answer} . trailing junk </s>")
    rec = generate("recall", 5, 500)
    assert is_correct(rec, rec.answer + " .")
    assert not is_correct(rec, rec.answer)                      # never finished
    assert not is_correct(rec, rec.answer.rsplit(" ", 1)[0] + " .")  # one value missing


def test_tokenizer_round_trip(tmp_path):
    path = save_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(path))
    for fam in FAMILIES:
        inst = generate(fam, 3, 300)
        assert tok.encode(inst.prompt).ids == inst.prompt_ids
        assert tok.decode(inst.solution_ids) == inst.solution


def test_training_batch_supervises_solution_tokens():
    import random
    x, y, sol, fams = make_batch(list(FAMILIES), 200, 8, random.Random(0))
    assert x.shape[0] == 8 and set(fams) == set(FAMILIES)
    for b in range(8):
        tgt = y[b][y[b] != -100]
        assert tgt[-1].item() == EOS_ID and len(tgt) >= 2


def test_cli_prints_json(capsys):
    from kvpop.cli import main
    assert main(["tasks", "--family", "recall", "--n", "2", "--length", "300", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and rows[0]["family"] == "recall" and rows[0]["seed"] != rows[1]["seed"]
    assert main(["tasks", "--family", "nope"]) == 2
