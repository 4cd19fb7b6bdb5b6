"""One stack for the reliability suite, started by the real `kvpop up` command
with the internal APIs on mutual TLS + the shared token (certificates from
tests/helpers/pki.py), on a freshly built placeholder model: the suite runs against the
configuration a production deployment uses."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from helpers.pki import make_pki
from kvpop.stack.up import Stack
from kvpop.stack.down import stop_stack
from kvpop.runtime.paths import REPO_ROOT
from kvpop.runtime.pb import generate_pb2_grpc
from .reliability_stack import (BLOCK_SIZE, DEFAULT_MAX_TOKENS, MAX_MODEL_LEN, SecureStack, clean_env,
                               tls_env)


@pytest.fixture(scope="session")
def placeholder_model(tmp_path_factory) -> Path:
    # Built here rather than read from models/default, which `kvpop train-model` overwrites.
    from kvpop.models.default_model import build_placeholder

    return build_placeholder(tmp_path_factory.mktemp("placeholder-model"), seed=0)


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


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
