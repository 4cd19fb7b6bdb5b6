"""`python -m services.cache_manager` / `kvpop-cache-manager`."""
from __future__ import annotations

import sys

from kvpop.runtime.config import CacheManagerConfig
from kvpop.runtime.grpc_server import run_service


def main(argv: list[str] | None = None) -> int:
    from services.cache_manager.server import build

    return run_service("cache-manager", CacheManagerConfig, build, argv)


if __name__ == "__main__":
    sys.exit(main())
