"""`kvpop down`: stop a stack started by `kvpop up`, then remove its state.

The supervisor first (so it restarts nothing), then one process group at a
time, newest first (gateway, compute, cache-manager, redis), so each drains
its in-flight streams while what it calls still runs: SIGTERM, then SIGKILL
after the grace period. The stack's internal token file goes with the state."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import shutil

from kvpop.stack.state import STATE_FILE, SUPERVISOR, TOKEN_FILE, Proc, Stack, _died, default_state_dir


def _signal(proc: Proc, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(proc.pid, sig)


def _gone(proc: Proc) -> bool:
    return _died(proc)


def stop_process(p: Proc, grace: float = 15.0) -> bool:
    """SIGTERM, wait up to `grace`, SIGKILL. Returns True if it needed SIGKILL."""
    if not p.alive():
        return False
    _signal(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not _gone(p):
        time.sleep(0.05)
    if _gone(p):
        return False
    _signal(p, signal.SIGKILL)
    end = time.monotonic() + 5
    while not _gone(p) and time.monotonic() < end:
        time.sleep(0.02)
    return True


def stop_processes(procs: list[Proc], grace: float = 15.0) -> list[str]:
    """Stop in the given order, one at a time; returns the names that needed SIGKILL."""
    return [p.name for p in procs if stop_process(p, grace)]


def stop_stack(stack: Stack, grace: float = 15.0) -> list[str]:
    # The supervisor rewrites stack.json when it restarts something: stop it, then read the final list.
    sup = [p for p in stack.processes if p.name == SUPERVISOR]
    killed = stop_processes(sup, grace)
    disk = Stack.load(Path(stack.state_dir))
    procs = disk.processes if disk is not None and sup else stack.processes
    killed += stop_processes([p for p in reversed(procs) if p.name != SUPERVISOR], grace)
    state = Path(stack.state_dir)
    (state / STATE_FILE).unlink(missing_ok=True)
    (state / TOKEN_FILE).unlink(missing_ok=True)
    (state / "supervisor.json").unlink(missing_ok=True)
    shutil.rmtree(state / "control", ignore_errors=True)
    return killed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, default=None, help="state folder of `kvpop up` (default .kvpop)")
    p.add_argument("--grace", type=float, default=15.0, help="seconds between SIGTERM and SIGKILL")


def run(args: argparse.Namespace) -> int:
    state_dir = args.state_dir.resolve() if args.state_dir else default_state_dir()
    stack = Stack.load(state_dir)
    if stack is None:
        print(f"kvpop down: no stack state in {state_dir}", file=sys.stderr)
        return 1
    running = [p.name for p in reversed(stack.processes) if p.alive()]
    killed = stop_stack(stack, args.grace)
    print(f"stopped {', '.join(running) or 'nothing (already gone)'}"
          + (f"; killed after {args.grace:g}s: {', '.join(killed)}" if killed else ""), file=sys.stderr)
    return 0
