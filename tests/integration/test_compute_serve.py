"""compute's Serve stream (the gateway's one stream per replica), on the real
compute process: many requests share it, their tokens are batched into one
message per write, and a refused, cancelled or timed-out request ends alone
with its own status while the others finish exactly as they would alone."""
from __future__ import annotations

import queue

import grpc

from kvpop.runtime.pb import compute_pb2
from .stack_helpers import compute_info, wait_until

NEW = 40


def _req(rid: str, max_tokens: int = NEW, prompt: str = "serve me ") -> compute_pb2.ComputeRequest:
    return compute_pb2.ComputeRequest(request_id=rid, prompt=prompt,
                                      sampling=compute_pb2.Sampling(max_tokens=max_tokens, ignore_eos=True, top_p=1.0,
                                                                    repetition_penalty=1.0),
                                      eviction=compute_pb2.Eviction(policy="dense"))


class ServeStream:
    def __init__(self, compute):
        self.out: queue.Queue = queue.Queue()
        self.call = compute.Serve(iter(self.out.get, None), timeout=120)

    def start(self, req, timeout_s: float = 0.0) -> None:
        self.out.put(compute_pb2.ServeRequest(start=req, timeout_s=timeout_s))

    def cancel(self, rid: str) -> None:
        self.out.put(compute_pb2.ServeRequest(cancel=rid))

    def close(self) -> None:
        self.out.put(None)


def _solo(compute, prompt: str) -> list[int]:
    ids = []
    for r in compute.Generate(_req("solo-" + prompt, prompt=prompt), timeout=60):
        ids.extend(r.response.chunk.token_ids)
    return ids


def test_many_requests_one_stream_batched_and_isolated(compute):
    prompts = {f"ok{i}": f"prompt number {i} " for i in range(4)}
    expected = {rid: _solo(compute, p) for rid, p in prompts.items()}
    s = ServeStream(compute)
    for rid, p in prompts.items():
        s.start(_req(rid, prompt=p))
        if rid == "ok0":    # right behind it, so ok0 is still running even on a loaded host
            s.start(_req("ok0", prompt="a second ok0"))        # id already running on this stream
    s.start(_req("too-long", max_tokens=10**7))               # over compute's own limit
    s.close()
    tokens = {rid: [] for rid in prompts}
    finished, failed, shared = set(), {}, 0
    for msg in s.call:
        shared = max(shared, len({ev.request_id for ev in msg.events if ev.response.response.HasField("chunk")}))
        for ev in msg.events:
            if ev.status_code:
                failed.setdefault(ev.request_id, grpc.StatusCode(next(c for c in grpc.StatusCode
                                                                      if c.value[0] == ev.status_code)))
                continue
            r = ev.response.response
            if r.HasField("chunk"):
                tokens[ev.request_id].extend(r.chunk.token_ids)
            if r.HasField("finished"):
                finished.add(ev.request_id)
    assert failed == {"too-long": grpc.StatusCode.RESOURCE_EXHAUSTED, "ok0": grpc.StatusCode.INVALID_ARGUMENT}
    assert finished == set(prompts)
    assert tokens == expected           # batched delivery changes nothing a request sees
    assert shared >= 2, "four requests decoding together never shared a message"


def test_cancel_and_deadline_end_one_request_and_free_its_pages(compute):
    base = compute_info(compute).stats
    s = ServeStream(compute)
    s.start(_req("long", max_tokens=3000))
    s.start(_req("late", max_tokens=3000), timeout_s=0.5)
    s.start(_req("short"))
    seen, ended = {"long": 0, "late": 0, "short": 0}, {}
    for msg in s.call:
        for ev in msg.events:
            r = ev.response.response
            if ev.status_code:
                ended[ev.request_id] = ev.status_code
            elif r.HasField("chunk"):
                seen[ev.request_id] += len(r.chunk.token_ids)
                if ev.request_id == "long" and seen["long"] >= 5 and "long" not in ended:
                    s.cancel("long")
                    ended["long"] = "cancelled"
            elif r.HasField("finished"):
                ended[ev.request_id] = "finished"
        if ended.keys() >= {"long", "late", "short"}:
            break
    assert ended["short"] == "finished" and seen["short"] == NEW
    assert ended["late"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0] and seen["late"] < 3000
    assert seen["long"] < 3000
    s.close()
    stats = wait_until(lambda: (st := compute_info(compute).stats).running == 0 and st, 10, "the sequences to go")
    assert stats.pages_used == base.pages_used
