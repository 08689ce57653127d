"""Candidates retrieved from a fixed corpus index: ADORE / LTRe (every step) and its static ablation (once).

LTRe Algorithm 1 / ADORE (Zhan et al. 2021, Sec. 6.2): the corpus is encoded once by the starting document
tower; at every step the batch's queries, encoded by the query tower being trained, retrieve their top n
from the whole corpus; the scores are inner products with the stored document vectors, and only the query
tower learns. A query none of whose n documents is relevant still needs a positive to learn from, and
`negatives.missing_positive` says where it comes from (`MISSING_POSITIVE`):
  append        DRhard's adore/train.py, the code behind ADORE's tables: every positive of the query is
                appended after the n retrieved, at positions n + 1, n + 2, ... of its candidate list;
  replace_last  LTRe Algorithm 1, line 4: the n-th retrieved document is replaced by the batch positive.

Where the retrieval runs is a config value (`negatives.retrieval_backend`):
  faiss  on the host, between steps: `HostRetrieval` encodes the batch's queries with the current query
         tower (the same dropout rng the step will use, so the ranking is the one the loss sees), searches
         any Faiss index (flat, or OPQ+PQ), and hands the ids to the step as the batch field `cand_rows`;
  jax    inside the jitted step: `sharded_top_k` (`jdr.retrieval.topk`) over the corpus matrix sharded by rows
         across the mesh, each device searching its own rows.
Either way the step then runs the same code: `candidates` (the missing-positive rule), the candidates'
vectors, scores, loss.

One copy of the corpus matrix: with faiss the matrix stays on the host (the encoding, memory-mapped) and
nothing goes to the devices: Flat retrieval is `faiss.knn` over it in place, and `HostVectors` hands the step
the batch's candidates' vectors (`cand_vectors`, `positive_vectors`). With jax the matrix lives on the devices
(`put_corpus`) and the host keeps only the map. With a compressed index the vectors the step scores against
are the index's own reconstruction of the documents (faiss sa_decode of their codes, decoded per batch from
the N x code-size codes), so the query tower learns the index it will be served with (LTRe Table 4), and no
decoded N x D matrix is ever held.

Row -1 marks "no document" (padding) everywhere.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jdr.retrieval import sharded_rows
from jdr.retrieval import topk


# ------------------------------------------------------------------------------------------------ the corpus


@dataclasses.dataclass
class CorpusMatrix:
  """The fixed document vectors the step scores against, on the devices and on the host.

  `device` holds the rows sharded over every mesh axis (`jdr.retrieval.topk`: float32, bfloat16 by default on
  accelerators, or int8 with a scale per row; padding rows are zeros) and `bias` [N_pad] is 0 for documents,
  -inf for padding rows, so padding never wins a top-k. `host` is the matrix it was placed from, as given (a
  memory-mapped encoding: not a second copy).
  """
  host: np.ndarray
  device: object
  bias: jax.Array
  ids: object  # the doc ids in row order: a list, or a prepared corpus's lazy sequence
  block_rows: int = topk.DEFAULT_BLOCK_ROWS

  @property
  def num_docs(self) -> int:
    return len(self.ids)


def put_corpus(matrix: np.ndarray, ids, mesh, dtype: str = "auto") -> CorpusMatrix:
  """The matrix on the devices (`topk.put_corpus`: a chunk at a time from the host); `ids` is kept as given
  (a prepared corpus's ids stay a lazy sequence), and `host` is `matrix` itself, not a copy of it."""
  placed = topk.put_corpus(matrix, mesh, dtype)
  return CorpusMatrix(matrix, placed.rows, placed.bias, ids, placed.block_rows)


def corpus_shardings(mesh):
  return topk.row_shardings(mesh)


# ------------------------------------------------------------------------------------------------ in the step


def sharded_top_k(queries: jax.Array, corpus, bias: jax.Array, k: int, mesh,
                  recall_target: float = 1.0, block_rows: int = topk.DEFAULT_BLOCK_ROWS) -> jax.Array:
  """Rows [B, k] of the top-k inner products of queries [B, D] against the row-sharded corpus, best first:
  `jdr.retrieval.topk.sharded_top_k`, the search every JAX caller shares."""
  return topk.sharded_top_k(queries, corpus, bias, k, mesh, block_rows, recall_target)[1]


def gather_rows(corpus, rows: jax.Array, mesh) -> jax.Array:
  """float32 corpus[rows] for rows of any shape (-1 gives zeros), with the corpus sharded by rows."""
  return topk.gather_rows(corpus, rows, mesh)


def _relevant(rows: jax.Array, positive_rows: jax.Array) -> jax.Array:
  """Bool [B, n]: is the retrieved row one of the query's positives (-1 padding matches nothing)."""
  return jnp.any((rows[:, :, None] == positive_rows[:, None, :]) & (positive_rows[:, None, :] >= 0), axis=-1)


def replace_last(rows: jax.Array, positive_rows: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """LTRe Algorithm 1, line 4: rows [B, n] retrieved, positive_rows [B, P] (-1 padded, column 0 first).

  Returns (rows with the last one replaced by positive_rows[:, 0] where no retrieved row is relevant,
  labels [B, n] float: 1 where the row is one of the query's positives, retrieved_labels [B, n]: the same
  before the replacement, for the diagnostics of what retrieval alone found).
  """
  relevant = _relevant(rows, positive_rows)
  missed = ~jnp.any(relevant, axis=1)
  last = jnp.arange(rows.shape[1]) == rows.shape[1] - 1
  replace = missed[:, None] & last[None, :] & (positive_rows[:, :1] >= 0)
  new_rows = jnp.where(replace, positive_rows[:, :1], rows)
  labels = jnp.where(replace, True, relevant)
  return new_rows, labels.astype(jnp.float32), relevant.astype(jnp.float32)


def append_positives(rows: jax.Array, positive_rows: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """DRhard's rule: rows [B, n] retrieved, positive_rows [B, P] (-1 padded at the end, column 0 first).

  Returns (rows [B, n + P]: the n retrieved, then the query's positives where none of the n is relevant and
  -1 (no candidate) elsewhere, labels [B, n + P], retrieved_labels [B, n]), as `replace_last`. The P extra
  columns are there for every query so the shapes stay static under jit; an appended positive's position in
  the list (n + 1 + its column) is what its lambda weight reads (`jdr.training.losses`, lambda_delta="positions").
  """
  relevant = _relevant(rows, positive_rows)
  missed = ~jnp.any(relevant, axis=1, keepdims=True)
  appended = jnp.where(missed, positive_rows, -1).astype(rows.dtype)
  labels = jnp.concatenate([relevant, appended >= 0], axis=1)
  return (jnp.concatenate([rows, appended], axis=1), labels.astype(jnp.float32),
          relevant.astype(jnp.float32))


# negatives.missing_positive -> the rule
MISSING_POSITIVE = {"append": append_positives, "replace_last": replace_last}


def check_missing_positive(name: str) -> str:
  if name not in MISSING_POSITIVE:
    raise ValueError(f"negatives.missing_positive must be one of {', '.join(MISSING_POSITIVE)}; got {name!r}")
  return name


def candidates(rows: jax.Array, positive_rows: jax.Array,
               missing_positive: str) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The step's candidate rows, their labels and the retrieved rows' own labels, under the named rule."""
  return MISSING_POSITIVE[check_missing_positive(missing_positive)](rows, positive_rows)


def retrieval_diagnostics(retrieved_labels: jax.Array, positive_rows: jax.Array) -> dict[str, jax.Array]:
  """MRR@10 and Recall@n of the batch's own full retrieval, before the missing-positive rule (LTRe Fig. 3a/b)."""
  n = retrieved_labels.shape[1]
  ranks = jnp.arange(1, n + 1, dtype=jnp.float32)
  first = jnp.min(jnp.where(retrieved_labels > 0, ranks, jnp.inf), axis=1)
  mrr10 = jnp.where(first <= 10, 1.0 / first, 0.0)
  num_pos = jnp.maximum(jnp.sum(positive_rows >= 0, axis=1), 1)
  recall = jnp.sum(retrieved_labels, axis=1) / num_pos
  return {"retrieval_mrr@10": jnp.mean(mrr10), f"retrieval_recall@{n}": jnp.mean(recall)}


# ------------------------------------------------------------------------------------------------ on the host


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


def vectors_of(rows: jax.Array, cand_rows: jax.Array, cand_vectors: jax.Array, positive_rows: jax.Array,
               positive_vectors: jax.Array) -> jax.Array:
  """float32 [B, m, D] vectors of the candidate rows [B, m] the missing-positive rule made, from the vectors
  the host gave with the batch (the retrieved rows' and the positives'): each row's vector is that of the
  same row among them, zeros for -1, so every rule's list is served without the corpus on the devices."""
  pool_rows = jnp.concatenate([cand_rows, positive_rows], axis=1)
  pool = jnp.concatenate([cand_vectors, positive_vectors], axis=1)
  match = (rows[:, :, None] == pool_rows[:, None, :]) & (rows[:, :, None] >= 0)
  picked = jnp.take_along_axis(pool, jnp.argmax(match, axis=2)[:, :, None], axis=1)
  return jnp.where(jnp.any(match, axis=2)[:, :, None], picked, 0.0)


def with_vectors(batch: dict, rows: np.ndarray, vectors: HostVectors) -> dict:
  """The batch with `cand_rows` and the vectors the step scores: the candidates' and the positives'."""
  return {**batch, "cand_rows": rows, "cand_vectors": vectors(rows),
          "positive_vectors": vectors(batch["positive_rows"])}


class HostRetrieval:
  """Faiss retrieval between steps: adds `cand_rows` [B, n] to a batch, from the current query tower, and
  the vectors of the candidates and positives (`with_vectors`).

  `encode_queries(state, query_ids, query_mask)` must produce exactly the query vectors the step
  will compute (same params, same dropout rng), so the ranking searched is the ranking the loss sees.
  """

  def __init__(self, index: HostIndex, top_n: int, encode_queries: Callable, mesh):
    self.index, self.top_n, self.encode_queries, self.mesh = index, top_n, encode_queries, mesh
    self.seconds = 0.0

  def __call__(self, batch: dict[str, np.ndarray], state) -> dict[str, np.ndarray]:
    import time  # pylint: disable=g-import-not-at-top
    # The previous step was dispatched asynchronously; wait for it first so `seconds` counts retrieval only.
    jax.block_until_ready(state.step)
    start = time.perf_counter()
    q = np.asarray(jax.device_get(self.encode_queries(state, batch["query_ids"], batch["query_mask"])),
                   np.float32)
    rows = self.index.search(q, self.top_n)
    out = with_vectors(batch, rows, self.index.vectors)
    self.seconds += time.perf_counter() - start
    return out


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


def overlap(a: np.ndarray, b: np.ndarray) -> float:
  """Mean over queries of |top(a) & top(b)| / n for two [Q, n] row arrays (LTRe Fig. 3c, STAR Fig. 4a)."""
  n = a.shape[1]
  return float(np.mean([len(set(x[x >= 0]) & set(y[y >= 0])) / n for x, y in zip(a, b)]))


def fingerprint(ids: list[str], extra: dict) -> str:
  h = hashlib.sha256(json.dumps(extra, sort_keys=True).encode())
  for i in ids:
    h.update(i.encode() + b"\0")
  return h.hexdigest()[:16]


def log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, file=sys.stderr, flush=True)

