"""Sampling: greedy, temperature, top-k, top-p, repetition penalty.

Every random request draws from its own ``torch.Generator`` (seeded by the
request's seed, or a fresh random seed), one row at a time, so the tokens a
seeded request gets do not depend on what else is in the batch.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    session_id: str | None = None   # park the KV at finish; continue a parked session
    resume_session: bool = False    # must continue a parked session: admission raises SessionNotParked if none

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.session_id is not None and (not isinstance(self.session_id, str) or not self.session_id
                                            or len(self.session_id) > 256):
            raise ValueError("session_id must be a non-empty string of at most 256 characters")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a sequence of non-empty strings")


def make_generator(params: SamplingParams, device) -> torch.Generator | None:
    if params.temperature == 0.0:
        return None
    seed = params.seed if params.seed is not None else random.getrandbits(63)
    return torch.Generator(device=device).manual_seed(seed)


def _penalise(row: torch.Tensor, seen: list[int], penalty: float) -> torch.Tensor:
    idx = torch.tensor(sorted(set(seen)), dtype=torch.long, device=row.device)
    vals = row[idx]
    row = row.clone()
    row[idx] = torch.where(vals > 0, vals / penalty, vals * penalty)
    return row


def _filter(row: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if 0 < top_k < row.numel():
        kth = torch.topk(row, top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if top_p < 1.0:
        sorted_vals, order = torch.sort(row, descending=True)
        cum = torch.softmax(sorted_vals, -1).cumsum(-1)
        # Drop a token once the mass before it already reaches top_p (the top token always stays).
        drop = (cum - torch.softmax(sorted_vals, -1)) >= top_p
        row = row.masked_fill(torch.zeros_like(drop).scatter_(0, order, drop), float("-inf"))
    return row


def sample(logits: torch.Tensor, seqs: list) -> tuple[list[int], list[float | None]]:
    """logits [B, V] float32, one row per sequence -> (token ids, logprobs).

    The logprob is the chosen token's under the model's raw distribution
    (before penalty, temperature and truncation), or None if not asked for."""
    logits = logits.float()
    greedy = [s.sampling.temperature == 0.0 and s.sampling.repetition_penalty == 1.0 for s in seqs]
    # One argmax and one device->host copy for all plain greedy rows.
    tokens = logits.argmax(-1).tolist() if any(greedy) else [0] * len(seqs)
    for i, seq in enumerate(seqs):
        if greedy[i]:
            continue
        p: SamplingParams = seq.sampling
        row = logits[i]
        if p.repetition_penalty != 1.0:
            row = _penalise(row, seq.tokens, p.repetition_penalty)
        if p.temperature == 0.0:
            tokens[i] = int(torch.argmax(row))
        else:
            probs = torch.softmax(_filter(row / p.temperature, p.top_k, p.top_p), -1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=seq.generator))
    logprobs: list[float | None] = [None] * len(seqs)
    want = [i for i, s in enumerate(seqs) if s.sampling.logprobs]
    if want:
        raw = torch.log_softmax(logits[want], -1)
        chosen = raw.gather(1, torch.tensor([tokens[i] for i in want], device=raw.device)[:, None])
        for i, v in zip(want, chosen[:, 0].tolist()):
            logprobs[i] = v
    return tokens, logprobs
