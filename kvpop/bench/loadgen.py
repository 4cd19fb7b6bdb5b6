"""Client side of the serving benchmarks: one timed gRPC stream per request
(arrival, every token's arrival, usage), and percentiles. `Stream` runs a
request on its own thread (a few streams); `AsyncStream` on an asyncio loop,
so that many in-flight streams cost the client one thread, not one each."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc


def request(pb, prompt: str, policy: str, budget: float | None, new_tokens: int, ignore_eos: bool = True,
            messages: list[dict] | None = None):
    """A greedy request; with ``messages`` a chat (the prompt is then unused)."""
    req = pb.GenerateRequest(prompt="" if messages else prompt, policy=policy, max_tokens=new_tokens,
                             ignore_eos=ignore_eos, temperature=0.0,
                             messages=[pb.ChatMessage(**m) for m in messages or []])
    if policy != "dense" and budget is not None:
        req.budget_fraction = budget
    return req


class Record:
    """One request's timings: its arrival (t0), every token's arrival, the text, usage or error."""

    def __init__(self, req, client_id: str | None = None):
        self.req = req
        from kvpop.stack.gateway_channel import key_metadata

        # Each simulated user names itself, as the gateway's per-client stream limit expects
        # (a gateway with API keys counts per key instead: KVPOP_API_KEY is sent when set).
        md = key_metadata() + ((("x-client-id", client_id),) if client_id else ())
        self.metadata = md or None
        self.stamps: list[float] = []
        self.text: list[str] = []
        self.usage, self.error = None, None
        self.t0 = self.t_end = 0.0

    def take(self, msg) -> None:
        if msg.HasField("chunk"):
            # A chunk may carry several tokens: they all arrived now.
            self.stamps.extend([time.perf_counter()] * max(1, len(msg.chunk.token_ids)))
            self.text.append(msg.chunk.text)
        else:
            self.usage = msg.finished.usage

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.t0

    @property
    def tpot(self) -> float:
        return (self.stamps[-1] - self.stamps[0]) / max(1, len(self.stamps) - 1)

    def itls(self, lo: float = float("-inf"), hi: float = float("inf")) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:]) if lo <= b <= hi]


class Stream(Record):
    """One request on its own thread: ``start()``, then ``thread.join()``."""

    def __init__(self, stub, req, client_id: str | None = None):
        super().__init__(req, client_id)
        self.stub = stub
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Stream:
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            for msg in self.stub.Generate(self.req, timeout=600, metadata=self.metadata):
                self.take(msg)
        except grpc.RpcError as e:
            self.error = f"{e.code().name}: {e.details()}"
        self.t_end = time.perf_counter()


class AsyncStream(Record):
    """One request as a task on the running loop (a ``grpc.aio`` stub): ``start(stub)``, then ``await task``."""

    def start(self, stub) -> AsyncStream:
        # Stamped at arrival, before the task first runs: time the loop takes to get to it counts in TTFT.
        self.t0 = time.perf_counter()
        self.task = asyncio.ensure_future(self._run(stub))
        return self

    async def _run(self, stub) -> AsyncStream:
        try:
            async for msg in stub.Generate(self.req, timeout=600, metadata=self.metadata):
                self.take(msg)
        except grpc.RpcError as e:   # grpc.aio.AioRpcError is one
            self.error = f"{e.code().name}: {e.details()}"
        self.t_end = time.perf_counter()
        return self


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
