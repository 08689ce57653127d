"""jdr.data.run_arrays: run files (TREC, MS MARCO top1000) read as arrays of corpus rows, checked against a
brute-force parse (formats.read_run for TREC, the file's lines grouped by hand for top1000)."""

import random

import numpy as np
import pytest

from jdr.data import formats
from jdr.data import prepared
from jdr.data import run_arrays
from conftest import write_tiny_beir

IDS = [f"d{i}" for i in range(40)]  # write_tiny_beir's doc ids, in corpus order


def _write_trec(path, seed=0, queries=8, per_query=25):
  """A shuffled TREC run whose scores tie often (to exercise trec_eval's tie order)."""
  rnd = random.Random(seed)
  lines = []
  for q in range(queries):
    for rank, doc in enumerate(rnd.sample(IDS, per_query), 1):
      score = rnd.choice([1.0, 2.0, 0.5, round(rnd.random(), 3)])
      lines.append(f"q{q} Q0 {doc} {rank} {score} tag")
  rnd.shuffle(lines)
  path.write_text("\n".join(lines) + "\n")
  return path


def _docs(ranked, i, ids=IDS):
  return [ids[r] for r in ranked.rows[i] if r >= 0]


@pytest.fixture(scope="module")
def prepared_corpus(tmp_path_factory):
  return prepared.prepare(write_tiny_beir(tmp_path_factory.mktemp("beir")) / "corpus.jsonl")


@pytest.mark.parametrize("depth", [None, 1, 6, 25])
def test_a_trec_run_reads_as_read_run_ranks_it(tmp_path, prepared_corpus, depth):
  path = _write_trec(tmp_path / "run.trec")
  run = formats.read_run(path)  # the oracle: trec_eval's order, score descending, ties by doc id descending
  qids = ["q3", "q1", "absent", "q0", "q7"]
  for corpus in ({d: None for d in IDS}, IDS, prepared_corpus):
    ranked = run_arrays.read(path, qids, corpus, depth=depth)
    assert ranked.format == run_arrays.TREC
    assert ranked.rows.dtype == np.int32 and ranked.scores.dtype == np.float32
    assert ranked.rows.shape == (len(qids), depth or 25)
    for i, qid in enumerate(qids):
      want = list(run.get(qid, {}).items())[:depth]
      assert _docs(ranked, i) == [d for d, _ in want]
      assert ranked.lengths[i] == len(want)
      np.testing.assert_array_equal(ranked.scores[i, :len(want)], np.float32([s for _, s in want]))
      assert (ranked.rows[i, len(want):] == -1).all() and np.isneginf(ranked.scores[i, len(want):]).all()


def test_kept_lines_cut_back_to_the_depth_give_the_same_arrays(tmp_path, monkeypatch):
  """Bounded memory: with a depth, the lines kept are cut to each query's best whenever they grow; the result
  is the one read whole."""
  path = _write_trec(tmp_path / "run.trec", seed=1, queries=12, per_query=40)
  whole = run_arrays.read(path, [f"q{i}" for i in range(12)], IDS, depth=5)
  monkeypatch.setattr(run_arrays, "BLOCK", 7)
  monkeypatch.setattr(run_arrays, "SLACK", 1)
  cut = run_arrays.read(path, [f"q{i}" for i in range(12)], IDS, depth=5)
  np.testing.assert_array_equal(cut.rows, whole.rows)
  np.testing.assert_array_equal(cut.scores, whole.scores)
  np.testing.assert_array_equal(cut.lengths, whole.lengths)


def test_an_ms_marco_top1000_file_ranks_in_file_order(tmp_path, prepared_corpus):
  rnd = random.Random(2)
  lines = [f"{q}\t{d}\tquery {q} text\tpassage {d} with  spaces" for q in ("101", "7", "55")
           for d in rnd.sample(IDS, 12)]
  rnd.shuffle(lines)  # a query's lines need not be together
  path = tmp_path / "top1000.dev.tsv"
  path.write_text("\n".join(lines) + "\n")
  oracle = {}
  for line in lines:
    qid, doc = line.split("\t")[:2]
    oracle.setdefault(qid, []).append(doc)
  ranked = run_arrays.read(path, ["7", "101", "999"], prepared_corpus, depth=10)
  assert ranked.format == run_arrays.TOP1000
  assert _docs(ranked, 0) == oracle["7"][:10] and _docs(ranked, 1) == oracle["101"][:10] and _docs(ranked, 2) == []
  assert ranked.lengths.tolist() == [10, 10, 0]
  np.testing.assert_array_equal(ranked.scores[0], -np.arange(1, 11, dtype=np.float32))


BAD = {
    "columns": ("q1 Q0 d1 1 0.5 t\nq1 Q0 d2 2 0.4\n", 2, "expected 6 columns"),
    "rank": ("q1 Q0 d1 1 0.5 t\nq1 Q0 d2 two 0.4 t\n", 2, "rank 'two' is not an integer"),
    "score": ("q1 Q0 d1 1 high t\n", 1, "score 'high' is not a number"),
    "infinite": ("q1 Q0 d1 1 0.5 t\n\nq1 Q0 d2 2 inf t\n", 3, "score 'inf' is not finite"),
    "unknown doc": ("q1 Q0 d1 1 0.5 t\nq1 Q0 nope 2 0.4 t\n", 2, "doc id 'nope' is not in the corpus"),
    "repeated pair": ("q1 Q0 d1 1 0.5 t\nq1 Q0 d2 2 0.4 t\nq1 Q0 d1 3 0.3 t\n", 3,
                      "run pair ('q1', 'd1') already on line 1"),
    "top1000 then trec": ("q1\td1\tquery\tpassage\nq1 Q0 d2 2 0.4 t\n", 2, "expected 4 tab-separated columns"),
    "top1000 empty id": ("q1\td1\tquery\tpassage\nq1\t \tquery\tpassage\n", 2, "empty doc id"),
    "unknown before malformed": ("q1 Q0 d1 1 0.5 t\nq1 Q0 nope 2 0.4 t\nq1 Q0 d3 x 0.3 t\n", 2, "'nope'"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_line_is_an_error_naming_file_and_line(tmp_path, prepared_corpus, name):
  text, line, reason = BAD[name]
  path = tmp_path / "bad.run"
  path.write_text(text)
  for corpus in (IDS, prepared_corpus):
    with pytest.raises(formats.DataFormatError) as e:
      run_arrays.read(path, ["q1"], corpus, depth=10)
    assert str(e.value).startswith(f"{path}:{line}: ") and reason in str(e.value), str(e.value)


def test_skip_invalid_drops_bad_lines_and_says_how_many(tmp_path, capsys):
  path = tmp_path / "bad.run"
  path.write_text("q1 Q0 d1 1 0.5 t\nq1 Q0 nope 2 0.4 t\nq1 Q0 d2 3 x t\nq1 Q0 d1 4 0.2 t\nq1 Q0 d3 5 0.1 t\n")
  ranked = run_arrays.read(path, ["q1"], IDS, skip_invalid=True)
  assert _docs(ranked, 0) == ["d1", "d3"]
  err = capsys.readouterr().err
  assert f"skipped 3 invalid records in {path}" in err
  assert "1 duplicate id (first on line 4)" in err and "1 unknown id (first on line 2)" in err
  assert "1 malformed line (first on line 3)" in err


def test_lines_of_other_queries_are_checked_but_not_looked_up(tmp_path):
  path = tmp_path / "run.trec"
  path.write_text("q9 Q0 not-in-corpus 1 0.5 t\nq1 Q0 d4 1 0.5 t\n")
  assert _docs(run_arrays.read(path, ["q1"], IDS), 0) == ["d4"]
  path.write_text("q9 Q0 d1 1 0.5\nq1 Q0 d4 1 0.5 t\n")
  with pytest.raises(formats.DataFormatError, match=":1: "):
    run_arrays.read(path, ["q1"], IDS)
