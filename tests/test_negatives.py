"""Negative sources and the batch candidate mask, on a tiny generated corpus."""

import math
import os

import bm25s
import numpy as np
import pytest

from jdr.retrieval import bm25 as bm25_lib
from jdr.data.formats import Doc, write_run
from jdr.data.text import doc_text
from jdr.negatives import (BM25Negatives, MixedNegatives, RandomNegatives, StaticNegatives, candidate_mask,
                           positive_ids)

N_DOCS = 50


def _corpus():
  rng = np.random.default_rng(0)
  vocab = [f"w{i:03d}" for i in range(120)]
  corpus = {}
  for i in range(N_DOCS):
    title = " ".join(rng.choice(vocab, size=2, replace=False))
    text = " ".join(rng.choice(vocab, size=8, replace=False))
    corpus[f"d{i}"] = Doc(f"d{i}", title, text)
  # Query qi is doc di's own text, so di must rank first for it.
  queries = {f"q{i}": doc_text(corpus[f"d{i}"]) for i in range(20)}
  qrels = {f"q{i}": {f"d{i}": 1} for i in range(20)}
  for i in range(0, 20, 3):
    qrels[f"q{i}"][f"d{i + 25}"] = 2  # a second positive
    qrels[f"q{i}"][f"d{i + 1}"] = 0  # judged non-relevant: a legitimate negative
  # A rare-word query: few BM25 candidates, so sampling must top up with random docs.
  rare = corpus["d30"].text.split()[0]
  queries["qrare"] = rare
  qrels["qrare"] = {"d30": 1}
  queries["qnone"] = "no positives here"
  qrels["qnone"] = {"d1": 0}
  queries["q_other_split"] = "never mined"
  return corpus, queries, qrels


CORPUS, QUERIES, QRELS = _corpus()
TRAIN = [q for q in QRELS if q != "qnone"]


def _all_positives(qid):
  return {d for d, r in QRELS[qid].items() if r > 0}


@pytest.fixture(scope="module")
def bm25(tmp_path_factory):
  return BM25Negatives(CORPUS, QUERIES, QRELS, top_k=10, cache_dir=tmp_path_factory.mktemp("bm25"),
                       show_progress=False)


def _check_rows(rows, qids, n, pool=None):
  assert len(rows) == len(qids)
  for qid, row in zip(qids, rows):
    assert len(row) == n and len(set(row)) == n, row
    assert not set(row) & _all_positives(qid)
    assert all(d in CORPUS for d in row)
    if pool is not None:
      assert set(row) <= set(pool(qid))


def test_positive_ids_errors_name_the_query():
  assert positive_ids(QRELS, "q0") == ["d0", "d25"]
  with pytest.raises(ValueError, match="'qnone' has no positive"):
    positive_ids(QRELS, "qnone")
  with pytest.raises(KeyError, match="'missing' is not in the qrels"):
    positive_ids(QRELS, "missing")


def test_random_negatives_exclude_positives_and_are_deterministic():
  source = RandomNegatives(list(CORPUS), QRELS)
  qids = TRAIN * 3
  pos = [positive_ids(QRELS, q)[0] for q in qids]
  rows = source.sample(qids, pos, np.random.default_rng(1), 8)
  _check_rows(rows, qids, 8)
  assert rows == source.sample(qids, pos, np.random.default_rng(1), 8)
  assert rows != source.sample(qids, pos, np.random.default_rng(2), 8)
  # Uniform over the non-positives (judged non-relevant d1 included): every one of them turns up.
  seen = {d for _ in range(20) for row in source.sample(["q0"], ["d0"], np.random.default_rng(_), 20) for d in row}
  assert seen == set(CORPUS) - _all_positives("q0")
  # The batch's positive is excluded even when the qrels do not list it; `exclude` is honoured too.
  row = source.sample(["q1"], ["d7"], np.random.default_rng(0), 47, exclude=[{"d8"}])[0]
  assert not {"d1", "d7", "d8"} & set(row)


def test_random_negatives_errors():
  source = RandomNegatives(CORPUS, QRELS)
  with pytest.raises(ValueError, match="'qnone' has no positive"):
    source.sample(["qnone"], ["d1"], np.random.default_rng(0), 2)
  with pytest.raises(ValueError, match="wanted 49 negatives"):
    source.sample(["q0"], ["d0"], np.random.default_rng(0), 49)
  assert source.sample(["q0"], ["d0"], np.random.default_rng(0), 0) == [[]]


def _brute_force_bm25(query, k1=0.9, b=0.4):
  """Lucene BM25 (idf log(1 + (N - df + .5) / (df + .5)), tf / (tf + k1 (1 - b + b dl / avgdl))) by loops over
  bm25s's own tokens, so only the scoring and the top-k are under test."""
  docs = bm25s.tokenize([doc_text(d) for d in CORPUS.values()], stopwords="en", return_ids=False,
                        show_progress=False)
  terms = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
  avgdl = sum(map(len, docs)) / len(docs)
  scores = {}
  for doc_id, tokens in zip(CORPUS, docs):
    score = 0.0
    for t in terms:
      df = sum(t in d for d in docs)
      tf = tokens.count(t)
      if tf:
        score += math.log(1 + (len(docs) - df + 0.5) / (df + 0.5)) * tf / (tf + k1 * (1 - b + b * len(tokens) / avgdl))
    scores[doc_id] = score
  return scores


def test_bm25_mining_matches_brute_force(bm25):
  for qid in ["q0", "q4", "q11", "qrare"]:
    mined = bm25.scores_of(qid)
    expected = _brute_force_bm25(QUERIES[qid])
    positive = sorted((s for s in expected.values() if s > 0), reverse=True)
    assert len(mined) == min(10, len(positive))
    # The mined scores are the true top scores, in order, and each doc carries its own score.
    np.testing.assert_allclose(list(mined.values()), positive[:len(mined)], rtol=1e-5)
    for doc_id, score in mined.items():
      assert score == pytest.approx(expected[doc_id], rel=1e-5)
  # A query that is a doc's own text ranks that doc first.
  for i in range(20):
    assert next(iter(bm25.scores_of(f"q{i}"))) == f"d{i}"


def test_bm25_negatives_come_from_the_pool(bm25):
  qids = [f"q{i}" for i in range(20)]
  pos = [f"d{i}" for i in range(20)]
  rows = bm25.sample(qids, pos, np.random.default_rng(0), 4)
  _check_rows(rows, qids, 4, pool=bm25.pool)
  assert rows == bm25.sample(qids, pos, np.random.default_rng(0), 4)
  assert bm25.stats()["fallback_negatives"] == 0


def test_bm25_falls_back_to_random_and_counts(bm25):
  pool = [d for d in bm25.pool("qrare") if d != "d30"]
  assert 0 < len(pool) < 10
  before = bm25.stats()
  row = bm25.sample(["qrare"], ["d30"], np.random.default_rng(0), len(pool) + 3)[0]
  _check_rows([row], ["qrare"], len(pool) + 3)
  assert set(pool) <= set(row)
  after = bm25.stats()
  assert after["fallback_negatives"] - before["fallback_negatives"] == 3
  assert after["fallback_queries"] - before["fallback_queries"] == 1


def test_bm25_errors_for_unmined_queries(bm25):
  assert "qnone" not in bm25.qids and "q_other_split" not in bm25.qids
  with pytest.raises(ValueError, match="'qnone' has no positive"):
    bm25.sample(["qnone"], ["d1"], np.random.default_rng(0), 2)
  with pytest.raises(ValueError, match="no text in `queries`"):
    BM25Negatives(CORPUS, {"q0": "x"}, QRELS, cache_dir=None, show_progress=False)


def test_bm25_cache_is_reused(tmp_path, monkeypatch):
  monkeypatch.setattr(bm25_lib, "OPEN", {})  # no index open yet, as in a new process
  first = BM25Negatives(CORPUS, QUERIES, QRELS, top_k=5, cache_dir=tmp_path, show_progress=False)
  assert not first.from_cache and first.cache_path.exists()
  mtime = os.stat(first.cache_path / "rows.npy").st_mtime_ns

  def no_work(*args, **kwargs):
    raise AssertionError("indexed or mined again despite the cache")

  monkeypatch.setattr(bm25_lib, "OPEN", {})
  monkeypatch.setattr(bm25_lib, "build_index", no_work)
  monkeypatch.setattr(bm25_lib.Scorer, "__call__", no_work)
  second = BM25Negatives(CORPUS, QUERIES, QRELS, top_k=5, cache_dir=tmp_path, show_progress=False)
  assert second.from_cache and second.cache_path == first.cache_path
  assert os.stat(second.cache_path / "rows.npy").st_mtime_ns == mtime
  rng = lambda: np.random.default_rng(3)
  assert first.sample(TRAIN, [positive_ids(QRELS, q)[0] for q in TRAIN], rng(), 3) == \
      second.sample(TRAIN, [positive_ids(QRELS, q)[0] for q in TRAIN], rng(), 3)
  # A different k or different query texts is a different key: mining is attempted again.
  with pytest.raises(AssertionError, match="mined again"):
    BM25Negatives(CORPUS, QUERIES, QRELS, top_k=6, cache_dir=tmp_path, show_progress=False)
  with pytest.raises(AssertionError, match="mined again"):
    BM25Negatives(CORPUS, {**QUERIES, "q0": "changed"}, QRELS, top_k=5, cache_dir=tmp_path, show_progress=False)
  # So is a changed document (a new index) or a BM25 setting.
  changed = {**CORPUS, "d3": Doc("d3", "", "changed")}
  with pytest.raises(AssertionError, match="indexed or mined again"):
    BM25Negatives(changed, QUERIES, QRELS, top_k=5, cache_dir=tmp_path, show_progress=False)
  with pytest.raises(AssertionError, match="indexed or mined again"):
    BM25Negatives(CORPUS, QUERIES, QRELS, top_k=5, cache_dir=tmp_path, b=0.75, show_progress=False)
  # The index and the mined arrays; the attempts stopped above left only their resumable .partial folders.
  names = {p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")}  # locks: one builder at a time
  assert {n for n in names if not n.endswith(".partial")} == {first.index.path.name, first.cache_path.name}
  assert len(names) == 4 and not [p for p in tmp_path.rglob(".*")]


def test_bm25_negatives_from_doc_ids_and_an_index(bm25):
  """The corpus as ids in row order plus an index of its texts (what a prepared corpus gives) mines the same."""
  ids = list(CORPUS)
  texts = (doc_text(CORPUS[d]) for d in ids)
  index = bm25_lib.index_for(texts, len(ids), fingerprint="the prepared corpus's own", show_progress=False)
  source = BM25Negatives(ids, QUERIES, QRELS, top_k=10, index=index, show_progress=False)
  assert all(source.scores_of(q) == pytest.approx(bm25.scores_of(q), rel=1e-6) for q in TRAIN)
  with pytest.raises(ValueError, match="needs index="):
    BM25Negatives(ids, QUERIES, QRELS, show_progress=False)
  with pytest.raises(ValueError, match="the index holds 50 documents, the corpus 49"):
    BM25Negatives(ids[:-1], QUERIES, QRELS, index=index, show_progress=False)


def test_static_negatives_from_a_run_file(tmp_path):
  # Query qi's run ranks d(i+1) .. d(i+30) with falling scores; only the top 6 may be used.
  run = {f"q{i}": {f"d{(i + j) % N_DOCS}": 100.0 - j for j in range(1, 31)} for i in range(20)}
  run["q0"]["d0"] = 1000.0  # the positive ranked first must still be excluded
  path = tmp_path / "warmup.trec"
  write_run(path, run)
  source = StaticNegatives(path, QRELS, top_k=6)
  top6 = lambda q: [f"d{(int(q[1:]) + j) % N_DOCS}" for j in range(1, 7)] + (["d0"] if q == "q0" else [])
  qids = [f"q{i}" for i in range(20)]
  rows = source.sample(qids, [f"d{i}" for i in range(20)], np.random.default_rng(0), 4)
  _check_rows(rows, qids, 4, pool=top6)
  assert "d0" not in rows[0]
  with pytest.raises(ValueError, match="fewer than the 7 negatives"):
    source.sample(["q1"], ["d1"], np.random.default_rng(0), 7)
  with pytest.raises(KeyError, match="'qrare' is not in the run"):
    source.sample(["qrare"], ["d30"], np.random.default_rng(0), 1)
  # With corpus ids, missing queries and short pools are topped up with random docs and counted.
  source = StaticNegatives(run, QRELS, top_k=6, corpus_ids=list(CORPUS))
  rows = source.sample(["q1", "qrare"], ["d1", "d30"], np.random.default_rng(0), 7)
  _check_rows(rows, ["q1", "qrare"], 7)
  assert set(top6("q1")) <= set(rows[0])
  assert source.stats() == {"sampled_negatives": 6, "fallback_negatives": 8, "fallback_queries": 2}


def test_mixed_fractions(bm25):
  # Two disjoint static pools make each negative's source identifiable.
  low = StaticNegatives({q: {f"d{j}": -j for j in range(40, 50)} for q in TRAIN}, QRELS)
  high = StaticNegatives({q: {f"d{j}": -j for j in range(30, 40)} for q in TRAIN}, QRELS)
  mixed = MixedNegatives([(low, 1), (high, 1)])
  qids = ["q1"] * 400
  rows = mixed.sample(qids, ["d1"] * 400, np.random.default_rng(0), 3)
  from_low = np.array([sum(int(d[1:]) >= 40 for d in row) for row in rows])
  assert set(from_low) == {1, 2}  # floor(1.5) or one more, never 0 or 3
  assert abs(from_low.mean() - 1.5) < 0.15
  assert rows == mixed.sample(qids, ["d1"] * 400, np.random.default_rng(0), 3)
  even = MixedNegatives([(low, 0.25), (high, 0.75)]).sample(["q2"], ["d2"], np.random.default_rng(0), 4)[0]
  assert sum(int(d[1:]) >= 40 for d in even) == 1
  # DPR's 1:1 BM25 + random: no duplicates across sources, no positives.
  dpr = MixedNegatives([(bm25, 1), (RandomNegatives(CORPUS, QRELS), 1)])
  qids = [f"q{i}" for i in range(20)]
  _check_rows(dpr.sample(qids, [f"d{i}" for i in range(20)], np.random.default_rng(5), 8), qids, 8)
  with pytest.raises(ValueError, match="fractions"):
    MixedNegatives([(low, -1), (high, 1)])


def test_candidate_mask_by_hand():
  qrels = {"q0": {"a": 1, "c": 1, "z": 0}, "q1": {"b": 2, "c": 1}}
  # B=3, n_neg=1: positives a, c, padding; negatives z (q0), a (q1), padding.
  qids = ["q0", "q1", None]
  docs = ["a", "c", None, "z", "a", None]
  T, F = True, False
  expected = np.array([
      [T, F, F, T, F, F],  # c is q0's other positive; column 4 is its own positive again
      [T, T, F, T, T, F],  # a is not relevant to q1, so it is a fine negative (twice)
      [F, F, T, F, F, F],  # padding query: only its target
  ])
  np.testing.assert_array_equal(candidate_mask(qids, docs, qrels, in_batch=True), expected)
  expected_own = np.array([
      [T, F, F, T, F, F],
      [F, T, F, F, T, F],
      [F, F, T, F, F, F],
  ])
  np.testing.assert_array_equal(candidate_mask(qids, docs, qrels, in_batch=False), expected_own)
  # Padding marked by doc_index -1 instead of a None id.
  docs_named = ["a", "c", "pad", "z", "a", "pad"]
  mask = candidate_mask(qids, docs_named, qrels, doc_index=np.array([0, 2, -1, 25, 0, -1]))
  np.testing.assert_array_equal(mask, expected)
  # In-batch only (n_neg = 0): the other queries' positives are the negatives.
  np.testing.assert_array_equal(candidate_mask(["q0", "q1"], ["a", "b"], qrels), [[T, T], [T, T]])
  np.testing.assert_array_equal(candidate_mask(["q0", "q1"], ["a", "c"], qrels), [[T, F], [T, T]])
  with pytest.raises(ValueError, match="B \\* \\(1 \\+ n_neg\\)"):
    candidate_mask(["q0", "q1"], ["a", "b", "c"], qrels)


def test_candidate_mask_on_sampled_batch(bm25):
  qids = ["q0", "q3", "q6", "q9"]
  pos = [positive_ids(QRELS, q)[0] for q in qids]
  negs = MixedNegatives([(bm25, 1), (RandomNegatives(CORPUS, QRELS), 1)]).sample(qids, pos,
                                                                                np.random.default_rng(0), 3)
  docs = pos + [d for row in negs for d in row]
  mask = candidate_mask(qids, docs, QRELS, in_batch=True)
  for b, qid in enumerate(qids):
    for c, doc in enumerate(docs):
      assert mask[b, c] == (c == b or doc not in _all_positives(qid))
  own = candidate_mask(qids, docs, QRELS, in_batch=False)
  assert own.sum() == 4 * (1 + 3)


def test_candidate_mask_masks_duplicate_texts_of_positives():
  """A negative whose text is a positive's text under another id is masked like the positive; a brute-force
  transcription over random batches with planted duplicates."""
  rng = np.random.default_rng(0)
  texts = {f"d{i}": f"text {i % 7}" for i in range(20)}  # ids with i % 7 equal share a text
  qrels = {f"q{j}": {f"d{int(k)}": 1 for k in rng.choice(20, size=2, replace=False)} for j in range(6)}
  keys = lambda ids: [texts[d] for d in ids]
  for trial in range(20):
    qids = list(rng.choice(sorted(qrels), size=3, replace=False))
    targets = [sorted(qrels[q])[0] for q in qids]
    docs = targets + [f"d{int(k)}" for k in rng.choice(20, size=6)]
    for in_batch in (True, False):
      got = candidate_mask(qids, docs, qrels, in_batch=in_batch, text_keys=keys)
      by_id = candidate_mask(qids, docs, qrels, in_batch=in_batch)
      for b, qid in enumerate(qids):
        relevant = {d for d, r in qrels[qid].items() if r > 0} | {docs[b]}
        for c, doc in enumerate(docs):
          want = c == b or (by_id[b, c] and texts[doc] not in {texts[d] for d in relevant})
          assert got[b, c] == want, (trial, in_batch, b, c)
  # A planted twin: d8 has d1's text; d1 is q's positive, so d8 is no negative of q.
  mask = candidate_mask(["q", "r"], ["d1", "d2", "d8", "d3"], {"q": {"d1": 1}, "r": {"d2": 1}}, text_keys=keys)
  assert not mask[0, 2] and mask[1, 2]


def test_candidate_mask_counts_what_duplicate_texts_mask():
  texts = {"d1": "same", "d8": "same", "d2": "other", "d3": "third"}
  counts = {}
  candidate_mask(["q", "r"], ["d1", "d2", "d8", "d3"], {"q": {"d1": 1}, "r": {"d2": 1}},
                 text_keys=lambda ids: [texts[d] for d in ids], counts=counts)
  assert counts == {"duplicate_texts": 1}  # d8 for q; d1 itself is masked by id, not counted
  counts = {}
  candidate_mask(["q", "r"], ["d1", "d2", "d8", "d3"], {"q": {"d1": 1}, "r": {"d2": 1}}, counts=counts)
  assert counts == {}


def test_bm25_index_and_lists_kept_beside_a_prepared_corpus_serve_every_later_run(tmp_path):
  """A second run (another workdir) over the same prepared corpus builds and mines nothing; a shallower depth
  reads the first k columns of the deeper list, which equal a fresh mine at that depth."""
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  from jdr.data import formats, prepared  # pylint: disable=g-import-not-at-top
  bm25 = bm25_lib
  data = write_tiny_beir(tmp_path / "data", num_docs=60)
  corpus_all, queries, qrels = formats.load_beir(data, "train")
  corpus = prepared.prepare(data / "corpus.jsonl", out_dir=tmp_path / "prepared", progress=False)
  first = BM25Negatives(corpus, queries, qrels, top_k=20, cache_dir=tmp_path / "w1" / "cache",
                                show_progress=False)
  assert not first.from_cache and first.cache_path.parent == corpus.folder / "bm25"
  assert list((corpus.folder / "bm25").glob("bm25-index-*")) and not (tmp_path / "w1").exists()
  bm25.OPEN.clear()  # another process: nothing in memory
  again = prepared.prepare(data / "corpus.jsonl", out_dir=tmp_path / "prepared", progress=False)
  second = BM25Negatives(again, queries, qrels, top_k=20, cache_dir=tmp_path / "w2" / "cache",
                                 show_progress=False)
  assert second.from_cache and all(second.pool(q) == first.pool(q) for q in first.qids)
  shallow = BM25Negatives(again, queries, qrels, top_k=5, cache_dir=tmp_path / "w3" / "cache",
                                  show_progress=False)
  assert shallow.from_cache and shallow.cache_path == first.cache_path  # the deeper list, read
  fresh = bm25.mine(bm25.index_for([doc_text(corpus_all[d]) for d in corpus_all], len(corpus_all)),
                    [queries[q] for q in shallow.qids], 5, show_progress=False)
  assert all(shallow.pool(q) == [corpus.id_sequence()[r] for r in fresh.rows[i] if r >= 0]
             for i, q in enumerate(shallow.qids))

