"""`kvpop bench serve --quick`: the serving benchmark works end to end on its
own stack (it checks the benchmark, not a speed)."""
from __future__ import annotations

import argparse
import json

import pytest

from kvpop import bench_serve

pytestmark = pytest.mark.slow


def test_bench_serve_quick_writes_results_and_summary(tmp_path):
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    args = p.parse_args(["--quick", "--out", str(tmp_path / "serve")])
    assert bench_serve.run(args) == 0
    out = tmp_path / "serve"
    rows = json.loads((out / "results.json").read_text())["rows"]
    summary = json.loads((out / "summary.json").read_text())
    assert {r["policy"] for r in rows} == {"dense", "learned"}
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == 8, r
        assert r["output_tokens_per_s"] > 0 and r["peak_running"] >= 1 and r["peak_pages"] > 0, r
        assert isinstance(r["budget_shrinks"], int) and r["budget_shrinks"] >= 0, r   # polled from compute
    learned = next(r for r in rows if r["policy"] == "learned")
    dense = next(r for r in rows if r["policy"] == "dense")
    assert learned["network_share"] >= 0.99, learned
    assert learned["peak_pages"] < dense["peak_pages"], (learned, dense)   # the budget holds less KV
    assert summary["throughput_ratio"] > 0 and summary["concurrency_ratio"] > 0, summary
    assert (out / "throughput.png").is_file() and (out / "latency_cdf.png").is_file()


def test_bench_serve_hf_baseline_gives_the_same_answers(tmp_path):
    # Comparison 4's baseline: transformers generate() on static batches of the same arrivals.
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    args = p.parse_args(["--quick", "--policies", "dense,hf", "--out", str(tmp_path / "hf")])
    assert bench_serve.run(args) == 0
    rows = {r["policy"]: r for r in json.loads((tmp_path / "hf" / "results.json").read_text())["rows"]}
    hf, dense = rows["hf"], rows["dense"]
    assert hf["errors"] == 0 and hf["requests"] == 8 and hf["output_tokens_per_s"] > 0, hf
    assert 1 <= hf["peak_running"] <= 8 and hf["ttft_p50_ms"] > 0, hf
    assert hf["accuracy"] == dense["accuracy"], (hf, dense)     # greedy on both sides: the same answers
    summary = json.loads((tmp_path / "hf" / "summary.json").read_text())
    assert summary["served_dense_over_hf"]["throughput_ratio"] > 0, summary
