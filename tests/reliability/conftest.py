"""One stack for the reliability suite, started by the real `kvpop up` command
with the internal APIs on mutual TLS + the shared token (certificates from
helpers_pki), on a freshly built placeholder model: the suite runs against the
configuration a production deployment uses."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from helpers_pki import make_pki
from kvpop.launcher import Stack
from kvpop.launcher_down import stop_stack
from kvpop.paths import REPO_ROOT
from kvpop.pb import compute_pb2, compute_pb2_grpc, generate_pb2, generate_pb2_grpc
from kvpop.security import SecurityConfig, sync_channel

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


def wait_until(cond, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def collect(stream):
    """(token ids, text, Finished or None) of a Generate stream."""
    ids, text, final = [], [], None
    for r in stream:
        if r.HasField("chunk"):
            assert final is None, "chunk after the final message"
            ids.extend(r.chunk.token_ids)
            text.append(r.chunk.text)
        else:
            final = r.finished
    return ids, "".join(text), final


@pytest.fixture(scope="session")
def placeholder_model(tmp_path_factory) -> Path:
    # Built here rather than read from models/default, which `kvpop train-model` overwrites.
    from kvpop.default_model import build_placeholder

    return build_placeholder(tmp_path_factory.mktemp("placeholder-model"), seed=0)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


class SecureStack:
    """The running stack plus what a test needs to reach and restart its parts."""

    def __init__(self, stack: Stack, env: dict[str, str], pki: Path):
        self.stack, self.env, self.pki = stack, env, pki
        self.client_security = SecurityConfig.from_env(tls_env(pki, "client"))

    def compute_info(self) -> compute_pb2.InfoResponse:
        with sync_channel(self.stack.proc("compute").address, self.client_security) as ch:
            return compute_pb2_grpc.ComputeStub(ch).Info(compute_pb2.InfoRequest(), timeout=10)

    def pool_idle(self) -> int:
        """Pages in use by nothing but the prefix cache (which keeps its pages on purpose)."""
        s = self.compute_info().stats
        return s.pages_used - int(s.extra.get("prefix_cache_pages", 0))


@pytest.fixture(scope="session")
def secure_stack(tmp_path_factory, pki, placeholder_model) -> SecureStack:
    state = tmp_path_factory.mktemp("kvpop-state")
    env = {**clean_env(), **tls_env(pki, "server"), "KVPOP_GRACE_S": "2", "KVPOP_NUM_PAGES": "8192",
           "KVPOP_MAX_MODEL_LEN": str(MAX_MODEL_LEN), "KVPOP_DEFAULT_MAX_TOKENS": str(DEFAULT_MAX_TOKENS)}
    up = subprocess.run([sys.executable, "-m", "kvpop.cli", "up", "--state-dir", str(state),
                         "--model", str(placeholder_model), "--block-size", str(BLOCK_SIZE), "--device", "cpu",
                         "--timeout", "240"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
    stack = Stack.load(state)
    if up.returncode != 0:
        if stack is not None:
            stop_stack(stack, grace=5)
        pytest.fail(f"kvpop up with internal TLS + token failed:\n{up.stderr[-3000:]}")
    assert stack is not None and up.stdout.strip() == stack.gateway
    yield SecureStack(stack, env, pki)
    down = subprocess.run([sys.executable, "-m", "kvpop.cli", "down", "--state-dir", str(state), "--grace", "10"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr


@pytest.fixture(scope="session")
def gateway_channel(secure_stack):
    with grpc.insecure_channel(secure_stack.stack.gateway) as ch:
        yield ch


@pytest.fixture(scope="session")
def gateway(gateway_channel):
    return generate_pb2_grpc.KVpopStub(gateway_channel)


def request(**kw) -> generate_pb2.GenerateRequest:
    kw.setdefault("prompt", "The quick brown fox jumps over the lazy dog.")
    return generate_pb2.GenerateRequest(**kw)
