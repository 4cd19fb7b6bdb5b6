"""AsyncEngine: the LLMEngine loop in one background thread, for asyncio servers.

Requests and aborts are handed to the loop through a locked inbox and applied
between steps; outputs are handed back to each request's asyncio queue with
``call_soon_threadsafe``. A bad request raises in its own ``generate`` only;
an exception inside a step finishes the requests of that step with an error
and the loop keeps serving.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import AsyncIterator

from services.compute.engine.engine import EngineConfig, EvictionParams, LLMEngine, SamplingParams, StepOutput

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine | EngineConfig, advisor=None):
        self.engine = engine if isinstance(engine, LLMEngine) else LLMEngine(engine, advisor=advisor)
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list = []
        self._aborts: list[str] = []
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        if self.engine.advisor is not None:
            # A sequence held for its plan runs again as soon as the plan arrives.
            self.engine.advisor.on_plan = self._wake.set
        self._thread = threading.Thread(target=self._loop, name="kvpop-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ API
    async def generate(self, request_id: str, prompt_ids: list[int],
                       sampling: SamplingParams | None = None,
                       eviction: EvictionParams | None = None,
                       session_id: str | None = None) -> AsyncIterator[StepOutput]:
        """Stream one request, output by output. Closing the iterator early aborts it.
        Raises ValueError for invalid parameters, EngineError if the engine failed.
        ``session_id``: as LLMEngine.add_request."""
        async for batch in self.generate_batches(request_id, prompt_ids, sampling, eviction, session_id):
            for out in batch:
                yield out

    async def generate_batches(self, request_id: str, prompt_ids: list[int],
                               sampling: SamplingParams | None = None,
                               eviction: EvictionParams | None = None,
                               session_id: str | None = None) -> AsyncIterator[list[StepOutput]]:
        """As ``generate``, but each item is every output that arrived since the
        last one was taken: a consumer that falls behind the engine (many
        streams on few cores) sends one message for several tokens instead of
        paying the per-message cost on each, and never adds latency."""
        if self._stop:
            raise EngineError("the engine is shut down")
        if session_id is not None:
            sampling = dataclasses.replace(sampling or SamplingParams(), session_id=session_id)
        seq = self.engine.make_sequence(request_id, prompt_ids, sampling, eviction)
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._queues:
                raise ValueError(f"request id {request_id!r} is already running")
            self._queues[request_id] = (asyncio.get_running_loop(), queue)
            self._inbox.append(seq)
        self._wake.set()
        done = False
        try:
            while not done:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                batch = []
                for item in items:
                    if isinstance(item, BaseException):
                        done = True
                        if batch:
                            yield batch
                        raise item
                    batch.append(item)
                    if item.finished:
                        done = True
                        break
                yield batch
        finally:
            with self._lock:
                self._queues.pop(request_id, None)
                if not done:
                    self._aborts.append(request_id)
            self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def stats(self) -> dict:
        with self._step_lock:
            return self.engine.stats()

    # Sessions and prefix cache: called from any thread (or asyncio.to_thread);
    # they wait for the current step, never for a whole request.
    def has_session(self, session_id: str) -> bool:
        with self._step_lock:
            return self.engine.has_session(session_id)

    def session_tokens(self, session_id: str) -> int:
        with self._step_lock:
            return self.engine.session_tokens(session_id)

    def drop_session(self, session_id: str) -> bool:
        with self._step_lock:
            return self.engine.drop_session(session_id)

    def prewarm(self, prompts) -> int:
        """LLMEngine.prewarm between steps; on an idle engine (at start, before
        serving) it returns once the prefixes are cached."""
        with self._step_lock:
            n = self.engine.prewarm(prompts)
        self._wake.set()   # prefills queued behind running requests run in the loop
        return n

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)
        with self._lock:
            pending = list(self._queues)
        for rid in pending:
            self._deliver(rid, EngineError("the engine shut down"))

    # ------------------------------------------------------------ loop
    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list) -> None:
        """Hand (request id, output) pairs to their event loops: one wake-up per
        loop and step, not one per output (each costs a syscall and a GIL
        hand-over that the engine thread waits for)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for request_id, item in items:
                target = self._queues.get(request_id)
                if target is not None:          # None: the client is gone
                    by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, puts in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, puts)
            except RuntimeError:
                pass  # its event loop is closed

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop:
            self._wake.clear()
            with self._lock:
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            with self._step_lock:
                for seq in inbox:
                    try:
                        engine.add_sequence(seq)
                    except ValueError as e:
                        self._deliver(seq.request_id, e)
                for rid in aborts:
                    engine.abort(rid)
                if not engine.has_unfinished():
                    outputs = None
                else:
                    try:
                        outputs = engine.step()
                    except Exception as e:  # never let one bad step kill the service
                        log.exception("engine step failed; failing its requests")
                        outputs = engine.fail_all("error")
                        for out in outputs:
                            self._deliver(out.request_id, EngineError(f"engine step failed: {e}"))
                        outputs = []
            if outputs is None:
                self._wake.wait(0.5)
                continue
            self._deliver_all([(out.request_id, out) for out in outputs])
            if engine.idle:
                # Every running sequence is held for its eviction plan: sleep until
                # a plan arrives (on_plan) or the earliest wait runs out.
                deadline = engine.next_plan_deadline()
                self._wake.wait(0.05 if deadline is None else min(0.05, deadline + 1e-3))


def _put_all(puts: list) -> None:
    for queue, item in puts:
        queue.put_nowait(item)
