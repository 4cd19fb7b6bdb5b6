"""A real Prometheus, configured from deploy/monitoring/prometheus/prometheus.yml (the
compose config, targets pointed at this session's stack) with the shipped alert
rules loaded, scrapes the running services under a little load: every query of
the Grafana dashboard and every custom metric the HPAs scale on returns a series."""
from __future__ import annotations

import time
from urllib.parse import urlsplit

import pytest

from helpers.common import collect
from helpers.prometheus import Prometheus, dashboard_queries, hpa_queries, stack_config
from kvpop.runtime.pb import generate_pb2
from .stack_helpers import compute_info, wait_until


@pytest.fixture(scope="module")
def prometheus(stack):
    targets = {name: urlsplit(url).netloc for name, url in stack.metrics.items()}
    prom = Prometheus(stack_config(targets)).start()
    yield prom
    prom.stop()


def load(gateway) -> None:
    """A few streams of each kind the panels show: dense, a heuristic policy
    over its budget, and `learned` over its budget (plans from the cache-manager)."""
    for i, (policy, budget) in enumerate((("dense", 0), ("h2o", 64), ("learned", 64), ("learned", 64))):
        budgeted = {"budget_tokens": budget} if budget else {}
        _, _, final = collect(gateway.Generate(generate_pb2.GenerateRequest(
            prompt=f"scrape load {i} " * 20, max_tokens=120, ignore_eos=True, policy=policy,
            **budgeted), timeout=120))
        assert final.usage.completion_tokens == 120
        if budget:
            assert final.usage.kv_blocks_evicted > 0, policy


def test_dashboard_and_hpa_queries_return_series(stack, gateway, compute, prometheus):
    wait_until(lambda: len(prometheus.query('up{job="kvpop"} == 1')) == 3, 30,
               "Prometheus to scrape the three services")
    wait_until(lambda: compute_info(compute).advisor_connected, 20, "compute to reach the cache-manager")
    load(gateway)
    matchers = {"gateway": 'job="kvpop",component="gateway"', "compute": 'job="kvpop",component="compute"'}
    queries = {**dashboard_queries(), **hpa_queries(matchers)}
    assert any("HPA" in k for k in queries) and len(queries) > 15
    # Rates need two scrapes after the load; a few seconds at a 1 s interval.
    deadline = time.monotonic() + 30
    while True:
        empty = [k for k, q in queries.items() if not prometheus.query(q)]
        if not empty or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not empty, f"queries with no series: {empty}\n{prometheus.log()}"
    # The series carry real values: tokens flowed, every service reports ready.
    assert float(prometheus.query(queries["Tokens per second (compute) / generated"])[0]["value"][1]) > 0
    ready = prometheus.query('kvpop_service_ready{job="kvpop"}')
    assert {r["metric"]["component"]: r["value"][1] for r in ready} == \
        {"gateway": "1", "compute": "1", "cache-manager": "1"}
    # The rules loaded and evaluated without error.
    groups = prometheus.api("rules")["groups"]
    assert {g["name"] for g in groups} == {"kvpop.recording", "kvpop.alerts"}
    for g in groups:
        for rule in g["rules"]:
            assert rule["health"] in ("ok", "unknown"), rule
