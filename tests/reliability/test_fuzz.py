"""Fuzzing the public API (hypothesis): every GenerateRequest field with
random, extreme, unicode and huge values, and raw bytes as the request
message. Each request gets a clear status — OK when docs/reference/api.md says the
request is valid, INVALID_ARGUMENT or RESOURCE_EXHAUSTED with a message when
it is not, never UNKNOWN/INTERNAL or a traceback. Meanwhile a good request
runs again and again and always gets the tokens it gets alone, and afterwards
every service is alive, SERVING, and the KV pool is back to idle."""
from __future__ import annotations

import itertools
import math
import re
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from .reliability_stack import MAX_MODEL_LEN, collect, request, wait_until
from kvpop.runtime.pb import generate_pb2
from kvpop.runtime.security import SecurityConfig, sync_channel

pytestmark = pytest.mark.slow

OK, IA, RE = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
INT32 = (-2**31, 2**31 - 1)
MAX_PROMPT_CHARS, MAX_TOKENS_LIMIT, MAX_STOP, MAX_STOP_CHARS = 65536, 4096, 8, 256
MIN_BUDGET = 24     # sink 4 + recent 8 rounded up to whole blocks of 8, + one block: the smallest token budget
ID = re.compile(r"[A-Za-z0-9._:@/-]{1,128}")
SETTINGS = dict(deadline=None, database=None, derandomize=True, print_blob=True,
                suppress_health_check=list(HealthCheck))
GOOD = request(prompt="The good request, alongside the fuzz.", max_tokens=48, ignore_eos=True, policy="h2o",
               budget_tokens=64)


# ---- strategies ------------------------------------------------------------

def _floats():
    return st.one_of(st.none(), st.floats(width=32), st.floats(0, 2, width=32),
                     st.sampled_from([0.0, -0.0, 1.0, 100.0, 100.00001, 1e-45, math.inf, -math.inf, math.nan]))


def _huge():
    return st.builds(lambda c, n: c * n, st.characters(), st.sampled_from([129, 257, 100_000]))


def _ids():
    return st.one_of(st.just(""), st.from_regex(ID, fullmatch=True), st.text(max_size=200), _huge())


# Huge strings are built by repetition: hypothesis cannot draw megabytes.
_prompts = st.one_of(
    st.text(max_size=60),
    st.builds(lambda c, n: c * n, st.characters(), st.sampled_from([1, 300, 2000, MAX_PROMPT_CHARS,
                                                                    MAX_PROMPT_CHARS + 1, 300_000, 5_000_000])),
)
_max_tokens = st.one_of(st.none(), st.integers(1, 8), st.sampled_from([INT32[0], -1, 0, MAX_TOKENS_LIMIT + 1, INT32[1]]),
                        st.integers(*INT32).filter(lambda v: not 1 <= v <= MAX_TOKENS_LIMIT))


def _fields(policies: list[str]) -> dict[str, tuple]:
    """field -> (strategy of valid values, strategy of any value); None = leave unset."""
    usable = [p for p in policies if p != "oracle"]
    return {
        "prompt": (st.text(min_size=1, max_size=60), _prompts),
        "max_tokens": (st.one_of(st.none(), st.integers(1, 8)), _max_tokens),
        "temperature": (st.one_of(st.none(), st.floats(0, 2, width=32)), _floats()),
        "top_p": (st.one_of(st.none(), st.floats(0.0625, 1, width=32)), _floats()),
        "repetition_penalty": (st.one_of(st.none(), st.floats(0.5, 2, width=32)), _floats()),
        "top_k": (st.one_of(st.none(), st.integers(0, 50)), st.one_of(st.none(), st.integers(*INT32))),
        "seed": (st.one_of(st.none(), st.integers(0, 2**63 - 1)), st.one_of(st.none(), st.integers(0, 2**64 - 1))),
        "stop": (st.lists(st.text(min_size=1, max_size=4), max_size=3),
                 st.lists(st.one_of(st.text(max_size=4), st.text(min_size=250, max_size=300), _huge()), max_size=10)),
        "policy": (st.sampled_from(["", *usable]), st.one_of(st.sampled_from(["", *policies]), st.text(max_size=20),
                                                                _huge())),
        "budget_tokens": (st.one_of(st.none(), st.integers(MIN_BUDGET, MAX_MODEL_LEN)),
                          st.one_of(st.integers(*INT32), st.integers(0, 2 * MAX_MODEL_LEN))),
        "budget_fraction": (st.one_of(st.none(), st.floats(0.0625, 1, width=32)),
                            st.one_of(st.floats(width=32), st.floats(0, 1, width=32))),
        "session_id": (st.one_of(st.just(""), st.from_regex(ID, fullmatch=True)), _ids()),
        "request_id": (st.one_of(st.just(""), st.from_regex(ID, fullmatch=True)), _ids()),
        "ignore_eos": (st.booleans(), st.booleans()),
        "logprobs": (st.booleans(), st.booleans()),
    }


@st.composite
def requests(draw, policies: list[str]) -> tuple[generate_pb2.GenerateRequest, str | None]:
    """A request with every field valid, one field fuzzed (its name is returned), or all fuzzed."""
    fields = _fields(policies)
    mode = draw(st.sampled_from(["valid", "one", "one", "all"]))
    fuzzed = draw(st.sampled_from(sorted(fields))) if mode == "one" else None
    # The two budget fields are a oneof: at most one of them is drawn.
    budget = draw(st.sampled_from(["budget_tokens", "budget_fraction"]))
    req = generate_pb2.GenerateRequest()
    for name, (valid, anything) in fields.items():
        if name.startswith("budget_") and name != budget and name != fuzzed:
            continue
        value = draw(anything if mode == "all" or name == fuzzed else valid)
        if name == "stop":
            req.stop.extend(value)
        elif value is not None:
            setattr(req, name, value)
    return req, fuzzed


# Each rule just outside and just inside its range, one field at a time; the
# oracle below says which must be refused.
_F32_OVER_100 = 100.00001        # the next float32 above 100 (and 1.0000001 above 1)
EDGES = [(dict(f), name) for f, name in [
    ({"prompt": ""}, "prompt"), ({"prompt": "p" * MAX_PROMPT_CHARS}, "prompt"),
    ({"prompt": "p" * (MAX_PROMPT_CHARS + 1)}, "prompt"), ({"prompt": "é" * 600}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens"),
    ({"temperature": 100.0}, "temperature"), ({"temperature": _F32_OVER_100}, "temperature"),
    ({"temperature": -1e-45}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": 1e30}, "temperature"),
    ({"top_p": 1e-45}, "top_p"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.0000001}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"repetition_penalty": 100.0}, "repetition_penalty"), ({"repetition_penalty": _F32_OVER_100}, "repetition_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": -math.inf}, "repetition_penalty"),
    ({"top_k": -1}, "top_k"), ({"top_k": INT32[1]}, "top_k"),
    ({"seed": 2**63 - 1}, "seed"), ({"seed": 2**63}, "seed"), ({"seed": 2**64 - 1}, "seed"),
    ({"stop": ["s" * MAX_STOP_CHARS] * MAX_STOP}, "stop"), ({"stop": ["s"] * (MAX_STOP + 1)}, "stop"),
    ({"stop": ["s" * (MAX_STOP_CHARS + 1)]}, "stop"), ({"stop": [""]}, "stop"), ({"stop": ["x" * 100_000]}, "stop"),
    ({"policy": "nope"}, "policy"), ({"policy": "p" * 100_000}, "policy"), ({"policy": "DENSE"}, "policy"),
    ({"budget_tokens": 0}, "budget_tokens"), ({"budget_tokens": MIN_BUDGET - 1}, "budget_tokens"),
    ({"budget_tokens": MIN_BUDGET}, "budget_tokens"), ({"budget_tokens": MAX_MODEL_LEN}, "budget_tokens"),
    ({"budget_tokens": MAX_MODEL_LEN + 1}, "budget_tokens"), ({"budget_tokens": INT32[0]}, "budget_tokens"),
    ({"budget_fraction": 1.0}, "budget_fraction"), ({"budget_fraction": 1.0000001}, "budget_fraction"),
    ({"budget_fraction": 0.0}, "budget_fraction"), ({"budget_fraction": 1e-45}, "budget_fraction"),
    ({"budget_fraction": math.nan}, "budget_fraction"),
    ({"session_id": "s" * 128}, "session_id"), ({"session_id": "s" * 129}, "session_id"),
    ({"session_id": "a b"}, "session_id"), ({"session_id": "s" * 100_000}, "session_id"),
    ({"session_id": "s\n"}, "session_id"),
    ({"request_id": "r\u00e9"}, "request_id"), ({"request_id": "\x00"}, "request_id"),
]]


# ---- the documented rules (docs/reference/api.md), as an oracle ----------------------

def expected(req: generate_pb2.GenerateRequest, policies: list[str]) -> set[grpc.StatusCode]:
    """The statuses docs/reference/api.md allows for `req` (a set when rules leave room)."""
    bad: set[grpc.StatusCode] = set()
    grey = False

    def outside(name, lo, hi, lo_open):
        v = getattr(req, name)
        return req.HasField(name) and not (math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi)

    if not req.prompt:
        bad.add(IA)
    if req.messages:
        bad.add(IA)     # the placeholder has no chat template (and with a prompt: not both)
    if len(req.prompt) > MAX_PROMPT_CHARS or len(req.prompt.encode()) > 4 * 1024 * 1024:
        bad.add(RE)
    n_bytes = len(req.prompt.encode())
    # Byte-level tokenizer: one token per byte + BOS (special-token spellings are shorter: near the edge, either).
    if n_bytes + 1 >= MAX_MODEL_LEN + 100:
        bad.add(RE)
    elif n_bytes + 1 >= MAX_MODEL_LEN - 100:
        grey = True
    if req.HasField("max_tokens"):
        if req.max_tokens < 1:
            bad.add(IA)
        elif req.max_tokens > MAX_TOKENS_LIMIT:
            bad.add(RE)
    if outside("temperature", 0, 100, False) or outside("top_p", 0, 1, True) \
            or outside("repetition_penalty", 0, 100, True) or (req.HasField("top_k") and req.top_k < 0):
        bad.add(IA)
    if len(req.stop) > MAX_STOP or any(not 1 <= len(s) <= MAX_STOP_CHARS for s in req.stop):
        bad.add(IA)
    policy = req.policy or "learned"
    if policy not in policies:
        bad.add(IA)
    which = req.WhichOneof("kv_budget")
    if which == "budget_tokens":
        if not 1 <= req.budget_tokens <= MAX_MODEL_LEN:
            bad.add(IA)
        elif req.budget_tokens < MIN_BUDGET and policy != "dense":
            bad.add(IA)
        elif req.budget_tokens < MIN_BUDGET:
            grey = True
    elif which == "budget_fraction" and outside("budget_fraction", 0, 1, True):
        bad.add(IA)
    for name in ("session_id", "request_id"):
        if getattr(req, name) and not ID.fullmatch(getattr(req, name)):
            bad.add(IA)
    if req.HasField("seed") and req.seed >= 2**63:
        bad.add(IA)
    if policy == "oracle":
        grey = True     # evaluation-only policy: accepted or refused
    if bad:
        return bad
    return {OK, IA, RE} if grey else {OK}


def check(outcome: tuple[grpc.StatusCode, str, int | None], allowed: set[grpc.StatusCode], what) -> None:
    code, details, tokens = outcome
    assert len(details) < 1000, f"a {len(details)}-character status message"
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (code, details, what)
    assert "Traceback" not in details and 'File "' not in details, details
    if code != OK:
        assert details.strip(), f"{code.name} without a message"
    assert code in allowed, f"{code.name} {details!r}, want one of {[c.name for c in allowed]}: {what}"


def run(call) -> tuple[grpc.StatusCode, str, int | None]:
    try:
        ids, _, final = collect(call)
    except grpc.RpcError as e:
        return e.code(), e.details() or "", None
    assert final is not None, "a stream ended without its final message"
    return OK, "", len(ids)


def _short(req: generate_pb2.GenerateRequest) -> str:
    text = str(req)
    return text if len(text) < 600 else text[:600] + f"... ({len(text)} chars)"


class GoodAlongside:
    """Runs GOOD back to back on its own connection and compares every run with the solo one."""

    def __init__(self, address: str, alone: list[int]):
        from kvpop.runtime.pb import generate_pb2_grpc

        self.channel = grpc.insecure_channel(address)
        self.stub = generate_pb2_grpc.KVpopStub(self.channel)
        self.alone, self.runs, self.mismatches = alone, 0, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop)

    def _loop(self):
        while not self.stop.is_set():
            try:
                ids, _, _ = collect(self.stub.Generate(GOOD, timeout=120))
            except grpc.RpcError as e:
                self.mismatches.append(f"{e.code().name}: {e.details()}")
                continue
            self.runs += 1
            if ids != self.alone:
                self.mismatches.append(f"run {self.runs}: {ids[:8]}... != {self.alone[:8]}...")

    def __enter__(self):
        self.thread.start()
        wait_until(lambda: self.runs or self.mismatches, 60, "the good request to complete once")
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(120)
        self.channel.close()


def _all_serving_and_alive(secure_stack) -> None:
    st = secure_stack.stack.reload()    # pids as the supervisor last wrote them
    for p in st.processes:
        assert p.alive(), f"{p.name} died"
        if p.name in ("redis", "supervisor"):
            continue
        cfg = SecurityConfig() if p.name == "gateway" else secure_stack.client_security
        with sync_channel(p.address, cfg) as ch:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING, p.name


@pytest.fixture(scope="module")
def policies(gateway) -> list[str]:
    return list(gateway.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=10).policies)


@pytest.fixture(scope="module")
def alone(gateway, secure_stack) -> list[int]:
    ids, _, _ = collect(gateway.Generate(GOOD, timeout=120))
    assert len(ids) == GOOD.max_tokens
    return ids


def test_fuzz_request_fields(secure_stack, gateway, policies, alone):
    idle = secure_stack.pool_idle()
    seen: dict[str, int] = {}
    fresh = itertools.count()

    def one(drawn):
        req, fuzzed = drawn
        if ID.fullmatch(req.session_id):
            # A session id seen before continues that conversation, which may outgrow the model's
            # length; fields are under test here, not sessions: every valid id names a new one.
            req.session_id = f"{next(fresh)}-{req.session_id}"[:128]
        outcome = run(gateway.Generate(req, timeout=60))
        check(outcome, expected(req, policies), _short(req))
        seen[outcome[0].name] = seen.get(outcome[0].name, 0) + 1
        if fuzzed and outcome[0] != OK and len(req.prompt.encode()) < 4 * 1024 * 1024:
            # The one bad field is the one the message names (gRPC's own size check aside).
            word = {"budget_tokens": "budget", "budget_fraction": "budget", "stop": "stop"}.get(fuzzed, fuzzed)
            assert word in outcome[1], (fuzzed, outcome[1])
        if outcome[0] == OK:
            limit = req.max_tokens if req.HasField("max_tokens") else 8
            assert outcome[2] <= limit

    # Every rule's edges first (hypothesis runs explicit examples before drawing), then random requests.
    for fields, fuzzed in EDGES:
        one = example(drawn=(request(**fields), fuzzed))(one)
    one = settings(max_examples=100 + len(EDGES), **SETTINGS)(given(drawn=requests(policies))(one))
    t0 = time.monotonic()
    with GoodAlongside(secure_stack.stack.gateway, alone) as good:
        one()
    print(f"\nfuzz fields: {sum(seen.values())} requests {seen} in {time.monotonic() - t0:.1f} s; "
          f"good request alongside ran {good.runs} times")
    assert not good.mismatches, good.mismatches[:5]
    assert good.runs >= 2 and seen.get("OK", 0) >= 20 and len(seen) >= 3, seen
    _all_serving_and_alive(secure_stack)
    wait_until(lambda: secure_stack.compute_info().stats.running == 0 and secure_stack.pool_idle() == idle, 30,
               "the pool to be back to idle")


def _mutations(valid: bytes):
    return st.one_of(
        st.binary(max_size=300),
        st.builds(lambda cut: valid[:cut], st.integers(0, len(valid))),
        st.builds(lambda i, b: valid[:i] + bytes([b]) + valid[i + 1:], st.integers(0, len(valid) - 1),
                  st.integers(0, 255)),
        st.builds(lambda i, junk: valid[:i] + junk + valid[i:], st.integers(0, len(valid)), st.binary(max_size=16)),
        st.sampled_from([
            b"\x0a\xff\xff\xff\xff\x0f",                  # prompt claims 4 GiB
            b"\x0a\x02\xff\xfe",                          # prompt is not UTF-8
            b"\x10" + b"\xff" * 10 + b"\x01",             # max_tokens: an 11-byte varint
            b"\x0b\x0c",                                  # a group (deprecated wire type)
            b"\x0a\x05hello\xfa\xff\xff\x7f\x01x",      # an unknown field number near the top
            b"\x0a\x05hello" * 1000,                      # the same field 1000 times (last wins)
            b"\x35\x00\x00\xc0\x7f",                      # top_p = NaN, as raw fixed32
        ]),
    )


def test_fuzz_raw_bytes(secure_stack, gateway_channel, alone):
    generate = gateway_channel.unary_stream("/kvpop.v1.KVpop/Generate", request_serializer=None,
                                            response_deserializer=generate_pb2.GenerateResponse.FromString)
    info = gateway_channel.unary_unary("/kvpop.v1.KVpop/GetModelInfo", request_serializer=None,
                                       response_deserializer=None)
    policies = list(generate_pb2.ModelInfo.FromString(info(b"", timeout=10)).policies)
    valid = request(prompt="raw bytes", max_tokens=4, policy="h2o", budget_tokens=64, stop=["zz"],
                    session_id="raw-1").SerializeToString()
    seen: dict[str, int] = {}

    @settings(max_examples=80, **SETTINGS)
    @given(data=_mutations(valid))
    def one(data):
        try:
            parsed = generate_pb2.GenerateRequest.FromString(data)
        except Exception:  # noqa: BLE001 - unparsable: the gateway must say so
            parsed = None
        outcome = run(generate(data, timeout=60))
        allowed = {IA} if parsed is None else expected(parsed, policies)
        check(outcome, allowed, data[:200])
        if parsed is None:
            assert "not a valid kvpop.v1.GenerateRequest" in outcome[1], outcome
        seen[outcome[0].name] = seen.get(outcome[0].name, 0) + 1

    t0 = time.monotonic()
    with GoodAlongside(secure_stack.stack.gateway, alone) as good:
        one()
        # GetModelInfo takes no fields: anything that parses is answered, the rest refused.
        for data in (b"\x08\x01", b"\xff", b"\x0a\x02\xff\xfe"):
            try:
                generate_pb2.ModelInfo.FromString(info(data, timeout=10))
                got = OK
            except grpc.RpcError as e:
                got = e.code()
            assert got in (OK, IA), got
    print(f"\nfuzz raw bytes: {sum(seen.values())} messages {seen} in {time.monotonic() - t0:.1f} s; "
          f"good request alongside ran {good.runs} times")
    assert not good.mismatches, good.mismatches[:5]
    assert seen.get("INVALID_ARGUMENT", 0) >= 5 and seen.get("OK", 0) >= 1, seen
    _all_serving_and_alive(secure_stack)
