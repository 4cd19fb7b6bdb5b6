"""`kvpop bench context` on the default model (small lengths): dense KV grows
with the context, a budgeted sequence's stays at its budget."""
from __future__ import annotations

import argparse
import json

from kvpop.bench import context as bench_context
from kvpop.runtime.paths import DEFAULT_MODEL_DIR


def test_dense_grows_budget_stays_flat(tmp_path):
    p = argparse.ArgumentParser()
    bench_context.add_arguments(p)
    args = p.parse_args(["--model", str(DEFAULT_MODEL_DIR), "--lengths", "128,256,512", "--new-tokens", "8",
                         "--budget", "64", "--json", str(tmp_path / "c.json"),
                         "--plot", str(tmp_path / "c.png")])
    assert bench_context.run(args) == 0
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    dense = [r["kv_bytes_at_end"] for r in rows if r["policy"] == "dense"]
    budget = [r["kv_bytes_at_end"] for r in rows if r["policy"] == "h2o"]
    assert dense[0] < dense[1] < dense[2] and dense[2] > 3 * dense[0], dense
    assert len(set(budget)) == 1 and budget[0] < dense[0], budget      # flat, below the shortest dense
    assert all(r["evicted_blocks"] > 0 for r in rows if r["policy"] == "h2o")
    assert (tmp_path / "c.png").is_file()


def test_a_smaller_prefill_chunk_lowers_the_peak(tmp_path):
    p = argparse.ArgumentParser()
    bench_context.add_arguments(p)
    args = p.parse_args(["--model", str(DEFAULT_MODEL_DIR), "--lengths", "512", "--new-tokens", "8",
                         "--budget", "64", "--block-size", "16", "--prefill-chunks", "256,64",
                         "--json", str(tmp_path / "c.json")])
    assert bench_context.run(args) == 0
    rows = {(r["policy"], r["prefill_chunk"]): r for r in json.loads((tmp_path / "c.json").read_text())["rows"]}
    assert set(rows) == {("dense", 256), ("h2o", 256), ("h2o", 64)}
    page = rows["dense", 256]["peak_kv_bytes"] / rows["dense", 256]["peak_pages"]
    rows_of = rows["dense", 256]["resident_blocks"] // (512 // 16)     # layers x kv-heads
    for chunk in (256, 64):
        peak_tokens = rows["h2o", chunk]["peak_kv_bytes"] / page / rows_of * 16
        assert 64 < peak_tokens <= 64 + chunk + 16, (chunk, peak_tokens)
    assert rows["h2o", 64]["peak_kv_bytes"] < rows["h2o", 256]["peak_kv_bytes"] < rows["dense", 256]["peak_kv_bytes"]


def test_refuses_a_context_past_the_model(capsys):
    p = argparse.ArgumentParser()
    bench_context.add_arguments(p)
    args = p.parse_args(["--model", str(DEFAULT_MODEL_DIR), "--lengths", "1000000"])
    assert bench_context.run(args) == 2
    assert "past the model" in capsys.readouterr().out
