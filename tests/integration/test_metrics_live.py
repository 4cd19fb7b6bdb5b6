"""What /metrics says, read from the real processes of the stack by deltas:
every client cancel counted once, a scrape that reflects the moment it is
made, and the eviction plans compute received, applied, found late or dropped."""
from __future__ import annotations

import secrets
import threading
import urllib.request

import grpc

from stack_helpers import compute_info, wait_until
from kvpop.pb import generate_pb2

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
