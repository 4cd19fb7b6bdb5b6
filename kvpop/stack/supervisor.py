"""The supervisor of a stack started by `kvpop up`: restarts what exits.

    python -m kvpop.stack.supervisor --state-dir DIR      (started by `kvpop up`)

Every `POLL_S` it looks at each process of `<state dir>/stack.json` (by pid
and kernel start time, so a reused pid is not mistaken for ours). When one
has exited, for whatever reason (crash, SIGKILL, OOM killer, exit 0), it is
started again with its original command, address and environment, and
stack.json is rewritten with the new pid. A run is **good** when the
process became ready (grpc.health.v1 SERVING; redis: PONG), which the
supervisor checks every `READY_POLL_S` after a start, or lasted `STABLE_S`.
Restart delays:

- after a good run: at once (however soon it was killed after that);
- after each run in a row that was not good (a failed start): 0.5 s, 1 s,
  2 s, ... up to `MAX_DELAY_S`;
- from `CRASH_LOOP_AFTER` such failed runs in a row the service is in a
  **crash loop**: it is still retried every `MAX_DELAY_S` at most, and the
  loop is reported, never hidden: a line in `logs/supervisor.log` with the
  last lines of the service's own log, `crash_loop: true` in
  `supervisor.json` (until a run is good), and `kvpop status` exits 1
  saying so.

Each restart also writes one line into the service's own log
(`---- kvpop supervisor: ... ----`), so its log reads as one story.

`<state dir>/supervisor.json` holds the current view (rewritten on every
change and every second): per service its pid, state (`running`,
`restarting`, `stopping`), whether it is in a crash loop, restarts so far, the last exit
(`exit code N`, `signal SIGKILL`, or `exited` when the process was not the
supervisor's child and its status cannot be known) and when.

Control: `kvpop restart SERVICE` drops a file `control/restart-SERVICE`;
the supervisor stops that service (SIGTERM, its grace, SIGKILL) and starts it
again at once. SIGTERM/SIGINT stop the supervisor alone (`kvpop down` stops
it first, then the services).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpop.stack.up import SUPERVISOR, Proc, Stack, log_tail, proc_start_time
from kvpop.runtime.paths import REPO_ROOT
from kvpop.stack.state import CONTROL_DIR

log = logging.getLogger("kvpop.stack.supervisor")

STATUS_FILE = "supervisor.json"
POLL_S = 0.05
STABLE_S = 30.0
READY_POLL_S = 0.25
BASE_DELAY_S = 0.5
MAX_DELAY_S = 30.0
CRASH_LOOP_AFTER = 3
STOP_GRACE_S = 15.0


def restart_delay(quick_exits: int) -> float:
    """Seconds before the next start, after `quick_exits` runs in a row that were not good
    (0 = the last run was good)."""
    if quick_exits <= 0:
        return 0.0
    return min(MAX_DELAY_S, BASE_DELAY_S * 2 ** (quick_exits - 1))


@dataclass
class Track:
    name: str
    pid: int
    state: str = "running"          # running | restarting (waiting for its delay) | stopping (requested)
    crash_loop: bool = False        # CRASH_LOOP_AFTER failed runs in a row; cleared by a good run
    ready: bool = True              # this run became ready (SERVING / PONG)
    restarts: int = 0
    quick_exits: int = 0            # runs in a row that ended before they were good
    last_exit: str = ""
    last_exit_at: float = 0.0       # wall clock
    next_start_in: float = 0.0      # seconds, while restarting
    started_mono: float = 0.0       # when it started, as this supervisor knows it (monotonic)
    due: float = 0.0                # monotonic time of the next start, while restarting
    requested: bool = False         # a `kvpop restart`: no backoff, not counted as a failure


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def _ready(proc: Proc) -> bool:
    """Whether `proc` answers as ready: SERVING on grpc.health.v1 (redis: PONG). Services that
    are not ours (no address) count as ready once alive."""
    if not proc.address:
        return True
    host, port = proc.address.rsplit(":", 1)
    if proc.name == "redis":
        try:
            with socket.create_connection((host, int(port)), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvpop.runtime.security import SecurityConfig, SecurityConfigError, sync_channel

    try:
        # The public gateway port is plaintext; internal ones follow this process's KVPOP_TLS_* (as started).
        cfg = SecurityConfig() if proc.name == "gateway" else SecurityConfig.from_env()
    except SecurityConfigError:
        return False
    with sync_channel(proc.address, cfg) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=0.5)
        except grpc.RpcError:
            return False
    return r.status == health_pb2.HealthCheckResponse.SERVING


class Supervisor:
    def __init__(self, state_dir: Path, poll_s: float = POLL_S):
        self.state_dir = Path(state_dir).resolve()
        self.poll_s = poll_s
        self.stop_event = threading.Event()
        stack = Stack.load(self.state_dir)
        if stack is None:
            raise SystemExit(f"kvpop supervisor: no stack.json in {self.state_dir}")
        self.stack = stack
        me = Proc(SUPERVISOR, os.getpid(), "", str(self.state_dir / "logs" / f"{SUPERVISOR}.log"),
                  [sys.executable, "-m", "kvpop.stack.supervisor", "--state-dir", str(self.state_dir)],
                  proc_start_time(os.getpid()))
        self.stack.processes = [p for p in self.stack.processes if p.name != SUPERVISOR] + [me]
        self.stack.save()
        now = time.monotonic()
        # `kvpop up` hands over services it saw SERVING.
        self.tracks = {p.name: Track(p.name, p.pid, started_mono=now - STABLE_S)
                       for p in self.stack.processes if p.name != SUPERVISOR}
        self._next_probe = 0.0
        self._last_status = 0.0
        # Processes this supervisor started (it reaps them, so it knows how they ended); those
        # `kvpop up` started are not its children: how they ended cannot be known ("exited").
        self._children: dict[int, subprocess.Popen] = {}
        self.write_status()
        log.info("supervising %s from %s", ", ".join(self.tracks), self.state_dir)

    # ------------------------------------------------------------ status
    def write_status(self) -> None:
        data = {"pid": os.getpid(), "updated_at": time.time(),
                "services": {n: asdict(t) for n, t in self.tracks.items()}}
        path = self.state_dir / STATUS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)
        self._last_status = time.monotonic()

    # ------------------------------------------------------------ the loop
    def run(self) -> None:
        while not self.stop_event.is_set():
            changed = self.step(time.monotonic())
            if changed or time.monotonic() - self._last_status > 1.0:
                self.write_status()
            self.stop_event.wait(self.poll_s)
        self.write_status()
        log.info("supervisor stopped; the services keep running")

    def step(self, now: float) -> bool:
        changed = self._take_requests(now)
        probe = now >= self._next_probe
        if probe:
            self._next_probe = now + READY_POLL_S
        for name, t in self.tracks.items():
            proc = self.stack.proc(name)
            if t.state in ("running", "stopping"):
                if proc.alive():
                    if not t.ready and (now - t.started_mono >= STABLE_S or (probe and _ready(proc))):
                        t.ready = True
                        log.info("%s (pid %d) ready %.1f s after its start", name, proc.pid, now - t.started_mono)
                        if t.crash_loop:
                            log.info("%s is out of its crash loop", name)
                        t.crash_loop, t.quick_exits = False, 0
                        changed = True
                    continue
                self._exited(t, proc, self._exit_status(proc.pid), now)
                changed = True
            if t.state == "restarting":
                t.next_start_in = max(0.0, t.due - now)
                if now >= t.due:
                    self._start(t, proc, now)
                    changed = True
        return changed

    def _exit_status(self, pid: int) -> str:
        child = self._children.pop(pid, None)
        if child is None:
            return "exited"
        try:
            rc = child.wait(1.0)
        except subprocess.TimeoutExpired:
            return "exited"
        return _describe(rc)

    def _exited(self, t: Track, proc: Proc, status: str, now: float) -> None:
        up = now - t.started_mono
        t.last_exit, t.last_exit_at, t.state = status, time.time(), "restarting"
        if t.requested:
            # `kvpop status` then reads `restarts N (last: restart requested)`, not a failure.
            t.requested, t.due, t.last_exit = False, now, "restart requested"
            log.info("%s (pid %d) stopped for a requested restart (%s)", t.name, proc.pid, status)
            return
        t.quick_exits = 0 if t.ready or up >= STABLE_S else t.quick_exits + 1
        delay = restart_delay(t.quick_exits)
        t.due = now + delay
        if t.quick_exits >= CRASH_LOOP_AFTER:
            t.crash_loop = True
            log.error("%s is crash-looping: %d runs in a row ended before it was ready (last: %s); "
                      "next try in %.1f s. Last lines of %s:\n%s", t.name, t.quick_exits, status,
                      delay, proc.log, log_tail(proc, 20))
        else:
            log.warning("%s (pid %d) %s after %.1f s up; restarting %s", t.name, proc.pid, status, up,
                        "now" if delay == 0 else f"in {delay:.1f} s")

    def _start(self, t: Track, old: Proc, now: float) -> None:
        t.restarts += 1
        note = (f"---- kvpop supervisor: {t.name} {t.last_exit or 'stopped'}; restart {t.restarts} "
                f"at {time.strftime('%Y-%m-%d %H:%M:%S')} ----\n")
        try:
            with open(old.log, "ab") as f:
                f.write(note.encode())
                f.flush()
                p = subprocess.Popen(old.cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                     cwd=REPO_ROOT, env=os.environ, start_new_session=True)
        except OSError as e:
            t.quick_exits += 1
            t.crash_loop = t.crash_loop or t.quick_exits >= CRASH_LOOP_AFTER
            t.last_exit = f"could not start: {e}"
            t.due = now + restart_delay(t.quick_exits)
            log.error("%s could not be started: %s", t.name, e)
            return
        self._children[p.pid] = p
        new = Proc(t.name, p.pid, old.address, old.log, old.cmd, proc_start_time(p.pid))
        self.stack.processes[self.stack.processes.index(old)] = new
        self.stack.save()
        t.pid, t.started_mono, t.next_start_in, t.state, t.ready = p.pid, now, 0.0, "running", False
        log.info("%s started again as pid %d (restart %d)", t.name, p.pid, t.restarts)

    def _take_requests(self, now: float) -> bool:
        control = self.state_dir / CONTROL_DIR
        if not control.is_dir():
            return False
        changed = False
        for f in control.glob("restart-*"):
            name = f.name.removeprefix("restart-")
            f.unlink(missing_ok=True)
            t = self.tracks.get(name)
            if t is None:
                log.warning("restart requested for %r: not a service of this stack", name)
                continue
            log.info("restart of %s requested", name)
            changed = True
            if t.state == "restarting":
                t.due = now         # waiting out a backoff: start it now
                continue
            if t.state == "stopping":
                continue
            t.requested, t.state = True, "stopping"
            threading.Thread(target=self._stop, args=(self.stack.proc(name),), daemon=True).start()
        return changed

    @staticmethod
    def _stop(proc: Proc) -> None:
        from kvpop.stack.down import stop_process

        stop_process(proc, STOP_GRACE_S)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvpop.stack.supervisor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-dir", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sup = Supervisor(args.state_dir)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sup.stop_event.set())
    sup.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
