"""`python -m services.gateway` / `kvpop-gateway`."""
from __future__ import annotations

import sys

from kvpop.config import GatewayConfig
from kvpop.grpc_server import run_service


def main(argv: list[str] | None = None) -> int:
    from services.gateway.server import build

    # The public port: no internal token or TLS (those guard compute and the cache-manager).
    return run_service("gateway", GatewayConfig, build, argv, internal=False)


if __name__ == "__main__":
    sys.exit(main())
