"""Per-sequence scoring state: every block of a sequence the cache-manager has
seen features for, kept in growing arrays (amortised appends, no restacking
per plan) so a policy scores all of them in one array op.

State lives as long as the sequence (dropped on SequenceFinished or when the
compute stream that sent it ends), so scores can depend on the whole history
(delayed, stateful scoring)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class BlockRecord:
    block: int
    position: int
    age: int
    key_mean: np.ndarray    # [L, Hkv, d]
    value_norm: np.ndarray  # [L, Hkv]
    attention: np.ndarray   # [L, Hkv]
    reach: np.ndarray | None = None   # [L, Hkv] (None: zeros, e.g. from a compute that does not send it)

    def __post_init__(self):
        if self.reach is None or np.size(self.reach) == 0:
            self.reach = np.zeros(np.shape(self.value_norm), np.float32)


_FIELDS = ("key_mean", "value_norm", "attention", "reach")


class SequenceState:
    def __init__(self, request_id: str):
        self.request_id = request_id
        self.n = 0
        self._row: dict[int, int] = {}          # block number -> row
        self._data: dict[str, np.ndarray] = {}
        self.revision = 0                       # bumped when a known block's features are replaced
        self.cache: dict = {}                   # a policy's per-sequence memo (the estimator's hidden states)
        self.prompt_tokens = 0                  # the prompt's length, as compute says (0 = unknown)

    def _grow(self, rec: BlockRecord, need: int = 0) -> None:
        cap = max(16, 2 * self.n, need)
        new = {"block": np.zeros(cap, np.int32), "position": np.zeros(cap, np.int64),
               "age": np.zeros(cap, np.float32)}
        for f in _FIELDS:
            new[f] = np.zeros((cap, *getattr(rec, f).shape), np.float32)
        new["gone"] = np.zeros((cap, *rec.value_norm.shape), bool)
        for k, v in self._data.items():
            new[k][: self.n] = v[: self.n]
        self._data = new

    def add_many(self, a: dict[str, np.ndarray]) -> None:
        """Blocks as arrays (block, position, age [k]; key_mean [k, L, Hkv, d];
        value_norm, attention, reach [k, L, Hkv]), in one copy per field when
        they are all new and follow the known ones (a features batch); block by
        block otherwise (features sent again replace the earlier ones)."""
        blocks = np.asarray(a["block"])
        k = len(blocks)
        if not k:
            return
        if self.n and (int(blocks.min()) <= int(self._data["block"][: self.n].max()) or len(set(blocks.tolist())) < k):
            for j in range(k):
                self.add(BlockRecord(int(blocks[j]), int(a["position"][j]), int(a["age"][j]),
                                     *(np.asarray(a[f][j]) for f in _FIELDS)))
            return
        first = BlockRecord(int(blocks[0]), int(a["position"][0]), int(a["age"][0]), *(np.asarray(a[f][0]) for f in _FIELDS))
        if self._data:
            for f in _FIELDS:
                if getattr(first, f).shape != self._data[f].shape[1:]:
                    raise ValueError(f"block {first.block}: {f} shape {getattr(first, f).shape} differs from "
                                     f"earlier blocks of {self.request_id} {self._data[f].shape[1:]}")
        while not self._data or self.n + k > len(self._data["block"]):
            self._grow(first, self.n + k)
        d, lo, hi = self._data, self.n, self.n + k
        d["block"][lo:hi], d["position"][lo:hi], d["age"][lo:hi] = blocks, a["position"], a["age"]
        for f in _FIELDS:
            d[f][lo:hi] = a[f]
        self._row.update(zip(blocks.tolist(), range(lo, hi)))
        self.n = hi

    def add(self, rec: BlockRecord) -> None:
        if self._data:
            for f in _FIELDS:
                if getattr(rec, f).shape != self._data[f].shape[1:]:
                    raise ValueError(f"block {rec.block}: {f} shape {getattr(rec, f).shape} differs from "
                                     f"earlier blocks of {self.request_id} {self._data[f].shape[1:]}")
        # A block sent again (re-scored later) replaces its earlier features.
        row = self._row.get(rec.block)
        if row is None:
            if not self._data or self.n == len(self._data["block"]):
                self._grow(rec)
            row = self._row[rec.block] = self.n
            self.n += 1
        else:
            self.revision += 1
        d = self._data
        d["block"][row], d["position"][row], d["age"][row] = rec.block, rec.position, rec.age
        for f in _FIELDS:
            d[f][row] = getattr(rec, f)

    def mark_gone(self, names: np.ndarray) -> None:
        """names [L, Hkv, k]: blocks compute's rows evicted (-1 pads; unknown numbers are ignored)."""
        if not self._data or names.size == 0:
            return
        gone = self._data["gone"]
        if names.ndim != 3 or names.shape[:2] != gone.shape[1:]:
            raise ValueError(f"gone has shape {names.shape}, expected [L, Hkv, k] with (L, Hkv) {gone.shape[1:]}")
        uniq, inv = np.unique(names, return_inverse=True)
        rows = np.array([self._row.get(int(b), -1) for b in uniq])[inv].reshape(names.shape)
        l, h, j = np.nonzero(rows >= 0)
        gone[rows[l, h, j], l, h] = True

    def __len__(self) -> int:
        return self.n

    @property
    def block_size(self) -> int:
        """Tokens per block, from the newest block's position (0 = unknown: only block 0 seen)."""
        if not self.n:
            return 0
        block = int(self._data["block"][self.n - 1])
        return int(self._data["position"][self.n - 1]) // block if block > 0 else 0

    def arrays(self) -> dict[str, np.ndarray]:
        """Views of the first n rows, in arrival order: block [n], position [n], age [n],
        key_mean [n, L, Hkv, d], value_norm / attention / reach [n, L, Hkv], gone [n, L, Hkv]."""
        return {k: v[: self.n] for k, v in self._data.items()}


class ScoringState:
    def __init__(self) -> None:
        self.sequences: dict[str, SequenceState] = {}

    def get(self, request_id: str) -> SequenceState:
        seq = self.sequences.get(request_id)
        if seq is None:
            seq = self.sequences[request_id] = SequenceState(request_id)
        return seq

    def drop(self, request_id: str) -> None:
        self.sequences.pop(request_id, None)
