"""`kvpop bench` end to end on the default model at tiny sizes: the engine's
greedy outputs equal transformers' generate() on the same prompts (so the two
sides decode the same tokens), the budgeted run holds fewer KV bytes than
dense by the pool's accounting, and the JSON and PNG are written."""
from __future__ import annotations

import json

import pytest

from kvpop.cli import main


@pytest.mark.timeout(120)
def test_bench_engine_small(tmp_path):
    out = tmp_path / "engine.json"
    rc = main(["bench", "engine", "--threads", "1", "--batch", "1", "3", "--new-tokens", "12",
               "--prompt-len", "24", "--repeats", "1", "--warmup", "0", "--kv-prompt-len", "160",
               "--json", str(out), "--plot", str(tmp_path / "engine.png")])
    assert rc == 0
    r = json.loads(out.read_text())
    assert [row["batch"] for row in r["decode"]] == [1, 3]
    for row in r["decode"]:
        assert row["outputs_equal"] == 1.0
        assert row["ours_tok_s"] > 0 and row["hf_tok_s"] > 0
    kv = r["kv"]
    assert kv["dense"]["evicted_blocks"] == 0 and kv["h2o"]["evicted_blocks"] > 0
    assert kv["h2o"]["bytes_per_seq_at_finish"] < 0.6 * kv["dense"]["bytes_per_seq_at_finish"]
    # dense holds what HF's cache holds, up to rounding to whole blocks
    assert abs(kv["hf_dynamic_cache"]["vs_dense"] - 1) < 0.15
    assert (tmp_path / "engine.png").stat().st_size > 1000


@pytest.mark.timeout(120)
def test_bench_prefix_small(tmp_path):
    out = tmp_path / "prefix.json"
    rc = main(["bench", "prefix", "--threads", "1", "--requests", "4", "--repeats", "1", "--warmup", "0",
               "--system-len", "160", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["prefix_cache_hit_rate"] == 1.0 and r["first_tokens_equal"] == 1.0
    assert r["prefix_cache_hit_tokens"] == 4 * 160 and r["ttft_ratio"] > 1.0


@pytest.mark.parametrize("argv,message", [
    (["engine", "--model", "/nonexistent"], "not a model folder"),
    (["engine", "--budget", "0", "--skip-hf"], "--budget"),
    (["engine", "--new-tokens", "1", "--skip-hf"], "--new-tokens"),
    (["prefix", "--requests", "0"], "--requests"),
])
def test_bench_bad_arguments_are_refused_with_a_message(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_bench_restores_the_thread_count():
    import torch

    before = torch.get_num_threads()
    assert main(["bench", "prefix", "--threads", str(before + 1), "--requests", "0"]) == 2
    assert torch.get_num_threads() == before


@pytest.mark.timeout(120)
def test_bench_scoring_replays_a_sequence_on_both_paths(tmp_path):
    out = tmp_path / "scoring.json"
    rc = main(["bench", "scoring", "--model", "models/default", "--lengths", "96,160", "--decode", "6",
               "--prefill-chunk", "32", "--compression", "0.75", "--threads", "1", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["length"] for r in rows] == [96, 160]
    for r in rows:
        for path in ("live", "full"):
            m = r[path]
            # Rows were held to the budget through the replay, one decoded block over at most.
            assert m["held_max"] <= m["budget"] + 1 and m["budget"] == round(r["length"] * 0.25)
            assert m["prefill_plans"] == -(-r["length"] // 32) and m["decode_ms_median"] > 0


@pytest.mark.timeout(120)
def test_bench_step_counts_launches_and_leaves_the_planner_out(tmp_path):
    out = tmp_path / "step.json"
    rc = main(["bench", "step", "--policies", "dense,learned", "--sequences", "2,6", "--steps", "16",
               "--threads", "1", "--device", "cpu", "--json", str(out)])
    assert rc == 0
    rows = {(r["policy"], r["sequences"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("dense", 2), ("dense", 6), ("learned", 2), ("learned", 6)}
    for r in rows.values():
        assert r["device"] == "cpu" and r["step_ms"] > 0 and r["launches"] > 50
    # Dense plans nothing; learned's planner ran in process (16 steps: every sequence sent a
    # block's features) and was timed apart.
    assert rows["dense", 6]["planner_ms"] == 0 and rows["learned", 6]["planner_ms"] > 0
    # The forward's launches do not depend on the batch: a step for 6 is not 3x one for 2.
    assert rows["dense", 6]["launches"] < 1.5 * rows["dense", 2]["launches"]
