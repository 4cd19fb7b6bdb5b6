"""The standard library's own .py files, in a fixed order: the docstrings and
code sources read them. Tests, demos, GUI tools and pydoc_data (the held-out
`reference` source) are left out."""
from __future__ import annotations

import sysconfig
from functools import lru_cache
from pathlib import Path

_SKIP = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "site-packages",
         "pydoc_data", "__pycache__", "venv", "distutils", "config-3", "encodings"}
MAX_FILES = 200       # enough text for any prompt; reading every file would cost seconds per process


@lru_cache(maxsize=1)
def files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(part in _SKIP or part.startswith("config-") for part in rel):
            continue
        found.append(p)
    if not found:
        raise OSError(f"no standard-library sources under {root}")
    return found[:MAX_FILES]
