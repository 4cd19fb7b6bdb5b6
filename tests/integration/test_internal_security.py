"""The three services with mutual TLS and the shared token on the internal
APIs (real processes, certificates made by openssl): traffic flows through
gateway -> compute -> cache-manager, strangers are refused, probes work."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import pytest

from helpers.common import stop_processes
from helpers.pki import make_pki
from kvpop.stack.up import free_port
from kvpop.runtime.paths import REPO_ROOT as REPO
from kvpop.runtime.pb import cache_manager_pb2, cache_manager_pb2_grpc, compute_pb2, compute_pb2_grpc
from kvpop.runtime.pb import generate_pb2, generate_pb2_grpc
from kvpop.runtime.security import SecurityConfig, sync_channel

pytestmark = pytest.mark.slow
TOKEN = "integration-token"


def _security_env(pki, leaf="server", token=TOKEN) -> dict[str, str]:
    env = {"KVPOP_TLS_CERT": str(pki / f"{leaf}.pem"), "KVPOP_TLS_KEY": str(pki / f"{leaf}.key"),
           "KVPOP_TLS_CA": str(pki / "ca.pem")}
    if token:
        env["KVPOP_INTERNAL_TOKEN"] = token
    return env


def _probe(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpop.runtime.healthcheck", "--grpc", address, "--timeout", "3"],
                          capture_output=True, text=True, timeout=60, env=env)


def test_stack_with_mutual_tls_and_token(tmp_path):
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    ports = {n: free_port() for n in ("cache-manager", "compute", "gateway")}
    addr = {n: f"127.0.0.1:{p}" for n, p in ports.items()}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOP_", "OTEL_"))}
    base.update(OTEL_TRACES_EXPORTER="none", KVPOP_LOG_LEVEL="WARNING", KVPOP_METRICS_PORT="-1",
                PYTHONPATH=str(REPO))
    env = {**base, **_security_env(pki)}
    specs = {
        "cache-manager": {"KVPOP_CACHE_MANAGER_PORT": str(ports["cache-manager"])},
        "compute": {"KVPOP_COMPUTE_PORT": str(ports["compute"]), "KVPOP_DEVICE": "cpu",
                    "KVPOP_MAX_MODEL_LEN": "512", "KVPOP_NUM_PAGES": "4096",
                    "KVPOP_CACHE_MANAGER_ADDRESS": addr["cache-manager"]},
        "gateway": {"KVPOP_GATEWAY_PORT": str(ports["gateway"]), "KVPOP_COMPUTE_ADDRESS": addr["compute"]},
    }
    procs = {}
    try:
        for name, extra in specs.items():
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", f"services.{name.replace('-', '_')}"], env={**env, **extra}, cwd=REPO,
                stdout=open(tmp_path / f"{name}.log", "w"), stderr=subprocess.STDOUT)
        # The public gateway port stays plaintext: it is SERVING only once it
        # reached compute over TLS with the token.
        deadline = time.monotonic() + 120
        while _probe(addr["gateway"], base).returncode != 0:
            for name, p in procs.items():
                assert p.poll() is None, f"{name}:\n" + (tmp_path / f"{name}.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "gateway not SERVING"
            time.sleep(0.3)
        # Internal probes with the TLS variables (no token needed for health) ...
        for name in ("compute", "cache-manager"):
            r = _probe(addr[name], {**base, **_security_env(pki, token=None)})
            assert r.returncode == 0 and "SERVING" in r.stdout, r.stdout + r.stderr
            # ... and without them the TLS port does not answer.
            assert _probe(addr[name], base).returncode == 1

        good = SecurityConfig.from_env(_security_env(pki, leaf="client"))
        with sync_channel(addr["compute"], good) as ch:
            compute = compute_pb2_grpc.ComputeStub(ch)
            deadline = time.monotonic() + 20
            while not compute.Info(compute_pb2.InfoRequest(), timeout=5).advisor_connected:
                assert time.monotonic() < deadline, "compute never reached the cache-manager over TLS"
                time.sleep(0.1)
            plans = compute.Info(compute_pb2.InfoRequest(), timeout=5).stats.extra["advisor_plans_received"]

            # A learned-policy request crosses all three services.
            with grpc.insecure_channel(addr["gateway"]) as gch:
                req = generate_pb2.GenerateRequest(prompt="the sky is blue . " * 8, max_tokens=200,
                                                   ignore_eos=True, policy="learned", budget_tokens=64)
                out = list(generate_pb2_grpc.KVpopStub(gch).Generate(req, timeout=120))
            assert out[-1].finished.usage.completion_tokens == 200
            assert compute.Info(compute_pb2.InfoRequest(), timeout=5).stats.extra["advisor_plans_received"] > plans

        # Strangers: right certificate but no token, wrong token, a certificate
        # from another CA.
        for cfg, code in ((SecurityConfig.from_env(_security_env(pki, leaf="client", token=None)),
                           grpc.StatusCode.UNAUTHENTICATED),
                          (SecurityConfig.from_env(_security_env(pki, leaf="client", token="nope")),
                           grpc.StatusCode.UNAUTHENTICATED),
                          (SecurityConfig.from_env(_security_env(pki, leaf="rogue")),
                           grpc.StatusCode.UNAVAILABLE)):
            with sync_channel(addr["compute"], cfg) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    compute_pb2_grpc.ComputeStub(ch).Info(compute_pb2.InfoRequest(), timeout=5)
                assert e.value.code() == code
            with sync_channel(addr["cache-manager"], cfg) as ch:
                stream = cache_manager_pb2_grpc.CacheManagerStub(ch).Advise(
                    iter([cache_manager_pb2.AdvisorMessage()]), timeout=5)
                with pytest.raises(grpc.RpcError) as e:
                    list(stream)
                assert e.value.code() == code
        with grpc.insecure_channel(addr["compute"]) as ch:
            with pytest.raises(grpc.RpcError) as e:
                compute_pb2_grpc.ComputeStub(ch).Info(compute_pb2.InfoRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stop_processes(procs.values())
