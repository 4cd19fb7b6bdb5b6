"""Training examples from dense traces: features equal what the real engine
streams to the advisor, and targets equal a naive dense computation."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from helpers.engine import one_thread, random_prompt, run_all, tiny_engine, tiny_model  # noqa: F401
from kvpop.training.traces import TraceConfig, step_ends, submission_times, trace
from services.compute.engine.engine import EvictionParams, SamplingParams


class Recording:
    """An advisor that only records what compute sends."""

    def __init__(self):
        self.features = []

    def submit(self, features, gone=None):
        self.features.extend(features)

    def take_plans(self):
        return {}

    def release(self, request_id):
        pass


def _naive(model, ids):
    """Full probabilities [L, Hq, T, T] and post-RoPE K/V [L, T, Hkv, d], no chunking."""
    probs, ks, vs = [], [], []

    def attn(layer, q, k, v):
        T, Hq, d = q.shape
        G = Hq // k.shape[1]
        kk = k.float().repeat_interleave(G, 1)                              # [T, Hq, d]
        logits = torch.einsum("qhd,khd->hqk", q.float(), kk) / math.sqrt(d)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        p = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
        probs.append(p)
        ks.append(k.float()), vs.append(v.float())
        return torch.einsum("hqk,khd->qhd", p, v.float().repeat_interleave(G, 1)).to(q.dtype)

    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), attn)
    return torch.stack(probs), torch.stack(ks), torch.stack(vs), model.compute_logits(hidden)


@pytest.mark.parametrize("target", ["mean", "max"])
def test_targets_and_features_match_a_naive_dense_computation(target):
    model = tiny_model(seed=3)
    ids = random_prompt(45, seed=1)
    P, cfg = 30, TraceConfig(block_size=4, sink=4, recent=8, horizon=6, prefill_chunk=16, snapshots=50,
                             query_chunk=7, target=target)
    ex = trace(model, ids, P, cfg, random.Random(0))
    probs, ks, vs, logits = _naive(model, ids)
    with torch.no_grad():
        assert torch.allclose(logits, model.forward_dense(torch.tensor([ids]))[0], atol=1e-4)
    L, Hq, T, _ = probs.shape
    Hkv, G, bs = ks.shape[2], Hq // ks.shape[2], 4
    # Step ends: chunks of 16 over the prompt, then one token per step.
    assert step_ends(P, T, 16) == [16, 30] + list(range(31, 46))
    sub = {}
    for n in step_ends(P, T, 16):                   # compute's blocks_leaving, by hand
        for b in range(1, (n - 8) // bs):
            sub.setdefault(b, n)
    assert ex["block"].tolist() == sorted(sub)
    assert ex["age"].tolist() == [sub[b] - b * bs for b in sorted(sub)]
    for i, b in enumerate(sorted(sub)):
        cols = slice(b * bs, (b + 1) * bs)
        for l in range(L):
            for h in range(Hkv):
                acc = np.mean([float(probs[l, h * G + g, : sub[b], cols].sum()) for g in range(G)])
                assert abs(ex["attention"][i, l, h] - acc) < 1e-4
                assert np.allclose(ex["key_mean"][i, l, h], ks[l, cols, h].mean(0).numpy(), atol=1e-5)
                vn = torch.linalg.vector_norm(vs[l, cols, h], dim=-1).mean()
                assert abs(ex["value_norm"][i, l, h] - float(vn)) < 1e-5
    assert ex["times"].tolist()[:2] == [16, 30]      # prompt chunk ends always decide
    for t, k, tgt in zip(ex["times"], ex["known"], ex["targets"]):
        assert k == sum(1 for b in sub if sub[b] <= t) and tgt.shape == (L, Hkv, k)
        e = min(T, t + cfg.horizon)
        for j, b in enumerate(sorted(sub)[:k]):
            cols = slice(b * bs, (b + 1) * bs)
            for l in range(L):
                for h in range(Hkv):
                    per_query = probs[l, h * G:(h + 1) * G, t:e, cols].sum(-1)          # [G, e - t]
                    want = float((per_query.mean(1) if target == "mean" else per_query.amax(1)).max())
                    assert abs(tgt[l, h, j] - want) < 1e-5


def test_every_step_decides_at_each_decode_step_with_the_blocks_sent_so_far():
    """`--every-step`: at plan interval 8 a decode decision at every step, not
    one in 8; each knows only the blocks sent so far (features still arrive in
    batches), the features are those of the plain trace, and every target is
    the naive dense one from that step on."""
    model = tiny_model(seed=3)
    ids = random_prompt(45, seed=1)
    P = 30
    kw = dict(block_size=4, sink=4, recent=8, horizon=6, prefill_chunk=16, snapshots=50, query_chunk=7,
              plan_interval=8)
    plain = trace(model, ids, P, TraceConfig(**kw), random.Random(0))
    ex = trace(model, ids, P, TraceConfig(**kw, every_step=True), random.Random(0))
    for f in ("block", "position", "age", "attention", "key_mean", "value_norm"):
        assert np.array_equal(ex[f], plain[f])
    T = len(ids)
    assert ex["times"].tolist() == [16, 30] + list(range(P + 1, T))
    assert set(plain["times"].tolist()) < set(ex["times"].tolist())
    sent = ex["position"] + ex["age"]                 # the step at which each block was sent
    decode_known = []
    for t, k in zip(ex["times"], ex["known"]):
        assert k == int((sent <= t).sum())
        if t > P:
            decode_known.append(int(k))
    # Batches of the plan interval: the known set grows at a few steps only.
    assert len(set(decode_known)) < len(decode_known) / 2
    probs, _, _, _ = _naive(model, ids)
    L, Hq = probs.shape[:2]
    Hkv = ex["targets"][0].shape[1]
    G = Hq // Hkv
    for t, k, tgt in zip(ex["times"], ex["known"], ex["targets"]):
        e = min(T, t + 6)
        for j, b in enumerate(ex["block"][:k]):
            cols = slice(b * 4, (b + 1) * 4)
            for l in range(L):
                for h in range(Hkv):
                    want = float(probs[l, h * G:(h + 1) * G, t:e, cols].sum(-1).mean(1).max())
                    assert abs(tgt[l, h, j] - want) < 1e-5


def test_answer_weight_adds_the_continuations_mean_attention():
    """`--answer-weight W`: the mean target plus W x the mean over the queries
    that write the continuation only: from the prompt's last token, whose query
    writes the first answer token; from the prompt's end on both windows are the same."""
    model = tiny_model(seed=3)
    ids = random_prompt(45, seed=1)
    P, w = 30, 0.5
    cfg = TraceConfig(block_size=4, sink=4, recent=8, horizon=1024, prefill_chunk=16, snapshots=50, query_chunk=7,
                      answer_weight=w)
    probs, _, _, _ = _naive(model, ids)
    L, Hq, T = probs.shape[:3]
    # answer_len 2: only the queries that write the answer's content count (at P - 1
    # and P), not those that write its end markers.
    for answer_len, answer_end in ((None, T), (2, P + 1)):
        ex = trace(model, ids, P, cfg, random.Random(0), answer_len)
        Hkv = ex["targets"][0].shape[1]
        G = Hq // Hkv
        assert ex["times"].tolist()[0] == 16 < P
        for t, k, tgt in zip(ex["times"], ex["known"], ex["targets"]):
            a0 = max(t, P - 1)
            for j, b in enumerate(ex["block"][:k]):
                cols = slice(b * 4, (b + 1) * 4)
                for l in range(L):
                    for h in range(Hkv):
                        heads = slice(h * G, (h + 1) * G)
                        fut = probs[l, heads, t:T, cols].sum(-1).mean(1)
                        if a0 < answer_end:
                            fut = fut + w * probs[l, heads, a0:answer_end, cols].sum(-1).mean(1)
                        assert abs(tgt[l, h, j] - float(fut.max())) < 1e-5


@pytest.mark.parametrize("interval", [1, 12])
def test_trace_features_are_what_the_engine_streams(interval):
    model = tiny_model(seed=5)
    rec = Recording()
    # It never plans: pipelined, the sequence does not wait for plans (nothing is evicted anyway).
    # round_slack 0: every batch goes as it is taken (with a slack, batches wait for a round).
    eng = tiny_engine(model, advisor=rec, block_size=4, prefill_chunk=16, pipeline_decode_plans=True,
                      plan_interval=interval, round_slack=0)
    prompt = random_prompt(37, seed=2)
    # budget = the whole request: nothing is evicted, so compute's statistics are the dense ones.
    eng.add_request("r", prompt, SamplingParams(max_tokens=20, ignore_eos=True),
                    EvictionParams("learned", budget=1.0, sink=4, recent=8))
    out = run_all(eng)["r"]
    ids = prompt + [o.token_id for o in out][:-1]   # the last sampled token is never fed
    ex = trace(model, ids, len(prompt), TraceConfig(block_size=4, sink=4, recent=8, prefill_chunk=16,
                                                    plan_interval=interval), random.Random(0))
    got = {f.block: f for f in rec.features}
    assert len(got) == len(rec.features)               # each block sent once
    # The engine skips the step that finishes the request; the trace's decisions stop before it too.
    sent_before_end = [int(b) for b, a in zip(ex["block"], ex["age"]) if b * 4 + a < len(ids)]
    assert sorted(got) == sent_before_end and len(got) >= 8
    for i, b in enumerate(ex["block"][: len(got)]):
        f = got[int(b)]
        assert f.position == ex["position"][i] and f.age == ex["age"][i]
        assert torch.allclose(f.attention, torch.from_numpy(ex["attention"][i]), atol=1e-4)
        assert torch.allclose(f.key_mean, torch.from_numpy(ex["key_mean"][i]), atol=1e-5)
        assert torch.allclose(f.value_norm, torch.from_numpy(ex["value_norm"][i]), atol=1e-5)
        assert torch.allclose(f.reach, torch.from_numpy(ex["reach"][i]), atol=1e-5)
    # Reach is a real signal here, not zeros on both sides: blocks past the recent window exist.
    assert float(np.abs(ex["reach"]).max()) > 0.01


def test_submission_times_follow_the_window():
    cfg = TraceConfig(block_size=16, sink=4, recent=32, prefill_chunk=512)
    ends = step_ends(600, 700, 512)
    t = submission_times(ends, 700 // 16, cfg)
    assert t[0] == -1                                 # the sink block is never sent
    assert (t[1:(512 - 32) // 16] == 512).all()       # the first chunk's blocks, at its end
    b = 40                                            # a decode-time block: sent when it leaves the window
    assert t[b] == (b + 1) * 16 + 32


def test_prompt_file_traces_read_prompts_chats_and_completions(tmp_path):
    """`kvpop train-estimator --prompts FILE.jsonl`: a prompt line traces the
    prompt (+ completion), a chat line is rendered with the model's template,
    and a bad line names its line number."""
    import json

    from helpers.engine import default_tokenizer
    from kvpop.training.traces import prompt_file_traces

    tok = default_tokenizer()
    model = tiny_model(seed=4)
    cfg = [TraceConfig(block_size=1, sink=2, recent=4, horizon=64, prefill_chunk=32)]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "the quick brown fox jumps over the lazy dog " * 3, "completion": "and runs away"},
        {"prompt": "a b c d e f g h i j k l m n o p q r s t u v w x y z"},
    ]) + "\n\n")
    data = prompt_file_traces(model, tok, f, cfg, progress=False)
    assert len(data) == 2
    first = tok.encode("the quick brown fox jumps over the lazy dog " * 3)
    assert data[0]["length"] == len(first) + len(tok.encode("and runs away", add_bos=False))
    assert data[1]["length"] == len(tok.encode("a b c d e f g h i j k l m n o p q r s t u v w x y z"))
    for ex in data:
        assert all(t.shape[:2] == (2, 2) for t in ex["targets"])     # [layers, kv-heads, known blocks]
    f.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="p.jsonl:2: needs 'prompt' or 'messages'"):
        prompt_file_traces(model, tok, f, cfg, progress=False)


def test_reach_is_measured_only_while_the_advisor_reads_it():
    """An advisor whose networks do not read reach (SmolLM2's) spares compute the
    pass; the other features and the tokens are what they were."""
    model = tiny_model(seed=5)
    prompt = random_prompt(37, seed=2)
    sent = {}
    for reads in (True, False):
        rec = Recording()
        rec.reads_reach = reads
        eng = tiny_engine(model, advisor=rec, block_size=4, prefill_chunk=16, pipeline_decode_plans=True,
                          plan_interval=1, round_slack=0)
        eng.add_request("r", prompt, SamplingParams(max_tokens=20, ignore_eos=True),
                        EvictionParams("learned", budget=1.0, sink=4, recent=8))
        tokens = [o.token_id for o in run_all(eng)["r"]]
        sent[reads] = (tokens, {f.block: f for f in rec.features})
    (tok_on, on), (tok_off, off) = sent[True], sent[False]
    assert tok_on == tok_off and sorted(on) == sorted(off)
    assert max(float(f.reach.abs().max()) for f in on.values()) > 0.01
    assert all(float(f.reach.abs().max()) == 0.0 for f in off.values())
    for b in on:
        assert torch.equal(on[b].attention, off[b].attention) and torch.equal(on[b].key_mean, off[b].key_mean)
