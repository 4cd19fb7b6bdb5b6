"""Sessions through the real stack: the second turn of a session runs on the
KV compute parked after the first (no re-prefill of the history), and its
greedy tokens are those of the whole conversation recomputed in process."""
from __future__ import annotations

import secrets

from .stack_helpers import compute_info
from kvpop.runtime.pb import generate_pb2
from services.compute.engine.engine import EngineConfig, LLMEngine, SamplingParams


def _turn(gateway, sid, prompt):
    req = generate_pb2.GenerateRequest(prompt=prompt, max_tokens=6, ignore_eos=True, policy="dense",
                                       session_id=sid)
    ids, final = [], None
    for r in gateway.Generate(req, timeout=60):
        if r.HasField("chunk"):
            ids.extend(r.chunk.token_ids)
        else:
            final = r.finished
    return ids, final


def test_second_turn_continues_from_parked_kv(gateway, compute, placeholder_model):
    sid = "sess-" + secrets.token_hex(4)
    before = compute_info(compute).stats.extra
    first, _ = _turn(gateway, sid, "Alice has 3 apples.")
    second, final = _turn(gateway, sid, " Bob gives her 2 more.")
    after = compute_info(compute).stats.extra
    assert after["sessions_continued"] == before.get("sessions_continued", 0) + 1
    assert after["session_pages"] > 0
    # The turn's own tokens only (no BOS: it continues a conversation).
    engine = LLMEngine(EngineConfig(str(placeholder_model), max_model_len=256, max_num_seqs=1,
                                    prefix_cache_fraction=0))
    tok = engine.tokenizer
    turn2 = tok.encode(" Bob gives her 2 more.", add_bos=False)
    assert final.usage.prompt_tokens == len(turn2)
    history = tok.encode("Alice has 3 apples.") + first + turn2
    expected = [o.token_id for o in engine.generate(history, SamplingParams(max_tokens=6, ignore_eos=True))]
    assert second == expected
