"""jdr.evaluation.metrics against pytrec_eval (trec_eval) per query, and pairwise errors against brute force."""

import functools
import json
import math
import pathlib

import numpy as np
import pytest

from jdr.evaluation import metrics

pytrec_eval = pytest.importorskip("pytrec_eval")

# Our name -> trec_eval measure in pytrec_eval's output. "mrr@k" has no trec_eval measure: it is
# recip_rank on the run cut to k, checked separately.
TREC_NAMES = {
    "map": "map",
    "map@10": "map_cut_10",
    "map@100": "map_cut_100",
    "ndcg": "ndcg",
    "ndcg@5": "ndcg_cut_5",
    "ndcg@10": "ndcg_cut_10",
    "recall@10": "recall_10",
    "recall@100": "recall_100",
    "precision@5": "P_5",
    "precision@10": "P_10",
    "mrr": "recip_rank",
}
TREC_MEASURES = {"map", "map_cut.10,100", "ndcg", "ndcg_cut.5,10", "recall.10,100", "P.5,10", "recip_rank"}
MRR_CUTS = (1, 3, 10)


def _trec_order(scores):
  # Written out here rather than taken from jdr.evaluation.metrics so the reference does not share its code.
  return sorted(scores.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)


def _compare(qrels, run):
  """Asserts per-query equality with pytrec_eval; returns the largest absolute difference seen."""
  names = list(TREC_NAMES) + [f"mrr@{k}" for k in MRR_CUTS]
  ours = metrics.evaluate(qrels, run, names, per_query=True)
  theirs = pytrec_eval.RelevanceEvaluator(qrels, TREC_MEASURES).evaluate(run)
  cut_theirs = {
      k: pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(
          {q: dict(_trec_order(s)[:k]) for q, s in run.items()})
      for k in MRR_CUTS}
  expected_qids = {q for q, j in qrels.items() if q in run and any(g > 0 for g in j.values())}
  assert set(ours) == expected_qids
  worst = 0.0
  for qid in expected_qids:
    for name, trec in TREC_NAMES.items():
      diff = abs(ours[qid][name] - theirs[qid][trec])
      assert diff < 1e-6, (qid, name, ours[qid][name], theirs[qid][trec])
      worst = max(worst, diff)
    for k in MRR_CUTS:
      diff = abs(ours[qid][f"mrr@{k}"] - cut_theirs[k][qid]["recip_rank"])
      assert diff < 1e-6, (qid, k)
      worst = max(worst, diff)
  # The means are plain means of those per-query values.
  means = metrics.evaluate(qrels, run, names)
  for name, trec in TREC_NAMES.items():
    ref = np.mean([theirs[q][trec] for q in expected_qids])
    assert abs(means[name] - ref) < 1e-9
  return worst


def _brute_pairwise(qrels_q, scores, k=None):
  """STAR Eq. 5/6 read literally: count (d+, d-) pairs with d- ranked above d+; with k, only d- at or
  above the k-th irrelevant document. Relevant docs missing from the run rank below the whole run."""
  order = [d for d, _ in _trec_order(scores)]
  pos = {d: i for i, d in enumerate(order)}
  negatives = [d for d in order if qrels_q.get(d, 0) <= 0]
  k_q = math.inf if k is None or len(negatives) < k else pos[negatives[k - 1]]
  errors = 0
  for dp, grade in qrels_q.items():
    if grade <= 0:
      continue
    p = pos.get(dp, math.inf)
    for dn in negatives:
      if pos[dn] < p and pos[dn] <= k_q:
        errors += 1
  return errors


def _check_pairwise(qrels, run, ks=(1, 10, 200)):
  names = ["pairwise_errors"] + [f"pairwise_errors@{k}" for k in ks]
  ours = metrics.evaluate(qrels, run, names, per_query=True)
  for qid, values in ours.items():
    assert values["pairwise_errors"] == _brute_pairwise(qrels[qid], run[qid]), qid
    for k in ks:
      assert values[f"pairwise_errors@{k}"] == _brute_pairwise(qrels[qid], run[qid], k), (qid, k)
  return ours


def _random_runs(qrels, doc_pool, rng, *, num_levels):
  """A run with many ties (scores from num_levels values), judged and unjudged docs, some queries
  absent, some present with an empty ranking, and docids whose string and numeric orders differ."""
  run = {}
  for qid, judged in qrels.items():
    r = rng.random()
    if r < 0.05:
      continue
    if r < 0.08:
      run[qid] = {}
      continue
    docs = {str(d) for d in rng.choice(doc_pool, size=int(rng.integers(1, 60)), replace=False)}
    docs |= {d for d in judged if rng.random() < 0.7}
    run[qid] = {d: float(rng.integers(0, num_levels)) / num_levels for d in docs}
  run["not-in-qrels"] = {str(doc_pool[0]): 1.0}
  return run


def _graded_qrels(rng, num_queries=60, num_docs=400):
  doc_pool = np.array([f"d{i}" for i in range(num_docs)])
  qrels = {}
  for q in range(num_queries):
    docs = rng.choice(doc_pool, size=int(rng.integers(1, 25)), replace=False)
    # Grades 0-3 plus an occasional -1: trec_eval gives negative grades zero gain.
    qrels[f"q{q}"] = {str(d): int(rng.choice([-1, 0, 0, 1, 2, 3])) for d in docs}
  qrels["all-irrelevant"] = {"d1": 0, "d2": 0}
  return qrels, doc_pool


@functools.lru_cache(maxsize=1)
def _scifact_bm25(root: pathlib.Path):
  """SciFact test qrels and a BM25 top-100 run of its queries (bm25s, title + text)."""
  bm25s = pytest.importorskip("bm25s")
  try:
    from jdr.data.formats import read_corpus, read_qrels, read_queries
    corpus = read_corpus(root / "corpus.jsonl")
    texts = {i: f"{d.title} {d.text}" for i, d in corpus.items()}
    queries = read_queries(root / "queries.jsonl")
    qrels = read_qrels(root / "qrels" / "test.tsv")
  except ImportError:  # jdr.data.formats is written by another worker; a minimal BEIR reader meanwhile.
    texts = {}
    for line in open(root / "corpus.jsonl", encoding="utf-8"):
      doc = json.loads(line)
      texts[doc["_id"]] = f"{doc.get('title', '')} {doc['text']}"
    queries = {}
    for line in open(root / "queries.jsonl", encoding="utf-8"):
      q = json.loads(line)
      queries[q["_id"]] = q["text"]
    qrels = {}
    for line in list(open(root / "qrels" / "test.tsv", encoding="utf-8"))[1:]:
      qid, did, grade = line.rstrip("\n").split("\t")
      qrels.setdefault(qid, {})[did] = int(grade)
  doc_ids = list(texts)
  retriever = bm25s.BM25()
  retriever.index(bm25s.tokenize(list(texts.values()), stopwords="en", show_progress=False),
                  show_progress=False)
  qids = list(qrels)
  idx, scores = retriever.retrieve(
      bm25s.tokenize([queries[q] for q in qids], stopwords="en", show_progress=False),
      k=100, show_progress=False, n_threads=1)
  run = {q: {doc_ids[j]: float(s) for j, s in zip(idx[i], scores[i])} for i, q in enumerate(qids)}
  return qrels, run, np.array(doc_ids)


def test_scifact_bm25_matches_pytrec_eval(scifact):
  qrels, run, _ = _scifact_bm25(scifact)
  assert len(qrels) == 300
  worst = _compare(qrels, run)
  result = metrics.evaluate(qrels, run, ["ndcg@10", "mrr@10", "recall@100", "map", "pairwise_errors@10"])
  print(f"SciFact BM25 top-100: {result}; max |diff| vs pytrec_eval {worst:.2e}")
  # Published BM25 nDCG@10 on SciFact is about 0.67; bm25s's tokenisation lands close.
  assert 0.55 < result["ndcg@10"] < 0.8
  _check_pairwise(qrels, run)


def test_scifact_random_runs_with_ties_match_pytrec_eval(scifact):
  qrels, _, doc_ids = _scifact_bm25(scifact)
  rng = np.random.default_rng(0)
  worst = 0.0
  for num_levels in (2, 5, 1000):
    run = _random_runs(qrels, doc_ids, rng, num_levels=num_levels)
    worst = max(worst, _compare(qrels, run))
    _check_pairwise(qrels, run)
  print(f"SciFact random runs with ties: max |diff| vs pytrec_eval {worst:.2e}")


def test_graded_qrels_match_pytrec_eval():
  rng = np.random.default_rng(1)
  worst = 0.0
  for num_levels in (3, 50):
    qrels, doc_pool = _graded_qrels(rng)
    run = _random_runs(qrels, doc_pool, rng, num_levels=num_levels)
    worst = max(worst, _compare(qrels, run))
    _check_pairwise(qrels, run)
  print(f"graded qrels: max |diff| vs pytrec_eval {worst:.2e}")


def test_pairwise_errors_by_hand():
  # Ranking n1 r1 n2 n3 r2; r3 is relevant but not retrieved; n* irrelevant (n3 judged 0).
  qrels = {"q": {"r1": 1, "r2": 2, "r3": 1, "n3": 0}}
  run = {"q": {"n1": 5.0, "r1": 4.0, "n2": 3.0, "n3": 2.0, "r2": 1.0}}
  got = metrics.evaluate(qrels, run, ["pairwise_errors", "pairwise_errors@2", "pairwise_errors@1"])
  # r1: 1 irrelevant above; r2: 3; r3 (missing): all 3 irrelevant in the run.
  assert got == {"pairwise_errors": 7.0, "pairwise_errors@2": 5.0, "pairwise_errors@1": 3.0}


def test_query_selection_conventions():
  qrels = {"a": {"x": 1}, "b": {"y": 1}, "none-relevant": {"x": 0}}
  run = {"a": {"x": 1.0}, "none-relevant": {"x": 1.0}, "extra": {"x": 1.0}}
  # Only "a" is both in the run and has a relevant document.
  assert metrics.evaluate(qrels, run, ["mrr@10"]) == {"mrr@10": 1.0}
  assert metrics.evaluate(qrels, run, ["mrr@10"], missing="zero") == {"mrr@10": 0.5}
  per_query = metrics.evaluate(qrels, run, "mrr@10,recall@10", per_query=True, missing="zero")
  assert per_query == {"a": {"mrr@10": 1.0, "recall@10": 1.0}, "b": {"mrr@10": 0.0, "recall@10": 0.0}}
  assert metrics.mean(per_query) == {"mrr@10": 0.5, "recall@10": 0.5}
  with pytest.raises(ValueError, match="no query to evaluate"):
    metrics.evaluate(qrels, {"extra": {"x": 1.0}}, ["map"])


def test_ties_break_by_docid_descending():
  qrels = {"q": {"a": 1}}
  run = {"q": {"a": 1.0, "b": 1.0, "c": 1.0}}
  assert metrics.ranking(run["q"]) == ["c", "b", "a"]
  assert metrics.evaluate(qrels, run, ["mrr@10", "mrr@2"]) == {"mrr@10": 1 / 3, "mrr@2": 0.0}


@pytest.mark.parametrize("name", ["ndcg10", "mrr@0", "precision", "foo@3", "recall@x", "map@-1", ""])
def test_unknown_metric_names_list_valid_ones(name):
  with pytest.raises(ValueError, match="valid metrics: .*ndcg@k"):
    metrics.evaluate({"q": {"d": 1}}, {"q": {"d": 1.0}}, [name] if name else [" "])


def test_format_table():
  table = metrics.format_table({"ndcg@10": 0.5, "pairwise_errors": 1234.5}, num_queries=3)
  assert "ndcg@10" in table and "0.5000" in table and "1234.5000" in table and "3 queries" in table
