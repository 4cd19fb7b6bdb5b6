"""`kvpop up` with the internal APIs on mutual TLS + the shared token: it
comes up (its health wait probes each service with the right credentials),
the public port stays plaintext, strangers are refused, and every port is
bound to 127.0.0.1 unless KVPOP_HOST says otherwise."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from .reliability_stack import clean_env, collect, request, tls_env, wait_until
from kvpop.stack.up import free_port
from kvpop.runtime.paths import REPO_ROOT
from kvpop.runtime.pb import compute_pb2, compute_pb2_grpc
from kvpop.runtime.security import SecurityConfig, sync_channel


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket `pid` listens on, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:     # 0A = LISTEN
                continue
            raw, port = f[1].split(":")
            b = bytes.fromhex(raw)
            # /proc prints each 32-bit word in host (little-endian) order.
            b = b"".join(b[i:i + 4][::-1] for i in range(0, len(b), 4))
            host = socket.inet_ntop(family, b)
            # gRPC may bind an IPv6 socket to the v4-mapped address: the same loopback.
            out.add((host.removeprefix("::ffff:"), int(port, 16)))
    return out


def probe(address: str, env: dict[str, str], plaintext: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpop.runtime.healthcheck", "--grpc", address, "--timeout", "5",
                           *(["--plaintext"] if plaintext else [])],
                          capture_output=True, text=True, timeout=60, env=env, cwd=REPO_ROOT)


def test_up_with_tls_and_token_serves_through_all_services(secure_stack, gateway):
    st = secure_stack.stack
    # A learned-policy request crosses gateway -> compute -> cache-manager over mTLS + token.
    wait_until(lambda: secure_stack.compute_info().advisor_connected, 30, "compute to reach the cache-manager")
    plans_before = secure_stack.compute_info().stats.extra["advisor_plans_received"]
    ids, _, final = collect(gateway.Generate(request(max_tokens=120, ignore_eos=True, policy="learned",
                                                     budget_tokens=64), timeout=120))
    assert final is not None and len(ids) == 120 == final.usage.completion_tokens
    assert secure_stack.compute_info().stats.extra["advisor_plans_received"] > plans_before
    # Every eviction was ranked by the cache-manager over mTLS (its heuristic: no estimator fits this model).
    u = final.usage
    assert u.kv_blocks_evicted > 0 and u.advisor_heuristic_evictions + u.network_evictions == u.kv_blocks_evicted, u
    # The same probe the containers use: internal ports with the TLS variables, the gateway without.
    for name in ("compute", "cache-manager"):
        r = probe(st.proc(name).address, {**clean_env(), **tls_env(secure_stack.pki, "client", token=None)})
        assert r.returncode == 0 and "SERVING" in r.stdout, r.stdout + r.stderr
        assert probe(st.proc(name).address, clean_env()).returncode == 1, "plaintext must not reach a TLS port"
    r = probe(st.gateway, {**clean_env(), **tls_env(secure_stack.pki, "client")}, plaintext=True)
    assert r.returncode == 0 and "SERVING" in r.stdout, r.stdout + r.stderr


def test_internal_apis_refuse_strangers(secure_stack):
    compute = secure_stack.stack.proc("compute").address
    pki = secure_stack.pki
    for cfg, code in ((SecurityConfig.from_env(tls_env(pki, "client", token=None)), grpc.StatusCode.UNAUTHENTICATED),
                      (SecurityConfig.from_env(tls_env(pki, "client", token="wrong")), grpc.StatusCode.UNAUTHENTICATED),
                      (SecurityConfig.from_env(tls_env(pki, "rogue")), grpc.StatusCode.UNAVAILABLE),
                      (SecurityConfig(), grpc.StatusCode.UNAVAILABLE)):
        with sync_channel(compute, cfg) as ch:
            with pytest.raises(grpc.RpcError) as e:
                compute_pb2_grpc.ComputeStub(ch).Info(compute_pb2.InfoRequest(), timeout=10)
            assert e.value.code() == code, (cfg.token, e.value)
    assert secure_stack.compute_info().model.num_layers > 0


def test_every_port_binds_loopback_by_default(secure_stack):
    st = secure_stack.stack.reload()    # pids as the supervisor last wrote them
    for p in st.processes:
        ports = listening(p.pid)
        if p.name == "supervisor":
            assert not ports, f"the supervisor listens on {ports}"
            continue
        want = {int(p.address.rsplit(":", 1)[1])}
        if p.name in st.metrics:
            want.add(int(st.metrics[p.name].rsplit(":", 1)[1].split("/")[0]))
        assert want <= {port for _, port in ports}, (p.name, ports, want)
        assert {host for host, _ in ports} == {"127.0.0.1"}, (p.name, ports)


def test_host_setting_exposes_the_port(tmp_path):
    """KVPOP_HOST=0.0.0.0 is the way to expose a service (the compose file does; the
    public gateway then needs API keys or the explicit opt-out)."""
    port, mport = free_port(), free_port()
    env = {**clean_env(), "KVPOP_HOST": "0.0.0.0", "KVPOP_ALLOW_NO_KEYS": "true", "KVPOP_GATEWAY_PORT": str(port),
           "KVPOP_METRICS_PORT": str(mport), "KVPOP_COMPUTE_ADDRESS": f"127.0.0.1:{free_port()}"}
    with open(tmp_path / "gateway.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.gateway"], env=env, cwd=REPO_ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        # It listens (NOT_SERVING: no compute) on every interface.
        ports = wait_until(lambda: proc.poll() is None and {port, mport} <= {p for _, p in listening(proc.pid)}
                           and listening(proc.pid), 60, "the gateway to listen", interval=0.1)
        # gRPC takes 0.0.0.0 as the dual-stack wildcard "::".
        assert {h for h, p in ports if p in (port, mport)} <= {"0.0.0.0", "::"}, ports
    finally:
        proc.terminate()
        assert proc.wait(20) == 0, (tmp_path / "gateway.log").read_text()[-2000:]
