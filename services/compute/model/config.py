"""ModelConfig: the few fields of a Hugging Face config.json that the forward
pass needs, normalised across Llama, Qwen2 and Mistral and across the old
(`rope_theta` + `rope_scaling`) and new (`rope_parameters`) rope layouts."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "mistral")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_ARCH_FROM_CLASS = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"
    # Mistral's window; the engine's attention callback decides what to do with it.
    sliding_window: int | None = None
    # Anything else from config.json (e.g. "kvpop_placeholder"), kept for round trips.
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict) -> "ModelConfig":
        if isinstance(path_or_dict, dict):
            d = dict(path_or_dict)
        else:
            p = Path(path_or_dict)
            if p.is_dir():
                p = p / "config.json"
            if not p.is_file():
                raise ValueError(f"model config not found: {p}")
            try:
                d = json.loads(p.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{p} is not valid JSON: {e}") from e
        arch = d.get("model_type")
        if arch is None:
            for name in d.get("architectures") or []:
                arch = _ARCH_FROM_CLASS.get(name)
                if arch:
                    break
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch or d.get('architectures')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is implemented")
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported")
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            num_layers = int(d["num_hidden_layers"])
            vocab, inter = int(d["vocab_size"]), int(d["intermediate_size"])
        except KeyError as e:
            raise ValueError(f"config.json is missing required field {e.args[0]!r}") from None
        rope_theta, rope_scaling = _rope_fields(d)
        known = {
            "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
            "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
            "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id", "torch_dtype", "dtype",
            "sliding_window", "use_sliding_window", "hidden_act", "mlp_bias",
        }
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and no config flag for it.
            attention_bias=True if arch == "qwen2" else bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            sliding_window=(d.get("sliding_window") if (arch == "mistral" or d.get("use_sliding_window")) else None),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json that both this loader and transformers read."""
        cls_name = {v: k for k, v in _ARCH_FROM_CLASS.items()}[self.architecture]
        d: dict[str, Any] = dict(self.extra)
        rope_parameters = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        rope_parameters.pop("type", None)
        d.update({
            "architectures": [cls_name],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            # Both layouts, so old and new transformers read the same rope.
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
            "hidden_act": "silu",
        })
        if self.architecture != "qwen2":
            d["attention_bias"] = self.attention_bias
        if self.architecture == "mistral":
            d["sliding_window"] = self.sliding_window
        return d

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rope_fields(d: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either config layout."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(d.get("rope_theta", 10000.0))
        scaling = dict(d["rope_scaling"]) if d.get("rope_scaling") else None
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            return theta, None
        scaling = {"rope_type": rope_type, **{k: v for k, v in scaling.items() if k not in ("type", "rope_type")}}
    return theta, scaling
