"""Candidates retrieved from a fixed corpus index: ADORE / LTRe (every step) and its static ablation (once).

LTRe Algorithm 1 / ADORE (Zhan et al. 2021, Sec. 6.2): the corpus is encoded once by the starting document
tower; at every step the batch's queries, encoded by the query tower being trained, retrieve their top n
from the whole corpus; the scores are inner products with the stored document vectors, and only the query
tower learns. A query none of whose n documents is relevant still needs a positive to learn from, and
`negatives.retrieval.missing_positive` says where it comes from (`MISSING_POSITIVE`):
  append        DRhard's adore/train.py, the code behind ADORE's tables: every positive of the query is
                appended after the n retrieved, at positions n + 1, n + 2, ... of its candidate list;
  replace_last  LTRe Algorithm 1, line 4: the n-th retrieved document is replaced by the batch positive.

Where the retrieval runs is a config value (`negatives.retrieval.backend`):
  faiss  on the host, between steps: `HostRetrieval` encodes the batch's queries with the current query
         tower (the same dropout rng the step will use, so the ranking is the one the loss sees), searches
         any Faiss index (flat, or OPQ+PQ), and hands the ids to the step as the batch field `cand_rows`;
  jax    inside the jitted step: `sharded_top_k` (`jdr.retrieval.topk`) over the corpus matrix sharded by rows
         across the mesh, each device searching its own rows.
Either way the step then runs the same code: `candidates` (the missing-positive rule), the candidates'
vectors, scores, loss.

One copy of the corpus matrix: with faiss the matrix stays on the host (the encoding, memory-mapped) and
nothing goes to the devices: Flat retrieval is `faiss.knn` over it in place, and `host_search.HostVectors` hands the step
the batch's candidates' vectors (`cand_vectors`, `positive_vectors`). With jax the matrix lives on the devices
(`put_corpus`) and the host keeps only the map. With a compressed index the vectors the step scores against
are the index's own reconstruction of the documents (faiss sa_decode of their codes, decoded per batch from
the N x code-size codes), so the query tower learns the index it will be served with (LTRe Table 4), and no
decoded N x D matrix is ever held.

Row -1 marks "no document" (padding) everywhere. The source's settings are the group `negatives.retrieval`, read
here alone (`settings`, `check`).
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

from jdr.retrieval import host_search
from jdr.retrieval import topk


# ------------------------------------------------------------------------------------------------ settings


@dataclasses.dataclass(frozen=True)
class Settings:
  """The group `negatives.retrieval`, read once: what the builder, the step and the sizing use of it."""
  top_n: int  # candidates retrieved a query
  every: int  # 1 = at every step; 0 = once before training (the static ablation)
  missing_positive: str  # `MISSING_POSITIVE`
  backend: str  # faiss (host, between steps) | jax (in the step)
  recall_target: float  # < 1: jax.lax.approx_max_k in the step
  corpus_dtype: str  # the fixed corpus on the devices (jax)
  index_factory: str  # the Faiss index (faiss)
  corpus_encoding: str  # a jdr.encode directory as the fixed index ("" = encoded at the start)

  @property
  def in_step(self) -> bool:
    """Whether the jitted step retrieves: the JAX back-end, unless the candidates are fixed before training
    (which, like Faiss, serves them from the host)."""
    return self.backend == "jax" and self.every != 0


def settings(retrieval) -> Settings:
  """`negatives.retrieval` (the group) as `Settings`."""
  return Settings(top_n=retrieval.top_n, every=retrieval.every, missing_positive=retrieval.missing_positive,
                  backend=retrieval.backend, recall_target=retrieval.top_k_recall_target,
                  corpus_dtype=retrieval.corpus_dtype, index_factory=retrieval.index_factory,
                  corpus_encoding=retrieval.corpus_encoding)


def check(retrieval, run, chosen: bool) -> None:
  """Refuses the group's settings before anything is loaded, when source=retrieval is the run's (`run`: the
  run's `jdr.negatives.sources.Run`, of which the towers it trains are read)."""
  if not chosen:
    return
  if run.train_towers != "query":
    raise ValueError("negatives.source='retrieval' scores against a fixed corpus index, so only the query "
                     "tower may train: set model.train_towers=query (and model.shared=False)")
  if retrieval.backend not in ("faiss", "jax"):
    raise ValueError(f"negatives.retrieval.backend must be faiss or jax, got {retrieval.backend!r}")
  if retrieval.backend == "jax" and retrieval.index_factory.strip().lower() != "flat":
    raise ValueError(f"negatives.retrieval.index_factory={retrieval.index_factory!r} needs backend=faiss "
                     "(the JAX back-end is exact top-k over the flat matrix)")


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


# negatives.retrieval.missing_positive -> the rule
MISSING_POSITIVE = {"append": append_positives, "replace_last": replace_last}


def check_missing_positive(name: str) -> str:
  if name not in MISSING_POSITIVE:
    raise ValueError(f"negatives.retrieval.missing_positive must be one of {', '.join(MISSING_POSITIVE)}; "
                     f"got {name!r}")
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


def with_vectors(batch: dict, rows: np.ndarray, vectors: host_search.HostVectors) -> dict:
  """The batch with `cand_rows` and the vectors the step scores: the candidates' and the positives'."""
  return {**batch, "cand_rows": rows, "cand_vectors": vectors(rows),
          "positive_vectors": vectors(batch["positive_rows"])}


class HostRetrieval:
  """Faiss retrieval between steps: adds `cand_rows` [B, n] to a batch, from the current query tower, and
  the vectors of the candidates and positives (`with_vectors`).

  `encode_queries(state, query_ids, query_mask)` must produce exactly the query vectors the step
  will compute (same params, same dropout rng), so the ranking searched is the ranking the loss sees.
  """

  def __init__(self, index: host_search.HostIndex, top_n: int, encode_queries: Callable, mesh):
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

