"""`kvpop generate "PROMPT"` or `kvpop generate --chat "MESSAGE" [--system
TEXT] [--session ID]`: stream a completion from a running gateway,
printing text as tokens arrive and a one-line usage summary on stderr. With
--session, --chat continues that chat (the server keeps the conversation).
Only the generated stubs and grpc are needed (no torch)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from kvpop.flags import add_budget
from kvpop.stack.up import STATE_FILE, default_state_dir
from kvpop.stack.policy_names import POLICIES
from kvpop.stack.task_model_note import note_for


EPILOG = ("Text goes to stdout as it arrives, then one usage line to stderr. Exit status: 0 when the "
          "stream finished, 1 on a gRPC error (printed as STATUS: message), 130 when interrupted.")


def decisions(u) -> str:
    """For `learned`: who ranked the evicted blocks (the network's share first)."""
    if u.policy != "learned" or not u.kv_blocks_evicted:
        return ""
    parts = [f"network {100 * u.network_evictions / u.kv_blocks_evicted:.1f}%"]
    if u.advisor_heuristic_evictions:
        parts.append(f"cache-manager heuristic {u.advisor_heuristic_evictions} (no estimator fits this model)")
    if u.fallback_evictions:
        why = ", ".join(f"{k} {v}" for k, v in sorted(u.fallback_reasons.items()))
        parts.append(f"fallback {u.fallback_evictions}: {why}")
    return " (" + "; ".join(parts) + ")"


def usage_line(f, dt: float, first: float | None, session: bool) -> str:
    """The one-line summary of a finished stream (`f`: its Finished message)."""
    u = f.usage
    rate = u.completion_tokens / dt if dt > 0 else 0.0
    kept = (f", session_resumed {str(u.session_resumed).lower()} reprefilled_tokens {u.reprefilled_tokens}"
            if session else "")
    return (f"[{f.finish_reason_text or 'done'}] prompt {u.prompt_tokens} tok, completion "
            f"{u.completion_tokens} tok, policy {u.policy}, kv blocks resident "
            f"{u.kv_blocks_resident} (peak {u.kv_blocks_peak}) evicted {u.kv_blocks_evicted}{decisions(u)}{kept}, "
            f"ttft {1000 * (first or dt):.0f} ms, {rate:.1f} tok/s")


def gateway_address(args: argparse.Namespace) -> str:
    if args.address:
        return args.address
    if os.environ.get("KVPOP_GATEWAY_ADDRESS"):
        return os.environ["KVPOP_GATEWAY_ADDRESS"]
    path = (args.state_dir.resolve() if args.state_dir else default_state_dir()) / STATE_FILE
    try:
        return json.loads(path.read_text())["gateway"]
    except (OSError, ValueError, KeyError):
        raise SystemExit(f"kvpop: no running stack found ({path}); start one with `kvpop up` "
                         f"or pass --address HOST:PORT") from None


def build_request(args: argparse.Namespace):
    from kvpop.runtime.pb import generate_pb2

    if (args.prompt is None) == (args.chat is None):
        raise SystemExit("kvpop generate: give either PROMPT (plain completion) or --chat MESSAGE (a chat), not both")
    if args.system is not None and args.chat is None:
        raise SystemExit("kvpop generate: --system goes with --chat")
    messages = []
    if args.chat is not None:
        if args.system is not None:
            messages.append(generate_pb2.ChatMessage(role="system", content=args.system))
        messages.append(generate_pb2.ChatMessage(role="user", content=args.chat))
    req = generate_pb2.GenerateRequest(prompt=args.prompt or "", messages=messages, stop=args.stop or [], ignore_eos=args.ignore_eos,
                                       logprobs=args.logprobs, policy=args.policy or "",
                                       evict_after_prompt=args.evict_after_prompt,
                                       session_id=args.session or "", request_id=args.request_id or "")
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "repetition_penalty", "sink_tokens",
                 "recent_tokens", "prefill_allowance"):
        value = getattr(args, name)
        if value is not None:
            setattr(req, name, value)
    if args.budget is not None:
        b = args.budget
        try:
            if any(c in b for c in ".eE"):
                req.budget_fraction = float(b)
            else:
                req.budget_tokens = int(b)
        except ValueError:
            raise SystemExit(f"kvpop generate: --budget must be tokens (512) or a fraction (0.25), got {b!r}") \
                from None
    return req


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="text to complete as it is (or use --chat)")
    p.add_argument("--chat", metavar="MESSAGE",
                   help="send MESSAGE as the user's turn of a chat, rendered with the model's chat template")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before it")
    p.add_argument("--max-tokens", type=int, help="most tokens to generate (server default 128)")
    p.add_argument("--temperature", type=float, help="sampling temperature >= 0; 0 (the default) is greedy")
    p.add_argument("--top-p", type=float, help="nucleus sampling: keep the likeliest tokens up to this mass, (0, 1]")
    p.add_argument("--top-k", type=int, help="sample among the k likeliest tokens; 0 (the default) is off")
    p.add_argument("--seed", type=int, help="sampling seed: the same seed and request give the same tokens")
    p.add_argument("--repetition-penalty", type=float, help="> 1 makes tokens already seen less likely; 1 is off")
    p.add_argument("--stop", action="append", help="stop string (repeatable); it is not part of the output")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--logprobs", action="store_true", help="ask for each token's log-probability")
    p.add_argument("--policy", metavar="POLICY",
                   help=f"eviction policy: {', '.join(POLICIES)} (default: the server's, `kvpop up --policy`)")
    add_budget(p, help="KV budget per (layer, kv-head): tokens (512) or a fraction of prompt + max tokens (0.25); "
                          "default: the server's (KVPOP_DEFAULT_BUDGET)")
    p.add_argument("--sink-tokens", type=int, help="first positions never evicted (server default 4)")
    p.add_argument("--recent-tokens", type=int, help="last positions never evicted (server default 8)")
    p.add_argument("--evict-after-prompt", action="store_true",
                   help="hold the budget from the end of the prompt on (the prompt is prefilled in full, then "
                        "evicted down once: a question at its end is seen first); default: the server's "
                        "(KVPOP_DEFAULT_PREFILL)")
    p.add_argument("--prefill-allowance", type=float, metavar="N",
                   help="hold up to N times the budget while the prompt is prefilled, then the budget "
                        "(1: the budget from the first prompt chunk on; between that and --evict-after-prompt)")
    p.add_argument("--session", help="session id (stored in Redis): later turns continue its KV; with --chat, "
                   "MESSAGE is the chat's next user turn")
    p.add_argument("--request-id", help="names the request in logs and traces (default: the server makes one)")
    p.add_argument("--client-id", help="x-client-id metadata: names the client for the per-client stream limit "
                   "(default: the gateway counts by IP address)")
    add_connection_arguments(p)


def add_connection_arguments(p: argparse.ArgumentParser, timeout_help: str = "deadline in seconds") -> None:
    """How a client reaches the gateway: `kvpop generate` and `kvpop chat`."""
    p.add_argument("--api-key", default=None, help="API key, sent as 'authorization: Bearer KEY' "
                   "(default: KVPOP_API_KEY)")
    p.add_argument("--ca", default=None, help="CA (PEM) of a gateway that serves TLS (default: KVPOP_GATEWAY_CA; "
                   "none: plaintext)")
    p.add_argument("--address", help="gateway HOST:PORT (default: $KVPOP_GATEWAY_ADDRESS, else the stack "
                                      "in the state folder)")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="state folder of `kvpop up` (default: $KVPOP_STATE_DIR, else .kvpop)")
    p.add_argument("--timeout", type=float, default=None, help=timeout_help)


def _note_task_model(stub, args: argparse.Namespace, metadata=None) -> None:
    """One line on stderr when the request does not fit the default task model."""
    import grpc

    from kvpop.runtime.pb import generate_pb2

    try:
        info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=5, metadata=metadata)
    except grpc.RpcError:
        return      # Generate reports the gateway's state itself
    note = note_for(info, args.prompt, chat=args.chat is not None)
    if note:
        print(note, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    import grpc

    from kvpop.stack.gateway_channel import key_metadata, public_channel
    from kvpop.runtime.pb import generate_pb2_grpc

    address = gateway_address(args)
    req = build_request(args)
    t0 = time.monotonic()
    first = None
    with public_channel(address, args.ca) as channel:
        stub = generate_pb2_grpc.KVpopStub(channel)
        md = key_metadata(args.api_key) + ((("x-client-id", args.client_id),) if args.client_id else ())
        _note_task_model(stub, args, md or None)
        call = stub.Generate(req, timeout=args.timeout, metadata=md or None)
        try:
            for resp in call:
                kind = resp.WhichOneof("kind")
                if kind == "chunk":
                    if first is None:
                        first = time.monotonic() - t0
                    sys.stdout.write(resp.chunk.text)
                    sys.stdout.flush()
                elif kind == "finished":
                    sys.stdout.write("\n")
                    sys.stdout.flush()
                    print(usage_line(resp.finished, time.monotonic() - t0, first, bool(args.session)),
                          file=sys.stderr)
        except grpc.RpcError as e:
            if first is not None:
                sys.stdout.write("\n")
                sys.stdout.flush()
            print(f"kvpop generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            call.cancel()
            print("\nkvpop generate: cancelled", file=sys.stderr)
            return 130
    return 0
