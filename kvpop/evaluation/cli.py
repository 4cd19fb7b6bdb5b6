"""`kvpop eval`: every policy at every compression on the same test prompts,
through the in-process serving engine. Writes results.json, results.md and
accuracy.png under --out."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvpop.runtime.config import PLAN_INTERVAL, PREFILL_CHUNK
from kvpop.models.fetch import estimator_arg, model_arg

DEFAULT_POLICIES = "dense,oracle,streaming,random,knorm,keydiff,h2o,tova,snapkv,learned"
DEFAULT_COMPRESSION = "0.5,0.75,0.875,0.9375"


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"seeds are integers, comma-separated: {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"give distinct seeds: {text!r}")
    return seeds


def _seed_meta(seeds: list[int]):
    return seeds[0] if len(seeds) == 1 else seeds


def _question_meta(args) -> dict:
    if args.suite == "chat":
        return {"gaps": args.gaps, "length_unit": "turns"}
    if args.suite != "real":
        return {}
    from kvpop.tasks.sources import catalog as sources
    return {"question": args.question, "source": args.source, "held_out": args.source in sources.HELD_OUT}


def _source(name: str) -> str:
    from kvpop.tasks.sources import catalog as sources
    try:
        return sources.check(name)
    except sources.SourceError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="models/default", type=model_arg,
                   help="model folder (HF layout), or a fetched name (smollm2-135m)")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help="comma-separated; a plain NAME holds its budget as the default prefill protocol says "
                        "(kvpop/runtime/config.py DEFAULT_PREFILL, a stack's KVPOP_DEFAULT_PREFILL); NAME+recentP gives NAME "
                        "a recent window of P%% of each budget "
                        "(h2o+recent50: H2O as its paper runs it); a trailing +after holds the budget from the end "
                        "of the prompt on, not during prefill (the request's evict_after_prompt; kvpress's protocol); a trailing "
                        "+prefill<N>x holds up to N times the budget during prefill, then the budget "
                        "(the request's prefill_allowance; +prefill1x: the budget during prefill too)")
    p.add_argument("--compression", default=DEFAULT_COMPRESSION, help="1 - budget / sequence length")
    p.add_argument("--suite", choices=["tasks", "real", "chat"], default="tasks",
                   help="tasks: the default model's task families; real: long-context retrieval on real text "
                        "for a chat model (needle, multikey, multivalue, vartrack; kvpop/tasks/ruler.py); chat: "
                        "facts told in a chat's first turns, asked for after --gaps turns of other talk, the "
                        "history's replies fixed text (pet, number, place; kvpop/tasks/chat_recall.py)")
    p.add_argument("--lengths", default="1024,2048",
                   help="--suite real: prompt lengths in the model's tokens (chat-rendered)")
    p.add_argument("--gaps", default="5,20",
                   help="--suite chat: turns of other talk between the facts and the question")
    p.add_argument("--question", choices=["end", "first"], default="end",
                   help="--suite real: where the question is asked: after the text (the default) or before it, "
                        "so a budget held during prefill ranks the text with the question in the context")
    p.add_argument("--source", type=_source, default="generator",
                   help="--suite real: the haystack's text (kvpop/tasks/sources/): generator (the project's own "
                        "filler), docstrings, code, dialogue (training sources), reference, licenses (held out of "
                        "training: text no network here saw)")
    p.add_argument("--no-kl", action="store_true",
                   help="skip the teacher-forced pass (KL to dense): half the work, accuracy only")
    p.add_argument("--no-dense", action="store_true",
                   help="skip the dense reference (its row and the retention column): for a rerun of policies "
                        "whose dense row an earlier run of the same prompts has; needs --no-kl")
    p.add_argument("--tasks", default="all", help="comma-separated task families, or 'all'")
    p.add_argument("--n", type=int, default=16, help="test instances per family")
    p.add_argument("--seed", type=_seeds, default=[0], metavar="SEED[,SEED...]",
                   help="test-set seed (0-99 at the standard n); several, comma-separated, pool their "
                        "instances into one table (a larger fixed check)")
    p.add_argument("--min-len", type=int, default=None, help="shortest prompt (default: the standard test set's)")
    p.add_argument("--max-len", type=int, default=None, help="longest prompt")
    p.add_argument("--block-size", type=int, default=1, help="eviction granularity in tokens")
    p.add_argument("--plan-interval", type=int, default=PLAN_INTERVAL,
                   help="tokens between a decoding sequence's eviction plans (compute's KVPOP_PLAN_INTERVAL)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help="in process: prompt tokens per engine step (compute's KVPOP_PREFILL_CHUNK); a budget held "
                        "during prefill holds after each chunk, so the peak KV is about budget + chunk")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--recent", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=48, help="engine batch size")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: more only adds contention on shared cores)")
    p.add_argument("--estimator", type=estimator_arg, default=None, metavar="CHECKPOINT",
                   help="in process: the network(s) `learned` uses, comma-separated (default: MODEL's "
                        "estimator*.safetensors, routed by prompt length, as a stack does); "
                        "served, start the stack with `kvpop up --estimator`")
    p.add_argument("--device", default="cpu", help="in process: where the model runs (cpu, cuda or auto)")
    p.add_argument("--quick", action="store_true", help="tiny run for tests: 1 instance per family, short prompts")
    p.add_argument("--via", metavar="HOST:PORT",
                   help="run the prompts through a running gateway (e.g. `kvpop up`) instead of in process; "
                        "its block size is used; KL is not measured")
    p.add_argument("--concurrency", type=int, default=16, help="--via: requests in flight at once")
    p.add_argument("--out", required=True, help="output folder")


def run(args) -> int:
    import torch

    from kvpop.evaluation import report
    from kvpop.evaluation.harness import Harness, Setting
    from kvpop.tasks.suite import FAMILIES as TASK_FAMILIES
    from services.compute.engine.engine import EngineConfig, LLMEngine
    from services.compute.eviction.policies import POLICY_NAMES

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    known = tuple(TASK_FAMILIES)    # the suite's families
    if args.suite in ("real", "chat"):
        from kvpop.tasks import chat_recall, ruler
        known = (ruler if args.suite == "real" else chat_recall).FAMILIES
    families = list(known) if args.tasks == "all" else [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [f for f in families if f not in known]
    if bad:
        print(f"unknown task(s) {', '.join(bad)}; choose from {', '.join(known)}")
        return 2
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    from kvpop.runtime.config import MAX_PREFILL_ALLOWANCE
    from kvpop.evaluation.harness import after_prompt, policy_spec, prefill_allowance
    try:
        unknown = [p for p in policies if policy_spec(p)[0] not in POLICY_NAMES and p != "oracle"]
        for p in policies:
            a = prefill_allowance(p)
            if not 1.0 <= a <= MAX_PREFILL_ALLOWANCE or (a > 1.0 and after_prompt(p)):
                raise ValueError(f"{p!r}: the prefill allowance must be in [1, {MAX_PREFILL_ALLOWANCE:g}] "
                                 f"and cannot go with +after")
    except ValueError as e:
        print(e)
        return 2
    if unknown:
        print(f"unknown policy {', '.join(unknown)}; choose from {', '.join(POLICY_NAMES + ('oracle',))}")
        return 2
    try:
        comps = [float(c) for c in args.compression.split(",") if c.strip()]
    except ValueError:
        print(f"--compression takes comma-separated fractions, got {args.compression!r}")
        return 2
    if any(not 0.0 < c < 1.0 for c in comps):
        print("compressions must be in (0, 1)")
        return 2
    if args.no_dense and (not args.no_kl or "dense" in policies):
        print("--no-dense skips the dense reference: it needs --no-kl (KL is measured against dense) and no "
              "'dense' in --policies")
        return 2
    if args.via:
        return run_via(args, policies, comps, families)
    from services.compute.model.loader import resolve_device
    try:   # before the prompts are built and the network loaded: a wrong device fails at once
        device = resolve_device(args.device)
    except ValueError as e:
        print(e)
        return 2
    uses_network = [p for p in policies if policy_spec(p)[0] == "learned"]
    from services.cache_manager.planner import resolve_checkpoints
    # The model folder: its estimator.safetensors and any estimator-*.safetensors, as a stack loads them.
    checkpoint = args.estimator or str(model_dir)
    missing = [p for p in resolve_checkpoints(checkpoint) if not p.is_file()]
    if uses_network and missing:
        print(f"note: no {missing[0]}; skipping {', '.join(uses_network)}")
        policies = [p for p in policies if p not in uses_network]
        uses_network = []
    try:
        instances, lo, hi, n = test_instances(args, families)
    except ValueError as e:     # a seed outside the test range, a length the model cannot hold
        print(f"kvpop eval: {e}")
        return 2

    advisor = None
    if uses_network:   # the cache-manager's own scoring, in process (docs/design/estimator.md)
        from kvpop.evaluation.local_advisor import LocalAdvisor
        advisor = LocalAdvisor(checkpoint)
        print(f"learned: {advisor.planner.loaded}")
    longest = max(len(i.prompt_ids) + len(i.solution_ids) for i in instances) + 64
    # No cleanup: a request that does not fit the pool waits; it never
    # shrinks running budgets (cleanup would silently evaluate a higher compression
    # than asked; a shrunk budget fails the run below).
    engine = LLMEngine(EngineConfig(str(model_dir), block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                    max_model_len=max(4096, longest), prefill_chunk=args.prefill_chunk,
                                    cleanup_threshold=float("inf"), plan_interval=args.plan_interval,
                                    device=device),
                       advisor=advisor)
    harness = Harness(engine, sink=args.sink, recent=args.recent, block_size=args.block_size)
    t0 = time.time()
    forcing = not args.no_kl
    dense = [] if args.no_dense else harness.run([Setting("dense", 0.0)], instances, desc="dense", forcing=forcing)
    reference = {(o.instance.family, o.instance.seed): o.logprobs for o in dense}
    for o in dense:
        o.kl = [0.0] * len(o.logprobs)
        o.logprobs = []
    settings = [Setting(p, c) for p in policies if p != "dense" for c in comps]
    rest = harness.run(settings, instances, desc="policies", reference=reference if forcing else None,
                       forcing=forcing)
    rows = report.records(dense + rest, families)
    decisions = {f"{p}@{c}": d for (p, c), d in sorted(harness.decisions.items()) if d.get("evicted")}
    if engine.scheduler.budget_shrinks:
        raise RuntimeError(f"{engine.scheduler.budget_shrinks} budgets were shrunk: not the compressions asked for")
    meta = {"model": str(model_dir), "suite": args.suite, "kl": forcing, "n_per_family": n, "lengths": [lo, hi],
            "seed": _seed_meta(args.seed),
            "device": device, "block_size": args.block_size, "plan_interval": args.plan_interval,
            "prefill_chunk": args.prefill_chunk, "sink": args.sink, "recent": args.recent, **_question_meta(args),
            "seconds": round(time.time() - t0, 1), "decisions": decisions}
    out = Path(args.out)
    report.write(rows, families, out, meta, dense + rest)
    print(report.title(meta) + report.markdown(rows, families, meta.get("length_unit", "tokens")))
    print_network_share(decisions)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'accuracy.png'}, {out / 'outcomes.jsonl'} "
          f"in {meta['seconds']} s")
    return 0


def test_instances(args, families: list[str]):
    """(instances, shortest, longest, n per family) of the chosen suite, every
    seed's instances in one list."""
    from kvpop.tasks import suite
    if args.suite == "chat":
        from kvpop.tasks import chat_recall
        try:
            gaps = [int(x) for x in args.gaps.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--gaps takes comma-separated turn counts, got {args.gaps!r}") from None
        n = 1 if args.quick else args.n
        insts = [i for s in args.seed for i in chat_recall.model_test_set(args.model, n, gaps, families, s)]
        return insts, min(gaps), max(gaps), n * len(args.seed)
    if args.suite == "real":
        from kvpop.tasks import ruler
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        n, lo, hi = 1 if args.quick else args.n, min(lengths), max(lengths)
        limit = ruler.prompt_limit(args.model)
        if hi > limit:
            print(f"prompts are capped at {limit} tokens: the model's context less {ruler.ANSWER_ROOM} "
                  f"for the answer")
        one_seed = lambda s: ruler.model_test_set(args.model, n, lengths, families, s, args.question, args.source)
    else:
        n, lo, hi = args.n, args.min_len or suite.TEST_MIN_LEN, args.max_len or suite.TEST_MAX_LEN
        if args.quick:
            n, lo, hi = 1, args.min_len or 448, args.max_len or 520
        one_seed = lambda s: suite.test_set(n, families, s, lo, hi)
    return [i for s in args.seed for i in one_seed(s)], lo, hi, n * len(args.seed)


def print_network_share(decisions: dict) -> None:
    for key, d in decisions.items():
        if key.startswith("learned"):
            print(f"{key}: {d['network']}/{d['evicted']} evicted blocks ranked by the network "
                  f"({100 * d['network'] / d['evicted']:.2f}%), fallback {d['fallback']}")


def run_via(args, policies: list[str], comps: list[float], families: list[str]) -> int:
    from kvpop.evaluation import report
    from kvpop.evaluation.harness import Setting
    from kvpop.evaluation.served import ServedHarness

    if "oracle" in policies:
        print("note: 'oracle' is evaluation-only (it knows the answer's positions); not served, skipped")
        policies = [p for p in policies if p != "oracle"]
    if args.estimator or args.device != "cpu":
        print("note: --estimator and --device are for in-process runs; a stack uses what it was started "
              "with (`kvpop up --estimator ... --device ...`)")
    try:
        instances, lo, hi, n = test_instances(args, families)
    except ValueError as e:     # a text source not on this machine, a length the model cannot hold
        print(f"kvpop eval: {e}")
        return 2
    harness = ServedHarness(args.via, sink=args.sink, recent=args.recent, concurrency=args.concurrency)
    info = harness.info
    print(f"via {args.via}: model {info.name} ({info.architecture}, {info.num_layers} layers), "
          f"block size {info.block_size}, plan interval {info.plan_interval}")
    t0 = time.time()
    try:
        settings = [] if args.no_dense else [Setting("dense", 0.0)]
        settings += [Setting(p, c) for p in policies if p != "dense" for c in comps]
        outcomes = harness.run(settings, instances)
    finally:
        harness.close()
    rows = report.records(outcomes, families)
    decisions = {f"{p}@{c}": d for (p, c), d in sorted(harness.decisions.items()) if d.get("evicted")}
    failed = [o for o in outcomes if o.error]
    errors: dict[str, dict] = {}
    for o in failed:
        e = errors.setdefault(f"{o.setting.policy}@{o.setting.compression}", {"count": 0, "first": o.error})
        e["count"] += 1
    meta = {"model": info.name, "via": args.via, "n_per_family": n, "lengths": [lo, hi], "seed": _seed_meta(args.seed),
            "block_size": info.block_size, "plan_interval": info.plan_interval, "sink": args.sink,
            "recent": args.recent, **_question_meta(args), "seconds": round(time.time() - t0, 1), "decisions": decisions,
            "errors": errors}
    out = Path(args.out)
    report.write(rows, families, out, meta, outcomes)
    print(report.title(meta) + report.markdown(rows, families, meta.get("length_unit", "tokens")))
    print_network_share(decisions)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'accuracy.png'} in {meta['seconds']} s")
    if failed:
        print(f"{len(failed)} of {len(outcomes)} requests failed and count as wrong answers:")
        for key, e in errors.items():
            print(f"  {key}: {e['count']} failed, e.g. {e['first']}")
        return 1
    return 0
