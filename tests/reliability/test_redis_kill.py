"""Redis SIGKILLed in the middle of a conversation, then started again on the
same data dir: with its append-only file at `everysec`, at most the last
second of session writes is lost; the turns the gateway made while Redis was
gone are queued and filled back once it returns, in order; and the
conversation goes on with its full history (the next turn, whose KV has
expired on compute, is re-prefilled from what Redis holds)."""
from __future__ import annotations

import json
import secrets
import threading
import time

import grpc
import pytest
import redis

from helpers.common import RedisServer
from kvpop.stack.up import start_stack
from kvpop.stack.down import stop_stack
from kvpop.runtime.pb import generate_pb2_grpc
from kvpop.runtime.session_store import session_key, turns_key
from .reliability_stack import BLOCK_SIZE, clean_env, collect, request, wait_until

pytestmark = pytest.mark.slow

KV_TTL_S = 3.0          # compute's parked KV of an idle session: short, so the last turn must re-prefill
BEFORE, DURING = 4, 3   # turns stored before the kill; turns made while Redis is gone
LONG = 300              # tokens of the turn the kill lands in


@pytest.fixture(scope="module")
def redis_stack(tmp_path_factory, placeholder_model):
    server = RedisServer().start()
    env = {**clean_env(), "KVPOP_GRACE_S": "2", "KVPOP_SESSION_KV_TTL_S": str(KV_TTL_S)}
    st = start_stack(tmp_path_factory.mktemp("redis-kill-stack"), model=str(placeholder_model),
                     redis_url=server.url, env=env, timeout=180, supervise=False,
                     service_args={"compute": ["--block-size", str(BLOCK_SIZE), "--device", "cpu",
                                               "--num-pages", "4096"]})
    try:
        with grpc.insecure_channel(st.gateway) as ch:
            yield server, generate_pb2_grpc.KVpopStub(ch)
    finally:
        stop_stack(st, grace=5)
        server.cleanup()


def _turn(gateway, sid: str, i: int, n: int):
    ids, _, final = collect(gateway.Generate(request(prompt=f"turn {i}: go on.", max_tokens=n, ignore_eos=True,
                                                     policy="h2o", budget_tokens=64, session_id=sid), timeout=120))
    assert final is not None and len(ids) == n, f"turn {i} did not complete"
    return ids, final


def test_redis_sigkill_mid_conversation(redis_stack):
    server, gateway = redis_stack
    assert redis.Redis.from_url(server.url).config_get("appendfsync")["appendfsync"] == "everysec"
    sid = f"kill-{secrets.token_hex(3)}"
    r = redis.Redis.from_url(server.url, socket_timeout=2)
    streamed: list[list[int]] = []      # completion ids of each turn, as the client saw them
    acked: dict[int, float] = {}        # turn index -> when the test first saw it stored

    for i in range(BEFORE):
        ids, _ = _turn(gateway, sid, i, 6)
        streamed.append(ids)
        wait_until(lambda: r.llen(turns_key(sid)) == i + 1, 10, f"turn {i} to be stored")
        acked[i] = time.monotonic()

    # The kill lands while a long turn streams, right behind the writes of the turns before it.
    progress, result, errors = [0], {}, []

    def long_turn():
        try:
            ids, final = [], None
            for msg in gateway.Generate(request(prompt=f"turn {BEFORE}: a long answer.", max_tokens=LONG,
                                                ignore_eos=True, policy="h2o", budget_tokens=64, session_id=sid),
                                        timeout=120):
                if msg.HasField("chunk"):
                    ids.extend(msg.chunk.token_ids)
                    progress[0] = len(ids)
                else:
                    final = msg.finished
            result["ids"], result["final"] = ids, final
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    t = threading.Thread(target=long_turn)
    t.start()
    wait_until(lambda: progress[0] >= 8 or errors, 60, "the long turn to stream")
    r.close()
    server.kill()
    t_kill = time.monotonic()
    t.join(120)
    assert not errors and result["final"] is not None and len(result["ids"]) == LONG, errors
    assert result["final"].usage.session_resumed, "the long turn should continue the parked KV"
    streamed.append(result["ids"])
    # Redis is still down: these turns continue the KV parked on compute and are queued by the gateway.
    for i in range(BEFORE + 1, BEFORE + 1 + DURING):
        ids, final = _turn(gateway, sid, i, 6)
        assert final.usage.session_resumed, f"turn {i} lost its context while Redis was down"
        streamed.append(ids)
    down_s = time.monotonic() - t_kill

    server.start()      # same port, same dir: it replays its append-only file
    t_up = time.monotonic()
    r = redis.Redis.from_url(server.url, socket_timeout=2)

    def turn_index(t_: dict) -> int:
        return int(t_["prompt"].split(":")[0].split()[1])

    def stored_turns() -> list[dict]:
        return [json.loads(x) for x in r.lrange(turns_key(sid), 0, -1)]

    # The queued turns are written in order, so the last one being there means all of them are.
    wait_until(lambda: any(turn_index(t_) == len(streamed) - 1 for t_ in stored_turns()), 20,
               "queued turns to be filled back")
    filled_s = time.monotonic() - t_up
    stored = stored_turns()
    kept = [turn_index(t_) for t_ in stored]
    lost = sorted(set(range(len(streamed))) - set(kept))
    # Only a write Redis acknowledged in the last second before the kill may be gone.
    assert all(i in acked and acked[i] > t_kill - 1.0 for i in lost), \
        f"turns {lost} lost: queued, or acknowledged more than a second before the kill"
    assert kept == sorted(kept), f"turns out of order: {kept}"
    for t_ in stored:
        i = turn_index(t_)
        assert t_["completion_token_ids"] == streamed[i], f"turn {i} stored wrong"
    meta = json.loads(r.get(session_key(sid)))
    assert meta["turns"] == len(stored) and meta["session_id"] == sid and meta["replica"]
    history = [tok for t_ in stored for tok in (*t_["prompt_token_ids"], *t_["completion_token_ids"])]
    assert meta["tokens"] == len(history)

    # Once compute's parked KV has expired, the next turn is rebuilt from exactly what Redis holds.
    last_end = time.monotonic()
    wait_until(lambda: time.monotonic() - last_end > KV_TTL_S + 0.5, KV_TTL_S + 5, "the parked KV to expire")
    ids, final = _turn(gateway, sid, len(streamed), 6)
    assert not final.usage.session_resumed and final.usage.reprefilled_tokens == len(history), final.usage
    wait_until(lambda: r.llen(turns_key(sid)) == len(stored) + 1, 10, "the last turn to be stored")
    print(f"\nredis SIGKILL: {len(streamed)} turns before it came back ({DURING} made while it was down "
          f"{down_s:.2f} s), {len(lost)} lost, queued turns filled back {filled_s:.2f} s after its restart, "
          f"next turn re-prefilled {len(history)} tokens")
