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

from services.compute.engine import EngineConfig, EvictionParams, LLMEngine, SamplingParams, StepOutput

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
        """Stream one request. Closing the iterator early aborts it.
        Raises ValueError for invalid parameters, EngineError if the engine failed.
        ``session_id``: as LLMEngine.add_request."""
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
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
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
        with self._lock:
            target = self._queues.get(request_id)
        if target is None:
            return  # the client is gone
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
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
            if engine.idle:
                # Every running sequence is held for its eviction plan: sleep until
                # a plan arrives (on_plan) or the earliest wait runs out.
                deadline = engine.next_plan_deadline()
                self._wake.wait(0.05 if deadline is None else min(0.05, deadline + 1e-3))
            for out in outputs:
                self._deliver(out.request_id, out)
