"""A turn tokenized as a continuation (`resume_session`) never starts fresh:
when its parked session expired between the check and admission, admission
raises SessionNotParked (compute answers FAILED_PRECONDITION and the gateway
re-prefills from the history)."""
from __future__ import annotations

import asyncio

import pytest

from helpers.engine import random_prompt, run_all, tiny_engine, tiny_model
from helpers.engine import one_thread  # noqa: F401  (autouse: single-threaded tiny tensors)
from services.compute.engine.async_engine import AsyncEngine
from services.compute.engine.engine import SamplingParams
from services.compute.engine.session_cache import SessionNotParked

TTL_S = 60.0


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=7)


def _parked_then_expired(engine) -> list[float]:
    """Park session "s", check it like compute does, then let its TTL pass."""
    now = [0.0]
    engine.sessions.clock = lambda: now[0]
    engine.add_request("t1", random_prompt(9, seed=1), SamplingParams(max_tokens=3, ignore_eos=True),
                       session_id="s")
    run_all(engine)
    assert engine.session_tokens("s") == 12          # the check passes ...
    now[0] += TTL_S + 1                               # ... and the session expires before admission
    assert engine.sessions.expire() == 1
    return now


def test_resume_of_an_expired_session_raises_and_frees_nothing_twice(model):
    engine = tiny_engine(model, session_ttl_s=TTL_S, prefix_cache_fraction=0)
    _parked_then_expired(engine)
    resume = SamplingParams(max_tokens=3, ignore_eos=True, resume_session=True)
    with pytest.raises(SessionNotParked, match="session 's' is no longer parked"):
        engine.add_request("t2", random_prompt(4, seed=2), resume, session_id="s")
    assert not engine.has_unfinished() and engine.pool.num_used == 0
    # Without the flag the same request starts the session afresh (the first-turn path).
    engine.add_request("t3", random_prompt(4, seed=2), SamplingParams(max_tokens=3, ignore_eos=True),
                       session_id="s")
    assert run_all(engine)["t3"][-1].usage.session_tokens == 0


def test_resume_continues_a_parked_session(model):
    engine = tiny_engine(model, session_ttl_s=TTL_S, prefix_cache_fraction=0)
    engine.add_request("t1", random_prompt(9, seed=1), SamplingParams(max_tokens=3, ignore_eos=True),
                       session_id="s")
    run_all(engine)
    engine.add_request("t2", random_prompt(4, seed=2),
                       SamplingParams(max_tokens=3, ignore_eos=True, resume_session=True), session_id="s")
    assert run_all(engine)["t2"][-1].usage.session_tokens == 12


def test_async_engine_delivers_session_not_parked_to_its_request(model):
    engine = tiny_engine(model, session_ttl_s=TTL_S, prefix_cache_fraction=0)
    _parked_then_expired(engine)
    aengine = AsyncEngine(engine)

    async def turn():
        sp = SamplingParams(max_tokens=3, ignore_eos=True, resume_session=True)
        return [o async for o in aengine.generate("t2", random_prompt(4, seed=2), sp, session_id="s")]

    try:
        with pytest.raises(SessionNotParked):
            asyncio.run(turn())
    finally:
        aengine.shutdown()
