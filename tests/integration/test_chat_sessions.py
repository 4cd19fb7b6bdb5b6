"""Chat sessions through the real gateway, real compute replicas and a real
Redis, on a small random-weight model given a chat template: each turn sends
only its new message; compute appends the template's difference to the
session's resident KV, and the greedy reply equals a fresh dense run of the
whole conversation's tokens. After the replica holding it is SIGKILLed the
next turn is re-prefilled on the other one from the history in Redis, and
still equals it. A budgeted chat holds its KV flat from turn to turn. A client
resending the whole conversation gets the same turn;
prompt turns and chat turns do not mix in one session; `kvpop generate --chat
--session` and `kvpop chat` continue one chat across calls."""
from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from kvpop.runtime.paths import REPO_ROOT as REPO
from kvpop.runtime.pb import generate_pb2, generate_pb2_grpc
from kvpop.runtime.session_store import session_key, turns_key
from helpers.common import wait_until
from .test_replicas import gateway_env, sessions_stack

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
N = 6                   # tokens per reply
# Its closing token is the model's EOS, as in ChatML templates: a reply that ends
# with EOS has it in the KV already, one cut at max_tokens gets it from the template.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def chat_model(folder):
    from kvpop.models.default_model import build_placeholder

    model = build_placeholder(folder, seed=0)
    (model / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}))
    return model


class Chat:
    def __init__(self, stub, rc, reference):
        self.stub, self.rc, self.reference = stub, rc, reference

    def turn(self, sid: str, *messages: tuple[str, str], **kw):
        """(token ids, text, usage) of one turn, once its record is stored."""
        before = self.record(sid).get("turns", 0)
        req = generate_pb2.GenerateRequest(
            messages=[generate_pb2.ChatMessage(role=r, content=c) for r, c in messages],
            max_tokens=N, ignore_eos=True, session_id=sid, **kw)
        ids, text, usage = [], [], None
        for r in self.stub.Generate(req, timeout=60):
            if r.HasField("chunk"):
                ids.extend(r.chunk.token_ids)
                text.append(r.chunk.text)
            else:
                usage = r.finished.usage
        assert usage is not None and len(ids) == usage.completion_tokens == N
        wait_until(lambda: self.record(sid).get("turns", 0) == before + 1, 10, f"turn of {sid} stored")
        return ids, "".join(text), usage

    def record(self, sid: str) -> dict:
        return json.loads(self.rc.get(session_key(sid)) or "{}")

    def turns(self, sid: str) -> list[dict]:
        return [json.loads(t) for t in self.rc.lrange(turns_key(sid), 0, -1)]

    def history(self, sid: str) -> list[int]:
        return [i for t in self.turns(sid) for i in t["prompt_token_ids"] + t["completion_token_ids"]]

    def dense(self, ids: list[int]) -> list[int]:
        """Greedy tokens of a fresh dense run over the whole conversation, in process."""
        from services.compute.engine.engine import SamplingParams
        return [o.token_id for o in self.reference.generate(ids, SamplingParams(max_tokens=N, ignore_eos=True))]


def kvpop(*args: str, env: dict, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpop.cli", *args], cwd=REPO, env=env, input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_chat_sessions_continue_their_kv_and_move_with_their_history(redis_server, tmp_path):
    model = chat_model(tmp_path / "model")
    rep_env = dict(KVPOP_MODEL_DIR=str(model))
    with sessions_stack(redis_server, tmp_path, model) as (reps, address, rc, reference):
        tok = reference.tokenizer

        with grpc.insecure_channel(address) as ch:
            chat = Chat(generate_pb2_grpc.KVpopStub(ch), rc, reference)
            said = [("system", "You count fruit."), ("user", "Alice has 3 apples.")]
            ids, text, u = chat.turn("c1", *said)
            assert not u.session_resumed and u.reprefilled_tokens == 0
            conversation = [{"role": r, "content": c} for r, c in said]
            assert chat.turns("c1")[0]["prompt_token_ids"] == tok.encode_chat(conversation)
            assert ids == chat.dense(tok.encode_chat(conversation))
            conversation.append({"role": "assistant", "content": text})
            reps.start("r-b", **rep_env)

            # Turns 2 and 3 send only the new message and continue the resident KV.
            for msg in ("Bob gives her 2 more.", "How many now?"):
                history = chat.history("c1")
                ids, text, u = chat.turn("c1", ("user", msg))
                turn = tok.encode_chat_turn(conversation, [{"role": "user", "content": msg}])
                assert u.session_resumed and u.reprefilled_tokens == 0, u
                assert u.prompt_tokens == len(turn)
                # The turn starts with the template's closing of the previous reply.
                assert turn[0] in reference.eos_ids
                assert ids == chat.dense(history + turn)
                conversation += [{"role": "user", "content": msg}, {"role": "assistant", "content": text}]
            stored = chat.turns("c1")
            assert [t["messages"] for t in stored[1:]] == [[{"role": "user", "content": m}] for m in
                                                           ("Bob gives her 2 more.", "How many now?")]
            assert chat.record("c1")["chat"] and chat.record("c1")["replica"] == "r-a"

            # A budgeted chat: its KV stays at the budget, turn after turn.
            resident = []
            for i, msg in enumerate(("Dave walks 4 km north, then 3 km east, then 2 km south, then 1 km west.",
                                     "Then 5 more.", "And back.", "How far?")):
                _, _, u = chat.turn("c2", ("user", msg), policy="h2o", budget_tokens=32)
                assert u.session_resumed == (i > 0) and u.kv_blocks_evicted > 0, u
                resident.append(u.kv_blocks_resident)
            print(f"\nbudgeted chat: kv blocks resident per turn {resident}")
            assert len(set(resident)) == 1, resident

            # Prompt turns and chat turns do not mix in one session.
            with pytest.raises(grpc.RpcError) as e:
                list(chat.stub.Generate(generate_pb2.GenerateRequest(prompt="Hi", session_id="c1"), timeout=10))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "is a chat" in e.value.details()
            list(chat.stub.Generate(generate_pb2.GenerateRequest(prompt="Hi", session_id="t1", max_tokens=2),
                                    timeout=30))
            wait_until(lambda: chat.record("t1").get("turns") == 1, 10, "t1 stored")
            with pytest.raises(grpc.RpcError) as e:
                chat.turn("t1", ("user", "Hello"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt turns" in e.value.details()

            # r-a dies: the next turn goes to r-b, re-prefilled from the history in Redis.
            wait_until(lambda: set(rc.smembers("kvpop:v1:replicas")) == {"r-a", "r-b"}, 120, "r-b to register")
            reps.kill("r-a")
            history = chat.history("c1")
            msg = "She eats one."
            ids, text, u = chat.turn("c1", ("user", msg))
            turn = tok.encode_chat_turn(conversation, [{"role": "user", "content": msg}])
            assert not u.session_resumed and u.reprefilled_tokens == len(history), u
            assert ids == chat.dense(history + turn)
            assert chat.record("c1")["replica"] == "r-b"
            conversation += [{"role": "user", "content": msg}, {"role": "assistant", "content": text}]

            # The whole conversation resent: its stored part is recognised, only the new message is the turn.
            history = chat.history("c1")
            msg = "And now?"
            ids, _, u = chat.turn("c1", *[(m["role"], m["content"]) for m in conversation], ("user", msg))
            turn = tok.encode_chat_turn(conversation, [{"role": "user", "content": msg}])
            assert u.session_resumed and u.prompt_tokens == len(turn), u
            assert ids == chat.dense(history + turn)
            assert chat.turns("c1")[-1]["messages"] == [{"role": "user", "content": msg}]

        # The CLI: one chat across two `kvpop generate` calls, then `kvpop chat` on stdin.
        cli_env = {**gateway_env(redis_server.url, 0), "KVPOP_GATEWAY_ADDRESS": address}
        first = kvpop("generate", "--chat", "Carol has 7 pears.", "--session", "cli", "--max-tokens", "4", env=cli_env)
        assert first.returncode == 0, first.stderr
        assert "session_resumed false reprefilled_tokens 0" in first.stderr
        second = kvpop("generate", "--chat", "How many?", "--session", "cli", "--max-tokens", "4", env=cli_env)
        assert second.returncode == 0, second.stderr
        assert "session_resumed true reprefilled_tokens 0" in second.stderr
        assert [t["messages"] for t in chat.turns("cli")] == [[{"role": "user", "content": "Carol has 7 pears."}],
                                                              [{"role": "user", "content": "How many?"}]]
        repl = kvpop("chat", "--max-tokens", "4", "--session", "repl", env=cli_env,
                     stdin="Hello.\n/usage\nAgain.\n/usage\n/reset\nNew start.\n/usage\n/quit\n")
        assert repl.returncode == 0, repl.stderr
        usages = [ln for ln in repl.stderr.splitlines() if "reprefilled_tokens" in ln]
        assert len(usages) == 3, repl.stderr
        assert "session_resumed false" in usages[0] and "session_resumed true" in usages[1]
        assert "session_resumed false" in usages[2]     # /reset started a new session
        assert len(chat.turns("repl")) == 2


def test_a_chat_session_is_its_keys_alone(redis_server, tmp_path):
    from services.gateway.apikeys import append_key, new_key
    from services.gateway.ownership import claim_key

    model = chat_model(tmp_path / "model")
    keys = {name: new_key() for name in ("alice", "bob")}
    for name, key in keys.items():
        append_key(tmp_path / "api_keys", name, key)
    keyed = {"KVPOP_API_KEYS_FILE": str(tmp_path / "api_keys")}
    with sessions_stack(redis_server, tmp_path, model, keyed) as (reps, address, rc, reference):
        tok = reference.tokenizer

        def turn(key: str, msg: str):
            req = generate_pb2.GenerateRequest(messages=[generate_pb2.ChatMessage(role="user", content=msg)],
                                               max_tokens=N, ignore_eos=True, session_id="pin")
            ids, text, usage = [], [], None
            for r in stub.Generate(req, metadata=(("authorization", f"Bearer {keys[key]}"),), timeout=60):
                if r.HasField("chunk"):
                    ids.extend(r.chunk.token_ids)
                    text.append(r.chunk.text)
                else:
                    usage = r.finished.usage
            return ids, "".join(text), usage

        def stored_turns() -> int:
            return json.loads(rc.get(session_key("alice~pin")) or "{}").get("turns", 0)

        with grpc.insecure_channel(address) as ch:
            stub = generate_pb2_grpc.KVpopStub(ch)
            secret = {"role": "user", "content": "My PIN is 4719."}
            _, text, _ = turn("alice", secret["content"])
            assert rc.get(claim_key("pin")) == "alice"
            with pytest.raises(grpc.RpcError) as e:
                turn("bob", "What is the PIN?")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            wait_until(lambda: stored_turns() == 1, 10, "alice's turn stored")
            assert json.loads(rc.get(session_key("alice~pin")))["chat"] and not rc.exists(session_key("pin"))
            # Her next turn is re-prefilled (its replica named gone) from the history under her name.
            record = json.loads(rc.get(session_key("alice~pin")))
            rc.set(session_key("alice~pin"), json.dumps({**record, "replica": "gone"}), keepttl=True)
            history = [i for t in rc.lrange(turns_key("alice~pin"), 0, -1)
                       for i in json.loads(t)["prompt_token_ids"] + json.loads(t)["completion_token_ids"]]
            ask = {"role": "user", "content": "What is my PIN?"}
            ids, _, u = turn("alice", ask["content"])
            assert u.reprefilled_tokens == len(history)
            from services.compute.engine.engine import SamplingParams
            whole = history + tok.encode_chat_turn([secret, {"role": "assistant", "content": text}], [ask])
            assert ids == [o.token_id for o in reference.generate(whole, SamplingParams(max_tokens=N, ignore_eos=True))]
