"""jdr.retrieval.bm25 against a brute-force float64 BM25 written from Lucene's formula, over bm25s's own tokens."""

import collections
import json
import math
import tempfile
import types

import bm25s
import ml_collections
import numpy as np
import pytest
from bm25s.stopwords import STOPWORDS_EN

from jdr.retrieval import bm25
from jdr.runtime import paths
from jdr.data.formats import Doc
from jdr.negatives import sampled

K1, B = 0.9, 0.4


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch):
  """Each test starts as a new process would: no index open yet."""
  monkeypatch.setattr(bm25, "OPEN", {})


def _texts(n=60, seed=0):
  rng = np.random.default_rng(seed)
  vocab = [f"w{i:02d}" for i in range(40)] + ["the", "of", "and"]
  texts = []
  for _ in range(n):
    words = rng.choice(vocab, size=rng.integers(3, 15))
    texts.append(" ".join(w.upper() if rng.random() < 0.1 else w for w in words) + rng.choice([".", "!", ""]))
  texts[5] = texts[17]  # identical docs: an exact tie, which the lower row must win
  texts[8] = ""  # an empty doc
  texts[9] = "The and OF, of the."  # stopwords only
  texts[10] = "w01 w01 w01 w01 w01 w01 w01 w01 w01 w01 w01 w01 w01 w01 w01 w01 w02"  # long, saturated tf
  return texts


TEXTS = _texts()
QUERIES = ["w01 w02", "w03 w03 w07", "W05, w11 and the w12?", "nothing known here", "the of", "",
           TEXTS[5], TEXTS[10], "w39", "w00 w01 w02 w03 w04 w05 w06 w07 w08 w09"]


def _tokens(texts):
  return bm25s.tokenize(list(texts), stopwords="en", return_ids=False, show_progress=False, allow_empty=True)


def brute_force(texts, query, k1=K1, b=B):
  """{row: score} for every doc with a score > 0: sum over the query's tokens (repeats counted) of
  log(1 + (N - df + .5) / (df + .5)) * tf / (tf + k1 (1 - b + b |d| / avgdl)), in float64 loops."""
  docs = _tokens(texts)
  n = len(docs)
  avgdl = sum(map(len, docs)) / n
  scores = {}
  for row, doc in enumerate(docs):
    score = 0.0
    for t in _tokens([query])[0]:
      df = sum(t in d for d in docs)
      tf = doc.count(t)
      if tf:
        score += math.log(1 + (n - df + 0.5) / (df + 0.5)) * tf / (tf + k1 * (1 - b + b * len(doc) / avgdl))
    if score > 0:
      scores[row] = score
  return scores


def assert_top_k(rows, scores, oracle, k):
  """rows/scores [k] are `oracle`'s top k, best first, equal scores (within float32's error) by row, each row
  with its own score; -1 / 0 past the docs with a score."""
  expected = sorted((-s, r) for r, s in oracle.items())
  # Ties: scores equal up to float32 rounding form one group, ordered by row.
  groups = []
  for s, r in expected:
    if groups and abs(s - groups[-1][0]) <= 1e-6 * abs(s):
      groups[-1][1].append(r)
    else:
      groups.append((s, [r]))
  order = [r for _, members in groups for r in sorted(members)][:k]
  n = len(order)
  assert rows.dtype == np.int32 and scores.dtype == np.float32
  assert rows[:n].tolist() == order
  assert (rows[n:] == -1).all() and (scores[n:] == 0).all()
  np.testing.assert_allclose(scores[:n], [oracle[r] for r in order], rtol=1e-5)


def test_tokenization_is_bm25s():
  assert bm25.STOPWORDS == set(STOPWORDS_EN)
  texts = ["Hello, World! It's a TEST of the_system 42 x y", "ΟΔΟΣ ΟΔΟΣ. Straße İstanbul ǅemal", "",
           "tab\tand\nnewline\u2028sep", "nul\0inside text", "a I to", "café naïve coöperate résumé"]
  expected = _tokens(texts)
  assert [bm25.tokenize(t) for t in texts] == expected
  lengths, words, docs, terms, tfs = bm25.tokenize_chunk(texts)
  assert lengths.tolist() == [len(t) for t in expected]
  got = [collections.Counter() for _ in texts]
  for d, t, f in zip(docs, terms, tfs):
    got[d][words[t]] += int(f)
  assert got == [collections.Counter(t) for t in expected]


def test_bm25s_default_method_is_the_oracle_formula():
  """What the negatives were mined with before (bm25s, default method) is the formula tested here."""
  retriever = bm25s.BM25(k1=K1, b=B)
  assert retriever.method == "lucene"
  retriever.index(bm25s.tokenize(TEXTS, stopwords="en", show_progress=False), show_progress=False)
  for query in ["w01 w02", "w03 w03 w07"]:
    docs, scores = retriever.retrieve(bm25s.tokenize([query], stopwords="en", show_progress=False), k=5,
                                      show_progress=False)
    oracle = brute_force(TEXTS, query)
    for r, s in zip(docs[0], scores[0]):
      assert s == pytest.approx(oracle[r], rel=1e-5)


@pytest.mark.parametrize("k", [1, 4, 25, 100])
@pytest.mark.parametrize("block", [7, 64, None])
def test_top_k_equals_brute_force(k, block, monkeypatch):
  if block:  # docs scored a few at a time, as a large corpus is
    monkeypatch.setattr(bm25, "BLOCK", block)
  index = bm25.index_for(TEXTS, len(TEXTS), show_progress=False)
  rows, scores = bm25.search(index, QUERIES, k, n_threads=2)
  assert rows.shape == scores.shape == (len(QUERIES), k)
  for i, query in enumerate(QUERIES):
    assert_top_k(rows[i], scores[i], brute_force(TEXTS, query), k)
  assert (rows[QUERIES.index("nothing known here")] == -1).all()
  assert (rows[QUERIES.index("the of")] == -1).all() and (rows[QUERIES.index("")] == -1).all()


def test_ties_go_to_the_lower_row_on_any_threads(monkeypatch):
  monkeypatch.setattr(bm25, "BLOCK", 16)  # rows 5 and 17 in different blocks
  index = bm25.index_for(TEXTS, len(TEXTS), show_progress=False)
  rows, scores = bm25.search(index, [TEXTS[5]], 3, n_threads=1)
  assert rows[0, :2].tolist() == [5, 17] and scores[0, 0] == scores[0, 1]
  many = QUERIES * 7
  one, _ = bm25.search(index, many, 10, n_threads=1)
  two, _ = bm25.search(index, many, 10, n_threads=2)
  np.testing.assert_array_equal(one, two)


def _arrays(index):
  return {name: np.asarray(getattr(index, name)) for name in ("data", "indices", "indptr", "lengths")}


def test_worker_processes_build_the_same_index(tmp_path):
  texts = _texts(200, seed=1)
  inline = bm25.index_for(texts, len(texts), cache_dir=tmp_path / "a", workers=1, chunk_docs=1000,
                          show_progress=False)
  bm25.OPEN.clear()
  pooled = bm25.index_for(texts, len(texts), cache_dir=tmp_path / "b", workers=2, chunk_docs=7,
                          show_progress=False)
  for name, array in _arrays(inline).items():
    np.testing.assert_array_equal(array, _arrays(pooled)[name], err_msg=name)
  assert inline.vocab.keys() == pooled.vocab.keys()
  q = ["w01 w02", "w05 w33 w07"]
  np.testing.assert_array_equal(bm25.search(inline, q, 9)[0], bm25.search(pooled, q, 9)[0])


def test_the_corpus_comes_as_texts_and_a_count():
  stream = (t for t in TEXTS)
  with pytest.raises(ValueError, match="one-shot iterator"):
    bm25.index_for(stream, len(TEXTS))
  index = bm25.index_for((t for t in TEXTS), len(TEXTS), fingerprint=bm25.text_fingerprint(TEXTS, len(TEXTS)),
                         show_progress=False)
  assert len(index) == len(TEXTS)
  with pytest.raises(ValueError, match="gave 60 texts, not the 61"):
    bm25.index_for(TEXTS, len(TEXTS) + 1)
  with pytest.raises(ValueError, match="gave 60 texts, not the 59"):
    bm25.index_for((t for t in TEXTS), len(TEXTS) - 1, fingerprint="x", show_progress=False)


@pytest.fixture
def builds(monkeypatch):
  """How many times an index was built."""
  count = [0]
  build = bm25.build_index

  def counted(*args, **kwargs):
    count[0] += 1
    return build(*args, **kwargs)

  monkeypatch.setattr(bm25, "build_index", counted)
  return count


def test_index_cache_is_reused_and_keyed(tmp_path, builds):
  first = bm25.index_for(TEXTS, len(TEXTS), cache_dir=tmp_path, show_progress=False)
  assert builds[0] == 1 and first.path.parent == tmp_path
  assert bm25.index_for(TEXTS, len(TEXTS), show_progress=False) is first  # this process's, no cache needed
  bm25.OPEN.clear()  # a new process
  again = bm25.index_for(TEXTS, len(TEXTS), cache_dir=tmp_path, show_progress=False)
  assert builds[0] == 1 and again.path == first.path
  for name, array in _arrays(first).items():
    np.testing.assert_array_equal(array, _arrays(again)[name])
  # Another text, another k1 or b: another index.
  bm25.index_for(TEXTS[:-1] + ["changed"], len(TEXTS), cache_dir=tmp_path, show_progress=False)
  bm25.index_for(TEXTS, len(TEXTS), cache_dir=tmp_path, k1=1.2, show_progress=False)
  bm25.index_for(TEXTS, len(TEXTS), cache_dir=tmp_path, b=0.75, show_progress=False)
  assert builds[0] == 4
  entries = {p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")}  # locks: one builder at a time
  assert len(entries) == 4 and not list(tmp_path.glob("*.partial"))
  tuned = bm25.index_for(TEXTS, len(TEXTS), cache_dir=tmp_path, k1=1.2, show_progress=False)
  rows, scores = bm25.search(tuned, QUERIES[:3], 5)
  for i, query in enumerate(QUERIES[:3]):
    assert_top_k(rows[i], scores[i], brute_force(TEXTS, query, k1=1.2), 5)


class Killed(Exception):
  pass


def test_a_killed_build_resumes_at_its_last_chunk(tmp_path, monkeypatch, builds):
  texts = _texts(50, seed=2)
  tokenize = bm25.tokenize_chunk
  calls = [0]

  def dies_at_the_fourth(chunk):
    calls[0] += 1
    if calls[0] == 4:
      raise Killed
    return tokenize(chunk)

  monkeypatch.setattr(bm25, "tokenize_chunk", dies_at_the_fourth)
  with pytest.raises(Killed):
    bm25.index_for(texts, len(texts), cache_dir=tmp_path, chunk_docs=6, workers=1, show_progress=False)
  partial, = tmp_path.glob("*.partial")
  assert json.loads((partial / "progress.json").read_text())["docs"] == 18
  with open(partial / "terms.bin", "ab") as f:  # what a kill mid-chunk leaves after the last record
    f.write(b"junk")
  calls[0] = -100
  resumed = bm25.index_for(texts, len(texts), cache_dir=tmp_path, chunk_docs=6, workers=1, show_progress=False)
  assert calls[0] == -100 + 6  # chunks 4 to 9 only
  bm25.OPEN.clear()
  fresh = bm25.index_for(texts, len(texts), cache_dir=tmp_path / "fresh", show_progress=False)
  for name, array in _arrays(fresh).items():
    np.testing.assert_array_equal(array, _arrays(resumed)[name], err_msg=name)
  assert fresh.vocab == resumed.vocab and not list(tmp_path.glob("*.partial"))


def test_mining_is_cached_and_keyed(tmp_path):
  index = bm25.index_for(TEXTS, len(TEXTS), show_progress=False)
  queries = QUERIES * 3
  first = bm25.mine(index, queries, 6, tmp_path, chunk_size=4, show_progress=False)
  assert not first.from_cache and first.path.exists()
  direct, _ = bm25.search(index, queries, 6)
  np.testing.assert_array_equal(first.rows, direct)
  again = bm25.mine(index, queries, 6, tmp_path, show_progress=False)
  assert again.from_cache and again.path == first.path and isinstance(again.rows, np.memmap)
  np.testing.assert_array_equal(again.rows, first.rows)
  np.testing.assert_array_equal(again.scores, first.scores)
  assert not bm25.mine(index, queries, 7, tmp_path, show_progress=False).from_cache
  assert not bm25.mine(index, queries[:-1] + ["w01"], 6, tmp_path, show_progress=False).from_cache
  assert not bm25.mine(index, queries, 6, tmp_path, query_ids=[str(i) for i in range(len(queries))],
                       show_progress=False).from_cache
  other = bm25.index_for(TEXTS, len(TEXTS), k1=1.5, show_progress=False)
  assert not bm25.mine(other, queries, 6, tmp_path, show_progress=False).from_cache


def test_a_killed_mine_resumes_at_its_last_chunk(tmp_path, monkeypatch):
  index = bm25.index_for(TEXTS, len(TEXTS), show_progress=False)
  queries = [f"{q} w{i % 40:02d}" for i, q in enumerate(QUERIES * 4)]  # 40 queries, 10 chunks of 4
  expected = bm25.mine(index, queries, 8, show_progress=False)
  score = bm25.Scorer.__call__
  chunks, dying = [], [True]

  def dies_at_the_fourth(self, texts, k):
    chunks.append(texts[0])
    if dying[0] and len(chunks) == 4:
      raise Killed
    return score(self, texts, k)

  monkeypatch.setattr(bm25.Scorer, "__call__", dies_at_the_fourth)
  with pytest.raises(Killed):
    bm25.mine(index, queries, 8, tmp_path, chunk_size=4, show_progress=False)
  partial, = tmp_path.glob("*.partial")
  assert json.loads((partial / "progress.json").read_text())["chunks"] == 3
  chunks.clear()
  dying[0] = False
  # Restarted with another chunk size: the recorded one decides where the finished chunks end.
  resumed = bm25.mine(index, queries, 8, tmp_path, chunk_size=5, show_progress=False)
  assert chunks == [queries[i] for i in range(12, 40, 4)]
  np.testing.assert_array_equal(resumed.rows, expected.rows)
  np.testing.assert_array_equal(resumed.scores, expected.scores)
  assert not resumed.from_cache and not list(tmp_path.glob("*.partial"))


CORPUS = {f"d{i}": Doc(f"d{i}", "", t) for i, t in enumerate(TEXTS)}
QUERY_TEXTS = {f"q{i}": q for i, q in enumerate(QUERIES)}
QRELS = {f"q{i}": {f"d{i}": 1} for i in range(len(QUERIES))}


def _diagnostics(negatives, cache_dir=None, n=5):
  data = types.SimpleNamespace(corpus=CORPUS, queries=QUERY_TEXTS, train_qrels=QRELS)
  encoder = types.SimpleNamespace(doc_ids=list(CORPUS))
  # n: the pool depth of the run's source (jdr.negatives.sources.depth), here a dense_static pool's
  config = ml_collections.ConfigDict({"negatives": {"source": "dense_static", "dense_static": {"top_n": n}},
                                      "eval": {"diagnostic_queries": 6}})
  from jdr.evaluation import periodic  # pylint: disable=g-import-not-at-top  (imports JAX)
  return periodic.TrainingDiagnostics(encoder, data, negatives, config, cache_dir=cache_dir)


def test_the_evaluation_diagnostics_use_the_negatives_index(tmp_path, builds):
  source = sampled.BM25Negatives(CORPUS, QUERY_TEXTS, QRELS, top_k=4, cache_dir=tmp_path, show_progress=False)
  mixed = sampled.MixedNegatives([(source, 1), (sampled.RandomNegatives(CORPUS, QRELS), 1)])
  assert builds[0] == 1
  diagnostics = _diagnostics(types.SimpleNamespace(sampler=mixed, pools_in_use=None))
  rows = diagnostics.bm25_rows()
  assert builds[0] == 1 and rows.shape == (6, 5)
  for row, qid in zip(rows, diagnostics.qids):
    oracle = brute_force(TEXTS, QUERY_TEXTS[qid])
    top = sorted(oracle.values(), reverse=True)[:5]
    np.testing.assert_allclose([oracle[r] for r in row if r >= 0], top, rtol=1e-5)
  assert diagnostics.bm25_rows() is rows
  # Without BM25 negatives: this process's index of the corpus, else the cache's; never a build of its own.
  assert _diagnostics(None).bm25_rows().tolist() == rows.tolist()
  bm25.OPEN.clear()
  assert _diagnostics(None, cache_dir=tmp_path).bm25_rows().tolist() == rows.tolist()
  assert builds[0] == 1
  # bm25_run (the cross-encoder's BM25 first stage) shares it too.
  run = sampled.bm25_run(CORPUS, QUERY_TEXTS, ["q0", "q1"], 3)
  assert builds[0] == 1 and list(run["q0"]) == [f"d{r}" for r in rows[diagnostics.qids.index("q0"), :3]]


def test_an_object_storage_cache_is_built_locally_and_uploaded(tmp_path, monkeypatch, builds):
  """Memory maps need local disk: entries are built in a local folder, uploaded when finished, and a new
  machine downloads them instead of building (object storage played by a folder jdr.runtime.paths takes as remote)."""
  remote = tmp_path / "bucket"
  local = paths.is_local
  monkeypatch.setattr(paths, "is_local", lambda p: not str(p).startswith(str(remote)) and local(p))
  for machine in ("machine1", "machine2"):
    (tmp_path / machine).mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "machine1"))
  index = bm25.index_for(TEXTS, len(TEXTS), cache_dir=remote, show_progress=False)
  mined = bm25.mine(index, QUERIES, 5, remote, show_progress=False)
  assert index.path.is_relative_to(tmp_path / "machine1") and mined.path.is_relative_to(tmp_path / "machine1")
  assert {p.name for p in remote.iterdir()} == {index.path.name, mined.path.name}
  assert (remote / index.path.name / "data.npy").read_bytes() == (index.path / "data.npy").read_bytes()
  bm25.OPEN.clear()
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "machine2"))
  again = bm25.index_for(TEXTS, len(TEXTS), cache_dir=remote, show_progress=False)
  assert builds[0] == 1 and again.path.is_relative_to(tmp_path / "machine2")
  remined = bm25.mine(again, QUERIES, 5, remote, show_progress=False)
  assert remined.from_cache
  np.testing.assert_array_equal(remined.rows, mined.rows)


KILLED_MINE = """
import sys, time
from jdr.retrieval import bm25
texts, queries, cache = eval(sys.argv[1]), eval(sys.argv[2]), sys.argv[3]
index = bm25.index_for(texts, len(texts), cache_dir=cache, show_progress=False)
score = bm25.Scorer.__call__
def slowly(self, texts, k):
  time.sleep(0.3)  # time for the test to kill it between chunks, or in one
  return score(self, texts, k)
bm25.Scorer.__call__ = slowly
bm25.mine(index, queries, 8, cache, chunk_size=4, show_progress=False)
"""


def test_a_mine_killed_by_sigkill_resumes(tmp_path, monkeypatch):
  import os, signal, subprocess, sys, time  # pylint: disable=g-import-not-at-top,multiple-imports
  queries = [f"{q} w{i % 40:02d}" for i, q in enumerate(QUERIES * 4)]
  child = subprocess.Popen([sys.executable, "-c", KILLED_MINE, repr(TEXTS), repr(queries), str(tmp_path)])
  progress = None
  deadline = time.time() + 120
  while time.time() < deadline and child.poll() is None:
    found = list(tmp_path.glob("bm25-*-top8.partial/progress.json"))
    progress = json.loads(found[0].read_text()) if found else None
    if progress and progress["chunks"] >= 3:
      break
    time.sleep(0.05)
  os.kill(child.pid, signal.SIGKILL)
  child.wait()
  progress = json.loads(next(tmp_path.glob("bm25-*-top8.partial/progress.json")).read_text())
  assert 3 <= progress["chunks"] < 10, progress
  index = bm25.index_for(TEXTS, len(TEXTS), cache_dir=tmp_path, show_progress=False)
  expected = bm25.mine(index, queries, 8, show_progress=False)
  score, chunks = bm25.Scorer.__call__, []
  monkeypatch.setattr(bm25.Scorer, "__call__",
                      lambda self, texts, k: chunks.append(texts[0]) or score(self, texts, k))
  resumed = bm25.mine(index, queries, 8, tmp_path, show_progress=False)
  assert len(chunks) == 10 - progress["chunks"]
  np.testing.assert_array_equal(resumed.rows, expected.rows)
  np.testing.assert_array_equal(resumed.scores, expected.scores)
  assert not list(tmp_path.glob("*.partial"))
