"""The machine a benchmark ran on, recorded beside its numbers."""
from __future__ import annotations

import os
import platform

import torch


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "load_avg_1m": os.getloadavg()[0]}
