"""`python -m services.compute` / `kvpop-compute`."""
from __future__ import annotations

import sys

from kvpop.runtime.config import ComputeConfig
from kvpop.runtime.grpc_server import run_service


def main(argv: list[str] | None = None) -> int:
    from services.compute.server import build

    return run_service("compute", ComputeConfig, build, argv)


if __name__ == "__main__":
    sys.exit(main())
