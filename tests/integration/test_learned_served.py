"""`learned` as served: a stack on the trained default model, whose shipped
estimator fits it, so the cache-manager's network (not its heuristic, not
compute's fallback) ranks the evicted blocks. Checked from the usage of every
stream and from compute's /metrics (deltas), under one stream and 16
concurrent ones, and across a cache-manager kill and restart."""
from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request

import grpc
import pytest

from kvpop.stack.up import restart_service, start_stack
from kvpop.stack.down import stop_stack
from kvpop.runtime.paths import DEFAULT_MODEL_DIR
from kvpop.runtime.pb import compute_pb2, compute_pb2_grpc, generate_pb2, generate_pb2_grpc
from kvpop.runtime.security import sync_channel
from kvpop.tasks import suite
from .stack_helpers import wait_until

pytestmark = pytest.mark.slow

ENV = {"KVPOP_GRACE_S": "2"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    st = start_stack(tmp_path_factory.mktemp("learned-stack"), model=str(DEFAULT_MODEL_DIR), env=ENV, timeout=120,
                     service_args={"compute": ["--device", "cpu"]}, supervise=False)   # kills by hand
    yield st
    stop_stack(st, grace=10)


@pytest.fixture(scope="module")
def gateway(served):
    with grpc.insecure_channel(served.gateway) as ch:
        yield generate_pb2_grpc.KVpopStub(ch)


def compute_info(st) -> compute_pb2.InfoResponse:
    with sync_channel(st.proc("compute").address, st.security()) as ch:
        return compute_pb2_grpc.ComputeStub(ch).Info(compute_pb2.InfoRequest(), timeout=5)


def learned_evictions(st) -> dict[tuple[str, str], float]:
    """compute's kvpop_kv_evicted_blocks_total{policy="learned"} by (source, reason)."""
    text = urllib.request.urlopen(st.metrics["compute"], timeout=5).read().decode()
    out = {}
    for m in re.finditer(r'^kvpop_kv_evicted_blocks_total\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels["policy"] == "learned":
            out[(labels["source"], labels["reason"])] = float(m.group(2))
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def prompts(n: int, seed: int, lo: int = 600, hi: int = 1280) -> list[str]:
    return [inst.prompt for inst in suite.test_set(n, None, seed, lo, hi)][:n]


def run(gateway, prompt: str, budget: float, max_tokens: int = 32, out: dict | None = None, key=None):
    req = generate_pb2.GenerateRequest(prompt=prompt, policy="learned", budget_fraction=budget,
                                       max_tokens=max_tokens, ignore_eos=True)
    final = None
    for msg in gateway.Generate(req, timeout=300):
        if msg.HasField("finished"):
            final = msg.finished
    if out is not None:
        out[key] = final
    return final


def network_share(usages) -> tuple[int, int]:
    return sum(u.network_evictions for u in usages), sum(u.kv_blocks_evicted for u in usages)


def wait_metrics(st, before: dict, evicted: int) -> dict:
    """/metrics is refreshed from engine stats once a second: wait for the delta to show all evictions."""
    got = {}

    def complete():
        nonlocal got
        got = delta(learned_evictions(st), before)
        return sum(got.values()) >= evicted
    wait_until(complete, 10, "the metrics to count the streams' evictions")
    return got


def test_network_decides_one_stream_and_16_concurrent(served, gateway):
    wait_until(lambda: compute_info(served).advisor_connected, 30, "compute to reach the cache-manager")
    # The shipped default network reads reach, and the cache-manager said so on the stream.
    extra = compute_info(served).stats.extra
    assert extra["advisor_inputs_heard"] >= 1 and extra["advisor_reads_reach"] == 1.0, dict(extra)
    before = learned_evictions(served)
    one = run(gateway, prompts(1, seed=11, lo=1150, hi=1250)[0], 0.25)
    net, ev = network_share([one.usage])
    assert one.usage.policy == "learned" and ev > 0, one.usage
    assert net >= 0.99 * ev, one.usage

    texts = prompts(16, seed=12)
    results: dict = {}
    threads = [threading.Thread(target=run, args=(gateway, p, (0.25, 0.125)[i % 2], 48, results, i))
               for i, p in enumerate(texts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(results) == list(range(16))
    net16, ev16 = network_share([r.usage for r in results.values()])
    print(f"\nlearned served: 1 stream {net}/{ev} blocks by the network; "
          f"16 concurrent streams {net16}/{ev16} ({100 * net16 / ev16:.2f}%)")
    assert ev16 > 0 and net16 >= 0.99 * ev16, [dict(r.usage.fallback_reasons) for r in results.values()]
    got = wait_metrics(served, before, ev + ev16)
    assert sum(got.values()) == ev + ev16, got
    assert got.get(("network", ""), 0) >= 0.99 * (ev + ev16), got


def test_cache_manager_killed_then_restarted(served, gateway):
    """Killed mid-stream: the stream finishes within budget on the fallback
    (reason advisor_down, visible in /metrics); restarted: compute reconnects
    within 2 s of SERVING and the network decides again (>= 99%)."""
    wait_until(lambda: compute_info(served).advisor_connected, 30, "compute to reach the cache-manager")
    before = learned_evictions(served)
    # network_evictions is cumulative over the stack's life: this stream's first plan is a rise from here.
    planned_before = compute_info(served).stats.extra.get("network_evictions", 0)
    text = prompts(1, seed=13, lo=1150, hi=1250)[0]
    out: dict = {}
    t = threading.Thread(target=run, args=(gateway, text, 0.25, 400, out, "killed"))
    t.start()
    wait_until(lambda: compute_info(served).stats.extra.get("network_evictions", 0) > planned_before
               or not t.is_alive(), 60, "the stream's first network plan")
    assert t.is_alive(), "the stream finished before the kill"
    os.killpg(served.proc("cache-manager").pid, signal.SIGKILL)
    t.join(300)
    u = out["killed"].usage
    assert u.completion_tokens == 400 and u.kv_blocks_evicted > 0, u
    assert u.network_evictions > 0, u      # the network planned for this stream before the kill
    assert u.fallback_reasons.get("advisor_down", 0) > 0, u
    m = compute_info(served).model
    # The budget, a few protected blocks, and the round slack (one page less one block).
    assert u.kv_blocks_resident <= (int(0.25 * (len(text.split()) + 401)) // m.block_size + 3
                                    + m.page_size // m.block_size - 1) * m.num_layers * m.num_kv_heads, u
    got = wait_metrics(served, before, u.kv_blocks_evicted)
    assert got.get(("fallback", "advisor_down"), 0) > 0, got
    assert not compute_info(served).advisor_connected

    restart_service(served, "cache-manager", env=ENV)
    t0 = time.monotonic()
    wait_until(lambda: compute_info(served).advisor_connected, 10, "compute to reconnect")
    reconnect_s = time.monotonic() - t0
    after = run(gateway, text, 0.25)
    print(f"\ncache-manager restart: compute reconnected {reconnect_s:.2f} s after SERVING; next stream "
          f"{after.usage.network_evictions}/{after.usage.kv_blocks_evicted} blocks by the network")
    assert reconnect_s <= 2.0
    assert after.usage.network_evictions >= 0.99 * after.usage.kv_blocks_evicted > 0, after.usage


def test_eval_via_the_gateway_measures_what_is_served(served, tmp_path):
    """`kvpop eval --via`: the eval's prompts through the running stack; the
    learned rows come with who ranked the evictions (the network, here)."""
    import argparse
    import json

    from kvpop.evaluation.cli import add_arguments, run as run_eval
    wait_until(lambda: compute_info(served).advisor_connected, 30, "compute to reach the cache-manager")
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "via"
    args = p.parse_args(["--via", served.gateway, "--quick", "--policies", "dense,oracle,learned,learned+prefill2x,h2o",
                         "--compression", "0.75", "--out", str(out)])
    assert run_eval(args) == 0
    rows = json.loads((out / "results.json").read_text())
    meta = json.loads((out / "meta.json").read_text())
    got = {(r["policy"], r["task"]) for r in rows}
    assert {("dense", "all"), ("learned", "all"), ("h2o", "all")} <= got and ("oracle", "all") not in got
    assert all(r["n"] == 4 for r in rows if r["task"] == "all")
    for label in ("learned", "learned+prefill2x"):     # the label's allowance went out as prefill_allowance
        d = meta["decisions"][f"{label}@0.75"]
        assert d["evicted"] > 0 and d["network"] >= 0.99 * d["evicted"], d
    assert meta["block_size"] == compute_info(served).model.block_size and (out / "accuracy.png").is_file()
    lines = [json.loads(x) for x in (out / "outcomes.jsonl").read_text().splitlines()]
    assert len(lines) == 4 * 4 and all(x["peak_kv_mib"] > 0 and not x.get("error") for x in lines)
    # The same prompts in process: the same text (as compute streams it), KV held and peak, line for line.
    here = tmp_path / "here"
    args = p.parse_args(["--quick", "--policies", "dense,learned,learned+prefill2x,h2o", "--compression", "0.75",
                         "--block-size", str(meta["block_size"]), "--no-kl", "--threads", "1", "--out", str(here)])
    assert run_eval(args) == 0
    key = ("policy", "compression", "family", "seed")
    mine = {tuple(x[k] for k in key): x for x in map(json.loads, (here / "outcomes.jsonl").read_text().splitlines())}
    assert len(mine) == len(lines)
    for x in lines:
        y = mine[tuple(x[k] for k in key)]
        assert (x["text"], x["held_tokens"], x["peak_kv_mib"]) == (y["text"], y["held_tokens"], y["peak_kv_mib"]), (x, y)


def test_eval_via_goes_on_past_a_refused_request(served):
    """A request the stack refuses (here a prompt past the model's 4,096-token
    length) is that request's result, with its status; the others still run."""
    import dataclasses

    from kvpop.evaluation.harness import Setting
    from kvpop.evaluation.served import ServedHarness

    good = suite.test_set(1, ["passkey", "registers"], 5, 200, 300)[:2]
    too_long = dataclasses.replace(good[0], prompt=" ".join([good[0].prompt] * 40))
    harness = ServedHarness(served.gateway)
    try:
        outcomes = harness.run([Setting("dense", 0.0)], [good[0], too_long, good[1]])
    finally:
        harness.close()
    by_prompt = {id(o.instance): o for o in outcomes}
    refused = by_prompt[id(too_long)]
    assert refused.error.split(":")[0] in ("RESOURCE_EXHAUSTED", "INVALID_ARGUMENT") and not refused.correct
    assert "4096" in refused.error, refused.error
    assert all(not by_prompt[id(g)].error and by_prompt[id(g)].correct for g in good), outcomes
