"""Health probe for containers and scripts: exit 0 iff the service is ready.

    python -m kvpop.runtime.healthcheck --grpc 127.0.0.1:50052 [--service NAME] [--timeout 5]
    python -m kvpop.runtime.healthcheck --grpc 127.0.0.1:50051 --plaintext
    python -m kvpop.runtime.healthcheck --http http://127.0.0.1:9091/healthz

--grpc calls grpc.health.v1.Health/Check (service "" = the whole server) and
succeeds only on SERVING; TLS follows the KVPOP_TLS_* variables (see
kvpop.runtime.security) unless --plaintext says the port has none (the public
gateway port, probed from a container that has the internal TLS settings). --http succeeds only on a 200 from the URL. Given both, both
must pass. Prints one line saying what it saw; exit 1 otherwise.
"""
from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpop.runtime.security import SecurityConfig, SecurityConfigError, sync_channel


def check_grpc(address: str, service: str = "", timeout: float = 5.0,
               plaintext: bool = False) -> tuple[bool, str]:
    try:
        cfg = SecurityConfig() if plaintext else SecurityConfig.from_env()
    except SecurityConfigError as e:
        return False, f"grpc {address}: {e}"
    with sync_channel(address, cfg) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return False, f"grpc {address}: {e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, f"grpc {address}: {status}"


def check_http(url: str, timeout: float = 5.0) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200, f"http {url}: {resp.status}"
    except urllib.error.HTTPError as e:
        return False, f"http {url}: {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return False, f"http {url}: {getattr(e, 'reason', e)}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpop.runtime.healthcheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grpc", metavar="HOST:PORT", help="grpc.health.v1 address")
    p.add_argument("--service", default="", help="service name for the gRPC check ('' = server)")
    p.add_argument("--plaintext", action="store_true",
                   help="the gRPC port has no TLS (ignore KVPOP_TLS_*): the public gateway port")
    p.add_argument("--http", metavar="URL", help="readiness URL, e.g. http://127.0.0.1:9100/healthz")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per check (default 5)")
    args = p.parse_args(argv)
    if not args.grpc and not args.http:
        p.error("give --grpc and/or --http")
    results = []
    if args.grpc:
        results.append(check_grpc(args.grpc, args.service, args.timeout, args.plaintext))
    if args.http:
        results.append(check_http(args.http, args.timeout))
    for _, line in results:
        print(line)
    return 0 if all(ok for ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
