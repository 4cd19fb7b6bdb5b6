"""The cache-manager SIGKILLed while learned-policy streams run: every stream
finishes, on compute's local fallback policy while it is gone, within its
budget; the supervisor of `kvpop up` brings it back and compute reconnects."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from .reliability_stack import BLOCK_SIZE, request, wait_until
from kvpop.stack.up import restart_service

pytestmark = pytest.mark.slow

STREAMS = 8
TOKENS = 400
BUDGET = 64


def test_cache_manager_killed_mid_run(secure_stack, gateway):
    st = secure_stack.stack
    wait_until(lambda: secure_stack.compute_info().advisor_connected, 30, "compute to reach the cache-manager")
    plans_before = secure_stack.compute_info().stats.extra["advisor_plans_received"]
    results, errors = {}, []
    progress = [0] * STREAMS

    def stream(i):
        try:
            ids, final = [], None
            req = request(prompt=f"stream {i}: " + "remember this " * (i + 2), max_tokens=TOKENS, ignore_eos=True,
                          policy="learned", budget_tokens=BUDGET)
            for msg in gateway.Generate(req, timeout=240):
                if msg.HasField("chunk"):
                    ids.extend(msg.chunk.token_ids)
                    progress[i] = len(ids)
                else:
                    final = msg.finished
            results[i] = (ids, final, time.monotonic())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"stream {i}: {e!r}")

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    # Killed once the cache-manager is planning for these streams and all of them are well under way.
    wait_until(lambda: min(progress) >= TOKENS // 6 or errors, 120, "the streams to get going")
    wait_until(lambda: secure_stack.compute_info().stats.extra["advisor_plans_received"] > plans_before, 30,
               "plans for the streams")
    fallback_before = secure_stack.compute_info().stats.fallback_evictions
    os.killpg(st.proc("cache-manager").pid, signal.SIGKILL)
    t_kill = time.monotonic()
    at_kill = list(progress)
    for t in threads:
        t.join(240)
    assert not errors, errors
    assert all(results[i][2] > t_kill for i in range(STREAMS)), "a stream had ended before the kill"

    m = secure_stack.compute_info().model
    rows = m.num_layers * m.num_kv_heads
    evicted = fallback = 0
    for i in range(STREAMS):
        ids, final, _ = results[i]
        u = final.usage
        assert len(ids) == TOKENS == u.completion_tokens and u.policy == "learned", (i, u)
        # Bounded memory whatever the advisor does: at most budget + slack blocks stay resident.
        assert u.kv_blocks_resident <= (BUDGET // BLOCK_SIZE + 3) * rows, u
        evicted += u.kv_blocks_evicted
        fallback += u.fallback_evictions
    info = secure_stack.compute_info()
    print(f"\ncache-manager kill: {STREAMS} learned streams of {TOKENS} tokens, killed at "
          f"{min(at_kill)}-{max(at_kill)} tokens; evicted {evicted} blocks, {fallback} by the fallback policy; "
          f"compute fallback counter {fallback_before} -> {info.stats.fallback_evictions}")
    assert all(results[i][1].usage.fallback_evictions > 0 for i in range(STREAMS)), \
        [results[i][1].usage.fallback_evictions for i in range(STREAMS)]
    assert info.stats.fallback_evictions > fallback_before

    # The supervisor restarted it (a new pid, SERVING); compute is back on its plans.
    killed = st.proc("cache-manager").pid
    assert restart_service(st, "cache-manager", env=secure_stack.env).pid != killed
    wait_until(lambda: secure_stack.compute_info().advisor_connected, 30, "compute to reconnect")
