"""How a client reaches the public gateway: its API key and, when the port
serves TLS, the CA that signed it (and a client certificate, when asked)."""
from __future__ import annotations

import os
from pathlib import Path

import grpc

ENV_API_KEY = "KVPOP_API_KEY"
ENV_GATEWAY_CA = "KVPOP_GATEWAY_CA"


def key_metadata(key: str | None = None) -> tuple[tuple[str, str], ...]:
    """`authorization: Bearer KEY` metadata (`key`, else KVPOP_API_KEY; none without either)."""
    key = key or os.environ.get(ENV_API_KEY, "")
    return (("authorization", f"Bearer {key}"),) if key else ()


def public_channel(address: str, ca: str | Path | None = None, cert: str | Path | None = None,
                   key: str | Path | None = None) -> grpc.Channel:
    """A blocking channel: TLS when `ca` (else KVPOP_GATEWAY_CA) names the CA, plaintext otherwise."""
    ca = ca or os.environ.get(ENV_GATEWAY_CA) or None
    if ca is None:
        return grpc.insecure_channel(address)
    creds = grpc.ssl_channel_credentials(root_certificates=Path(ca).read_bytes(),
                                         private_key=Path(key).read_bytes() if key else None,
                                         certificate_chain=Path(cert).read_bytes() if cert else None)
    return grpc.secure_channel(address, creds)
