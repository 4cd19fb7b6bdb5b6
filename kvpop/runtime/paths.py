"""Well-known locations inside the repository checkout."""
from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MODELS_DIR = REPO_ROOT / "models"
# The embedded default model (HF layout). Placeholder random weights until
# `kvpop train-model` writes the trained model here.
DEFAULT_MODEL_DIR = MODELS_DIR / "default"
