"""`kvpop bench chat`: one long chat through a running stack, turn by turn,
two ways.

- session: each turn sends only the user's new message under one
  `session_id`, with a KV budget; compute appends the turn to the session's
  resident KV, generates the reply, and evicts back to the budget.
- stateless: each turn re-sends the whole conversation so far (the session's
  own replies, so both read the same chat) with no session and no budget, as
  a client of a stateless server (vLLM, TGI) does: the server prefills it all
  again.

Per turn: time to first token (client side), the prompt tokens the server
prefilled, the KV the request held (Usage: kv_blocks_resident at finish,
kv_blocks_peak) and, for the session, the compute pool's used pages after the
turn (compute's /metrics gauge `kvpop_kv_pool_pages_used`: what the session
keeps between turns). The session runs first, then the stateless replay,
so the pool gauge counts the session alone. User messages are everyday chat
(kvpop/tasks/small_talk.py) in a seeded order; replies are greedy.
"""
from __future__ import annotations

import random
import re
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
from tqdm import tqdm

from kvpop.bench import outputs
from kvpop.models.fetch import model_arg
from kvpop.runtime.paths import DEFAULT_MODEL_DIR


def add_arguments(p) -> None:
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), type=model_arg,
                   help="model of the stack it starts (it needs a chat template), or a fetched name (smollm2-135m)")
    p.add_argument("--via", metavar="HOST:PORT", help="use this running gateway instead of starting a stack")
    p.add_argument("--metrics", metavar="URL", help="with --via: compute's /metrics URL, for the pool's used pages")
    p.add_argument("--turns", type=int, default=50, help="user turns")
    p.add_argument("--budget", type=int, default=256, help="the session's KV budget per (layer, kv-head), tokens")
    p.add_argument("--policy", default="learned", help="the session's eviction policy")
    p.add_argument("--max-tokens", type=int, default=32, help="most tokens per reply")
    p.add_argument("--seed", type=int, default=0, help="order of the user messages")
    p.add_argument("--json", type=Path, default=None, help="write the per-turn results here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG here")


def user_messages(turns: int, seed: int) -> list[str]:
    """`turns` everyday user messages in a seeded order (each used once before any repeats)."""
    from kvpop.tasks.small_talk import EXCHANGES
    rng, out = random.Random(f"bench-chat:{seed}"), []
    while len(out) < turns:
        out += [u for u, _ in rng.sample(EXCHANGES, len(EXCHANGES))]
    return out[:turns]


def _pages_used(url: str | None) -> int | None:
    if not url:
        return None
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    m = re.search(r"^kvpop_kv_pool_pages_used (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else None


def _turn(stub, pb, req) -> dict:
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    for msg in stub.Generate(req, timeout=600):
        if msg.HasField("chunk"):
            first = first or time.perf_counter()
            text.append(msg.chunk.text)
        else:
            usage = msg.finished.usage
    return {"ttft_ms": round(1000 * ((first or time.perf_counter()) - t0), 2), "text": "".join(text),
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "kv_blocks_resident": usage.kv_blocks_resident, "kv_blocks_peak": usage.kv_blocks_peak,
            "kv_blocks_evicted": usage.kv_blocks_evicted, "session_resumed": usage.session_resumed,
            "reprefilled_tokens": usage.reprefilled_tokens}


def measure(stub, pb, args, metrics_url: str | None) -> dict:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    rows = info.num_layers * info.num_kv_heads
    users = user_messages(args.turns, args.seed)
    sid = f"bench-chat-{uuid.uuid4().hex[:12]}"
    chat: list[dict] = []
    session, stateless = [], []
    bar = tqdm(total=2 * args.turns, desc="bench chat", dynamic_ncols=True, mininterval=2)
    for msg in users:
        req = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=msg)], session_id=sid,
                                 policy=args.policy, budget_tokens=args.budget, max_tokens=args.max_tokens,
                                 temperature=0.0)
        r = _turn(stub, pb, req)
        r["pool_pages_used"] = _pages_used(metrics_url)
        session.append(r)
        chat += [{"role": "user", "content": msg}, {"role": "assistant", "content": r.pop("text")}]
        bar.update(1)
    for k in range(args.turns):
        sent = chat[:2 * k + 1]      # the conversation so far and the turn's user message
        req = pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in sent], policy="dense",
                                 max_tokens=args.max_tokens, temperature=0.0)
        r = _turn(stub, pb, req)
        r.pop("text")
        stateless.append(r)
        bar.update(1)
    bar.close()
    for r in session + stateless:
        r["held_tokens_per_row"] = round(r["kv_blocks_resident"] * info.block_size / rows, 1)
        r["peak_tokens_per_row"] = round(r["kv_blocks_peak"] * info.block_size / rows, 1)
    from services.compute.engine.kv_pool import KVPool
    import torch
    page_bytes = KVPool.page_bytes(info.page_size or info.block_size, info.head_dim,
                                   getattr(torch, info.dtype or "float32"))
    block_bytes = KVPool.page_bytes(info.block_size, info.head_dim, getattr(torch, info.dtype or "float32"))
    return {"model": info.name, "block_size": info.block_size, "page_size": info.page_size, "rows": rows,
            "block_bytes": block_bytes, "page_bytes": page_bytes, "turns": args.turns, "budget": args.budget,
            "policy": args.policy, "max_tokens": args.max_tokens, "seed": args.seed,
            "session": session, "stateless": stateless}


def summary(r: dict) -> dict:
    """Growth from the first quarter of the turns to the last quarter (medians), each side."""
    import statistics
    q = max(1, r["turns"] // 4)
    out = {}
    for side in ("session", "stateless"):
        turns = r[side]
        head, tail = turns[:q], turns[-q:]
        out[side] = {key: {"first_quarter": statistics.median(t[key] for t in head),
                           "last_quarter": statistics.median(t[key] for t in tail)}
                     for key in ("ttft_ms", "prompt_tokens", "held_tokens_per_row", "peak_tokens_per_row")}
    s = r["session"]
    full = [i for i, t in enumerate(s) if t["kv_blocks_evicted"] > 0]
    out["budget_reached_at_turn"] = full[0] + 1 if full else None
    held = [t["kv_blocks_resident"] for t in s[full[0]:]] if full else []
    out["session_blocks_resident_after_budget"] = [min(held), max(held)] if held else None
    pool = [t["pool_pages_used"] for t in s[full[0]:]] if full else []
    out["pool_pages_used_after_budget"] = [min(pool), max(pool)] if pool and None not in pool else None
    last = max(1, r["turns"] - q)
    out["ttft_ratio_last_quarter"] = round(out["stateless"]["ttft_ms"]["last_quarter"]
                                           / out["session"]["ttft_ms"]["last_quarter"], 2)
    out["turns_compared_from"] = last + 1
    return out


def print_results(r: dict) -> None:
    s = r["summary"]
    print(f"\n{r['model']}: {r['turns']} turns, replies up to {r['max_tokens']} tokens; session: {r['policy']} at "
          f"{r['budget']} tokens per row; stateless: the whole chat re-sent each turn, dense")
    print("| turn | session TTFT ms | session prompt tokens | session KV held (tokens/row) | pool pages used "
          "| stateless TTFT ms | stateless prompt tokens | stateless KV peak (tokens/row) |")
    print("|---|---|---|---|---|---|---|---|")
    n = r["turns"]
    for k in sorted({1, 2, 5, 10, 20, 30, 40, n} & set(range(1, n + 1))):
        a, b = r["session"][k - 1], r["stateless"][k - 1]
        print(f"| {k} | {a['ttft_ms']:.0f} | {a['prompt_tokens']} | {a['held_tokens_per_row']:.0f} | "
              f"{a['pool_pages_used'] if a['pool_pages_used'] is not None else '-'} | {b['ttft_ms']:.0f} | "
              f"{b['prompt_tokens']} | {b['peak_tokens_per_row']:.0f} |")
    print(f"budget reached at turn {s['budget_reached_at_turn']}; from then on the session held "
          f"{s['session_blocks_resident_after_budget']} blocks (min, max) and the pool "
          f"{s['pool_pages_used_after_budget']} pages")
    print(f"last quarter of the turns (median): TTFT stateless / session {s['ttft_ratio_last_quarter']}x")


def plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    turns = list(range(1, r["turns"] + 1))
    s, d = r["session"], r["stateless"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    a = axes[0]
    a.plot(turns, [t["held_tokens_per_row"] for t in s], "-o", ms=3, color="#c33",
           label=f"session, {r['policy']} @ {r['budget']}: held after the turn")
    a.plot(turns, [t["peak_tokens_per_row"] for t in d], "-", color="#555", label="stateless (dense): peak")
    a.set_title("KV tokens per (layer, kv-head) row", fontsize=10)
    a.set_xlabel("turn")
    a.legend(fontsize=7)
    a = axes[1]
    a.plot(turns, [t["ttft_ms"] for t in s], "-o", ms=3, color="#c33", label="session")
    a.plot(turns, [t["ttft_ms"] for t in d], "-", color="#555", label="stateless")
    a.set_title("time to first token (ms)", fontsize=10)
    a.set_xlabel("turn")
    a.legend(fontsize=7)
    a = axes[2]
    a.plot(turns, [t["prompt_tokens"] for t in s], "-o", ms=3, color="#c33", label="session")
    a.plot(turns, [t["prompt_tokens"] for t in d], "-", color="#555", label="stateless")
    if all(t["pool_pages_used"] is not None for t in s):
        b = a.twinx()
        b.plot(turns, [t["pool_pages_used"] for t in s], ":", color="#36c", label="pool pages used (session)")
        b.set_ylabel("pool pages used after the turn", fontsize=8, color="#36c")
    a.set_title("tokens prefilled per turn", fontsize=10)
    a.set_xlabel("turn")
    a.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"kvpop bench chat: {r['model']}, {r['turns']} turns", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    from kvpop.runtime.pb import generate_pb2, generate_pb2_grpc

    if args.turns < 1 or args.budget < 1 or args.max_tokens < 1:
        print("kvpop bench chat: --turns, --budget and --max-tokens must be >= 1")
        return 2
    stack = None
    if args.via:
        address, metrics = args.via, args.metrics
    else:
        from kvpop.stack.up import LaunchError, start_stack
        print(f"starting a stack on {args.model} ...")
        try:
            stack = start_stack(Path(tempfile.mkdtemp(prefix="kvpop-bench-chat-")), model=args.model, timeout=180)
        except LaunchError as e:
            print(f"kvpop bench chat: {e}")
            return 2
        address, metrics = stack.gateway, stack.metrics.get("compute")
    try:
        with grpc.insecure_channel(address) as ch:
            results = measure(generate_pb2_grpc.KVpopStub(ch), generate_pb2, args, metrics)
    except grpc.RpcError as e:
        print(f"kvpop bench chat: {e.code().name}: {e.details()}")
        return 1
    finally:
        if stack is not None:
            from kvpop.stack.down import stop_stack
            stop_stack(stack, grace=5)
    results["summary"] = summary(results)
    from kvpop.bench.machine import machine
    results["machine"] = machine()
    results["command"] = "kvpop bench chat"
    print_results(results)
    outputs.write(results, args, plot, indent=1)
    return 0
