"""Which files a dataset directory's splits are read from: BEIR's layout or MS MARCO passage ranking's own.

  BEIR      DIR/corpus.jsonl, DIR/queries.jsonl (every split's queries), DIR/qrels/SPLIT.tsv
  MS MARCO  DIR/collection.tsv (`pid\\tpassage`), DIR/queries.SPLIT.tsv (`qid\\tquery`), DIR/qrels.SPLIT.tsv
            (TREC `qid 0 pid rel`), as microsoft.github.io/msmarco distributes them; triples.train.small.tsv
            beside them is read by negatives.source=triples (jdr.data.triples)

A directory holding corpus.jsonl is BEIR, one holding collection.tsv MS MARCO. In MS MARCO's layout a split's
queries are queries.SPLIT.tsv, else those of the split it narrows (dev.small: queries.dev.tsv, said on stderr):
MS MARCO ships qrels.dev.small.tsv beside both queries files, but a download may hold only the larger one.
Only the queries the selected splits' qrels judge are kept: queries.train.tsv holds 808,731 queries, its qrels
judge 502,939, and evaluation on dev.small asks 6,980 of queries.dev.tsv's 101,093. The corpus is whatever the
caller read (jdr.data.pairs prepares collection.tsv once, memory-mapped, as it does corpus.jsonl).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping

from jdr.runtime import paths
from jdr.data import formats

BEIR_CORPUS = "corpus.jsonl"
MSMARCO_CORPUS = "collection.tsv"
TRIPLES = "triples.train.small.tsv"


@dataclasses.dataclass(frozen=True)
class Files:
  """The files of one dataset directory that a run reads: what every message about its data names."""
  layout: str  # "beir" | "msmarco"
  directory: paths.epath.Path
  corpus: paths.epath.Path
  train_queries: paths.epath.Path
  train_qrels: paths.epath.Path
  eval_queries: paths.epath.Path | None = None
  eval_qrels: paths.epath.Path | None = None


def layout_of(directory: formats.PathLike) -> str | None:
  """"beir" (corpus.jsonl), "msmarco" (collection.tsv) or None (neither)."""
  directory = paths.as_path(directory)
  if (directory / BEIR_CORPUS).exists():
    return "beir"
  if (directory / MSMARCO_CORPUS).exists():
    return "msmarco"
  return None


def check_layout(directory: formats.PathLike) -> str:
  """The directory's layout, or a one-line error naming what was looked for."""
  layout = layout_of(directory)
  if layout is None:
    raise FileNotFoundError(f"{directory}: neither {BEIR_CORPUS} (a BEIR directory) nor {MSMARCO_CORPUS} "
                            "(MS MARCO's own files) is there; data.dataset names a directory holding one of them")
  return layout


def files(directory: formats.PathLike, train_split: str, eval_split: str = "") -> Files:
  """The files of the splits (eval_split "" = none), by the directory's layout (BEIR when it has neither
  corpus file: the reader then names what is missing). Existence is checked by the readers."""
  directory = paths.as_path(directory)
  if layout_of(directory) != "msmarco":
    qrels = lambda split: directory / "qrels" / f"{split}.tsv"
    queries = directory / "queries.jsonl"
    return Files("beir", directory, directory / BEIR_CORPUS, queries, qrels(train_split),
                 queries if eval_split else None, qrels(eval_split) if eval_split else None)
  return Files("msmarco", directory, directory / MSMARCO_CORPUS, queries_file(directory, train_split),
               qrels_file(directory, train_split), queries_file(directory, eval_split) if eval_split else None,
               qrels_file(directory, eval_split) if eval_split else None)


def qrels_file(directory: paths.epath.Path, split: str) -> paths.epath.Path:
  return directory / f"qrels.{split}.tsv"


def queries_file(directory: paths.epath.Path, split: str) -> paths.epath.Path:
  """queries.SPLIT.tsv, else the queries of the split SPLIT narrows (dev.small -> dev): MS MARCO's small dev
  queries are a subset of queries.dev.tsv. The asked-for name when neither is there (the reader names it)."""
  wanted = directory / f"queries.{split}.tsv"
  parent = split
  while not wanted.exists() and "." in parent:
    parent = parent.rsplit(".", 1)[0]
    if (directory / f"queries.{parent}.tsv").exists():
      return directory / f"queries.{parent}.tsv"
  return wanted


def splits(directory: paths.epath.Path) -> list[str]:
  """The splits an MS MARCO directory has qrels for."""
  return sorted(p.name[len("qrels."):-len(".tsv")] for p in directory.glob("qrels.*.tsv"))


def read_splits(where: Files, corpus: Mapping, *, skip_invalid: bool = False) -> tuple[dict, dict, dict | None]:
  """(queries, training qrels, evaluation qrels or None) of an MS MARCO directory, validated against `corpus`.

  The qrels are read first (each pid checked against the corpus), then only the queries they judge; a judged
  query missing from its queries file is an error on its qrels line, as for BEIR."""
  wanted = [(where.train_qrels, where.train_queries, "data.train_split")]
  if where.eval_qrels is not None:
    wanted.append((where.eval_qrels, where.eval_queries, "data.eval_split"))
  read = []
  for qrels_path, queries_path, key in wanted:
    if not qrels_path.exists():
      raise FileNotFoundError(f"{key}: no {qrels_path.name} in {where.directory} (its splits: "
                              f"{', '.join(splits(where.directory)) or 'none'})")
    if not queries_path.exists():
      raise FileNotFoundError(f"{key}: no {queries_path.name} in {where.directory}, so {qrels_path.name}'s "
                              "queries have no text")
    read.append((qrels_path, queries_path, formats.read_qrels(qrels_path, doc_ids=corpus, skip_invalid=skip_invalid)))
  queries: dict[str, str] = {}
  by_file: dict = {}
  for _, queries_path, qrels in read:
    by_file.setdefault(queries_path, set()).update(qrels)
  for queries_path, qids in by_file.items():
    asked = queries_path.name[len("queries."):-len(".tsv")]
    for qrels_path, path, _ in read:
      split = qrels_path.name[len("qrels."):-len(".tsv")]
      if path == queries_path and asked != split:
        print(f"jdr: {where.directory / f'queries.{split}.tsv'} is not there; the {split} queries are read from "
              f"{queries_path}", file=sys.stderr)
    found = formats.read_queries(queries_path, skip_invalid=skip_invalid, only=qids)
    for qid, text in found.items():
      if queries.setdefault(qid, text) != text:
        raise ValueError(f"query {qid!r} has one text in {queries_path} and another in the other split's queries "
                         "file; are the files from one MS MARCO download?")
    if len(found) < len(qids):
      for qrels_path, path, _ in read:
        if path == queries_path:  # names the first judgment of a query the file lacks, by its line
          formats.read_qrels(qrels_path, query_ids=found, skip_invalid=skip_invalid)
  train_qrels = read[0][2]
  eval_qrels = read[1][2] if len(read) > 1 else None
  if where.eval_qrels is not None and where.eval_qrels.name == "qrels.dev.tsv" and (
      where.directory / "qrels.dev.small.tsv").exists():
    print(f"jdr: evaluating on qrels.dev.tsv's {len(eval_qrels)} queries; MS MARCO's published dev figures are "
          "on dev.small (data.eval_split=dev.small)", file=sys.stderr)
  if skip_invalid:  # judgments of the queries a skipped line held go too, as BEIR's reader drops them
    train_qrels = {q: docs for q, docs in train_qrels.items() if q in queries}
    eval_qrels = None if eval_qrels is None else {q: docs for q, docs in eval_qrels.items() if q in queries}
  return queries, train_qrels, eval_qrels
