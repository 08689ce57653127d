"""The TFDS builders: prepare a tiny local BEIR directory, read it back through array_record data sources."""

import collections
import csv
import json
import os
import pathlib

import pytest

from jdr.data import formats
from jdr.data import tfds as jdr_tfds

NAME = "tiny"
# Grades 0 and 2 and a query whose judgments are not on adjacent lines: the cases a loader gets wrong.
TRAIN_QRELS = [("q0", "d1", 1), ("q1", "d2", 1), ("q0", "d3", 2), ("q2", "d4", 0), ("q2", "d5", 1),
               ("q3", "d1", 1)]
TEST_QRELS = [("q4", "d6", 1), ("q4", "d7", 3)]


def _write_tiny_beir(root: pathlib.Path, train_qrels=TRAIN_QRELS) -> pathlib.Path:
  root.mkdir(parents=True)
  with open(root / "corpus.jsonl", "w", encoding="utf-8") as f:
    for i in range(10):
      f.write(json.dumps({"_id": f"d{i}", "title": f"Title {i}" if i % 3 else "",
                          "text": f"Doc {i} text, with ünïcode and a\ttab."}, ensure_ascii=False) + "\n")
  with open(root / "queries.jsonl", "w", encoding="utf-8") as f:
    for i in range(6):
      f.write(json.dumps({"_id": f"q{i}", "text": f"query number {i}?"}) + "\n")
  (root / "qrels").mkdir()
  for split, rows in (("train", train_qrels), ("test", TEST_QRELS)):
    with open(root / "qrels" / f"{split}.tsv", "w") as f:
      f.write("query-id\tcorpus-id\tscore\n")
      f.writelines(f"{q}\t{d}\t{r}\n" for q, d, r in rows)
  return root


def _positive_qrels_lines(path: pathlib.Path) -> list[tuple[str, str, int]]:
  """The qrels file parsed independently of jdr.data.formats."""
  with open(path, newline="") as f:
    rows = list(csv.reader(f, delimiter="\t"))[1:]
  return [(q, d, int(r)) for q, d, r in rows if int(r) > 0]


def _raw_docs(path: pathlib.Path) -> dict[str, dict]:
  with open(path, encoding="utf-8") as f:
    return {obj["_id"]: obj for obj in map(json.loads, f)}


def _file_stamps(data_dir: pathlib.Path) -> dict[str, int]:
  return {str(p.relative_to(data_dir)): p.stat().st_mtime_ns for p in data_dir.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """One prepared tiny dataset shared by the module: (source dir, data dir, pairs builder)."""
  base = tmp_path_factory.mktemp("tfds")
  source = _write_tiny_beir(base / "src")
  data_dir = base / "prepared"
  builder = jdr_tfds.prepare(source, data_dir, name=NAME)
  return source, data_dir, builder


def test_train_examples_are_exactly_the_positive_qrels_pairs(tiny):
  source, data_dir, _ = tiny
  examples = jdr_tfds.load_training_examples(data_dir, NAME)
  expected = _positive_qrels_lines(source / "qrels" / "train.tsv")
  assert len(examples) == len(expected) == 5
  got = [(ex["query_id"], ex["doc_id"], ex["relevance"]) for ex in examples]
  assert collections.Counter(got) == collections.Counter(expected)
  docs = _raw_docs(source / "corpus.jsonl")
  queries = {q["_id"]: q["text"] for q in _raw_docs(source / "queries.jsonl").values()}
  for ex in examples:
    assert set(ex) == set(jdr_tfds.PAIR_FIELDS)
    assert ex["query"] == queries[ex["query_id"]]
    assert (ex["title"], ex["text"]) == (docs[ex["doc_id"]]["title"], docs[ex["doc_id"]]["text"])
  # Same dicts, same order as reading the files directly: the trainer may take either path.
  assert list(examples) == jdr_tfds.examples_from_source(source, "train")


def test_random_access_and_plain_tfds_data_source(tiny):
  import tensorflow_datasets as tfds

  _, data_dir, builder = tiny
  examples = jdr_tfds.load_training_examples(data_dir, NAME)
  everything = list(examples)
  assert examples[-1] == everything[-1]
  assert examples[[3, 0]] == [everything[3], everything[0]]
  assert examples[1:4] == everything[1:4]
  with pytest.raises(IndexError):
    examples[len(examples)]
  # The registered builder also opens by name with stock TFDS (values stay bytes there).
  raw = tfds.data_source(f"jdr_pairs/{NAME}", data_dir=os.fspath(data_dir), split="train")
  assert len(raw) == len(examples)
  assert raw[0]["query_id"].decode() == everything[0]["query_id"]
  assert len(builder.as_data_source("test")) == len(TEST_QRELS)


def test_corpus_and_eval_qrels(tiny):
  source, data_dir, _ = tiny
  corpus = jdr_tfds.load_corpus(data_dir, NAME)
  docs = _raw_docs(source / "corpus.jsonl")
  assert [(d["doc_id"], d["title"], d["text"]) for d in corpus] == [
      (i, d["title"], d["text"]) for i, d in docs.items()]
  queries, qrels = jdr_tfds.load_qrels(data_dir, NAME, "test")
  assert qrels == formats.read_qrels(source / "qrels" / "test.tsv")
  assert queries == {"q4": "query number 4?"}


def test_reprepare_is_a_no_op(tiny, monkeypatch):
  import tensorflow_datasets as tfds

  source, data_dir, _ = tiny
  before = _file_stamps(data_dir)
  built = []
  monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", lambda self, **_: built.append(self.name))
  builder = jdr_tfds.prepare(source, data_dir, name=NAME)
  assert built == [], "an up-to-date dataset is not built again"
  assert _file_stamps(data_dir) == before
  assert builder.info.splits["train"].num_examples == 5


def test_changed_source_is_rebuilt(tmp_path):
  source = _write_tiny_beir(tmp_path / "src")
  jdr_tfds.prepare(source, tmp_path / "out", name=NAME, corpus=False)
  assert len(jdr_tfds.load_training_examples(tmp_path / "out", NAME)) == 5
  qrels = source / "qrels" / "train.tsv"
  qrels.write_text(qrels.read_text() + "q5\td9\t1\n")
  jdr_tfds.prepare(source, tmp_path / "out", name=NAME, corpus=False)
  examples = jdr_tfds.load_training_examples(tmp_path / "out", NAME)
  assert len(examples) == 6 and examples[-1]["doc_id"] == "d9"


def test_ms_marco_layout(tmp_path):
  src = tmp_path / "msmarco"
  src.mkdir()
  (src / "collection.tsv").write_text("".join(f"{i}\tpassage {i}\n" for i in range(10)))
  (src / "queries.train.tsv").write_text("100\twhat is one\n101\twhat is two\n")
  (src / "queries.dev.small.tsv").write_text("200\tdev query\n")
  (src / "qrels.train.tsv").write_text("100 0 1 1\n101 0 2 1\n")  # TREC columns, as MS MARCO ships them
  (src / "qrels.dev.small.tsv").write_text("200\t0\t7\t1\n")
  builder = jdr_tfds.prepare(src, tmp_path / "out", name="msmarco-mini", corpus=False)
  assert set(builder.info.splits) == {"train", "dev_small"}
  assert list(jdr_tfds.load_training_examples(tmp_path / "out", "msmarco-mini", "dev_small")) == [
      {"query_id": "200", "query": "dev query", "doc_id": "7", "title": "", "text": "passage 7", "relevance": 1}]


def test_missing_source_dir_names_the_path(tmp_path):
  missing = tmp_path / "no-such-dataset"
  with pytest.raises(FileNotFoundError, match=str(missing)):
    jdr_tfds.prepare(missing, tmp_path / "out", name=NAME)
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match=f"{empty}.*no corpus.jsonl"):
    jdr_tfds.prepare(empty, tmp_path / "out", name=NAME)
  assert not (tmp_path / "out").exists()


def test_bad_qrels_name_file_and_line(tmp_path):
  source = _write_tiny_beir(tmp_path / "src", train_qrels=[("q0", "d1", 1), ("q1", "nope", 1)])
  with pytest.raises(formats.DataFormatError) as err:
    jdr_tfds.prepare(source, tmp_path / "out", name=NAME, corpus=False)
  assert err.value.path.endswith("train.tsv") and err.value.line == 3 and "nope" in err.value.reason


def test_load_errors(tmp_path, tiny):
  with pytest.raises(FileNotFoundError, match="prepare"):
    jdr_tfds.load_training_examples(tmp_path, NAME)
  with pytest.raises(ValueError, match="splits"):
    jdr_tfds.load_training_examples(tiny[1], NAME, "dev")
  with pytest.raises(ValueError, match="dataset name"):
    jdr_tfds.prepare(tiny[0], tmp_path, name="bad/name")


def test_scifact_train_pairs(scifact, tmp_path):
  builder = jdr_tfds.prepare(scifact, tmp_path, name="scifact")
  train = jdr_tfds.load_training_examples(tmp_path, "scifact")
  assert len(train) == builder.info.splits["train"].num_examples == 919
  assert len(jdr_tfds.load_training_examples(tmp_path, "scifact", "test")) == 339
  assert len(jdr_tfds.load_corpus(tmp_path, "scifact")) == 5183
  got = collections.Counter((ex["query_id"], ex["doc_id"], ex["relevance"]) for ex in train)
  assert got == collections.Counter(_positive_qrels_lines(scifact / "qrels" / "train.tsv"))
