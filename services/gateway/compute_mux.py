"""Every request this gateway sends to one compute replica, on one Serve stream.

A gRPC message costs far more than its bytes (framing, a write, a wake-up on
both sides). With one Generate stream per request, N decoding requests cost N
messages per engine step; on Serve, compute sends what all of them produced
since its last write as one message, and this side hands each request its
events. `MuxCall` looks like the per-request call it replaces (iterate it,
`done()`, `cancel()`, errors as `grpc.aio.AioRpcError`), so routing and
sessions do not know the difference.

A broken stream (compute died, restarted) fails the requests it carried with
its error, UNAVAILABLE; the next request opens a new stream (the channel
reconnects as before).
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from kvpop.runtime import telemetry
from kvpop.runtime.pb import compute_pb2, compute_pb2_grpc

log = logging.getLogger(__name__)

_CODES = {c.value[0]: c for c in grpc.StatusCode}
# Stream-level statuses kept as they are; any other end of the stream means the
# replica is unreachable (killed, restarted, a write on a dead connection fails
# INTERNAL): UNAVAILABLE, so a request that had not started moves to another replica.
_KEEP = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED,
         grpc.StatusCode.CANCELLED}


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Stream:
    """One Serve call and the requests on it."""

    def __init__(self, stub: compute_pb2_grpc.ComputeStub):
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.pending: dict[str, asyncio.Queue] = {}
        self.broken = False
        self.call = stub.Serve(self._requests())
        self.reader = asyncio.create_task(self._read())

    async def _requests(self):
        while True:
            msg = await self.outbox.get()
            if msg is None:
                return
            yield msg

    async def _read(self) -> None:
        error = _error(grpc.StatusCode.UNAVAILABLE, "compute ended the stream")
        try:
            async for msg in self.call:
                for ev in msg.events:
                    queue = self.pending.get(ev.request_id)
                    if queue is None:
                        continue        # cancelled here already
                    if ev.status_code or ev.response.response.HasField("finished"):
                        del self.pending[ev.request_id]
                    queue.put_nowait(ev)
        except grpc.aio.AioRpcError as e:
            error = e if e.code() in _KEEP else _error(
                grpc.StatusCode.UNAVAILABLE, f"the stream to compute broke ({e.code().name}: {e.details()})")
        except asyncio.CancelledError:
            error = _error(grpc.StatusCode.CANCELLED, "the gateway closed the stream")
            raise
        finally:
            self.broken = True
            for queue in self.pending.values():
                queue.put_nowait(error)
            self.pending.clear()
            if error.code() not in (grpc.StatusCode.CANCELLED,):
                log.warning("compute stream ended: %s %s", error.code().name, error.details())

    def send(self, msg: compute_pb2.ServeRequest) -> None:
        self.outbox.put_nowait(msg)

    async def close(self) -> None:
        self.outbox.put_nowait(None)
        self.call.cancel()
        self.reader.cancel()
        try:
            await self.reader
        except asyncio.CancelledError:
            pass


class ComputeMux:
    def __init__(self, stub: compute_pb2_grpc.ComputeStub):
        self.stub = stub
        self._stream: _Stream | None = None

    def open(self, request: compute_pb2.ComputeRequest, timeout: float | None = None) -> "MuxCall":
        stream = self._stream
        if stream is None or stream.broken:
            stream = self._stream = _Stream(self.stub)
        queue: asyncio.Queue = asyncio.Queue()
        stream.pending[request.request_id] = queue
        stream.send(compute_pb2.ServeRequest(start=request, timeout_s=timeout or 0.0,
                                             trace_context=telemetry.inject()))
        return MuxCall(stream, request.request_id, queue)

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
            self._stream = None


class MuxCall:
    """One request on a Serve stream, shaped like a unary-stream call."""

    def __init__(self, stream: _Stream, request_id: str, queue: asyncio.Queue):
        self._stream, self._rid, self._queue = stream, request_id, queue
        self._done = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> compute_pb2.ComputeResponse:
        if self._done:
            raise StopAsyncIteration
        ev = await self._queue.get()
        if isinstance(ev, grpc.aio.AioRpcError):
            self._done = True
            raise ev
        if ev.status_code:
            self._done = True
            raise _error(_CODES.get(ev.status_code, grpc.StatusCode.UNKNOWN), ev.status_message)
        if ev.response.response.HasField("finished"):
            self._done = True
        return ev.response

    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """Abort the request on compute (frees its sequence); a no-op once it ended."""
        if self._done:
            return
        self._done = True
        if self._stream.pending.pop(self._rid, None) is not None and not self._stream.broken:
            self._stream.send(compute_pb2.ServeRequest(cancel=self._rid))
