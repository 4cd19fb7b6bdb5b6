"""Load and save TransformerModel in the Hugging Face folder layout:
config.json + model.safetensors, or shards listed in model.safetensors.index.json."""
from __future__ import annotations

import contextlib
import json
import shutil
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from safetensors.torch import save_file

from services.compute.model.model import TransformerModel
from services.compute.model.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def resolve_device(device: str) -> str:
    """'auto' -> cuda when torch sees a CUDA device, else cpu. ValueError for a
    CUDA device this torch cannot see (a CPU build, or no GPU)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this torch sees no CUDA device")
    return device


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = config.torch_dtype if dtype == "auto" else dtype
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (resolved {name!r}); use one of {', '.join(DTYPES)} or 'auto'")
    return DTYPES[name]


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{model_dir}: shards listed in {INDEX_FILE} are missing: {', '.join(missing)}")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise ValueError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} found (only .safetensors weights are supported)")


_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def _no_param_init():
    """nn.Linear and nn.Embedding skip reset_parameters inside the block (their weights get loaded)."""
    with _INIT_LOCK:
        saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
        nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
        try:
            yield
        finally:
            nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu") -> TransformerModel:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ValueError(f"model folder not found: {model_dir}")
    config = ModelConfig.from_hf(model_dir)
    torch_dtype = resolve_dtype(dtype, config)
    files = weight_files(model_dir)
    # Build on the meta device with no init at all: random init of weights we overwrite
    # wastes time, and even on meta it imports sympy/dynamo (seconds at every start).
    with torch.device("meta"), _no_param_init():
        model = TransformerModel(config)
    expected = dict(model.state_dict(keep_vars=True))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                if name not in expected:
                    if name.endswith("rotary_emb.inv_freq"):
                        continue  # old HF checkpoints saved this derived buffer
                    raise ValueError(f"{f.name}: unexpected tensor {name!r} for a {config.architecture} model")
                t = fh.get_tensor(name)
                if tuple(t.shape) != tuple(expected[name].shape):
                    raise ValueError(f"{f.name}: {name} has shape {tuple(t.shape)}, config implies {tuple(expected[name].shape)}")
                state[name] = t.to(device=device, dtype=torch_dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied: the embedding is the head
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{model_dir}: weights missing from checkpoint: {', '.join(missing[:5])}{more}")
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def save_model(model: TransformerModel, model_dir: str | Path, tokenizer_json_path: str | Path | None = None) -> Path:
    """HF layout; transformers' AutoModelForCausalLM.from_pretrained reads it."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; HF drops it too
    if _was_placeholder(model_dir / "config.json"):
        # Overwriting the random placeholder: its card ("RANDOM WEIGHTS") would now lie.
        (model_dir / "MODEL_CARD.md").unlink(missing_ok=True)
    hf = cfg.to_hf()
    hf["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    # Whatever we save is, by construction, not the untouched random placeholder
    # (kvpop.models.default_model re-adds the marker after saving it).
    hf.pop("kvpop_placeholder", None)
    hf.pop("kvpop_placeholder_seed", None)
    (model_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (model_dir / INDEX_FILE).unlink(missing_ok=True)  # a stale index would shadow the new single file
    save_file(state, str(model_dir / SINGLE_FILE), metadata={"format": "pt"})
    if tokenizer_json_path is not None and Path(tokenizer_json_path).resolve() != (model_dir / "tokenizer.json").resolve():
        shutil.copyfile(tokenizer_json_path, model_dir / "tokenizer.json")
    return model_dir


def _was_placeholder(config_path: Path) -> bool:
    try:
        return bool(json.loads(config_path.read_text()).get("kvpop_placeholder"))
    except (OSError, ValueError, AttributeError):
        return False
