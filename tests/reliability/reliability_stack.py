"""Helpers of the reliability suite (the fixtures are in conftest.py): the
stack's settings, credentials, and small stream utilities."""
from __future__ import annotations

import os
from pathlib import Path

from helpers.common import collect, wait_until  # noqa: F401  (re-exported)
from kvpop.stack.up import Stack
from kvpop.runtime.paths import REPO_ROOT
from kvpop.runtime.pb import compute_pb2, compute_pb2_grpc, generate_pb2
from kvpop.runtime.security import SecurityConfig, sync_channel

BLOCK_SIZE = 8
MAX_MODEL_LEN = 1024
DEFAULT_MAX_TOKENS = 8      # fuzzed requests that leave max_tokens unset stay short
TOKEN = "reliability-token"


def tls_env(pki: Path, leaf: str, token: str | None = TOKEN) -> dict[str, str]:
    env = {"KVPOP_TLS_CERT": str(pki / f"{leaf}.pem"), "KVPOP_TLS_KEY": str(pki / f"{leaf}.key"),
           "KVPOP_TLS_CA": str(pki / "ca.pem")}
    if token:
        env["KVPOP_INTERNAL_TOKEN"] = token
    return env


def clean_env() -> dict[str, str]:
    """The test process's environment without any KVPOP_/OTEL_ setting it may carry."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOP_", "OTEL_"))}
    env.update(OTEL_TRACES_EXPORTER="none", PYTHONPATH=str(REPO_ROOT))
    return env






class SecureStack:
    """The running stack plus what a test needs to reach and restart its parts."""

    def __init__(self, stack: Stack, env: dict[str, str], pki: Path):
        self.stack, self.env, self.pki = stack, env, pki
        self.client_security = SecurityConfig.from_env(tls_env(pki, "client"))

    def compute_info(self) -> compute_pb2.InfoResponse:
        with sync_channel(self.stack.proc("compute").address, self.client_security) as ch:
            return compute_pb2_grpc.ComputeStub(ch).Info(compute_pb2.InfoRequest(), timeout=10)

    def pool_idle(self) -> int:
        """Pages in use other than those the prefix cache and parked sessions keep on purpose:
        what running (or leaked) sequences hold."""
        s = self.compute_info().stats
        return s.pages_used - int(s.extra.get("prefix_cache_pages", 0)) - int(s.extra.get("session_pages", 0))


def request(**kw) -> generate_pb2.GenerateRequest:
    kw.setdefault("prompt", "The quick brown fox jumps over the lazy dog.")
    return generate_pb2.GenerateRequest(**kw)
