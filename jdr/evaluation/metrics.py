"""Ranking metrics on plain dict qrels and runs, equal per query to trec_eval's (pytrec_eval's).

  qrels: {qid: {docid: grade}}   grade > 0 is relevant; grade <= 0 (or unjudged) is irrelevant.
  run:   {qid: {docid: score}}   higher scores rank first.

Conventions, all chosen to match trec_eval so numbers are comparable with published tables:

* Ranking order: score descending, ties broken by docid descending (trec_eval sorts that way; Python's
  str order equals strcmp on UTF-8 bytes).
* `@k` cuts the ranking at its first k documents. "mrr@k" is trec_eval's recip_rank on the run cut to k;
  "map@k" is map_cut_k (precisions summed over the top k, divided by *all* relevant documents, not
  min(k, R)); "precision@k" divides by k even when fewer than k documents were retrieved (P_k);
  "recall@k" is recall_k; "ndcg@k" is ndcg_cut_k with gain = grade (negative grades count as 0), a
  log2(rank + 1) discount, and the ideal ranking built from all judged documents of the query.
* Which queries are averaged: queries in qrels with at least one relevant document. trec_eval scores a
  query without relevant documents as 0 for every metric, so averaging pytrec_eval's output counts it;
  here it is skipped because its recall/ndcg are undefined, and counting it as 0 would penalise every
  system equally. Queries in the run but not in qrels are ignored (as trec_eval does). A qrels query
  with no run entry is skipped with `missing="skip"` (the default: trec_eval without -c, and what BEIR
  reports, since BEIR averages pytrec_eval's per-query output) or scored as an empty ranking -- 0 for
  every metric -- with `missing="zero"` (trec_eval -c). A run entry with an empty dict is "present" and
  scores 0, as in pytrec_eval.

Pairwise errors (STAR paper, Zhan et al. 2021, Sec. 3-4 and Table 1): the loss of Eq. 2 is
1[f(q, d+) < f(q, d-)], and a query's total pairwise errors are the number of (relevant, irrelevant)
pairs ranked wrongly, which Eq. 5 writes as the sum over relevant d+ of pi(d+) - delta(d+) - 1: the number
of irrelevant documents ranked above d+. Top-K pairwise errors (Eq. 6) count only pairs whose irrelevant
document is among the K highest-ranked irrelevant documents, which equals
sum over d+ of min(irrelevant above d+, K); note that K counts *irrelevant* documents, not rank positions.
The paper's Table 1 reports both as means over queries (K = 200). Here:
* "pairwise_errors" and "pairwise_errors@K" follow those definitions on the run's ranking (ties broken
  by the trec_eval order above, so each pair is either right or wrong);
* irrelevant = every ranked document whose grade is <= 0 or that is unjudged (D- = C minus D+);
* a relevant document missing from the run is treated as ranked below every ranked document, so it
  contributes (irrelevant documents in the run) errors, capped at K for "@K". With a run cut at depth n,
  the total is therefore a lower bound, exact when the run ranks every relevant document (e.g. a
  full-corpus ranking); "@K" is exact whenever the run holds at least K irrelevant documents.
"""

from __future__ import annotations

import heapq
import math
import re
from typing import Callable, Literal, Mapping

import numpy as np

Qrels = Mapping[str, Mapping[str, int]]
Run = Mapping[str, Mapping[str, float]]
# A per-query metric sees the grades of the ranked documents (rank order, unjudged = 0) and the grades
# of every judged document of the query.
MetricFn = Callable[[np.ndarray, np.ndarray], float]

_FAMILIES = ("ndcg", "mrr", "recall", "map", "precision", "pairwise_errors")
# Families where a bare name (no @k) is meaningful: the whole ranking.
_NEEDS_K = ("precision",)
_NAME_RE = re.compile(r"^([a-z_]+?)(?:@(\d+))?$")
VALID_METRICS = (
    "ndcg", "ndcg@k", "mrr", "mrr@k", "recall", "recall@k", "map", "map@k", "precision@k",
    "pairwise_errors", "pairwise_errors@k")


def ranking(scores: Mapping[str, float]) -> list[str]:
  """Docids in trec_eval order: score descending, then docid descending."""
  return [d for d, _ in sorted(scores.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)]


def _top(scores: Mapping[str, float], depth: int | None) -> list[str]:
  if depth is None or depth >= len(scores):
    return ranking(scores)
  # nlargest on the same key gives the same prefix as a full sort, in O(n log depth).
  return [d for d, _ in heapq.nlargest(depth, scores.items(), key=lambda kv: (kv[1], kv[0]))]


def _cut(ranked: np.ndarray, k: int | None) -> np.ndarray:
  return ranked if k is None else ranked[:k]


def reciprocal_rank(ranked: np.ndarray, judged: np.ndarray, k: int | None = None) -> float:
  """1 / rank of the first relevant document within the top k (0 if none)."""
  hits = np.flatnonzero(_cut(ranked, k) > 0)
  return 1.0 / float(hits[0] + 1) if hits.size else 0.0


def recall(ranked: np.ndarray, judged: np.ndarray, k: int | None = None) -> float:
  """Relevant documents in the top k over all relevant documents of the query."""
  num_rel = int(np.sum(judged > 0))
  return float(np.sum(_cut(ranked, k) > 0)) / num_rel if num_rel else 0.0


def precision(ranked: np.ndarray, judged: np.ndarray, k: int) -> float:
  """Relevant documents in the top k over k (trec_eval's P_k: short runs are not excused)."""
  return float(np.sum(ranked[:k] > 0)) / k


def average_precision(ranked: np.ndarray, judged: np.ndarray, k: int | None = None) -> float:
  """Sum of precision at each relevant rank within the top k, over all relevant documents."""
  num_rel = int(np.sum(judged > 0))
  if not num_rel:
    return 0.0
  hits = _cut(ranked, k) > 0
  ranks = np.flatnonzero(hits) + 1
  return float(np.sum(np.arange(1, ranks.size + 1) / ranks)) / num_rel


def ndcg(ranked: np.ndarray, judged: np.ndarray, k: int | None = None) -> float:
  """Normalised DCG with gain = grade (negative grades 0) and a log2(rank + 1) discount."""
  gains = np.maximum(_cut(ranked, k), 0).astype(np.float64)
  ideal = np.sort(np.maximum(judged, 0).astype(np.float64))[::-1]
  ideal = _cut(ideal, k)
  idcg = float(np.sum(ideal / np.log2(np.arange(2, ideal.size + 2))))
  if idcg <= 0:
    return 0.0
  return float(np.sum(gains / np.log2(np.arange(2, gains.size + 2)))) / idcg


def pairwise_errors(ranked: np.ndarray, judged: np.ndarray, k: int | None = None) -> float:
  """(relevant, irrelevant) pairs in the wrong order; with k, only the k top irrelevant docs count.

  See the module docstring for how relevant documents missing from the run are counted.
  """
  rel = ranked > 0
  # Irrelevant documents above each ranked relevant one.
  above = np.cumsum(~rel)[rel]
  num_missing = int(np.sum(judged > 0)) - int(np.sum(rel))
  # Unjudged-but-relevant cannot exist (relevance comes from qrels), so num_missing >= 0.
  above = np.concatenate([above, np.full(max(num_missing, 0), np.sum(~rel))])
  if k is not None:
    above = np.minimum(above, k)
  return float(np.sum(above))


def parse_metric(name: str) -> tuple[str, int | None]:
  """"ndcg@10" -> ("ndcg", 10); a ValueError listing the valid names for anything else."""
  match = _NAME_RE.match(name.strip().lower())
  family, k = (match.group(1), match.group(2)) if match else (None, None)
  if family not in _FAMILIES or (k is not None and int(k) < 1) or (family in _NEEDS_K and k is None):
    raise ValueError(
        f"unknown metric {name!r}; valid metrics: {', '.join(VALID_METRICS)} "
        "(k a positive integer, e.g. ndcg@10, mrr@10, recall@100, map@100, pairwise_errors@200)")
  return family, (int(k) if k is not None else None)


def metric_fn(name: str) -> MetricFn:
  """The per-query function for a metric name such as "ndcg@10"."""
  family, k = parse_metric(name)
  fn = {
      "ndcg": ndcg, "mrr": reciprocal_rank, "recall": recall, "map": average_precision,
      "precision": precision, "pairwise_errors": pairwise_errors,
  }[family]
  return lambda ranked, judged: fn(ranked, judged, k)


def _depth(names: list[str]) -> int | None:
  """How much of each ranking the metrics read; None = all of it."""
  depth = 0
  for name in names:
    family, k = parse_metric(name)
    # Without @k, and for pairwise errors at any k (irrelevant docs below rank k still count), the
    # whole ranking matters.
    if k is None or family == "pairwise_errors":
      return None
    depth = max(depth, k)
  return depth


def evaluate(
    qrels: Qrels,
    run: Run,
    metrics: list[str] | tuple[str, ...] | str,
    per_query: bool = False,
    missing: Literal["skip", "zero"] = "skip",
) -> dict[str, float] | dict[str, dict[str, float]]:
  """Scores a run against qrels.

  Args:
    qrels: {qid: {docid: grade}}.
    run: {qid: {docid: score}}.
    metrics: names such as ["ndcg@10", "mrr@10", "recall@100"] (or one comma-separated string).
    per_query: return {qid: {metric: value}} for every evaluated query instead of the means.
    missing: "skip" ignores qrels queries absent from the run (trec_eval, BEIR); "zero" scores them
      as empty rankings (trec_eval -c).

  Returns:
    {metric: mean over evaluated queries}, or the per-query values when per_query is True.

  Raises:
    ValueError: an unknown metric name, a bad `missing`, or no query to evaluate.
  """
  if isinstance(metrics, str):
    metrics = [m for m in metrics.split(",") if m.strip()]
  names = [m.strip() for m in metrics]
  if not names:
    raise ValueError("no metrics requested")
  if missing not in ("skip", "zero"):
    raise ValueError(f"missing must be 'skip' or 'zero', got {missing!r}")
  fns = {name: metric_fn(name) for name in names}
  depth = _depth(names)

  values: dict[str, dict[str, float]] = {}
  for qid, judgments in qrels.items():
    judged = np.fromiter(judgments.values(), dtype=np.int64, count=len(judgments))
    if not np.any(judged > 0):
      continue
    scores = run.get(qid)
    if scores is None:
      if missing == "skip":
        continue
      scores = {}
    ranked = np.array([judgments.get(d, 0) for d in _top(scores, depth)], dtype=np.int64)
    values[qid] = {name: fn(ranked, judged) for name, fn in fns.items()}

  if per_query:
    return values
  if not values:
    raise ValueError(
        f"no query to evaluate: {len(qrels)} qrels queries, {len(run)} run queries, "
        f"{sum(1 for q in qrels if q in run)} in both (queries without relevant documents are skipped)")
  return {name: float(np.mean([v[name] for v in values.values()])) for name in names}


def mean(per_query_values: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
  """Means of `evaluate(..., per_query=True)` output, metric by metric."""
  rows = list(per_query_values.values())
  if not rows:
    return {}
  return {name: float(np.mean([r[name] for r in rows])) for name in rows[0]}


def format_table(results: Mapping[str, float], num_queries: int | None = None) -> str:
  """A two-column text table of metric means."""
  width = max(len("metric"), *(len(n) for n in results))
  lines = [f"{'metric':<{width}}  value", f"{'-' * width}  {'-' * 10}"]
  for name, value in results.items():
    text = f"{value:.4f}" if math.isfinite(value) and abs(value) < 1e6 else f"{value:g}"
    lines.append(f"{name:<{width}}  {text}")
  if num_queries is not None:
    lines.append(f"({num_queries} queries)")
  return "\n".join(lines)
