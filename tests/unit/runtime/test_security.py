"""TLS, mutual TLS and the shared token on a real grpc.aio server, with
certificates made by openssl in the test."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from helpers.pki import make_pki
from kvpop.runtime import telemetry
from kvpop.runtime.security import (
    ENV_CA, ENV_CERT, ENV_KEY, ENV_TOKEN, SecurityConfig, SecurityConfigError, add_port,
    aio_channel, server_interceptors, sync_channel,
)

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _env(pki: Path, leaf: str = "client", ca: str = "ca", token: str | None = TOKEN) -> dict:
    env = {ENV_CERT: str(pki / f"{leaf}.pem"), ENV_KEY: str(pki / f"{leaf}.key"),
           ENV_CA: str(pki / f"{ca}.pem")}
    if token:
        env[ENV_TOKEN] = token
    return env


# A service of every streaming shape, on raw bytes so no proto is needed.
async def _unary(req, ctx):
    return b"u:" + req


async def _server_stream(req, ctx):
    for i in range(3):
        yield b"s%d:" % i + req


async def _bidi(it, ctx):
    async for req in it:
        yield b"b:" + req


HANDLER = grpc.method_handlers_generic_handler("test.Echo", {
    "Unary": grpc.unary_unary_rpc_method_handler(_unary),
    "ServerStream": grpc.unary_stream_rpc_method_handler(_server_stream),
    "Bidi": grpc.stream_stream_rpc_method_handler(_bidi),
})


async def _start(cfg: SecurityConfig) -> tuple[grpc.aio.Server, str]:
    # The same interceptor chain as the services (tracing first).
    server = grpc.aio.server(interceptors=[*telemetry.server_interceptors(), *server_interceptors(cfg)])
    server.add_generic_rpc_handlers((HANDLER,))
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    await hs.set("", health_pb2.HealthCheckResponse.SERVING)
    port = add_port(server, "127.0.0.1:0", cfg)
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _call_all(channel: grpc.aio.Channel) -> list[bytes]:
    unary = channel.unary_unary("/test.Echo/Unary")
    stream = channel.unary_stream("/test.Echo/ServerStream")
    bidi = channel.stream_stream("/test.Echo/Bidi")
    out = [await unary(b"x", timeout=5)]
    out += [m async for m in stream(b"y", timeout=5)]

    async def reqs():
        yield b"1"
        yield b"2"
    out += [m async for m in bidi(reqs(), timeout=5)]
    return out


EXPECTED = [b"u:x", b"s0:y", b"s1:y", b"s2:y", b"b:1", b"b:2"]


async def _code_of(coro) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await coro
    return e.value.code()


async def _health(channel) -> int:
    resp = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=5)
    return resp.status


def test_token_on_plaintext_rejects_every_rpc_shape_but_not_health(pki):
    async def go():
        server, addr = await _start(SecurityConfig(token=TOKEN))
        try:
            async with aio_channel(addr, SecurityConfig(token=TOKEN)) as ch:
                assert await _call_all(ch) == EXPECTED
            for client_cfg in (SecurityConfig(), SecurityConfig(token="wrong")):
                async with aio_channel(addr, client_cfg) as ch:
                    assert await _code_of(_call_all(ch)) == grpc.StatusCode.UNAUTHENTICATED
                    stream = ch.unary_stream("/test.Echo/ServerStream")
                    assert await _code_of(
                        _consume(stream(b"y", timeout=5))) == grpc.StatusCode.UNAUTHENTICATED
                    bidi = ch.stream_stream("/test.Echo/Bidi")
                    assert await _code_of(
                        _consume(bidi(_one(), timeout=5))) == grpc.StatusCode.UNAUTHENTICATED
                    # Health probes need no secret.
                    assert await _health(ch) == health_pb2.HealthCheckResponse.SERVING
            # ... and a plaintext port is probed fine from a process that has
            # the internal TLS settings (the gateway container).
            probe = [sys.executable, "-m", "kvpop.runtime.healthcheck", "--grpc", addr]
            env = {**{k: v for k, v in os.environ.items() if not k.startswith("KVPOP_")}, **_env(pki)}
            r = await asyncio.to_thread(subprocess.run, probe + ["--plaintext"], capture_output=True,
                                        text=True, timeout=60, env=env)
            assert r.returncode == 0, r.stdout + r.stderr
            r = await asyncio.to_thread(subprocess.run, probe, capture_output=True, text=True,
                                        timeout=60, env=env)
            assert r.returncode == 1
            # An unknown method stays UNIMPLEMENTED, with or without a token.
            async with aio_channel(addr, SecurityConfig()) as ch:
                assert await _code_of(ch.unary_unary("/test.Echo/Nope")(b"", timeout=5)) \
                    == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await server.stop(None)
    asyncio.run(go())


async def _consume(call):
    return [m async for m in call]


async def _one():
    yield b"1"


def test_mutual_tls_with_token(pki):
    async def go():
        server_cfg = SecurityConfig.from_env(_env(pki, leaf="server"))
        assert server_cfg.server_tls and server_cfg.ca is not None
        server, addr = await _start(server_cfg)
        try:
            good = SecurityConfig.from_env(_env(pki))
            async with aio_channel(addr, good) as ch:
                assert await _call_all(ch) == EXPECTED
            # TLS right, token missing: the interceptor still says no.
            async with aio_channel(addr, SecurityConfig.from_env(_env(pki, token=None))) as ch:
                assert await _code_of(_call_all(ch)) == grpc.StatusCode.UNAUTHENTICATED
            # Plaintext to a TLS port, no client certificate, or a client
            # certificate from another CA: the handshake fails.
            bad = [SecurityConfig(token=TOKEN),
                   SecurityConfig(token=TOKEN, ca=good.ca),
                   SecurityConfig.from_env(_env(pki, leaf="rogue"))]
            for cfg in bad:
                async with aio_channel(addr, cfg) as ch:
                    assert await _code_of(_call_all(ch)) == grpc.StatusCode.UNAVAILABLE
            # A client that trusts only the rogue CA refuses our server.
            rogue_trust = SecurityConfig.from_env(_env(pki, ca="rogue-ca"))
            async with aio_channel(addr, rogue_trust) as ch:
                assert await _code_of(_call_all(ch)) == grpc.StatusCode.UNAVAILABLE
            # Blocking channel (call-credentials path) for scripts and probes,
            # called off the event loop so the server keeps answering.
            def sync_call(cfg):
                with sync_channel(addr, cfg) as ch:
                    try:
                        return ch.unary_unary("/test.Echo/Unary")(b"z", timeout=5)
                    except grpc.RpcError as e:
                        return e.code()
            assert await asyncio.to_thread(sync_call, good) == b"u:z"
            assert await asyncio.to_thread(
                sync_call, SecurityConfig.from_env(_env(pki, token=None))) \
                == grpc.StatusCode.UNAUTHENTICATED

            # The compose health probe over mTLS, configured by the same variables.
            probe = [sys.executable, "-m", "kvpop.runtime.healthcheck", "--grpc", addr, "--timeout", "5"]
            base = {k: v for k, v in os.environ.items() if not k.startswith("KVPOP_")}
            ok = await asyncio.to_thread(subprocess.run, probe, capture_output=True, text=True,
                                         timeout=60, env={**base, **_env(pki, token=None)})
            assert ok.returncode == 0, ok.stdout + ok.stderr
            assert "SERVING" in ok.stdout
            plain = await asyncio.to_thread(subprocess.run, probe, capture_output=True,
                                            text=True, timeout=60, env=base)
            assert plain.returncode == 1 and "UNAVAILABLE" in plain.stdout
            # --plaintext ignores the TLS variables: it fails on this TLS port ...
            forced = await asyncio.to_thread(subprocess.run, probe + ["--plaintext"], capture_output=True,
                                             text=True, timeout=60, env={**base, **_env(pki, token=None)})
            assert forced.returncode == 1
        finally:
            await server.stop(None)
    asyncio.run(go())


def test_config_errors_are_clear(tmp_path):
    assert SecurityConfig.from_env({}) == SecurityConfig()
    assert SecurityConfig.from_env({ENV_TOKEN: ""}).token is None
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(SecurityConfigError, match="KVPOP_TLS_KEY"):
        SecurityConfig.from_env({ENV_CERT: str(cert)})
    with pytest.raises(SecurityConfigError, match="cannot read"):
        SecurityConfig.from_env({ENV_CA: str(tmp_path / "missing.pem")})
    cfg = SecurityConfig(token="t")
    assert cfg.call_metadata() == (("authorization", "Bearer t"),)
    assert not cfg.client_tls and not cfg.server_tls
