"""One turn of a session: continue the resident KV, else re-prefill from history.

The session record in Redis (kvpop/runtime/session_store.py) names the replica that holds the
session's KV. While that replica is healthy the turn goes there with
`continue_session` and only its own tokens. Compute answers
FAILED_PRECONDITION, before streaming anything, when it no longer holds the
KV (idle TTL, dropped under pool pressure, expired between its check and
admission): the turn is then re-prefilled on that same replica, once, with the
stored token history. When the owner is gone (not in the registry, or it
refuses the call) the re-prefill goes to the least-loaded healthy replica.
Either way nothing is lost, only time; the turn's record (written by
server.py after the stream) names the replica that served it.

Without a record (a new session, or Redis unreadable) the turn goes to the
last replica this gateway saw serve the session, if any, as a plain request:
compute continues what it parked, else starts the session.
"""
from __future__ import annotations

import logging
import time
from typing import AsyncIterator, Awaitable, Callable

import grpc

from kvpop.runtime.pb import compute_pb2
from kvpop.runtime.session_store import Session
from services.gateway.routing import RETRYABLE, RoutedStream, Router, Target

log = logging.getLogger(__name__)

# Before anything streamed: the owner cannot continue, re-prefill instead.
NOT_RESIDENT = grpc.StatusCode.FAILED_PRECONDITION


class HistoryUnavailable(RuntimeError):
    """The session must be re-prefilled but its history cannot be read."""


class SessionTurn:
    """Iterate for ComputeResponse messages, like RoutedStream; `target` is the
    replica that served (or last failed)."""

    def __init__(self, router: Router, request: compute_pb2.ComputeRequest, timeout: float | None,
                 session: Session | None, last_owner: str | None,
                 history: Callable[[], Awaitable[list[int]]]):
        self.router, self.request, self.session = router, request, session
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.last_owner = last_owner
        self.history = history
        self.call: RoutedStream | None = None
        self._gen = self._stream()

    @property
    def target(self) -> Target | None:
        return self.call.target if self.call is not None else None

    def __aiter__(self):
        return self._gen

    async def aclose(self) -> None:
        await self._gen.aclose()
        if self.call is not None:
            await self.call.aclose()

    def _remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def _open(self, request, prefer: str | None = None, exclude=frozenset(), pinned: Target | None = None):
        self.call = self.router.open(request, self._remaining(), prefer, exclude, pinned)
        return self.call

    async def _stream(self) -> AsyncIterator:
        s = self.session
        if s is None or not s.replica:
            async for r in self._plain():
                yield r
            return
        owner, exclude = s.replica, set()
        target = await self.router.pick(owner)
        if target.replica_id in (owner, Router.STATIC):
            req = compute_pb2.ComputeRequest()
            req.CopyFrom(self.request)
            req.continue_session = True
            call = self._open(req, pinned=target)
            try:
                async for r in call:
                    yield r
                return
            except grpc.aio.AioRpcError as e:
                if call.started or (e.code() != NOT_RESIDENT and e.code() not in RETRYABLE):
                    raise
                if e.code() != NOT_RESIDENT:        # the owner is gone: anywhere else
                    exclude.add(target.replica_id)
                log.info("session %s: %s on %s (%s); re-prefilling from its history", self.request.session_id,
                         e.code().name, target.replica_id, e.details())
        async for r in self._reprefill(owner, exclude):
            yield r

    async def _reprefill(self, prefer: str | None, exclude: set[str]) -> AsyncIterator:
        try:
            history = await self.history()
        except Exception as e:  # noqa: BLE001 - any store failure means the same to the client
            raise HistoryUnavailable(f"the history of session {self.request.session_id!r} "
                                     f"cannot be read: {e}") from e
        req = compute_pb2.ComputeRequest()
        req.CopyFrom(self.request)
        req.history_token_ids.extend(history)
        async for r in self._open(req, prefer, exclude):
            yield r

    async def _plain(self) -> AsyncIterator:
        call = self._open(self.request, self.last_owner)
        try:
            async for r in call:
                yield r
            return
        except grpc.aio.AioRpcError as e:
            if call.started or e.code() != NOT_RESIDENT:
                raise
        # What compute had parked expired between its check and admission: the
        # record is unknown, so once more as a plain request (compute now starts it).
        async for r in self._open(self.request, call.target.replica_id if call.target else None):
            yield r
