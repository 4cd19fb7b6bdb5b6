"""The estimator in service: a real cache-manager process loads a checkpoint,
answers with the network's plans, reloads on SIGHUP, keeps its policy on a
broken file and falls back to the heuristic without one; the in-process
LocalAdvisor gives the same plans and keeps the advisor protocol."""
from __future__ import annotations

import contextlib
import math

import os
import queue
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers.common import REPO, free_port
from helpers.engine import one_thread, random_prompt, tiny_engine, tiny_model  # noqa: F401
from kvpop.runtime.arrays import from_int_array, to_float_array
from kvpop.runtime.pb import cache_manager_pb2 as pb
from kvpop.runtime.pb import cache_manager_pb2_grpc as pb_grpc
from services.cache_manager.estimator import EstimatorConfig, ValueEstimator, save
from services.cache_manager.heuristic import AttentionPerAge, plan
from kvpop.evaluation.local_advisor import LocalAdvisor
from services.cache_manager.planner import Planner
from services.cache_manager.scoring_state import BlockRecord, ScoringState
from services.compute.engine.engine import EvictionParams, SamplingParams
from services.compute.eviction.advisor import BlockFeatures

L, H, D = 2, 2, 16


def _net(seed: int) -> ValueEstimator:
    torch.manual_seed(seed)
    return ValueEstimator(EstimatorConfig(L, H, D, d_model=16)).eval()


def _records(n: int, seed: int) -> list[BlockRecord]:
    rng = np.random.default_rng(seed)
    return [BlockRecord(b, b * 4, int(rng.integers(8, 90)), rng.normal(size=(L, H, D)).astype(np.float32),
                        rng.random((L, H)).astype(np.float32) + 0.5, rng.random((L, H)).astype(np.float32))
            for b in range(1, n + 1)]


def _msg(rid: str, records: list[BlockRecord]) -> pb.AdvisorMessage:
    return pb.AdvisorMessage(features=pb.FeaturesBatch(request_id=rid, blocks=[
        pb.BlockFeatures(block=r.block, position=r.position, age=r.age, key_mean=to_float_array(r.key_mean),
                         value_norm=to_float_array(r.value_norm), attention=to_float_array(r.attention))
        for r in records]))


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class CacheManager:
    """A real `python -m services.cache_manager` with one open Advise stream."""

    def __init__(self, tmp_path, estimator: str):
        self.port = free_port()
        self.log = tmp_path / f"cm-{self.port}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOP_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cache_manager", "--port", str(self.port), "--metrics-port", "-1",
             "--estimator", estimator], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
            stderr=open(self.log, "wb"), start_new_session=True)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        health = health_pb2_grpc.HealthStub(self.channel)

        def serving():
            assert self.proc.poll() is None, self.log.read_text()
            try:
                return health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                    health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False
        _wait(serving, 60, "the cache-manager to serve")
        self.outbox: queue.Queue = queue.Queue()
        self.replies = pb_grpc.CacheManagerStub(self.channel).Advise(iter(self.outbox.get, None))
        self.inputs = next(self.replies).inputs      # every stream opens with what the networks read

    def plan(self, rid: str, records) -> np.ndarray:
        self.outbox.put(_msg(rid, records))
        reply = next(self.replies)
        assert reply.plan.request_id == rid
        self.last = reply.plan
        return from_int_array(reply.plan.evict)

    def log_count(self, text: str) -> int:
        return self.log.read_text().count(text)

    def close(self):
        self.outbox.put(None)
        self.channel.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)


@pytest.fixture
def manager(tmp_path):
    made = []

    def start(estimator: str) -> CacheManager:
        made.append(CacheManager(tmp_path, estimator))
        return made[-1]
    yield start
    for m in made:
        m.close()


def test_service_loads_scores_and_reloads_on_sighup(tmp_path, manager):
    ckpt = tmp_path / "estimator.safetensors"
    save(_net(1), ckpt)
    cm = manager(str(ckpt))
    assert cm.log_count("estimator loaded from") == 1
    recs = _records(30, seed=0)
    got = cm.plan("a", recs)
    assert got.shape == (L, H, 30)
    assert np.array_equal(got, Planner(model=_net(1)).apply("a", recs).evict)
    assert cm.last.ranker == "network" and cm.last.covers == max(r.block for r in recs) + 1
    # Another network at the same path, reloaded without a restart.
    save(_net(2), ckpt)
    os.killpg(cm.proc.pid, signal.SIGHUP)
    _wait(lambda: cm.log_count("estimator loaded from") == 2, 20, "the reload")
    recs_b = _records(30, seed=1)
    got_b = cm.plan("b", recs_b)
    assert np.array_equal(got_b, Planner(model=_net(2)).apply("b", recs_b).evict)
    assert not np.array_equal(got_b, Planner(model=_net(1)).apply("b", recs_b).evict)
    # A broken file keeps the loaded network, and says so.
    ckpt.write_bytes(b"garbage")
    os.killpg(cm.proc.pid, signal.SIGHUP)
    _wait(lambda: cm.log_count("estimator not loaded") == 1, 20, "the failed reload's log line")
    recs_c = _records(12, seed=2)
    assert np.array_equal(cm.plan("c", recs_c), Planner(model=_net(2)).apply("c", recs_c).evict)
    assert cm.proc.poll() is None


def test_service_without_checkpoint_uses_the_heuristic(tmp_path, manager):
    cm = manager(str(tmp_path / "missing.safetensors"))
    assert cm.log_count("estimator not loaded") == 1 and "heuristic" in cm.log.read_text()
    recs = _records(20, seed=3)
    seq = ScoringState().get("x")
    for r in recs:
        seq.add(r)
    assert np.array_equal(cm.plan("x", recs), plan(seq, AttentionPerAge().score(seq), 1024))


# ------------------------------------------------------------ local advisor
def _features(rid: str, records) -> list[BlockFeatures]:
    return [BlockFeatures(rid, r.block, r.position, torch.from_numpy(r.key_mean), torch.from_numpy(r.value_norm),
                          torch.from_numpy(r.attention), r.age) for r in records]


def test_local_advisor_protocol():
    adv = LocalAdvisor(model=_net(1))
    recs = _records(16, seed=4)
    adv.submit(_features("r", recs[:10]))
    plans = adv.take_plans()
    assert set(plans) == {"r"} and adv.take_plans() == {}          # each plan handed over once
    evict = plans["r"].evict
    assert evict.dtype == torch.int32 and evict.shape == (L, H, 10)
    assert all(sorted(evict[l, h].tolist()) == list(range(1, 11)) for l in range(L) for h in range(H))
    adv.submit(_features("r", recs[10:]))
    assert adv.take_plans()["r"].evict.shape == (L, H, 16)         # every known block, re-ranked
    # Same code path as the service: the plan equals the Planner's.
    other = LocalAdvisor(model=_net(1))
    other.submit(_features("q", recs))
    assert np.array_equal(other.take_plans()["q"].evict.numpy(), Planner(model=_net(1)).apply("q", recs).evict)
    adv.release("r")
    assert "r" not in adv.planner.state.sequences
    adv.submit(_features("r", recs[:3]))
    assert adv.take_plans()["r"].evict.shape == (L, H, 3)          # a released sequence starts afresh


def _run_learned(advisor, prompt, budget=32, **config):
    config.setdefault("block_size", 4)
    eng = tiny_engine(tiny_model(seed=7), advisor=advisor, **config)
    eng.add_request("r", prompt, SamplingParams(max_tokens=40, ignore_eos=True),
                    EvictionParams("learned", budget=budget, sink=4, recent=8))
    tokens, peak, usage = [], 0, None
    while eng.has_unfinished():
        for o in eng.step():
            tokens.append(o.token_id)
            usage = o.usage or usage
        if "r" in eng.seqs:
            peak = max(peak, eng.seqs["r"].num_blocks)
    return tokens, peak, usage


def test_engine_with_local_advisor_follows_plans_deterministically():
    prompt = random_prompt(90, seed=3)
    adv = LocalAdvisor(model=_net(1))
    tokens, peak, usage = _run_learned(adv, prompt)
    assert usage.policy == "learned" and usage.kv_blocks_evicted > 0
    assert usage.network_evictions == usage.kv_blocks_evicted      # every eviction came from a plan
    # Held for its plan, the prompt's one chunk stays until the next step boundary.
    assert peak <= math.ceil(90 / 4) and adv.plans_sent > 0
    assert "r" not in adv.planner.state.sequences                  # released at finish
    again, _, _ = _run_learned(LocalAdvisor(model=_net(1)), prompt)
    assert again == tokens


class _Counting(LocalAdvisor):
    """Records the size of every features batch it plans."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.batches = []

    def submit(self, features, gone=None):
        self.batches.append(len(features))
        super().submit(features, gone)


@pytest.mark.parametrize("interval, budget", [(1, 24), (6, 24), (6, 15)])
def test_decode_plans_come_once_per_plan_interval(interval, budget):
    """Block size 1: after the prompt, features go in batches of `plan_interval`
    blocks and each is planned once; between plans every round evicts on the
    plan in hand (all evictions are the network's, none unranked) and the
    budget holds. A budget too small for the interval (15 tokens: sink 4 and
    recent 8 leave 3 blocks a plan can name) sends sooner, never unranked."""
    prompt = random_prompt(60, seed=5)
    adv = _Counting(model=_net(1))
    # round_slack 0: a round at every step, so each batch is planned as it goes (with a
    # slack, batches wait for the round: test_paged_compaction's page rounds).
    tokens, peak, usage = _run_learned(adv, prompt, budget=budget, block_size=1, plan_interval=interval,
                                       round_slack=0)
    assert len(tokens) == 40 and usage.kv_blocks_evicted > 0
    assert usage.network_evictions == usage.kv_blocks_evicted
    assert peak <= 60                                  # the prompt (one chunk), then the budget
    decode = adv.batches[1:]                           # the first batch is the prompt's chunk
    # The prompt sends 60 - 8 (recent) - 4 (sink) blocks; the 38 decode steps before the
    # last (the request ends there) push 38 more out of the window.
    if budget > 20:
        assert decode and all(n == interval for n in decode), adv.batches
        assert sum(adv.batches) == 60 - 8 - 4 + 38 // interval * interval
    else:
        assert decode and all(n <= interval for n in decode) and min(decode) < interval, adv.batches
        assert sum(adv.batches) <= 60 - 8 - 4 + 38


def test_a_batch_in_parts_is_planned_once_after_its_last_part(tmp_path, manager):
    """Parts marked `more` are folded without a plan; the last part's plan ranks
    the whole batch, and another sequence's message after it is answered next."""
    ckpt = tmp_path / "estimator.safetensors"
    save(_net(1), ckpt)
    cm = manager(str(ckpt))
    recs = _records(30, seed=4)
    for i, part in enumerate((recs[:10], recs[10:20], recs[20:])):
        msg = _msg("a", part)
        msg.features.more = i < 2
        cm.outbox.put(msg)
    cm.outbox.put(_msg("b", _records(5, seed=5)))
    first, second = next(cm.replies), next(cm.replies)
    assert first.plan.request_id == "a" and first.plan.covers == 31, first.plan
    assert np.array_equal(from_int_array(first.plan.evict), Planner(model=_net(1)).apply("a", recs).evict)
    assert second.plan.request_id == "b"


@contextlib.contextmanager
def _connected_client(port: int):
    """compute's AdvisorClient on a loop of its own, its stream up."""
    import asyncio
    import threading

    from services.compute.eviction.advisor_client import AdvisorClient

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    client = AdvisorClient(f"127.0.0.1:{port}", loop)
    loop.call_soon_threadsafe(client.start)
    try:
        _wait(lambda: client.connected, 30, "the advisor stream")
        yield client
    finally:
        asyncio.run_coroutine_threadsafe(client.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def test_advisor_client_splits_a_batch_larger_than_the_message_limit(tmp_path, manager):
    """A 512-token chunk of 1-token blocks on a 30-layer, 3-kv-head, d=64 model is
    ~12 MB of features: the client sends it in parts under the cache-manager's
    default 4 MB limit, and a plan comes back on the same stream (before, the
    stream broke with RESOURCE_EXHAUSTED and every plan fell back)."""
    cm = manager("none")
    with _connected_client(cm.port) as client:
        rng = np.random.default_rng(0)
        feats = [BlockFeatures("big", b, b, torch.from_numpy(rng.normal(size=(30, 3, 64)).astype(np.float32)),
                               torch.ones(30, 3), torch.from_numpy(rng.random((30, 3)).astype(np.float32)), 600 - b)
                 for b in range(4, 516)]
        client.submit(feats)
        plans = {}
        _wait(lambda: plans.update(client.take_plans()) or "big" in plans, 60, "the plan")
        assert plans["big"].covers == 516 and plans["big"].evict.shape[:2] == (30, 3)
        # Then 512 more blocks with a long list of what the rows evicted (2.9 MB by itself).
        gone = torch.full((30, 3, 8000), -1, dtype=torch.int32)
        gone[:, :, :400] = torch.arange(4, 404, dtype=torch.int32)
        more = [BlockFeatures("big", b, b, torch.from_numpy(rng.normal(size=(30, 3, 64)).astype(np.float32)),
                              torch.ones(30, 3), torch.ones(30, 3), 1100 - b) for b in range(516, 1028)]
        client.submit(more, gone)
        plans = {}
        _wait(lambda: plans.update(client.take_plans()) or "big" in plans, 60, "the second plan")
        assert plans["big"].covers == 1028
        # The evicted-block list arrived: those blocks are ranked after every block the rows hold.
        named = plans["big"].evict[0, 0].tolist()
        assert not set(named[:600]) & set(range(4, 404)) and set(named[-400:]) == set(range(4, 404))
        assert client.stats["reconnects"] == 0 and client.connected
        assert "RESOURCE_EXHAUSTED" not in cm.log.read_text()


def test_compute_says_each_prompt_length_and_the_service_routes_by_it(tmp_path, manager):
    """The engine stamps every block's features with its sequence's prompt
    length; AdvisorClient carries it in the batch; a cache-manager serving a
    folder of two networks ranks each sequence with the one trained for that
    length and names it in the plan."""
    torch.manual_seed(1)
    save(ValueEstimator(EstimatorConfig(L, H, D, d_model=16, max_context=100)), tmp_path / "estimator.safetensors")
    torch.manual_seed(2)
    save(ValueEstimator(EstimatorConfig(L, H, D, d_model=16, max_context=1000)),
         tmp_path / "estimator-long.safetensors")
    # In process, the engine's features carry the prompt's length.
    seen = []

    class Recording(LocalAdvisor):
        def submit(self, features, gone=None):
            seen.extend(f.prompt_tokens for f in features)
            super().submit(features, gone)
    _run_learned(Recording(tmp_path), random_prompt(90, seed=3))
    assert seen and set(seen) == {90}

    cm = manager(str(tmp_path))
    assert cm.log_count("estimator loaded from") == 2
    with _connected_client(cm.port) as client:
        recs = _records(20, seed=6)
        for rid, prompt_tokens, want in (("short", 90, "estimator.safetensors"),
                                         ("long", 900, "estimator-long.safetensors")):
            client.submit([BlockFeatures(rid, r.block, r.position, torch.from_numpy(r.key_mean),
                                         torch.from_numpy(r.value_norm), torch.from_numpy(r.attention), r.age,
                                         prompt_tokens) for r in recs])
            plans = {}
            _wait(lambda: plans.update(client.take_plans()) or rid in plans, 30, "the plan")
            local = Planner(tmp_path).apply(rid, recs, prompt_tokens)
            assert plans[rid].estimator == want == local.estimator
            assert np.array_equal(plans[rid].evict.numpy(), local.evict)


def test_the_stream_opens_with_what_the_networks_read(tmp_path, manager):
    """Compute measures reach only for a network that reads it: the cache-manager
    says which on every stream (a network without reach, one with, the heuristic)."""
    plain, reach = tmp_path / "plain.safetensors", tmp_path / "reach.safetensors"
    save(_net(1), plain)
    torch.manual_seed(1)
    save(ValueEstimator(EstimatorConfig(L, H, D, d_model=16, reach=True)).eval(), reach)
    assert list(manager(str(plain)).inputs.reads) == []
    cm = manager(str(reach))
    assert list(cm.inputs.reads) == ["reach"]
    assert cm.plan("a", _records(6, seed=1)).shape[:2] == (L, H)     # plans follow as before
    assert list(manager("none").inputs.reads) == []
    # A reload that changes what the networks read is told on the open stream, after the round's plans.
    save(_net(1), reach)
    os.killpg(cm.proc.pid, signal.SIGHUP)
    _wait(lambda: cm.log_count("estimator loaded from") == 2, 20, "the reload")
    cm.outbox.put(_msg("b", _records(6, seed=2)))
    plan, told = next(cm.replies), next(cm.replies)
    assert plan.plan.request_id == "b" and not told.HasField("plan") and list(told.inputs.reads) == []
