"""Concurrent Generate streams per client (KVPOP_MAX_STREAMS_PER_CLIENT).

With API keys a client is its key's name (its line's `streams=N` overrides the
limit). Without them it is the `x-client-id` request metadata when present
(set it at your authenticating proxy: a client can choose its own id),
otherwise the IP address of the peer, so one host opening many connections
still counts once. Behind a proxy that does not forward `x-client-id`, every
request comes from the proxy's address and shares one allowance.
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


def client_key(context: grpc.aio.ServicerContext, key_name: str | None = None) -> str:
    if key_name:
        return f"key:{key_name}"
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

    def acquire(self, client: str, limit: int | None = None) -> None:
        """Raises Invalid(RESOURCE_EXHAUSTED) when the client is at its limit
        (`limit`: this client's own, else the shared one)."""
        limit = self.limit if limit is None else limit
        if limit and self.open[client] >= limit:
            kind, name = client.split(":", 1)
            who, which = ((f"API key {name!r}", "its streams limit") if kind == "key"
                          else (f"client {name!r}", "KVPOP_MAX_STREAMS_PER_CLIENT"))
            raise Invalid(f"{who} already has {self.open[client]} streams open; the limit is {limit} ({which}): "
                          f"retry when one of them has finished", grpc.StatusCode.RESOURCE_EXHAUSTED)
        self.open[client] += 1

    def release(self, client: str) -> None:
        self.open[client] -= 1
        if self.open[client] <= 0:
            del self.open[client]
