"""Prometheus metrics of one kvpop process, and the HTTP server for them.

Names follow vLLM's and TGI's metrics with Prometheus conventions (`kvpop_`
prefix, base units, `_total` counters); docs/reference/metrics.md lists every
series and who sets it (a test keeps the two in step).

A plan received is applied, late, dropped, or still pending when its sequence
ends (no round needed it): the four do not have to add up to the received.
Compute's engine counts reach Prometheus when `/metrics` is scraped (read from
the engine then, not by a periodic copy), so a scrape shows the moment it is made.

Each process has one registry (`get_metrics()`); `start_metrics_server` serves
it at `/metrics`, a readiness probe at `/healthz` (200 when the `ready`
callable says so, else 503; the body lists every health name) and a liveness
probe at `/livez` on one small HTTP server thread.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Mapping

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, Histogram, GCCollector, PlatformCollector, ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)

# `*_created` series double the scrape size and no dashboard of ours reads them.
disable_created_metrics()

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 60.0, 120.0, 300.0)
PLAN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# KV pages (blocks x layers x kv-heads): a few rows of a short prompt up to SmolLM2's 8k x 90 rows.
KV_PAGE_BUCKETS = tuple(4 ** k for k in range(3, 12))
SCORING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, process_collectors: bool = True):
        r = self.registry = registry if registry is not None else CollectorRegistry()
        if process_collectors:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)
        self.ttft = Histogram("kvpop_time_to_first_token_seconds",
                              "Time from request arrival to its first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("kvpop_inter_token_latency_seconds",
                             "Time between consecutive tokens of one stream.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("kvpop_e2e_request_latency_seconds",
                             "Time from request arrival to its last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.in_flight = Gauge("kvpop_requests_in_flight", "Streams open on this process.",
                               registry=r)
        self.success = Counter("kvpop_request_success", "Requests that finished.",
                               ["finish_reason"], registry=r)
        self.failure = Counter("kvpop_request_failure", "Requests that failed.",
                               ["reason"], registry=r)
        self.prompt_tokens = Counter("kvpop_prompt_tokens", "Prompt tokens processed.",
                                     registry=r)
        self.generation_tokens = Counter("kvpop_generation_tokens", "Tokens generated.",
                                         registry=r)
        self.running = Gauge("kvpop_num_requests_running", "Sequences in the running batch.",
                             registry=r)
        self.waiting = Gauge("kvpop_num_requests_waiting", "Sequences waiting for admission.",
                             registry=r)
        self.pages_used = Gauge("kvpop_kv_pool_pages_used", "KV pool pages held by sequences.",
                                registry=r)
        self.pages_free = Gauge("kvpop_kv_pool_pages_free", "KV pool pages free.", registry=r)
        self.pages_total = Gauge("kvpop_kv_pool_pages_total", "KV pool pages in all.",
                                 registry=r)
        self.evictions = Counter("kvpop_kv_evictions", "KV blocks evicted, by policy.",
                                 ["policy"], registry=r)
        self.fallback_evictions = Counter(
            "kvpop_kv_fallback_evictions",
            "KV blocks evicted by the local fallback because no plan came in time.", registry=r)
        self.evicted_blocks = Counter(
            "kvpop_kv_evicted_blocks", "KV blocks evicted, by policy and by what ranked them.",
            ["policy", "source", "reason"], registry=r)
        self.kv_peak = Histogram("kvpop_request_kv_peak_pages",
                                 "Most KV blocks a finished request held at once, summed over its rows (its "
                                 "Usage.kv_blocks_peak), by policy: a budget held during prefill keeps it near "
                                 "budget + one chunk.",
                                 ["policy"], buckets=KV_PAGE_BUCKETS, registry=r)
        self.held = Gauge("kvpop_learned_sequences_held",
                          "Learned sequences held (alone) waiting for their eviction plan.", registry=r)
        self.prefix_queries = Counter("kvpop_prefix_cache_queries",
                                      "Requests looked up in the prefix cache.", registry=r)
        self.prefix_hits = Counter("kvpop_prefix_cache_hits",
                                   "Requests that reused a cached prefix.", registry=r)
        self.scoring_latency = Histogram("kvpop_scoring_latency_seconds",
                                         "Time of one scoring round in the cache-manager.",
                                         buckets=SCORING_BUCKETS, registry=r)
        self.plans_received = Counter("kvpop_eviction_plans_received",
                                      "Eviction plans compute received from the cache-manager.", registry=r)
        self.plans_applied = Counter("kvpop_eviction_plans_applied",
                                     "Eviction plans compute evicted with (each plan once).", registry=r)
        self.plans_late = Counter(
            "kvpop_eviction_plans_late",
            "Eviction plans never applied because they came late: superseded (a newer plan for the sequence "
            "came first) or stale (it ranks fewer blocks than the sequence had sent since).",
            ["reason"], registry=r)
        self.plans_dropped = Counter(
            "kvpop_eviction_plans_dropped",
            "Eviction plans compute could not use: finished (the request had ended), malformed_plan, "
            "shape_mismatch.", ["reason"], registry=r)
        self.plan_latency = Histogram("kvpop_eviction_plan_latency_seconds",
                                      "Compute: from sending a sequence's block features to receiving "
                                      "the plan that answers them.", buckets=PLAN_BUCKETS, registry=r)
        self.plans_sent = Counter("kvpop_eviction_plans_sent",
                                  "Eviction plans the cache-manager computed and sent, by the network that "
                                  "ranked them (checkpoint file name, or heuristic).", ["estimator"], registry=r)
        self.budget_shrinks = Counter(
            "kvpop_budget_shrinks", "KV budgets the scheduler shrank to admit more requests (pool pressure).",
            registry=r)
        self.ready = Gauge("kvpop_service_ready", "1 while this process is ready (/healthz 200), else 0.",
                           registry=r)
        self.info = Gauge("kvpop_service_info", "Constant 1, labelled with the service.",
                          ["service", "version"], registry=r)
        # Last cumulative values seen in engine.stats(): counters advance by deltas.
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._on_scrape: list[Callable[[], None]] = []

    def on_scrape(self, hook: Callable[[], None]) -> None:
        """Run `hook` at every scrape, before the registry is read, so a scrape
        shows the state at that moment rather than at the last periodic refresh."""
        self._on_scrape.append(hook)

    def exposition(self, accept: str | None = None) -> tuple[bytes, str]:
        """(body, content type) of one scrape."""
        for hook in self._on_scrape:
            try:
                hook()
            except Exception as e:  # noqa: BLE001 — a scrape still answers, with the last values
                log.warning("metrics scrape hook failed: %s", e)
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    def refresh_engine_on_scrape(self, stats: Callable[[], Mapping], timeout_s: float = 1.0) -> None:
        """Copy `stats()` in at every scrape. It may wait for an engine step, so
        it runs on its own thread: past `timeout_s` (engine stuck) the scrape
        answers with the values of the last refresh rather than hang."""
        def hook() -> None:
            box: dict = {}
            t = threading.Thread(target=lambda: box.setdefault("stats", stats()), name="metrics-stats",
                                 daemon=True)
            t.start()
            t.join(timeout_s)
            if "stats" not in box:
                raise TimeoutError(f"engine stats took over {timeout_s} s")
            self.refresh_engine(box["stats"])
        self.on_scrape(hook)

    def request(self) -> "RequestTimer":
        return RequestTimer(self)

    def refresh_engine(self, stats: Mapping) -> None:
        """Copy `engine.stats()` into the gauges and advance the counters.

        Cumulative engine counts (`evictions` by policy, `fallback_evictions`,
        `prompt_tokens`, `generated_tokens`, `prefix_cache_queries`,
        `prefix_cache_hits`, `budget_shrinks`) become counter increments; a count that went down
        (engine rebuilt, a live sequence's count dropped on abort) becomes the
        new baseline, so the counter never overcounts. Missing keys are left
        alone, so an engine that does not report something simply exports no
        change."""
        gauges = {"pages_used": self.pages_used, "pages_free": self.pages_free,
                  "pages_total": self.pages_total, "running": self.running,
                  "waiting": self.waiting, "held_for_plan": self.held}
        for key, gauge in gauges.items():
            if key in stats:
                gauge.set(stats[key])
        with self._lock:
            for key, counter in (("fallback_evictions", self.fallback_evictions),
                                 ("prompt_tokens", self.prompt_tokens),
                                 ("generated_tokens", self.generation_tokens),
                                 ("prefix_cache_queries", self.prefix_queries),
                                 ("prefix_cache_hits", self.prefix_hits),
                                 ("plans_applied", self.plans_applied),
                                 ("budget_shrinks", self.budget_shrinks)):
                if key in stats:
                    self._advance(key, stats[key], counter)
            for policy, count in (stats.get("evictions") or {}).items():
                self._advance(f"evictions/{policy}", count, self.evictions.labels(policy=policy))
            for key, counter in (("plans_late", self.plans_late), ("plans_dropped", self.plans_dropped)):
                for reason, count in (stats.get(key) or {}).items():
                    self._advance(f"{key}/{reason}", count, counter.labels(reason=reason))
            for (policy, source, reason), count in (stats.get("evictions_by_source") or {}).items():
                self._advance(f"evicted/{policy}/{source}/{reason}", count,
                              self.evicted_blocks.labels(policy=policy, source=source, reason=reason))

    def _advance(self, key: str, value: float, counter) -> None:
        last = self._seen.get(key, 0.0)
        if value > last:
            counter.inc(value - last)
        self._seen[key] = value


class EngineStatsRefresher:
    """Copies `stats()` into the metrics every `period_s` from an asyncio task
    (for whatever reads `last` between scrapes; a scrape itself refreshes:
    `Metrics.refresh_engine_on_scrape`).

    `stats` runs in a worker thread (it may wait for an engine step); the last
    result stays in `last` for others (the replica heartbeat's load)."""

    def __init__(self, stats: Callable[[], Mapping], metrics: Metrics | None = None,
                 period_s: float = 1.0):
        self.stats = stats
        self.metrics = metrics or get_metrics()
        self.period_s = period_s
        self.last: Mapping = {}
        self._task: asyncio.Task | None = None

    async def refresh(self) -> Mapping:
        self.last = await asyncio.to_thread(self.stats)
        self.metrics.refresh_engine(self.last)
        return self.last

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001 — metrics must never take the service down
                log.warning("engine stats refresh failed: %s", e)
            await asyncio.sleep(self.period_s)

    def start(self) -> "EngineStatsRefresher":
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-metrics")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


class RequestTimer:
    """Per-stream latency bookkeeping: call `token()` per streamed token (or
    chunk), then `finish()` or `fail()` exactly once."""

    def __init__(self, metrics: Metrics):
        self.m = metrics
        self.start = time.perf_counter()
        self.last: float | None = None
        self.done = False
        metrics.in_flight.inc()

    def token(self, n: int = 1) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.m.ttft.observe(now - self.start)
        else:
            # A chunk of n tokens spreads its gap evenly, as vLLM's ITL does.
            gap = (now - self.last) / max(1, n)
            for _ in range(max(1, n)):
                self.m.itl.observe(gap)
        self.last = now

    def finish(self, finish_reason: str, prompt_tokens: int | None = None,
               completion_tokens: int | None = None) -> None:
        """Pass token counts only where no engine stats export them (the gateway)."""
        if self._close():
            self.m.e2e.observe(time.perf_counter() - self.start)
            self.m.success.labels(finish_reason=finish_reason or "unknown").inc()
            if prompt_tokens:
                self.m.prompt_tokens.inc(prompt_tokens)
            if completion_tokens:
                self.m.generation_tokens.inc(completion_tokens)

    def fail(self, reason: str) -> None:
        if self._close():
            self.m.failure.labels(reason=reason or "unknown").inc()

    def _close(self) -> bool:
        if self.done:
            return False
        self.done = True
        self.m.in_flight.dec()
        return True


_metrics: Metrics | None = None
_metrics_lock = threading.Lock()


def get_metrics() -> Metrics:
    """The process-wide Metrics (created on first use)."""
    global _metrics
    with _metrics_lock:
        if _metrics is None:
            _metrics = Metrics()
        return _metrics


class MetricsServer:
    """`/metrics` and `/healthz` on a daemon thread; `port` is the bound port."""

    def __init__(self, httpd: ThreadingHTTPServer, thread: threading.Thread):
        self.httpd = httpd
        self.thread = thread
        self.host, self.port = httpd.server_address[:2]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def start_metrics_server(port: int, host: str = "127.0.0.1",
                         ready: Callable[[], bool] | None = None,
                         metrics: Metrics | None = None,
                         service: str | None = None, version: str = "",
                         live: Callable[[], bool] | None = None,
                         details: Callable[[], Mapping[str, bool]] | None = None,
                         token: str | None = None) -> MetricsServer:
    """Serve `metrics` (default: the process's) on host:port (0 = any free port).

    ready: readiness probe for `/healthz`; None means "ready while the process
    runs" (liveness only). An exception inside it counts as not ready.
    live: liveness probe for `/livez` (None: alive while this thread answers).
    details: health name -> serving, listed in the body of `/healthz`.
    token: `/metrics` then needs `Authorization: Bearer <token>` (401 without);
    the probes stay open, as grpc.health.v1 does, so orchestrators need no secret."""
    expected = f"Bearer {token}".encode() if token else None
    m = metrics or get_metrics()
    if service:
        if not version:
            from importlib.metadata import PackageNotFoundError, version as pkg_version
            try:
                version = pkg_version("kvpop-serving")
            except PackageNotFoundError:
                version = "dev"
        m.info.labels(service=service, version=version).set(1)

    def probe_ok(probe: Callable[[], bool] | None) -> bool:
        try:
            return True if probe is None else bool(probe())
        except Exception:  # noqa: BLE001 — a broken probe is "not ready", not a 500
            return False

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 — http.server's naming
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                if expected is not None and not hmac.compare_digest(
                        self.headers.get("Authorization", "").encode(), expected):
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Bearer realm="kvpop metrics"')
                    body = b"unauthorized: /metrics needs the bearer token (KVPOP_METRICS_TOKEN)\n"
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                # Readiness as a series, so an alert can see a replica that is up but not serving.
                m.ready.set(1 if probe_ok(ready) else 0)
                body, content_type = m.exposition(self.headers.get("Accept"))
                self._send(200, body, content_type)
            elif path in ("/healthz", "/livez"):
                ok = probe_ok(ready if path == "/healthz" else live)
                body = "ok\n" if ok else ("not ready\n" if path == "/healthz" else "not live\n")
                if path == "/healthz" and details is not None:
                    try:
                        names = sorted(details().items())
                    except Exception:  # noqa: BLE001
                        names = []
                    body += "".join(f"{n or '(server)'}: {'SERVING' if v else 'NOT_SERVING'}\n" for n, v in names)
                self._send(200 if ok else 503, body.encode(), "text/plain")
            else:
                self._send(404, b"not found: try /metrics, /healthz or /livez\n", "text/plain")

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass  # scrapes every few seconds would drown the service log

    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread)
