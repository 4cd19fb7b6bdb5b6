"""Property test: random prompt lengths, budgets, block sizes, policies,
joins and cancellations. Between every two steps:
- no (layer, kv-head) row holds more than its budget (+ slack for learned;
  the whole prompt until its round for a request that asks for the budget
  after its prompt);
- sink blocks and blocks overlapping the recent window are all resident;
- rows are strictly increasing block numbers, no page is held twice, and the
  pool's used count equals the pages held by live sequences;
and at the end every page is back in the pool. A second property runs the
same scenarios in a tight pool: admission by reservation never lets a step
run out of pages (queueing and cleanup shrinks happen there)."""
from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.engine import ScriptedAdvisor, check_invariants, random_prompt, tiny_engine, tiny_model
from helpers.engine import one_thread  # noqa: F401  (autouse: single-threaded tiny tensors)
from services.compute.engine.engine import EvictionParams, SamplingParams
from services.compute.eviction.budget import min_budget_blocks
from services.compute.eviction.policies import POLICY_NAMES

MODEL = tiny_model(seed=2)


@st.composite
def request(draw, block_size):
    sink = draw(st.integers(0, 6))
    recent = draw(st.integers(0, 8))
    minimum = min_budget_blocks(math.ceil(sink / block_size), recent, block_size)
    # Budgets near the minimum and prompts up to ~10x longer, so rounds happen
    # during prefill (between chunks) and during decode.
    return dict(
        prompt=random_prompt(draw(st.integers(1, 100)), seed=draw(st.integers(0, 1000))),
        max_tokens=draw(st.integers(1, 24)),
        policy=draw(st.sampled_from(POLICY_NAMES)),
        budget=minimum * block_size + draw(st.integers(0, 2 * block_size)),
        sink=sink, recent=recent,
        join_step=draw(st.integers(0, 6)),
        cancel_step=draw(st.one_of(st.none(), st.integers(1, 20))),
        after_prompt=draw(st.booleans()),
        prefill_allowance=draw(st.sampled_from([1.0, 1.5, 3.0])),
    )


@st.composite
def scenario(draw):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    return dict(block_size=bs, prefill_chunk=draw(st.sampled_from([3, 8, 16, 64])),
                advisor=draw(st.sampled_from(["prompt", "late", "silent", "none"])),
                requests=draw(st.lists(request(bs), min_size=1, max_size=6)))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_budget_protection_and_pages_return(sc):
    advisor = {"prompt": ScriptedAdvisor(), "late": ScriptedAdvisor(delay=2),
               "silent": ScriptedAdvisor(silent=True), "none": None}[sc["advisor"]]
    # A silent advisor is waited out at the next step boundary (the wait is wall-clock, the test is not).
    engine = tiny_engine(MODEL, advisor=advisor, block_size=sc["block_size"], plan_wait_s=0.0,
                         prefill_chunk=sc["prefill_chunk"], num_pages=3000, max_num_seqs=4)
    reqs = sc["requests"]
    finished = set()
    for step in range(400):
        for i, r in enumerate(reqs):
            if r["join_step"] == step:
                engine.add_request(str(i), r["prompt"],
                                   SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True),
                                   EvictionParams(r["policy"], budget=r["budget"], sink=r["sink"],
                                                  recent=r["recent"], after_prompt=r["after_prompt"],
                                                  prefill_allowance=1.0 if r["after_prompt"] else r["prefill_allowance"]))
            if r["cancel_step"] == step:
                engine.abort(str(i))
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        check_invariants(engine)
        if step > 6 and not engine.has_unfinished():
            break
    assert finished == {str(i) for i in range(len(reqs))}
    assert engine.pool.num_free == engine.pool.capacity


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario(), st.integers(40, 200), st.sampled_from([0.3, 0.7, 1.0]))
def test_tight_pool_never_runs_out_of_pages(sc, num_pages, threshold):
    """Admission by reservation is exact enough that a small pool never runs
    dry mid-step, whatever joins, budgets, cleanup shrinks and the advisor do;
    requests too big for the pool are refused up front with ValueError."""
    advisor = ScriptedAdvisor(delay=1) if sc["advisor"] != "none" else None
    engine = tiny_engine(MODEL, advisor=advisor, block_size=sc["block_size"], prefill_chunk=sc["prefill_chunk"],
                         num_pages=num_pages, max_num_seqs=6, cleanup_threshold=threshold)
    admitted, finished = set(), set()
    for i, r in enumerate(sc["requests"]):
        try:
            engine.add_request(str(i), r["prompt"], SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True),
                               EvictionParams(r["policy"], budget=r["budget"], sink=r["sink"], recent=r["recent"],
                                              after_prompt=r["after_prompt"],
                                              prefill_allowance=1.0 if r["after_prompt"] else r["prefill_allowance"]))
            admitted.add(str(i))
        except ValueError as e:
            assert "KV pages" in str(e)
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        finished |= {o.request_id for o in engine.step() if o.finished}   # OutOfPages would raise here
        check_invariants(engine)
    assert finished == admitted
    assert engine.pool.peak_used <= engine.pool.capacity
    assert engine.pool.num_free == engine.pool.capacity


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_plan_ranks_are_each_blocks_first_place_in_its_rows_plan(data):
    """The lookup that places resident blocks in an advisor's plan agrees with
    comparing every block against every name (-1 pads, names of blocks the row
    no longer holds, repeated names: the first place counts), for several
    sequences side by side, some without a plan."""
    import torch

    from services.compute.eviction.advisor import EvictionPlan
    from services.compute.eviction.evict import plan_ranks
    L, H = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    seqs = []
    for _ in range(data.draw(st.integers(1, 3))):
        nb, k = data.draw(st.integers(1, 24)), data.draw(st.integers(1, 30))
        rows = [sorted(data.draw(st.sets(st.integers(0, 60), min_size=nb, max_size=nb))) for _ in range(L * H)]
        names = ([data.draw(st.lists(st.integers(-1, 70), min_size=k, max_size=k)) for _ in range(L * H)]
                 if data.draw(st.booleans()) else None)
        seqs.append((rows, names))
    bi = torch.cat([torch.tensor(rows, dtype=torch.int32).view(L, H, -1) for rows, _ in seqs], 2)
    plans = [None if names is None else EvictionPlan("r", torch.tensor(names, dtype=torch.int32).view(L, H, -1))
             for _, names in seqs]
    got = plan_ranks(bi, [len(rows[0]) for rows, _ in seqs], plans).view(L * H, -1)
    col = 0
    for rows, names in seqs:
        for j in range(len(rows[0])):
            for r in range(L * H):
                b = rows[r][j]
                want = float("inf") if names is None else \
                    next((i - len(names[r]) for i, x in enumerate(names[r]) if x == b), float("inf"))
                assert got[r, col + j].item() == want
        col += len(rows[0])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_rounds_run_together_equal_rounds_run_alone(data):
    """`evict_rounds` over several sequences (one sort for all) frees, keeps
    and counts exactly what each sequence's round alone would: random sizes,
    protection, policies (their own window lengths), plans with pads, repeats
    and unknown names, and rounds without a plan."""
    import copy

    import torch

    from services.compute.eviction.advisor import EvictionPlan
    from services.compute.eviction.evict import Round, evict_rounds, protected_mask
    from services.compute.engine.kv_pool import KVPool
    from services.compute.eviction.policies import get_policy
    from services.compute.model.sampler import SamplingParams
    from services.compute.engine.sequence import COLUMN_FIELDS, EvictionState, Sequence

    L, H, D = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), 4
    bs = data.draw(st.sampled_from([1, 4]))
    pool = KVPool(4000, bs, D)
    rounds = []
    for i in range(data.draw(st.integers(1, 5))):
        nb = data.draw(st.integers(3, 20))
        sink, recent = data.draw(st.integers(0, 1)), data.draw(st.integers(0, bs))
        policy = data.draw(st.sampled_from(["learned", "h2o", "snapkv", "streaming"]))
        state = EvictionState(policy, budget_blocks=2, floor_blocks=1, sink_blocks=sink, recent=recent)
        seq = Sequence(f"s{i}", list(range(3, 3 + nb * bs)), SamplingParams(), state, L, H, D, bs)
        seq.append_blocks(pool.alloc(L * H * nb).view(L, H, nb), 0)
        seq.num_cached = nb * bs
        seq.policy = get_policy("h2o" if policy == "learned" else policy)
        g = torch.Generator().manual_seed(data.draw(st.integers(0, 10**6)))
        seq.acc_mass = torch.rand(L, H, nb, generator=g).round(decimals=1)      # ties happen
        # Drop some columns so rows hold different blocks.
        if data.draw(st.booleans()):
            seq.block_index = seq.block_index + (torch.rand(L, H, nb, generator=g) < 0.3).cumsum(2).int()
        evictable = int((~protected_mask(seq)).sum(-1).min())
        if evictable < 1:
            continue
        plan = None
        if policy == "learned" and data.draw(st.booleans()):
            k = data.draw(st.integers(0, 2 * nb))
            names = torch.randint(-1, int(seq.block_index.max()) + 3, (L, H, k), generator=g, dtype=torch.int32)
            plan = EvictionPlan(seq.request_id, names, covers=nb)
        rounds.append(Round(seq, data.draw(st.integers(1, evictable)), plan, data.draw(st.sampled_from(["", "x"]))))
    if not rounds:
        return
    alone = [copy.deepcopy(r) for r in rounds]
    pool_alone = copy.deepcopy(pool)
    for r in alone:
        evict_rounds([r], pool_alone)
    evict_rounds(rounds, pool)
    assert pool.num_free == pool_alone.num_free
    for a, b in zip(rounds, alone):
        for name in COLUMN_FIELDS:
            assert torch.equal(getattr(a.seq, name), getattr(b.seq, name)), name
        assert a.seq.evictions == b.seq.evictions and a.seq.eviction_rounds == b.seq.eviction_rounds == 1
        assert [torch.equal(x, y) for x, y in zip(a.seq.gone, b.seq.gone)] == [True] * len(b.seq.gone)
        assert a.seq.num_blocks == a.seq.block_index.shape[2]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_columns_grown_together_equal_columns_grown_alone(data):
    """`append_blocks` over several sequences (one tensor per field for all)
    gives each exactly the columns its own append gives: sizes, new-block
    counts, first block numbers and window lengths at random."""
    import copy

    import torch

    from services.compute.engine.kv_pool import KVPool
    from services.compute.model.sampler import SamplingParams
    from services.compute.engine.sequence import COLUMN_FIELDS, EvictionState, Sequence, append_blocks

    L, H, D = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), 4
    pool = KVPool(4000, 2, D)
    seqs, pages, firsts = [], [], []
    for i in range(data.draw(st.integers(1, 5))):
        nb = data.draw(st.integers(0, 12))
        policy = data.draw(st.sampled_from(["h2o", "snapkv"]))
        state = EvictionState(policy, budget_blocks=2, floor_blocks=1, sink_blocks=0, recent=0)
        seq = Sequence(f"s{i}", list(range(3, 40)), SamplingParams(), state, L, H, D, 2)
        if nb:
            seq.append_blocks(pool.alloc(L * H * nb).view(L, H, nb), 0)
            g = torch.Generator().manual_seed(i)
            for name in COLUMN_FIELDS[2:]:
                setattr(seq, name, torch.rand(getattr(seq, name).shape, generator=g))
        k = data.draw(st.integers(1, 4))
        seqs.append(seq)
        pages.append(pool.alloc(L * H * k).view(L, H, k))
        firsts.append(nb + data.draw(st.integers(0, 3)))
    alone = copy.deepcopy(seqs)
    for s, p, f in zip(alone, pages, firsts):
        s.append_blocks(p, f)
    append_blocks(seqs, pages, firsts)
    for a, b in zip(seqs, alone):
        for name in COLUMN_FIELDS:
            assert getattr(a, name).dtype == getattr(b, name).dtype
            assert torch.equal(getattr(a, name), getattr(b, name)), name


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_page_tables_stacked_together_equal_each_padded_alone(data):
    """`stack_columns` (one cat and one gather for a decode batch's page
    tables) gives what padding each sequence's table alone and stacking gives:
    sizes, widths and fill values at random, empty tables included."""
    import torch
    import torch.nn.functional as F

    from services.compute.model.runner import stack_columns

    L, H = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    sizes = data.draw(st.lists(st.integers(0, 9), min_size=1, max_size=6))
    width = max(sizes) + data.draw(st.integers(0, 2))
    fill = data.draw(st.sampled_from([0, 7, 1 << 30]))
    g = torch.Generator().manual_seed(sum(sizes))
    ts = [torch.randint(0, 1000, (L, H, n), dtype=torch.int32, generator=g) for n in sizes]
    want = torch.stack([F.pad(t, (0, width - t.shape[2]), value=fill) for t in ts], 1)
    got = stack_columns(ts, width, fill)
    assert got.dtype == want.dtype and got.is_contiguous()
    assert torch.equal(got, want)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_columns_grown_in_place_equal_columns_concatenated(data):
    """Growing sequences (dense, or a budget after a prompt still being
    prefilled) get spare columns and later appends write into them; budgeted
    ones are rebuilt. Over many steps of random appends (random subsets, 1-3
    blocks) and compactions, every field equals plain concatenation, and a
    dense sequence grown a block at a time is rebuilt only a few times."""
    import torch

    from services.compute.engine.kv_pool import KVPool
    from services.compute.model.sampler import SamplingParams
    from services.compute.engine.sequence import COLUMN_FIELDS, EvictionState, Sequence, append_blocks, keep_columns

    L, H, D = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3)), 4
    pool = KVPool(20000, 2, D)
    seqs, ref = [], []
    for i in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["dense", "h2o", "after"]))
        state = EvictionState("dense" if kind == "dense" else "h2o", budget_blocks=None if kind == "dense" else 3,
                              floor_blocks=1, sink_blocks=0, recent=0, after_prompt=kind == "after")
        seqs.append(Sequence(f"s{i}", list(range(3, 3 + data.draw(st.integers(1, 60)))), SamplingParams(), state,
                             L, H, D, 1))
        ref.append({name: getattr(seqs[-1], name).clone() for name in COLUMN_FIELDS})
    for step in range(data.draw(st.integers(1, 30))):
        grow = [i for i in range(len(seqs)) if data.draw(st.booleans())]
        if grow:
            ks = [data.draw(st.integers(1, 3)) for _ in grow]
            pages = [pool.alloc(L * H * k).view(L, H, k) for k in ks]
            firsts = [seqs[i].num_blocks + 2 for i in grow]
            append_blocks([seqs[i] for i in grow], pages, firsts)
            for i, k, p, f in zip(grow, ks, pages, firsts):
                s, r = seqs[i], ref[i]
                s.num_cached += k
                r["block_index"] = torch.cat([r["block_index"], (f + torch.arange(k, dtype=torch.int32))
                                              .expand(L, H, k)], 2)
                for name in COLUMN_FIELDS[1:]:
                    t = r[name]
                    r[name] = torch.cat([t, t.new_zeros(t.shape[:2] + (k,) + t.shape[3:])], 2)
                # Statistics change in place between steps, as the engine's observe does.
                s.acc_mass += 1.0
                r["acc_mass"] += 1.0
        budgeted = [s for s in seqs if s.eviction.budget_blocks is not None and s.num_blocks > 3
                    and not s.in_prefill]
        if budgeted and data.draw(st.booleans()):
            left = [s.num_blocks - 1 for s in budgeted]
            keep = torch.cat([torch.arange(1, s.num_blocks).expand(L, H, -1) + sum(left[:j]) + j
                              for j, s in enumerate(budgeted)], 2)
            keep_columns(budgeted, keep, left)
            for s in budgeted:
                r = ref[seqs.index(s)]
                for name in COLUMN_FIELDS:
                    r[name] = r[name][:, :, 1:]
    for s, r in zip(seqs, ref):
        for name in COLUMN_FIELDS:
            assert torch.equal(getattr(s, name), r[name]), (s.request_id, name)


def test_a_dense_sequence_grown_a_block_at_a_time_is_rebuilt_rarely():
    import torch

    from services.compute.engine.kv_pool import KVPool
    from services.compute.model.sampler import SamplingParams
    from services.compute.engine.sequence import EvictionState, Sequence, append_blocks

    pool = KVPool(5000, 1, 4)
    seq = Sequence("d", [3] * 10, SamplingParams(), EvictionState("dense", None, 1, 0, 0), 2, 2, 4, 1)
    rebuilds, before = 0, seq.key_mean
    for n in range(600):
        append_blocks([seq], [pool.alloc(4).view(2, 2, 1)], [n])
        # `before` stays alive until compared, so a new storage cannot reuse its address.
        rebuilds += seq.key_mean.untyped_storage().data_ptr() != before.untyped_storage().data_ptr()
        before = seq.key_mean
    assert seq.num_blocks == 600 and torch.equal(seq.block_index[1, 1], torch.arange(600, dtype=torch.int32))
    # Spare columns double up to 1,024: 16, 32, ... 512 -> 7 rebuilds, not 600.
    assert rebuilds <= 8, rebuilds


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_one_packed_sort_orders_as_four_stable_sorts(data):
    """The eviction order by one 64-bit key equals the order by four stable
    sorts (score, plan place, protection, sequence), ties included: repeated
    scores, -0.0 and 0.0, infinities, named and unnamed blocks."""
    import torch

    from services.compute.eviction.evict import _order

    L, H = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 3))
    sizes = data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=5))
    N, k = sum(sizes), data.draw(st.integers(0, 6))
    seg = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    pick = lambda values: torch.tensor(data.draw(st.lists(st.sampled_from(values), min_size=L * H * N,
                                                          max_size=L * H * N))).view(L, H, N)
    scores = pick([0.0, -0.0, 1.5, -1.5, 2.0, float("inf"), float("-inf"), 1e-30, -3e5]).float()
    rank = pick([float("inf")] + [float(-j) for j in range(1, k + 1)]).float()
    protected = pick([False, True])
    packed = _order(scores, rank, protected, seg, len(sizes), k)
    sorted4 = _order(scores, rank, protected, seg, len(sizes), 1 << 40)    # too wide to pack: four sorts
    assert torch.equal(packed, sorted4)
