"""jdr.negatives.mining's filters against a query-by-query transcription of their definitions, its scores against
the retrievers' own, and `python -m jdr.mine` end to end: its report, its directory, its resume."""

import json
import pathlib

import numpy as np
import pytest

from jdr.negatives import mining
from conftest import run_module, write_tiny_beir


def _oracle(rows, scores, positives, f, pos_scores, teacher, pos_teacher):
  """Each query's kept candidates and each filter's drops, one candidate at a time, as the docstring says."""
  kept_all, dropped = [], dict.fromkeys(mining.FILTERS, 0)
  for q in range(len(rows)):
    pos = {int(p) for p in positives[q] if p >= 0}
    low_pos = min((float(s) for s in pos_scores[q] if np.isfinite(s)), default=None)
    low_t = min((float(s) for s in pos_teacher[q] if np.isfinite(s)), default=None)
    left = []
    for j, r in enumerate(rows[q]):
      if r < 0:
        continue
      if int(r) in pos:
        dropped["positives"] += 1
        continue
      left.append(j)
    survivors = []
    for n, j in enumerate(left):
      if n < f.skip_ranks:
        dropped["skip_ranks"] += 1
      else:
        survivors.append(j)
    left, survivors = survivors, []
    for j in left:
      if f.positive_fraction is not None and low_pos is not None and scores[q, j] > f.positive_fraction * low_pos:
        dropped["positive_fraction"] += 1
      elif f.ce_threshold is not None and teacher[q, j] > f.ce_threshold:
        dropped["ce_threshold"] += 1
      elif f.ce_margin is not None and low_t is not None and teacher[q, j] > low_t - f.ce_margin:
        dropped["ce_margin"] += 1
      else:
        survivors.append(j)
    if f.keep:
      dropped["keep"] += max(0, len(survivors) - f.keep)
      survivors = survivors[:f.keep]
    kept_all.append(survivors)
  return kept_all, dropped


def _random_case(seed, q=40, d=30, p=3, docs=60):
  rng = np.random.default_rng(seed)
  rows = np.stack([rng.permutation(docs)[:d] for _ in range(q)]).astype(np.int32)
  rows[rng.random((q, d)) < 0.1] = -1
  positives = np.full((q, p), -1, np.int32)
  for i in range(q):
    k = rng.integers(0, p + 1)
    positives[i, :k] = rng.choice(docs, k, replace=False)
  scores = np.sort(rng.random((q, d)).astype(np.float32) * 10, axis=1)[:, ::-1].copy()
  pos_scores = np.where(positives >= 0, rng.random((q, p)) * 10, np.nan).astype(np.float32)
  teacher = rng.normal(size=(q, d)).astype(np.float32)
  pos_teacher = np.where(positives >= 0, rng.normal(size=(q, p)), np.nan).astype(np.float32)
  return rows, scores, positives, pos_scores, teacher, pos_teacher


@pytest.mark.parametrize("filters", [
    mining.Filters(),
    mining.Filters(skip_ranks=3),
    mining.Filters(positive_fraction=0.9, keep=5),
    mining.Filters(skip_ranks=1, ce_threshold=0.3, keep=7),
    mining.Filters(positive_fraction=1.2, ce_margin=0.5),
])
def test_filters_agree_with_a_query_by_query_transcription(filters):
  for seed in range(3):
    rows, scores, positives, pos_scores, teacher, pos_teacher = _random_case(seed)
    result = mining.apply(rows, scores, positives, filters, positive_scores=pos_scores, teacher=teacher,
                          positive_teacher=pos_teacher)
    kept, dropped = _oracle(rows, scores, positives, filters, pos_scores, teacher, pos_teacher)
    for q in range(len(rows)):
      assert np.flatnonzero(result.alive[q]).tolist() == kept[q]
    assert {k: v for k, v in result.dropped.items()} == {k: v for k, v in dropped.items() if k in result.dropped}
    assert not any(v for k, v in dropped.items() if k not in result.dropped)  # off filters drop nothing
    [out_rows, out_scores] = mining.compact(result.alive, rows, scores, width=8, fill=(-1, np.nan))
    for q in range(len(rows)):
      want = kept[q][:8]
      assert out_rows[q, :len(want)].tolist() == rows[q, want].tolist()
      assert (out_rows[q, len(want):] == -1).all() and np.isnan(out_scores[q, len(want):]).all()


def test_positive_fraction_refuses_negative_scores():
  with pytest.raises(ValueError, match="non-negative.*query 'q7' scores -1"):
    mining.fraction_bound(np.array([[-1.0, 2.0]]), 0.9, ["q7"])
  with pytest.raises(ValueError, match="one filter"):
    mining.Filters(ce_threshold=1.0, ce_margin=0.5)


def test_dev_report_counts_what_each_threshold_drops_and_leaves():
  # Query 0: candidates 5, 1 (labeled), 6, 7; query 1: 2 (labeled), 8, 3 (labeled, known), -1.
  rows = np.array([[5, 1, 6, 7], [2, 8, 3, -1]], np.int32)
  scores = np.array([[9.0, 8.0, 7.0, 1.0], [9.0, 5.0, 4.0, np.nan]], np.float32)
  positives = np.array([[1, -1], [3, 2]], np.int32)
  pos_scores = np.array([[8.0, np.nan], [4.0, 9.0]], np.float32)
  report = mining.dev_report(rows, scores, positives, mining.Filters(skip_ranks=1, positive_fraction=0.5),
                             positive_scores=pos_scores)
  assert report["candidates"] == 7 and report["positives_among_candidates"] == 3
  assert report["unfiltered"] == {"dropped": 0.0, "false_negative_rate": round(3 / 7, 4), "positives_dropped": 0.0,
                                  "f1": 0.0}
  # skip 1: drops 5 and 2 (a labeled positive); kept 1, 6, 7, 8, 3 of which 1 and 3 are labeled.
  # F1 as a detector of labeled positives: precision 1/2, recall 1/3.
  assert report["skip_ranks"]["1"] == {"dropped": round(2 / 7, 4), "false_negative_rate": 0.4,
                                       "positives_dropped": round(1 / 3, 4), "f1": 0.4}
  # Relative to the known positive (query 1 only: its lowest row, 2, scores 9): 0.9 x 9 = 8.1 drops nothing of
  # 8 (5.0) and 3 (4.0)... and candidate 2 itself is the known one, out of the count.
  frac = report["positive_fraction"]
  assert frac["queries"] == 1 and frac["0.9"]["dropped"] == 0.0 and frac["0.9"]["false_negative_rate"] == 0.5
  # The chosen 0.5 joins the grid: 0.5 x 9 = 4.5 drops 8 (5.0) and keeps 3 (4.0, the hidden positive).
  assert frac["0.5"] == {"dropped": 0.5, "false_negative_rate": 1.0, "positives_dropped": 0.0, "f1": 0.0}


def test_the_value_chosen_on_dev_is_the_best_detector_of_hidden_positives():
  rows, scores, positives, pos_scores, teacher, pos_teacher = _random_case(3, q=60, d=30, p=2)
  hidden = mining.positive_mask(rows, positives)
  teacher = np.where(hidden, teacher + 1.5, teacher).astype(np.float32)  # the labeled score higher, as a CE's would
  report = mining.dev_report(rows, scores, positives, mining.Filters(), teacher=teacher, positive_teacher=pos_teacher)
  alive = rows >= 0

  def f1(t):  # one candidate at a time
    dropped = [(q, j) for q in range(len(rows)) for j in range(rows.shape[1]) if alive[q, j] and teacher[q, j] > t]
    caught = sum(hidden[q, j] for q, j in dropped)
    return 2 * caught / (len(dropped) + hidden.sum())

  grid = [float(v) for v in report["ce_threshold"]]
  assert len(grid) == len(mining.CE_QUANTILES)
  best = max(grid, key=lambda t: (round(f1(t), 4), -t))
  assert mining.choose_on_dev(report, "ce_threshold") == best
  for t in grid:
    assert report["ce_threshold"][f"{t:.4g}"]["f1"] == round(f1(t), 4)
  # Equal F1s go to the value that drops less; a grid the report lacks is refused by name.
  tie = {"skip_ranks": {"1": {"f1": 0.5, "dropped": 0.2}, "3": {"f1": 0.5, "dropped": 0.1}, "0": {"f1": 0.0, "dropped": 0}}}
  assert mining.choose_on_dev(tie, "skip_ranks") == 3.0
  with pytest.raises(ValueError, match="no ce_margin grid"):
    mining.choose_on_dev(tie, "ce_margin")


def test_scores_of_the_positives_match_each_retriever(tmp_path):
  from jdr.retrieval import bm25
  from jdr.data import formats, text
  beir = write_tiny_beir(tmp_path / "beir", num_docs=30)
  corpus = formats.read_corpus(beir)
  texts = [text.doc_text(d) for d in corpus.values()]
  index = bm25.index_for(texts, len(texts), show_progress=False)
  queries = list(formats.read_queries(beir / "queries.jsonl").values())[:10]
  rows, scores = bm25.search(index, queries, 5, n_threads=1)
  np.testing.assert_allclose(mining.bm25_scores(index, queries, rows), np.where(rows >= 0, scores, np.nan),
                             rtol=1e-5)
  rng = np.random.default_rng(0)
  q, d = rng.normal(size=(4, 8)), rng.normal(size=(20, 8)).astype(np.float32)
  pick = np.array([[3, -1], [0, 19], [-1, -1], [7, 7]], np.int32)
  got = mining.dot_scores(q, d, pick)
  for i in range(4):
    for j in range(2):
      want = np.nan if pick[i, j] < 0 else float(q[i] @ d[pick[i, j]])
      np.testing.assert_allclose(got[i, j], want, rtol=1e-5)
  ranked = np.array([[4, 2, 9], [1, -1, -1]], np.int32)
  ranked_scores = np.array([[3.0, 2.0, 1.0], [5.0, np.nan, np.nan]], np.float32)
  np.testing.assert_array_equal(mining.run_scores(ranked, ranked_scores, np.array([[9, 5], [1, -1]])),
                                np.array([[1.0, np.nan], [5.0, np.nan]], np.float32))


def _overlap_scorer(pairs):
  """A stand-in cross-encoder: shared words."""
  return np.array([len(set(q.split()) & set(d.split())) for q, d in pairs], np.float32)


def test_teacher_scores_read_each_document_once_and_score_in_place(tmp_path):
  from jdr.data import prepared
  beir = write_tiny_beir(tmp_path / "beir", num_docs=20)
  corpus = prepared.prepare(beir / "corpus.jsonl", out_dir=tmp_path / "cache", progress=False)
  rows = np.array([[3, 3, -1], [0, 5, 3]], np.int32)
  alive = np.array([[True, False, False], [True, True, True]])
  got = mining.teacher_scores(_overlap_scorer, corpus, ["alphaton betalith", "gammavox"], rows, alive)
  texts = corpus.texts([0, 3, 5])
  by_row = dict(zip([0, 3, 5], texts))
  assert got[0, 0] == _overlap_scorer([("alphaton betalith", by_row[3])])[0]
  assert np.isnan(got[0, 1]) and np.isnan(got[0, 2])
  assert got[1].tolist() == _overlap_scorer([("gammavox", by_row[r]) for r in (0, 5, 3)]).tolist()


def test_teacher_scores_in_slices_equal_one_call_and_advance_the_bar_by_each_pair(tmp_path, monkeypatch):
  from jdr.data import prepared
  beir = write_tiny_beir(tmp_path / "beir", num_docs=20)
  corpus = prepared.prepare(beir / "corpus.jsonl", out_dir=tmp_path / "cache", progress=False)
  rng = np.random.default_rng(0)
  rows = rng.integers(-1, 20, size=(6, 5)).astype(np.int32)
  alive = rng.random((6, 5)) < 0.8
  texts = [f"alphaton q{i}" for i in range(6)]
  whole = mining.teacher_scores(_overlap_scorer, corpus, texts, rows, alive)
  calls, bar = [], _Bar()
  monkeypatch.setattr(mining, "SCORE_SLICE", 3)
  sliced = mining.teacher_scores(lambda p: calls.append(len(p)) or _overlap_scorer(p), corpus, texts, rows, alive,
                                 bar=bar)
  np.testing.assert_array_equal(sliced, whole)
  expected = int(((rows >= 0) & alive).sum())
  assert bar.n == sum(calls) == expected and max(calls) == 3


class _Bar:
  def __init__(self):
    self.n = 0

  def update(self, n):
    self.n += n


class _Stop(Exception):
  pass


def test_mine_with_a_cross_encoder_resumes_without_scoring_a_finished_chunk_again(mine_data, tmp_path, monkeypatch,
                                                                                   capsys):
  """Stopped while scoring the training queries, a second run scores only what the first had not saved: neither
  the dev report's chunks nor the finished training chunks again; the result equals an uninterrupted run's."""
  from jdr import mine  # pylint: disable=g-import-not-at-top
  scored = []

  def scorer(limit=None):
    def score(pairs):
      if limit is not None and sum(len(p) for p in scored) + len(pairs) > limit:
        raise _Stop
      scored.append(list(pairs))
      return _overlap_scorer(pairs)
    return score

  argv = lambda out: ["--data", str(mine_data), "--out", str(out), "--dev-split", "dev", "--depth", "10",
                      "--cross-encoder", "stand-in", "--ce-threshold", "dev", "--chunk", "4"]
  monkeypatch.setattr(mine, "scorer", lambda settings: scorer())
  mine.main(argv(tmp_path / "whole"))
  total = sum(len(p) for p in scored)
  assert "cross-encoder (dev)" in capsys.readouterr().err
  dev_pairs = sum(len(p) for p in scored[:_dev_calls(scored, mine_data)])
  scored.clear()
  monkeypatch.setattr(mine, "scorer", lambda settings: scorer(limit=dev_pairs + 100))
  with pytest.raises(_Stop):
    mine.main(argv(tmp_path / "resumed"))
  first = [tuple(x) for p in scored for x in p]
  assert (tmp_path / "resumed" / mining.PARTIAL_DEV).exists() and (tmp_path / "resumed" / mining.PARTIAL).exists()
  scored.clear()
  monkeypatch.setattr(mine, "scorer", lambda settings: scorer())
  mine.main(argv(tmp_path / "resumed"))
  second = [tuple(x) for p in scored for x in p]
  assert 0 < len(second) < total - dev_pairs  # no dev pair, and not every training pair, scored again
  assert len(first) + len(second) < total + 100  # at most the unsaved chunk scored twice
  a, b = mining.read(tmp_path / "whole"), mining.read(tmp_path / "resumed")
  np.testing.assert_array_equal(a.rows, b.rows)
  np.testing.assert_array_equal(a.teacher, b.teacher)
  assert a.meta["report"]["dev"] == b.meta["report"]["dev"]
  assert not (tmp_path / "resumed" / mining.PARTIAL_DEV).exists()
  # Stopped again, then resumed with queries at another length: the saved chunks are not theirs.
  scored.clear()
  monkeypatch.setattr(mine, "scorer", lambda settings: scorer(limit=dev_pairs + 100))
  with pytest.raises(_Stop):
    mine.main(argv(tmp_path / "changed"))
  capsys.readouterr()
  monkeypatch.setattr(mine, "scorer", lambda settings: scorer())
  mine.main(argv(tmp_path / "changed") + ["--query-max-length", "16"])
  assert "was made with other settings; starting over" in capsys.readouterr().err


def test_a_directory_written_over_reads_as_unfinished_until_its_meta_lands(mine_data, tmp_path, monkeypatch):
  """`--from X --out X` or mining into a finished directory again: killed between the new arrays, the directory
  is unfinished, never old and new arrays passed off as one; arrays of mismatched shapes are refused."""
  from jdr.runtime import atomic  # pylint: disable=g-import-not-at-top
  out = tmp_path / "m"
  rows = np.array([[3, 4], [5, -1]], np.int32)
  mining.write(out, ["q1", "q2"], rows, np.ones(rows.shape, np.float32), np.array([[1], [2]]), {},
               teacher=np.zeros(rows.shape, np.float32), positive_teacher=np.zeros((2, 1), np.float32))
  assert mining.read(out).rows.tolist() == rows.tolist()
  real = atomic.write_atomic

  def dies_after_the_new_rows(path, write):
    if pathlib.Path(path).name == "scores.npy":
      raise _Stop
    real(path, write)
  monkeypatch.setattr(atomic, "write_atomic", dies_after_the_new_rows)
  wider = np.array([[3, 4, 6], [5, 7, -1]], np.int32)
  with pytest.raises(_Stop):
    mining.write(out, ["q1", "q2"], wider, np.ones(wider.shape, np.float32), np.array([[1], [2]]), {})
  assert np.load(out / "rows.npy").shape == wider.shape  # the new rows beside the old scores
  with pytest.raises(ValueError, match="unfinished"):
    mining.read(out)
  monkeypatch.undo()
  mining.write(out, ["q1", "q2"], rows, np.ones(rows.shape, np.float32), np.array([[1], [2]]), {},
               teacher=np.zeros(rows.shape, np.float32), positive_teacher=np.zeros((2, 1), np.float32))
  np.save(out / "teacher.npy", np.zeros((2, 3), np.float32))  # a teacher of another width
  with pytest.raises(ValueError, match=r"teacher.npy has shape \(2, 3\).*corrupt"):
    mining.read(out)


def test_the_default_chunk_holds_a_bounded_number_of_cross_encoder_pairs():
  from jdr.negatives import mined_lists  # pylint: disable=g-import-not-at-top
  assert mined_lists.chunk_queries(0, 100, cross_encoder=False) == 4096
  assert mined_lists.chunk_queries(0, 100, cross_encoder=True) == mined_lists.CE_CHUNK_PAIRS // 100
  assert mined_lists.chunk_queries(0, 100_000, cross_encoder=True) == 1
  assert mined_lists.chunk_queries(7, 100, cross_encoder=True) == 7  # a given --chunk wins


def _dev_calls(scored, beir) -> int:
  """How many of the scorer's calls were the dev report's: those whose queries are dev queries."""
  from jdr.data import formats  # pylint: disable=g-import-not-at-top
  queries = formats.read_queries(beir / "queries.jsonl")
  dev = {queries[line.split("\t")[0]] for line in (beir / "qrels" / "dev.tsv").read_text().splitlines()[1:]}
  n = 0
  while n < len(scored) and all(q in dev for q, _ in scored[n]):
    n += 1
  return n


@pytest.fixture(scope="module")
def mine_data(tmp_path_factory):
  root = tmp_path_factory.mktemp("mine")
  beir = write_tiny_beir(root / "beir", num_docs=60)
  # A dev split of held-out training queries, two of them with a second positive.
  lines = (beir / "qrels" / "train.tsv").read_text().splitlines()
  head, body = lines[0], lines[1:]
  (beir / "qrels" / "train.tsv").write_text("\n".join([head] + body[:35]) + "\n")
  dev = body[35:] + ["q40\td41\t1", "q41\td40\t1"]
  (beir / "qrels" / "dev.tsv").write_text("\n".join([head] + dev) + "\n")
  return beir


def _mine(*args):
  return run_module("jdr.mine", args)


@pytest.mark.slow
def test_mine_writes_filtered_negatives_and_a_dev_report(mine_data, tmp_path):
  out = tmp_path / "mined"
  proc = _mine("--data", mine_data, "--out", out, "--dev-split", "dev", "--depth", "20", "--skip-ranks", "2",
               "--positive-fraction", "0.95", "--keep", "8")
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout.strip().splitlines()[-1])
  assert "skip_ranks" in proc.stdout and "FN rate" in proc.stdout
  mined = mining.read(out)
  assert mined.qids == sorted(f"q{i}" for i in range(35)) and report["queries"] == 35
  assert mined.rows.shape == (35, 8) and mined.teacher is None
  assert set(report["training"]["dropped"]) == {"positives", "skip_ranks", "positive_fraction", "keep"}
  assert report["negatives"] == int((mined.rows >= 0).sum())
  for i, q in enumerate(mined.qids):  # a query's own positive is never its negative
    assert int(q[1:]) not in mined.rows[i].tolist()
  dev = report["dev"]
  assert dev["queries"] == 10 and dev["split"] == "dev" and dev["positives_among_candidates"] > 0
  assert {"0", "1", "2", "3", "10", "30"} == set(dev["skip_ranks"])
  assert dev["positive_fraction"]["queries"] == 2
  assert not (out / mining.PARTIAL).exists()
  # Mined again into the same directory with the same settings: the same arrays.
  again = _mine("--data", mine_data, "--out", out, "--dev-split", "dev", "--depth", "20", "--skip-ranks", "2",
                "--positive-fraction", "0.95", "--keep", "8")
  assert again.returncode == 0, again.stderr[-3000:]
  np.testing.assert_array_equal(mining.read(out).rows, mined.rows)


@pytest.mark.slow
def test_a_finished_directory_filtered_again_is_what_mining_with_those_filters_writes(mine_data, tmp_path):
  """--from takes the unfiltered directory's dev report and candidates; mining with the same "dev" choice writes
  the same negatives."""
  base = ["--data", mine_data, "--dev-split", "dev", "--depth", "20"]
  assert _mine(*base, "--out", tmp_path / "all").returncode == 0
  again = _mine("--from", tmp_path / "all", "--out", tmp_path / "again", "--skip-ranks", "dev", "--keep", "8")
  assert again.returncode == 0, again.stderr[-3000:]
  direct = _mine(*base, "--out", tmp_path / "direct", "--skip-ranks", "dev", "--keep", "8")
  assert direct.returncode == 0, direct.stderr[-3000:]
  chosen = json.loads(direct.stdout.strip().splitlines()[-1])["chosen_on_dev"]
  assert json.loads(again.stdout.strip().splitlines()[-1])["chosen_on_dev"] == chosen
  dev = mining.read(tmp_path / "all").meta["report"]["dev"]
  assert chosen == {"skip_ranks": int(mining.choose_on_dev(dev, "skip_ranks"))} and "chosen on dev" in again.stdout
  a, b = mining.read(tmp_path / "again"), mining.read(tmp_path / "direct")
  assert a.qids == b.qids
  np.testing.assert_array_equal(a.rows, b.rows)
  np.testing.assert_array_equal(a.scores, b.scores)
  refused = _mine("--from", tmp_path / "all", "--out", tmp_path / "x", "--ce-threshold", "0.5")
  assert refused.returncode == 2 and "without (--cross-encoder)" in refused.stderr


def test_mine_refuses_bad_flags_with_a_reason(mine_data, tmp_path, capsys):
  """In this process (what `python -m jdr.mine` runs): status 2 and the reason, never a traceback."""
  from jdr import mine  # pylint: disable=g-import-not-at-top
  for args, reason in ((["--data", mine_data, "--ce-threshold", "0.5"],
                        "--ce-threshold and --ce-margin need --cross-encoder"),
                       (["--data", tmp_path / "absent"], "absent")):
    with pytest.raises(SystemExit) as exit_info:
      mine.main([*map(str, args), "--out", str(tmp_path / "m")])
    assert exit_info.value.code == 2 and reason in capsys.readouterr().err


def _tevatron(path, lines):
  path.write_text("".join(json.dumps(line) + "\n" for line in lines))
  return path


def test_tevatron_files_of_either_schema_read_as_rows(tmp_path):
  from jdr.data import prepared
  from jdr.negatives import training_files as negative_files
  beir = write_tiny_beir(tmp_path / "beir", num_docs=20)
  corpus = prepared.prepare(beir / "corpus.jsonl", out_dir=tmp_path / "cache", progress=False)
  qrels = {"q1": {"d1": 1}, "q2": {"d2": 1}}
  v1 = _tevatron(tmp_path / "v1.jsonl", [
      {"query_id": "q2", "query": "x", "positive_passages": [{"docid": "d2", "text": "t"}],
       "negative_passages": [{"docid": "d5", "title": "", "text": "t"}, {"docid": "d2", "text": "t"}]},
      {"query_id": "q1", "query": "y", "positive_passages": [], "negative_passages": [{"docid": "d7"}]},
      {"query_id": "q2", "query": "x", "positive_passages": [], "negative_passages": [{"docid": "d9"}, {"docid": "d5"}]},
  ])
  queries = {"q1": "y", "q2": "x"}
  got = negative_files.read(v1, corpus, queries, qrels)
  assert got.meta["schema"] == "tevatron-v1" and got.qids == ["q1", "q2"] and got.meta["dropped_positives"] == 1
  assert got.rows.tolist() == [[7, -1], [5, 9]]  # q2's two lines merged, d2 (its positive) dropped
  assert got.positives.tolist() == [[-1], [2]] and got.teacher is None
  v2 = _tevatron(tmp_path / "v2.jsonl", [{"query_id": "q1", "query_text": "y", "positive_document_ids": ["d1"],
                                          "negative_document_ids": ["d3", "d4"]}])
  assert negative_files.read(v2, corpus, queries, qrels).rows.tolist() == [[3, 4]]
  from jdr.data import formats
  bad = _tevatron(tmp_path / "bad.jsonl", [{"query_id": "q1", "negative_document_ids": ["d3"]},
                                           {"query_id": "q1", "negative_document_ids": ["nope"]}])
  with pytest.raises(formats.DataFormatError, match=r"bad.jsonl:2: .*'nope' is not in the corpus"):
    negative_files.read(bad, corpus, queries, qrels)
  mixed = _tevatron(tmp_path / "mixed.jsonl", [{"query_id": "q1", "negative_document_ids": ["d3"]},
                                               {"query_id": "q1", "negative_passages": [{"docid": "d3"}]}])
  with pytest.raises(formats.DataFormatError, match=r"mixed.jsonl:2: .*tevatron-v1 record in a file of tevatron-v2"):
    negative_files.read(mixed, corpus, queries, qrels)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_sentence_transformers_rows_match_texts_to_rows_and_carry_scores(tmp_path, suffix):
  from jdr.data import formats, prepared
  from jdr.negatives import training_files as negative_files
  beir = write_tiny_beir(tmp_path / "beir", num_docs=20)
  corpus = prepared.prepare(beir / "corpus.jsonl", out_dir=tmp_path / "cache", progress=False)
  text = {f"d{i}": json.loads(line)["text"] for i, line in enumerate((beir / "corpus.jsonl").read_text().splitlines())}
  queries = formats.read_queries(beir / "queries.jsonl")
  qrels = {"q1": {"d1": 1}, "q2": {"d2": 1}}
  # "scores": the column sentence-transformers' miner writes with output_scores=True.
  records = [{"anchor": queries["q1"], "positive": text["d1"], "negative_1": text["d4"], "negative_2": text["d1"],
              "scores": [3.0, 1.5, 2.5]},
             {"anchor": queries["q2"], "positive": text["d2"], "negative_1": text["d6"], "negative_2": text["d8"],
              "scores": [4.0, -1.0, 0.5]}]
  path = tmp_path / f"st{suffix}"
  if suffix == ".parquet":
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(records), path)
  else:
    _tevatron(path, records)
  got = negative_files.read(path, corpus, queries, qrels)
  assert got.meta["schema"] == "sentence-transformers" and got.qids == ["q1", "q2"]
  assert got.rows.tolist() == [[4, -1], [6, 8]] and got.meta["dropped_positives"] == 1  # d1 is q1's positive
  np.testing.assert_array_equal(got.teacher, [[1.5, np.nan], [-1.0, 0.5]])
  assert got.positives.tolist() == [[1], [2]] and got.positive_teacher.tolist() == [[3.0], [4.0]]
  records[1]["negative_2"] = "a passage the corpus does not hold"
  bad = tmp_path / f"bad{suffix}"
  if suffix == ".parquet":
    pq.write_table(pa.Table.from_pylist(records), bad)
  else:
    _tevatron(bad, records)
  with pytest.raises(formats.DataFormatError, match=r"bad\.\w+:2: .*negative passage 'a passage the corpus"):
    negative_files.read(bad, corpus, queries, qrels)
  if suffix == ".jsonl":  # "score" is read too; both at once is refused
    del records[1]
    records[0]["score"] = records[0].pop("scores")
    single = _tevatron(tmp_path / "single.jsonl", records)
    np.testing.assert_array_equal(negative_files.read(single, corpus, queries, qrels).teacher, [[1.5]])
    records[0]["scores"] = records[0]["score"]
    both = _tevatron(tmp_path / "both.jsonl", records)
    with pytest.raises(formats.DataFormatError, match=r"both.jsonl:1: .*both 'scores' and 'score'"):
      negative_files.read(both, corpus, queries, qrels)


def test_a_negative_text_of_several_rows_is_a_false_negative_where_one_is_relevant(tmp_path):
  """A passage text the corpus holds twice, once as the query's relevant document: a negative with that text is a
  false negative and dropped, whichever copy comes first in the corpus."""
  from jdr.data import formats, prepared
  from jdr.negatives import training_files as negative_files
  beir = write_tiny_beir(tmp_path / "beir", num_docs=20)
  lines = (beir / "corpus.jsonl").read_text().splitlines()
  copy = {**json.loads(lines[1]), "_id": "copy-of-d1"}  # row 0; d1 moves to row 2
  (beir / "corpus.jsonl").write_text("".join(l + "\n" for l in [json.dumps(copy)] + lines))
  corpus = prepared.prepare(beir / "corpus.jsonl", out_dir=tmp_path / "cache", progress=False)
  text = {json.loads(l)["_id"]: json.loads(l)["text"] for l in lines}
  queries = formats.read_queries(beir / "queries.jsonl")
  path = _tevatron(tmp_path / "st.jsonl", [{"anchor": queries["q1"], "positive": text["d1"],
                                            "negative_1": text["d1"], "negative_2": text["d4"]}])
  got = negative_files.read(path, corpus, queries, {"q1": {"d1": 1}})
  assert got.positives.tolist() == [[2]]  # the copy the qrels judge
  assert got.rows.tolist() == [[5]] and got.meta["dropped_positives"] == 1  # d4 kept, d1's text dropped


def test_a_training_file_is_read_once_for_the_sampler_and_the_teacher(tmp_path, monkeypatch):
  """The negatives source and the distiller both load negatives.mined.file: the file is read once, and again only
  when it changed or another corpus asks."""
  from jdr.data import prepared
  from jdr.negatives import training_files as negative_files
  beir = write_tiny_beir(tmp_path / "beir", num_docs=20)
  corpus = prepared.prepare(beir / "corpus.jsonl", out_dir=tmp_path / "cache", progress=False)
  queries, qrels = {"q1": "y"}, {"q1": {"d1": 1}}
  path = _tevatron(tmp_path / "v2.jsonl", [{"query_id": "q1", "negative_document_ids": ["d3"]}])
  reads, real = [], negative_files.read
  monkeypatch.setattr(negative_files, "read", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
  first = negative_files.load(path, corpus, queries, qrels)
  assert negative_files.load(path, corpus, queries, qrels) is first and len(reads) == 1
  _tevatron(path, [{"query_id": "q1", "negative_document_ids": ["d3", "d4"]}])
  assert negative_files.load(path, corpus, queries, qrels).rows.tolist() == [[3, 4]] and len(reads) == 2
  other = prepared.prepare(beir / "corpus.jsonl", out_dir=tmp_path / "cache2", progress=False)
  negative_files.load(path, other, queries, qrels)
  assert len(reads) == 3


@pytest.mark.slow
def test_training_reads_negatives_from_a_tevatron_file(tmp_path):
  from jdr.training import trainer
  from jdr.runtime import config_files
  from jdr.runtime import defaults
  beir = write_tiny_beir(tmp_path / "beir", num_docs=40)
  lines = [{"query_id": f"q{i}", "negative_document_ids": [f"d{(i + 1) % 40}", f"d{(i + 2) % 40}"]}
           for i in range(30)]
  given = _tevatron(tmp_path / "train.jsonl", lines)
  config = defaults.get_config()
  config_files.apply_overrides(config, [
      "model.init_from=", "model.fresh=tiny", f"data.dataset={beir}", "data.eval_split=", "batch_size=4",
      "data.query_max_length=12", "data.doc_max_length=32", "negatives.source=mined", f"negatives.mined.file={given}",
      "negatives.per_query=1", "num_train_steps=2", "log_every=1", "eval_before_training=False"])
  trainer.train_and_evaluate(config, tmp_path / "w")
  records = [json.loads(l) for l in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  assert [r for r in records if "train/loss" in r]


@pytest.mark.slow
def test_an_unfiltered_bm25_mining_trains_on_what_the_bm25_source_samples(mine_data, tmp_path):
  """BM25's top k mined by jdr.mine, unfiltered, is the pool negatives.source=bm25 builds: the same negatives
  drawn from the same random stream, so a filtered mining differs from the BM25-negative recipe only by what
  its filters dropped."""
  from jdr.runtime import defaults
  from jdr.data import pairs
  from jdr.negatives import sources
  proc = _mine("--data", mine_data, "--out", tmp_path / "mined", "--depth", "12", "--dev-fraction", "0")
  assert proc.returncode == 0, proc.stderr[-3000:]
  config = defaults.get_config()
  config.data.dataset, config.data.eval_split = str(mine_data), ""
  data = pairs.load(config.data, tmp_path / "w")
  config.negatives.bm25.top_k, config.negatives.mined.file = 12, str(tmp_path / "mined")
  bm25 = sources.SAMPLERS["bm25"](config.negatives.bm25, data, tmp_path / "cache")
  mined = sources.SAMPLERS["mined"](config.negatives.mined, data, None)
  qids = sorted(data.train_qrels)
  positives = [next(iter(data.train_qrels[q])) for q in qids]
  for seed in range(3):
    a = bm25.sample(qids, positives, np.random.default_rng(seed), 2)
    b = mined.sample(qids, positives, np.random.default_rng(seed), 2)
    assert a == b
  assert mined.stats() == bm25.stats() and mined.stats()["sampled_negatives"] >= 3 * len(qids)  # from the pools
