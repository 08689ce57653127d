"""Training files that carry their own negatives, read as a mined directory's arrays (`jdr.negatives.mining`).

Tevatron's JSONL, both of its schemas, names documents by id:

  v1   {"query_id": .., "query": .., "positive_passages": [{"docid": .., "title": .., "text": ..}, ...],
        "negative_passages": [{"docid": .., ...}, ...]}
  v2   {"query_id": .., "query_text": .., "positive_document_ids": [..], "negative_document_ids": [..]}

sentence-transformers' rows (JSONL, or Parquet with pyarrow) name them by text, as its hard-negative miner writes
them: {"anchor": query text, "positive": passage text, "negative": text} or "negative_1" ... "negative_n", and,
optionally, "scores" (the miner's `output_scores` column; "score" is read too): the teacher's scores, the
positive's first, then each negative's. An anchor is matched to the training query with exactly its text (where
several queries share it, the one whose qrels judge the positive), a passage to the corpus row with exactly its
text (`triples.PassageRows`: hashes, then the text compared); a negative whose text several rows hold names the
relevant one, or the positive, where one of them is.

The schema is decided by the first record, and every later one must be the same kind. A query on several
records gets the union of their negatives in order of first appearance; a negative its qrels judge relevant, or
that is one of the query's given positives, is dropped (counted). A malformed record, an unknown doc id, query or
passage is a `formats.DataFormatError` ("FILE:LINE: reason"; Parquet: the row number); with `skip_invalid` such
records are counted per reason and reported, never dropped silently.
"""

from __future__ import annotations

import collections
import pathlib
import sys
from collections.abc import Iterator, Mapping

import numpy as np

from jdr.data import formats
from jdr.data import triples
from jdr.negatives import mining

_Invalid = formats.Invalid

TEVATRON_V1, TEVATRON_V2, SENTENCE_TRANSFORMERS = "tevatron-v1", "tevatron-v2", "sentence-transformers"


def _schema_of(obj: dict) -> str:
  if "query_id" in obj and "negative_passages" in obj:
    return TEVATRON_V1
  if "query_id" in obj and "negative_document_ids" in obj:
    return TEVATRON_V2
  if "anchor" in obj and ("negative" in obj or "negative_1" in obj):
    return SENTENCE_TRANSFORMERS
  raise _Invalid(formats.MALFORMED, "not a training record with negatives: expected Tevatron's 'query_id' and "
                 "'negative_passages' (v1) or 'negative_document_ids' (v2), or sentence-transformers' 'anchor', "
                 "'positive' and 'negative' / 'negative_1'...")


def _id_list(obj: dict, key: str, *, passages: bool) -> list[str]:
  value = obj.get(key, [])
  if not isinstance(value, list):
    raise _Invalid(formats.MALFORMED, f"{key!r} must be a list, got {type(value).__name__}")
  if passages:
    if not all(isinstance(p, dict) for p in value):
      raise _Invalid(formats.MALFORMED, f"{key!r} must hold objects with a 'docid'")
    value = [p.get("docid") for p in value]
  bad = [i for i in value if not isinstance(i, (str, int)) or isinstance(i, bool)]
  if bad:
    raise _Invalid(formats.MALFORMED, f"{key!r}: doc ids must be strings, got {bad[0]!r}")
  return [str(i) for i in value]


def _texts(obj: dict) -> tuple[str, str, list[str], list[float] | None]:
  """(anchor, positive, negatives, scores or None) of a sentence-transformers record."""
  def text(key):
    value = obj.get(key)
    if not isinstance(value, str) or not value:
      raise _Invalid(formats.MALFORMED, f"{key!r} must be a non-empty string")
    return value
  keys = ["negative"] if "negative" in obj else []
  k = 1
  while f"negative_{k}" in obj:
    keys.append(f"negative_{k}")
    k += 1
  if "scores" in obj and "score" in obj:
    raise _Invalid(formats.MALFORMED, "both 'scores' and 'score': give the teacher's scores once")
  scores = obj.get("scores", obj.get("score"))
  if scores is not None:
    if (not isinstance(scores, list) or len(scores) != 1 + len(keys)
        or not all(isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores)):
      raise _Invalid(formats.MALFORMED, f"'scores' must be {1 + len(keys)} numbers (the positive's, then each "
                     "negative's)")
    scores = [float(s) for s in scores]
  return text("anchor"), text("positive"), [text(key) for key in keys], scores


class _Reader:
  def __init__(self, path: pathlib.Path, corpus, queries: Mapping[str, str], qrels, skip_invalid: bool):
    self.path, self.corpus, self.queries, self.qrels = path, corpus, queries, qrels
    self.skip_invalid = skip_invalid
    self.schema = None
    self.negatives: dict[str, dict[int, float]] = {}  # query -> {row: teacher score (NaN: none)}, in order
    self.positives: dict[str, dict[int, float]] = {}
    self.dropped = 0
    self._texts = self._query_of = None
    self._relevant: dict[str, set[int]] = {}

  def relevant(self, qid: str) -> set[int]:
    if qid not in self._relevant:
      judged = [d for d, r in self.qrels.get(qid, {}).items() if r > 0]
      self._relevant[qid] = set(self.rows_of(judged).tolist())
    return self._relevant[qid]

  def rows_of(self, ids: list[str]) -> np.ndarray:
    if hasattr(self.corpus, "row_of"):
      return np.asarray(self.corpus.row_of(ids, missing=-1))
    if self._texts is None:
      self._texts = triples.CorpusTexts(self.corpus)
    return self._texts.rows_of(ids)

  def record(self, obj: dict) -> None:
    kind = _schema_of(obj)
    if self.schema is not None and kind != self.schema:
      raise _Invalid(formats.MALFORMED, f"a {kind} record in a file of {self.schema} records")
    if kind == SENTENCE_TRANSFORMERS:
      qid, positive, negatives, scores = self._by_text(obj)
    else:
      qid = str(obj["query_id"])
      positive_key, negative_key = (("positive_passages", "negative_passages") if kind == TEVATRON_V1 else
                                    ("positive_document_ids", "negative_document_ids"))
      ids = _id_list(obj, negative_key, passages=kind == TEVATRON_V1)
      positive_ids = _id_list(obj, positive_key, passages=kind == TEVATRON_V1)
      rows = self.rows_of(positive_ids + ids)
      unknown = [d for d, r in zip(positive_ids + ids, rows.tolist()) if r < 0]
      if unknown:
        raise _Invalid(formats.UNKNOWN, f"doc id {unknown[0]!r} is not in the corpus")
      positive, negatives, scores = rows[:len(positive_ids)].tolist(), rows[len(positive_ids):].tolist(), None
    self.schema = kind
    relevant = self.relevant(qid)
    mine = self.negatives.setdefault(qid, {})
    pos = self.positives.setdefault(qid, {})
    for i, r in enumerate(positive):
      pos.setdefault(r, np.nan if scores is None else scores[0])
    for i, r in enumerate(negatives):
      if r in relevant or r in pos:
        self.dropped += 1
      elif r not in mine:
        mine[r] = np.nan if scores is None else scores[1 + i]

  def _by_text(self, obj: dict) -> tuple[str, list[int], list[int], list[float] | None]:
    anchor, positive, negatives, scores = _texts(obj)
    if self._query_of is None:
      self._query_of = collections.defaultdict(list)
      for qid in sorted(self.qrels):
        if qid in self.queries:
          self._query_of[self.queries[qid]].append(qid)
      self._passages = triples.PassageRows(triples.CorpusTexts(self.corpus), progress=True,
                                           desc=f"{self.path.name}: hash the corpus")
    found, several = self._passages.lookup([positive] + negatives)
    for i, r in enumerate(found.tolist()):
      if r == -1:
        what = "positive" if i == 0 else "negative"
        raise _Invalid(formats.UNKNOWN, f"the {what} passage {triples.shown(([positive] + negatives)[i])} is not "
                       "in the corpus")
    positive_rows = several.get(0, [int(found[0])])
    qids = self._query_of.get(anchor, [])
    if not qids:
      raise _Invalid(formats.UNKNOWN, f"the anchor {triples.shown(anchor)} is not the text of a training query")
    judging = [q for q in qids if self.relevant(q) & set(positive_rows)]
    if len(qids) > 1 and not judging:
      raise _Invalid(formats.MALFORMED, f"the anchor {triples.shown(anchor)} is the text of queries "
                     f"{', '.join(map(repr, qids[:3]))}, none of whose qrels judge its positive relevant")
    qid = (judging or qids)[0]
    positive = [r for r in positive_rows if r in self.relevant(qid)] or positive_rows[:1]
    # A negative text several rows hold names the row that makes it a false negative, where one does.
    false = self.relevant(qid) | set(positive)
    negatives = [r if r != -2 else next((x for x in several[i] if x in false), several[i][0])
                 for i, r in enumerate(found.tolist()) if i > 0]
    return qid, positive, negatives, scores

  def result(self) -> mining.Mined:
    qids = sorted(self.negatives)
    width = max((len(self.negatives[q]) for q in qids), default=0)
    pos_width = max((len(self.positives[q]) for q in qids), default=0)
    rows = np.full((len(qids), max(width, 1)), -1, np.int32)
    teacher = np.full(rows.shape, np.nan, np.float32)
    positives = np.full((len(qids), max(pos_width, 1)), -1, np.int32)
    positive_teacher = np.full(positives.shape, np.nan, np.float32)
    for i, q in enumerate(qids):
      rows[i, :len(self.negatives[q])] = list(self.negatives[q])
      teacher[i, :len(self.negatives[q])] = list(self.negatives[q].values())
      positives[i, :len(self.positives[q])] = list(self.positives[q])
      positive_teacher[i, :len(self.positives[q])] = list(self.positives[q].values())
    has_teacher = bool(np.isfinite(teacher).any())
    meta = {"source": str(self.path), "schema": self.schema, "dropped_positives": self.dropped,
            "num_docs": len(self.corpus), "teacher": has_teacher}
    return mining.Mined(qids, rows, np.full(rows.shape, np.nan, np.float32), positives,
                        teacher if has_teacher else None, positive_teacher if has_teacher else None, meta)


def _parquet_rows(path: pathlib.Path) -> Iterator[tuple[int, dict]]:
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
  at = 0
  for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
    for obj in batch.to_pylist():
      at += 1
      yield at, obj


# The last file `load` read: the negatives source and the distiller (distill.teacher=mined) both ask for it, and a
# sentence-transformers file costs a pass over the corpus's texts (MS MARCO: minutes) each time it is read.
_last_read: tuple[tuple, mining.Mined] | None = None


def load(path, corpus, queries: Mapping[str, str], qrels) -> mining.Mined:
  """What `negatives.mined.file` names: a `python -m jdr.mine` directory (checked to be of this corpus), or a file of
  training records with negatives (`read`, once per file, corpus and qrels)."""
  global _last_read
  if pathlib.Path(path).is_dir():
    mined = mining.read(path)
    mining.check_corpus(mined, corpus, path)
    return mined
  stat = pathlib.Path(path).stat()
  key = (str(pathlib.Path(path).resolve()), stat.st_mtime_ns, stat.st_size, id(corpus), id(queries), id(qrels))
  if _last_read is None or _last_read[0] != key:
    _last_read = (key, read(path, corpus, queries, qrels))
  return _last_read[1]


def read(path: formats.PathLike, corpus, queries: Mapping[str, str], qrels: Mapping[str, Mapping[str, int]], *,
         skip_invalid: bool = False) -> mining.Mined:
  """The negatives (and any teacher scores) of a Tevatron or sentence-transformers file, by training query."""
  path = pathlib.Path(path)
  reader = _Reader(path, corpus, queries, qrels, skip_invalid)
  if path.suffix == ".parquet":
    counts, first = collections.Counter(), {}
    for rowno, obj in _parquet_rows(path):
      try:
        reader.record(obj)
      except _Invalid as e:
        if not skip_invalid:
          raise formats.DataFormatError(path, rowno, f"{e.args[0]}: {e.args[1]}") from None
        counts[e.args[0]] += 1
        first.setdefault(e.args[0], rowno)
    if counts:
      print(f"jdr: skipped {sum(counts.values())} invalid rows of {path}: " + ", ".join(
          f"{n} {kind} (first at row {first[kind]})" for kind, n in sorted(counts.items())), file=sys.stderr)
  else:
    with formats.reading(path, skip_invalid) as f:
      for lineno, line in f.lines():
        try:
          reader.record(formats.json_record(line))
        except _Invalid as e:
          f.bad(lineno, e)
  if reader.schema is None:
    raise ValueError(f"{path}: no training record with negatives in it")
  return reader.result()
