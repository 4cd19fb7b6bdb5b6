"""`kvpop eval --quick` end to end as a real process on the shipped default
model: well-formed results.json, outcomes.jsonl, markdown table and plot."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIELDS = {"policy", "compression", "task", "n", "accuracy", "retention", "kl", "mean_generated_tokens"}


@pytest.mark.slow
def test_quick_eval_writes_well_formed_results(tmp_path):
    policies = "dense,oracle,streaming,random,h2o,knorm,learned"
    proc = subprocess.run(
        [sys.executable, "-m", "kvpop.cli", "eval", "--quick", "--policies", policies,
         "--compression", "0.75,0.9375", "--out", str(tmp_path), "--threads", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())
    assert rows and all(FIELDS <= set(r) for r in rows)
    families = {"registers", "arithmetic", "recall", "passkey"}
    # The default model ships its estimator: `learned` runs, on the network's plans.
    expected = {("dense", 0.0)} | {(p, c) for p in ("oracle", "streaming", "random", "h2o", "knorm", "learned")
                                   for c in (0.75, 0.9375)}
    assert "skipping" not in proc.stdout, proc.stdout[-3000:]
    assert {(r["policy"], r["compression"]) for r in rows} == expected
    decisions = json.loads((tmp_path / "meta.json").read_text())["decisions"]
    for c in (0.75, 0.9375):
        d = decisions[f"learned@{c}"]
        assert d["evicted"] > 0 and d["network"] >= 0.99 * d["evicted"], d
    for r in rows:
        assert r["task"] in families | {"all"}
        assert r["n"] == (4 if r["task"] == "all" else 1)
        assert 0.0 <= r["accuracy"] <= 1.0 and r["kl"] >= 0.0 and r["mean_generated_tokens"] >= 1
        if r["policy"] == "dense":
            assert r["kl"] == 0.0
    dense = {r["task"]: r["accuracy"] for r in rows if r["policy"] == "dense"}
    for r in rows:
        if dense[r["task"]]:
            assert r["retention"] == pytest.approx(r["accuracy"] / dense[r["task"]])
    # KV as compute measured it (usage): a budget holds less than dense at the end and at its peak
    # (the budget holds during prefill), and less at 93.75% than at 75%.
    pooled = {(r["policy"], r["compression"]): r for r in rows if r["task"] == "all"}
    assert all(r["held_tokens"] > 0 and r["peak_kv_mib"] > 0 for r in pooled.values())
    d = pooled["dense", 0.0]
    for (pol, comp), r in pooled.items():
        if pol != "dense":
            assert r["held_tokens"] < d["held_tokens"] and r["peak_kv_mib"] < d["peak_kv_mib"], (pol, comp)
            if comp == 0.9375:
                assert r["held_tokens"] < pooled[pol, 0.75]["held_tokens"], pol
    # One line per request; its correctness agrees with the table, and a dense line's text is what it answered.
    lines = [json.loads(x) for x in (tmp_path / "outcomes.jsonl").read_text().splitlines()]
    assert len(lines) == sum(pooled[k]["n"] for k in pooled) == 4 * len(expected)
    for (pol, comp), r in pooled.items():
        mine = [x for x in lines if x["policy"] == pol and x["compression"] == comp]
        assert len(mine) == 4 and sum(x["correct"] for x in mine) == round(r["accuracy"] * 4), (pol, comp)
    for x in lines:
        assert x["family"] in families and x["prompt_tokens"] > 400 and x["peak_kv_mib"] > 0
        assert (x["budget"] is None) == (x["policy"] == "dense")
        assert not x["correct"] or any(e in x["text"] for e in x["expected"]), x
    md = (tmp_path / "results.md").read_text()
    assert md.count("\n|") >= len(expected) + 1 and "| oracle | 93.75% |" in md
    png = (tmp_path / "accuracy.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
