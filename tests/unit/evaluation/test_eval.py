"""Evaluation harness: teacher forcing through the engine, the oracle policy,
dense engine accuracy against transformers greedy decoding, result records."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from helpers.common import REPO
from kvpop.evaluation import report
from kvpop.evaluation.harness import Harness, Outcome, Setting, budget_tokens, policy_spec
from kvpop.evaluation.oracle import OraclePolicy, answer_attention
from kvpop.tasks import suite
from kvpop.tasks.suite import generate
from kvpop.tasks.checker import is_correct
from kvpop.tasks.vocab import WORDS, decode_ids, save_tokenizer



def _tiny_model_dir(tmp: Path) -> Path:
    from kvpop.training.train_model import add_arguments, model_config
    from services.compute.model.loader import save_model
    from services.compute.model.model import TransformerModel
    p = argparse.ArgumentParser(); add_arguments(p)
    args = p.parse_args(["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--ff", "96"])
    torch.manual_seed(0)
    model = TransformerModel(model_config(args))
    with torch.no_grad():
        for name, w in model.named_parameters():
            if not name.endswith("norm.weight"):
                w.normal_(0, 0.2)   # larger than training init: peaked, position-dependent outputs
    return save_model(model, tmp / "tiny", save_tokenizer(tmp / "tok.json"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _tiny_model_dir(tmp_path_factory.mktemp("evalmodel"))


@pytest.fixture(scope="module")
def task_model_dir(tmp_path_factory):
    """The shipped default model when it speaks the task vocabulary, else a tiny random one."""
    cfg = REPO / "models" / "default" / "config.json"
    if cfg.is_file() and json.loads(cfg.read_text())["vocab_size"] == len(WORDS):
        return REPO / "models" / "default"
    return _tiny_model_dir(tmp_path_factory.mktemp("fallback"))


def _engine(model_dir, block_size=1):
    from services.compute.engine.engine import EngineConfig, LLMEngine
    return LLMEngine(EngineConfig(str(model_dir), block_size=block_size, max_num_seqs=8, max_model_len=2048))


def test_teacher_forced_dense_matches_full_forward(tiny_dir):
    from services.compute.model.loader import load_model
    insts = [generate(f, 11, 120) for f in ("recall", "arithmetic")]
    h = Harness(_engine(tiny_dir))
    outs = h.run([Setting("dense", 0.0)], insts, desc="tf")
    model = load_model(tiny_dir)
    for o in outs:
        ids = o.instance.prompt_ids + o.instance.solution_ids
        ref = torch.log_softmax(model.forward_dense(torch.tensor([ids]))[0], -1)
        start = len(o.instance.prompt_ids) - 1
        got = torch.stack(o.logprobs)
        assert got.shape[0] == len(o.instance.solution_ids)
        torch.testing.assert_close(got, ref[start: start + got.shape[0]], atol=2e-4, rtol=1e-4)


def test_oracle_keeps_dependency_blocks_under_tight_budget(tiny_dir):
    from services.compute.engine.engine import EvictionParams, SamplingParams
    eng = _engine(tiny_dir, block_size=2)
    inst = generate("recall", 4, 600)
    budget = budget_tokens(inst, 0.9375, 0)
    seq = eng.make_sequence("o", inst.prompt_ids, SamplingParams(max_tokens=3),
                            EvictionParams("streaming", budget=budget, sink=4, recent=8, block_size=2))
    seq.policy = OraclePolicy(inst.depends, 2)
    eng.add_sequence(seq)
    while seq.in_prefill:
        eng.step()
    resident = set(seq.block_index[0, 0].tolist())
    assert seq.num_blocks * 2 <= budget + 2
    assert {p // 2 for p in inst.depends} <= resident
    assert all(set(seq.block_index[l, h].tolist()) == resident
               for l in range(seq.block_index.shape[0]) for h in range(seq.block_index.shape[1]))


def test_oracle_ranks_each_row_by_the_dense_answers_attention(tiny_dir):
    """Without a dependency list, each (layer, kv-head) row keeps its protected
    blocks and, of the rest, those the dense answer attends to most."""
    from services.compute.engine.engine import EvictionParams, SamplingParams
    from services.compute.model.loader import load_model
    inst = generate("recall", 5, 300)
    ids, P = inst.prompt_ids + inst.solution_ids, len(inst.prompt_ids)
    att = answer_attention(load_model(tiny_dir), ids, P)
    L, H, T = att.shape
    assert T == len(ids) and float(att.max()) <= 1.0
    assert bool((att[..., : T - 1] > 0).all()) and bool((att[..., T - 1] == 0).all())   # no answer query sees it
    eng = _engine(tiny_dir, block_size=2)
    budget = budget_tokens(inst, 0.875, 0)
    seq = eng.make_sequence("o", inst.prompt_ids, SamplingParams(max_tokens=2),
                            EvictionParams("streaming", budget=budget, sink=4, recent=8, block_size=2))
    seq.policy = OraclePolicy([], 2, att)
    eng.add_sequence(seq)
    while seq.in_prefill:     # one chunk: one round, over every block of the prompt
        eng.step()
    nb = -(-P // 2)
    block_att = seq.policy.block_att[..., :nb]
    protected = set(range(2)) | set(range((P - 8) // 2, nb))
    keep = seq.num_blocks - len(protected)
    rows = set()
    for l in range(L):
        for h in range(H):
            score = {b: float(block_att[l, h, b]) * (1 - 1e-3) + 1e-3 * b / nb for b in range(nb) if b not in protected}
            best = sorted(score, key=score.get, reverse=True)[:keep]
            resident = set(seq.block_index[l, h].tolist())
            assert resident == protected | set(best), (l, h)
            rows.add(frozenset(resident))
    assert len(rows) > 1, "rows choose differently"


def test_eviction_changes_distribution_and_kl_is_zero_for_dense(tiny_dir):
    insts = [generate("passkey", 3, 500)]
    h = Harness(_engine(tiny_dir))
    dense = h.run([Setting("dense", 0.0)], insts)
    ref = {(o.instance.family, o.instance.seed): o.logprobs for o in dense}
    outs = h.run([Setting("dense", 0.0), Setting("streaming", 0.9375)], insts, reference=ref)
    kl_dense, kl_stream = outs[0].kl, outs[1].kl
    assert len(kl_stream) == len(insts[0].solution_ids)
    assert max(kl_dense) < 1e-6
    assert sum(kl_stream) / len(kl_stream) > 1e-4
    assert outs[1].budget == budget_tokens(insts[0], 0.9375, h.min_budget)


def test_dense_engine_accuracy_equals_transformers_greedy(task_model_dir):
    transformers = pytest.importorskip("transformers")
    insts = suite.test_set(2, None, seed=3, min_len=200, max_len=320)
    h = Harness(_engine(task_model_dir))
    outs = h.run([Setting("dense", 0.0)], insts)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(task_model_dir), torch_dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    agree = 0
    for o in outs:
        inst = o.instance
        with torch.no_grad():
            g = hf.generate(torch.tensor([inst.prompt_ids]), max_new_tokens=len(inst.solution_ids) + h.margin,
                            do_sample=False, eos_token_id=2, pad_token_id=0)
        new = g[0, len(inst.prompt_ids):].tolist()
        hf_text = decode_ids(new)
        # o.text is what compute streams: the words, after the prompt's last one (a leading space).
        assert hf_text == " ".join(o.text.split()) and o.text.startswith(" "), (inst.family, hf_text, o.text)
        assert is_correct(inst, hf_text) == o.correct
        agree += o.correct
    assert agree == sum(o.correct for o in outs)


def test_records_and_table(tmp_path):
    from kvpop.evaluation.harness import Outcome
    a, b = generate("passkey", 1, 200), generate("recall", 1, 200)
    outs = [Outcome(Setting("dense", 0.0), a, True, 4), Outcome(Setting("dense", 0.0), b, True, 6),
            Outcome(Setting("random", 0.5), a, True, 4, kl=[0.5, 0.1], budget=100),
            Outcome(Setting("random", 0.5), b, False, 9, kl=[0.3], budget=100)]
    rows = report.records(outs, ["passkey", "recall"])
    by = {(r["policy"], r["task"]): r for r in rows}
    assert by[("random", "all")]["accuracy"] == 0.5 and by[("random", "all")]["retention"] == 0.5
    assert by[("random", "recall")]["retention"] == 0.0 and by[("dense", "all")]["compression"] == 0.0
    assert abs(by[("random", "all")]["kl"] - 0.3) < 1e-9
    assert by[("random", "all")]["mean_generated_tokens"] == 6.5
    report.write(rows, ["passkey", "recall"], tmp_path, {"x": 1})
    assert json.loads((tmp_path / "results.json").read_text()) == rows
    md = (tmp_path / "results.md").read_text()
    assert "| random | 50.00% |" in md and (tmp_path / "accuracy.png").stat().st_size > 1000


def test_records_break_real_text_results_down_by_length(tmp_path):
    """A long-context run pools every length in its main table; each length asked
    for gets its own rows (with its own dense for retention) and table column."""
    from kvpop.evaluation.harness import Outcome
    from kvpop.tasks.ruler import TextInstance

    def inst(fam, length, seed):
        return TextInstance(fam, seed, [{"role": "user", "content": "x"}], ["a"], "a",
                            prompt_ids=[1] * length, solution_ids=[2], length=length)
    short, long_ = inst("needle", 1024, 1), inst("needle", 4096, 2)
    outs = [Outcome(Setting("dense", 0.0), short, True, 3), Outcome(Setting("dense", 0.0), long_, False, 3),
            Outcome(Setting("learned", 0.875), short, True, 3, budget=128),
            Outcome(Setting("learned", 0.875), long_, False, 3, budget=512)]
    rows = report.records(outs, ["needle"])
    by = {(r["policy"], r["task"], r["length"]): r for r in rows}
    assert by["learned", "all", None]["accuracy"] == 0.5 and by["learned", "all", None]["n"] == 2
    assert by["learned", "all", 1024]["accuracy"] == 1.0 and by["learned", "needle", 4096]["accuracy"] == 0.0
    assert by["learned", "all", 1024]["retention"] == 1.0 and by["learned", "all", 4096]["retention"] is None
    md = report.markdown(rows, ["needle"])
    assert "| 1,024 tokens | 4,096 tokens |" in md and "| learned | 87.50% | 1.000 (1) | 0.000 (1) |" in md
    report.write(rows, ["needle"], tmp_path, {})
    assert (tmp_path / "accuracy.png").stat().st_size > 1000


def test_recent_share_variant_gives_half_the_budget_to_recent_tokens(tiny_dir):
    assert policy_spec("h2o") == ("h2o", None) and policy_spec("h2o+recent50") == ("h2o", 0.5)
    with pytest.raises(ValueError):
        policy_spec("h2o+recent100")
    inst = generate("passkey", 3, 500)
    h = Harness(_engine(tiny_dir))
    plain, half = Outcome(Setting("h2o", 0.75), inst), Outcome(Setting("h2o+recent50", 0.75), inst)
    a, b = h._make("a", plain, False), h._make("b", half, False)
    assert a.eviction.policy == b.eviction.policy == "h2o" and plain.budget == half.budget
    assert a.eviction.recent == h.recent
    assert b.eviction.recent == half.budget // 2 > h.recent


def test_protocol_suffixes_become_the_requests_fields(tiny_dir):
    """"+after" and "+prefill<N>x" are request fields (evict_after_prompt,
    prefill_allowance), not policies: the in-process request carries them."""
    from kvpop.evaluation.harness import after_prompt, base_label, prefill_allowance
    assert base_label("h2o+recent50+prefill2x") == "h2o+recent50" and base_label("learned+after") == "learned"
    assert prefill_allowance("learned+prefill2.5x") == 2.5 and prefill_allowance("learned") == 1.0
    assert policy_spec("h2o+recent50+prefill2x") == ("h2o", 0.5) and not after_prompt("learned+prefill2x")
    with pytest.raises(ValueError, match=r"\+prefill<N>x"):
        prefill_allowance("learned+prefill2")
    inst = generate("passkey", 3, 500)
    h = Harness(_engine(tiny_dir))
    o = Outcome(Setting("keydiff+prefill2x", 0.75), inst)
    st = h._make("a", o, False).eviction
    assert st.policy == "keydiff" and not st.after_prompt
    assert st.prefill_blocks == 2 * st.budget_blocks == 2 * o.budget


def test_is_correct_scores_real_text_by_containment():
    """One scoring entry point for both suites: a real-text instance is right when
    every expected value appears anywhere in the text, a task instance by its
    extracted answer."""
    from kvpop.tasks.ruler import TextInstance
    inst = TextInstance("multivalue", 1, [{"role": "user", "content": "x"}], ["4711", "815"], "4711, 815")
    assert is_correct(inst, "The values are 815 and 4711.")
    assert not is_correct(inst, "The value is 4711.")


def test_eval_refuses_a_seed_past_the_test_range_with_a_message(tmp_path, capsys):
    """A test-set seed whose instances would leave the test range is a usage
    error (exit 2, the range to use), not a traceback."""
    from kvpop.cli import main

    assert main(["eval", "--policies", "dense", "--n", "16", "--seed", "101", "--no-kl",
                 "--out", str(tmp_path / "e")]) == 2
    said = capsys.readouterr().out
    assert "seed 101" in said and "from 0 to 99" in said
    with pytest.raises(ValueError, match="from 0 to 98"):
        suite.test_set(1001, ["passkey"], 99)


def test_eval_pools_several_seeds_into_one_table(tmp_path):
    """`--seed 3,5` runs both seeds' instances as one test set: every family
    cell counts both, and meta.json names the seeds."""
    from kvpop.cli import main

    out = tmp_path / "e"
    assert main(["eval", "--policies", "dense", "--tasks", "passkey", "--quick", "--seed", "3,5", "--no-kl",
                 "--threads", "1", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())
    assert {r["n"] for r in rows if r["task"] == "passkey"} == {2}
    assert json.loads((out / "meta.json").read_text())["seed"] == [3, 5]
    with pytest.raises(SystemExit):
        main(["eval", "--seed", "3,3", "--out", str(out)])


def test_no_dense_runs_only_the_policies_asked_for(tmp_path, capsys):
    """`--no-dense` (a rerun of one policy on prompts whose dense row exists) runs
    no dense request: the table and outcomes hold only the policy's rows, with no
    retention. KL needs dense, so it asks for --no-kl."""
    from kvpop.cli import main

    out = tmp_path / "e"
    assert main(["eval", "--policies", "h2o", "--compression", "0.5", "--tasks", "passkey", "--quick", "--seed", "3",
                 "--no-kl", "--no-dense", "--threads", "1", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())
    assert {r["policy"] for r in rows} == {"h2o"} and all(r["retention"] is None for r in rows)
    lines = (out / "outcomes.jsonl").read_text().splitlines()
    assert lines and all(json.loads(x)["policy"] == "h2o" for x in lines)
    capsys.readouterr()
    assert main(["eval", "--policies", "h2o", "--no-dense", "--quick", "--out", str(out)]) == 2
    assert "--no-kl" in capsys.readouterr().out
    assert main(["eval", "--policies", "dense,h2o", "--no-dense", "--no-kl", "--quick", "--out", str(out)]) == 2
