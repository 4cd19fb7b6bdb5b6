"""GGUF -> Hugging Face folder (kvpop/models/gguf_convert.py) on a tiny seeded Llama
written as llama.cpp writes one: q/k rows permuted for its RoPE, ggml shape
order, the token embedding in Q8_0, byte-level BPE tokenizer metadata and a
chat template. No network: the real file is covered by tests/integration/test_smollm2.py.

Checks: our converted weights equal the original model's (the Q8_0 tensor
equals its quantize/dequantize round trip), equal transformers' own GGUF
conversion of the same file (so the file is written the llama.cpp way), and
our model on the converted folder gives the original model's logits.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers.models import hf_logits, make_hf_model
from kvpop.models.default_model import byte_to_unicode
from kvpop.models.gguf_convert import ConversionError, convert, hf_tensor_name, unpermute
from services.compute.model.loader import load_model
from services.compute.model.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_LAYER[module]}.{kind}"


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def write_gguf(path, hf, tied: bool) -> dict[str, np.ndarray]:
    """The model as llama.cpp would store it; returns the weights the file really holds (HF layout)."""
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    tokens = SPECIALS + [byte_to_unicode()[b] for b in range(256)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * 256)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    held = {}
    for name, t in hf.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        a = t.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name(name), q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            held[name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(a.shape)
            continue
        held[name] = a
        if name.endswith("q_proj.weight"):
            a = llama_cpp_permute(a, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = llama_cpp_permute(a, cfg.num_key_value_heads)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


@pytest.fixture(scope="module", params=["untied", "tied"])
def converted(request, tmp_path_factory):
    tied = request.param == "tied"
    hf = make_hf_model("llama", seed=3, vocab_size=259, hidden_size=64, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=tied, rope_theta=50000.0)
    assert _rope_theta(hf.config) == 50000.0
    d = tmp_path_factory.mktemp(request.param)
    held = write_gguf(d / "tiny.gguf", hf, tied)
    out = convert(d / "tiny.gguf", d / "hf")
    return hf, held, d, out, tied


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8 * 6, 3)
    for heads in (1, 2, 3, 6):
        assert np.array_equal(unpermute(llama_cpp_permute(w, heads), heads), w)
    assert not np.array_equal(llama_cpp_permute(w, 2), w)


def test_config_and_files(converted):
    hf, _, _, out, tied = converted
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] == tied
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["rope_theta"] == 50000.0 and cfg["rms_norm_eps"] == 1e-5 and cfg["vocab_size"] == 259
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHATML and tok_cfg["eos_token"] == "<|im_end|>"
    assert "add_bos_token" not in tok_cfg


def test_weights_round_trip(converted):
    _, held, _, out, tied = converted
    from safetensors.numpy import load_file

    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(held)
    for name, a in held.items():
        assert np.array_equal(got[name], a), name


def test_transformers_reads_the_file_the_same_way(converted):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    _, _, d, out, _ = converted
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(d), gguf_file="tiny.gguf", dtype=torch.float32)
    ours = load_model(out).state_dict()
    for name, t in ref.state_dict().items():
        assert torch.equal(ours[name], t), name


@torch.inference_mode()
def test_logits_match_the_original_model(converted):
    hf, held, _, out, _ = converted
    with torch.no_grad():
        hf.model.embed_tokens.weight.copy_(torch.from_numpy(held["model.embed_tokens.weight"]))
    ids = torch.randint(3, 259, (2, 24), generator=torch.Generator().manual_seed(1))
    got = load_model(out).forward_dense(ids)
    assert (got - hf_logits(hf, ids)).abs().max().item() <= 1e-4


def test_tokenizer(converted):
    _, _, _, out, _ = converted
    tok = Tokenizer(out)
    text = "hi 2024 <|im_end|> é"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and 2 not in ids and tok.prefix_ids == []
    # digits are split one by one (the "smollm" pre-tokenizer), bytes are tokens 3 + b
    assert ids[3:7] == [3 + ord(c) for c in "2024"]
    chat = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert chat[0] == 1 and chat.count(2) == 1 and tok.decode(chat) == "user\nhi\nassistant\n"


def test_unknown_tensor_name():
    with pytest.raises(ConversionError, match="no Llama counterpart"):
        hf_tensor_name("blk.0.ssm_conv1d.weight")
