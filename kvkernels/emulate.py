"""Run the CUDA kernel sources on the CPU, for machines without a GPU.

`with emulated(): cuda.paged_attention(...)` compiles each kernel module with
g++ against csrc/host_emu.h (one coroutine per CUDA thread, warps synchronised
at shuffles) and routes kvkernels/cuda.py's launches there, with CPU tensors.
Everything else in kvkernels/cuda.py (configuration, splits, scratch buffers,
argument packing) is the code that runs on a GPU. Slow; for tests only.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import torch

from kvkernels import cuda

_HEADER = Path(__file__).with_name("csrc") / "host_emu.h"
_CTYPES = {"int": ctypes.c_int, "long long": ctypes.c_longlong, "float": ctypes.c_float}
_KERNEL = re.compile(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s*(\w+)\(([^)]*)\)')


def available() -> bool:
    return shutil.which("g++") is not None


def _host_source(kind: str, defines: tuple) -> tuple[str, dict]:
    src = cuda.source(kind, **dict(defines))
    # The only device-specific statements: fp16 conversions and dynamic shared memory.
    src = src.replace('asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));', "f = emu_h2f(x);")
    src = src.replace('asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));', "h = emu_f2h(f);")
    src = re.sub(r"extern __shared__ float (\w+)\[\];", r"float* \1 = (float*)emu_smem;", src)
    sigs = {m.group(1): [" ".join(p.split()) for p in m.group(2).split(",")]
            for m in _KERNEL.finditer(src)}
    wrappers = []
    for name, params in sigs.items():
        names = ", ".join(p.split()[-1].lstrip("*") for p in params)
        wrappers.append(f'extern "C" void emu_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
                        f'unsigned long sm, {", ".join(params)}) {{ emu_launch(dim3{{gx, gy, gz}}, '
                        f'dim3{{bx, 1, 1}}, sm, [=] {{ {name}({names}); }}); }}')
    return _HEADER.read_text() + src + "\n" + "\n".join(wrappers) + "\n", sigs


@functools.cache
def _library(kind: str, defines: tuple):
    code, sigs = _host_source(kind, defines)
    build = Path(tempfile.gettempdir()) / "kvpop-kernel-emu"
    build.mkdir(exist_ok=True)
    so = build / f"{kind}_{hashlib.sha1(code.encode()).hexdigest()[:16]}.so"
    if not so.exists():
        cpp = so.with_suffix(".cpp")
        cpp.write_text(code)
        tmp = so.with_suffix(".so.tmp")
        r = subprocess.run(["g++", "-O1", "-std=c++20", "-shared", "-fPIC", "-w", str(cpp), "-o", str(tmp)],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"host build of {kind} {dict(defines)} failed:\n{r.stderr[:4000]}")
        tmp.replace(so)  # atomic: parallel test processes never load a half-written library
    return ctypes.CDLL(str(so)), sigs


def _launch(kind, defines, name, device, grid, block, args, shared_mem) -> None:
    lib, sigs = _library(kind, defines)
    params = sigs[name]
    if len(params) != len(args):
        raise TypeError(f"{name} takes {len(params)} arguments, launched with {len(args)}")
    grid = tuple(grid) + (1,) * (3 - len(grid))
    cargs = [ctypes.c_uint(g) for g in grid] + [ctypes.c_uint(block[0]), ctypes.c_ulong(shared_mem)]
    for p, a in zip(params, args):
        if "*" in p:
            if type(a) is not np.uint64:
                raise TypeError(f"{name}: pointer parameter {p!r} got {type(a).__name__}")
            cargs.append(ctypes.c_void_p(int(a)))
        else:
            ctype = _CTYPES[p.rsplit(" ", 1)[0]]
            if np.dtype(type(a)).itemsize != ctypes.sizeof(ctype):
                raise TypeError(f"{name}: parameter {p!r} got {type(a).__name__}")
            cargs.append(ctype(a.item()))
    getattr(lib, f"emu_{name}")(*cargs)


@contextlib.contextmanager
def emulated(sm_count: int = 8):
    """Route kvkernels/cuda.py launches to the host build; `sm_count` stands in
    for the GPU's multiprocessor count (it decides the attention splits)."""
    saved = cuda._launcher, cuda.sm_count
    cuda._launcher, cuda.sm_count = _launch, lambda device: sm_count
    try:
        with torch.no_grad():
            yield
    finally:
        cuda._launcher, cuda.sm_count = saved
