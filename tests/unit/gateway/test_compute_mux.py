"""ComputeMux: the gateway's requests to one compute replica on one Serve stream,
against a real grpc.aio server whose Serve replies the test writes: each request
gets its own events and only those, a failed event or a cancel ends that request
alone, and a broken stream fails what it carried (UNAVAILABLE unless its status
says more) while the next request opens a new one."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from kvpop.runtime.pb import compute_pb2, compute_pb2_grpc, generate_pb2
from services.gateway.compute_mux import ComputeMux


class ScriptedCompute(compute_pb2_grpc.ComputeServicer):
    """Compute as the mux meets it: every ServeRequest lands in ``received``; a
    Serve stream sends what the test puts in ``replies`` (ServeEvents), ends with
    the status of a StatusCode put there, or ends cleanly on None."""

    def __init__(self):
        self.streams = 0
        self.received: asyncio.Queue = asyncio.Queue()
        self.replies: asyncio.Queue = asyncio.Queue()

    async def Serve(self, request_iterator, context):
        self.streams += 1

        async def read():
            async for req in request_iterator:
                self.received.put_nowait(req)
        reader = asyncio.ensure_future(read())
        try:
            while (reply := await self.replies.get()) is not None:
                if isinstance(reply, grpc.StatusCode):
                    await context.abort(reply, "scripted end")
                yield reply
        finally:
            reader.cancel()


def chunk(rid: str, text: str) -> compute_pb2.ServeEvent:
    return compute_pb2.ServeEvent(request_id=rid, response=compute_pb2.ComputeResponse(
        response=generate_pb2.GenerateResponse(request_id=rid, chunk=generate_pb2.TokenChunk(text=text))))


def finished(rid: str) -> compute_pb2.ServeEvent:
    return compute_pb2.ServeEvent(request_id=rid, response=compute_pb2.ComputeResponse(
        response=generate_pb2.GenerateResponse(request_id=rid, finished=generate_pb2.Finished(finish_reason_text="length"))))


def failed(rid: str, code: grpc.StatusCode, message: str) -> compute_pb2.ServeEvent:
    return compute_pb2.ServeEvent(request_id=rid, status_code=code.value[0], status_message=message)


def events(*evs: compute_pb2.ServeEvent) -> compute_pb2.ServeEvents:
    return compute_pb2.ServeEvents(events=list(evs))


def start(mux: ComputeMux, rid: str, timeout: float | None = None):
    return mux.open(compute_pb2.ComputeRequest(request_id=rid, prompt="hi"), timeout)


async def texts(call) -> list[str]:
    return [r.response.chunk.text if r.response.HasField("chunk") else "finished" async for r in call]


async def received(compute: ScriptedCompute) -> compute_pb2.ServeRequest:
    return await asyncio.wait_for(compute.received.get(), 10)


def run(test) -> None:
    async def go():
        compute = ScriptedCompute()
        server = grpc.aio.server()
        compute_pb2_grpc.add_ComputeServicer_to_server(compute, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        mux = ComputeMux(compute_pb2_grpc.ComputeStub(channel))
        try:
            await asyncio.wait_for(test(compute, mux), 30)
        finally:
            try:
                await mux.close()
            finally:       # a server left running would hang the loop's shutdown
                await channel.close()
                await server.stop(None)
    asyncio.run(go())


def test_requests_share_one_stream_and_each_gets_only_its_events():
    async def test(compute, mux):
        a, b = start(mux, "a", timeout=2.5), start(mux, "b")
        got = [await received(compute), await received(compute)]
        assert [(r.start.request_id, r.timeout_s) for r in got] == [("a", 2.5), ("b", 0.0)]
        # One message carries both requests' output, as compute writes an engine step.
        compute.replies.put_nowait(events(chunk("a", "x"), chunk("b", "y"), finished("b")))
        compute.replies.put_nowait(events(chunk("a", "z"), finished("a")))
        assert await texts(b) == ["y", "finished"] and b.done()
        assert await texts(a) == ["x", "z", "finished"] and a.done()
        assert await texts(a) == []                       # an ended call stays ended
        start(mux, "c")                                   # the stream outlives its requests
        assert (await received(compute)).start.request_id == "c" and compute.streams == 1
    run(test)


def test_a_failed_event_or_a_cancel_ends_that_request_alone():
    async def test(compute, mux):
        a, b = start(mux, "a"), start(mux, "b")
        await received(compute), await received(compute)
        compute.replies.put_nowait(events(failed("a", grpc.StatusCode.FAILED_PRECONDITION, "no session parked"),
                                          chunk("b", "y")))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await texts(a)
        assert (e.value.code(), e.value.details()) == (grpc.StatusCode.FAILED_PRECONDITION, "no session parked")
        assert a.done()
        assert (await b.__anext__()).response.chunk.text == "y"

        b.cancel()                                        # compute is told, to free the sequence
        assert (await received(compute)).cancel == "b" and b.done()
        c = start(mux, "c")
        assert (await received(compute)).start.request_id == "c"
        compute.replies.put_nowait(events(chunk("b", "late"), finished("c")))
        assert await texts(c) == ["finished"]             # b's late output goes nowhere
        assert await texts(b) == []
        b.cancel()                                        # once ended, a cancel sends nothing
        start(mux, "d")
        assert (await received(compute)).start.request_id == "d" and compute.streams == 1
    run(test)


@pytest.mark.parametrize("end, code, details", [
    (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, "the stream to compute broke (INTERNAL: scripted end)"),
    (None, grpc.StatusCode.UNAVAILABLE, "compute ended the stream"),
    (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED, "scripted end"),
])
def test_a_broken_stream_fails_its_requests_and_the_next_request_opens_a_new_one(end, code, details):
    async def test(compute, mux):
        a, b = start(mux, "a"), start(mux, "b")
        await received(compute), await received(compute)
        compute.replies.put_nowait(events(chunk("a", "x")))
        compute.replies.put_nowait(end)
        assert (await a.__anext__()).response.chunk.text == "x"
        for call in (a, b):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await texts(call)
            assert (e.value.code(), e.value.details()) == (code, details) and call.done()

        c = start(mux, "c")
        assert (await received(compute)).start.request_id == "c" and compute.streams == 2
        compute.replies.put_nowait(events(finished("c")))
        assert await texts(c) == ["finished"]
    run(test)
