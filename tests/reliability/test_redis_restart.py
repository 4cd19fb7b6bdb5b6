"""Redis restarted while sessions stream: no stream fails, a request made
during the outage succeeds, and every session survives — its record and
turns are in Redis after the restart and further turns complete."""
from __future__ import annotations

import json
import secrets
import threading
import time

import pytest
import redis

from .reliability_stack import collect, request, wait_until
from kvpop.stack.up import restart_service
from kvpop.stack.down import stop_process
from kvpop.runtime.session_store import session_key, turns_key

pytestmark = pytest.mark.slow

SESSIONS = 8
LONG = 600      # tokens of the turn that spans the restart


def _turn(gateway, sid: str, i: int, n: int, **kw):
    return collect(gateway.Generate(request(prompt=f"session {sid} turn {i}: tell me more.", max_tokens=n,
                                            ignore_eos=True, policy="h2o", budget_tokens=64,
                                            session_id=sid, **kw), timeout=180))


def test_redis_restart_mid_run(secure_stack, gateway):
    st = secure_stack.stack
    r = redis.Redis.from_url(st.redis_url, socket_timeout=5)
    sids = [f"restart-{secrets.token_hex(3)}-{i}" for i in range(SESSIONS)]
    for sid in sids:
        _turn(gateway, sid, 1, 4)
    wait_until(lambda: all(r.llen(turns_key(s)) == 1 for s in sids), 20, "first turns to be stored")

    results: dict[str, tuple] = {}
    streaming = threading.Semaphore(0)
    errors = []

    def second_turn(sid):
        try:
            ids, final, first = [], None, None
            for msg in gateway.Generate(request(prompt=f"session {sid} turn 2: tell me more.", max_tokens=LONG,
                                                ignore_eos=True, policy="h2o", budget_tokens=64, session_id=sid),
                                        timeout=180):
                if msg.HasField("chunk"):
                    if first is None:
                        first = time.monotonic()
                        streaming.release()
                    ids.extend(msg.chunk.token_ids)
                else:
                    final = msg.finished
            results[sid] = (ids, final, time.monotonic())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{sid}: {e!r}")
            streaming.release()

    threads = [threading.Thread(target=second_turn, args=(s,)) for s in sids]
    for t in threads:
        t.start()
    for _ in sids:
        assert streaming.acquire(timeout=120), "a second turn never started streaming"

    t_down = time.monotonic()
    stop_process(st.proc("redis"), grace=10)
    # A whole request, with a new session, while Redis is gone.
    outage_sid = f"outage-{secrets.token_hex(3)}"
    o_ids, _, o_final = _turn(gateway, outage_sid, 1, 8)
    assert o_final is not None and len(o_ids) == 8, "a request during the outage failed"
    restart_service(st, "redis", env=secure_stack.env)
    t_up = time.monotonic()

    for t in threads:
        t.join(180)
    assert not errors, errors
    ended_after_restart = sum(end > t_up for _, _, end in results.values())
    assert all(end > t_down for _, _, end in results.values()), "a stream ended before Redis went down"
    for sid in sids:
        ids, final, _ = results[sid]
        assert final is not None and len(ids) == LONG == final.usage.completion_tokens, sid
    print(f"\nredis restart: {SESSIONS} streams of {LONG} tokens, Redis down {t_up - t_down:.2f} s, "
          f"{ended_after_restart} streams ended after it was back")
    assert ended_after_restart > 0, "the restart did not happen mid-run (every stream had already ended)"

    # Turns made while Redis was down were queued and land once it is back.
    wait_until(lambda: all(r.llen(turns_key(s)) == 2 for s in sids) and r.llen(turns_key(outage_sid)) == 1,
               30, "queued turns to be stored")
    for sid in sids:
        meta = json.loads(r.get(session_key(sid)))
        assert meta["turns"] == 2 and meta["session_id"] == sid and meta["model"], meta
        turns = [json.loads(t) for t in r.lrange(turns_key(sid), 0, -1)]
        assert turns[1]["completion_token_ids"] == results[sid][0]
        assert turns[0]["prompt_token_ids"] and turns[1]["prompt_token_ids"]
        assert r.ttl(session_key(sid)) > 0
    # The sessions go on.
    for sid in sids[:3] + [outage_sid]:
        ids, _, final = _turn(gateway, sid, 3, 6)
        assert final is not None and len(ids) == 6
    wait_until(lambda: all(r.llen(turns_key(s)) == 3 for s in sids[:3]) and r.llen(turns_key(outage_sid)) == 2,
               20, "third turns to be stored")
