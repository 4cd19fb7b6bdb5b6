"""Placeholder default model: a small Llama-layout model with seeded random
weights and a byte-level tokenizer, so every part of the stack has a real
model to run before `kvpop train-model` replaces it with trained weights.

Regenerate with: python -m kvpop.models.default_model [out_dir]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

PLACEHOLDER_KEY = "kvpop_placeholder"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2; byte b is id 3 + b

MODEL_CARD = """# Placeholder default model — RANDOM WEIGHTS

This folder holds a small Llama-architecture model ({layers} layers, hidden
{hidden}, {heads} query heads over {kv_heads} kv-heads, head_dim {head_dim},
vocab {vocab}) whose weights are **seeded random numbers (seed {seed})**, not a
trained model. Its output is meaningless text. It exists so the serving stack,
the KV pool and the eviction machinery run end to end on a real forward pass.

`config.json` carries `"{key}": true` while this is the case.
`kvpop train-model` trains the real default model on the project's task
generator and overwrites these files (config.json, model.safetensors,
tokenizer.json) in the same Hugging Face layout.

Tokenizer: byte-level, no merges: `<pad>`=0, `<s>`=1 (prepended), `</s>`=2
(end of sequence), byte b = 3 + b. Any UTF-8 text round-trips.

Built by `python -m kvpop.models.default_model` (kvpop/models/default_model.py).
"""


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (what ByteLevel uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_tokenizer():
    """A byte-level `tokenizers.Tokenizer` with the three special tokens; BOS
    is added by its post-processor."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b, ch in byte_to_unicode().items():
        vocab[ch] = len(SPECIAL_TOKENS) + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    # BOS on every fresh sequence, said by the tokenizer itself (as transformers reads it).
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    return tok


def placeholder_config(vocab_size: int):
    from services.compute.model.config import ModelConfig

    return ModelConfig(
        architecture="llama", vocab_size=vocab_size, hidden_size=256, intermediate_size=512,
        num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096,
        tie_word_embeddings=False, attention_bias=False, bos_token_id=1, eos_token_id=2,
        torch_dtype="bfloat16",
    )


def build_placeholder(out_dir: str | Path, seed: int = 0) -> Path:
    import torch

    from services.compute.model.loader import save_model
    from services.compute.model.model import TransformerModel

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = placeholder_config(tok.get_vocab_size(with_added_tokens=True))
    g = torch.Generator().manual_seed(seed)
    model = TransformerModel(cfg)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                # 1/sqrt(fan_in) keeps activations O(1) through the layers, so
                # logits are neither uniform nor saturated.
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
        # Sharper next-token distributions: greedy decoding then rarely meets
        # near-ties, so dense-vs-cache comparisons in tests are stable.
        model.lm_head.weight.mul_(3.0)
    # bf16 on disk halves the committed size; load_model upcasts on request.
    save_model(model.to(torch.bfloat16), out_dir)
    config_path = out_dir / "config.json"
    hf = json.loads(config_path.read_text())
    hf[PLACEHOLDER_KEY] = True
    hf["kvpop_placeholder_seed"] = seed
    config_path.write_text(json.dumps(hf, indent=2) + "\n")
    (out_dir / "MODEL_CARD.md").write_text(MODEL_CARD.format(
        layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, vocab=cfg.vocab_size, seed=seed, key=PLACEHOLDER_KEY))
    return out_dir


def is_placeholder(model_dir: str | Path) -> bool:
    path = Path(model_dir) / "config.json"
    return path.is_file() and bool(json.loads(path.read_text()).get(PLACEHOLDER_KEY, False))


if __name__ == "__main__":
    from kvpop.runtime.paths import DEFAULT_MODEL_DIR

    target = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_MODEL_DIR
    print(build_placeholder(target))
