"""A stack started by `kvpop up`: its processes (told apart from later
processes that reuse a pid) and its state file, `stack.json`. Shared by the
launcher, `kvpop down`, `kvpop status`, `kvpop restart` and the supervisor."""
from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_FILE = "stack.json"
TOKEN_FILE = "internal_token"
SUPERVISOR = "supervisor"
CONTROL_DIR = "control"      # under the state dir: requests to the supervisor (`kvpop restart`)
SERVICES = ("cache-manager", "compute", "gateway")


def default_state_dir() -> Path:
    return Path(os.environ.get("KVPOP_STATE_DIR", ".kvpop")).resolve()


_PORTS_GIVEN: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now and that this process has not handed out
    before: once a probe socket closes, the kernel may give the same ephemeral
    port to the next probe, and two services of one stack would then collide."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def proc_start_time(pid: int) -> str | None:
    """Kernel start time of pid: tells our process apart from a later one reusing its pid."""
    stat = _stat(pid)
    return None if stat is None else stat[19]


def proc_uptime(proc: "Proc") -> float | None:
    """Seconds since `proc` started (None when unknown)."""
    if not proc.started:
        return None
    try:
        since_boot = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError):
        return None
    return max(0.0, since_boot - int(proc.started) / os.sysconf("SC_CLK_TCK"))


@dataclass
class Proc:
    name: str
    pid: int
    address: str
    log: str
    cmd: list[str]
    started: str | None = None

    def alive(self) -> bool:
        stat = _stat(self.pid)
        # A zombie (exited, not yet reaped by its parent) still has its /proc entry.
        return stat is not None and self.started is not None and stat[19] == self.started and stat[0] != "Z"


@dataclass
class Stack:
    state_dir: str
    gateway: str = ""
    redis_url: str = ""
    processes: list[Proc] = field(default_factory=list)
    metrics: dict[str, str] = field(default_factory=dict)
    token_file: str = ""        # the internal token `kvpop up` generated ('' = none, or given by the caller)

    def save(self) -> None:
        path = Path(self.state_dir) / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, state_dir: Path) -> "Stack | None":
        path = Path(state_dir) / STATE_FILE
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        return cls(state_dir=raw["state_dir"], gateway=raw.get("gateway", ""), redis_url=raw.get("redis_url", ""),
                   processes=[Proc(**p) for p in raw.get("processes", [])], metrics=raw.get("metrics", {}),
                   token_file=raw.get("token_file", ""))

    def proc(self, name: str) -> Proc:
        return next(p for p in self.processes if p.name == name)

    def has(self, name: str) -> bool:
        return any(p.name == name for p in self.processes)

    def reload(self) -> "Stack":
        """Refresh this object from stack.json (the supervisor rewrites it when it restarts a service)."""
        disk = Stack.load(Path(self.state_dir))
        if disk is not None:
            self.processes, self.metrics, self.token_file = disk.processes, disk.metrics, disk.token_file
        return self

    def security(self, env: dict[str, str] | None = None):
        """How to call this stack's internal services: the TLS settings of `env`
        (default: this process's) and the stack's internal token."""
        from kvpop.runtime.security import ENV_TOKEN, ENV_TOKEN_FILE, SecurityConfig

        env = dict(os.environ if env is None else env)
        if self.token_file and not env.get(ENV_TOKEN):
            env[ENV_TOKEN_FILE] = self.token_file
        return SecurityConfig.from_env(env)


def _died(proc: Proc) -> bool:
    # When we are the parent (tests, a failed `up`), collect the exit status so no zombie lingers.
    try:
        os.waitpid(proc.pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return not proc.alive()
