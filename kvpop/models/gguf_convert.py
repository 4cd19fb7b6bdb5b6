"""Convert a Llama-architecture GGUF file (llama.cpp's format) into a Hugging
Face folder that `services.compute.model.loader` and transformers both read:
config.json, model.safetensors (fp32), tokenizer.json, tokenizer_config.json
(with the chat template), generation_config.json, special_tokens_map.json.

What GGUF changes relative to the Hugging Face checkpoint, and how it is undone:

- Tensors are quantized (Q4_1, Q8_0, ...): `gguf.quants.dequantize` gives fp32.
- Shapes are stored in ggml order (fastest dimension first): reversed here.
- llama.cpp's converter permutes the rows of q_proj and k_proj so that each
  head's two RoPE halves are interleaved (GPT-J style rotation); Hugging Face
  Llama rotates halves (`rotate_half`). `unpermute` restores the HF row order.
- No output.weight tensor means the LM head is tied to the token embedding.
- The tokenizer is metadata (tokens, merges, token types, special ids, chat
  template); `build_tokenizer` rebuilds the byte-level BPE tokenizer.json,
  including the pre-tokenizer the vocabulary was trained with (named by
  `tokenizer.ggml.pre`), which the GGUF only names.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4

# tokenizer.ggml.pre -> the pre-tokenizer of the original tokenizer.json. llama.cpp's
# "smollm" (like starcoder) splits every digit alone, then applies the GPT-2 regex.
_PRE_TOKENIZERS: dict[str, dict] = {
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
    "starcoder": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
    "gpt-2": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class ConversionError(ValueError):
    pass


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _BLOCK.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_TENSORS:
        return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"
    raise ConversionError(f"GGUF tensor {gguf_name!r} has no Llama counterpart in this converter")


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k permute: rows [head, pair, 2] -> [head, 2, pair]."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _float32_value(x: float) -> float:
    # GGUF stores floats as float32 (1e-5 reads back as 9.99999974e-06); the
    # shortest decimal that rounds to the same float32 is what config.json had.
    return float(str(np.float32(x)))


def read_config(reader) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConversionError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    g = lambda k, d=None: _field(reader, f"llama.{k}", d)  # noqa: E731
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    kv_heads = int(g("attention.head_count_kv", heads))
    head_dim = int(g("attention.key_length", g("rope.dimension_count", hidden // heads)))
    if g("rope.scaling.type") not in (None, "none"):
        raise ConversionError(f"rope scaling {g('rope.scaling.type')!r} is not supported by this converter")
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(g("vocab_size", int(embd.shape[1])))
    tok = lambda k: _field(reader, f"tokenizer.ggml.{k}")  # noqa: E731
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": _float32_value(g("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _float32_value(g("rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(g("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": any(n.endswith("attn_q.bias") for n in names),
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": tok("bos_token_id"),
        "eos_token_id": tok("eos_token_id"),
        "pad_token_id": tok("padding_token_id"),
        "torch_dtype": "float32",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def convert_tensors(reader, config: dict, progress: Callable | None = None) -> dict[str, np.ndarray]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    out: dict[str, np.ndarray] = {}
    tensors = list(reader.tensors)
    for t in (progress(tensors) if progress else tensors):
        name = hf_tensor_name(t.name)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        if t.tensor_type == GGMLQuantizationType.F32:
            w = np.asarray(t.data, dtype=np.float32)
        else:
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = w.reshape(shape)
        if t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias"):
            w = unpermute(w, heads)
        elif t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias"):
            w = unpermute(w, kv_heads)
        out[name] = np.ascontiguousarray(w)
    return out


def build_tokenizer(reader) -> tuple[dict, dict, dict]:
    """(tokenizer.json, tokenizer_config.json, special_tokens_map.json) for a
    byte-level BPE ("gpt2") GGUF vocabulary."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ConversionError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2')")
    pre = _field(reader, "tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_TOKENIZERS:
        raise ConversionError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {', '.join(_PRE_TOKENIZERS)}")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    merges: list[str] = list(_field(reader, "tokenizer.ggml.merges") or [])
    f = reader.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": typ == _TOKEN_CONTROL}
             for i, (tok, typ) in enumerate(zip(tokens, types)) if typ in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)]
    tokenizer_json = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": _PRE_TOKENIZERS[pre],
        # ByteLevel post-processing adds no special token: this family has no BOS on encode.
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                           "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }

    def token(key: str) -> str | None:
        i = _field(reader, f"tokenizer.ggml.{key}")
        return None if i is None else tokens[int(i)]

    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:
        raise ConversionError("GGUF asks for BOS/EOS on encode; this converter only writes ByteLevel "
                              "post-processing (no special tokens added)")
    special = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
               "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
    special = {k: v for k, v in special.items() if v is not None}
    chat_template = _field(reader, "tokenizer.chat_template")
    tokenizer_config = {
        # No add_bos_token / add_eos_token keys: tokenizer.json's post-processor decides, as in the original.
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length", 4096)),
        # Not GPT2Tokenizer: transformers 5 rebuilds a named class's pre-tokenizer from
        # code (dropping the digit split); this class reads tokenizer.json as it is.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
    }
    if chat_template:
        tokenizer_config["chat_template"] = chat_template
    return tokenizer_json, tokenizer_config, special


def convert(gguf_path: str | Path, out_dir: str | Path, progress: Callable | None = None,
            extra_config: dict | None = None) -> Path:
    """Write the Hugging Face folder for `gguf_path` into `out_dir` (created)."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(str(gguf_path))
    config = read_config(reader)
    tokenizer_json, tokenizer_config, special = build_tokenizer(reader)
    state = convert_tensors(reader, config, progress)
    if config["tie_word_embeddings"]:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config.update(extra_config or {})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False) + "\n")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2, ensure_ascii=False) + "\n")
    return out_dir
