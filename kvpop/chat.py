"""`kvpop chat`: an interactive chat with a running gateway. Every line is the
user's next turn of one session, so the server keeps the conversation (its KV,
and its history in Redis) and each turn sends only the new message; replies
stream as they are generated. Commands: /usage (the last turn's usage line),
/reset (a new session: the conversation starts over), /quit (or end of input).
Only the generated stubs and grpc are needed (no torch)."""
from __future__ import annotations

import argparse
import sys
import time
import uuid

from kvpop.stack.generate import add_connection_arguments, build_request, gateway_address, usage_line
from kvpop.flags import add_budget
from kvpop.stack.policy_names import POLICIES

EPILOG = "Commands: /usage, /reset, /quit. Exit status: 0 at /quit or end of input, 1 when the gateway is unreachable."
HELP = "type a message; /usage shows the last turn's usage, /reset starts over, /quit leaves"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--session", help="continue this session (default: a new one)")
    p.add_argument("--system", metavar="TEXT", help="a system message before the first message typed")
    p.add_argument("--max-tokens", type=int, help="most tokens per reply (server default 128)")
    p.add_argument("--temperature", type=float, help="sampling temperature >= 0; 0 (the default) is greedy")
    p.add_argument("--policy", metavar="POLICY",
                   help=f"eviction policy: {', '.join(POLICIES)} (default: the server's)")
    add_budget(p, help="KV budget per (layer, kv-head) the session holds whatever the chat's length: tokens "
                       "(512) or a fraction (0.25); default: the server's (KVPOP_DEFAULT_BUDGET)")
    add_connection_arguments(p, timeout_help="deadline per turn in seconds")


def _turn_args(args: argparse.Namespace, session: str, message: str, first: bool) -> argparse.Namespace:
    """The `kvpop generate --chat MESSAGE --session ID` arguments of one turn."""
    from kvpop.stack import generate as client
    p = argparse.ArgumentParser()
    client.add_arguments(p)
    turn = p.parse_args(["--chat", message, "--session", session])
    for name in ("max_tokens", "temperature", "policy", "budget"):
        setattr(turn, name, getattr(args, name))
    turn.system = args.system if first else None
    return turn


def new_session() -> str:
    return f"chat-{uuid.uuid4().hex[:16]}"


def run(args: argparse.Namespace) -> int:
    import grpc

    from kvpop.stack.gateway_channel import key_metadata, public_channel
    from kvpop.runtime.pb import generate_pb2_grpc

    address = gateway_address(args)
    # --system goes with this REPL's first turn (a system message later in a chat is the template's to take).
    session, first, last = args.session or new_session(), True, "no turn yet"
    interactive = sys.stdin.isatty()
    print(f"session {session} ({HELP})", file=sys.stderr)
    with public_channel(address, args.ca) as channel:
        stub = generate_pb2_grpc.KVpopStub(channel)
        md = key_metadata(args.api_key) or None
        while True:
            try:
                line = input("> " if interactive else "")
            except EOFError:
                return 0
            except KeyboardInterrupt:
                print(file=sys.stderr)
                return 0
            message = line.strip()
            if not message:
                continue
            if message == "/quit":
                return 0
            if message == "/usage":
                print(last, file=sys.stderr)
                continue
            if message == "/reset":
                session, first, last = new_session(), True, "no turn yet"
                print(f"session {session}", file=sys.stderr)
                continue
            req = build_request(_turn_args(args, session, line, first))
            t0, ttft = time.monotonic(), None
            call = stub.Generate(req, timeout=args.timeout, metadata=md)
            try:
                for resp in call:
                    if resp.WhichOneof("kind") == "chunk":
                        ttft = ttft if ttft is not None else time.monotonic() - t0
                        sys.stdout.write(resp.chunk.text)
                        sys.stdout.flush()
                    elif resp.WhichOneof("kind") == "finished":
                        last = usage_line(resp.finished, time.monotonic() - t0, ttft, session=True)
                first = False
            except grpc.RpcError as e:
                print(f"\nkvpop chat: {e.code().name}: {e.details()}", file=sys.stderr)
                if e.code() == grpc.StatusCode.UNAVAILABLE and first:
                    return 1
            except KeyboardInterrupt:
                call.cancel()
                print("\n(cancelled)", file=sys.stderr)
            sys.stdout.write("\n")
            sys.stdout.flush()
