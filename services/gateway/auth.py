"""API-key check on the public gateway, as a gRPC server interceptor.

A call carries its key as `authorization: Bearer <key>` metadata. Without
one, with a key the KeyRing does not know (wrong, or revoked since), or with
the key in any other header, the call ends UNAUTHENTICATED before its request
is parsed. Health and reflection stay open: probes and clients that discover
the API need no secret.

An admitted call runs with `CALLER` set to its key, which the servicer reads
(limits, session ownership) and which names the caller in the server span
(`kvpop.api_key`: the key's name, never the key).
"""
from __future__ import annotations

import contextvars

import grpc
import grpc.aio
from opentelemetry import trace

from kvpop.runtime.security import refusing
from services.gateway.apikeys import ApiKey, KeyRing

CALLER: contextvars.ContextVar[ApiKey | None] = contextvars.ContextVar("kvpop_api_caller", default=None)
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")
SPAN_ATTRIBUTE = "kvpop.api_key"


def _bearer(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            value = value.decode(errors="replace") if isinstance(value, bytes) else value
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def _refusal(metadata) -> str:
    token = _bearer(metadata)
    if token is None:
        return "no API key: send it as 'authorization: Bearer <key>' metadata"
    if not token:
        return "the authorization metadata must be 'Bearer <key>'"
    return "unknown or revoked API key"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: KeyRing):
        self.keys = keys

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        token = _bearer(details.invocation_metadata)
        key = self.keys.identify(token) if token else None
        if key is None:
            return refusing(handler, grpc.StatusCode.UNAUTHENTICATED, _refusal(details.invocation_metadata))
        return _as_caller(handler, key)


def _as_caller(handler: grpc.RpcMethodHandler, key: ApiKey) -> grpc.RpcMethodHandler:
    """The same handler, its behaviour run with CALLER = key. Each call runs in
    its own asyncio task, so the value set here is that call's alone."""
    def enter():
        trace.get_current_span().set_attribute(SPAN_ATTRIBUTE, key.name)
        CALLER.set(key)

    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def unary(request, context):
            enter()
            return await inner(request, context)
        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(unary, handler.request_deserializer, handler.response_serializer)

    inner = handler.unary_stream or handler.stream_stream

    async def streaming(request, context):
        enter()
        stream = inner(request, context)
        try:
            async for r in stream:
                yield r
        finally:
            await stream.aclose()   # now, as a cancelled call frees its compute sequence at once
    make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
    return make(streaming, handler.request_deserializer, handler.response_serializer)
