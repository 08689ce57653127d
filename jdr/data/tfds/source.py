"""Reading a local BEIR or MS MARCO directory into jdr's training examples, with no TFDS involved.

The TFDS builders in `builders.py` write exactly what these functions return, so a trainer can read either the
prepared `array_record` files or the source files and get the same examples in the same order.

Layouts (the first that matches wins):

  BEIR       corpus.jsonl[.gz], queries.jsonl[.gz], qrels/<split>.tsv
  MS MARCO   collection.tsv[.gz], queries.<split>.tsv or queries.tsv, qrels.<split>.tsv
             (TREC `qid 0 pid rel` lines, as MS MARCO ships them; BEIR-style qrels work too)

A split is one qrels file. Its examples are the qrels lines with relevance > 0, in file order, each joined with
its query text and its document's title and text. Judgments with relevance <= 0 are not training positives and
are left out (their count is logged); no metric in jdr counts them as relevant.
"""

import dataclasses
import logging
import os
import pathlib
import re
from collections.abc import Iterator, Sequence

from jdr.data import formats

PathLike = str | os.PathLike

# The example types, shared by the builders, `examples_from_source` and the TFDS loaders.
PAIR_FIELDS = ("query_id", "query", "doc_id", "title", "text", "relevance")
DOC_FIELDS = ("doc_id", "title", "text")

# TFDS split names must match (\w|-)+, so "dev.small" (MS MARCO's qrels.dev.small.tsv) becomes "dev_small".
_SPLIT_CHARS = re.compile(r"[^\w-]")


@dataclasses.dataclass(frozen=True)
class Layout:
  """The files of one source directory: `qrels` and `queries` map a split name to its file."""

  root: pathlib.Path
  corpus: pathlib.Path
  queries: dict[str, pathlib.Path]
  qrels: dict[str, pathlib.Path]

  @property
  def splits(self) -> list[str]:
    return list(self.qrels)

  def files(self) -> list[pathlib.Path]:
    return sorted({self.corpus, *self.queries.values(), *self.qrels.values()})


LAYOUT_HELP = """\
Expected a local directory in one of these layouts (nothing is downloaded):
  BEIR:     corpus.jsonl, queries.jsonl, qrels/<split>.tsv   (e.g. an unzipped BEIR dataset such as scifact/)
  MS MARCO: collection.tsv, queries.<split>.tsv (or queries.tsv), qrels.<split>.tsv
Each qrels file becomes one split of positive (query, document) pairs."""


def _first(root: pathlib.Path, names: Sequence[str]) -> pathlib.Path | None:
  for name in names:
    if (root / name).is_file():
      return root / name
  return None


def _split_name(stem: str) -> str:
  return _SPLIT_CHARS.sub("_", stem)


def find_layout(source_dir: PathLike) -> Layout:
  """Finds the corpus, queries and qrels files of a BEIR or MS MARCO directory; errors name the path."""
  root = pathlib.Path(source_dir).expanduser()
  if not root.is_dir():
    raise FileNotFoundError(f"dataset source directory not found: {root}\n{LAYOUT_HELP}")
  if corpus := _first(root, ("corpus.jsonl", "corpus.jsonl.gz")):
    queries = _first(root, ("queries.jsonl", "queries.jsonl.gz"))
    if queries is None:
      raise FileNotFoundError(f"{root}: BEIR corpus found but no queries.jsonl\n{LAYOUT_HELP}")
    qrels = {_split_name(p.name[:-len(".tsv")]): p for p in sorted((root / "qrels").glob("*.tsv"))}
    query_files = {split: queries for split in qrels}
  elif corpus := _first(root, ("collection.tsv", "collection.tsv.gz")):
    qrels = {}
    query_files = {}
    for path in sorted(root.glob("qrels.*.tsv")):
      stem = path.name[len("qrels."):-len(".tsv")]
      query_file = _first(root, (f"queries.{stem}.tsv", "queries.tsv"))
      if query_file is None:
        raise FileNotFoundError(f"{root}: {path.name} has no queries.{stem}.tsv (or queries.tsv)\n{LAYOUT_HELP}")
      qrels[_split_name(stem)] = path
      query_files[_split_name(stem)] = query_file
  else:
    raise FileNotFoundError(f"{root}: no corpus.jsonl or collection.tsv found\n{LAYOUT_HELP}")
  if not qrels:
    raise FileNotFoundError(f"{root}: no qrels files found, so there are no query-document pairs\n{LAYOUT_HELP}")
  return Layout(root=root, corpus=corpus, queries=query_files, qrels=qrels)


def fingerprint(layout: Layout, *, skip_invalid: bool) -> dict:
  """What a prepared dataset was built from: re-preparing rebuilds when this changes, and only then.

  File sizes and modification times stand in for contents: hashing a multi-GB MS MARCO collection on every
  `prepare` call would cost more than the rebuild it guards against.
  """
  files = []
  for path in layout.files():
    stat = path.stat()
    files.append([str(path.relative_to(layout.root)), stat.st_size, stat.st_mtime_ns])
  return {"source_dir": str(layout.root.resolve()), "files": files, "skip_invalid": skip_invalid}


def iter_docs(layout: Layout, *, skip_invalid: bool = False) -> Iterator[dict]:
  """The corpus as {"doc_id", "title", "text"} dicts, in file order."""
  for doc in formats.iter_corpus(layout.corpus, skip_invalid=skip_invalid):
    yield {"doc_id": doc.id, "title": doc.title, "text": doc.text}


def read_pairs(layout: Layout, splits: Sequence[str] | None = None, *,
               skip_invalid: bool = False) -> dict[str, list[dict]]:
  """The positive pairs of each split: {split: [{"query_id", "query", "doc_id", "title", "text", "relevance"}]}.

  The corpus is streamed once and only the judged documents are kept, so an 8.8M-passage MS MARCO collection
  costs a set of ids in memory, not the whole text.
  """
  splits = layout.splits if splits is None else list(splits)
  for split in splits:
    if split not in layout.qrels:
      raise ValueError(f"no split {split!r} in {layout.root} (splits: {layout.splits})")
  queries_by_file: dict[pathlib.Path, formats.Queries] = {}
  qrels: dict[str, formats.Qrels] = {}
  for split in splits:
    query_file = layout.queries[split]
    if query_file not in queries_by_file:
      queries_by_file[query_file] = formats.read_queries(query_file, skip_invalid=skip_invalid)
    qrels[split] = formats.read_qrels(layout.qrels[split], query_ids=queries_by_file[query_file],
                                      skip_invalid=skip_invalid)
  wanted = {doc_id for split_qrels in qrels.values() for docs in split_qrels.values() for doc_id in docs}
  all_ids: set[str] = set()
  docs: dict[str, formats.Doc] = {}
  for doc in formats.iter_corpus(layout.corpus, skip_invalid=skip_invalid):
    all_ids.add(doc.id)
    if doc.id in wanted:
      docs[doc.id] = doc
  if wanted - all_ids:
    # Read again, now against the corpus ids, so the error (or the skip count) names the qrels file and line.
    for split in splits:
      qrels[split] = formats.read_qrels(layout.qrels[split], doc_ids=all_ids,
                                        query_ids=queries_by_file[layout.queries[split]], skip_invalid=skip_invalid)

  pairs: dict[str, list[dict]] = {}
  for split in splits:
    queries = queries_by_file[layout.queries[split]]
    examples = []
    dropped = 0
    for qid, judged in qrels[split].items():
      for doc_id, rel in judged.items():
        if rel <= 0:
          dropped += 1
          continue
        doc = docs[doc_id]
        examples.append({"query_id": qid, "query": queries[qid], "doc_id": doc_id, "title": doc.title,
                         "text": doc.text, "relevance": rel})
    if dropped:
      logging.info("%s: left out %d judgments with relevance <= 0 (not positives)", layout.qrels[split], dropped)
    pairs[split] = examples
  return pairs


def examples_from_source(source_dir: PathLike, split: str = "train", *, skip_invalid: bool = False) -> list[dict]:
  """The training examples of one split read straight from the files: what the TFDS dataset holds, in order."""
  layout = find_layout(source_dir)
  return read_pairs(layout, [split], skip_invalid=skip_invalid)[split]
