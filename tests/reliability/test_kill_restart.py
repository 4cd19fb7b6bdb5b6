"""Each service SIGKILLed (by PID) under 8 concurrent streams, on the default
`kvpop up` (supervised, internal token generated, no TLS):

- it is back SERVING within BACK_WITHIN_S (the supervisor restarts it);
- streams that do not need it finish (cache-manager: `learned` falls back
  locally; Redis: sessions queue); streams it carried (compute, gateway) end
  with UNAVAILABLE, none hangs;
- the gateway goes NOT_SERVING within FLIP_WITHIN_S of its last compute dying
  and SERVING within FLIP_WITHIN_S of compute being SERVING again;
- after recovery every new request succeeds, and the KV pool is back to its
  baseline (no page leaked by the killed streams).

Also on that stack: the internal APIs refuse callers without the stack's
token, and compute holds direct callers to its own limits.

CI runs each kill once; docs/guides/operations.md has the figures of

    KVPOP_KILL_ROUNDS=5 KVPOP_RELIABILITY_OUT=runs/reliability \\
        .venv/bin/python -m pytest -q -s tests/reliability/test_kill_restart.py

(a table on stdout, every measurement in runs/reliability/kill_restart.json).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .reliability_stack import BLOCK_SIZE, MAX_MODEL_LEN, clean_env, request, wait_until
from kvpop.stack.up import Stack
from kvpop.stack.down import stop_stack
from kvpop.runtime.paths import REPO_ROOT
from kvpop.runtime.pb import cache_manager_pb2, cache_manager_pb2_grpc, compute_pb2, compute_pb2_grpc, generate_pb2_grpc
from kvpop.runtime.security import SecurityConfig, sync_channel
from kvpop.runtime.session_store import turns_key

pytestmark = pytest.mark.slow

ROUNDS = int(os.environ.get("KVPOP_KILL_ROUNDS", "1"))
OUT = os.environ.get("KVPOP_RELIABILITY_OUT", "")
STREAMS = 8
TOKENS = 96
# The promise: back within 5 s; a machine shared with other heavy jobs may need more (the doc run says how much).
BACK_WITHIN_S = float(os.environ.get("KVPOP_BACK_WITHIN_S", "5.0"))
# The promise: the gateway's health flips within 2 s; overridable as BACK_WITHIN_S is.
FLIP_WITHIN_S = float(os.environ.get("KVPOP_FLIP_WITHIN_S", "2.0"))
COMPUTE_STREAMS = 24         # KVPOP_MAX_COMPUTE_STREAMS of this stack
SERVICES = ("cache-manager", "redis", "gateway", "compute")
RESULTS: list[dict] = []


class Up:
    """The default `kvpop up` stack and how to reach its parts."""

    def __init__(self, stack: Stack, env: dict[str, str]):
        self.stack, self.env = stack, env

    def security(self) -> SecurityConfig:
        return self.stack.security(self.env)

    def compute_info(self) -> compute_pb2.InfoResponse:
        with sync_channel(self.stack.proc("compute").address, self.security()) as ch:
            return compute_pb2_grpc.ComputeStub(ch).Info(compute_pb2.InfoRequest(), timeout=10)

    def pool_idle(self) -> int:
        s = self.compute_info().stats
        return s.pages_used - int(s.extra.get("prefix_cache_pages", 0)) - int(s.extra.get("session_pages", 0))

    def health(self, name: str, service: str = "") -> bool:
        address = self.stack.proc(name).address
        if name == "redis":
            host, port = address.rsplit(":", 1)
            try:
                with socket.create_connection((host, int(port)), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    return s.recv(16).startswith(b"+PONG")
            except OSError:
                return False
        cfg = SecurityConfig() if name == "gateway" else self.security()
        with sync_channel(address, cfg) as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=0.5)
            except grpc.RpcError:
                return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    def settled(self) -> bool:
        """Everything up and SERVING, the advisor stream open, compute idle."""
        self.stack.reload()
        if not all(p.alive() for p in self.stack.processes):
            return False
        if not all(self.health(n) for n in ("redis", "cache-manager", "compute", "gateway")):
            return False
        if not self.health("compute", "kvpop.compute.advisor"):
            return False
        s = self.compute_info().stats
        return s.running == 0 and s.waiting == 0


@pytest.fixture(scope="module")
def up(tmp_path_factory, placeholder_model):
    state = tmp_path_factory.mktemp("default-up")
    env = {**clean_env(), "KVPOP_GRACE_S": "2", "KVPOP_NUM_PAGES": "8192", "KVPOP_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
           "KVPOP_MAX_COMPUTE_STREAMS": str(COMPUTE_STREAMS)}
    run = subprocess.run([sys.executable, "-m", "kvpop.cli", "up", "--state-dir", str(state), "--model",
                          str(placeholder_model), "--block-size", str(BLOCK_SIZE), "--device", "cpu",
                          "--timeout", "240"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    stack = Stack.load(state)
    if run.returncode != 0:
        if stack is not None:
            stop_stack(stack, grace=5)
        pytest.fail(f"kvpop up failed:\n{run.stderr[-3000:]}")
    assert stack.has("supervisor") and stack.token_file
    yield Up(stack, env)
    down = subprocess.run([sys.executable, "-m", "kvpop.cli", "down", "--state-dir", str(state), "--grace", "10"],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    _report()


# ---- closed by default -------------------------------------------------------

def test_internal_apis_need_the_stack_token(up):
    compute, cm = up.stack.proc("compute").address, up.stack.proc("cache-manager").address
    for cfg in (SecurityConfig(), SecurityConfig(token="not-the-token")):
        with sync_channel(compute, cfg) as ch:
            stub = compute_pb2_grpc.ComputeStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                stub.Info(compute_pb2.InfoRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(compute_pb2.ComputeRequest(request_id="x", prompt="hi",
                                                              sampling=compute_pb2.Sampling(max_tokens=4)),
                                   timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
        with sync_channel(cm, cfg) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(cache_manager_pb2_grpc.CacheManagerStub(ch).Advise(
                    iter([cache_manager_pb2.AdvisorMessage()]), timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
    # With the stack's token (a 0600 file in the state dir) the same calls go through.
    assert (Path(up.stack.token_file).stat().st_mode & 0o777) == 0o600
    assert up.compute_info().model.num_layers > 0
    with sync_channel(cm, up.security()) as ch:
        replies = list(cache_manager_pb2_grpc.CacheManagerStub(ch).Advise(
            iter([cache_manager_pb2.AdvisorMessage()]), timeout=10))
        # The stream's opening reply says what the networks read; an empty message earns no plan.
        assert [r.HasField("plan") for r in replies] == [False]
        assert replies[0].HasField("inputs")


def _sampling(max_tokens: int) -> compute_pb2.Sampling:
    # What a gateway sends: every field resolved.
    return compute_pb2.Sampling(max_tokens=max_tokens, ignore_eos=True, top_p=1.0, repetition_penalty=1.0)


def _direct(stub, **kw) -> tuple[grpc.StatusCode, str, int]:
    sampling = _sampling(kw.pop("max_tokens", 4))
    req = compute_pb2.ComputeRequest(request_id=kw.pop("request_id", f"direct-{time.monotonic_ns()}"),
                                     prompt=kw.pop("prompt", "direct call"), sampling=sampling,
                                     eviction=compute_pb2.Eviction(policy="dense"), **kw)
    try:
        out = list(stub.Generate(req, timeout=60))
    except grpc.RpcError as e:
        return e.code(), e.details() or "", 0
    return grpc.StatusCode.OK, "", sum(len(r.response.chunk.token_ids) for r in out)


def test_compute_holds_direct_callers_to_its_limits(up):
    RE = grpc.StatusCode.RESOURCE_EXHAUSTED
    with sync_channel(up.stack.proc("compute").address, up.security()) as ch:
        stub = compute_pb2_grpc.ComputeStub(ch)
        assert _direct(stub, max_tokens=4) == (grpc.StatusCode.OK, "", 4)
        for max_tokens in (4097, 1_000_000, 2**31 - 1):
            code, details, _ = _direct(stub, max_tokens=max_tokens)
            assert code == RE and "KVPOP_MAX_TOKENS_LIMIT=4096" in details, (code, details)
        code, details, _ = _direct(stub, max_tokens=0)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
        code, details, _ = _direct(stub, prompt="p" * 65537)
        assert code == RE and "KVPOP_MAX_PROMPT_CHARS=65536" in details, (code, details)
        # Concurrent streams: COMPUTE_STREAMS open, the next one refused, one freed is taken again.
        # (Budgeted, so that all of them fit in the pool and run at once.)
        held = []
        try:
            for i in range(COMPUTE_STREAMS):
                call = stub.Generate(compute_pb2.ComputeRequest(
                    request_id=f"hold-{i}", prompt="hold", sampling=_sampling(1000),
                    eviction=compute_pb2.Eviction(policy="h2o", budget_tokens=64)), timeout=120)
                next(call)
                held.append(call)
            code, details, _ = _direct(stub)
            assert code == RE and f"KVPOP_MAX_COMPUTE_STREAMS={COMPUTE_STREAMS}" in details, (code, details)
            held.pop().cancel()
            wait_until(lambda: _direct(stub)[0] == grpc.StatusCode.OK, 30, "a freed stream slot", interval=0.1)
        finally:
            for call in held:
                call.cancel()
    wait_until(lambda: up.compute_info().stats.running == 0, 30, "the held streams to go")


# ---- kill each service ------------------------------------------------------

def _stream(stub, rnd: int, i: int, progress: list[int], out: dict, sid: str) -> None:
    policy = ("learned", "h2o")[i % 2]
    req = request(prompt=f"round {rnd} stream {i}: " + "remember this " * (i + 2), max_tokens=TOKENS,
                  ignore_eos=True, policy=policy, budget_tokens=64, session_id=sid)
    n = 0
    try:
        final = None
        for msg in stub.Generate(req, timeout=120):
            if msg.HasField("chunk"):
                n += len(msg.chunk.token_ids)
                progress[i] = n
            else:
                final = msg.finished
        out[i] = ("OK" if final is not None and n == TOKENS else "INCOMPLETE", n, time.monotonic())
    except grpc.RpcError as e:
        out[i] = (e.code().name, n, time.monotonic())
    except Exception as e:  # noqa: BLE001 - any other failure is reported as such
        out[i] = (f"{type(e).__name__}: {e}", n, time.monotonic())


def _one_request(address: str, max_tokens: int = 4, timeout: float = 60) -> str:
    with grpc.insecure_channel(address) as ch:
        try:
            msgs = list(generate_pb2_grpc.KVpopStub(ch).Generate(
                request(prompt="after recovery", max_tokens=max_tokens, ignore_eos=True, policy="h2o",
                        budget_tokens=64), timeout=timeout))
        except grpc.RpcError as e:
            return e.code().name
    return "OK" if msgs and msgs[-1].HasField("finished") else "INCOMPLETE"


def kill_round(up: Up, service: str, rnd: int) -> dict:
    wait_until(up.settled, 60, "the stack to settle", interval=0.2)
    baseline = up.pool_idle()
    gateway = up.stack.gateway
    channels = [grpc.insecure_channel(gateway) for _ in range(STREAMS)]
    progress, out = [0] * STREAMS, {}
    # Half the streams are session turns: they are written to Redis after the stream.
    sids = [f"kill-{service}-{rnd}-{i}-{time.monotonic_ns()}" if i % 2 == 0 else "" for i in range(STREAMS)]
    threads = [threading.Thread(target=_stream, args=(generate_pb2_grpc.KVpopStub(channels[i]), rnd, i, progress,
                                                      out, sids[i])) for i in range(STREAMS)]
    for t in threads:
        t.start()
    wait_until(lambda: min(progress) >= 8 or out, 120, "the streams to get going")
    victim = up.stack.reload().proc(service)
    at_kill, finished_before_kill = list(progress), len(out)
    os.kill(victim.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    back = gw_down = gw_up = None
    while time.monotonic() - t_kill < 60 and (back is None or (service == "compute" and gw_up is None)):
        now = time.monotonic() - t_kill
        if service == "compute":
            serving = up.health("gateway")
            if gw_down is None and not serving:
                gw_down = now
            elif gw_down is not None and gw_up is None and serving:
                gw_up = now
        if back is None:
            proc = up.stack.reload().proc(service)
            if proc.pid != victim.pid and proc.alive() and up.health(service):
                back = now
        time.sleep(0.02)
    assert back is not None, f"{service} not back SERVING 60 s after its SIGKILL"
    # The first request through the gateway that succeeds after the service is SERVING again.
    first_ok = None
    while first_ok is None and time.monotonic() - t_kill < back + 30:
        if _one_request(gateway, max_tokens=2, timeout=10) == "OK":
            first_ok = time.monotonic() - t_kill
        else:
            time.sleep(0.05)
    for t in threads:
        t.join(180)
    for ch in channels:
        ch.close()
    assert not any(t.is_alive() for t in threads), "a stream hung"
    outcomes = [out[i][0] for i in range(STREAMS)]
    # Every finished session turn is in Redis, a Redis SIGKILL included (turns queue while it is down).
    r = redis.Redis.from_url(up.stack.redis_url, socket_timeout=5)
    done = [sid for sid, o in zip(sids, outcomes) if sid and o == "OK"]
    t0 = time.monotonic()
    while not all(r.llen(turns_key(sid)) == 1 for sid in done) and time.monotonic() - t0 < 15:
        time.sleep(0.05)
    turns_stored = sum(r.llen(turns_key(sid)) == 1 for sid in done)
    r.close()
    # After recovery: compute idle, the pool back to its baseline, then every new request succeeds.
    wait_until(lambda: (s := up.compute_info().stats).running == 0 and s.waiting == 0, 60, "compute to be idle")
    deadline = time.monotonic() + 10
    while (idle := up.pool_idle()) != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    results = {}
    after = [threading.Thread(target=lambda i=i: results.__setitem__(i, _one_request(gateway, max_tokens=16)))
             for i in range(STREAMS)]
    for t in after:
        t.start()
    for t in after:
        t.join(120)
    row = {"service": service, "round": rnd, "back_serving_s": round(back, 3),
           "first_request_ok_s": None if first_ok is None else round(first_ok, 3),
           "gateway_not_serving_s": None if gw_down is None else round(gw_down, 3),
           "gateway_serving_after_compute_s": None if gw_up is None else round(max(0.0, gw_up - back), 3),
           "tokens_at_kill": [min(at_kill), max(at_kill)], "finished_before_kill": finished_before_kill,
           "streams": outcomes,
           "new_requests_ok": sum(v == "OK" for v in results.values()), "pages_leaked": idle - baseline,
           "session_turns_stored": [turns_stored, len(done)],
           "pool_baseline": baseline}
    RESULTS.append(row)
    print(f"\n{service} kill {rnd + 1}/{ROUNDS}: " + json.dumps({k: v for k, v in row.items() if k != "service"}))
    return row


@pytest.mark.parametrize("service", SERVICES)
def test_kill_service(up, service):
    for rnd in range(ROUNDS):
        row = kill_round(up, service, rnd)
        # The kill landed mid-stream: every stream had tokens and none had finished.
        assert row["tokens_at_kill"][0] > 0 and row["finished_before_kill"] == 0, row
        assert row["tokens_at_kill"][1] < TOKENS, row
        assert row["back_serving_s"] <= BACK_WITHIN_S, row
        if service in ("cache-manager", "redis"):
            # Streams that can do without it finish, all of their tokens.
            assert row["streams"] == ["OK"] * STREAMS, row
        else:
            # Streams it carried end, with UNAVAILABLE (one whose last tokens were already
            # on the wire: OK); none hangs.
            assert set(row["streams"]) <= {"OK", "UNAVAILABLE"} and "UNAVAILABLE" in row["streams"], row
        if service == "compute":
            assert row["gateway_not_serving_s"] is not None and row["gateway_not_serving_s"] <= FLIP_WITHIN_S, row
            assert row["gateway_serving_after_compute_s"] is not None, row
            assert row["gateway_serving_after_compute_s"] <= FLIP_WITHIN_S, row
        assert row["first_request_ok_s"] is not None, row
        assert row["new_requests_ok"] == STREAMS, row
        assert row["pages_leaked"] == 0, row
        assert row["session_turns_stored"][0] == row["session_turns_stored"][1], row
    # The supervisor saw every kill, and no crash loop.
    status = json.loads((Path(up.stack.state_dir) / "supervisor.json").read_text())["services"][service]
    assert status["restarts"] >= ROUNDS and not status["crash_loop"], status


def _report() -> None:
    if not RESULTS:
        return
    lines = ["", f"kill/restart under {STREAMS} streams, {ROUNDS} round(s) per service (seconds after SIGKILL)",
             "| service | kills | back SERVING (median / max) | first request OK (median / max) | "
             "streams finished / failed | session turns stored | new requests OK | pages leaked |",
             "|---|---|---|---|---|---|---|---|"]
    for service in SERVICES:
        rows = [r for r in RESULTS if r["service"] == service]
        if not rows:
            continue
        back = [r["back_serving_s"] for r in rows]
        ok = [r["first_request_ok_s"] for r in rows if r["first_request_ok_s"] is not None]
        fin = sum(s == "OK" for r in rows for s in r["streams"])
        lines.append(f"| {service} | {len(rows)} | {statistics.median(back):.2f} / {max(back):.2f} | "
                     f"{statistics.median(ok):.2f} / {max(ok):.2f} | {fin} / {len(rows) * STREAMS - fin} | "
                     f"{sum(r['session_turns_stored'][0] for r in rows)} / "
                     f"{sum(r['session_turns_stored'][1] for r in rows)} | "
                     f"{sum(r['new_requests_ok'] for r in rows)} / {len(rows) * STREAMS} | "
                     f"{sum(r['pages_leaked'] for r in rows)} |" if ok else f"| {service} | {len(rows)} | ... |")
    comp = [r for r in RESULTS if r["service"] == "compute"]
    if comp:
        down = [r["gateway_not_serving_s"] for r in comp if r["gateway_not_serving_s"] is not None]
        upd = [r["gateway_serving_after_compute_s"] for r in comp if r["gateway_serving_after_compute_s"] is not None]
        if down and upd:
            lines.append(f"gateway NOT_SERVING after compute's SIGKILL: median {statistics.median(down):.2f} s, "
                         f"max {max(down):.2f} s; SERVING after compute is SERVING again: median "
                         f"{statistics.median(upd):.2f} s, max {max(upd):.2f} s")
    print("\n".join(lines))
    if OUT:
        out = Path(OUT)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kill_restart.json").write_text(json.dumps({"rounds": ROUNDS, "streams": STREAMS, "tokens": TOKENS,
                                                           "results": RESULTS}, indent=2))
