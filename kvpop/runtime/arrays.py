"""numpy <-> the packed FloatArray / IntArray messages of cache_manager.proto
(row-major little-endian bytes plus a shape: no per-element protobuf cost)."""
from __future__ import annotations

import numpy as np

from kvpop.runtime.pb import cache_manager_pb2 as pb


def to_float_array(a) -> pb.FloatArray:
    a = np.ascontiguousarray(np.asarray(a, dtype="<f4"))
    return pb.FloatArray(shape=list(a.shape), data=a.tobytes())


def to_int_array(a) -> pb.IntArray:
    a = np.ascontiguousarray(np.asarray(a, dtype="<i4"))
    return pb.IntArray(shape=list(a.shape), data=a.tobytes())


def _decode(msg, dtype: str) -> np.ndarray:
    shape = tuple(int(s) for s in msg.shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    n = int(np.prod(shape)) if shape else 1
    if len(msg.data) != 4 * n:
        raise ValueError(f"{len(msg.data)} bytes do not fit shape {shape}")
    return np.frombuffer(msg.data, dtype=dtype).reshape(shape)


def from_float_array(msg: pb.FloatArray) -> np.ndarray:
    return _decode(msg, "<f4")


def from_int_array(msg: pb.IntArray) -> np.ndarray:
    return _decode(msg, "<i4")
