"""Searching a corpus matrix held on the host, by corpus row (no ids, no Python object per passage): exactly
(`exact_top_rows`: faiss.knn over the vectors where they lie, or the devices' sharded top-k), or through a Faiss
index of the vectors' codes (`HostIndex`, which also decodes the candidates' vectors for a step that scores
against what the index serves). Evaluation, the dense miners, ANCE's refresh and ADORE / LTRe's fixed index all
search here; jdr.retrieval.index's retrievers serve ids to the command lines.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from jdr.retrieval import sharded_rows
from jdr.retrieval import topk


def is_flat(factory: str) -> bool:
  return factory.strip().lower() == "flat"


class HostVectors:
  """float32 vectors of corpus rows, read on the host a batch at a time (zeros for row -1): the stored matrix
  itself (memory-mapped, not copied), or a compressed index's reconstruction decoded from its codes."""

  def __init__(self, matrix: np.ndarray | None = None, codes: np.ndarray | None = None, decode=None,
               dim: int | None = None):
    self.matrix, self.codes, self.decode = matrix, codes, decode
    self.dim = matrix.shape[1] if matrix is not None else dim

  def __call__(self, rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows)
    flat = rows.reshape(-1)
    out = np.zeros((len(flat), self.dim), np.float32)
    real = flat >= 0
    picked = flat[real]
    if len(picked):
      # Sorted reads are sequential on a memory-mapped file; the order is restored after.
      order = np.argsort(picked, kind="stable")
      found = (self.matrix[picked[order]] if self.matrix is not None
               else self.decode(np.ascontiguousarray(self.codes[picked[order]])))
      values = np.empty((len(picked), self.dim), np.float32)
      values[order] = found
      out[real] = values
    return out.reshape(*rows.shape, self.dim)


class HostIndex:
  """The fixed index on the host: `search(queries, n)` -> rows [Q, n], `vectors` the candidates' vectors.

  Flat: exact inner product by `faiss.knn` over the embeddings where they lie (no index copy). Compressed
  (e.g. OPQ48,IVF1,PQ48): a Faiss index of that factory, and its codes of every document kept beside it for
  the vectors (N x code size bytes: 48 a document for PQ48)."""

  def __init__(self, embeddings: np.ndarray, factory: str, *, seed: int = 0, train_size: int = 100_000):
    self.factory, self.num_docs = factory, len(embeddings)
    if is_flat(factory):
      self.matrix, self.retriever = embeddings, None
      self.vectors = HostVectors(matrix=embeddings)
      return
    from jdr.retrieval import index as index_lib  # pylint: disable=g-import-not-at-top
    self.matrix = None
    self.retriever = index_lib.FaissRetriever(embeddings.shape[1], factory=factory, train_size=train_size,
                                              seed=seed, use_gpu="auto")
    sample = embeddings
    if len(embeddings) > train_size:  # the sample FaissRetriever.add trains on
      sample = embeddings[np.sort(np.random.default_rng(seed).choice(len(embeddings), train_size, replace=False))]
    self.retriever.train(sample)
    # The Faiss index itself, added to and searched by row: the retriever's string ids are N Python objects.
    self._index = self.retriever.search_index
    cpu = self.retriever.cpu_index  # the trained CPU index holds the codecs
    codes = []
    for start in range(0, len(embeddings), 65536):
      block = np.ascontiguousarray(embeddings[start:start + 65536], np.float32)
      codes.append(cpu.sa_encode(block))
      self._index.add(block)
    self.vectors = HostVectors(codes=np.concatenate(codes), decode=cpu.sa_decode, dim=embeddings.shape[1])

  def search(self, queries: np.ndarray, n: int) -> np.ndarray:
    """int32 rows [Q, n] of each query's top n, -1 where the index finds fewer."""
    return self.search_scored(queries, n)[0]

  def search_scored(self, queries: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows int32 [Q, n], scores float32 [Q, n]): -1 and -inf where the index finds fewer."""
    if self.retriever is None:
      return exact_top_rows(self.matrix, queries, n, "faiss")
    queries = np.ascontiguousarray(queries, np.float32)
    rows = np.full((len(queries), n), -1, np.int32)
    scores = np.full((len(queries), n), -np.inf, np.float32)
    k = min(n, self.num_docs)
    for start in range(0, len(queries), 1024):
      found_scores, found = self._index.search(queries[start:start + 1024], k)
      rows[start:start + len(found), :k] = found
      scores[start:start + len(found), :k] = np.where(found < 0, -np.inf, found_scores)
    return rows, scores


def reconstruct(embeddings: np.ndarray, factory: str, *, seed: int = 0, train_size: int = 100_000):
  """(A Faiss retriever over the embeddings, the index's own reconstruction of every document [N, D]): the
  whole decoded matrix, for the benchmarks that compare against it; training uses `HostIndex`."""
  from jdr.retrieval import index as index_lib  # pylint: disable=g-import-not-at-top
  retriever = index_lib.FaissRetriever(embeddings.shape[1], factory=factory, train_size=train_size, seed=seed,
                                       use_gpu="auto")
  retriever.add(embeddings, [str(i) for i in range(len(embeddings))])
  if is_flat(factory):
    return retriever, np.asarray(embeddings, np.float32)
  return retriever, HostIndex(embeddings, factory, seed=seed, train_size=train_size).vectors(
      np.arange(len(embeddings)))


def top_rows(retriever, queries: np.ndarray, n: int) -> np.ndarray:
  """[Q, n] corpus rows of each query's top n (the retriever's ids are row numbers), -1 where short."""
  rows = np.full((len(queries), n), -1, np.int32)
  for start in range(0, len(queries), 1024):
    _, ids = retriever.search(queries[start:start + 1024], n)
    for b, row_ids in enumerate(ids):
      picked = [int(i) for i in row_ids if i != ""]
      rows[start + b, :len(picked)] = picked
  return rows


MINE_BACKENDS = ("auto", "faiss", "jax")


def mining_backend(backend: str) -> str:
  """`auto`: the JAX top-k where there is an accelerator (the corpus on the devices), Faiss on a CPU host."""
  if backend not in MINE_BACKENDS:
    raise ValueError(f"the mining backend must be one of {', '.join(MINE_BACKENDS)}, got {backend!r}")
  if backend == "auto":
    return "faiss" if jax.default_backend() == "cpu" else "jax"
  return backend


def exact_top_rows(doc_emb: np.ndarray, queries: np.ndarray, n: int, backend: str = "auto",
                   dtype: str = "auto", *, batch: int = 4096, progress: str | None = None,
                   mesh=None) -> tuple[np.ndarray, np.ndarray]:
  """(rows int32 [Q, n], scores float32 [Q, n]) of each query's exact top n by inner product over
  `doc_emb`, -1 / -inf where the corpus is shorter than n; queries searched `batch` at a time.

  faiss: `faiss.knn` reads `doc_emb` where it lies (a memory-mapped float32 matrix is searched without a
  copy; an index would hold a second one). jax: the matrix is placed once on the mesh (every device of this
  process unless `mesh`), stored as `dtype` (bfloat16 on accelerators by default), and searched by the one
  sharded top-k. Neither path builds ids: rows are what the miners keep. `progress` names a progress bar."""
  backend = mining_backend(backend)
  num, k = len(queries), min(n, len(doc_emb))
  rows = np.full((num, n), -1, np.int32)
  scores = np.full((num, n), -np.inf, np.float32)
  if not num or not k:
    return rows, scores
  bar = None
  if progress:
    import tqdm  # pylint: disable=g-import-not-at-top
    bar = tqdm.tqdm(total=num, desc=progress, unit="query", file=sys.stderr, disable=jax.process_index() != 0)
  if backend == "faiss":
    import faiss  # pylint: disable=g-import-not-at-top
    # A float32 memmap stays the memmap; an encoding's shards are searched one at a time and merged.
    pieces = [(first, np.ascontiguousarray(piece, dtype=np.float32))
              for first, piece in sharded_rows.pieces(doc_emb)]
    for lo in range(0, num, batch):
      part = np.ascontiguousarray(queries[lo:lo + batch], dtype=np.float32)
      # Each shard's top k merged into the best k so far as the shards go (ties to the lower row: the earlier
      # shard's come first in the stable sort): [batch, 2k] at a time, not [batch, shards x k] (8.8M rows are 884
      # shards, whose results together would be gigabytes).
      best_scores = best_rows = None
      for first, piece in pieces:
        if not len(piece):
          continue
        found_scores, found_rows = faiss.knn(part, piece, min(k, len(piece)), metric=faiss.METRIC_INNER_PRODUCT)
        # Faiss lists tied documents in no fixed order: by score, then row, so a search's ties do not depend
        # on how the corpus is sharded.
        order = np.lexsort((found_rows, -found_scores), axis=-1)
        found_scores = np.take_along_axis(found_scores, order, axis=1)
        found_rows = np.take_along_axis(found_rows, order, axis=1) + first
        if best_scores is not None:
          found_scores = np.concatenate([best_scores, found_scores], axis=1)
          found_rows = np.concatenate([best_rows, found_rows], axis=1)
          order = np.argsort(-found_scores, axis=1, kind="stable")[:, :k]
          found_scores = np.take_along_axis(found_scores, order, axis=1)
          found_rows = np.take_along_axis(found_rows, order, axis=1)
        best_scores, best_rows = found_scores, found_rows
      rows[lo:lo + len(part), :k], scores[lo:lo + len(part), :k] = best_rows, best_scores
      if bar is not None:
        bar.update(len(part))
  else:
    from jdr.runtime import parallel  # pylint: disable=g-import-not-at-top
    mesh = mesh if mesh is not None else parallel.make_mesh((-1, 1, 1), devices=jax.local_devices())
    corpus = topk.put_corpus(doc_emb, mesh, dtype)
    search = topk.search_fn(corpus, k, mesh)
    size = min(batch, num)
    for lo in range(0, num, size):
      part = np.zeros((size, queries.shape[1]), np.float32)  # one shape: compiled once
      real = np.asarray(queries[lo:lo + size], np.float32)
      part[:len(real)] = real
      found_scores, found = jax.device_get(search(part))
      rows[lo:lo + len(real), :k] = found[:len(real)]
      scores[lo:lo + len(real), :k] = found_scores[:len(real)]
      if bar is not None:
        bar.update(len(real))
  if bar is not None:
    bar.close()
  rows[~np.isfinite(scores)] = -1  # faiss pads with -1 already; a padded device row never wins, but be sure
  return rows, scores
