"""Load: 64 concurrent streams over loopback, back to back, for a bounded
count and time. No stream may fail, and once the load is gone the KV pool
holds exactly what it held before (no leaked pages)."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from .reliability_stack import collect, request, wait_until
from kvpop.runtime.pb import generate_pb2_grpc

pytestmark = pytest.mark.slow

STREAMS = 64            # concurrent workers, one open stream each
ROUNDS = 6              # at most this many requests per worker ...
START_FOR_S = 15.0      # ... and none started after this many seconds
MAX_TOKENS = 32
CHANNELS = 8            # several connections from one host: one client for the stream limit


def _make(i: int, r: int):
    policy = ("dense", "h2o", "learned", "streaming")[i % 4]
    budget = {} if policy == "dense" else {"budget_tokens": 64}
    return request(prompt=f"worker {i} round {r}: " + "lorem ipsum " * (i % 7 + 2), max_tokens=MAX_TOKENS,
                   ignore_eos=True, policy=policy, **budget)


def test_64_concurrent_streams_no_errors_no_leaked_pages(secure_stack):
    stats = wait_until(lambda: (s := secure_stack.compute_info().stats).running == 0 and s.waiting == 0 and s,
                       60, "compute to be idle")
    idle = secure_stack.pool_idle()
    channels = [grpc.insecure_channel(secure_stack.stack.gateway) for _ in range(CHANNELS)]
    stubs = [generate_pb2_grpc.KVpopStub(ch) for ch in channels]
    errors, done, tokens = [], [], []
    lock = threading.Lock()
    start = threading.Barrier(STREAMS)
    peak = {"engine": 0, "pages": 0}
    stop_monitor = threading.Event()

    def worker(i: int):
        start.wait()
        t_end = t0 + START_FOR_S
        for r in range(ROUNDS):
            if r and time.monotonic() > t_end:
                break
            try:
                ids, _, final = collect(stubs[i % CHANNELS].Generate(_make(i, r), timeout=180))
                if final is None or len(ids) != MAX_TOKENS or final.usage.completion_tokens != MAX_TOKENS:
                    raise AssertionError(f"incomplete: {len(ids)} tokens, final {final}")
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                with lock:
                    errors.append(f"worker {i} round {r}: {type(e).__name__}: {getattr(e, 'details', lambda: e)()}")
                continue
            with lock:
                done.append((i, r))
                tokens.append(len(ids))

    def monitor():
        while not stop_monitor.is_set():
            try:
                s = secure_stack.compute_info().stats
                peak["engine"] = max(peak["engine"], s.running + s.waiting)
                peak["pages"] = max(peak["pages"], s.pages_used)
            except grpc.RpcError:
                pass
            stop_monitor.wait(0.25)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(STREAMS)]
    mon = threading.Thread(target=monitor)
    for t in threads:
        t.start()
    mon.start()
    for t in threads:
        t.join(300)
    wall = time.monotonic() - t0
    stop_monitor.set()
    mon.join(10)
    for ch in channels:
        ch.close()
    assert not any(t.is_alive() for t in threads), "a worker did not stop"
    assert not errors, f"{len(errors)} failed streams:\n" + "\n".join(errors[:20])
    assert len(done) >= STREAMS, "every worker finishes at least its first stream"

    after = wait_until(lambda: (s := secure_stack.compute_info().stats).running == 0 and s.waiting == 0 and s,
                       30, "compute to be idle again")
    # Pages of finished sequences are freed at the engine's next step: allow it a moment.
    deadline = time.monotonic() + 10
    while (idle_after := secure_stack.pool_idle()) != idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert idle_after == idle, f"{idle_after - idle} pages leaked (in use before {idle}, after {idle_after})"
    print(f"\nload: {len(done)} streams ({STREAMS} concurrent, {CHANNELS} connections), "
          f"{sum(tokens)} tokens in {wall:.1f} s = {sum(tokens) / wall:.0f} tokens/s, "
          f"peak running+waiting {peak['engine']}, peak pages used {peak['pages']}, pages held by sequences before {idle} "
          f"after {idle_after} of {after.pages_total}, prefix-cache pages {after.extra.get('prefix_cache_pages', 0):.0f}")
    assert peak["engine"] >= 16, f"the streams never overlapped in the engine (peak {peak['engine']})"
    assert peak["pages"] > idle, "the load never held a page"
    assert stats.pages_total == after.pages_total
