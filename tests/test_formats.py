import gzip
import json

import pytest

from jdr.data import formats as F
from jdr.data.shared import shared_data_dir, shared_dataset


def _jsonl(*records) -> bytes:
  return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


DOC1 = {"_id": "d1", "title": "T1", "text": "first doc"}
DOC2 = {"_id": "d2", "title": "", "text": "second doc"}
Q1 = {"_id": "q1", "text": "what is first"}

# (file name, content, reader, 1-based bad line, reason fragment)
MALFORMED = [
    # BEIR corpus.jsonl
    ("corpus.jsonl", _jsonl(DOC1, b'{"_id": "d2", "text": '), F.read_corpus, 2, "malformed line: bad JSON"),
    ("corpus.jsonl", _jsonl(DOC1, {"title": "t", "text": "x"}), F.read_corpus, 2, "missing field '_id'"),
    ("corpus.jsonl", _jsonl(DOC1, {"_id": "d2", "text": 3}), F.read_corpus, 2, "field 'text' must be a string"),
    ("corpus.jsonl", _jsonl(DOC1, b"[1, 2]"), F.read_corpus, 2, "expected a JSON object"),
    ("corpus.jsonl", _jsonl(DOC1, DOC2, DOC1), F.read_corpus, 3, "duplicate id: doc id 'd1' already on line 1"),
    ("corpus.jsonl", _jsonl(DOC1, {"_id": "d2", "title": " ", "text": ""}), F.read_corpus, 2, "empty text"),
    ("corpus.jsonl", _jsonl(DOC1, b'{"_id": "d2", "text": "caf\xe9"}'), F.read_corpus, 2,
     "bad UTF-8: invalid byte 0xe9"),
    # MS MARCO collection TSV
    ("collection.tsv", b"1\tone\n2\ttwo\tthree\n", F.read_corpus, 2, "malformed line: expected 2 tab-separated"),
    ("collection.tsv", b"1\tone\n\n1\tagain\n", F.read_corpus, 3, "duplicate id"),
    ("collection.tsv", b"1\tone\n2\t  \n", F.read_corpus, 2, "empty text"),
    ("collection.tsv", b"1\tone\n2\t\xff\xfe\n", F.read_corpus, 2, "bad UTF-8"),
    # queries
    ("queries.jsonl", _jsonl(Q1, b"{oops}"), F.read_queries, 2, "malformed line: bad JSON"),
    ("queries.jsonl", _jsonl(Q1, {"_id": "q2", "text": ""}), F.read_queries, 2, "empty text: query 'q2'"),
    ("queries.jsonl", _jsonl(Q1, Q1), F.read_queries, 2, "duplicate id"),
    ("queries.tsv", b"q1\twhat\nq2\n", F.read_queries, 2, "malformed line: expected 2 tab-separated"),
    ("queries.tsv", b"q1\twhat\nq2\t\n", F.read_queries, 2, "empty text"),
    ("queries.tsv", b"q1\t\xc3\n", F.read_queries, 1, "bad UTF-8"),
    # BEIR qrels
    ("test.tsv", b"query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\n", F.read_qrels, 3, "expected 3 tab-separated"),
    ("test.tsv", b"query-id\tcorpus-id\tscore\nq1\td1\t1.5\n", F.read_qrels, 2, "relevance '1.5' is not an integer"),
    ("test.tsv", b"query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td1\t0\n", F.read_qrels, 3, "duplicate id: qrels pair"),
    ("test.tsv", b"query-id\tcorpus-id\tscore\nq1\td\xff\t1\n", F.read_qrels, 2, "bad UTF-8"),
    # TREC qrels
    ("qrels.txt", b"q1 0 d1 1\nq1 0 d2\n", F.read_qrels, 2, "expected 4 columns (TREC qrels"),
    ("qrels.txt", b"q1 0 d1 1\nq1 0 d2 high\n", F.read_qrels, 2, "relevance 'high' is not an integer"),
    ("qrels.txt", b"q1 0 d1 1\nq2 0 d1 1\nq1 0 d1 2\n", F.read_qrels, 3, "duplicate id"),
    # TREC runs
    ("run.trec", b"q1 Q0 d1 1 2.5 t\nq1 Q0 d2 2 1.5\n", F.read_run, 2, "expected 6 columns (TREC run"),
    ("run.trec", b"q1 Q0 d1 1 2.5 t\nq1 Q0 d2 2 high t\n", F.read_run, 2, "score 'high' is not a number"),
    ("run.trec", b"q1 Q0 d1 1 2.5 t\nq1 Q0 d2 2 nan t\n", F.read_run, 2, "is not finite"),
    ("run.trec", b"q1 Q0 d1 one 2.5 t\n", F.read_run, 1, "rank 'one' is not an integer"),
    ("run.trec", b"q1 Q0 d1 1 2.5 t\nq1 Q0 d1 2 1.5 t\n", F.read_run, 2, "duplicate id: run pair"),
    ("run.trec", b"q1 Q0 d1 1 2.5 t\n\x80\n", F.read_run, 2, "bad UTF-8"),
]


@pytest.mark.parametrize("name, content, reader, line, reason", MALFORMED,
                         ids=[f"{m[0]}-{m[4][:30]}" for m in MALFORMED])
def test_malformed_file_names_path_line_and_reason(tmp_path, name, content, reader, line, reason):
  path = tmp_path / name
  path.write_bytes(content)
  with pytest.raises(F.DataFormatError) as info:
    reader(path)
  message = str(info.value)
  assert message.startswith(f"{path}:{line}: ")
  assert reason in message
  assert (info.value.path, info.value.line) == (str(path), line)


def test_qrels_unknown_ids(tmp_path):
  path = tmp_path / "test.tsv"
  path.write_bytes(b"query-id\tcorpus-id\tscore\nq1\td1\t1\nq9\td1\t1\nq1\td9\t1\n")
  with pytest.raises(F.DataFormatError, match=rf"{path}:3: unknown id: query id 'q9'"):
    F.read_qrels(path, query_ids={"q1"})
  with pytest.raises(F.DataFormatError, match=rf"{path}:4: unknown id: doc id 'd9' is not in the corpus"):
    F.read_qrels(path, doc_ids={"d1"})
  assert F.read_qrels(path) == {"q1": {"d1": 1, "d9": 1}, "q9": {"d1": 1}}


class _AskedInBulk:
  """Doc ids a reader asks about many at a time (`contains`), as it asks a prepared corpus."""

  def __init__(self, ids):
    self.ids, self.calls = set(ids), 0

  def contains(self, doc_ids):
    self.calls += 1
    return [d in self.ids for d in doc_ids]


# The first error is on the line named last; the others are later lines: what a file says first is raised first.
_QRELS_FIRST_ERRORS = [
    (["q1\td1\t1", "q1\td9\t1", "q1\td2\tx"], 3, "unknown id: doc id 'd9'"),
    (["q1\td1\t1", "q1\td2\tx", "q1\td9\t1"], 3, "malformed line"),
    (["q1\td1\t1", "q1\td9\t1", "q1\td2\t1", "q1\td9\t1"], 3, "unknown id: doc id 'd9'"),
    (["q1\td1\t1", "q1\td2\t1", "q1\td2\t0", "q1\td9\t1"], 4, "duplicate id: qrels pair"),
    (["q1\td1\t1", "q2\td9\t1"], 3, "unknown id: query id 'q2'"),
]


@pytest.mark.parametrize("lines, line, reason", _QRELS_FIRST_ERRORS)
def test_qrels_doc_ids_asked_in_bulk_fail_on_the_same_line(tmp_path, monkeypatch, lines, line, reason):
  monkeypatch.setattr(F, "QRELS_BLOCK", 2)
  path = tmp_path / "test.tsv"
  path.write_text("query-id\tcorpus-id\tscore\n" + "".join(x + "\n" for x in lines))
  errors = []
  for doc_ids in ({"d1", "d2"}, _AskedInBulk({"d1", "d2"})):
    with pytest.raises(F.DataFormatError) as info:
      F.read_qrels(path, doc_ids=doc_ids, query_ids={"q1"})
    errors.append(str(info.value))
  assert errors[0] == errors[1] and errors[0].startswith(f"{path}:{line}: {reason}")


def test_qrels_doc_ids_asked_in_bulk_skip_what_line_by_line_skips(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(F, "QRELS_BLOCK", 3)
  rows = []
  for i in range(40):  # unknown docs, repeats of unknown and known pairs, malformed lines, interleaved
    doc = f"d{i % 7}" if i % 5 else f"x{i % 3}"
    rows.append(f"q{i % 4}\t{doc}\t{i % 3}" if i % 11 != 4 else f"q{i % 4}\t{doc}")
  path = tmp_path / "test.tsv"
  path.write_text("query-id\tcorpus-id\tscore\n" + "".join(r + "\n" for r in rows))
  known = {f"d{i}" for i in range(6)}
  expected = F.read_qrels(path, doc_ids=known, skip_invalid=True)
  report = capsys.readouterr().err
  bulk = _AskedInBulk(known)
  got = F.read_qrels(path, doc_ids=bulk, skip_invalid=True)
  assert got == expected and list(got) == list(expected)
  assert [list(docs) for docs in got.values()] == [list(docs) for docs in expected.values()]
  assert capsys.readouterr().err == report and "unknown id" in report and "duplicate id" in report
  assert bulk.calls < len(rows) // 2


def test_skip_invalid_reports_counts_per_reason(tmp_path, capsys):
  path = tmp_path / "corpus.jsonl"
  path.write_bytes(_jsonl(DOC1, b"{bad", DOC2, DOC1, {"_id": "d3", "text": " "}, b'{"_id": "d4", "text": "\xff"}',
                          {"_id": "d5", "text": "ok"}, b"nope"))
  corpus = F.read_corpus(path, skip_invalid=True)
  assert list(corpus) == ["d1", "d2", "d5"]
  err = capsys.readouterr().err
  assert f"skipped 5 invalid records in {path}" in err
  for part in ["2 malformed line (first on line 2)", "1 duplicate id (first on line 4)",
               "1 empty text (first on line 5)", "1 bad UTF-8 (first on line 6)"]:
    assert part in err

  qrels = tmp_path / "qrels.txt"
  qrels.write_text("q1 0 d1 1\nq1 0 d1 1\nq1 0 d9 1\nq1 0 d2 x\n")
  assert F.read_qrels(qrels, doc_ids=corpus, skip_invalid=True) == {"q1": {"d1": 1}}
  err = capsys.readouterr().err
  assert "1 duplicate id" in err and "1 unknown id" in err and "1 malformed line" in err

  (tmp_path / "clean.jsonl").write_bytes(_jsonl(DOC1))
  F.read_corpus(tmp_path / "clean.jsonl", skip_invalid=True)
  assert capsys.readouterr().err == ""  # nothing skipped, nothing printed


def test_corpus_and_queries_round_trip(tmp_path):
  corpus = {"a": F.Doc("a", "Title", "text with \u2028 separator and ünïcode"), "b": F.Doc("b", "", "plain")}
  F.write_corpus(tmp_path / "c.jsonl", corpus)
  assert F.read_corpus(tmp_path / "c.jsonl") == corpus
  untitled = {"b": corpus["b"], "7": F.Doc("7", "", "seven")}
  F.write_corpus(tmp_path / "c.tsv", untitled)
  assert F.read_corpus(tmp_path / "c.tsv") == untitled
  with pytest.raises(ValueError, match="title"):
    F.write_corpus(tmp_path / "bad.tsv", corpus)

  queries = {"q1": "what is ünïcode", "2": "x"}
  for name in ["q.jsonl", "q.tsv"]:
    F.write_queries(tmp_path / name, queries)
    assert F.read_queries(tmp_path / name) == queries
  with pytest.raises(ValueError, match="tab or newline"):
    F.write_queries(tmp_path / "bad.tsv", {"q": "a\tb"})


def test_qrels_round_trip_both_formats(tmp_path):
  qrels = {"q1": {"d1": 1, "d2": 0}, "q2": {"d1": 3}}
  F.write_qrels(tmp_path / "beir.tsv", qrels)
  F.write_qrels(tmp_path / "trec.tsv", qrels, trec=True)  # MS MARCO's qrels are TREC lines in a .tsv
  assert (tmp_path / "beir.tsv").read_text().startswith("query-id\tcorpus-id\tscore\n")
  assert (tmp_path / "trec.tsv").read_text().startswith("q1 0 d1 1\n")
  assert F.read_qrels(tmp_path / "beir.tsv") == qrels
  assert F.read_qrels(tmp_path / "trec.tsv") == qrels
  (tmp_path / "msmarco.tsv").write_text("q1\t0\td1\t1\n")
  assert F.read_qrels(tmp_path / "msmarco.tsv") == {"q1": {"d1": 1}}


def test_run_round_trip_orders_like_trec_eval(tmp_path):
  run = {"q2": {"a": 0.5, "b": 2.0, "c": 0.5, "d": 1 / 3}, "q1": {"x": -1.0}}
  path = tmp_path / "run.trec"
  F.write_run(path, run, tag="mine")
  lines = path.read_text().splitlines()
  assert lines[:4] == ["q2 Q0 b 1 2.0 mine", "q2 Q0 c 2 0.5 mine", "q2 Q0 a 3 0.5 mine",
                       f"q2 Q0 d 4 {1 / 3!r} mine"]
  back = F.read_run(path)
  assert back == run and list(back) == ["q2", "q1"]
  assert list(back["q2"]) == ["b", "c", "a", "d"]  # scores exact, ties by doc id descending
  with pytest.raises(ValueError, match="whitespace"):
    F.write_run(path, {"q 1": {"a": 1.0}})


def test_tie_order_matches_trec_eval(tmp_path):
  pytrec_eval = pytest.importorskip("pytrec_eval")
  qrels, run = {"q": {"a": 1}}, {"q": {"a": 1.0, "b": 1.0, "c": 0.0}}
  assert [d for d, _ in F.ranked(run["q"])] == ["b", "a", "c"]
  scores = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(run)
  assert scores["q"]["recip_rank"] == 0.5  # trec_eval also put b (the larger id) first


def test_format_detection_gzip_bom_crlf_and_numeric_ids(tmp_path):
  with gzip.open(tmp_path / "corpus.jsonl.gz", "wb") as f:
    f.write(_jsonl({"_id": 5, "text": "five"}))
  assert F.read_corpus(tmp_path / "corpus.jsonl.gz") == {"5": F.Doc("5", "", "five")}
  (tmp_path / "noext").write_bytes(b"\xef\xbb\xbf" + _jsonl(DOC2).replace(b"\n", b"\r\n"))
  assert F.read_corpus(tmp_path / "noext") == {"d2": F.Doc("d2", "", "second doc")}
  (tmp_path / "noext2").write_bytes(b"1\tone\r\n")
  assert F.read_corpus(tmp_path / "noext2") == {"1": F.Doc("1", "", "one")}


def test_load_beir_filters_queries_to_split(tmp_path):
  corpus = {"d1": F.Doc("d1", "T", "x"), "d2": F.Doc("d2", "", "y")}
  F.write_beir(tmp_path, corpus, {"q1": "a", "q2": "b"}, {"q2": {"d1": 1}}, split="dev")
  assert F.read_corpus(tmp_path) == corpus  # a BEIR directory works as a corpus path
  c, q, qrels = F.load_beir(tmp_path, "dev")
  assert (c, q, qrels) == (corpus, {"q2": "b"}, {"q2": {"d1": 1}})
  assert F.load_beir(tmp_path) == (corpus, {"q1": "a", "q2": "b"}, None)
  with pytest.raises(FileNotFoundError, match=r"splits: \['dev'\]"):
    F.load_beir(tmp_path, "test")
  F.write_qrels(tmp_path / "qrels" / "bad.tsv", {"q1": {"d3": 1}})
  with pytest.raises(F.DataFormatError, match=r"bad.tsv:2: unknown id: doc id 'd3'"):
    F.load_beir(tmp_path, "bad")


def test_error_pickles():
  import pickle
  err = pickle.loads(pickle.dumps(F.DataFormatError("f.tsv", 3, "malformed line: x")))
  assert (str(err), err.line) == ("f.tsv:3: malformed line: x", 3)


def test_real_scifact(scifact):
  corpus, queries, qrels = F.load_beir(scifact, "test")
  assert (len(corpus), len(queries), sum(map(len, qrels.values()))) == (5183, 300, 339)
  assert set(queries) == set(qrels)
  _, train_queries, train_qrels = F.load_beir(scifact, "train")
  assert (len(train_queries), sum(map(len, train_qrels.values()))) == (809, 919)
  assert all(doc.title and doc.text for doc in corpus.values())


def test_real_trec_dl_sample(tmp_path):
  path = shared_dataset("trec-dl-2019-passage-sample")
  if path is None:
    pytest.skip(f"real data absent: {shared_data_dir() / 'trec-dl-2019-passage-sample'} (set JDR_SHARED_DATA)")
  corpus, queries, qrels = F.load_beir(path, "test")
  assert (len(corpus), len(queries), sum(map(len, qrels.values()))) == (5000, 43, 4102)
  assert {rel for docs in qrels.values() for rel in docs.values()} == {1, 2, 3}
  # MS MARCO formats round trip on real text: the passages have no titles.
  F.write_corpus(tmp_path / "collection.tsv", corpus)
  F.write_qrels(tmp_path / "qrels.dev.tsv", qrels, trec=True)
  assert F.read_corpus(tmp_path / "collection.tsv") == corpus
  assert F.read_qrels(tmp_path / "qrels.dev.tsv", doc_ids=corpus, query_ids=queries) == qrels


def test_long_documents_group_whole_abstracts_and_map_qrels(tmp_path):
  """jdr.data.longdocs: every abstract in exactly one document of 1-3, in budget, qrels follow, seeded."""
  import json  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  from jdr.data import formats, longdocs  # pylint: disable=g-import-not-at-top
  from jdr.models import hf  # pylint: disable=g-import-not-at-top
  source = write_tiny_beir(tmp_path / "short", num_docs=40)
  tok = transformers.AutoTokenizer.from_pretrained(str(hf.minilm_path()))
  stats = longdocs.build(source, tmp_path / "long", seed=3, max_tokens=40, tokenizer=tok)
  pieces = {r["_id"]: r["pieces"] for r in map(json.loads, (tmp_path / "long" / "pieces.jsonl").read_text().splitlines())}
  flat = [a for p in pieces.values() for a in p]
  assert sorted(flat) == sorted(formats.read_corpus(source)) and stats["abstracts"] == 40  # none dropped
  corpus = formats.read_corpus(tmp_path / "long")
  short = formats.read_corpus(source)
  for doc_id, members in pieces.items():
    assert 1 <= len(members) <= 3 and (len(members) > 1 or stats["abstracts_per_document"].get("1", 0))
    assert corpus[doc_id].text == "\n\n".join(longdocs.abstract_text(short[a]) for a in members)
    if len(members) > 1:
      assert len(tok(corpus[doc_id].text.replace("\n\n", " "))["input_ids"]) <= 40 + 2
  home = {a: d for d, p in pieces.items() for a in p}
  for split in ("train", "test"):
    old = formats.read_qrels(source / "qrels" / f"{split}.tsv")
    new = formats.read_qrels(tmp_path / "long" / "qrels" / f"{split}.tsv")
    assert new == {q: {home[a]: g for a, g in rels.items()} for q, rels in old.items()}
  again = longdocs.build(source, tmp_path / "again", seed=3, max_tokens=40, tokenizer=tok)
  assert again["documents"] == stats["documents"]
  free = longdocs.build(source, tmp_path / "free", seed=3, tokenizer=tok)  # no cap: 2 or 3 abstracts each
  sizes = [len(r["pieces"]) for r in map(json.loads, (tmp_path / "free" / "pieces.jsonl").read_text().splitlines())]
  assert set(sizes[:-1]) <= {2, 3} and free["documents"] < stats["documents"]
  assert (tmp_path / "again" / "pieces.jsonl").read_text() == (tmp_path / "long" / "pieces.jsonl").read_text()


@pytest.mark.parametrize("suffix", [".jsonl", ".tsv"])
def test_corpus_parts_cover_every_line_once_in_order(tmp_path, suffix):
  """Each host's part (its share of the bytes) read alone: the parts, in order, are the whole corpus, whatever
  the number of parts, with blank lines, long and short lines, CRLF and a byte-order mark in the file."""
  path = tmp_path / f"corpus{suffix}"
  lines = []
  for i in range(23):
    text = "word " * (1 + (i * 7) % 40)
    lines.append(json.dumps({"_id": f"d{i}", "title": "", "text": text}) if suffix == ".jsonl" else f"d{i}\t{text}")
    if i % 5 == 0:
      lines.append("")
  path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
  whole = F.read_corpus(path)
  assert len(whole) == 23
  for parts in (1, 2, 3, 5, 23, 40):
    merged = {}
    for part in range(parts):
      docs = F.read_corpus(path, part=part, parts=parts)
      assert not set(docs) & set(merged)
      merged.update(docs)
    assert list(merged.items()) == list(whole.items()), parts


def test_corpus_part_errors_name_the_files_own_line(tmp_path):
  """A bad record in a later part is reported with its line number in the whole file, not in the part."""
  path = tmp_path / "corpus.tsv"
  path.write_text("".join(f"d{i}\ttext {i}\n" for i in range(30)) + "bad line without a tab\n" + "d31\tx\n")
  with pytest.raises(F.DataFormatError) as err:
    for part in range(3):
      F.read_corpus(path, part=part, parts=3)
  assert err.value.line == 31 and "expected 2 tab-separated columns" in str(err.value)
  dup = tmp_path / "dup.tsv"
  dup.write_text("".join(f"d{i}\ttext\n" for i in range(20)) + "d15\tagain\n")
  with pytest.raises(F.DataFormatError, match=r"dup.tsv:21: duplicate id: doc id 'd15' already on line 16"):
    F.read_corpus(dup, part=1, parts=2)
  gz = tmp_path / "c.tsv.gz"
  with gzip.open(gz, "wt") as f:
    f.write("d1\tx\n")
  with pytest.raises(ValueError, match="cannot be split into parts by bytes"):
    F.read_corpus(gz, part=0, parts=2)


def test_an_empty_queries_file_is_named_not_blamed_on_the_qrels(tmp_path):
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  from jdr.data import formats as formats_lib  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "d")
  (data / "queries.jsonl").write_text("")
  for load in (lambda: formats_lib.load_beir(data, "test"), lambda: formats_lib.load_queries(str(data), "test")):
    with pytest.raises(formats_lib.DataFormatError, match=r"queries.jsonl: holds no queries"):
      load()
