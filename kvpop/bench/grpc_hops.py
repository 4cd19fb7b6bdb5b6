"""`kvpop bench grpc`: what serving over gRPC adds per token, path by path, in one run.

The same greedy requests (dense, EOS ignored) go four ways, rounds interleaved:

  engine   LLMEngine.step() in this process: the floor;
  async    AsyncEngine in this process: the engine thread and an asyncio consumer
           (what compute's servicer reads from);
  compute  compute's Generate over gRPC, with the stack's internal token;
  gateway  the public API: gateway, then compute.

For each path: inter-token latency p50/p99 over all streams of all rounds,
output tokens/s (median of the rounds), and the latency each hop adds over the
engine at p50. The stack is started by the benchmark (`kvpop up`'s code) on
the same model and block size as the in-process engine, so the engine work
is identical and only the transport differs.
"""
from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from kvpop.bench import outputs
from kvpop.bench.loadgen import Stream, percentile
from kvpop.models.fetch import model_arg
from kvpop.runtime.paths import DEFAULT_MODEL_DIR

PATHS = ("engine", "async", "compute", "gateway")


def add_arguments(p) -> None:
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR), type=model_arg,
                   help="model folder or a fetched name (smollm2-135m)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 16],
                   help="concurrent streams per round (one table row per value)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="rounds per path, interleaved")
    p.add_argument("--block-size", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="a small run (checks that it works, not a speed)")
    p.add_argument("--json", type=Path, default=None)


PROMPT = "Registers hold small numbers. a = 5. b = 7. c = a + b. What is c? "


def _engine_round(engine, streams: int, new_tokens: int, tag: str) -> list[list[float]]:
    from services.compute.engine.engine import EvictionParams, SamplingParams

    ids = engine.tokenizer.encode(PROMPT, add_bos=True)
    stamps: dict[str, list[float]] = {}
    for i in range(streams):
        rid = f"{tag}-{i}"
        stamps[rid] = []
        engine.add_request(rid, ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True), EvictionParams("dense"))
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_id is not None:
                stamps[out.request_id].append(time.perf_counter())
    return list(stamps.values())


def _async_round(aengine, streams: int, new_tokens: int, tag: str) -> list[list[float]]:
    from services.compute.engine.engine import EvictionParams, SamplingParams

    ids = aengine.engine.tokenizer.encode(PROMPT, add_bos=True)

    async def one(rid: str) -> list[float]:
        ts = []
        async for out in aengine.generate(rid, ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                                          EvictionParams("dense")):
            if out.token_id is not None:
                ts.append(time.perf_counter())
        return ts

    async def all_streams():
        return await asyncio.gather(*(one(f"{tag}-{i}") for i in range(streams)))

    return list(asyncio.run(all_streams()))


class _ComputeStream(Stream):
    """A Stream whose messages are compute's (a GenerateResponse inside)."""

    def _run(self) -> None:
        import grpc
        try:
            for msg in self.stub.Generate(self.req, timeout=600, metadata=self.metadata):
                r = msg.response
                if r.HasField("chunk"):
                    self.stamps.extend([time.perf_counter()] * max(1, len(r.chunk.token_ids)))
        except grpc.RpcError as e:
            self.error = f"{e.code().name}: {e.details()}"
        self.t_end = time.perf_counter()


def _grpc_round(make, streams: int) -> list[list[float]]:
    runs = [make(i).start() for i in range(streams)]
    for s in runs:
        s.thread.join()
    errors = [s.error for s in runs if s.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {streams} streams failed: {errors[0]}")
    return [s.stamps for s in runs]


def _summary(rounds: list[list[list[float]]]) -> dict:
    gaps = [b - a for r in rounds for ts in r for a, b in zip(ts[1:], ts[2:])]   # first gap: after prefill
    rates = []
    for r in rounds:
        first = min(ts[0] for ts in r)
        last = max(ts[-1] for ts in r)
        rates.append(sum(len(ts) - 1 for ts in r) / max(last - first, 1e-9))
    return {"itl_p50_ms": 1e3 * percentile(gaps, 0.5), "itl_p99_ms": 1e3 * percentile(gaps, 0.99),
            "tokens_per_s": statistics.median(rates), "gaps": len(gaps)}


def bench(args) -> dict:
    import grpc

    from kvpop.stack.up import start_stack
    from kvpop.stack.down import stop_stack
    from kvpop.runtime.pb import compute_pb2_grpc, generate_pb2, generate_pb2_grpc
    from kvpop.runtime.security import sync_channel
    from services.compute.engine.async_engine import AsyncEngine
    from services.compute.engine.engine import EngineConfig, LLMEngine

    if args.quick:
        args.streams, args.new_tokens, args.repeats = [1, 2], 24, 2
    max_streams = max(args.streams)
    state = Path(tempfile.mkdtemp(prefix="kvpop-bench-grpc-"))
    print(f"starting a stack on {args.model} (block size {args.block_size}) ...", flush=True)
    stack = start_stack(state, model=args.model, service_args={"compute": ["--block-size", str(args.block_size)]},
                        supervise=False, timeout=300)
    try:
        ec = EngineConfig(model_dir=args.model, dtype="float32", device="cpu", block_size=args.block_size,
                          max_num_seqs=max(64, max_streams))
        engine = LLMEngine(ec)
        aengine = AsyncEngine(LLMEngine(ec))
        gw = generate_pb2_grpc.KVpopStub(grpc.insecure_channel(stack.gateway))
        info = gw.GetModelInfo(generate_pb2.GetModelInfoRequest())
        compute_ch = sync_channel(stack.proc("compute").address, stack.security())
        cp = compute_pb2_grpc.ComputeStub(compute_ch)
        from kvpop.runtime.config import GatewayConfig
        from services.gateway.validation import validate

        public = generate_pb2.GenerateRequest(prompt=PROMPT, policy="dense", max_tokens=args.new_tokens,
                                              ignore_eos=True, temperature=0.0)
        rows = []
        total = len(args.streams) * (args.repeats + 1) * len(PATHS)
        with tqdm(total=total, desc="bench grpc", unit="round") as bar:
            for streams in args.streams:
                rounds: dict[str, list] = {p: [] for p in PATHS}
                for rep in range(args.repeats + 1):          # round 0 warms every path up
                    for path in PATHS:
                        tag = f"{path}-{streams}-{rep}"
                        if path == "engine":
                            r = _engine_round(engine, streams, args.new_tokens, tag)
                        elif path == "async":
                            r = _async_round(aengine, streams, args.new_tokens, tag)
                        elif path == "compute":
                            def make(i, tag=tag):
                                creq = validate(public, GatewayConfig(), info)
                                creq.request_id = f"{tag}-{i}-{time.monotonic_ns()}"
                                return _ComputeStream(cp, creq)
                            r = _grpc_round(make, streams)
                        else:
                            r = _grpc_round(lambda i: Stream(gw, public, client_id=f"bench-{i}"), streams)
                        if rep:
                            rounds[path].append(r)
                        bar.update()
                row = {"streams": streams, **{p: _summary(rounds[p]) for p in PATHS}}
                base = row["engine"]
                for p in PATHS[1:]:
                    row[p]["added_ms_p50"] = row[p]["itl_p50_ms"] - base["itl_p50_ms"]
                    row[p]["throughput_ratio"] = row[p]["tokens_per_s"] / base["tokens_per_s"]
                rows.append(row)
        aengine.shutdown()
        compute_ch.close()
    finally:
        stop_stack(stack, grace=5)
    return {"command": "kvpop bench grpc", "model": str(args.model), "block_size": args.block_size,
            "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": rows}


def print_table(res: dict) -> None:
    print(f"\nper-token cost of each hop ({res['new_tokens']} new tokens, dense, median of {res['repeats']} rounds)")
    print("| streams | path | ITL p50 ms | ITL p99 ms | added p50 ms | tok/s | vs engine |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for row in res["rows"]:
        for p in PATHS:
            r = row[p]
            added = f"{r['added_ms_p50']:+.2f}" if p != "engine" else ""
            ratio = f"{r['throughput_ratio']:.2f}x" if p != "engine" else "1.00x"
            print(f"| {row['streams']} | {p} | {r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | {added} | "
                  f"{r['tokens_per_s']:.0f} | {ratio} |")


def run(args) -> int:
    res = bench(args)
    from kvpop.bench.machine import machine
    res["machine"] = machine()
    print_table(res)
    outputs.write(res, args)
    return 0
