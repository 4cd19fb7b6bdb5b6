"""Shared bootstrap of a gRPC service: grpc.aio server with message limits,
OpenTelemetry interceptors, grpc.health.v1 (NOT_SERVING until the app says it
is ready), server reflection, and a graceful drain on SIGTERM/SIGINT (health
goes NOT_SERVING, new calls are refused, in-flight streams get `grace_s`).

A service supplies `build(cfg, service) -> App`: it registers its servicers on
`service.server`; `App.ready()` runs after the port is open (load a model, reach
a dependency) and `App.close()` after the drain. An optional `App.watch(service)`
runs from SERVING until the drain and keeps the health names true
(`service.set_status(name, ok)`).

Health names (grpc.health.v1), the same on every service:

- `""` and each full service name (e.g. `kvpop.compute.v1.Compute`): readiness,
  SERVING while the service can do its job (the gateway: while a compute
  replica answers). `/healthz` on the metrics port says the same (200 / 503).
- `kvpop.live`: liveness, SERVING from the moment the port is open (model
  loading included) until the drain. `/livez` says the same, and turns 503
  when the event loop stops turning for `LIVE_STALE_S`.
- capability names (`kvpop.compute.advisor`, `kvpop.compute.redis`,
  `kvpop.gateway.redis`, ...): a dependency that degrades the service without
  stopping it; NOT_SERVING while it is gone (docs/guides/deploy.md lists them).

Reflection is served on the public gateway, and on compute and the
cache-manager only with `KVPOP_REFLECTION=on`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from typing import Awaitable, Callable, Protocol, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpop.runtime import security

from kvpop.runtime import telemetry
from kvpop.runtime.security import SecurityConfig
from kvpop.runtime.config import ConfigError, ServerConfig, add_arguments, load

log = logging.getLogger(__name__)

C = TypeVar("C", bound=ServerConfig)

LIVE = "kvpop.live"
LIVE_STALE_S = 30.0     # /livez fails when the event loop has not turned for this long


# How a public port is served: its TLS, and interceptors that admit callers.
Access = tuple[SecurityConfig, list[grpc.aio.ServerInterceptor]]


class App(Protocol):
    async def ready(self) -> None: ...
    async def close(self) -> None: ...
    # Optional `async drain()`: runs when draining starts, before in-flight calls get their grace
    # (e.g. end long-lived streams that would otherwise hold the whole grace period).


class GrpcService:
    """`internal=True` (compute, cache-manager): TLS and the shared token of
    kvpop.runtime.security apply when configured. The public gateway port takes
    neither; it brings its own `access` instead (its TLS, its API-key check)."""

    def __init__(self, name: str, cfg: ServerConfig, internal: bool = True, access: "Access | None" = None):
        self.name, self.cfg = name, cfg
        if access is not None:
            self.security, guards = access
        else:
            self.security = SecurityConfig.from_env() if internal else SecurityConfig()
            guards = security.server_interceptors(self.security)
        self.server = grpc.aio.server(
            interceptors=[*telemetry.server_interceptors(), *guards],
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", -1),
                # Without this a second process silently shares the port.
                ("grpc.so_reuseport", 0),
                # Long streams with no calls in between must survive keepalive policing.
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 10000),
                ("grpc.keepalive_permit_without_calls", 1),
            ],
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names: list[str] = []
        self.port = 0
        # Health name -> serving, as last set: /healthz and /livez read it from their thread.
        self.status: dict[str, bool] = {}
        self.draining = False
        self.ever_serving = False
        self.loop_beat = time.monotonic()
        mode = getattr(cfg, "reflection", "auto")
        self.reflection = mode == "on" or (mode == "auto" and not internal)

    def add(self, full_service_name: str) -> None:
        """Record a registered servicer's full name (for health and reflection)."""
        self.service_names.append(full_service_name)

    async def start(self) -> int:
        if self.reflection:
            names = [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
            reflection.enable_server_reflection(names, self.server)
        addr = f"{self.cfg.host}:{self.cfg.port}"
        try:
            self.port = security.add_port(self.server, addr, self.security)
        except RuntimeError as e:
            raise RuntimeError(f"{self.name}: cannot bind {addr}: {e}") from None
        await self.server.start()
        await self.set_serving(False)
        await self.set_status(LIVE, True)
        log.info("%s listening on %s:%d%s", self.name, self.cfg.host, self.port,
                 " (TLS)" if self.security.server_tls else "")
        return self.port

    async def set_status(self, name: str, serving: bool) -> None:
        """Set one health name (ignored once draining: everything is NOT_SERVING then)."""
        if self.draining:
            return
        if self.status.get(name) != serving and name not in ("", LIVE, *self.service_names):
            log.log(logging.INFO if serving else logging.WARNING, "%s: health %s %s", self.name, name,
                    "SERVING" if serving else "NOT_SERVING")
        self.status[name] = serving
        await self.health.set(name, health_pb2.HealthCheckResponse.SERVING if serving
                              else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def set_serving(self, serving: bool) -> None:
        """Readiness: "" and every service name."""
        # Flips after the first SERVING are worth a line (serve() announces the first one).
        if not self.draining and self.ever_serving and self.status.get("") != serving:
            log.log(logging.INFO if serving else logging.WARNING, "%s: health now %s", self.name,
                    "SERVING" if serving else "NOT_SERVING")
        self.ever_serving = self.ever_serving or serving
        for name in ("", *self.service_names):
            await self.set_status(name, serving)

    async def enter_drain(self) -> None:
        self.draining = True
        self.status = {name: False for name in self.status}
        await self.health.enter_graceful_shutdown()

    def ready(self) -> bool:
        return self.status.get("", False)

    def live(self) -> bool:
        return not self.draining and time.monotonic() - self.loop_beat < LIVE_STALE_S

    async def beat_loop(self) -> None:
        while True:
            self.loop_beat = time.monotonic()
            await asyncio.sleep(1.0)


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


async def serve(name: str, cfg: C, build: Callable[[C, GrpcService], Awaitable[App]],
                internal: bool = True, access: Access | None = None) -> int:
    service = GrpcService(name, cfg, internal=internal, access=access)
    app = await build(cfg, service)
    await service.start()
    beat = asyncio.create_task(service.beat_loop())
    metrics_server = None
    mport = getattr(cfg, "metrics_port", -1)
    if mport >= 0:
        from kvpop.runtime.metrics import start_metrics_server

        mhost = cfg.metrics_host or cfg.host
        try:
            metrics_server = start_metrics_server(mport, mhost, ready=service.ready, service=name,
                                                  live=service.live, details=lambda: dict(service.status),
                                                  token=cfg.metrics_token or None)
        except OSError as e:
            raise RuntimeError(f"{name}: cannot serve metrics on {mhost}:{mport}: {e}") from None
        log.info("%s metrics on http://%s:%d/metrics%s", name, mhost, metrics_server.port,
                 " (bearer token required)" if cfg.metrics_token else "")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    ready = asyncio.create_task(app.ready())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({ready, stopped}, return_when=asyncio.FIRST_COMPLETED)
    rc = 0
    watcher = None
    if ready.done():
        if ready.exception() is not None:
            log.error("%s failed to start: %s", name, ready.exception(), exc_info=ready.exception())
            rc = 1
        else:
            await service.set_serving(True)
            log.info("%s SERVING on %s:%d", name, cfg.host, service.port)
            watch = getattr(app, "watch", None)
            if watch is not None:
                watcher = asyncio.create_task(watch(service))
            await stopped
    else:
        ready.cancel()
    log.info("%s draining (grace %.1fs)", name, cfg.grace_s)
    for task in (watcher, beat):
        if task is not None:
            task.cancel()
    await service.enter_drain()
    drain = getattr(app, "drain", None)
    if drain is not None:
        await drain()
    await service.server.stop(cfg.grace_s)
    try:
        await app.close()
    except Exception:  # noqa: BLE001 - closing must not mask the exit code
        log.exception("%s close failed", name)
    if metrics_server is not None:
        metrics_server.close()
    log.info("%s stopped", name)
    return rc


def run_service(name: str, cfg_cls: type[C], build: Callable[[C, GrpcService], Awaitable[App]],
                argv: list[str] | None = None, internal: bool = True,
                access: Callable[[C], Access] | None = None) -> int:
    """Entry point body shared by `python -m services.<name>` and `kvpop-<name>`.
    `access(cfg)`: the public port's TLS and admission (read at start: bad
    files stop the service here, with their name)."""
    parser = argparse.ArgumentParser(prog=f"kvpop-{name}", description=f"KVpop {name} service")
    add_arguments(parser, cfg_cls)
    args = parser.parse_args(argv)
    try:
        cfg = load(cfg_cls, args)
        guard = access(cfg) if access is not None else None
    except (ConfigError, security.SecurityConfigError) as e:
        print(f"kvpop-{name}: error: {e}", file=sys.stderr)
        return 2
    configure_logging(cfg.log_level)
    telemetry.setup_tracing(name)
    try:
        rc = asyncio.run(serve(name, cfg, build, internal, guard))
    except RuntimeError as e:
        log.error("%s", e)
        rc = 1
    telemetry.shutdown_tracing()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is drained and flushed; skip interpreter teardown, which takes
    # seconds once torch is loaded and would only delay `kvpop down` and restarts.
    os._exit(rc)
