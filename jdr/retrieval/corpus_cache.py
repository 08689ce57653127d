"""Corpus vectors kept on disk under a name for everything that made them, so a run that encodes a corpus
with a document side some earlier run already encoded it with reads the vectors instead.

Where it pays: a frozen or unchanged document side is encoded again and again across runs. Every run that
starts from the same model evaluates it before training; a fine-tuned model's last evaluation encodes the
corpus its scoring, its successor's static negatives (STAR) and its successor's fixed index (ADORE) encode
again. On a CPU each of those is minutes.

The name is a digest of: the document side's weights (the shared tower, or the document tower), its settings
(`TowerConfig`, pooling and normalization included), the corpus's token ids at the encoding length, the
batching (tokens per batch, rows multiple) and the JAX backend and version; a change in any of them is a new
entry, never a stale one. Each entry is the corpus's float32 [N, D] matrix as .npy, written atomically; the
folder keeps the `KEPT` entries used last.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
from typing import Sequence

import jax
import numpy as np

from jdr.runtime import atomic
from jdr.runtime import paths

# Entries the folder keeps (the least recently used go first): enough for a fine-tuning run's evaluations
# (one an interval) to leave its starting model's and its last ones in place until the next run reads them.
KEPT = 16


def doc_side(params) -> dict:
  """The params a TwoTower encodes documents with: its one shared tower, or its document tower."""
  return params["tower"] if "tower" in params else params["doc_tower"]


def weights_digest(params) -> str:
  """sha1 over the leaves (in tree order) with their shapes and dtypes; boxed and plain trees agree."""
  digest = hashlib.sha1()
  for leaf in jax.tree_util.tree_leaves(params):
    array = np.asarray(jax.device_get(leaf))
    digest.update(f"{array.shape}{array.dtype}".encode())
    digest.update(np.ascontiguousarray(array).tobytes())
  return digest.hexdigest()


def tokens_digest(token_ids: Sequence[np.ndarray]) -> str:
  digest = hashlib.sha1()
  for ids in token_ids:
    digest.update(len(ids).to_bytes(4, "little"))
    digest.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
  return digest.hexdigest()


def entry_name(*, doc_weights: str, tower: str, tokens: str, batching: str) -> str:
  parts = [doc_weights, tower, tokens, batching, jax.default_backend(), jax.__version__]
  return hashlib.sha1("\n".join(parts).encode()).hexdigest()


class CorpusCache:
  """A folder of corpus encodings by entry name (see the module docstring)."""

  def __init__(self, folder: str | os.PathLike, kept: int = KEPT):
    if not paths.is_local(folder):
      raise ValueError(f"eval.corpus_cache={folder}: the corpus cache is a local folder (it is read and "
                       "pruned by file times)")
    self.folder, self.kept = paths.local(folder), kept

  def _path(self, name: str) -> pathlib.Path:
    return self.folder / f"{name}.npy"

  def get(self, name: str) -> np.ndarray | None:
    path = self._path(name)
    try:
      array = np.load(path)
      os.utime(path)  # used now: the last to be dropped
    except (FileNotFoundError, ValueError, EOFError):  # absent, pruned meanwhile, or cut short by a crash
      return None
    return array

  def put(self, name: str, array: np.ndarray) -> None:
    atomic.write_atomic(self._path(name), lambda f: np.save(f, np.asarray(array, np.float32)))
    used = {}
    for entry in self.folder.glob("*.npy"):
      try:
        used[entry] = entry.stat().st_mtime
      except FileNotFoundError:  # pruned by another writer meanwhile (ANCE's refresh encodes in a thread)
        pass
    for old in sorted(used, key=used.get)[:max(0, len(used) - self.kept)]:
      old.unlink(missing_ok=True)
