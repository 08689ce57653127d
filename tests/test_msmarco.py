"""MS MARCO's own files as a dataset directory: collection.tsv, queries.SPLIT.tsv, qrels.SPLIT.tsv read as the same
data as their BEIR copy, only the judged queries kept, and every bad file named with its line."""

import json
import os
import pathlib

import ml_collections
import pytest

from conftest import run_module
from jdr.data import formats
from jdr.data import msmarco
from jdr.data import pairs
from jdr.data import prepared
from jdr.data import synthetic

ROOT = pathlib.Path(__file__).resolve().parents[1]
PASSAGES = 120


def write_msmarco(root, passages=PASSAGES, seed=0) -> pathlib.Path:
  """A tiny MS MARCO-layout directory (jdr.data.synthetic), few triples a query."""
  return synthetic.dataset(root, passages, seed=seed, progress=False, layout="msmarco", triples_per_query=6,
                           top1000=20)


def beir_twin(source: pathlib.Path, out: pathlib.Path, splits=(("train", "train"), ("dev.small", "dev"))):
  """The same data in BEIR's layout, converted with nothing of jdr's: the oracle the MS MARCO reader is checked
  against. Only judged queries go to queries.jsonl's splits; unjudged ones too, as BEIR's files hold them."""
  (out / "qrels").mkdir(parents=True)
  with open(source / "collection.tsv", encoding="utf-8") as f, open(out / "corpus.jsonl", "w") as g:
    for line in f:
      pid, text = line.rstrip("\n").split("\t")
      g.write(json.dumps({"_id": pid, "title": "", "text": text}) + "\n")
  with open(out / "queries.jsonl", "w") as g:
    for name in sorted(p.name for p in source.glob("queries.*.tsv")):
      for line in open(source / name, encoding="utf-8"):
        qid, text = line.rstrip("\n").split("\t")
        g.write(json.dumps({"_id": qid, "text": text}) + "\n")
  for split, beir_split in splits:
    with open(out / "qrels" / f"{beir_split}.tsv", "w") as g:
      g.write("query-id\tcorpus-id\tscore\n")
      for line in open(source / f"qrels.{split}.tsv"):
        qid, _, pid, rel = line.split()
        g.write(f"{qid}\t{pid}\t{rel}\n")
  return out


def _cfg(dataset, train_split="train", eval_split="dev.small"):
  return ml_collections.ConfigDict({"dataset": str(dataset), "source": "files", "train_split": train_split,
                                    "eval_split": eval_split, "train_fraction": 1.0})


@pytest.fixture(scope="module")
def marco(tmp_path_factory):
  return write_msmarco(tmp_path_factory.mktemp("marco"))


@pytest.fixture(scope="module")
def twin(marco, tmp_path_factory):
  return beir_twin(marco, tmp_path_factory.mktemp("twin") / "beir")


def test_reads_as_its_beir_copy_and_keeps_only_judged_queries(marco, twin, tmp_path):
  data = pairs.load(_cfg(marco), tmp_path)
  oracle = pairs.load(_cfg(twin, eval_split="dev"), tmp_path)
  assert isinstance(data.corpus, prepared.PreparedCorpus)  # memory-mapped, not a dict of documents
  assert list(data.corpus) == list(oracle.corpus) and list(data.corpus.values()) == list(oracle.corpus.values())
  assert data.train_qrels == oracle.train_qrels and data.eval_qrels == oracle.eval_qrels
  judged = set(data.train_qrels) | set(data.eval_qrels)
  assert set(data.queries) == judged and all(data.queries[q] == oracle.queries[q] for q in judged)
  unjudged = len(formats.read_queries(marco / "queries.train.tsv")) - len(data.train_qrels)
  assert unjudged == synthetic.manifest(marco)["unjudged_train_queries"] > 0
  assert data.files.train_qrels.name == "qrels.train.tsv" and data.files.eval_queries.name == "queries.dev.small.tsv"


def test_dev_small_queries_fall_back_to_the_dev_file_and_say_so(marco, tmp_path, capsys):
  folder = tmp_path / "marco"
  folder.mkdir()
  for name in ("collection.tsv", "queries.train.tsv", "qrels.train.tsv", "qrels.dev.small.tsv"):
    os.symlink(marco / name, folder / name)
  small = (marco / "queries.dev.small.tsv").read_text()
  (folder / "queries.dev.tsv").write_text("900001\tan unjudged dev query\n" + small)
  data = pairs.load(_cfg(folder), tmp_path)
  assert data.files.eval_queries.name == "queries.dev.tsv"
  assert "900001" not in data.queries and len(data.eval_qrels) == synthetic.manifest(marco)["dev_queries"]
  err = capsys.readouterr().err
  assert "queries.dev.small.tsv is not there; the dev.small queries are read from" in err and "queries.dev.tsv" in err


def _copy(marco, folder, **replace):
  folder.mkdir()
  for path in marco.iterdir():
    if path.name in replace:
      (folder / path.name).write_text(replace[path.name])
    elif path.name.endswith(".tsv"):
      os.symlink(path, folder / path.name)
  return folder


def test_bad_files_are_named_with_their_line(marco, tmp_path):
  qrels = (marco / "qrels.train.tsv").read_text().splitlines(keepends=True)
  queries = (marco / "queries.train.tsv").read_text().splitlines(keepends=True)
  cases = [
      ({"qrels.train.tsv": "".join(qrels[:2]) + "1 0 2\n"}, "qrels.train.tsv:3: malformed line"),
      ({"qrels.train.tsv": "".join(qrels[:1]) + "5 0 no-such-pid 1\n"},
       "qrels.train.tsv:2: unknown id: doc id 'no-such-pid' is not in the corpus"),
      ({"qrels.train.tsv": "".join(qrels[:3]) + "77777 0 3 1\n"},
       "qrels.train.tsv:4: unknown id: query id '77777' is not among the queries"),
      # An unjudged query's line is validated too, though the query is not kept.
      ({"queries.train.tsv": "".join(queries) + "123456 no tab here\n"}, f"queries.train.tsv:{len(queries) + 1}: "
                                                                          "malformed line"),
      ({"queries.train.tsv": queries[0] + queries[0] + "".join(queries[1:])}, "queries.train.tsv:2: duplicate id"),
  ]
  for k, (replace, wanted) in enumerate(cases):
    folder = _copy(marco, tmp_path / f"case{k}", **replace)
    with pytest.raises(formats.DataFormatError) as e:
      pairs.load(_cfg(folder), tmp_path)
    assert str(e.value).startswith(str(folder)) and wanted in str(e.value), (wanted, str(e.value))


def test_missing_files_and_splits_name_what_was_looked_for(marco, tmp_path):
  with pytest.raises(FileNotFoundError, match="no qrels.test.tsv in .* splits: dev.small, train"):
    pairs.load(_cfg(marco, eval_split="test"), tmp_path)
  folder = _copy(marco, tmp_path / "no-queries")
  (folder / "queries.dev.small.tsv").unlink()
  with pytest.raises(FileNotFoundError, match="no queries.dev.small.tsv in"):
    pairs.load(_cfg(folder), tmp_path)
  folder = _copy(marco, tmp_path / "no-positive", **{"qrels.train.tsv": "0 0 1 0\n"})
  with pytest.raises(ValueError, match=r"qrels\.train\.tsv: no \(query, document\) pair with relevance > 0"):
    pairs.load(_cfg(folder), tmp_path)
  empty = tmp_path / "empty"
  empty.mkdir()
  with pytest.raises(FileNotFoundError, match="neither corpus.jsonl .* nor collection.tsv"):
    pairs.load(_cfg(empty), tmp_path)
  assert msmarco.layout_of(marco) == "msmarco" and msmarco.layout_of(empty) is None


def _train(workdir, data, *extra):
  tiny = ["--config.model.init_from=", "--config.model.fresh=tiny", "--config.model.pooling=mean",
          "--config.optimizer.learning_rate=1e-3", "--config.optimizer.warmup_steps=2", "--config.batch_size=4",
          "--config.log_every=1", "--config.data.query_max_length=16", "--config.data.doc_max_length=32",
          "--config.num_train_steps=3", "--config.checkpoint_every=0"]
  return run_module("jdr.train", ["--config", str(ROOT / "configs" / "demo.py"), "--workdir", str(workdir),
                                  f"--config.data.dataset={data}", *tiny, *extra])


@pytest.mark.long
def test_trains_and_evaluates_as_its_beir_copy(marco, twin, tmp_path):
  """python -m jdr.train on the MS MARCO directory, negatives from its triples file, trains and evaluates exactly
  as on the BEIR copy (the triples file matched by text against either corpus)."""
  triples = ["--config.negatives.source=triples", "--config.negatives.per_query=1"]
  proc = _train(tmp_path / "marco", marco, "--config.data.eval_split=dev.small", *triples)
  assert proc.returncode == 0, proc.stderr[-3000:]
  manifest = synthetic.manifest(marco)
  assert f"mapped {manifest['triples']} triples of {manifest['train_queries']} queries" in proc.stderr
  oracle = _train(tmp_path / "beir", twin, "--config.data.eval_split=dev", *triples,
                  f"--config.negatives.triples.file={marco / 'triples.train.small.tsv'}")
  assert oracle.returncode == 0, oracle.stderr[-3000:]
  read = lambda w: [{k: v for k, v in json.loads(line).items() if k != "time" and "per_second" not in k}
                    for line in (w / "metrics.jsonl").read_text().splitlines()]
  records = read(tmp_path / "marco")
  assert records == read(tmp_path / "beir")
  assert [r["step"] for r in records if "eval/ndcg@10" in r] == [0, 3]
  assert sum("train/loss" in r for r in records) == 3


@pytest.mark.slow
def test_a_directory_without_a_corpus_is_one_error_line(tmp_path):
  (tmp_path / "data").mkdir()
  proc = _train(tmp_path / "w", tmp_path / "data")
  assert proc.returncode == 2
  lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and "neither corpus.jsonl" in lines[0] and "collection.tsv" in lines[0], proc.stderr[-2000:]


def test_the_triples_source_is_refused_without_its_file(marco, tmp_path):
  """The triples source's own check (jdr.negatives.given.check, run by the negatives' check) refuses a missing
  file in one line, and a file another source would ignore."""
  from jdr.negatives import sources  # pylint: disable=g-import-not-at-top
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  from jdr.runtime import defaults
  c = defaults.get_config()
  c.data.dataset, c.negatives.source, c.negatives.per_query = str(marco), "triples", 1
  sources.check(c)  # the directory's own triples.train.small.tsv
  c.data.dataset = str(tmp_path)
  with pytest.raises(config_files.ConfigError, match=r"negatives.triples.file=.*triples.train.small.tsv: file not "
                                                     r"found; set --config.negatives.triples.file=FILE"):
    sources.check(c)
  c.negatives.source = "random"
  c.negatives.triples.file = str(marco / "triples.train.small.tsv")
  with pytest.raises(config_files.ConfigError, match="read by negatives.source=triples only"):
    sources.check(c)
