"""`kvpop bench context` on the default model (small lengths): dense KV grows
with the context, a budgeted sequence's stays at its budget."""
from __future__ import annotations

import argparse
import json

from kvpop import bench_context
from kvpop.paths import DEFAULT_MODEL_DIR


def test_dense_grows_budget_stays_flat(tmp_path):
    p = argparse.ArgumentParser()
    bench_context.add_arguments(p)
    args = p.parse_args(["--model", str(DEFAULT_MODEL_DIR), "--lengths", "128,256,512", "--new-tokens", "8",
                         "--budget-tokens", "64", "--json", str(tmp_path / "c.json"),
                         "--plot", str(tmp_path / "c.png")])
    assert bench_context.run(args) == 0
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    dense = [r["kv_bytes_at_end"] for r in rows if r["policy"] == "dense"]
    budget = [r["kv_bytes_at_end"] for r in rows if r["policy"] == "h2o"]
    assert dense[0] < dense[1] < dense[2] and dense[2] > 3 * dense[0], dense
    assert len(set(budget)) == 1 and budget[0] < dense[0], budget      # flat, below the shortest dense
    assert all(r["evicted_blocks"] > 0 for r in rows if r["policy"] == "h2o")
    assert (tmp_path / "c.png").is_file()


def test_refuses_a_context_past_the_model(capsys):
    p = argparse.ArgumentParser()
    bench_context.add_arguments(p)
    args = p.parse_args(["--model", str(DEFAULT_MODEL_DIR), "--lengths", "1000000"])
    assert bench_context.run(args) == 2
    assert "past the model" in capsys.readouterr().out
