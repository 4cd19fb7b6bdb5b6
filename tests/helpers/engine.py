"""Test helpers for the engine: tiny seeded models (2 layers, hidden 64) built
straight from ModelConfig, engines around them, and the no-cache reference."""
from __future__ import annotations

import math

import pytest
import torch

from helpers.models import randomize_
from services.compute.engine.engine import EngineConfig, LLMEngine
from services.compute.model.model import TransformerModel
from services.compute.model.config import ModelConfig

VOCAB = 259  # the placeholder's byte-level tokenizer (kvpop.models.default_model)



@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: intra-op threads only add contention on the 2 shared CI
    cores (an einsum of a decode step went from 1.3 ms to 0.1 ms). Import this
    into a test module to run it single-threaded; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(seed: int = 0, vocab: int = VOCAB, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, head_dim: int = 16, max_pos: int = 2048,
               sliding_window: int | None = None) -> TransformerModel:
    """Llama, or Mistral when ``sliding_window`` is given."""
    cfg = ModelConfig(architecture="mistral" if sliding_window else "llama", vocab_size=vocab,
                      hidden_size=64, intermediate_size=96, sliding_window=sliding_window,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=max_pos, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = TransformerModel(cfg)
    randomize_(model, seed)
    return model.eval()


def default_tokenizer():
    """The placeholder's byte-level tokenizer (any text encodes), built fresh:
    models/default holds the trained task model's word-level one."""
    import tempfile
    from pathlib import Path

    from kvpop.models.default_model import build_tokenizer
    from services.compute.model.tokenizer import Tokenizer
    folder = Path(tempfile.mkdtemp(prefix="kvpop-tok-"))
    build_tokenizer().save(str(folder / "tokenizer.json"))
    return Tokenizer(folder)


def tiny_engine(model=None, tokenizer=None, advisor=None, **config) -> LLMEngine:
    config.setdefault("block_size", 4)
    config.setdefault("num_pages", 2000)
    return LLMEngine(EngineConfig(**config), advisor=advisor, model=model or tiny_model(),
                     tokenizer=tokenizer)


def random_prompt(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    # Ids >= 3 avoid the special tokens (pad/bos/eos) of the byte tokenizer.
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def dense_greedy(model: TransformerModel, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full recomputation, no cache at all."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model.forward_dense(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list]:
    """Step until idle; outputs grouped by request id."""
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outs
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not finish")


class ScriptedAdvisor:
    """A test advisor: ranks every block it was told about by the attention it
    had received when submitted (lowest first), covering every block it knows.
    ``delay`` holds each plan back that many ``take_plans`` calls; ``silent``
    never answers; ``connected=False`` is an advisor that is down."""

    def __init__(self, delay: int = 0, silent: bool = False, connected: bool = True):
        import threading
        self.delay, self.silent, self.connected = delay, silent, connected
        self.epoch, self.on_plan = 0, None
        self._lock = threading.Lock()
        self._blocks: dict[str, dict[int, torch.Tensor]] = {}
        self._due: dict[str, int] = {}
        self.submitted = 0
        self.plans_sent = 0

    def submit(self, features, gone=None) -> None:
        with self._lock:
            for f in features:
                self._blocks.setdefault(f.request_id, {})[f.block] = f.attention
                self._due.setdefault(f.request_id, self.delay)
                self.submitted += 1

    def take_plans(self):
        from services.compute.eviction.advisor import EvictionPlan
        plans = {}
        with self._lock:
            for rid in list(self._due):
                if self._due[rid] > 0:
                    self._due[rid] -= 1
                    continue
                del self._due[rid]
                if self.silent:
                    continue
                blocks = self._blocks[rid]
                names = torch.tensor(sorted(blocks), dtype=torch.int32)
                att = torch.stack([blocks[b] for b in sorted(blocks)], -1)   # [L, Hkv, n]
                plans[rid] = EvictionPlan(rid, names[att.argsort(dim=-1, stable=True)], int(names.max()) + 1)
                self.plans_sent += 1
        return plans

    def release(self, request_id: str) -> None:
        with self._lock:
            self._blocks.pop(request_id, None)
            self._due.pop(request_id, None)


def check_invariants(engine):
    """Between two steps: every running row within its budget (+ slack, + the
    whole prompt for evict-after-prompt, + a chunk while held for a plan),
    sink / recent window / newest block resident, rows sorted without
    duplicates, no page held twice, pool accounting equal to the page tables,
    and pages held within what admission reserved."""
    held = []
    for seq in engine.seqs.values():
        if seq.status.value != "running":
            continue
        st_ = seq.eviction
        bi = seq.block_index.reshape(-1, seq.num_blocks) if seq.num_blocks else None
        held.append(seq.page_table.reshape(-1))
        if bi is None:
            continue
        if st_.budget_blocks is not None:
            # A learned sequence held for its plan keeps its last prefill chunk until the plan comes.
            chunk = math.ceil(engine.config.prefill_chunk / seq.block_size) + 1 if seq.holding else 0
            # Held longer: the whole prompt (after_prompt) or an allowance, until the prompt is in.
            base = (engine.scheduler.base_blocks(seq) if st_.prefill_blocks is not None
                    else st_.budget_blocks + st_.round_slack + st_.slack_blocks)
            assert seq.num_blocks <= base + chunk, (st_, seq.num_blocks)
        assert bool((bi[:, 1:] > bi[:, :-1]).all()), "rows sorted, no duplicates"
        if st_.budget_blocks is None and engine.model.config.sliding_window:
            continue   # dense rows of a sliding-window model drop what the window left (sink included)
        n, bs = seq.num_cached, seq.block_size
        last = (n - 1) // bs
        must = set(range(min(st_.sink_blocks, last + 1)))
        if st_.recent:
            must |= set(range(max(0, (n - st_.recent) // bs), last + 1))
        must.add(last)
        for row in bi.tolist():
            assert must <= set(row), (must - set(row), st_)
    sch = engine.scheduler
    running = [s for s in sch.running if s.num_blocks]
    if running:
        # Prefill overshoot of all budgeted sequences together fits the shared headroom,
        # so the pages held never exceed what admission reserved.
        assert sum(sch.headroom_used(s) for s in running) <= sch.headroom_pages(running[0])
        assert sum(s.page_table.numel() for s in running) <= sch.reserved()
    pages = torch.cat(held) if held else torch.empty(0, dtype=torch.int32)
    assert pages.numel() == pages.unique().numel(), "a page is held twice"
    assert bool((pages > 0).all()), "page 0 is never handed out"
    assert engine.pool.num_used == pages.numel(), "pool accounting matches page tables"
