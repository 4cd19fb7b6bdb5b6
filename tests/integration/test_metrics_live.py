"""What /metrics says, read from the real processes of the stack by deltas:
every client cancel counted once, a scrape that reflects the moment it is
made, and the eviction plans compute received, applied, found late or dropped."""
from __future__ import annotations

import secrets
import threading
import urllib.request

import grpc

from helpers.common import collect
from .stack_helpers import compute_info, wait_until
from kvpop.runtime.pb import generate_pb2

CANCELS = 8


def request(**kw) -> generate_pb2.GenerateRequest:
    kw.setdefault("prompt", "The quick brown fox jumps over the lazy dog.")
    return generate_pb2.GenerateRequest(**kw)


def scrape(stack, service: str) -> str:
    with urllib.request.urlopen(stack.metrics[service], timeout=5) as r:
        return r.read().decode()


def value(text: str, sample: str) -> float:
    """Sum of the samples whose name{labels...} starts with `sample`."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(sample) and not line.startswith("#"))


CANCELLED = 'kvpop_request_failure_total{reason="cancelled"}'


def test_every_client_cancel_counted_once(stack, gateway, compute):
    """Half the streams are session turns (the gateway reads their record before
    streaming), half plain; half are cancelled before their first token, half
    mid-stream; all from several threads at once, as clients do."""
    before = value(scrape(stack, "gateway"), CANCELLED)
    compute_before = value(scrape(stack, "compute"), CANCELLED)
    sid = f"cancels-{secrets.token_hex(3)}"
    calls = [gateway.Generate(request(prompt=f"cancel {i}", max_tokens=2000, ignore_eos=True, policy="h2o",
                                      budget_tokens=64, session_id=f"{sid}-{i}" if i % 2 else ""), timeout=120)
             for i in range(CANCELS)]
    for c in calls[CANCELS // 2:]:
        assert next(iter(c)).HasField("chunk")
    threads = [threading.Thread(target=c.cancel) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in calls:
        assert c.code() == grpc.StatusCode.CANCELLED
    wait_until(lambda: compute_info(compute).stats.running == 0, 20, "compute to drop the cancelled sequences")
    # The gateway counts as each call ends; give it the same deadline, then the count must be exact.
    wait_until(lambda: value(scrape(stack, "gateway"), CANCELLED) - before >= CANCELS, 10, "the cancels to count")
    assert value(scrape(stack, "gateway"), CANCELLED) - before == CANCELS
    assert value(scrape(stack, "gateway"), "kvpop_requests_in_flight") == 0
    # Compute sees each as the gateway's call to it cancelled: counted once there too.
    assert value(scrape(stack, "compute"), CANCELLED) - compute_before == CANCELS


def test_scrape_shows_the_moment_it_is_made(stack, gateway):
    """Right after a stream's final message, the very next scrape of the
    gateway and of compute counts its tokens: no refresh period to wait out."""
    before = {s: value(scrape(stack, s), "kvpop_generation_tokens_total") for s in ("gateway", "compute")}
    for n in (5, 9):
        _, _, final = collect(gateway.Generate(request(prompt=f"scrape {n}", max_tokens=n, ignore_eos=True,
                                                       policy="dense"), timeout=60))
        assert final.usage.completion_tokens == n
        for s in ("gateway", "compute"):
            now = value(scrape(stack, s), "kvpop_generation_tokens_total")
            assert now - before[s] == n, (s, now - before[s], n)
            before[s] = now


PLANS = ("kvpop_eviction_plans_received_total", "kvpop_eviction_plans_applied_total",
         "kvpop_eviction_plans_late_total", "kvpop_eviction_plans_dropped_total",
         "kvpop_eviction_plan_latency_seconds_count")


def test_request_kv_peak_observed_per_policy(stack, gateway):
    """Compute observes each finished request's peak KV (usage.kv_blocks_peak) by policy:
    the histogram's count and sum move by exactly that request's."""
    hist = 'kvpop_request_kv_peak_pages_{}{{policy="h2o"}}'
    before = {k: value(scrape(stack, "compute"), hist.format(k)) for k in ("count", "sum")}
    _, _, final = collect(gateway.Generate(request(prompt="peak " * 200, max_tokens=8, ignore_eos=True,
                                                   policy="h2o", budget_tokens=64), timeout=120))
    u = final.usage
    assert u.kv_blocks_resident < u.kv_blocks_peak, u
    text = scrape(stack, "compute")
    assert value(text, hist.format("count")) - before["count"] == 1
    assert value(text, hist.format("sum")) - before["sum"] == u.kv_blocks_peak


def test_eviction_plans_counted_on_both_sides(stack, gateway, compute):
    """A learned stream over its budget: the cache-manager sends plans, compute
    receives every one of them, times each, and evicts with them; every plan
    received is applied, late, dropped or was the sequence's last."""
    wait_until(lambda: compute_info(compute).advisor_connected, 20, "compute to reach the cache-manager")
    c0 = {m: value(scrape(stack, "compute"), m) for m in PLANS}
    sent0 = value(scrape(stack, "cache-manager"), "kvpop_eviction_plans_sent_total")
    scored0 = value(scrape(stack, "cache-manager"), "kvpop_scoring_latency_seconds_count")
    _, _, final = collect(gateway.Generate(request(prompt="plans", max_tokens=200, ignore_eos=True,
                                                   policy="learned", budget_tokens=64), timeout=120))
    assert final.usage.kv_blocks_evicted > 0

    def moved() -> dict:
        text = scrape(stack, "compute")
        return {m: value(text, m) - c0[m] for m in PLANS}
    # The sequence is gone once its final message is out; a plan still on the wire then counts as dropped.
    sent = wait_until(lambda: (n := value(scrape(stack, "cache-manager"), "kvpop_eviction_plans_sent_total")
                               - sent0) == moved()["kvpop_eviction_plans_received_total"] and n, 10,
                      "compute to receive every plan the cache-manager sent")
    d = moved()
    assert sent > 0 and d["kvpop_eviction_plans_applied_total"] > 0, d
    assert value(scrape(stack, "cache-manager"), "kvpop_scoring_latency_seconds_count") - scored0 == sent
    # Each received plan is answered to some features (a plan for a re-sent stream may not be timed).
    assert 0 < d["kvpop_eviction_plan_latency_seconds_count"] <= sent, d
    settled = (d["kvpop_eviction_plans_applied_total"] + d["kvpop_eviction_plans_late_total"]
               + d["kvpop_eviction_plans_dropped_total"])
    assert settled <= sent, d
