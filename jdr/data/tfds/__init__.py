"""TFDS datasets of retrieval training pairs, built from local BEIR / MS MARCO files, read without TensorFlow.

  prepare("/data/scifact", "/data/tfds", name="scifact")            # once; a no-op when already up to date
  train = load_training_examples("/data/tfds", "scifact")            # random access, len(train) == 919
  train[0] == {"query_id": "0", "query": "...", "doc_id": "31715818", "title": "...", "text": "...",
               "relevance": 1}
  corpus = load_corpus("/data/tfds", "scifact")                      # {"doc_id", "title", "text"} per index
  queries, qrels = load_qrels("/data/tfds", "scifact", "test")       # for jdr.evaluation.metrics

  python -m jdr.data.tfds /data/scifact /data/tfds --name scifact    # the same `prepare` from a shell

The same datasets open with plain TFDS once this package is imported (it registers the builders):
`tfds.data_source("jdr_pairs/scifact", data_dir="/data/tfds")["train"]` (values are bytes there).
`examples_from_source(source_dir, split)` reads the files directly and returns the same dicts in the same
order, so a trainer can take either path. See `builders.py` for the layout of the prepared data.
"""

import logging
import os
import pathlib
import shutil
from collections.abc import Sequence
from typing import Any

import tensorflow_datasets as tfds

from jdr.data.tfds import source
from jdr.data.tfds.builders import JdrCorpus, JdrPairs, check_name
from jdr.data.tfds.source import DOC_FIELDS, PAIR_FIELDS, examples_from_source, find_layout

__all__ = [
    "DOC_FIELDS", "PAIR_FIELDS", "Examples", "JdrCorpus", "JdrPairs", "examples_from_source", "find_layout",
    "load_corpus", "load_qrels", "load_training_examples", "prepare",
]

PathLike = str | os.PathLike


def _is_prepared(builder) -> bool:
  # TFDS's is_prepared() logs a warning for a folder that does not exist yet; that is the normal first run.
  return (builder.data_path / "dataset_info.json").exists() and builder.is_prepared()


def _prepare_one(cls, layout: source.Layout, data_dir: pathlib.Path, name: str, skip_invalid: bool):
  builder = cls(data_dir=os.fspath(data_dir), config=name, skip_invalid=skip_invalid)
  wanted = source.fingerprint(layout, skip_invalid=skip_invalid)
  if _is_prepared(builder):
    if builder.info.metadata.get("source") == wanted:
      return builder
    # TFDS itself would reuse the stale files forever (it keys a dataset by name and version only).
    logging.warning("%s: source %s changed since it was prepared; rebuilding", builder.data_path, layout.root)
    shutil.rmtree(builder.data_path)
    builder = cls(data_dir=os.fspath(data_dir), config=name, skip_invalid=skip_invalid)
  builder.download_and_prepare(
      download_dir=os.fspath(data_dir / "downloads"),
      download_config=tfds.download.DownloadConfig(manual_dir=os.fspath(layout.root)))
  return builder


def prepare(source_dir: PathLike, data_dir: PathLike, *, name: str, corpus: bool = True,
            skip_invalid: bool = False) -> JdrPairs:
  """Builds jdr_pairs/<name> (and jdr_corpus/<name> when `corpus`) under data_dir from a local directory.

  Idempotent: when the prepared data was built from the same files (names, sizes, modification times) with
  the same `skip_invalid`, nothing is rewritten; when the source changed, that dataset is rebuilt. Data errors
  raise `jdr.data.formats.DataFormatError` naming file and line; a missing directory raises FileNotFoundError
  naming it. Multi-host jobs should call this on one host and let the others wait for it.
  """
  check_name(name)
  layout = source.find_layout(source_dir)
  data_dir = pathlib.Path(data_dir).expanduser()
  pairs = _prepare_one(JdrPairs, layout, data_dir, name, skip_invalid)
  if corpus:
    _prepare_one(JdrCorpus, layout, data_dir, name, skip_invalid)
  return pairs


class Examples(Sequence):
  """A random-access view of one prepared split that decodes each record to a dict of str (and int) values.

  Backed by TFDS's ArrayRecord data source, so `len` is free and `examples[i]` reads one record from disk;
  `examples[[i, j, ...]]` (or `__getitems__`) reads a batch in one call, as a sampler-driven loader wants.
  """

  def __init__(self, data_source, fields: Sequence[str]):
    self._source = data_source
    self._fields = tuple(fields)

  def __len__(self) -> int:
    return len(self._source)

  def _decode(self, record: dict) -> dict[str, Any]:
    out = {}
    for key in self._fields:
      value = record[key]
      out[key] = value.decode("utf-8") if isinstance(value, bytes) else int(value)
    return out

  def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
    n = len(self)
    keys = []
    for i in indices:
      i = int(i)
      if not -n <= i < n:
        raise IndexError(f"index {i} out of range for {n} examples")
      keys.append(i % n)
    return [self._decode(r) for r in self._source.__getitems__(keys)]

  def __getitem__(self, index):
    if isinstance(index, slice):
      return self.__getitems__(range(*index.indices(len(self))))
    if isinstance(index, (list, tuple)) or getattr(index, "ndim", 0) == 1:
      return self.__getitems__(index)
    return self.__getitems__([index])[0]

  def __iter__(self):
    batch = 1024  # batched reads: one record at a time costs a file seek each
    for start in range(0, len(self), batch):
      yield from self.__getitems__(range(start, min(start + batch, len(self))))

  def __repr__(self) -> str:
    return f"Examples({len(self)} x {self._fields})"


def _open(cls, data_dir: PathLike, name: str, split: str):
  builder = cls(data_dir=os.fspath(pathlib.Path(data_dir).expanduser()), config=check_name(name))
  if not _is_prepared(builder):
    raise FileNotFoundError(f"no prepared {builder.name}/{name} at {builder.data_path}; run "
                            f"jdr.data.tfds.prepare(source_dir, {os.fspath(data_dir)!r}, name={name!r}) first")
  if split not in builder.info.splits:
    raise ValueError(f"{builder.name}/{name} has no split {split!r} (splits: {sorted(builder.info.splits)})")
  return builder.as_data_source(split)


def load_training_examples(data_dir: PathLike, name: str, split: str = "train") -> Examples:
  """The prepared positive pairs of one split: dicts with PAIR_FIELDS, same order as `examples_from_source`."""
  return Examples(_open(JdrPairs, data_dir, name, split), PAIR_FIELDS)


def load_corpus(data_dir: PathLike, name: str) -> Examples:
  """The prepared corpus: dicts with DOC_FIELDS (doc_id, title, text), in the source file's order."""
  return Examples(_open(JdrCorpus, data_dir, name, "corpus"), DOC_FIELDS)


def load_qrels(data_dir: PathLike, name: str, split: str) -> tuple[dict[str, str], dict[str, dict[str, int]]]:
  """(queries, qrels) of a prepared split, for `jdr.evaluation.metrics.evaluate`.

  Built from the stored positive pairs, so judgments with relevance <= 0 are absent: no jdr metric counts them,
  but a query judged only non-relevant is missing too (BEIR datasets have none).
  """
  queries: dict[str, str] = {}
  qrels: dict[str, dict[str, int]] = {}
  for ex in load_training_examples(data_dir, name, split):
    queries[ex["query_id"]] = ex["query"]
    qrels.setdefault(ex["query_id"], {})[ex["doc_id"]] = ex["relevance"]
  return queries, qrels
