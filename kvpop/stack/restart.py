"""`kvpop restart SERVICE`: restart one service of a stack started by `kvpop up`.

With the supervisor running, it stops the service (SIGTERM: the service
drains, then SIGKILL after the grace) and starts it again at once with its
original command and address; without one (a stack started with
`supervise=False`), this command does both itself. Either way it returns
once the new process is SERVING (redis: answers PING) and prints its pid.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpop.stack.up import SUPERVISOR, LaunchError, Stack, default_state_dir, restart_service, supervisor_of


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("service", help="redis, cache-manager, compute or gateway")
    p.add_argument("--state-dir", type=Path, default=None, help="state folder of `kvpop up` (default .kvpop)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for SERVING")


def run(args: argparse.Namespace) -> int:
    from kvpop.stack.down import stop_process

    state_dir = args.state_dir.resolve() if args.state_dir else default_state_dir()
    stack = Stack.load(state_dir)
    if stack is None:
        print(f"kvpop restart: no stack state in {state_dir}", file=sys.stderr)
        return 2
    names = [p.name for p in stack.processes if p.name != SUPERVISOR]
    if args.service not in names:
        print(f"kvpop restart: {args.service!r} is not in this stack ({', '.join(names)})", file=sys.stderr)
        return 2
    old = stack.proc(args.service)
    try:
        if supervisor_of(stack) is None:
            stop_process(old)
        new = restart_service(stack, args.service, timeout=args.timeout)
    except LaunchError as e:
        print(f"kvpop restart: error: {e}", file=sys.stderr)
        return 1
    print(f"{args.service} restarted: pid {old.pid} -> {new.pid}, SERVING on {new.address}", file=sys.stderr)
    return 0
