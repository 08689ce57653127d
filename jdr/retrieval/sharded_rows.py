"""An encoding's shards read as one [N, D] matrix, memory-mapped, never concatenated.

`jdr.encode` writes a corpus's vectors as shards (`emb-NNNNN.npy`); at MS MARCO's size (8.8M x 768 float32,
27 GB) concatenating them into one array doubles the host memory an index or a device placement needs, and
exceeds it. `ShardedRows` maps each shard and answers what the matrix's users ask of it: its shape, a slice
of consecutive rows (`put_corpus` places a chunk at a time), rows by index (`HostVectors`, a batch's
candidates), and the shards themselves (`exact_top_rows` searches shard by shard and merges). `np.asarray`
of it is the one explicit whole copy, for callers that need one.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class ShardedRows:
  """Row-wise concatenation of 2-D arrays (typically memory-mapped shards) with the same width and dtype."""

  ndim = 2

  def __init__(self, shards: Sequence[np.ndarray]):
    shards = [s for s in shards if len(s)] or list(shards[:1])
    if not shards:
      raise ValueError("ShardedRows needs at least one shard")
    widths = {s.shape[1] for s in shards}
    dtypes = {np.dtype(s.dtype) for s in shards}
    if len(widths) != 1 or len(dtypes) != 1 or any(s.ndim != 2 for s in shards):
      raise ValueError(f"shards must be 2-D with one width and dtype, got shapes "
                       f"{[s.shape for s in shards][:4]} and dtypes {sorted(map(str, dtypes))}")
    self.shards = list(shards)
    self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in shards])]).astype(np.int64)
    self.shape = (int(self.offsets[-1]), widths.pop())
    self.dtype = dtypes.pop()

  def __len__(self) -> int:
    return self.shape[0]

  @property
  def nbytes(self) -> int:
    return self.shape[0] * self.shape[1] * self.dtype.itemsize

  def __array__(self, dtype=None, copy=None):  # the explicit whole copy
    out = np.concatenate(self.shards)
    return out if dtype is None else out.astype(dtype)

  def __getitem__(self, key):
    if isinstance(key, tuple):
      rows, rest = key[0], key[1:]
      return self[rows][(slice(None), *rest)] if not np.isscalar(rows) else self[rows][rest]
    if isinstance(key, slice):
      lo, hi, step = key.indices(len(self))
      if step != 1:
        return self[np.arange(lo, hi, step)]
      return self._range(lo, max(lo, hi))
    if np.isscalar(key):
      row = range(len(self))[int(key)]
      shard = int(np.searchsorted(self.offsets, row, "right")) - 1
      return self.shards[shard][row - self.offsets[shard]]
    rows = np.asarray(key)
    if rows.dtype == bool:
      rows = np.nonzero(rows)[0]
    flat = rows.reshape(-1).astype(np.int64)
    flat = np.where(flat < 0, flat + len(self), flat)
    if len(flat) and (flat.min() < 0 or flat.max() >= len(self)):
      raise IndexError(f"row index out of range for {len(self)} rows")
    out = np.empty((len(flat), self.shape[1]), self.dtype)
    shard_of = np.searchsorted(self.offsets, flat, "right") - 1
    for shard in np.unique(shard_of):
      where = np.nonzero(shard_of == shard)[0]
      out[where] = self.shards[shard][flat[where] - self.offsets[shard]]
    return out.reshape(*rows.shape, self.shape[1])

  def _range(self, lo: int, hi: int) -> np.ndarray:
    first = int(np.searchsorted(self.offsets, lo, "right")) - 1
    if first < len(self.shards) and hi <= self.offsets[first + 1]:  # within one shard: a view of its map
      return self.shards[first][lo - self.offsets[first]:hi - self.offsets[first]]
    parts = []
    for shard in range(max(first, 0), len(self.shards)):
      start, end = self.offsets[shard], self.offsets[shard + 1]
      if start >= hi:
        break
      parts.append(self.shards[shard][max(lo, start) - start:min(hi, end) - start])
    return np.concatenate(parts) if parts else np.empty((0, self.shape[1]), self.dtype)

  def pieces(self) -> list[tuple[int, np.ndarray]]:
    """(first row, shard) of every shard: what a search that takes one contiguous matrix at a time walks."""
    return [(int(self.offsets[i]), s) for i, s in enumerate(self.shards)]


def pieces(matrix) -> list[tuple[int, np.ndarray]]:
  """(first row, contiguous block) pieces of any [N, D] matrix: its shards, or itself whole."""
  if isinstance(matrix, ShardedRows):
    return matrix.pieces()
  return [(0, matrix)]
