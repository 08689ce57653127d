"""Building and searching an index over an encoding, one way everywhere (`jdr.retrieve`, the trainer's
evaluation, ANCE's refresh):

  retriever = build_index(emb, ids, backend="jax", mesh=mesh)   # or load_index("emb/") from disk
  run = retrieve_run(retriever, query_ids, query_emb, k=100)
"""

import os
from typing import Literal, Sequence

import numpy as np

from jdr.retrieval import encodings
from jdr.retrieval import index as index_lib
from jdr.runtime import paths
from jdr.retrieval import sharded_rows


def build_index(embeddings: np.ndarray, ids: Sequence[str],
                backend: Literal["faiss", "jax"] = "faiss", factory: str = "Flat",
                mesh=None, recall_target: float = 1.0, gpu: dict | None = None,
                jax_dtype: str = "auto") -> index_lib.Retriever:
  """A retriever over embeddings [N, D] with their N ids.

  `factory` is a Faiss index_factory string (the faiss back-end; `gpu` = {"gpu_layout", "gpu_float16"}
  says how it spreads over the host's GPUs, see FaissRetriever); the jax back-end is exact top-k over
  the embedding matrix sharded by rows over `mesh` (default: all devices) and takes only "Flat"; `jax_dtype`
  is its storage (see index.JaxRetriever).
  """
  if not isinstance(embeddings, sharded_rows.ShardedRows):
    embeddings = np.asarray(embeddings)
  if embeddings.ndim != 2:
    raise ValueError(f"embeddings must be [N, D], got shape {embeddings.shape}")
  if backend == "faiss":
    kwargs = {"factory": factory, **(gpu or {})}
  elif backend == "jax":
    if factory != "Flat":
      raise ValueError(f"the jax back-end is exact (factory 'Flat'), not {factory!r}; use backend='faiss'")
    kwargs = {"mesh": mesh, "recall_target": recall_target, "dtype": jax_dtype}
  else:
    raise ValueError(f"backend must be 'faiss' or 'jax', got {backend!r}")
  retriever = index_lib.make_retriever(backend, embeddings.shape[1], **kwargs)
  retriever.add(embeddings, ids)
  return retriever


def load_index(enc_dir: str | os.PathLike, backend: Literal["faiss", "jax"] = "faiss",
               factory: str = "Flat", *, save: bool = False, mesh=None,
               recall_target: float = 1.0, gpu: dict | None = None,
               jax_dtype: str = "auto") -> index_lib.Retriever:
  """A retriever over an encoding directory; reuses a Faiss index saved in it (see `save`).

  With `save`, a built Faiss index is kept in enc_dir/index-faiss-FACTORY, so that a compressed index
  is trained once.
  """
  saved = paths.as_path(enc_dir) / f"index-{backend}-{factory.replace(',', '_')}"
  if backend == "faiss" and saved.is_dir():
    return index_lib.load_retriever(saved, **(gpu or {}))
  emb, ids, _ = encodings.load_embeddings(enc_dir)
  retriever = build_index(emb, ids, backend, factory, mesh, recall_target, gpu if backend == "faiss" else None,
                          jax_dtype)
  if save and backend == "faiss":
    retriever.save(saved)
  return retriever


def ensemble_rerank(run: dict[str, dict[str, float]], query_ids: Sequence[str], query_embeddings: np.ndarray,
                    row_of: dict[str, int], pieces: dict[str, np.ndarray], gamma: float,
                    k: int) -> dict[str, dict[str, float]]:
  """FGD's multi-vector ensemble (Eq. 16) over each query's retrieved documents: s(q, d) + gamma x the sum
  over levels of the best window's score, then the top k."""
  out = {}
  for qi, qid in enumerate(query_ids):
    docs = list(run.get(qid, {}))
    if not docs:
      out[qid] = {}
      continue
    rows = np.array([row_of[d] for d in docs])
    extra = np.zeros(len(docs), np.float32)
    for vectors in pieces.values():
      scores = np.einsum("nkd,d->nk", vectors[rows], query_embeddings[qi])
      extra += np.nan_to_num(np.nanmax(np.where(np.isnan(scores), -np.inf, scores), axis=1), neginf=0.0)
    combined = np.array([run[qid][d] for d in docs], np.float32) + gamma * extra
    order = np.argsort(-combined, kind="stable")[:k]
    out[qid] = {docs[i]: float(combined[i]) for i in order}
  return out


def retrieve_run(retriever: index_lib.Retriever, query_ids: Sequence[str], query_embeddings: np.ndarray,
                 k: int, passages: int = 1) -> dict[str, dict[str, float]]:
  """Top k documents per query as a run {query id: {doc id: score}}, best first. With `passages` rows per
  document (a MaxP encoding) it searches k x passages rows and scores a document by its best passage, so
  the k documents are exact whenever each has at most `passages` rows."""
  query_ids = list(query_ids)
  if len(query_ids) != len(query_embeddings):
    raise ValueError(f"{len(query_ids)} query ids for {len(query_embeddings)} query embeddings")
  if k < 1:
    raise ValueError(f"k must be positive, got {k}")
  if not query_ids:
    return {}
  if passages <= 1:
    scores, ids = retriever.search(query_embeddings, k)
    return index_lib.to_run(query_ids, scores, ids)
  scores, ids = retriever.search(query_embeddings, k * passages)
  run = {}
  for qid, row_scores, row_ids in zip(query_ids, scores, ids):
    best: dict[str, float] = {}
    for d, s in zip(row_ids, row_scores):  # best first: a document's first row is its best passage
      if d and np.isfinite(s) and d not in best:
        best[d] = float(s)
    run[qid] = dict(list(best.items())[:k])
  return run
