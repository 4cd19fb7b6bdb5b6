"""Who a client is for the concurrent-stream limit, and the counting."""
from __future__ import annotations

import grpc
import pytest

from services.gateway.limits import StreamLimiter, client_key, peer_host
from services.gateway.validation import Invalid


class Ctx:
    def __init__(self, peer: str, metadata=()):
        self._peer, self._md = peer, metadata

    def peer(self):
        return self._peer

    def invocation_metadata(self):
        return self._md


def test_peer_host_drops_the_port():
    assert peer_host("ipv4:10.1.2.3:5555") == "10.1.2.3"
    assert peer_host("ipv6:[::1]:5555") == "::1"
    assert peer_host("ipv6:[2001:db8::7]:80") == "2001:db8::7"
    assert peer_host("unix:/tmp/s") == "unix:/tmp/s"


def test_client_key_prefers_x_client_id():
    assert client_key(Ctx("ipv4:10.1.2.3:1")) == client_key(Ctx("ipv4:10.1.2.3:2")) == "ip:10.1.2.3"
    assert client_key(Ctx("ipv4:10.1.2.3:1", (("x-client-id", "team-a"),))) == "id:team-a"
    for bad in ("a b", "a\n", "x" * 129, ""):
        with pytest.raises(Invalid) as e:
            client_key(Ctx("ipv4:10.1.2.3:1", (("x-client-id", bad),)))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "x-client-id" in e.value.message


def test_limiter_counts_per_client_and_zero_is_no_limit():
    lim = StreamLimiter(2)
    lim.acquire("ip:a")
    lim.acquire("ip:a")
    lim.acquire("ip:b")
    with pytest.raises(Invalid) as e:
        lim.acquire("ip:a")
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "KVPOP_MAX_STREAMS_PER_CLIENT" in e.value.message
    lim.release("ip:a")
    lim.acquire("ip:a")
    lim.release("ip:a")
    lim.release("ip:a")
    assert "ip:a" not in lim.open, "released clients leave no entry behind"
    unlimited = StreamLimiter(0)
    for _ in range(1000):
        unlimited.acquire("ip:a")
