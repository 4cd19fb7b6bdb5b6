"""NVIDIA kvpress's presses on the prompts of `kvpop eval --suite real`, on the
transformers model: the peer reference for docs/results/long-context.md. Run it
with scripts/compare_kvpress.sh (kvpress pins an older transformers, so it
has its own venv).

The prompts are the same instances (same seeds, lengths, chat template); the
protocol is kvpress's: the context is prefilled in full and compressed once
(a press keeps ``int(context * (1 - compression))`` tokens per kv-head), then
the question and the answer run uncompressed on top. Two placements:

- ``end`` (kvpress's own): the user message without its question is the
  context; the question comes after the compression, which never sees it.
- ``context``: the whole user message, question included, is compressed (as
  `kvpop eval --policies NAME+after` does), then the answer is generated.

Accuracy is the suite's containment check. KV is measured on the cache
itself (``KVMeter``): "held" is what a (layer, kv-head) row holds in the
answer's last step (kept context + question + answer so far, in tokens), to
set beside the budget our policies hold; "peak" is the most KV bytes the
cache held at once, read after each layer's attention and before the press
compresses that layer (a press compresses layer by layer during the prefill,
so the peak is the compressed earlier layers plus one whole layer).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

PRESSES = ("streaming", "snapkv", "tova", "knorm", "keydiff", "expected_attention")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvpop.models.fetch import model_arg
    p.add_argument("--model", default="smollm2-135m", type=model_arg, help="model folder or fetched name")
    p.add_argument("--lengths", default="1024,2048")
    p.add_argument("--n", type=int, default=2, help="instances per (family, length)")
    p.add_argument("--seed", type=int, default=0, help="test-set seed (as kvpop eval --seed)")
    p.add_argument("--tasks", default="all")
    p.add_argument("--compression", default="0.5,0.75,0.875,0.9375")
    p.add_argument("--presses", default=",".join(PRESSES))
    p.add_argument("--question", choices=("end", "context", "both"), default="both",
                   help="end: question after compression (kvpress); context: compressed with the prompt")
    p.add_argument("--question-at", choices=("end", "first"), default="end",
                   help="where the prompt asks its question (kvpop eval --question): first puts it before the "
                        "text, so it is compressed with the context (--question is then context)")
    p.add_argument("--source", default="generator",
                   help="the haystack's text (kvpop eval --source): generator, docstrings, code, dialogue, or the "
                        "held-out reference, licenses")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)


def make_press(name: str, compression: float):
    import kvpress
    cls = {"streaming": kvpress.StreamingLLMPress, "snapkv": kvpress.SnapKVPress, "tova": kvpress.TOVAPress,
           "knorm": kvpress.KnormPress, "keydiff": kvpress.KeyDiffPress,
           "expected_attention": kvpress.ExpectedAttentionPress}[name]
    return cls(compression_ratio=compression)


class KVMeter:
    """Bytes in a transformers cache after every attention layer's forward. Its hooks are
    registered before any press's (a press registers on entering its context), so they run
    first: each reading sees that layer's full KV, the earlier layers as compressed."""

    def __init__(self, model):
        self.cache, self.peak, self.last = None, 0, 0
        self.hooks = [layer.self_attn.register_forward_hook(self._read) for layer in model.model.layers]

    def start(self, cache) -> None:
        self.cache, self.peak, self.last = cache, 0, 0

    def stop(self) -> None:
        """Stop reading (the readings stay: the answer's last step and the peak)."""
        self.cache = None

    def _read(self, module, args, output) -> None:
        if self.cache is None:
            return
        n = 0
        for layer in self.cache.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if t is not None and t.dim() == 4:
                    n += t.numel() * t.element_size()
        self.last = n
        self.peak = max(self.peak, n)


def split(content: str) -> tuple[str, str]:
    """The ruler prompt's user message -> (text before the question, the question)."""
    at = content.rindex("\n\nQuestion:")
    return content[:at], content[at:]


def run(args) -> int:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline

    import kvpress  # noqa: F401  (registers the kv-press-text-generation pipeline)
    from kvpop.tasks import ruler

    torch.set_num_threads(args.threads)
    families = list(ruler.FAMILIES) if args.tasks == "all" else [t.strip() for t in args.tasks.split(",")]
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    comps = [float(c) for c in args.compression.split(",") if c.strip()]
    presses = [p.strip() for p in args.presses.split(",") if p.strip()]
    bad = [p for p in presses if p not in PRESSES]
    if bad:
        print(f"unknown press {', '.join(bad)}; choose from {', '.join(PRESSES)}")
        return 2
    placements = ["end", "context"] if args.question == "both" else [args.question]
    if args.question_at == "first":
        placements = ["context"]      # the question is part of the text before it
    from kvpop.tasks.sources import catalog as sources
    try:
        sources.check(args.source)
    except sources.SourceError as e:
        print(e)
        return 2
    insts = ruler.model_test_set(args.model, args.n, lengths, families, args.seed, args.question_at, args.source)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    meter = KVMeter(model)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # Bytes one token takes in one (layer, kv-head) row: K and V.
    row_token_bytes = 2 * head_dim * torch.empty((), dtype=model.dtype).element_size()
    rows_of = cfg.num_hidden_layers * cfg.num_key_value_heads
    jobs = [(None, 0.0, "end")] + [(p, c, q) for q in placements for p in presses for c in comps]
    rows = []
    t0 = time.time()
    bar = tqdm(total=len(jobs) * len(insts), desc="kvpress", dynamic_ncols=True, mininterval=2)
    for press_name, comp, where in jobs:
        for inst in insts:
            content = inst.messages[0]["content"]
            context, question = (content, "") if where == "context" else split(content)
            press = make_press(press_name, comp) if press_name else None
            cache = DynamicCache()
            meter.start(cache)
            out = pipe(context, question=question, press=press, max_new_tokens=len(inst.solution_ids) + 16,
                       cache=cache)
            meter.stop()
            answer = out["answer"]
            ctx_tokens = len(pipe.preprocess(context, [question], "", 1 << 30)["context_ids"][0])
            rows.append({"policy": f"kvpress:{press_name or 'dense'}" + ("+ctx" if where == "context" else ""),
                         "compression": comp, "family": inst.family, "length": len(inst.prompt_ids), "asked_length": inst.length,
                         "seed": inst.seed, "correct": inst.check(answer), "answer": answer,
                         "context_tokens": ctx_tokens,
                         "held_tokens": meter.last / (rows_of * row_token_bytes),
                         "peak_kv_mib": meter.peak / 2 ** 20})
            bar.update(1)
    bar.close()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"model": str(args.model), "kvpress": _version("kvpress"), "transformers": _version("transformers"),
            "n_per_family": args.n, "lengths": lengths, "seed": args.seed, "question_at": args.question_at,
            "source": args.source, "held_out": args.source in sources.HELD_OUT, "seconds": round(time.time() - t0, 1)}
    (out_dir / "kvpress.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    md = table(rows, families)
    (out_dir / "kvpress.md").write_text(md + "\n")
    print(md)
    print(f"wrote {out_dir / 'kvpress.json'}, {out_dir / 'kvpress.md'} in {meta['seconds']} s")
    return 0


def table(rows: list[dict], families: list[str]) -> str:
    """Accuracy per (press, compression): each family, the mean, and the mean KV held per row."""
    keys = sorted({(r["policy"], r["compression"]) for r in rows}, key=lambda k: (k[1] > 0, k[0], k[1]))
    head = "| press | compression | " + " | ".join(families) + " | mean | KV held (tokens/row) | peak KV (MiB) |"
    lines = [head, "|" + " --- |" * 2 + " ---: |" * (len(families) + 3)]
    for pol, comp in keys:
        sel = [r for r in rows if (r["policy"], r["compression"]) == (pol, comp)]
        accs = []
        for f in families:
            fs = [r["correct"] for r in sel if r["family"] == f]
            accs.append(sum(fs) / len(fs) if fs else float("nan"))
        held = sum(r["held_tokens"] for r in sel) / len(sel)
        peak = [r["peak_kv_mib"] for r in sel if "peak_kv_mib" in r]
        lines.append(f"| {pol} | {comp:.2%} | " + " | ".join(f"{a:.2f}" for a in accs)
                     + f" | {sum(accs) / len(accs):.3f} | {held:.0f} | "
                     + (f"{sum(peak) / len(peak):.1f} |" if peak else "- |"))
    return "\n".join(lines)


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(pkg)
    except PackageNotFoundError:
        return "?"


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m kvpop.bench.compare_kvpress", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
