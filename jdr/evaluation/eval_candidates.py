"""Evaluation over each query's candidates: the periodic evaluation whose cost follows the queries it scores.

A full-corpus evaluation encodes every document at every evaluation, a cost that follows the corpus, not the
queries scored (docs/performance.md, `eval-candidates` and `plan`). Here each evaluation query comes with a
fixed list of candidates (BM25's top-k, mined once, or a given run file's), only the distinct candidate
documents are encoded, each query's candidates are scored by dot product, and the metrics are computed on
that re-ranked list. A document outside a query's candidates ranks nowhere for it, so recall is bounded by
the candidates' own recall (BM25's, at the depth).

  cands = bm25_candidates(index, query_texts, qids, depth=100, cache_dir=...)   # or run_candidates(...)
  tokens = tokenize(encoder, cands.unique)          # once: the candidate set does not change
  vectors = encoder.documents(params, tokens)       # [U, D], at every evaluation
  run = rerank(cands, qids, query_vectors, vectors, doc_ids, top_k=100)
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Sequence

import numpy as np

from jdr.data import prepared
from jdr.data import run_arrays
from jdr.data import text as text_lib

_BLOCK_BYTES = 1 << 26  # candidate vectors gathered at once while scoring: bounds the [queries, k, D] block


@dataclasses.dataclass
class Candidates:
  """Each evaluation query's candidate documents as corpus rows."""
  rows: np.ndarray  # int32 [Q, k]: query i's candidates, -1 past its last
  kind: str  # "bm25" | "run"
  source: str  # what the line says: "BM25", or the run file's name
  depth: int  # k asked for (rows may be narrower on a small corpus)

  def __post_init__(self):
    valid = self.rows >= 0
    # The distinct documents (what is encoded) and where each candidate's vector sits among them.
    self.unique, inverse = np.unique(self.rows[valid], return_inverse=True)
    self.where = np.full(self.rows.shape, -1, np.int32)
    self.where[valid] = inverse.reshape(-1)

  @property
  def prefix(self) -> str:
    """Prefix of this kind's metric names ("bm25-top100/ndcg@10"): full-corpus metrics keep the bare names."""
    return f"{self.kind}-top{self.depth}/"

  def describe(self) -> str:
    return (f"candidates: {self.source} top-{self.depth} of {len(self.rows):,} queries, "
            f"{len(self.unique):,} documents")


def bm25_candidates(index, query_texts: Sequence[str], query_ids: Sequence[str], depth: int,
                    cache_dir: str | os.PathLike | None = None) -> Candidates:
  """BM25's top `depth` of the corpus for each query, mined once (kept under `cache_dir`, see `jdr.retrieval.bm25`)."""
  from jdr.retrieval import bm25  # pylint: disable=g-import-not-at-top  (only BM25 users need numba)
  mined = bm25.mine(index, list(query_texts), min(depth, len(index)), cache_dir, query_ids=list(query_ids),
                    desc="BM25 evaluation candidates")
  return Candidates(np.asarray(mined.rows, np.int32), "bm25", "BM25", depth)


def run_candidates(path: str | os.PathLike, query_ids: Sequence[str], corpus, depth: int) -> Candidates:
  """The top `depth` of a run file (TREC, or MS MARCO's top1000) for each query (`jdr.data.run_arrays`);
  an error naming the file when it ranks nothing for some of the queries."""
  ranked = run_arrays.read(path, query_ids, corpus, depth=depth)
  missing = [q for q, n in zip(query_ids, ranked.lengths.tolist()) if n == 0]
  if missing:
    raise ValueError(f"eval.candidates_run={path}: no line for {len(missing)} of the {len(query_ids)} "
                     f"evaluation queries (e.g. {missing[:3]})")
  return Candidates(ranked.rows, "run", pathlib.Path(os.fspath(path)).name, depth)


def tokenize(tokenizer, corpus, doc_ids: Sequence[str], rows: np.ndarray, max_length: int) -> list[np.ndarray]:
  """Token ids of the documents at `rows`, as the full-corpus encoding tokenizes them (`text.doc_text`, after
  the document prompt of a `text.Prompted` tokenizer: pass the document side's); a prepared corpus reads just
  those texts from its file."""
  if isinstance(corpus, prepared.PreparedCorpus):
    texts = corpus.texts(rows)
  else:
    texts = [text_lib.doc_text(corpus[doc_ids[r]]) for r in rows.tolist()]
  return text_lib.tokenize(tokenizer, texts, max_length)


def rerank(candidates: Candidates, query_ids: Sequence[str], query_emb: np.ndarray, doc_emb: np.ndarray,
           doc_ids: Sequence[str], top_k: int) -> dict[str, dict[str, float]]:
  """Each query's candidates by dot product, best `top_k` as a run {qid: {doc id: score}}. `doc_emb` [U, D]
  holds `candidates.unique`'s vectors in order. Every query is in the run, one without candidates empty."""
  query_emb = np.asarray(query_emb, np.float32)
  doc_emb = np.asarray(doc_emb, np.float32)
  num, k = candidates.where.shape
  block = max(1, _BLOCK_BYTES // max(1, 4 * k * doc_emb.shape[-1]))
  run = {}
  for lo in range(0, num, block):
    where = candidates.where[lo:lo + block]
    scores = np.einsum("bkd,bd->bk", doc_emb[np.maximum(where, 0)], query_emb[lo:lo + block])
    scores[where < 0] = -np.inf
    order = np.argsort(-scores, axis=1, kind="stable")[:, :top_k]
    for i, picks in enumerate(order):
      q = lo + i
      run[query_ids[q]] = {doc_ids[int(candidates.rows[q, j])]: float(scores[i, j])
                           for j in picks.tolist() if where[i, j] >= 0}
  return run
