"""The trainer's evaluation of the towers being trained, which encode through jdr/retrieval/tower_encoder.py.

`Evaluator` scores the evaluation queries' rankings, and each evaluation says which kind it is:
  full corpus   every document encoded (in shards kept in the workdir until the evaluation ends, so a killed
                one resumes where it stopped), indexed and searched; the default at the end of training
  candidates    each query's BM25 top-k, or a run file's, re-ranked by the model: only the distinct candidates
                are encoded (`jdr.evaluation.eval_candidates`), so the cost follows the queries scored, not the corpus
When the document tower does not train (ADORE / LTRe), the corpus (or the candidates) is encoded once and
reused at every evaluation.
"""

from __future__ import annotations

import functools
import os
import pathlib
import sys
from typing import Callable, Sequence

import jax
import ml_collections
import numpy as np

from jdr.evaluation import eval_candidates
from jdr.evaluation import metrics as metrics_lib
from jdr.runtime import paths
from jdr.runtime import timings
from jdr.evaluation import reranking
from jdr.retrieval import topk
from jdr.data import formats
from jdr.retrieval import host_search
from jdr.retrieval import tower_encoder
from jdr.negatives import retrieved
from jdr.negatives import sampled
from jdr.negatives import sources


CANDIDATES = ("auto", "full", "bm25", "run")
FINAL = ("full", "candidates")


def periodic_kind(eval_config: ml_collections.ConfigDict, num_queries: int, num_docs: int,
                  doc_tower_frozen: bool) -> str:
  """What eval.candidates makes of this run's evaluations before and during training: "full", "bm25" or "run".

  auto is "run" when eval.candidates_run names a file; else "full" where the candidates could cover the
  corpus anyway (queries x depth >= documents: encoding them would cost what the corpus costs, and the full
  evaluation is exact) or where the document tower is frozen (the corpus is encoded once, and searched on the
  index the model serves from, eval.factories); else "bm25"."""
  kind, run = eval_config.candidates, eval_config.candidates_run
  if kind not in CANDIDATES:
    raise ValueError(f"eval.candidates={kind!r}: must be one of {', '.join(CANDIDATES)}")
  if eval_config.final not in FINAL:
    raise ValueError(f"eval.final={eval_config.final!r}: must be one of {', '.join(FINAL)}")
  if eval_config.candidates_depth < 1:
    raise ValueError(f"eval.candidates_depth={eval_config.candidates_depth}: must be >= 1")
  if run and kind not in ("auto", "run"):
    raise ValueError(f"eval.candidates_run={run} is set but eval.candidates={kind!r}; set eval.candidates=run "
                     "(or auto) to evaluate on the run's candidates, or clear eval.candidates_run")
  if kind == "run" and not run:
    raise ValueError("eval.candidates=run needs eval.candidates_run (a TREC run or MS MARCO top1000 file)")
  if kind != "auto":
    return kind
  if run:
    return "run"
  if doc_tower_frozen or num_queries * eval_config.candidates_depth >= num_docs:
    return "full"
  return "bm25"


class Evaluator:
  """Scores the evaluation queries' rankings: of the whole corpus, or of each query's candidates.

  `evaluator(params)` is the periodic kind (eval.candidates, resolved by `periodic_kind`); `evaluator(params,
  final=True)` the end of training's: with eval.final="full" the full corpus, plus the periodic kind when that
  is candidates (cheap), so the curve's last point is comparable with the ones before it. `describe(final)`
  says which kinds a call runs. Full-corpus metrics keep their bare names ("ndcg@10"); candidate metrics are
  prefixed with the kind and depth ("bm25-top100/ndcg@10", "run-top1000/ndcg@10").

  Full corpus: the document tower encodes the corpus (in resumable shards under `cache_dir`/eval-corpus when
  given, removed once the evaluation ends unless the tower is frozen), it is indexed and searched. `eval.factories` lists Faiss index
  factories to evaluate on, ';'-separated (the first one's metrics are unprefixed, later ones are prefixed
  "FACTORY/"), e.g. "OPQ48,IVF1,PQ48;Flat" for an ADORE run trained on a compressed index. With backend "jax"
  the first is always the exact JAX top-k. `diagnostics(params, doc_emb)` hooks, when given, add the training
  diagnostics computed from the same corpus encoding (overlaps of top-200 lists): full evaluations only.

  Candidates (`jdr.evaluation.eval_candidates`): BM25's top eval.candidates_depth (mined once from `bm25_index()`, the
  index the BM25 negatives or diagnostics hold, else one built once and kept in `cache_dir`), or a run
  file's. Exact dot products; the factories do not apply.

  With a frozen document tower the corpus, or the candidates, is encoded once (or taken from `fixed_doc_emb`).
  """

  def __init__(self, encoder: tower_encoder.TowerEncoder, config: ml_collections.ConfigDict, mesh, *,
               doc_tower_frozen: bool = False, diagnostics=None, fixed_doc_emb: np.ndarray | None = None,
               cache_dir: str | os.PathLike | None = None, bm25_index: Callable | None = None,
               fixed_corpus: retrieved.CorpusMatrix | None = None, matryoshka_dims: Sequence[int] = ()):
    self.encoder, self.config, self.mesh = encoder, config, mesh
    # A Matryoshka model's narrower widths, each also scored on the full corpus (exact search of the same
    # vectors' prefixes, re-normalized where the towers normalize), as "dim<m>/ndcg@10".
    self.matryoshka_dims = tuple(matryoshka_dims)
    self.data = encoder.data
    self.metric_names = [m.strip() for m in config.eval.metrics.split(",") if m.strip()]
    for name in self.metric_names:
      metrics_lib.parse_metric(name)  # an unknown metric name fails here, before training
    qids = sorted(self.data.eval_qrels or {})
    if config.eval.max_queries:
      qids = qids[:config.eval.max_queries]
    self.qids = qids
    self.factories = [f.strip() for f in _split_factories(config.eval.factories)] or ["Flat"]
    self.doc_tower_frozen = doc_tower_frozen
    self.diagnostics = diagnostics
    self._fixed: dict[str, host_search.HostIndex] = {}
    # A frozen document tower's corpus vectors, when the caller already has them (ADORE's fixed index), and
    # their copy on the devices, when its step searches there: searched here too, never copied again.
    self._fixed_emb = fixed_doc_emb if doc_tower_frozen else None
    self.fixed_corpus = fixed_corpus if doc_tower_frozen else None
    self._fixed_search = {}
    self._shards_dir = paths.as_path(cache_dir) / "eval-corpus" if cache_dir is not None else None
    self.periodic = periodic_kind(config.eval, len(qids), len(encoder.doc_ids), doc_tower_frozen)
    self.candidates = None
    depth = config.eval.candidates_depth
    if self.periodic == "bm25":  # mined now: a problem shows before training, and the cache holds it after
      index = bm25_index() if bm25_index is not None else BM25IndexOf(self.data, None, cache_dir)()
      self.candidates = eval_candidates.bm25_candidates(index, [self.data.queries[q] for q in qids], qids, depth,
                                                        cache_dir)
    elif self.periodic == "run":
      self.candidates = eval_candidates.run_candidates(config.eval.candidates_run, qids, self.data.corpus, depth)
    self._candidate_tokens = None  # tokenized once: the candidate set does not change
    self._candidate_emb = None  # a frozen document tower's candidate vectors, encoded once

  def kinds(self, final: bool = False) -> list[str]:
    """The kinds of evaluation a call runs, in order: "full", "bm25", "run"."""
    if not final or self.config.eval.final == "candidates":
      return [self.periodic]
    return ["full"] + ([self.periodic] if self.periodic != "full" else [])

  def describe(self, final: bool = False) -> str:
    """What a call evaluates, for its line: "full corpus, 5,183 documents, 300 queries" or "candidates: BM25
    top-100 of 300 queries, 4,120 documents"."""
    return "; ".join(self.candidates.describe() if kind != "full" else
                     f"full corpus, {len(self.encoder.doc_ids):,} documents, {len(self.qids):,} queries"
                     for kind in self.kinds(final))

  def corpus_embeddings(self, params) -> np.ndarray:
    if self.doc_tower_frozen:
      if self._fixed_emb is None:
        self._fixed_emb = self.encoder.corpus(params, progress=True, shards_dir=self._shards_dir)
      return self._fixed_emb
    return self.encoder.corpus(params, progress=True, shards_dir=self._shards_dir)

  def search_factory(self, factory: str, doc_emb, query_emb: np.ndarray, k: int, first: bool):
    """(rows [Q, k], scores) of the corpus's top k on `factory`, by row: no index holds ids or a copy of a
    Flat matrix. Flat is the exact search, on the mesh (eval.backend=jax, the first factory) or by faiss.knn
    over the vectors where they lie (memory-mapped shards); a compressed factory is a Faiss index of its
    codes, kept for every evaluation when the document tower is frozen."""
    if host_search.is_flat(factory):
      if first and self.fixed_corpus is not None:  # ADORE's matrix on the devices: its own placement
        corpus = self.fixed_corpus
        if k not in self._fixed_search:
          placed = topk.ShardedCorpus(corpus.device, corpus.bias, corpus.num_docs, "", corpus.block_rows)
          self._fixed_search[k] = topk.search_fn(placed, k, self.mesh)
        scores, rows = jax.device_get(self._fixed_search[k](np.asarray(query_emb, np.float32)))
        return np.asarray(rows, np.int32), np.asarray(scores, np.float32)
      backend = self.config.eval.backend if first else "faiss"
      return host_search.exact_top_rows(doc_emb, query_emb, k, backend, self.config.eval.corpus_dtype,
                                      mesh=self.mesh if backend == "jax" else None)
    index = self._fixed.get(factory)
    if index is None:
      index = host_search.HostIndex(doc_emb, factory, seed=self.config.seed)
      if self.doc_tower_frozen:
        self._fixed[factory] = index
    return index.search_scored(query_emb, k)

  @timings.timed("evaluate")
  def __call__(self, params, final: bool = False) -> dict[str, float]:
    query_emb = self.encoder.queries(params, self.qids)
    results, doc_emb = {}, None
    for kind in self.kinds(final):
      if kind == "full":
        doc_emb = self.corpus_embeddings(params)
        results.update(self._full_corpus(params, doc_emb, query_emb))
      else:
        results.update(self._on_candidates(params, query_emb, doc_emb))
    return results

  def _full_corpus(self, params, doc_emb: np.ndarray, query_emb: np.ndarray) -> dict[str, float]:
    qrels = {q: self.data.eval_qrels[q] for q in self.qids}
    results = {}
    k = min(self.config.eval.top_k, len(self.encoder.doc_ids))
    for i, factory in enumerate(self.factories):
      rows, scores = self.search_factory(factory, doc_emb, query_emb, k, i == 0)
      run = {q: {self.encoder.doc_ids[int(r)]: float(v) for r, v in zip(row, score) if r >= 0}
             for q, row, score in zip(self.qids, rows, scores)}
      scored = metrics_lib.evaluate(qrels, run, self.metric_names)
      prefix = "" if i == 0 else f"{factory}/"
      results.update({prefix + k: v for k, v in scored.items()})
    for dim in (m for m in self.matryoshka_dims if m < query_emb.shape[1]):
      cut = functools.partial(prefix_vectors, dim=dim, normalize=self.encoder._model.query.normalize)
      rows, scores = host_search.exact_top_rows(cut(doc_emb), cut(query_emb), k, "faiss", "float32")
      run = {q: {self.encoder.doc_ids[int(r)]: float(v) for r, v in zip(row, score) if r >= 0}
             for q, row, score in zip(self.qids, rows, scores)}
      results.update({f"dim{dim}/{name}": v for name, v in metrics_lib.evaluate(qrels, run, self.metric_names).items()})
    if self.diagnostics is not None:
      results.update(self.diagnostics(params, doc_emb))
    if self._shards_dir is not None and not self.doc_tower_frozen and jax.process_index() == 0:
      # Finished: nothing left to resume (a frozen tower's shards are its vectors, mapped, for every evaluation).
      self._shards_dir.rmtree(missing_ok=True)
    return results

  def _on_candidates(self, params, query_emb: np.ndarray, doc_emb: np.ndarray | None) -> dict[str, float]:
    cands = self.candidates
    whole = doc_emb if doc_emb is not None else self._fixed_emb  # this call's corpus vectors, or the fixed ones
    if whole is not None:
      vectors = whole[cands.unique]
    elif self._candidate_emb is not None:
      vectors = self._candidate_emb
    else:
      if self._candidate_tokens is None:
        self._candidate_tokens = eval_candidates.tokenize(self.encoder.doc_tokenizer, self.data.corpus,
                                                          self.encoder.doc_ids, cands.unique,
                                                          self.encoder.doc_max_length)
      vectors = self.encoder.documents(params, self._candidate_tokens)
      if self.doc_tower_frozen:
        self._candidate_emb = vectors
    run = eval_candidates.rerank(cands, self.qids, query_emb, vectors, self.encoder.doc_ids,
                                 self.config.eval.top_k)
    scored = metrics_lib.evaluate({q: self.data.eval_qrels[q] for q in self.qids}, run, self.metric_names)
    return {cands.prefix + k: v for k, v in scored.items()}


class BM25IndexOf:
  """The corpus's BM25 index, looked up once and shared (the evaluation's candidates, the diagnostics): the
  one the BM25 negatives already hold, else this process's or `cache_dir`'s (`jdr.retrieval.bm25`), built only when
  there is none. Once, because naming a corpus's index hashes all of its texts."""

  def __init__(self, data, negatives, cache_dir=None):
    self.data, self.negatives, self.cache_dir = data, negatives, cache_dir
    self._index = None

  def __call__(self):
    if self._index is None:
      from jdr.retrieval import bm25  # pylint: disable=g-import-not-at-top  (only BM25 users need numba)
      index = sampled.bm25_index_of(getattr(self.negatives, "sampler", None))
      if index is None:
        index = bm25.corpus_index(self.data.corpus, cache_dir=self.cache_dir)
      if len(index) != len(self.data.corpus):
        raise ValueError(f"the BM25 index holds {len(index)} documents, the corpus {len(self.data.corpus)}")
      self._index = index
    return self._index


class TrainingDiagnostics:
  """The papers' diagnostics, from the corpus encoding of each evaluation, on a fixed sample of training
  queries: overlap of the model's real-time top-n with BM25's top-n (LTRe Fig. 3c), and with the
  negatives in use (STAR Fig. 4a: how far static or refreshed negatives lag the model).

  BM25's top-n is retrieved once, from `bm25_index()` (a `BM25IndexOf`, shared with the evaluation's
  candidates): the index the BM25 negatives already hold, else this process's or `cache_dir`'s index of the
  corpus (`jdr.retrieval.bm25`), built only when there is none."""

  def __init__(self, encoder: tower_encoder.TowerEncoder, data, negatives, config: ml_collections.ConfigDict, *,
               cache_dir=None, bm25_index: Callable | None = None):
    self.encoder, self.data, self.negatives = encoder, data, negatives
    self.n = sources.depth(config.negatives)
    train_qids = sorted(q for q, docs in data.train_qrels.items() if any(r > 0 for r in docs.values()))
    self.qids = train_qids[:config.eval.diagnostic_queries] if config.eval.diagnostic_queries else []
    self.cache_dir = cache_dir
    self.bm25_index = bm25_index or BM25IndexOf(data, negatives, cache_dir)
    self._bm25 = None

  def bm25_rows(self) -> np.ndarray:
    if self._bm25 is None:
      from jdr.retrieval import bm25  # pylint: disable=g-import-not-at-top  (only BM25 users need numba)
      index = self.bm25_index()
      if len(index) != len(self.encoder.doc_ids):
        raise ValueError(f"the BM25 index holds {len(index)} documents, the encoded corpus "
                         f"{len(self.encoder.doc_ids)}")
      self._bm25, _ = bm25.search(index, [self.data.queries[q] for q in self.qids],
                                  min(self.n, len(self.encoder.doc_ids)))
    return self._bm25

  @timings.timed("diagnostics")
  def __call__(self, params, doc_emb: np.ndarray) -> dict[str, float]:
    if not self.qids:
      return {}
    n = min(self.n, len(doc_emb))
    rows, _ = host_search.exact_top_rows(doc_emb, self.encoder.queries(params, self.qids), n)
    out = {f"overlap_bm25@{n}": retrieved.overlap(rows, self.bm25_rows()[:, :n])}
    if self.negatives is not None and self.negatives.pools_in_use is not None:
      out[f"overlap_negatives@{n}"] = retrieved.overlap(rows, self.negatives.pools_in_use(self.qids)[:, :n])
    return out


def prefix_vectors(x: np.ndarray, dim: int, normalize: bool) -> np.ndarray:
  """The first `dim` dimensions of [n, D] vectors as float32, L2-normalized again when the towers normalize."""
  x = np.asarray(x[:, :dim], np.float32)
  if normalize:
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
  return x


def _split_factories(text: str) -> list[str]:
  """Factory strings contain commas themselves; entries are separated by ';'."""
  return [t for t in (text or "").split(";") if t.strip()]


class RerankEvaluator:
  """A cross-encoder's evaluation: rerank the top `eval.rerank_depth` of a first-stage run for the eval
  queries (eval.rerank_run, a TREC file; "" = BM25 over the corpus, mined once) and score the result.

  Documents below the depth keep their first-stage order, so the metrics at depths the reranking does not
  reach are the first stage's.
  """

  def __init__(self, model, tokenizer, data, config: ml_collections.ConfigDict):
    self.model, self.tokenizer, self.data, self.config = model, tokenizer, data, config
    self.metric_names = [m.strip() for m in config.eval.metrics.split(",") if m.strip()]
    for name in self.metric_names:
      metrics_lib.parse_metric(name)
    qids = sorted(data.eval_qrels or {})
    if config.eval.max_queries:
      qids = qids[:config.eval.max_queries]
    self.qids = qids
    self.depth = config.eval.rerank_depth
    if config.eval.rerank_run:
      run = formats.read_run(config.eval.rerank_run)
      missing = [q for q in qids if q not in run]
      if missing:
        raise ValueError(f"eval.rerank_run={config.eval.rerank_run}: no ranking for {len(missing)} of the "
                         f"{len(qids)} evaluation queries (e.g. {missing[:3]})")
      self.first_stage = {q: run[q] for q in qids}
    else:
      self.first_stage = self._bm25(max(self.depth, config.eval.top_k))
    reranking.check_inputs(self.first_stage, data.queries, data.corpus, self.depth,
                           config.eval.rerank_run or "BM25 first stage")

  def _bm25(self, k: int) -> dict:
    return sampled.bm25_run(self.data.corpus, self.data.queries, self.qids, k)

  def describe(self, final: bool = False) -> str:
    del final  # every evaluation of a cross-encoder is this one
    first = pathlib.Path(self.config.eval.rerank_run).name if self.config.eval.rerank_run else "BM25"
    return f"reranking: {first} top-{self.depth} of {len(self.qids):,} queries"

  def __call__(self, params, final: bool = False) -> dict[str, float]:
    del final
    score = reranking.make_scorer(self.model, params, self.tokenizer, max_length=self.config.data.doc_max_length,
                                  batch_size=self.config.eval.rerank_batch_size or None,
                                  query_max_length=self.config.data.query_max_length)
    run = reranking.rerank(self.first_stage, self.data.queries, self.data.corpus, score, self.depth)
    qrels = {q: self.data.eval_qrels[q] for q in self.qids}
    return metrics_lib.evaluate(qrels, run, self.metric_names)


def metrics_line(title: str, scores: dict[str, float]) -> str:
  return f"{title}: " + "  ".join(f"{k}={v:.4f}" for k, v in scores.items())


def print_metrics(title: str, scores: dict[str, float]) -> None:
  if jax.process_index() == 0:
    print(metrics_line(title, scores), flush=True, file=sys.stdout)
