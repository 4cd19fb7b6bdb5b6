"""Property test for shared pages: random requests, some starting with a
prewarmed system prompt (prefix cache), some continuing sessions, random
policies, budgets and cancellations, in a tight pool. Between every two steps
each page's reference count equals the number of holders (running sequences,
cached blocks, parked sessions), the pool's used count equals the distinct
pages held, every sequence's own pages are within its reservation, and
reservations plus held pages never exceed the pool; no step
runs out of pages; at the end, with sessions and cache dropped, every page is
back with no reference left."""
from __future__ import annotations

from collections import Counter

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.engine import random_prompt, tiny_engine, tiny_model
from helpers.engine import one_thread  # noqa: F401  (autouse: single-threaded tiny tensors)
from services.compute.engine.engine import EvictionParams, SamplingParams

MODEL = tiny_model(seed=4)
WINDOWED = tiny_model(seed=4, sliding_window=8)   # Mistral: dense rows shrink to the window
SYSTEM = random_prompt(24, seed=77)


@st.composite
def request(draw):
    return dict(system=draw(st.booleans()),
                prompt=random_prompt(draw(st.integers(1, 40)), seed=draw(st.integers(0, 1000))),
                max_tokens=draw(st.integers(1, 12)),
                policy=draw(st.sampled_from(["dense", "h2o", "snapkv", "streaming"])),
                budget=draw(st.integers(24, 48)),
                session=draw(st.sampled_from([None, "a", "b", "c"])),
                cancel_step=draw(st.one_of(st.none(), st.integers(1, 12))))


def holders(engine):
    """Every (holder, pages) pair: running/waiting sequences, cached blocks, parked sessions."""
    out = [s.page_table.reshape(-1) for s in engine.seqs.values()]
    out += [b.pages.reshape(-1) for b in engine.prefix_cache.blocks.values()]
    out += [s.page_table.reshape(-1) for s in engine.sessions.parked.values()]
    return [p for p in out if p.numel()]


def check(engine):
    held = holders(engine)
    pages = torch.cat(held).long() if held else torch.empty(0, dtype=torch.long)
    counts = Counter(pages.tolist())
    refs = engine.pool.refs
    assert all(int(refs[p]) == c for p, c in counts.items()), "refcount = number of holders"
    assert int(refs.sum()) == pages.numel(), "no reference without a holder"
    assert engine.pool.num_used == len(counts), "used pages = distinct pages held"
    sched = engine.scheduler
    assert sched.reserved() + sched.held() <= engine.pool.capacity
    for s in sched.running:   # a sequence's own pages (shared ones are the cache's) within its reservation
        assert s.page_table.numel() - s.shared_prefix_blocks * sched.rows <= sched.reservation(s)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request(), min_size=1, max_size=8), num_pages=st.integers(120, 400),
       bs=st.sampled_from([2, 4]), chunk=st.sampled_from([4, 16, 64]), windowed=st.booleans())
def test_shared_pages_are_counted_exactly(reqs, num_pages, bs, chunk, windowed):
    engine = tiny_engine(WINDOWED if windowed else MODEL, block_size=bs, prefill_chunk=chunk, num_pages=num_pages, max_num_seqs=4,
                         prefix_cache_fraction=0.3)
    engine.prewarm(SYSTEM)
    check(engine)
    ids = []
    for i, r in enumerate(reqs):
        prompt = (SYSTEM if r["system"] else []) + r["prompt"]
        ev = None if r["policy"] == "dense" else EvictionParams(r["policy"], budget=r["budget"], sink=2, recent=4)
        try:
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True),
                               ev, session_id=r["session"])
            ids.append((str(i), r["cancel_step"]))
        except ValueError as e:   # too big for the pool or the model, with a session's context
            assert "KV pages" in str(e) or "max length" in str(e)
        check(engine)
    for step in range(1000):
        if not engine.has_unfinished():
            break
        for rid, cancel in ids:
            if cancel == step:
                engine.abort(rid)
        engine.step()                       # OutOfPages would raise here
        check(engine)
    assert not engine.has_unfinished()
    for sid in list(engine.sessions.parked):
        assert engine.drop_session(sid)
    engine.prefix_cache.clear()
    assert engine.pool.num_free == engine.pool.capacity and int(engine.pool.refs.abs().sum()) == 0
