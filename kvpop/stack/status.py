"""`kvpop status`: what a stack started by `kvpop up` is doing now.

One line per process: pid, uptime, restarts by the supervisor (and the last
exit), the supervisor's view (`restarting`, `CRASH LOOP`), and the health of
each grpc.health.v1 name (readiness `""` and the capability names, e.g.
compute's `advisor`). Exit status 0 when every service is up and SERVING and
the supervisor runs; 1 otherwise (a crash loop, a dead process, a service not
SERVING, a degraded capability); 2 when there is no stack.

`kvpop restart SERVICE` restarts one service (see kvpop.stack.restart).
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

from kvpop.stack.up import SUPERVISOR, Stack, default_state_dir, proc_uptime

EPILOG = ("Exit status: 0 when every service is up and SERVING and the supervisor runs; 1 otherwise "
          "(a crash loop, a dead process, a service not SERVING, a degraded capability); 2 when there is "
          "no stack in the state folder.")

# Health names each service reports besides readiness "" (services/*/server.py).
CAPABILITIES = {
    "gateway": ["kvpop.gateway.redis"],
    "compute": ["kvpop.compute.advisor", "kvpop.compute.redis"],
    "cache-manager": [],
}


def health(address: str, names: list[str], security, timeout: float = 2.0) -> dict[str, str]:
    """name -> SERVING / NOT_SERVING / SERVICE_UNKNOWN / the gRPC error code."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvpop.runtime.security import sync_channel

    out = {}
    with sync_channel(address, security) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in names:
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=timeout)
                out[name] = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            except grpc.RpcError as e:
                out[name] = "SERVICE_UNKNOWN" if e.code() == grpc.StatusCode.NOT_FOUND else e.code().name
    return out


def _redis_ping(address: str) -> str:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return "PONG" if s.recv(16).startswith(b"+PONG") else "NO PONG"
    except OSError as e:
        return f"UNREACHABLE ({e.strerror or e})"


def collect(stack: Stack, env: dict[str, str] | None = None) -> dict:
    """The status of every process of `stack` as a dict (what --json prints)."""
    from kvpop.runtime.security import SecurityConfig, SecurityConfigError
    from kvpop.stack.supervisor import STATUS_FILE

    try:
        sup_view = json.loads((Path(stack.state_dir) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        sup_view = {}
    tracks = sup_view.get("services", {})
    try:
        internal = stack.security(env)
    except SecurityConfigError as e:
        internal = None
        internal_error = str(e)
    out = {"state_dir": stack.state_dir, "gateway": stack.gateway, "ok": True, "processes": []}
    for p in stack.processes:
        alive = p.alive()
        row = {"name": p.name, "pid": p.pid, "address": p.address, "alive": alive,
               "uptime_s": proc_uptime(p) if alive else None, "log": p.log}
        t = tracks.get(p.name)
        if t is not None:
            row.update(state=t["state"], crash_loop=t["crash_loop"], restarts=t["restarts"],
                       last_exit=t["last_exit"], next_start_in=t["next_start_in"])
        if p.name == SUPERVISOR:
            row["ok"] = alive
        elif p.name == "redis":
            row["health"] = {"": _redis_ping(p.address)} if alive else {}
            row["ok"] = alive and row["health"][""] == "PONG"
        elif alive and p.name not in CAPABILITIES:
            row["ok"] = True        # not one of ours: alive is all we can say
        elif alive:
            names = ["", *CAPABILITIES[p.name]]
            if p.name == "gateway":
                row["health"] = health(p.address, names, SecurityConfig())
            elif internal is None:
                row["health"] = {"": f"cannot probe: {internal_error}"}
            else:
                row["health"] = health(p.address, names, internal)
            row["ok"] = all(v in ("SERVING", "SERVICE_UNKNOWN") for v in row["health"].values())
        else:
            row["health"], row["ok"] = {}, False
        row["ok"] = row["ok"] and not row.get("crash_loop", False)
        out["ok"] = out["ok"] and row["ok"]
        out["processes"].append(row)
    if not stack.has(SUPERVISOR):
        out["supervisor"] = "not started (nothing restarts a service that exits)"
    gw = next((r for r in out["processes"] if r["name"] == "gateway"), None)
    out["model"] = served_model(stack.gateway) if gw and gw["ok"] else None
    return out


def served_model(gateway: str, timeout: float = 5.0) -> str | None:
    """The served model's name (its folder's name: `default` for the embedded one), or None."""
    import grpc

    from kvpop.runtime.pb import generate_pb2, generate_pb2_grpc

    try:
        with grpc.insecure_channel(gateway) as ch:
            return generate_pb2_grpc.KVpopStub(ch).GetModelInfo(generate_pb2.GetModelInfoRequest(),
                                                                timeout=timeout).name
    except grpc.RpcError:
        return None


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def render(status: dict) -> str:
    lines = [f"stack in {status['state_dir']}, gateway {status['gateway']}, model {status.get('model') or '-'}"]
    if "supervisor" in status:
        lines.append(f"supervisor: {status['supervisor']}")
    for r in status["processes"]:
        parts = [f"{r['name']:<14}", f"pid {r['pid']:<7}",
                 f"up {_duration(r['uptime_s'])}" if r["alive"] else "DOWN"]
        if "restarts" in r:
            parts.append(f"restarts {r['restarts']}" + (f" (last: {r['last_exit']})" if r["last_exit"] else ""))
            if r.get("crash_loop"):
                parts.append(f"CRASH LOOP (see {r['log']})")
            if r["state"] == "restarting":
                parts.append(f"restarting in {r['next_start_in']:.1f} s")
            elif r["state"] == "stopping":
                parts.append("stopping for a restart")
        if r["name"] == SUPERVISOR:
            parts.append("running" if r["alive"] else "DOWN: nothing restarts the services")
        for name, v in (r.get("health") or {}).items():
            parts.append(v if not name else f"{name.rsplit('.', 1)[-1]} {v}")
        lines.append("  ".join(parts))
    lines.append("all up and SERVING" if status["ok"] else "NOT all up and SERVING")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, default=None, help="state folder of `kvpop up` (default .kvpop)")
    p.add_argument("--json", action="store_true", help="print the status as JSON")


def run(args: argparse.Namespace) -> int:
    state_dir = args.state_dir.resolve() if args.state_dir else default_state_dir()
    stack = Stack.load(state_dir)
    if stack is None:
        print(f"kvpop status: no stack state in {state_dir}", file=sys.stderr)
        return 2
    status = collect(stack)
    status["time"] = time.time()
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0 if status["ok"] else 1
