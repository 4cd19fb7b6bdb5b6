"""Sessions across replicas, through the real gateway, two real compute
replicas and a real Redis: turns continue the resident KV on the session's
replica (only the new turn's tokens are prefilled); when that replica dropped
the KV (idle TTL) the turn is re-prefilled there from the stored history;
when it is killed the next turn is re-prefilled on the other replica, whose
greedy output equals a fresh dense run of the whole conversation, and the
session record names the new replica."""
from __future__ import annotations

import json
import os
import time

import grpc
import pytest

from kvpop.runtime.pb import compute_pb2, compute_pb2_grpc, generate_pb2, generate_pb2_grpc
from kvpop.runtime.session_store import session_key, turns_key
from helpers.common import wait_until
from .test_replicas import sessions_stack

pytestmark = pytest.mark.slow

# Replicas drop a session's KV after this long idle: long enough that the resident
# sessions' next turns come within it on a loaded machine (a replica's start and two
# other turns lie between them), short enough to wait out for s3.
KV_TTL_S = float(os.environ.get("KVPOP_TEST_KV_TTL_S", "15"))
MAX_MODEL_LEN = 512
N = 6                   # tokens per turn


class Chat:
    def __init__(self, stub, rc, reference):
        self.stub, self.rc, self.reference = stub, rc, reference

    def turn(self, sid: str, prompt: str, **kw):
        """(token ids, usage) of one turn, once its record is stored."""
        before = self.record(sid).get("turns", 0)
        req = generate_pb2.GenerateRequest(prompt=prompt, max_tokens=N, ignore_eos=True, session_id=sid, **kw)
        ids, usage = [], None
        for r in self.stub.Generate(req, timeout=60):
            if r.HasField("chunk"):
                ids.extend(r.chunk.token_ids)
            else:
                usage = r.finished.usage
        assert usage is not None and len(ids) == usage.completion_tokens == N
        wait_until(lambda: self.record(sid).get("turns", 0) == before + 1, 10, f"turn of {sid} stored")
        return ids, usage

    def record(self, sid: str) -> dict:
        return json.loads(self.rc.get(session_key(sid)) or "{}")

    def history(self, sid: str) -> list[int]:
        turns = [json.loads(t) for t in self.rc.lrange(turns_key(sid), 0, -1)]
        return [i for t in turns for i in t["prompt_token_ids"] + t["completion_token_ids"]]

    def dense(self, ids: list[int]) -> list[int]:
        """Greedy tokens of a fresh dense run over the whole conversation, in process."""
        from services.compute.engine.engine import SamplingParams
        return [o.token_id for o in self.reference.generate(ids, SamplingParams(max_tokens=N, ignore_eos=True))]


def compute_stats(address: str) -> dict:
    with grpc.insecure_channel(address) as ch:
        return dict(compute_pb2_grpc.ComputeStub(ch).Info(compute_pb2.InfoRequest(), timeout=5).stats.extra)


def test_sessions_continue_resident_kv_and_reprefill_when_it_is_gone(redis_server, tmp_path):
    from kvpop.models.default_model import build_placeholder
    # Own weights: models/default may be retrained while the suite runs.
    model = build_placeholder(tmp_path / "model", seed=0)
    rep_env = dict(KVPOP_MODEL_DIR=str(model), KVPOP_SESSION_KV_TTL_S=str(KV_TTL_S))
    # r-a alone first, so every session starts on it; r-b loads while they run.
    with sessions_stack(redis_server, tmp_path, model, KVPOP_SESSION_KV_TTL_S=str(KV_TTL_S)) as (
            reps, address, rc, reference):
        tok = reference.tokenizer

        with grpc.insecure_channel(address) as ch:
            chat = Chat(generate_pb2_grpc.KVpopStub(ch), rc, reference)
            t0 = time.monotonic()
            # s3's KV will be dropped by r-a's idle TTL.
            p3 = "Carol counts 7 pears."
            out3, u = chat.turn("s3", p3)
            idle_since = time.monotonic()
            assert not u.session_resumed and u.reprefilled_tokens == 0
            p1 = ["Alice has 3 apples.", " Bob gives her 2 more.", " How many now?"]
            out1, u = chat.turn("s1", p1[0])
            assert not u.session_resumed and u.reprefilled_tokens == 0
            assert u.prompt_tokens == len(tok.encode(p1[0]))
            # Longer than its budget: it evicts from the first turn on.
            p2 = ["Dave walks 4 km north, then 3 km east, then 2 km south, and then 1 km west to get home.",
                  " Then 5 more."]
            chat.turn("s2", p2[0], policy="h2o", budget_tokens=64)
            reps.start("r-b", **rep_env)

            # Turns 2 and 3 continue the resident KV: only their own tokens are prefilled.
            for text in p1[1:]:
                history = chat.history("s1")
                ids, u = chat.turn("s1", text)
                turn = tok.encode(text, add_bos=False)
                assert u.session_resumed and u.reprefilled_tokens == 0, u
                assert u.prompt_tokens == len(turn)
                assert ids == chat.dense(history + turn)
            _, u = chat.turn("s2", p2[1], policy="h2o", budget_tokens=64)
            assert u.session_resumed and u.kv_blocks_evicted > 0, u
            assert {chat.record(s)["replica"] for s in ("s1", "s2", "s3")} == {"r-a"}
            assert chat.record("s1")["tokens"] == len(chat.history("s1"))

            wait_until(lambda: set(rc.smembers("kvpop:v1:replicas")) == {"r-a", "r-b"}, 120, "r-b to register")
            # r-a dropped s3's idle KV: its next turn is re-prefilled there, from the history.
            wait_until(lambda: time.monotonic() > idle_since + KV_TTL_S + 0.2, KV_TTL_S + 1, "s3's KV TTL")
            history = chat.history("s3")
            ids, u = chat.turn("s3", " She eats 2.")
            turn = tok.encode(" She eats 2.", add_bos=False)
            assert not u.session_resumed and u.reprefilled_tokens == len(history) == len(tok.encode(p3)) + N
            assert u.prompt_tokens == len(turn)
            assert ids == chat.dense(history + turn)
            assert chat.record("s3")["replica"] == "r-a"
            assert compute_stats(reps.addresses["r-a"])["sessions_expired"] >= 1
            print(f"\nsessions: r-a up to the TTL re-prefill in {time.monotonic() - t0:.1f} s")

            # r-a dies: the next turn goes to r-b, re-prefilled from the history.
            reps.kill("r-a")
            killed = time.monotonic()
            history = chat.history("s1")
            text = " Then she eats one."
            ids, u = chat.turn("s1", text)
            turn = tok.encode(text, add_bos=False)
            assert not u.session_resumed and u.reprefilled_tokens == len(history), u
            assert u.prompt_tokens == len(turn)
            assert ids == chat.dense(history + turn)
            record = chat.record("s1")
            assert record["replica"] == "r-b" and record["turns"] == 4
            assert record["tokens"] == len(history) + len(turn) + N == len(chat.history("s1"))
            print(f"sessions: re-prefill of {len(history)} tokens on r-b {time.monotonic() - killed:.2f} s "
                  "after r-a was killed")
            # From now on r-b holds it: the next turn continues there.
            history = chat.history("s1")
            ids, u = chat.turn("s1", " Left?")
            assert u.session_resumed and u.reprefilled_tokens == 0
            assert ids == chat.dense(history + tok.encode(" Left?", add_bos=False))
            # A budgeted session is re-prefilled (with evictions) and completes.
            history = chat.history("s2")
            _, u = chat.turn("s2", " And back.", policy="h2o", budget_tokens=64)
            assert not u.session_resumed and u.reprefilled_tokens == len(history) and u.kv_blocks_evicted > 0
            assert chat.record("s2")["replica"] == "r-b"
