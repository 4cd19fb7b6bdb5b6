"""On a GPU every tensor operation the engine dispatches is a kernel launch,
and a decode step for a hundred small sequences was bound by host work
(docs/benchmarks.md, "On a GPU"). Between block ends no operation of a step may be
per sequence: counted here as dispatched operations (views excluded, which
launch nothing; `kvpop bench step` counts the same way), on the CPU, where
the count is the same as on a GPU."""
from __future__ import annotations

import pytest

from helpers.engine import ScriptedAdvisor, random_prompt, tiny_engine
from helpers.engine import one_thread  # noqa: F401  (autouse: single-threaded tiny tensors)
from kvpop.bench.step import DispatchCounter
from services.compute.engine.engine import EvictionParams, SamplingParams


def launches_per_step(policy: str, n: int, steps: int = 34) -> list:
    """Launch counts of ``steps`` decode steps once every sequence decodes,
    each with the context length of the sequences at that step (all prompts
    have the same length, so they cross block ends together, give or take
    the chunked prefill's stagger)."""
    eng = tiny_engine(block_size=16, num_pages=20000, max_num_seqs=64,
                      advisor=ScriptedAdvisor() if policy == "learned" else None)
    for i in range(n):
        eng.add_request(f"r{i}", random_prompt(100, i), SamplingParams(max_tokens=80, ignore_eos=True),
                        EvictionParams(policy=policy, budget=None if policy == "dense" else 48, sink=4, recent=8))
    while any(s.num_cached < s.num_prompt for s in eng.seqs.values()):
        eng.step()
    out = []
    for _ in range(steps):
        lengths = {s.num_cached for s in eng.seqs.values()}
        counter = DispatchCounter()
        with counter:
            eng.step()
        out.append((lengths, counter.launches))
    return out


def event_phases(policy: str) -> set[int]:
    """Positions within a block (context length mod 16 before the step) at
    which one sequence's step does more than the quiet minimum: a block opens
    or fills, a round runs, features are sent or a plan is applied."""
    runs = launches_per_step(policy, 1, 40)
    least = min(sum(ops.values()) for _, ops in runs)
    return {n % 16 for lengths, ops in runs if sum(ops.values()) != least for n in lengths}


@pytest.mark.parametrize("policy", ["dense", "h2o", "learned"])
def test_a_decode_step_between_block_ends_launches_the_same_for_3_or_12_sequences(policy):
    events = event_phases(policy)
    assert 0 in events, "opening a block should show"   # the measurement sees what it should
    quiet = lambda runs: [ops for lengths, ops in runs if not {n % 16 for n in lengths} & events]
    few, many = quiet(launches_per_step(policy, 3)), quiet(launches_per_step(policy, 12))
    assert few and many, "no step between block ends was measured"
    # Every quiet step of either batch dispatches exactly the same operations.
    first = few[0]
    for ops in few + many:
        assert ops == first, f"{policy}: per-sequence operations {dict((ops - first) + (first - ops))}"
