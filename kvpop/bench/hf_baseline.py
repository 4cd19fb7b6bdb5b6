"""What a user without a server does: Hugging Face `generate()` on static
batches of whatever has arrived (`kvpop bench serve --policies dense,hf`).

Requests arrive at the same seeded Poisson times as the served run. Whenever
the model is free, every request that has arrived (up to `max_batch`) is
left-padded into one batch and generated to the end; requests arriving
meanwhile wait for the next batch. Dense KV, greedy, the same prompts, EOS
ignored, `new_tokens` each. A logits processor stamps every decoding step, so
TTFT (arrival to the first token) and inter-token latency are measured the
same way as for streamed requests.
"""
from __future__ import annotations

import math
import random
import time

from kvpop.bench.loadgen import percentile


class _StepClock:
    """A logits processor that only records when each step's token is chosen."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """The served run's arrival times (it sleeps an exponential gap before each request)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        if math.isfinite(rate):
            t += rng.expovariate(rate)
        out.append(t)
    return out


def run_hf(model_dir: str, insts, rate: float, seed: int, bar, new_tokens: int = 256,
           max_batch: int = 16) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    from kvpop.tasks.checker import is_correct
    from services.compute.model.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tok.eos_token_ids and min(tok.eos_token_ids) or 0
    # A chat instance carries its template-rendered ids (what compute builds from its messages).
    prompts = [list(inst.prompt_ids) if getattr(inst, "messages", None) else tok.encode(inst.prompt)
               for inst in insts]
    offsets = arrival_offsets(len(insts), rate, seed)
    ttft, tpot, itl, texts, peak = [], [], [], [None] * len(insts), 0
    done, t0 = 0, time.perf_counter()
    while done < len(insts):
        now = time.perf_counter() - t0
        if offsets[done] > now:
            time.sleep(offsets[done] - now)
            now = time.perf_counter() - t0
        batch = [i for i in range(done, min(len(insts), done + max_batch)) if offsets[i] <= now]
        peak = max(peak, len(batch))
        width = max(len(prompts[i]) for i in batch)
        ids = torch.full((len(batch), width), pad)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        clock = _StepClock()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=pad, logits_processor=LogitsProcessorList([clock]))
        for row, i in enumerate(batch):
            ttft.append(clock.stamps[0] - (t0 + offsets[i]))
            itl.extend(b - a for a, b in zip(clock.stamps, clock.stamps[1:]))
            tpot.append((clock.stamps[-1] - clock.stamps[0]) / max(1, len(clock.stamps) - 1))
            texts[i] = tok.decode(out[row, width:].tolist())
        done += len(batch)
        bar.update(len(batch))
    wall = time.perf_counter() - t0
    ms = lambda xs, q: round(1000 * percentile(xs, q), 3)
    return {
        "policy": "hf", "rate": "inf" if not math.isfinite(rate) else rate, "requests": len(insts), "errors": 0,
        "error_sample": None, "seconds": round(wall, 3), "requests_per_s": round(len(insts) / wall, 3),
        "output_tokens_per_s": round(len(insts) * new_tokens / wall, 2),
        "ttft_p50_ms": ms(ttft, 0.5), "ttft_p99_ms": ms(ttft, 0.99),
        "tpot_p50_ms": ms(tpot, 0.5), "tpot_p99_ms": ms(tpot, 0.99),
        "itl_p50_ms": ms(itl, 0.5), "itl_p99_ms": ms(itl, 0.99),
        "peak_running": peak, "peak_pages": 0, "network_share": None,
        "accuracy": round(sum(is_correct(inst, t) for inst, t in zip(insts, texts)) / len(insts), 4),
        "_ttft": ttft, "_itl": itl, "_texts": texts,
    }
