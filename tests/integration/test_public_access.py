"""Who may use the public API, through a real gateway process (in front of the
shared stack's compute and Redis) configured as a deployment would be: API
keys in a file that changes while it runs, per-key limits, sessions owned by
their key, TLS on the public port."""
from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time

import grpc
import pytest
import redis as redis_sync

from helpers.pki import make_pki
from kvpop.runtime.paths import REPO_ROOT
from kvpop.runtime.pb import generate_pb2, generate_pb2_grpc
from kvpop.runtime.session_store import session_key
from .public_gateway import Burst, PublicGateway, reflected_generate
from services.gateway.apikeys import append_key, new_key, remove_key
from services.gateway.ownership import claim_key

KEYS = {name: new_key() for name in ("alice", "bob", "burst", "calm", "rpm", "tpm", "small")}
LIMITS = {"burst": {"streams": 1}, "rpm": {"requests_per_minute": 3}, "tpm": {"tokens_per_minute": 10},
          "small": {"max_tokens": 8}}


def md(name: str) -> tuple:
    return (("authorization", f"Bearer {KEYS[name]}"),)


def req(prompt: str = "Hello there.", n: int = 8, **kw) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(prompt=prompt, max_tokens=n, ignore_eos=True, policy="dense", **kw)


def run(stub, request, metadata, timeout: float = 60):
    """(token ids, finished) of a whole stream."""
    ids, final = [], None
    for r in stub.Generate(request, metadata=metadata, timeout=timeout):
        if r.HasField("chunk"):
            ids.extend(r.chunk.token_ids)
        else:
            final = r.finished
    return ids, final


def refused(stub, request, metadata) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        run(stub, request, metadata)
    return e.value


@pytest.fixture(scope="module")
def keyed(stack, otlp, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyed-gateway")
    key_file = tmp / "api_keys"
    for name, key in KEYS.items():
        append_key(key_file, name, key, LIMITS.get(name))
    gw = PublicGateway(stack, tmp, {"KVPOP_API_KEYS_FILE": str(key_file)}, otlp_port=otlp.port)
    gw.key_file = key_file
    with grpc.insecure_channel(gw.address) as ch:
        gw.wait_serving(ch)
        gw.stub = generate_pb2_grpc.KVpopStub(ch)
        yield gw
    gw.stop()


def test_keys_refuse_strangers_and_reload_without_disturbing_streams(keyed, otlp):
    stub = keyed.stub
    # A long stream of alice's is in flight through all of what follows.
    long = {}
    t = threading.Thread(target=lambda: long.update(zip(("ids", "final"), run(stub, req(n=1500), md("alice")))))
    t.start()
    missing = refused(stub, req(), ())
    assert missing.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in missing.details()
    wrong = refused(stub, req(), (("authorization", "Bearer " + new_key()),))
    assert wrong.code() == grpc.StatusCode.UNAUTHENTICATED and "unknown or revoked" in wrong.details()
    for header in ((("x-api-key", KEYS["bob"]),), (("authorization", KEYS["bob"]),)):
        e = refused(stub, req(), header)
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, header
    with pytest.raises(grpc.RpcError) as e:
        stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The right key is served, its name (never the key) in the trace.
    trace_id = secrets.token_hex(16)
    ids, final = run(stub, req(), md("bob") + (("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),))
    assert len(ids) == 8 and final.finish_reason_text == "length"
    assert stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), metadata=md("bob"), timeout=10).name

    # Revoked while the gateway runs: refused from the next call on; a new key works at once.
    remove_key(keyed.key_file, "bob")
    assert refused(stub, req(), md("bob")).code() == grpc.StatusCode.UNAUTHENTICATED
    KEYS["carol"] = new_key()
    append_key(keyed.key_file, "carol", KEYS["carol"])
    assert len(run(stub, req(), md("carol"))[0]) == 8
    assert t.is_alive(), "alice's stream ended before the keys changed: make it longer"

    t.join(60)
    assert len(long["ids"]) == 1500 and long["final"].finish_reason_text == "length", "alice's stream was disturbed"
    text = keyed.metrics()
    assert 'kvpop_api_key_requests_total{key="alice"} 1.0' in text
    assert not any(k in text for k in KEYS.values()), "a key reached the metrics"
    deadline = time.monotonic() + 15
    while not (spans := otlp.span_attributes(trace_id, "gateway", "/kvpop.v1.KVpop/Generate")):
        assert time.monotonic() < deadline, otlp.span_names(trace_id)
        time.sleep(0.1)
    assert spans[0].get("kvpop.api_key") == "bob"


def test_a_session_is_its_keys_alone(keyed, stack, placeholder_model):
    stub = keyed.stub
    sid = "s1-" + secrets.token_hex(3)
    secret = "My bank PIN is 4719."
    first, _ = run(stub, req(secret, session_id=sid), md("alice"))
    rc = redis_sync.Redis.from_url(stack.redis_url, decode_responses=True)
    assert rc.get(claim_key(sid)) == "alice"
    # Another key naming it: NOT_FOUND, and not one token of anything.
    got = []
    with pytest.raises(grpc.RpcError) as e:
        for r in stub.Generate(req("What is my bank PIN?", session_id=sid), metadata=md("calm"), timeout=30):
            got.append(r)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and not got, e.value.details()
    # Stored under its owner: no record answers to the bare id.
    deadline = time.monotonic() + 10
    while not rc.exists(session_key(f"alice~{sid}")):
        assert time.monotonic() < deadline, "alice's turn was not stored"
        time.sleep(0.05)
    assert not rc.exists(session_key(sid))
    # Alice's next turn continues her own conversation: its greedy tokens are
    # those of the whole history, the secret in it, recomputed in process.
    second, final = run(stub, req(" What is my PIN?", session_id=sid), md("alice"))
    assert final.usage.session_resumed
    from services.compute.engine.engine import EngineConfig, LLMEngine, SamplingParams
    engine = LLMEngine(EngineConfig(str(placeholder_model), max_model_len=256, max_num_seqs=1,
                                    prefix_cache_fraction=0))
    tok = engine.tokenizer
    history = tok.encode(secret) + first + tok.encode(" What is my PIN?", add_bos=False)
    assert second == [o.token_id for o in engine.generate(history, SamplingParams(max_tokens=8, ignore_eos=True))]
    # Its replica gone (the record names one no longer registered): the next
    # turn is re-prefilled from the history stored under alice's name.
    deadline = time.monotonic() + 10
    while json.loads(rc.get(session_key(f"alice~{sid}")))["turns"] < 2:
        assert time.monotonic() < deadline, "alice's second turn was not stored"
        time.sleep(0.05)
    record = json.loads(rc.get(session_key(f"alice~{sid}")))
    rc.set(session_key(f"alice~{sid}"), json.dumps({**record, "replica": "gone"}), keepttl=True)
    history += second + tok.encode(" Say it again.", add_bos=False)
    third, final = run(stub, req(" Say it again.", session_id=sid), md("alice"))
    assert final.usage.reprefilled_tokens == len(history) - len(tok.encode(" Say it again.", add_bos=False))
    assert third == [o.token_id for o in engine.generate(history, SamplingParams(max_tokens=8, ignore_eos=True))]
    # Even with the claim gone (expired, lost with Redis), the other key only
    # ever reaches a session of its own: a fresh one, nothing of alice's.
    rc.delete(claim_key(sid))
    ids, final = run(stub, req("What is my bank PIN?", session_id=sid), md("calm"))
    assert not final.usage.session_resumed and not final.usage.reprefilled_tokens
    assert final.usage.prompt_tokens == len(tok.encode("What is my bank PIN?"))
    assert rc.get(claim_key(sid)) == "calm"


def _latencies(stub, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        assert len(run(stub, req(f"calm request {i}", n=16), md("calm"))[0]) == 16
        out.append(time.perf_counter() - t0)
    return out


def test_per_key_limits_hold_a_burst_while_others_keep_their_latency(keyed):
    stub = keyed.stub
    _latencies(stub, 2)     # warm
    # Alone, beside the key's allowance used politely (one stream at a time),
    # and during its bursts, in turns: whatever else the machine runs weighs
    # on all three alike.
    alone, polite, during = [], [], []
    one, burst = Burst(keyed.address, KEYS["burst"], width=1), Burst(keyed.address, KEYS["burst"])
    try:
        one.pause()
        for _ in range(10):
            burst.pause()
            alone += _latencies(stub, 1)
            one.go()
            polite += _latencies(stub, 1)
            one.pause()
            burst.go()
            during += _latencies(stub, 1)
    finally:
        seen = burst.stop()
        one.stop()
    # The burst got its one stream at a time, most calls refused at once, saying why.
    assert seen["served"] >= 1 and sum(seen["refused"].values()) >= 3 * seen["served"], seen
    assert all(r.startswith("RESOURCE_EXHAUSTED: API key 'burst' already has 1 streams open") for r in seen["refused"]), \
        seen
    # A burst costs the others no more than the key's allowance does. (What
    # that allowance costs depends on the device: on this CPU test stack one
    # more stream decoding beside a request slows it by about half; a GPU
    # batches it nearly for free.) Without the limit the same bursts cost ~1.8x.
    p50 = {name: statistics.median(v) for name, v in (("alone", alone), ("polite", polite), ("during", during))}
    assert p50["during"] <= 1.5 * p50["polite"], p50

    # Requests per minute: the 4th in a minute is refused, saying when to retry.
    for _ in range(3):
        run(stub, req(n=2), md("rpm"))
    e = refused(stub, req(n=2), md("rpm"))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "3 requests per minute" in e.details()
    retry = dict(e.trailing_metadata())["retry-after"]
    assert 1 <= int(retry) <= 60 and f"retry in {retry} s" in e.details()
    # Tokens per minute: a stream started under the limit finishes; the next call waits.
    assert len(run(stub, req(n=16), md("tpm"))[0]) == 16
    e = refused(stub, req(n=2), md("tpm"))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "10 tokens per minute" in e.details()
    # Largest max_tokens: above it refused; unset, the default is capped to it.
    e = refused(stub, req(n=9), md("small"))
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 8" in e.details()
    ids, _ = run(stub, generate_pb2.GenerateRequest(prompt="Hi", ignore_eos=True, policy="dense"), md("small"))
    assert len(ids) == 8
    text = keyed.metrics()
    for name, limit in (("burst", "streams"), ("rpm", "requests_per_minute"), ("tpm", "tokens_per_minute"),
                        ("small", "max_tokens")):
        assert f'kvpop_api_key_refusals_total{{key="{name}",limit="{limit}"}}' in text, (name, limit)


def _tls_gateway(stack, tmp_path, user: str, **extra: str):
    """(pki folder, a key of ``user``, a keyed gateway serving TLS with ``extra`` settings)."""
    pki = make_pki(tmp_path)
    key_file = tmp_path / "api_keys"
    key = new_key()
    append_key(key_file, user, key)
    env = {"KVPOP_API_KEYS_FILE": str(key_file), "KVPOP_PUBLIC_TLS_CERT": str(pki / "server.pem"),
           "KVPOP_PUBLIC_TLS_KEY": str(pki / "server.key"), **{k: v.format(pki=pki) for k, v in extra.items()}}
    return pki, key, PublicGateway(stack, tmp_path, env)


def test_tls_on_the_public_port(stack, tmp_path):
    pki, key, gw = _tls_gateway(stack, tmp_path, "tls-user")
    good = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.pem").read_bytes())
    rogue = grpc.ssl_channel_credentials(root_certificates=(pki / "rogue-ca.pem").read_bytes())
    try:
        with grpc.secure_channel(gw.address, good) as ch:
            gw.wait_serving(ch)
            stub = generate_pb2_grpc.KVpopStub(ch)
            auth = (("authorization", f"Bearer {key}"),)
            ids, final = run(stub, req(), auth)
            assert len(ids) == 8 and final.finish_reason_text == "length"
            # A client knowing only reflection: discovers the API over TLS, calls it with the key.
            replies = reflected_generate(ch, {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True,
                                              "policy": "dense"}, metadata=auth)
            assert replies[-1]["finished"]["usage"]["completionTokens"] == 4
            with pytest.raises(grpc.RpcError) as e:
                reflected_generate(ch, {"prompt": "Hi", "max_tokens": 4}, metadata=())
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Without the CA (another one, or none) the handshake fails: nothing is served.
        for channel in (grpc.secure_channel(gw.address, rogue), grpc.insecure_channel(gw.address)):
            with channel as ch:
                with pytest.raises(grpc.RpcError) as e:
                    run(generate_pb2_grpc.KVpopStub(ch), req(), (("authorization", f"Bearer {key}"),), timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        # The command line client: --ca and the key from KVPOP_API_KEY.
        cli = subprocess.run([sys.executable, "-m", "kvpop.cli", "generate", "Hi", "--max-tokens", "3", "--ignore-eos",
                              "--policy", "dense", "--address", gw.address, "--ca", str(pki / "ca.pem")],
                             capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
                             env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "KVPOP_API_KEY": key})
        assert cli.returncode == 0 and "completion 3 tok" in cli.stderr, cli.stderr
    finally:
        gw.stop()


def test_client_certificates_on_the_public_port(stack, tmp_path):
    pki, key, gw = _tls_gateway(stack, tmp_path, "mtls-user", KVPOP_PUBLIC_TLS_CA="{pki}/ca.pem")
    ca = (pki / "ca.pem").read_bytes()
    client = grpc.ssl_channel_credentials(ca, (pki / "client.key").read_bytes(), (pki / "client.pem").read_bytes())
    rogue = grpc.ssl_channel_credentials(ca, (pki / "rogue.key").read_bytes(), (pki / "rogue.pem").read_bytes())
    auth = (("authorization", f"Bearer {key}"),)
    try:
        with grpc.secure_channel(gw.address, client) as ch:
            gw.wait_serving(ch)
            assert len(run(generate_pb2_grpc.KVpopStub(ch), req(), auth)[0]) == 8
        for creds in (grpc.ssl_channel_credentials(ca), rogue):     # no certificate, or one the CA did not sign
            with grpc.secure_channel(gw.address, creds) as ch:
                with pytest.raises(grpc.RpcError) as e:
                    run(generate_pb2_grpc.KVpopStub(ch), req(), auth, timeout=5)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        gw.stop()
