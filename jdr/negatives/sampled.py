"""Host-side negative samplers over static pools.

A training batch holds B queries and C = B * (1 + n_neg) documents: docs[0:B] are the positives (doc b is
query b's positive) and query b's n_neg sampled negatives sit at B + b*n_neg ... B + (b+1)*n_neg - 1.
A `NegativeSource` fills the second part; `jdr.data.batch.candidate_mask` builds the `valid` [B, C]
matrix the losses in `jdr.training.losses` take.

Sources (the "negatives" column of docs/architecture.md's recipe table):
  RandomNegatives   uniform over the corpus (Rand Neg)
  BM25Negatives     uniform over BM25's top-k, mined once with `jdr.retrieval.bm25` and cached (BM25 Neg; DPR, ANCE warm-up)
  StaticNegatives   top-k of a TREC run file, e.g. a warm-up dense model's (STAR's static hard negatives)
  MixedNegatives    per-query mixture by fractions (DPR's 1:1 BM25 + random)

Every source excludes all of the query's positives (qrels relevance > 0) and samples without replacement
within a query. All randomness comes from the `np.random.Generator` passed to `sample`, and nothing iterates
a set, so a seed reproduces the batch in any process (string hashing is randomized per process).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from jdr.data import prepared
from jdr.data.formats import Doc, read_run

if TYPE_CHECKING:
  from jdr.retrieval import bm25

log = logging.getLogger(__name__)

Qrels = Mapping[str, Mapping[str, int]]


def positive_ids(qrels: Qrels, qid: str) -> list[str]:
  """The query's relevant docs (relevance > 0) in qrels order; an error naming the query if it has none."""
  judged = qrels.get(qid)
  if judged is None:
    raise KeyError(f"query {qid!r} is not in the qrels, so it has no positives and cannot be a training query")
  positives = [doc_id for doc_id, rel in judged.items() if rel > 0]
  if not positives:
    raise ValueError(f"query {qid!r} has no positive document in the qrels (all {len(judged)} judgments have "
                     "relevance <= 0); drop it from the training queries")
  return positives


class NegativeSource(Protocol):
  """Samples `n` negative doc ids for each query of a batch.

  `query_ids[i]` is row i's query and `positives[i]` its positive in this batch (excluded along with every
  other positive the qrels give the query). `exclude[i]`, when given, holds further doc ids row i must not
  get; `MixedNegatives` uses it so two sources never hand a row the same doc.
  """

  def sample(self, query_ids: Sequence[str], positives: Sequence[str], rng: np.random.Generator, n: int, *,
             exclude: Sequence[Collection[str]] | None = None) -> list[list[str]]:
    ...


def _excluded(qrels: Qrels, qid: str, positive: str, extra: Collection[str] | None) -> set[str]:
  out = set(positive_ids(qrels, qid))
  out.add(positive)
  if extra:
    out.update(extra)
  return out


def _check_rows(query_ids, positives, exclude, n):
  if len(query_ids) != len(positives):
    raise ValueError(f"{len(query_ids)} queries but {len(positives)} positives")
  if exclude is not None and len(exclude) != len(query_ids):
    raise ValueError(f"{len(query_ids)} queries but {len(exclude)} exclude sets")
  if n < 0:
    raise ValueError(f"n must be >= 0, got {n}")


class RandomNegatives:
  """Uniform negatives from the whole corpus, without replacement within a query (Rand Neg)."""

  def __init__(self, corpus_ids: Sequence[str] | Mapping[str, Doc], qrels: Qrels):
    self.corpus_ids = prepared.id_sequence(corpus_ids)
    self.qrels = qrels
    if not len(self.corpus_ids):
      raise ValueError("RandomNegatives needs a non-empty corpus")

  def sample_one(self, qid: str, excluded: set[str], rng: np.random.Generator, n: int) -> list[str]:
    """`n` distinct corpus docs outside `excluded`, uniformly at random."""
    if n == 0:
      return []
    size = len(self.corpus_ids)
    # At most len(excluded) of the draws can be rejected, so n + len(excluded) distinct draws always leave n.
    # Generator.choice without replacement is O(draws), not O(corpus), when draws << corpus.
    draws = rng.choice(size, size=min(size, n + len(excluded)), replace=False)
    out = []
    for row in draws:
      doc_id = self.corpus_ids[row]
      if doc_id not in excluded:
        out.append(doc_id)
        if len(out) == n:
          return out
    raise ValueError(f"query {qid!r}: wanted {n} negatives but the corpus has only {len(out)} documents that are "
                     f"not its positives or already chosen")

  def sample(self, query_ids, positives, rng, n, *, exclude=None):
    _check_rows(query_ids, positives, exclude, n)
    return [self.sample_one(qid, _excluded(self.qrels, qid, pos, exclude and exclude[i]), rng, n)
            for i, (qid, pos) in enumerate(zip(query_ids, positives))]


class _PoolNegatives:
  """Uniform negatives from a fixed per-query candidate pool, topped up with random docs when it runs short.

  `fallback_negatives` / `fallback_queries` count the random top-ups (reported by `stats`), so a pool that
  is mostly empty shows up instead of silently turning a hard-negative run into a random-negative one.
  """

  def __init__(self, qrels: Qrels, fallback: RandomNegatives | None, name: str):
    self.qrels = qrels
    self.fallback = fallback
    self.name = name
    self.sampled_negatives = 0
    self.fallback_negatives = 0
    self.fallback_queries = 0

  def pool(self, qid: str) -> list[str]:
    """The query's candidates in rank order (positives not yet removed); [] when it has none."""
    raise NotImplementedError

  def sample(self, query_ids, positives, rng, n, *, exclude=None, keep_other_positives=False):
    """As `NegativeSource.sample`; `keep_other_positives` skips only each row's own positive, leaving the query's
    other positives in its pool as negatives (ANCE's triples: `run_ann_data_gen.py` skips the one positive it
    keeps a query)."""
    _check_rows(query_ids, positives, exclude, n)
    out = []
    for i, (qid, pos) in enumerate(zip(query_ids, positives)):
      if keep_other_positives:
        excluded = {pos} | set(exclude[i] if exclude else ())
      else:
        excluded = _excluded(self.qrels, qid, pos, exclude and exclude[i])
      candidates = [d for d in self.pool(qid) if d not in excluded]
      if len(candidates) >= n:
        picks = rng.choice(len(candidates), size=n, replace=False)
        out.append([candidates[j] for j in picks])
        self.sampled_negatives += n
        continue
      if self.fallback is None:
        raise ValueError(f"{self.name}: query {qid!r} has {len(candidates)} candidates left after removing its "
                         f"positives, fewer than the {n} negatives asked for; pass corpus_ids to top up with "
                         "random negatives")
      # Keep every candidate (in random order) and fill the rest uniformly from the corpus.
      chosen = [candidates[j] for j in rng.permutation(len(candidates))]
      chosen += self.fallback.sample_one(qid, excluded | set(chosen), rng, n - len(chosen))
      out.append(chosen)
      self.sampled_negatives += len(candidates)
      self.fallback_negatives += n - len(candidates)
      self.fallback_queries += 1
    return out

  def stats(self) -> dict[str, int]:
    return {"sampled_negatives": self.sampled_negatives, "fallback_negatives": self.fallback_negatives,
            "fallback_queries": self.fallback_queries}


class RowPools(_PoolNegatives):
  """Negatives drawn uniformly from per-query pools held as one int32 array of corpus rows [Q, n] (-1 pads),
  row i the pool of `qids[i]` in rank order: nothing per candidate is a Python object, so 502,939 queries x
  200 candidates cost 400 MB rather than tens of GB of lists of strings. Ids are looked up only for the
  pools a batch samples. Queries the pools lack, or whose pool runs short, get random negatives (counted)."""

  def __init__(self, rows: np.ndarray, qids: Sequence[str], qrels: Qrels, corpus_ids, name: str = "RowPools"):
    super().__init__(qrels, RandomNegatives(corpus_ids, qrels), name)
    rows = np.asarray(rows)
    if rows.ndim != 2 or len(rows) != len(qids):
      raise ValueError(f"{name}: pools must be [queries, n] rows, got shape {rows.shape} for {len(qids)} queries")
    self.rows, self.qids = rows, list(qids)
    self.corpus_ids = self.fallback.corpus_ids
    self._index = {q: i for i, q in enumerate(self.qids)}

  def current_rows(self) -> np.ndarray:
    """The pools in force (a refreshed source's change over time; these stay)."""
    return self.rows

  def pool(self, qid: str) -> list[str]:
    i = self._index.get(qid)
    if i is None:
      return []
    return [self.corpus_ids[int(r)] for r in self.current_rows()[i] if r >= 0]

  def rows_of(self, qids: Sequence[str]) -> np.ndarray:
    """The pools of `qids` as rows [len(qids), n] (-1 for a query without one): the diagnostics' view."""
    current = self.current_rows()
    out = np.full((len(qids), current.shape[1]), -1, np.int32)
    for b, q in enumerate(qids):
      i = self._index.get(q)
      if i is not None:
        out[b] = current[i]
    return out


def drop_rows(rows: np.ndarray, excluded: np.ndarray, keep: int) -> np.ndarray:
  """rows [Q, m] without the rows `excluded` [Q, p] names for the same query (-1 pads both), the others kept
  in order and cut to `keep` columns: how STAR's miner takes the top 210 and keeps the first 200 that are not
  positives (DRhard `prepare_hardneg.py`), for all queries at once."""
  rows = np.asarray(rows)
  out = np.full((len(rows), keep), -1, np.int32)
  for lo in range(0, len(rows), 65536):  # bounds the [chunk, m, p] comparison
    part, ex = rows[lo:lo + 65536], np.asarray(excluded)[lo:lo + 65536]
    gone = (part < 0) | ((part[:, :, None] == ex[:, None, :]) & (ex[:, None, :] >= 0)).any(axis=2)
    order = np.argsort(gone, axis=1, kind="stable")  # kept rows first, in rank order
    picked = np.take_along_axis(part, order, axis=1)[:, :keep]
    picked = np.where(np.take_along_axis(gone, order, axis=1)[:, :keep], -1, picked)
    out[lo:lo + len(part), :picked.shape[1]] = picked
  return out


class BM25Negatives(_PoolNegatives):
  """Negatives drawn uniformly from each training query's BM25 top-k (default 100, as DPR and ANCE).

  Training queries are the qrels' queries with a positive; each must have text in `queries` (which may
  also hold other splits' queries: they are not mined). Documents are scored by `jdr.retrieval.bm25` (Lucene's BM25
  with Anserini's MS MARCO k1=0.9, b=0.4; bm25s's tokens: lowercase, English stopwords, no stemming).

  `corpus` is a {doc id: Doc} dict, indexed as `doc_text` (title + " " + text) with `k1` and `b`; or the
  corpus's doc ids in row order, with `index` the BM25 index of its texts (`jdr.retrieval.bm25.index_for`, e.g. over a
  prepared corpus), whose own settings then apply.
  The index and the mined top-k rows and scores are kept under `cache_dir` (see `jdr.retrieval.bm25` for the layout),
  keyed by the corpus texts, the settings, k and the mined queries' ids and texts, so any change mines again
  and an unchanged setup reads the arrays memory-mapped. Mining uses `n_threads` cores (-1: all), shows a
  progress bar, and a killed mine resumes at its last finished chunk of `chunk_size` queries.
  Docs that share no term with a query are not its candidates; queries whose pool runs short get random
  negatives (counted in `stats`). `cache_dir=None` keeps nothing on disk. After construction, `from_cache`
  says whether mining was skipped, `index` is the BM25 index (for other users of the same corpus).
  """

  def __init__(self, corpus: Mapping[str, Doc] | Sequence[str], queries: Mapping[str, str], qrels: Qrels, *,
               top_k: int = 100, cache_dir: str | os.PathLike | None = None, k1: float | None = None,
               b: float | None = None, chunk_size: int = 4096, n_threads: int = -1, show_progress: bool = True,
               index: bm25.Index | None = None):
    from jdr.retrieval import bm25  # pylint: disable=g-import-not-at-top  (imported here: only BM25 users need numba)
    super().__init__(qrels, RandomNegatives(corpus, qrels), "BM25Negatives")
    if top_k < 1:
      raise ValueError(f"top_k must be >= 1, got {top_k}")
    self.corpus_ids = self.fallback.corpus_ids
    self.top_k = min(top_k, len(self.corpus_ids))
    self.qids = [qid for qid, judged in qrels.items() if any(rel > 0 for rel in judged.values())]
    missing = [qid for qid in self.qids if qid not in queries]
    if missing:
      raise ValueError(f"{len(missing)} qrels queries have no text in `queries`, e.g. {missing[:5]}")
    if index is None:
      if not isinstance(corpus, Mapping):
        raise ValueError("BM25Negatives: a corpus given as doc ids needs index= (jdr.retrieval.bm25.index_for over its "
                         "texts in the same order)")
      # k1 and b default to jdr.retrieval.bm25's (Anserini's), kept there only.
      index = bm25.corpus_index(corpus, cache_dir=cache_dir, k1=bm25.K1 if k1 is None else k1,
                                b=bm25.B if b is None else b, show_progress=show_progress)
    if len(index) != len(self.corpus_ids):
      raise ValueError(f"BM25Negatives: the index holds {len(index)} documents, the corpus {len(self.corpus_ids)}")
    self.index = index
    mined = bm25.mine(index, [queries[qid] for qid in self.qids], self.top_k, cache_dir, query_ids=self.qids,
                      chunk_size=chunk_size, n_threads=n_threads, show_progress=show_progress,
                      desc="BM25 negatives")
    self.cache_path, self.from_cache = mined.path, mined.from_cache
    self._rows, self._scores = mined.rows, mined.scores
    self._row_of = {qid: i for i, qid in enumerate(self.qids)}
    empty = int(np.sum(self._rows[:, 0] < 0))
    if empty:
      log.warning("BM25Negatives: %d of %d training queries share no term with any document; their negatives "
                  "will be random", empty, len(self.qids))

  def pool(self, qid: str) -> list[str]:
    i = self._row_of.get(qid)
    if i is None:
      positive_ids(self.qrels, qid)  # raises the clear error for a query without positives
      raise KeyError(f"query {qid!r} was not mined: it is not among the qrels this source was built from")
    return [self.corpus_ids[r] for r in self._rows[i] if r >= 0]

  def scores_of(self, qid: str) -> dict[str, float]:
    """The mined (doc id -> BM25 score) ranking of a training query; for inspection and tests."""
    self.pool(qid)  # the same errors as sampling for an unknown query
    i = self._row_of[qid]
    return {self.corpus_ids[r]: float(s) for r, s in zip(self._rows[i], self._scores[i]) if r >= 0}


def bm25_index_of(source) -> bm25.Index | None:
  """The BM25 index a negative source (or a mixture holding one) already has, so others need not build it."""
  if isinstance(source, BM25Negatives):
    return source.index
  for inner in getattr(source, "sources", None) or ():
    found = bm25_index_of(inner)
    if found is not None:
      return found
  return None


def bm25_run(corpus: Mapping[str, Doc], queries: Mapping[str, str], qids: Sequence[str], k: int, *,
             k1: float | None = None, b: float | None = None, cache_dir: str | os.PathLike | None = None,
             n_threads: int = -1, show_progress: bool = True) -> dict[str, dict[str, float]]:
  """BM25's top k of the corpus for each query id, as a run {qid: {doc id: score}} (Anserini's k1, b).

  The index is this process's for the same corpus and settings if any (e.g. BM25Negatives'), else
  `cache_dir`'s, else built once."""
  from jdr.retrieval import bm25  # pylint: disable=g-import-not-at-top
  ids = list(corpus)
  index = bm25.corpus_index(corpus, cache_dir=cache_dir, k1=bm25.K1 if k1 is None else k1, b=bm25.B if b is None else b,
                            show_progress=show_progress)
  rows, scores = bm25.search(index, [queries[q] for q in qids], min(k, len(ids)), n_threads=n_threads)
  return {q: {ids[r]: float(s) for r, s in zip(rows[i], scores[i]) if r >= 0} for i, q in enumerate(qids)}


class StaticNegatives(_PoolNegatives):
  """Negatives drawn uniformly from each query's top-k in a fixed TREC run (STAR: a warm-up model's top-200).

  `run` is a TREC run file or an already read {qid: {doc id: score}}; each query's top `top_k` by score
  (trec_eval order) form its pool, positives removed. With `corpus_ids`, queries whose pool runs short
  (or that the run lacks) are topped up with random negatives and counted in `stats`; without, that is
  an error.
  """

  def __init__(self, run: str | os.PathLike | Mapping[str, Mapping[str, float]], qrels: Qrels, *,
               top_k: int = 200, corpus_ids: Sequence[str] | Mapping[str, Doc] | None = None):
    fallback = RandomNegatives(corpus_ids, qrels) if corpus_ids is not None else None
    super().__init__(qrels, fallback, "StaticNegatives")
    if top_k < 1:
      raise ValueError(f"top_k must be >= 1, got {top_k}")
    if not isinstance(run, Mapping):
      run = read_run(run)
    # read_run returns each query's docs in rank order; a dict given by the caller may not be, so sort.
    self._pools = {qid: [d for d, _ in sorted(docs.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)[:top_k]]
                   for qid, docs in run.items()}

  def pool(self, qid: str) -> list[str]:
    if qid not in self._pools and self.fallback is None:
      raise KeyError(f"StaticNegatives: query {qid!r} is not in the run; pass corpus_ids to fall back to random")
    return self._pools.get(qid, [])


class MixedNegatives:
  """Each row's n negatives split between sources by fraction: [(BM25Negatives, 1), (RandomNegatives, 1)] is
  DPR's 1:1 BM25 + random.

  Fractions are normalized. Row counts are floor(n * f) per source, and the leftover slots go to sources
  drawn (without replacement) with probability proportional to their remainders, so the expected share is
  exactly n * f even when n is small. Sources run in list order and each excludes the docs the earlier
  ones picked for the row.
  """

  def __init__(self, sources: Sequence[tuple[NegativeSource, float]]):
    if not sources:
      raise ValueError("MixedNegatives needs at least one (source, fraction)")
    fractions = np.asarray([f for _, f in sources], np.float64)
    if np.any(fractions < 0) or not np.isfinite(fractions).all() or fractions.sum() <= 0:
      raise ValueError(f"fractions must be >= 0 with a positive sum, got {fractions.tolist()}")
    self.sources = [s for s, _ in sources]
    self.fractions = fractions / fractions.sum()

  def counts(self, rng: np.random.Generator, n: int) -> np.ndarray:
    """How many of a row's n negatives each source gives."""
    exact = n * self.fractions
    counts = np.floor(exact).astype(np.int64)
    left = n - int(counts.sum())
    if left:
      remainder = exact - counts
      extra = rng.choice(len(counts), size=left, replace=False, p=remainder / remainder.sum())
      counts[extra] += 1
    return counts

  def sample(self, query_ids, positives, rng, n, *, exclude=None):
    _check_rows(query_ids, positives, exclude, n)
    out = []
    for i, (qid, pos) in enumerate(zip(query_ids, positives)):
      taken: list[str] = []
      base = set(exclude[i]) if exclude is not None else set()
      for source, count in zip(self.sources, self.counts(rng, n)):
        if count:
          taken += source.sample([qid], [pos], rng, int(count), exclude=[base | set(taken)])[0]
      out.append(taken)
    return out
