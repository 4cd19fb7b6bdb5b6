"""`python -m services.gateway` / `kvpop-gateway`."""
from __future__ import annotations

import sys

from kvpop.runtime.config import GatewayConfig
from kvpop.runtime.grpc_server import run_service


def public_access(cfg: GatewayConfig):
    """The public port's TLS (KVPOP_PUBLIC_TLS_*) and API-key check (KVPOP_API_KEYS*)."""
    from kvpop.runtime.security import SecurityConfig
    from services.gateway.apikeys import KeyRing
    from services.gateway.auth import ApiKeyInterceptor

    tls = SecurityConfig.server_files(("KVPOP_PUBLIC_TLS_CERT", cfg.public_tls_cert),
                                      ("KVPOP_PUBLIC_TLS_KEY", cfg.public_tls_key),
                                      ("KVPOP_PUBLIC_TLS_CA", cfg.public_tls_ca))
    keys = KeyRing(cfg.api_keys_file, cfg.api_keys)
    return tls, [ApiKeyInterceptor(keys)] if keys.enabled else []


def main(argv: list[str] | None = None) -> int:
    from services.gateway.server import build

    # Not the internal token or TLS (those guard compute and the cache-manager): its own.
    return run_service("gateway", GatewayConfig, build, argv, internal=False, access=public_access)


if __name__ == "__main__":
    sys.exit(main())
