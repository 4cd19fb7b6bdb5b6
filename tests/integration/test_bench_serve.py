"""`kvpop bench serve --quick`: the serving benchmark works end to end on its
own stack (it checks the benchmark, not a speed)."""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import grpc
import pytest

from kvpop.bench import serve as bench_serve
from kvpop.bench.loadgen import Stream, request
from kvpop.runtime.pb import generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.slow


def test_bench_serve_quick_writes_results_and_summary(tmp_path):
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    # Two stacks, one per layout (the default, and whole-block eviction), pools of the same memory.
    args = p.parse_args(["--quick", "--layouts", "1/16,16/16", "--out", str(tmp_path / "serve")])
    assert bench_serve.run(args) == 0
    out = tmp_path / "serve"
    both = json.loads((out / "results.json").read_text())["rows"]
    summary = json.loads((out / "summary.json").read_text())
    assert sorted((r["layout"], r["policy"]) for r in both) == [("1/16", "dense"), ("1/16", "learned"),
                                                                 ("16/16", "dense"), ("16/16", "learned")]
    assert set(summary["by_variant"]) == {"layout 1/16", "layout 16/16"}
    assert summary["throughput_ratio"] == summary["by_variant"]["layout 1/16"]["throughput_ratio"]
    assert summary["tokens_per_s_over_first"]["learned"]["layout 1/16"] == 1.0
    assert summary["tokens_per_s_over_first"]["learned"]["layout 16/16"] > 0
    assert "| learned | 16/16 |" in (out / "results.md").read_text()
    assert all(r["errors"] == 0 and r["requests"] == 8 for r in both), both
    rows = [r for r in both if r["layout"] == "1/16"]
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == 8, r
        assert r["output_tokens_per_s"] > 0 and r["peak_running"] >= 1 and r["peak_pages"] > 0, r
        assert isinstance(r["budget_shrinks"], int) and r["budget_shrinks"] >= 0, r   # polled from compute
    learned = next(r for r in rows if r["policy"] == "learned")
    dense = next(r for r in rows if r["policy"] == "dense")
    assert learned["network_share"] >= 0.99, learned
    # Every eviction is accounted: ranked by the network, or by someone else for a named reason.
    assert learned["network_evictions"] + sum(learned["not_network"].values()) == learned["evictions"] > 0, learned
    assert learned["peak_pages"] < dense["peak_pages"], (learned, dense)   # the budget holds less KV
    assert summary["throughput_ratio"] > 0 and summary["concurrency_ratio"] > 0, summary
    assert (out / "throughput.png").is_file() and (out / "latency_cdf.png").is_file()


def solution(text: str) -> list[str]:
    """The words up to and including the first end-of-solution mark (all: a solution still going)."""
    words = text.split()
    return words[: words.index(".") + 1] if "." in words else words


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
    # Greedy on both sides: the same solution, request by request, word for word up to the
    # end-of-solution mark. Past it (EOS ignored) the model runs on in text it was never trained
    # on, where near-ties fall differently in HF's left-padded fp32 batches and compute's kernels.
    outputs = [json.loads(x) for x in (tmp_path / "hf" / "outputs.jsonl").read_text().splitlines()]
    solutions = {p: [solution(o["text"]) for o in sorted(outputs, key=lambda o: o["request"]) if o["policy"] == p]
                 for p in ("hf", "dense")}
    assert len(solutions["hf"]) == len(solutions["dense"]) == 8 and all(solutions["dense"]), solutions
    for i, (a, b) in enumerate(zip(solutions["hf"], solutions["dense"])):
        assert a == b, (i, a, b)
    assert hf["accuracy"] == dense["accuracy"], (hf, dense)
    summary = json.loads((tmp_path / "hf" / "summary.json").read_text())
    assert summary["served_dense_over_hf"]["throughput_ratio"] > 0, summary


def _send(address: str, reqs, rate: float):
    """The finished streams, and a time just before the first arrival's clock started."""
    async def go():
        async with grpc.aio.insecure_channel(address) as ch:
            start = time.perf_counter()
            return await bench_serve.send(generate_pb2_grpc.KVpopStub(ch), reqs, rate, seed=3), start
    return asyncio.run(go())


@pytest.mark.parametrize("rate", [float("inf"), 40.0])
def test_async_client_times_every_token_of_every_request(stack, rate):
    # The benchmark's one-loop client on a real stack, many streams in flight: a token lost, counted
    # twice or stamped outside its request would change every throughput and latency it reports.
    n, tokens = 12, 24
    reqs = [request(generate_pb2, f"Request {i}: the quick brown fox jumps over the lazy dog.", "dense", None,
                    tokens) for i in range(n)]
    streams, start = _send(stack.gateway, reqs, rate)
    assert len(streams) == n
    for s in streams:
        assert s.error is None, s.error
        assert len(s.stamps) == tokens == s.usage.completion_tokens
        assert s.t0 <= s.stamps[0] and s.stamps == sorted(s.stamps) and s.stamps[-1] <= s.t_end
        assert 0 < s.ttft <= s.t_end - s.t0
        gaps = s.itls()
        assert len(gaps) == tokens - 1 and min(gaps) >= 0
    if rate != float("inf"):
        # Sent at the seeded Poisson arrivals, never early (late only by the loop's own delay).
        rng = random.Random(3)
        due = start
        for s in streams:
            due += rng.expovariate(rate)
            assert due - 0.001 <= s.t0 < due + 1.0, (s.t0 - start, due - start)


def test_async_client_text_equals_the_threaded_clients(stack, gateway):
    # Every chunk's text kept, in order: the same greedy request read both ways gives the same text.
    req = request(generate_pb2, "Compare: one request, two clients.", "dense", None, 32)
    threaded = Stream(gateway, req).start()
    threaded.thread.join()
    [one_loop], _ = _send(stack.gateway, [req], float("inf"))
    assert threaded.error is None and one_loop.error is None
    assert len(one_loop.stamps) == len(threaded.stamps) == 32
    assert "".join(one_loop.text) == "".join(threaded.text)
