"""Peak running sequences and pool pages while a benchmark runs, polled from
compute's Info as a task on the benchmark's own event loop (no thread of its own)."""
from __future__ import annotations

import asyncio
import contextlib

import grpc


class PeakPoller:
    """``async with PeakPoller(compute) as peaks:`` ... then ``peaks.running``, ``peaks.pages``."""

    def __init__(self, address: str | None, period: float = 0.1, security=None):
        """security: how to reach compute (its stack's token; None: KVPOP_INTERNAL_TOKEN(_FILE), KVPOP_TLS_*).

        period: 0.1 s, not 0.02: each poll costs ~1 ms of client CPU and an Info on compute, the process
        being measured; pool pages grow by under a page per sequence in 0.1 s, so the peaks barely move.
        """
        self.address, self.period, self.security = address, period, security
        self.running = self.pages = 0
        # compute's cleanup counter at the first and the latest poll: budgets it shrank
        # under pool pressure (those requests ran at a higher compression than asked).
        self.shrinks_first = self.shrinks_last = None
        self._task: asyncio.Task | None = None

    async def __aenter__(self):
        if self.address:
            self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        from kvpop.runtime.pb import compute_pb2, compute_pb2_grpc
        from kvpop.runtime.security import aio_channel
        # Compute's Info needs the stack's internal token.
        async with aio_channel(self.address, self.security) as ch:
            stub = compute_pb2_grpc.ComputeStub(ch)
            while True:
                try:
                    st = (await stub.Info(compute_pb2.InfoRequest(), timeout=2)).stats
                    self.running = max(self.running, st.running)
                    self.pages = max(self.pages, st.pages_used)
                    shrinks = int(st.extra.get("budget_shrinks", 0))
                    if self.shrinks_first is None:
                        self.shrinks_first = shrinks
                    self.shrinks_last = shrinks
                except grpc.RpcError:
                    pass
                await asyncio.sleep(self.period)
