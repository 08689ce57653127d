"""MS MARCO's triples file mapped from texts to rows (jdr.data.triples) and sampled as negatives
(jdr.negatives.given): against a brute-force dict mapping, through hash collisions and texts shared by several
ids, resumed after a kill, cached, and with every bad line named."""

import numpy as np
import pytest

from jdr.data import formats
from jdr.data import prepared
from jdr.data import triples as triples_lib
from jdr.negatives import given

from test_msmarco import write_msmarco


def _corpus(path, texts):
  path.write_text("".join(f"p{i}\t{t}\n" for i, t in enumerate(texts)))
  return prepared.prepare(path, progress=False)


def brute_force(path, queries, qrels, corpus):
  """(query index, positive row, negative row) of each line by dicts of every text: the oracle."""
  qids = sorted(queries)
  by_query = {}
  for i, q in enumerate(qids):
    by_query.setdefault(queries[q], []).append(i)
  rows = {}
  for row, doc in enumerate(corpus.values()):
    rows.setdefault(doc.text, []).append(row)
  ids = list(corpus)
  out = []
  for line in open(path, encoding="utf-8"):
    query, positive, negative = line.rstrip("\n").split("\t")
    judged = lambda i, r: qrels.get(qids[i], {}).get(ids[r], 0) > 0
    pairs = [(i, r) for i in by_query[query] for r in rows[positive] if judged(i, r)]
    i, pos = pairs[0] if pairs else (by_query[query][0], rows[positive][0])
    out.append((i, pos, rows[negative][0]))
  return np.array(out, np.int32).reshape(-1, 3)


@pytest.fixture(scope="module")
def marco(tmp_path_factory):
  return write_msmarco(tmp_path_factory.mktemp("marco"))


def _load_marco(marco):
  corpus = prepared.prepare(marco / "collection.tsv", progress=False)
  queries = formats.read_queries(marco / "queries.train.tsv")
  qrels = formats.read_qrels(marco / "qrels.train.tsv")
  return corpus, queries, qrels


def _arrays(mapped):
  return np.stack([mapped.query, mapped.positive, mapped.negative], axis=1)


def test_mapping_equals_a_dict_mapping_and_is_cached(marco, tmp_path, monkeypatch):
  corpus, queries, qrels = _load_marco(marco)
  path = marco / "triples.train.small.tsv"
  mapped = triples_lib.load(path, queries, qrels, corpus, progress=False)
  assert np.array_equal(_arrays(mapped), brute_force(path, queries, qrels, corpus))
  assert mapped.folder.parent == corpus.folder / "triples"  # beside the prepared corpus: one mapping for all runs
  for i in range(len(mapped.qids)):  # pools: each query's distinct negatives
    assert mapped.pool(i).tolist() == sorted(set(mapped.negative[mapped.query == i].tolist()))

  def never(*args):
    raise AssertionError("mapped again")

  monkeypatch.setattr(triples_lib.Mapper, "run", never)
  again = triples_lib.load(path, queries, qrels, corpus, progress=False)
  assert again.folder == mapped.folder and np.array_equal(_arrays(again), _arrays(mapped))


def test_colliding_hashes_and_shared_texts_resolve_as_the_dict_mapping(tmp_path, monkeypatch):
  # p1 and p4 share a text, as some MS MARCO passages do; q0 and q2 share a query text.
  texts = ["alpha beta", "gamma delta", "epsilon", "zeta eta theta", "gamma delta", "iota kappa"]
  corpus = _corpus(tmp_path / "collection.tsv", texts)
  queries = {"q0": "what is gamma", "q1": "what is alpha", "q2": "what is gamma"}
  qrels = {"q0": {"p1": 1}, "q1": {"p0": 1}, "q2": {"p4": 1}}
  lines = [("what is gamma", "gamma delta", "epsilon"), ("what is alpha", "alpha beta", "gamma delta"),
           ("what is gamma", "gamma delta", "iota kappa"), ("what is alpha", "alpha beta", "zeta eta theta")]
  path = tmp_path / "triples.tsv"
  path.write_text("".join("\t".join(t) + "\n" for t in lines))
  expected = brute_force(path, queries, qrels, corpus)
  for name, fake_hash in (("python's hash", None), ("every text one hash", lambda s: 7),
                          ("by length", lambda s: len(s) % 3)):
    if fake_hash is not None:
      monkeypatch.setattr(triples_lib, "hash", fake_hash, raising=False)  # shadows the builtin in the module
    mapped = triples_lib.load(path, queries, qrels, corpus, cache_dir=tmp_path / name, progress=False)
    assert mapped.folder.parent == corpus.folder / "triples"
    assert np.array_equal(_arrays(mapped), expected), name
    assert mapped.manifest["same_text_passages"] == 3  # both gamma-delta positives and the shared negative
    triples_lib.shutil.rmtree(mapped.folder)
  # q0 and q2 each judge one of the two "gamma delta" passages: a triple goes to the first query judging one.
  assert [mapped.qids[i] for i in expected[:, 0]] == ["q0", "q1", "q0", "q1"]
  assert [list(corpus)[r] for r in expected[:, 1]] == ["p1", "p0", "p1", "p0"]
  # A text not in the corpus under a corpus text's hash and length is found out by comparing the texts.
  monkeypatch.setattr(triples_lib, "hash", len, raising=False)
  path.write_text("what is alpha\talpha beta\tzeta eta thetX\n")
  with pytest.raises(formats.DataFormatError, match="triples.tsv:1: unknown passage: the negative passage 'zeta eta"):
    triples_lib.load(path, queries, qrels, corpus, progress=False)


def test_a_killed_mapping_resumes_to_the_same_arrays(marco, tmp_path, monkeypatch, capsys):
  corpus, queries, qrels = _load_marco(marco)
  path = tmp_path / "triples.train.small.tsv"  # a file of its own: not the mapping another test made
  path.write_bytes((marco / "triples.train.small.tsv").read_bytes())
  expected = brute_force(path, queries, qrels, corpus)
  monkeypatch.setattr(triples_lib, "CHUNK_LINES", 5)
  write = triples_lib.Mapper.write_arrays
  written = []

  def killed(self, k, arrays, end):
    if len(written) == 3:
      raise KeyboardInterrupt("killed")
    written.append(k)
    write(self, k, arrays, end)

  monkeypatch.setattr(triples_lib.Mapper, "write_arrays", killed)
  with pytest.raises(KeyboardInterrupt):
    triples_lib.load(path, queries, qrels, corpus, cache_dir=tmp_path, progress=False)
  monkeypatch.setattr(triples_lib.Mapper, "write_arrays", write)
  mapped = triples_lib.load(path, queries, qrels, corpus, cache_dir=tmp_path, progress=False)
  assert f"resuming the mapping of {path} at line 16" in capsys.readouterr().err  # after 3 chunks of 5 lines
  assert np.array_equal(_arrays(mapped), expected)
  assert not (mapped.folder / triples_lib.PARTIAL).exists()


def test_bad_lines_name_file_and_line_or_are_counted(tmp_path, capsys):
  corpus = _corpus(tmp_path / "collection.tsv", ["alpha beta", "gamma delta", "epsilon"])
  queries, qrels = {"q0": "what is alpha", "q1": "what is gamma"}, {"q0": {"p0": 1}, "q1": {"p1": 1}}
  good = ["what is alpha\talpha beta\tepsilon\n", "what is gamma\tgamma delta\talpha beta\n"]
  cases = [
      (["what is alpha\talpha beta\n"], "malformed line: expected 3 tab-separated columns"),
      (["what is omega\talpha beta\tepsilon\n"], "unknown query: the query text 'what is omega' is not among"),
      (["what is alpha\talpha beta\tno such passage\n"], "unknown passage: the negative passage 'no such passage'"),
      (["what is alpha\talpha betas\tepsilon\n"], "unknown passage: the positive passage 'alpha betas'"),
      (["what is alpha\talpha beta\tepsilo\n"], "unknown passage: the negative passage 'epsilo'"),  # a shorter text
  ]
  for k, (bad, reason) in enumerate(cases):
    path = tmp_path / f"triples-{k}.tsv"
    path.write_text(good[0] + "".join(bad) + good[1])
    with pytest.raises(formats.DataFormatError) as e:
      triples_lib.load(path, queries, qrels, corpus, cache_dir=tmp_path, progress=False)
    assert str(e.value).startswith(f"{path}:2: {reason}"), str(e.value)
  path = tmp_path / "utf8.tsv"
  path.write_bytes(good[0].encode() + b"what is \xff\talpha beta\tepsilon\n")
  with pytest.raises(formats.DataFormatError, match=r"utf8.tsv:2: bad UTF-8: invalid byte 0xff"):
    triples_lib.load(path, queries, qrels, corpus, cache_dir=tmp_path, progress=False)
  # The earliest bad line is the one named, whichever check finds it.
  path = tmp_path / "order.tsv"
  path.write_text(good[0] + "what is alpha\talpha beta\tmissing\n" + "too\tfew\n")
  with pytest.raises(formats.DataFormatError, match=r"order.tsv:2: unknown passage"):
    triples_lib.load(path, queries, qrels, corpus, cache_dir=tmp_path, progress=False)
  # Skipping: every bad line counted per reason, the good ones mapped.
  path = tmp_path / "skip.tsv"
  path.write_text(good[0] + "".join(bad[0] for bad, _ in cases) + good[1])
  capsys.readouterr()
  mapped = triples_lib.load(path, queries, qrels, corpus, cache_dir=tmp_path, skip_invalid=True, progress=False)
  assert _arrays(mapped).tolist() == [[0, 0, 2], [1, 1, 0]]
  err = capsys.readouterr().err
  assert (f"skipped 5 invalid triples in {path}: 1 malformed line (first on line 2), 3 unknown passage (first on "
          "line 4), 1 unknown query (first on line 3)") in err
  assert mapped.manifest["skipped"] == {"malformed line": 1, "unknown query": 1, "unknown passage": 3}


def test_sampler_draws_from_the_query_triples_without_positives(tmp_path):
  texts = [f"passage {i}" for i in range(12)]
  corpus = _corpus(tmp_path / "collection.tsv", texts)
  queries = {"q0": "first", "q1": "second", "q2": "third"}
  qrels = {"q0": {"p0": 1, "p5": 1}, "q1": {"p1": 1}, "q2": {"p2": 1}}
  lines = ["first\tpassage 0\tpassage 3", "first\tpassage 0\tpassage 4", "first\tpassage 0\tpassage 5",
           "first\tpassage 0\tpassage 3", "second\tpassage 1\tpassage 6"]
  path = tmp_path / "triples.tsv"
  path.write_text("\n".join(lines) + "\n")
  mapped = triples_lib.load(path, queries, qrels, corpus, cache_dir=tmp_path, progress=False)
  source = given.TriplesNegatives(mapped, corpus, qrels)
  assert source.pool("q0") == ["p3", "p4", "p5"] and source.pool("q2") == []
  rng = np.random.default_rng(0)
  seen = set()
  for _ in range(30):
    got = source.sample(["q0"], ["p0"], rng, 2)[0]
    assert len(set(got)) == 2 and set(got) == {"p3", "p4"}  # p5 is a positive of q0: never a negative
    seen.update(got)
  assert source.stats()["fallback_negatives"] == 0
  # q1 has one negative: the second is random (counted); q2 has no triples: all random.
  first = source.sample(["q1", "q2"], ["p1", "p2"], np.random.default_rng(1), 2)
  again = source.sample(["q1", "q2"], ["p1", "p2"], np.random.default_rng(1), 2)
  assert first == again and "p6" in first[0] and "p1" not in first[0] and "p2" not in first[1]
  assert source.stats() == {"sampled_negatives": 62, "fallback_negatives": 6, "fallback_queries": 4}
  assert source.sample(["q1"], ["p1"], rng, 3, exclude=[{"p6"}])[0].count("p6") == 0
