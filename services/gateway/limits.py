"""Concurrent Generate streams per client (KVPOP_MAX_STREAMS_PER_CLIENT).

A client is the `x-client-id` request metadata when present (set it at your
authenticating proxy: a client can choose its own id), otherwise the IP
address of the peer, so one host opening many connections still counts once.
Behind a proxy that does not forward `x-client-id`, every request comes from
the proxy's address and shares one allowance.
"""
from __future__ import annotations

from collections import Counter

import grpc

from services.gateway.validation import ID_PATTERN, Invalid

CLIENT_ID_KEY = "x-client-id"


def peer_host(peer: str) -> str:
    """'ipv4:1.2.3.4:5678' -> '1.2.3.4', 'ipv6:[::1]:5678' -> '::1', 'unix:/p' -> 'unix:/p'."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1:rest.find("]")]
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return peer


def client_key(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_ID_KEY:
            value = value.decode(errors="replace") if isinstance(value, bytes) else value
            if not ID_PATTERN.fullmatch(value):
                raise Invalid(f"{CLIENT_ID_KEY} metadata must be 1-128 characters of [A-Za-z0-9._:@/-], "
                              f"got {value[:40]!r}")
            return f"id:{value}"
    return f"ip:{peer_host(context.peer() or 'unknown')}"


class StreamLimiter:
    """Counts open streams per client; `limit` 0 means no limit."""

    def __init__(self, limit: int):
        self.limit = limit
        self.open: Counter[str] = Counter()

    def acquire(self, client: str) -> None:
        """Raises Invalid(RESOURCE_EXHAUSTED) when the client is at its limit."""
        if self.limit and self.open[client] >= self.limit:
            raise Invalid(f"client {client.split(':', 1)[1]!r} already has {self.open[client]} streams open; "
                          f"the limit is {self.limit} (KVPOP_MAX_STREAMS_PER_CLIENT)",
                          grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.open[client] += 1

    def release(self, client: str) -> None:
        self.open[client] -= 1
        if self.open[client] <= 0:
            del self.open[client]
