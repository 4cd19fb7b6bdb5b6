"""load_model / save_model: clear errors on bad folders, and our saved
checkpoints load in transformers with the same logits."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.models import hf_logits, save_hf_model
from kvpop.models.default_model import build_placeholder, is_placeholder
from kvpop.runtime.paths import DEFAULT_MODEL_DIR
from services.compute.model.loader import load_model, save_model
from services.compute.model.config import ModelConfig


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_hf_model(path, "llama", seed=5)
    return path


def broken_copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="model folder not found"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match="config not found"):
        load_model(tmp_path)


def test_missing_weights(hf_dir, tmp_path):
    d = broken_copy(hf_dir, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_model(d)


def test_unsupported_architecture(hf_dir, tmp_path):
    d = broken_copy(hf_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"], cfg["architectures"] = "gpt2", ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(d)


def test_unsupported_rope_and_activation():
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        ModelConfig.from_hf({k: v for k, v in base.items() if k != "hidden_size"})


def test_corrupt_config(hf_dir, tmp_path):
    d = broken_copy(hf_dir, tmp_path)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(d)


def test_missing_tensor(hf_dir, tmp_path):
    d = broken_copy(hf_dir, tmp_path)
    state = load_file(d / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, d / "model.safetensors")
    with pytest.raises(ValueError, match="weights missing.*model.layers.1.mlp.up_proj.weight"):
        load_model(d)


def test_wrong_shape(hf_dir, tmp_path):
    d = broken_copy(hf_dir, tmp_path)
    state = load_file(d / "model.safetensors")
    state["model.norm.weight"] = torch.ones(3)
    save_file(state, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\)"):
        load_model(d)


def test_missing_shard(tmp_path):
    save_hf_model(tmp_path, "llama", seed=1, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(ValueError, match="shards listed in model.safetensors.index.json are missing"):
        load_model(tmp_path)


def test_bad_dtype(hf_dir):
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        load_model(hf_dir, dtype="int8")


def test_auto_dtype_follows_config(tmp_path):
    placeholder = build_placeholder(tmp_path / "p")
    assert load_model(placeholder, dtype="auto").dtype == torch.bfloat16
    assert load_model(placeholder, dtype="float32").dtype == torch.float32


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "rope_scaling": {
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    ("qwen2", {}),
    ("mistral", {}),
])
@torch.inference_mode()
def test_save_model_loads_in_transformers(arch, overrides, tmp_path):
    """HF -> load_model -> save_model -> transformers and -> load_model: same logits."""
    import transformers

    save_hf_model(tmp_path / "hf", arch, seed=2, **overrides)
    ours = load_model(tmp_path / "hf")
    save_model(ours, tmp_path / "ours")
    ids = torch.randint(0, ours.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = ours.forward_dense(ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32).eval()
    assert type(hf).__name__.lower().startswith(arch)
    assert (hf_logits(hf, ids) - expected).abs().max().item() <= 1e-4
    again = load_model(tmp_path / "ours")
    assert again.config.tie_word_embeddings == ours.config.tie_word_embeddings
    assert again.config.rope_scaling == ours.config.rope_scaling
    assert torch.equal(again.forward_dense(ids), expected)


def test_placeholder_builder(tmp_path):
    out = build_placeholder(tmp_path / "p", seed=3)
    assert is_placeholder(out)
    assert "RANDOM WEIGHTS" in (out / "MODEL_CARD.md").read_text()
    size = sum(f.stat().st_size for f in out.iterdir())
    assert size < 25 * 2**20
    model = load_model(out)
    assert model.config.architecture == "llama" and model.config.max_position_embeddings == 4096
    # Seeded: same seed, same weights; another seed, different weights.
    again = load_model(build_placeholder(tmp_path / "q", seed=3))
    other = load_model(build_placeholder(tmp_path / "r", seed=4))
    w = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(w, again.model.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(w, other.model.layers[0].self_attn.q_proj.weight)
    # save_model never carries the placeholder marker over to another model.
    save_model(model, tmp_path / "saved")
    assert not is_placeholder(tmp_path / "saved")
    # Saving a (trained) model over the placeholder drops the random-weights card.
    save_model(model, out)
    assert not is_placeholder(out) and not (out / "MODEL_CARD.md").exists()


def test_default_model_loads():
    """Whatever sits in models/default (placeholder or trained) is servable."""
    model = load_model(DEFAULT_MODEL_DIR)
    ids = torch.tensor([[1, 50, 60, 70]])
    with torch.inference_mode():
        logits = model.forward_dense(ids)
    assert logits.shape == (1, 4, model.config.vocab_size) and torch.isfinite(logits).all()


def test_config_layouts_agree():
    """Pre-v5 transformers configs (rope_theta + rope_scaling, torch_dtype) and
    v5 ones (rope_parameters, dtype) give the same ModelConfig."""
    base = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    old = ModelConfig.from_hf({**base, "rope_theta": 5e5, "torch_dtype": "bfloat16",
                               "rope_scaling": {"type": "llama3", **scaling}})
    new = ModelConfig.from_hf({**base, "dtype": "bfloat16",
                               "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert old == new
    assert old.rope_theta == 5e5 and old.rope_scaling["rope_type"] == "llama3"
    assert ModelConfig.from_hf(old.to_hf()) == old
    default = ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    assert default.rope_scaling is None and default.head_dim == 4 and default.architecture == "llama"


def test_resolve_device():
    import torch

    from services.compute.model.loader import resolve_device
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():      # a CUDA device this torch cannot reach: one clear line
        with pytest.raises(ValueError, match="sees no CUDA device"):
            resolve_device("cuda:0")
