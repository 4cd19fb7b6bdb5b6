"""Prometheus metrics: names, engine-stats refresh, request timing, and the
real /metrics and /healthz HTTP endpoints."""
from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpop.runtime.metrics import EngineStatsRefresher, Metrics, get_metrics, start_metrics_server

REQUIRED = [
    "kvpop_time_to_first_token_seconds", "kvpop_inter_token_latency_seconds",
    "kvpop_e2e_request_latency_seconds", "kvpop_prompt_tokens_total",
    "kvpop_generation_tokens_total", "kvpop_num_requests_running", "kvpop_num_requests_waiting",
    "kvpop_kv_pool_pages_used", "kvpop_kv_pool_pages_free", "kvpop_kv_evictions_total",
    "kvpop_kv_fallback_evictions_total", "kvpop_prefix_cache_queries_total",
    "kvpop_prefix_cache_hits_total", "kvpop_scoring_latency_seconds",
    "kvpop_request_success_total", "kvpop_request_failure_total",
]


def scrape(url: str) -> tuple[dict[str, float], set[str]]:
    """(sample name{labels} -> value, declared metric names), from a real HTTP GET."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        body = resp.read().decode()
    declared = {line.split()[2] for line in body.splitlines() if line.startswith("# TYPE ")}
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out, declared


def test_refresh_engine_sets_gauges_and_advances_counters():
    m = Metrics(process_collectors=False)
    stats = {"pages_used": 40, "pages_free": 60, "pages_total": 100, "running": 3, "waiting": 1,
             "evictions": {"h2o": 12, "learned": 5}, "fallback_evictions": 2,
             "prompt_tokens": 300, "generated_tokens": 50,
             "prefix_cache_queries": 10, "prefix_cache_hits": 9, "budget_shrinks": 2}
    m.refresh_engine(stats)
    m.refresh_engine(stats)   # same cumulative values: counters must not double
    reg = m.registry
    assert reg.get_sample_value("kvpop_kv_pool_pages_used") == 40
    assert reg.get_sample_value("kvpop_num_requests_waiting") == 1
    assert reg.get_sample_value("kvpop_kv_evictions_total", {"policy": "h2o"}) == 12
    assert reg.get_sample_value("kvpop_generation_tokens_total") == 50
    assert reg.get_sample_value("kvpop_budget_shrinks_total") == 2
    stats.update(pages_used=10, pages_free=90, running=0, generated_tokens=80,
                 evictions={"h2o": 20, "learned": 5, "snapkv": 1}, prefix_cache_hits=10)
    m.refresh_engine(stats)
    assert reg.get_sample_value("kvpop_kv_pool_pages_used") == 10
    assert reg.get_sample_value("kvpop_num_requests_running") == 0
    assert reg.get_sample_value("kvpop_kv_evictions_total", {"policy": "h2o"}) == 20
    assert reg.get_sample_value("kvpop_kv_evictions_total", {"policy": "snapkv"}) == 1
    assert reg.get_sample_value("kvpop_generation_tokens_total") == 80
    assert reg.get_sample_value("kvpop_prefix_cache_hits_total") == 10
    # A count that goes down (engine rebuilt) is the new baseline: no overcount,
    # and counting resumes from there.
    m.refresh_engine({"generated_tokens": 7})
    assert reg.get_sample_value("kvpop_generation_tokens_total") == 80
    m.refresh_engine({"generated_tokens": 10})
    assert reg.get_sample_value("kvpop_generation_tokens_total") == 83
    # Keys an engine does not report are left alone.
    m.refresh_engine({})
    assert reg.get_sample_value("kvpop_kv_pool_pages_free") == 90


def test_request_timer_observes_ttft_itl_e2e_once():
    m = Metrics(process_collectors=False)
    reg = m.registry
    t = m.request()
    assert reg.get_sample_value("kvpop_requests_in_flight") == 1
    time.sleep(0.02)
    t.token()
    for _ in range(3):
        time.sleep(0.005)
        t.token()
    t.finish("length", prompt_tokens=12, completion_tokens=4)
    t.finish("length")          # a second close is ignored
    t.fail("INTERNAL")
    assert reg.get_sample_value("kvpop_requests_in_flight") == 0
    assert reg.get_sample_value("kvpop_time_to_first_token_seconds_count") == 1
    assert reg.get_sample_value("kvpop_time_to_first_token_seconds_sum") >= 0.02
    assert reg.get_sample_value("kvpop_inter_token_latency_seconds_count") == 3
    assert reg.get_sample_value("kvpop_inter_token_latency_seconds_sum") >= 0.015
    assert reg.get_sample_value("kvpop_e2e_request_latency_seconds_count") == 1
    assert reg.get_sample_value("kvpop_request_success_total", {"finish_reason": "length"}) == 1
    assert reg.get_sample_value("kvpop_request_failure_total", {"reason": "INTERNAL"}) is None
    assert reg.get_sample_value("kvpop_prompt_tokens_total") == 12
    f = m.request()
    f.fail("UNAVAILABLE")
    assert reg.get_sample_value("kvpop_request_failure_total", {"reason": "UNAVAILABLE"}) == 1
    assert reg.get_sample_value("kvpop_e2e_request_latency_seconds_count") == 1


def test_http_endpoint_serves_metrics_and_readiness():
    m = Metrics()
    ready = {"ok": False}
    server = start_metrics_server(0, "127.0.0.1", ready=lambda: ready["ok"], metrics=m,
                                  service="compute")
    base = f"http://127.0.0.1:{server.port}"
    try:
        m.refresh_engine({"pages_used": 5, "pages_free": 7, "evictions": {"tova": 3}})
        m.scoring_latency.observe(0.002)
        samples, declared = scrape(base + "/metrics")
        assert set(REQUIRED) <= declared, set(REQUIRED) - declared
        assert not any(n.endswith("_created") for n in declared)
        assert samples["kvpop_kv_pool_pages_used"] == 5
        assert samples["kvpop_kv_evictions_total{policy=tova}"] == 3
        assert samples["kvpop_scoring_latency_seconds_count"] == 1
        assert any(k.startswith("kvpop_service_info{service=compute") for k in samples)
        assert "process_resident_memory_bytes" in samples

        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/healthz", timeout=5)
        assert e.value.code == 503
        # Readiness is also a series, read at the scrape (alerts see "up but not ready").
        assert samples["kvpop_service_ready"] == 0
        ready["ok"] = True
        with urllib.request.urlopen(base + "/healthz", timeout=5) as resp:
            assert resp.status == 200
        assert scrape(base + "/metrics")[0]["kvpop_service_ready"] == 1
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/nope", timeout=5)
        assert e.value.code == 404

        # The probe command used by compose sees the same thing.
        probe = [sys.executable, "-m", "kvpop.runtime.healthcheck", "--http", base + "/healthz"]
        assert subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
        ready["ok"] = False
        assert subprocess.run(probe, capture_output=True, timeout=30).returncode == 1
    finally:
        server.close()


def test_broken_readiness_probe_is_not_ready():
    def boom():
        raise RuntimeError("engine gone")
    server = start_metrics_server(0, ready=boom, metrics=Metrics(process_collectors=False))
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5)
        assert e.value.code == 503
    finally:
        server.close()


def test_refresher_polls_stats_in_the_background():
    import asyncio
    import threading

    m = Metrics(process_collectors=False)
    calls = []

    def stats():
        calls.append(threading.current_thread().name)
        return {"pages_used": len(calls), "running": 2, "waiting": 1}

    async def go():
        r = EngineStatsRefresher(stats, metrics=m, period_s=0.02).start()
        deadline = time.monotonic() + 5
        while len(calls) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await r.stop()
        return r.last
    last = asyncio.run(go())
    assert len(calls) >= 3 and last["running"] == 2
    # stats() ran off the event loop thread: an engine step cannot stall the server.
    assert threading.main_thread().name not in calls
    assert m.registry.get_sample_value("kvpop_kv_pool_pages_used") == last["pages_used"]


def test_process_registry_is_a_singleton():
    assert get_metrics() is get_metrics()
    assert get_metrics().registry.get_sample_value("kvpop_requests_in_flight") is not None


def test_scrape_reads_engine_stats_at_that_moment():
    """Each scrape shows the engine as it is then (no periodic copy to wait
    for); a stuck engine makes the scrape answer late with its last values,
    never hang; plan counters advance by deltas like the others."""
    import threading

    m = Metrics(process_collectors=False)
    state = {"generated_tokens": 0, "pages_used": 0, "plans_applied": 0, "plans_late": {}}
    stuck = threading.Event()

    def stats():
        if stuck.is_set():
            time.sleep(3)       # an engine step that does not end
        return dict(state)
    m.refresh_engine_on_scrape(stats, timeout_s=0.5)
    server = start_metrics_server(0, metrics=m)
    url = f"http://127.0.0.1:{server.port}/metrics"
    try:
        for n in (1, 5, 6):
            state.update(generated_tokens=n, pages_used=2 * n, plans_applied=n, plans_late={"stale": n - 1})
            samples, declared = scrape(url)
            assert samples["kvpop_generation_tokens_total"] == n and samples["kvpop_kv_pool_pages_used"] == 2 * n
            assert samples["kvpop_eviction_plans_applied_total"] == n
            assert samples["kvpop_eviction_plans_late_total{reason=stale}"] == n - 1
        assert {"kvpop_eviction_plans_received_total", "kvpop_eviction_plans_dropped_total",
                "kvpop_eviction_plan_latency_seconds", "kvpop_eviction_plans_sent_total"} <= declared
        stuck.set()
        state["generated_tokens"] = 99
        t0 = time.monotonic()
        samples, _ = scrape(url)
        assert time.monotonic() - t0 < 2.5 and samples["kvpop_generation_tokens_total"] == 6
    finally:
        server.close()


def test_metrics_bearer_token():
    """With a token, /metrics answers 401 to a scrape without it or with a wrong
    one; the probes stay open (an orchestrator needs no secret for them)."""
    server = start_metrics_server(0, metrics=Metrics(process_collectors=False), token="s3cret")
    base = f"http://127.0.0.1:{server.port}"
    try:
        for auth in (None, "Bearer wrong", "s3cret", "Bearer s3cret2"):
            req = urllib.request.Request(base + "/metrics", headers={"Authorization": auth} if auth else {})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=5)
            assert e.value.code == 401 and e.value.headers["WWW-Authenticate"].startswith("Bearer"), auth
        req = urllib.request.Request(base + "/metrics", headers={"Authorization": "Bearer s3cret"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert resp.status == 200 and b"kvpop_request_failure_total" in resp.read()
        for probe in ("/healthz", "/livez"):
            with urllib.request.urlopen(base + probe, timeout=5) as resp:
                assert resp.status == 200
    finally:
        server.close()


def test_service_metrics_on_loopback_with_token(tmp_path):
    """A real cache-manager process with its gRPC on every interface but
    KVPOP_METRICS_HOST=127.0.0.1 and KVPOP_METRICS_TOKEN: /metrics is on
    loopback only and needs the token."""
    import os
    import socket

    from helpers.common import REPO, free_port, wait_until

    port, mport = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOP_", "OTEL_"))}
    env.update(OTEL_TRACES_EXPORTER="none", PYTHONPATH=str(REPO), KVPOP_HOST="0.0.0.0",
               KVPOP_METRICS_HOST="127.0.0.1", KVPOP_METRICS_PORT=str(mport), KVPOP_METRICS_TOKEN="t0ken")
    log = open(tmp_path / "cm.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "services.cache_manager", "--port", str(port)], env=env,
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{mport}"

    def live():
        assert proc.poll() is None, (tmp_path / "cm.log").read_text()[-2000:]
        try:
            return urllib.request.urlopen(base + "/livez", timeout=2).status == 200
        except OSError:
            return False
    try:
        wait_until(live, 60, "the cache-manager's /livez")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/metrics", timeout=5)
        assert e.value.code == 401
        req = urllib.request.Request(base + "/metrics", headers={"Authorization": "Bearer t0ken"})
        assert b"kvpop_service_info" in urllib.request.urlopen(req, timeout=5).read()
        # Bound to loopback alone: another local address of this host does not answer.
        other = socket.gethostbyname(socket.gethostname())
        if not other.startswith("127."):
            with pytest.raises(OSError):
                socket.create_connection((other, mport), timeout=2).close()
        with open(f"/proc/{proc.pid}/net/tcp") as f:     # the listener's local address, in hex
            listening = [line.split()[1] for line in f.readlines()[1:] if line.split()[3] == "0A"]
        assert f"0100007F:{mport:04X}" in listening and f"00000000:{mport:04X}" not in listening
    finally:
        proc.terminate()
        proc.wait(15)
        log.close()
