"""`kvpop bench grpc --quick`: every hop (engine, asyncio, compute, gateway)
streams the same tokens count on its own stack (checks the benchmark, not a speed)."""
from __future__ import annotations

import argparse
import json

import pytest

from kvpop.bench import grpc_hops as bench_grpc
pytestmark = pytest.mark.slow


def test_bench_grpc_quick_measures_every_path(tmp_path):
    p = argparse.ArgumentParser()
    bench_grpc.add_arguments(p)
    args = p.parse_args(["--quick", "--json", str(tmp_path / "grpc.json")])
    assert bench_grpc.run(args) == 0
    res = json.loads((tmp_path / "grpc.json").read_text())
    assert [r["streams"] for r in res["rows"]] == [1, 2]
    for row in res["rows"]:
        # Every path delivered every token of every stream of every round (first gap excluded).
        gaps = row["streams"] * (res["new_tokens"] - 2) * res["repeats"]
        for path in bench_grpc.PATHS:
            assert row[path]["gaps"] == gaps, (path, row[path])
            assert row[path]["tokens_per_s"] > 0 and row[path]["itl_p50_ms"] > 0, (path, row[path])
        assert row["gateway"]["throughput_ratio"] > 0
