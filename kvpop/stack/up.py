"""`kvpop up`: start redis (unless --redis-url), cache-manager, compute and
gateway as detached processes on free ports, wait until each reports SERVING on
grpc.health.v1, print the gateway address.

State lives in `<state dir>/stack.json` (default `.kvpop/`, or KVPOP_STATE_DIR),
logs in `<state dir>/logs/<service>.log`. `kvpop down` reads the state.
The integration tests start their stacks through `start_stack` too.

Closed by default: unless the environment already names an internal token
(`KVPOP_INTERNAL_TOKEN` or `KVPOP_INTERNAL_TOKEN_FILE`), a fresh random one is
written to `<state dir>/internal_token` (mode 0600) and every service reads it
from there (`KVPOP_INTERNAL_TOKEN_FILE`): compute and the cache-manager refuse
calls without it (UNAUTHENTICATED); the gateway and compute send it.

Secure by default: on a loopback address the public gateway may run without
API keys; on any other it needs a key file (`--api-keys-file`, made with
`kvpop keys new`) or the explicit opt-out `--allow-no-keys`, else `kvpop up`
refuses before starting anything (as Redis's protected mode does).

Supervised: once everything is SERVING, a supervisor process
(`kvpop/stack/supervisor.py`, recorded in stack.json as `supervisor`) restarts any
service that exits, with backoff, and reports a crash loop in
`<state dir>/supervisor.json` (`kvpop status`) and its log.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvpop.stack.down import stop_stack
from kvpop.models.fetch import estimator_arg, model_arg, resolve_model
from kvpop.runtime.paths import REPO_ROOT
from kvpop.stack.policy_names import POLICIES
from kvpop.stack.state import (CONTROL_DIR, SERVICES, STATE_FILE, SUPERVISOR, TOKEN_FILE, Proc, Stack,  # noqa: F401 (re-exported)
                         _died, default_state_dir, free_port, proc_start_time, proc_uptime)

_MODULES = {"cache-manager": "services.cache_manager", "compute": "services.compute", "gateway": "services.gateway"}


class LaunchError(RuntimeError):
    pass


def supervisor_of(stack: Stack) -> Proc | None:
    """The stack's supervisor if it is running (read from stack.json)."""
    disk = Stack.load(Path(stack.state_dir))
    if disk is None or not disk.has(SUPERVISOR):
        return None
    sup = disk.proc(SUPERVISOR)
    return sup if sup.alive() else None


def _spawn(stack: Stack, name: str, cmd: list[str], address: str, env: dict[str, str]) -> Proc:
    logs = Path(stack.state_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{name}.log"
    with open(log_path, "ab") as log:
        # Own session: the stack outlives `kvpop up`, and down signals the whole group.
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             cwd=REPO_ROOT, env=env, start_new_session=True)
    proc = Proc(name, p.pid, address, str(log_path), cmd, proc_start_time(p.pid))
    stack.processes.append(proc)
    stack.save()
    return proc


def log_tail(proc: Proc, lines: int = 15) -> str:
    try:
        text = Path(proc.log).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in text[-lines:])


def _probe_security(name: str, env: dict[str, str]):
    """How to reach `name`'s port: the internal services with the TLS settings
    they were started with, the public gateway port in plaintext."""
    from kvpop.runtime.security import SecurityConfig, SecurityConfigError

    if name == "gateway":
        return SecurityConfig()
    try:
        return SecurityConfig.from_env(env)
    except SecurityConfigError as e:
        raise LaunchError(str(e)) from None


def _serving(address: str, security=None) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvpop.runtime.security import SecurityConfig, sync_channel

    with sync_channel(address, security or SecurityConfig()) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.RpcError:
            return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


def _wait_redis(proc: Proc, port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        if _died(proc):
            raise LaunchError(f"redis-server exited; log {proc.log}:\n{log_tail(proc)}")
        time.sleep(0.05)
    raise LaunchError(f"redis-server did not answer PING; log {proc.log}")


def _check_redis_url(url: str) -> None:
    import redis

    try:
        redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2).ping()
    except (redis.RedisError, ValueError) as e:
        raise LaunchError(f"cannot reach Redis at {url}: {e}") from None


def start_stack(state_dir: Path, *, model: str | None = None, redis_url: str | None = None,
                port: int | None = None, host: str = "127.0.0.1", policy: str | None = None,
                service_args: dict[str, list[str]] | None = None, env: dict[str, str] | None = None,
                timeout: float = 180.0, progress=None, supervise: bool = True,
                internal_token: bool = True, api_keys_file: str | Path | None = None,
                allow_no_keys: bool = False) -> Stack:
    """Start everything and wait for SERVING; on failure stop what was started and raise LaunchError.

    internal_token: generate the stack's token unless `env` or the environment names one.
    supervise: start the supervisor once everything is SERVING (off: nothing restarts a dead service).
    api_keys_file: the gateway's API keys; allow_no_keys: serve a non-loopback host without them."""
    merged = {**os.environ, **(env or {})}
    keyed = bool(api_keys_file or merged.get("KVPOP_API_KEYS_FILE") or merged.get("KVPOP_API_KEYS"))
    from kvpop.runtime.config import is_loopback
    opted_out = allow_no_keys or merged.get("KVPOP_ALLOW_NO_KEYS", "").strip().lower() in ("1", "true", "yes", "on")
    if not (keyed or opted_out or is_loopback(host)):
        raise LaunchError(f"refusing to serve the public API on {host} without API keys: anyone who reaches it "
                          f"could use it and continue anyone's session. Make a key file with `kvpop keys new NAME "
                          f"--file FILE` and pass --api-keys-file FILE, or opt out with --allow-no-keys")
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    old = Stack.load(state_dir)
    if old is not None and any(p.alive() for p in old.processes):
        raise LaunchError(f"a stack is already running from {state_dir} (gateway {old.gateway}); "
                          f"run `kvpop down` first")
    say = progress or (lambda msg: None)
    if model:
        try:
            model = resolve_model(model)
        except ValueError as e:
            raise LaunchError(str(e)) from None
    stack = Stack(state_dir=str(state_dir))
    child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child_env.get("PYTHONPATH")]))
    from kvpop.runtime.security import ENV_TOKEN, ENV_TOKEN_FILE, write_token

    if internal_token and not child_env.get(ENV_TOKEN) and not child_env.get(ENV_TOKEN_FILE):
        # A fresh secret per stack, in a file only this user can read; the services read the file.
        stack.token_file = str(write_token(state_dir / TOKEN_FILE, secrets.token_hex(32)))
        child_env[ENV_TOKEN_FILE] = stack.token_file
    extra = service_args or {}
    deadline = time.monotonic() + timeout
    try:
        if not redis_url:
            exe = shutil.which("redis-server")
            if exe is None:
                raise LaunchError("redis-server not found on PATH (run scripts/setup.sh or pass --redis-url)")
            rport = free_port()
            rdir = state_dir / "redis"
            rdir.mkdir(exist_ok=True)
            # Append-only at `everysec`, as in compose: a killed (even SIGKILLed) Redis
            # comes back with the sessions, losing at most the last second of writes.
            rproc = _spawn(stack, "redis", [exe, "--port", str(rport), "--bind", "127.0.0.1", "--dir", str(rdir),
                                            "--save", "", "--appendonly", "yes", "--appendfsync", "everysec"],
                           f"127.0.0.1:{rport}", child_env)
            _wait_redis(rproc, rport, deadline)
            redis_url = f"redis://127.0.0.1:{rport}/0"
            say(f"redis      {redis_url}")
        else:
            _check_redis_url(redis_url)
        stack.redis_url = redis_url
        from services.cache_manager.planner import resolve_checkpoints
        # The folder, when it holds networks (the cache-manager loads them by the same rule).
        estimator = Path(model).resolve() if model else None
        if estimator is not None and not any(p.is_file() for p in resolve_checkpoints(estimator)):
            estimator = None
        ports = {"cache-manager": free_port(), "compute": free_port(), "gateway": port or free_port()}
        addr = {n: f"{host}:{p}" for n, p in ports.items()}
        # Clients reach a 0.0.0.0 listener through loopback.
        dial = {n: f"127.0.0.1:{p}" if host in ("0.0.0.0", "::") else addr[n] for n, p in ports.items()}
        # Fixed default metrics ports would collide between stacks on one host.
        mports = {n: free_port() for n in SERVICES}
        stack.metrics = {n: f"http://{dial[n].rsplit(':', 1)[0]}:{mports[n]}/metrics" for n in SERVICES}
        py = [sys.executable, "-m"]
        cmds = {
            # A model folder with its own networks (fetch-model places the shipped ones) gets them.
            "cache-manager": [*py, _MODULES["cache-manager"], "--port", str(ports["cache-manager"]), "--host", host,
                              *(["--estimator", str(estimator)] if estimator else [])],
            "compute": [*py, _MODULES["compute"], "--port", str(ports["compute"]), "--host", host,
                        "--cache-manager-address", dial["cache-manager"],
                        # Registry heartbeats (the gateway routes by them) and prewarm entries.
                        "--redis-url", redis_url, "--advertise-address", dial["compute"],
                        *(["--model", str(Path(model).resolve())] if model else [])],
            "gateway": [*py, _MODULES["gateway"], "--port", str(ports["gateway"]), "--host", host,
                        "--compute-address", dial["compute"], "--redis-url", redis_url,
                        *(["--default-policy", policy] if policy else []),
                        *(["--api-keys-file", str(Path(api_keys_file).resolve())] if api_keys_file else []),
                        *(["--allow-no-keys", "true"] if allow_no_keys else [])],
        }
        procs = {n: _spawn(stack, n, [*cmds[n], "--metrics-port", str(mports[n]), *extra.get(n, [])], dial[n],
                           child_env) for n in SERVICES}
        stack.gateway = dial["gateway"]
        stack.save()
        probe = {n: _probe_security(n, child_env) for n in SERVICES}
        waiting = list(SERVICES)
        while waiting:
            for name in list(waiting):
                p = procs[name]
                if _died(p):
                    raise LaunchError(f"{name} exited during start; log {p.log}:\n{log_tail(p)}")
                if _serving(p.address, probe[name]):
                    say(f"{name:<14} SERVING on {p.address}")
                    waiting.remove(name)
            if waiting and time.monotonic() > deadline:
                names = ", ".join(waiting)
                logs = ", ".join(procs[n].log for n in waiting)
                raise LaunchError(f"{names} not SERVING after {timeout:.0f}s; see {logs}")
            if waiting:
                time.sleep(0.1)
        if supervise:
            _start_supervisor(stack, child_env, deadline)
            say(f"{SUPERVISOR:<14} pid {stack.proc(SUPERVISOR).pid}")
    except BaseException:

        stop_stack(stack)
        raise
    return stack


def _start_supervisor(stack: Stack, env: dict[str, str], deadline: float) -> Proc:
    """Start the supervisor; from here on it alone writes stack.json (it adds itself)."""
    logs = Path(stack.state_dir) / "logs"
    log_path = logs / f"{SUPERVISOR}.log"
    cmd = [sys.executable, "-m", "kvpop.stack.supervisor", "--state-dir", stack.state_dir]
    with open(log_path, "ab") as log:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                             cwd=REPO_ROOT, env=env, start_new_session=True)
    end = max(deadline, time.monotonic() + 30)
    while True:
        disk = Stack.load(Path(stack.state_dir))
        if disk is not None and disk.has(SUPERVISOR) and disk.proc(SUPERVISOR).pid == p.pid:
            stack.processes = disk.processes
            return stack.proc(SUPERVISOR)
        if p.poll() is not None:
            tail = log_tail(Proc(SUPERVISOR, p.pid, "", str(log_path), cmd))
            raise LaunchError(f"the supervisor exited with {p.returncode}; log {log_path}:\n{tail}")
        if time.monotonic() > end:
            p.kill()
            raise LaunchError(f"the supervisor did not start; see {log_path}")
        time.sleep(0.05)


def _service_env(stack: Stack, env: dict[str, str] | None) -> dict[str, str]:
    from kvpop.runtime.security import ENV_TOKEN, ENV_TOKEN_FILE

    child_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), child_env.get("PYTHONPATH")]))
    if stack.token_file and not child_env.get(ENV_TOKEN):
        child_env[ENV_TOKEN_FILE] = stack.token_file
    return child_env


def wait_serving(stack: Stack, name: str, timeout: float, env: dict[str, str] | None = None) -> None:
    """Wait until `name` (as stack.json says now) answers: SERVING, or PONG for redis."""
    proc = stack.proc(name)
    deadline = time.monotonic() + timeout
    if name == "redis":
        _wait_redis(proc, int(proc.address.rsplit(":", 1)[1]), deadline)
        return
    security = _probe_security(name, _service_env(stack, env))
    while not _serving(proc.address, security):
        if _died(proc):
            raise LaunchError(f"{name} exited during restart; log {proc.log}:\n{log_tail(proc)}")
        if time.monotonic() > deadline:
            raise LaunchError(f"{name} not SERVING {timeout:.0f}s after restart; see {proc.log}")
        time.sleep(0.05)


def request_restart(state_dir: Path | str, name: str) -> Path:
    """Ask the supervisor to restart `name` (SIGTERM, its grace, then a new process)."""
    control = Path(state_dir) / CONTROL_DIR
    control.mkdir(exist_ok=True)
    path = control / f"restart-{name}"
    path.write_text(str(time.time()))
    return path


def restart_service(stack: Stack, name: str, env: dict[str, str] | None = None, timeout: float = 60.0) -> Proc:
    """`name` runs anew and is SERVING; returns its new Proc (and updates `stack`).

    Supervised stack: the supervisor restarts it (now, if it is still running;
    a dead one it restarts by itself) and this waits for the new process.
    Otherwise the service must be stopped (or killed) first, and this starts it
    again with its original command and address. `env`: the extra variables
    it was started with."""
    if supervisor_of(stack) is not None:
        return _restart_supervised(stack, name, env, timeout)
    old = stack.proc(name)
    if not _died(old):
        raise LaunchError(f"{name} is still running (pid {old.pid})")
    index = stack.processes.index(old)
    stack.processes.remove(old)
    proc = _spawn(stack, name, old.cmd, old.address, _service_env(stack, env))
    # Keep its place: `down` stops in reverse start order (gateway before compute before cache-manager).
    stack.processes.remove(proc)
    stack.processes.insert(index, proc)
    stack.save()
    wait_serving(stack, name, timeout, env)
    return proc


def _restart_supervised(stack: Stack, name: str, env: dict[str, str] | None, timeout: float) -> Proc:
    before = stack.proc(name)
    now = Stack.load(Path(stack.state_dir)).proc(name)
    if (now.pid, now.started) == (before.pid, before.started) and now.alive():
        request_restart(stack.state_dir, name)
    deadline = time.monotonic() + timeout
    while True:
        stack.reload()
        proc = stack.proc(name)
        if (proc.pid, proc.started) != (before.pid, before.started) and proc.alive():
            break
        if time.monotonic() > deadline:
            raise LaunchError(f"the supervisor did not restart {name} within {timeout:.0f}s; "
                              f"see {Path(stack.state_dir) / 'logs' / 'supervisor.log'}")
        time.sleep(0.05)
    wait_serving(stack, name, max(1.0, deadline - time.monotonic()), env)
    return proc


def _model_line(gateway: str) -> str:
    import grpc

    from kvpop.runtime.pb import generate_pb2, generate_pb2_grpc

    from kvpop.stack.gateway_channel import key_metadata

    try:
        with grpc.insecure_channel(gateway) as ch:
            m = generate_pb2_grpc.KVpopStub(ch).GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10,
                                                               metadata=key_metadata() or None)
    except grpc.RpcError as e:
        return f"unknown ({e.code().name}{': set KVPOP_API_KEY to see it' if e.code() == grpc.StatusCode.UNAUTHENTICATED else ''})"
    label = " — PLACEHOLDER: seeded random weights, output is noise" if m.placeholder else ""
    return (f"{m.name} ({m.architecture}, {m.num_layers} layers, {m.dtype} on {m.device}, "
            f"default policy {m.default_policy}){label}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_arg,
                   help="model folder (Hugging Face layout) or a fetched name (smollm2-135m, see `kvpop fetch-model`); "
                        "default: the embedded model")
    p.add_argument("--redis-url", help="use this Redis instead of starting one")
    p.add_argument("--port", type=int, help="gateway port (default: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="bind address of the services (other than loopback: "
                   "needs --api-keys-file or --allow-no-keys)")
    p.add_argument("--api-keys-file", type=Path, default=None,
                   help="the gateway's API keys (`kvpop keys new NAME --file FILE`); calls then need one")
    p.add_argument("--allow-no-keys", action="store_true",
                   help="serve a non-loopback --host without API keys (anyone reaching it may use it)")
    p.add_argument("--policy", metavar="POLICY",
                   help=f"the gateway's default eviction policy: {', '.join(POLICIES)} (default learned)")
    p.add_argument("--budget", help="the gateway's default KV budget per (layer, kv-head): tokens ('512') or a "
                                    "fraction of prompt + max tokens ('0.25', the default)")
    p.add_argument("--prefill", metavar="PROTOCOL",
                   help="the gateway's default prefill protocol (KVPOP_DEFAULT_PREFILL): held (the budget from the "
                        "first prompt chunk on), after (from the prompt's end on) or Nx (up to N times the budget "
                        "during prefill); default: kvpop/runtime/config.py's DEFAULT_PREFILL")
    p.add_argument("--device", help="compute device: cpu, cuda, auto")
    p.add_argument("--dtype", help="model dtype: float32, bfloat16, float16, auto")
    p.add_argument("--block-size", type=int, help="positions per block, the unit of eviction (default 1)")
    p.add_argument("--page-size", type=int, help="positions per KV page, the unit of memory (default 16)")
    p.add_argument("--estimator", type=estimator_arg, default=None,
                   help="value-estimation checkpoint(s) for the cache-manager: files or shipped names, "
                        "comma-separated (default: the model folder's estimator*.safetensors, routed by "
                        "prompt length), e.g. smollm2-135m-long")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="where stack.json and logs/ go (default: $KVPOP_STATE_DIR, else .kvpop)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for SERVING")
    p.add_argument("--no-supervisor", action="store_true",
                   help="start no supervisor: a service that exits stays down")


def run(args: argparse.Namespace) -> int:
    state_dir = args.state_dir.resolve() if args.state_dir else default_state_dir()
    compute = []
    for flag, value in (("--device", args.device), ("--dtype", args.dtype), ("--block-size", args.block_size),
                        ("--page-size", args.page_size)):
        if value is not None:
            compute += [flag, str(value)]
    gateway = ["--default-budget", args.budget] if args.budget is not None else []
    gateway += ["--default-prefill", args.prefill] if args.prefill is not None else []
    # After the folder's own on the command line: the last one wins.
    cache_manager = ["--estimator", str(args.estimator)] if args.estimator is not None else []
    try:
        stack = start_stack(state_dir, model=args.model, redis_url=args.redis_url, port=args.port, host=args.host,
                            policy=args.policy, service_args={"compute": compute, "gateway": gateway,
                                                          "cache-manager": cache_manager},
                            timeout=args.timeout, progress=lambda m: print(m, file=sys.stderr, flush=True),
                            supervise=not args.no_supervisor, api_keys_file=args.api_keys_file,
                            allow_no_keys=args.allow_no_keys)
    except LaunchError as e:
        print(f"kvpop up: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvpop up: interrupted; stopped what had started", file=sys.stderr)
        return 130
    print(f"model: {_model_line(stack.gateway)}", file=sys.stderr)
    print(f"gateway (gRPC, kvpop.v1.KVpop): {stack.gateway}", file=sys.stderr)
    print("metrics: " + ", ".join(f"{name} {url}" for name, url in stack.metrics.items()), file=sys.stderr)
    print(f"logs and state in {state_dir}", file=sys.stderr)
    if stack.token_file:
        print(f"internal token (compute, cache-manager) in {stack.token_file}, mode 0600", file=sys.stderr)
    if args.api_keys_file:
        print(f"API keys required (from {args.api_keys_file.resolve()}): kvpop generate --api-key KEY, "
              f"or KVPOP_API_KEY", file=sys.stderr)
    print(stack.gateway)     # stdout: the address alone, for scripts (ADDR=$(kvpop up))
    return 0
