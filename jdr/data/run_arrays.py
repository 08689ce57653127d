"""A run file read as arrays: each asked query's ranked documents as corpus rows, for evaluation candidates
and for training negatives.

  ranked = run_arrays.read("top1000.dev.tsv", query_ids, corpus, depth=1000)
  ranked.rows     int32 [Q, depth]: row i is query_ids[i]'s documents as corpus rows, best first, -1 past its last
  ranked.scores   float32 [Q, depth]: their scores, -inf past the last
  ranked.lengths  int32 [Q]: how many documents each query has (0: the run has no line for it)

Formats, decided by the first non-blank line (every later line must be the same kind):

  TREC run          `qid Q0 docid rank score tag`, whitespace-separated. Ranked as trec_eval ranks (and
                    `formats.read_run`): score descending, ties by doc id descending; the rank column is checked
                    to be an integer and otherwise ignored.
  MS MARCO top1000  `qid\\tpid\\tquery text\\tpassage text` (top1000.dev.tsv): no scores, so a query's lines
                    rank in file order, and its score is minus its position (-1.0, -2.0, ...).

`corpus` maps doc ids to rows: a `jdr.data.prepared.PreparedCorpus` (looked up in bulk, a block of lines at a
time) or anything that iterates its doc ids in row order (a {doc id: Doc} dict, a list of ids).

Memory is bounded by what is asked, not by the file: lines of other queries are checked and dropped, and with
`depth` the lines kept are cut back to each query's best `depth` whenever they pass a few times Q x depth, so
a 1,000-deep run of every MS MARCO training query read for 200 of them holds about 200 x 1,000 entries.

Errors are `formats`': a malformed line, a doc id the corpus lacks, or a (query, doc) pair given twice raises
`formats.DataFormatError` ("FILE:LINE: reason"). With `skip_invalid=True` such lines are dropped, counted per
reason and reported on stderr, never silently. Only the asked queries' doc ids are looked up, and a repeated
pair is found among the lines a query keeps (its best `depth`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from jdr.runtime import paths
from jdr.data import formats
from jdr.data import prepared

_Invalid = formats.Invalid

TREC, TOP1000 = "trec", "top1000"
BLOCK = 1 << 16  # lines whose doc ids are looked up at once
SLACK = 4  # with a depth, kept entries are cut back once they pass this many times Q x depth


@dataclasses.dataclass
class RankedArrays:
  rows: np.ndarray  # int32 [Q, k]: corpus rows, best first, -1 past a query's last
  scores: np.ndarray  # float32 [Q, k]: -inf past a query's last
  lengths: np.ndarray  # int32 [Q]: documents per query (0: not in the run)
  format: str  # TREC or TOP1000


def read(path: formats.PathLike, query_ids: Sequence[str], corpus, *, depth: int | None = None,
         skip_invalid: bool = False) -> RankedArrays:
  """The ranked documents of `query_ids` in the run at `path`, at most `depth` a query (None: all of them);
  see the module docstring."""
  if depth is not None and depth < 1:
    raise ValueError(f"depth must be >= 1 (or None for every line), got {depth}")
  query_index = {q: i for i, q in enumerate(query_ids)}
  if len(query_index) != len(query_ids):
    raise ValueError("query_ids repeats an id")
  rows_of = _Rows(corpus)
  kept = _Kept(list(query_ids), depth, rows_of)
  pending: list[tuple[int, int, str, float]] = []  # (line, query index, doc id, score): ids not looked up yet
  path = paths.as_path(path)
  kind = None
  position: dict[int, int] = {}  # top1000: lines seen per query, its rank in file order

  with formats.reading(path, skip_invalid) as f:

    def settle() -> None:
      """Looks up the pending lines' doc ids, rejecting unknown ones in line order."""
      if not pending:
        return
      rows = rows_of.lookup([doc for _, _, doc, _ in pending])
      for (lineno, _, doc, _), row in zip(pending, rows.tolist()):
        if row < 0:
          f.bad(lineno, _Invalid(formats.UNKNOWN, f"doc id {doc!r} is not in the corpus"))
      known = rows >= 0
      kept.add(np.array([p[1] for p in pending], np.int32)[known], rows[known],
               np.array([p[3] for p in pending], np.float64)[known],
               np.array([p[0] for p in pending], np.int64)[known], f)
      pending.clear()

    for lineno, line in f.lines():
      try:
        if kind is None:
          kind = TOP1000 if len(line.split("\t")) == 4 else TREC
        qid, doc, score = _parse(line, kind)
      except _Invalid as e:
        if not skip_invalid:
          settle()  # an earlier line's error comes first
          kept.check_repeats(f)
        f.bad(lineno, e)
        continue
      i = query_index.get(qid)
      if i is None:
        continue
      if kind == TOP1000:
        position[i] = position.get(i, 0) + 1
        score = -float(position[i])
      pending.append((lineno, i, doc, score))
      if len(pending) >= BLOCK:
        settle()
    settle()
    kept.check_repeats(f)
  rows, scores, lengths = kept.arrays()
  return RankedArrays(rows, scores, lengths, kind or TREC)


def _parse(line: str, kind: str) -> tuple[str, str, float]:
  """(query id, doc id, score) of one line; raises _Invalid."""
  if kind == TOP1000:
    fields = line.split("\t")
    if len(fields) != 4:
      raise _Invalid(formats.MALFORMED, f"expected 4 tab-separated columns (MS MARCO top1000: qid, pid, query, "
                     f"passage), got {len(fields)}")
    qid, doc = formats.check_id(fields[0], "query"), formats.check_id(fields[1], "doc")
    return qid, doc, 0.0
  fields = line.split()
  if len(fields) != 6:
    raise _Invalid(formats.MALFORMED, f"expected 6 columns (TREC run: qid Q0 docid rank score tag), got "
                   f"{len(fields)}")
  qid, _, doc, rank, score, _ = fields
  try:
    int(rank)
  except ValueError:
    raise _Invalid(formats.MALFORMED, f"rank {rank!r} is not an integer") from None
  try:
    value = float(score)
  except ValueError:
    raise _Invalid(formats.MALFORMED, f"score {score!r} is not a number") from None
  if not math.isfinite(value):
    raise _Invalid(formats.MALFORMED, f"score {score!r} is not finite")
  return qid, doc, value


class _Rows:
  """Doc ids to corpus rows and back, for a prepared corpus (in bulk, nothing per document) or any other."""

  def __init__(self, corpus):
    if isinstance(corpus, prepared.PreparedCorpus):
      self._prepared, self._ids, self._row = corpus, None, None
    else:
      self._prepared = None
      self._ids = list(corpus.keys() if isinstance(corpus, Mapping) else corpus)
      self._row = {d: i for i, d in enumerate(self._ids)}

  def lookup(self, doc_ids: list[str]) -> np.ndarray:
    """int32 rows, -1 for an id the corpus lacks."""
    if self._prepared is not None:
      return self._prepared.row_of(doc_ids, missing=-1).astype(np.int32)
    get = self._row.get
    return np.fromiter((get(d, -1) for d in doc_ids), np.int32, count=len(doc_ids))

  def ids(self, rows: Iterable[int]) -> list[str]:
    rows = [int(r) for r in rows]
    return self._prepared.ids(rows) if self._prepared is not None else [self._ids[r] for r in rows]


class _Kept:
  """The entries (query index, row, score, line) kept so far, in blocks; cut back to each query's best
  `depth` when they grow past SLACK x Q x depth."""

  def __init__(self, query_ids: list[str], depth: int | None, rows_of: _Rows):
    self.query_ids, self.q, self.depth, self.rows_of = query_ids, len(query_ids), depth, rows_of
    self.blocks: list[tuple[np.ndarray, ...]] = []
    self.size = 0
    self.limit = max(SLACK * self.q * depth, BLOCK) if depth else None

  def add(self, qi, rows, scores, lines, f) -> None:
    if len(qi):
      self.blocks.append((qi, rows, scores, lines))
      self.size += len(qi)
    if self.limit is not None and self.size > self.limit:
      self._cut(f)

  def _merged(self) -> tuple[np.ndarray, ...]:
    if not self.blocks:
      return (np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float64), np.zeros(0, np.int64))
    merged = tuple(np.concatenate(parts) for parts in zip(*self.blocks))
    self.blocks = [merged]
    return merged

  def check_repeats(self, f) -> None:
    """A (query, doc) pair on two kept lines: the later line is the error (or dropped, counted)."""
    qi, rows, scores, lines = self._merged()
    if len(qi) < 2:
      return
    order = np.lexsort((lines, rows, qi))
    same = (qi[order][1:] == qi[order][:-1]) & (rows[order][1:] == rows[order][:-1])
    if not same.any():
      return
    later, first = order[1:][same], order[:-1][same]
    # A pair on three lines: each repeat is reported against the line before it, the first of all in file order.
    by_line = np.argsort(lines[later], kind="stable")
    docs = self.rows_of.ids(rows[later][by_line])
    for j, k in enumerate(by_line.tolist()):
      f.bad(int(lines[later[k]]), _Invalid(formats.DUPLICATE, formats.already(
          "run pair", (self.query_ids[int(qi[later[k]])], docs[j]), int(lines[first[k]]))))
    keep = np.ones(len(qi), bool)
    keep[later] = False
    self.blocks = [tuple(a[keep] for a in (qi, rows, scores, lines))]
    self.size = int(keep.sum())

  def _ranked(self) -> tuple[np.ndarray, ...]:
    """The entries sorted by query, then score descending, ties by doc id descending (trec_eval's order)."""
    qi, rows, scores, lines = self._merged()
    order = np.lexsort((lines, -scores, qi))
    qi, rows, scores, lines = qi[order], rows[order], scores[order], lines[order]
    tied = (qi[1:] == qi[:-1]) & (scores[1:] == scores[:-1])
    if tied.any():
      # Runs of equal (query, score) are put in doc id order, descending: only the tied rows' ids are read.
      starts = np.flatnonzero(np.diff(np.concatenate([[0], tied.astype(np.int8), [0]])) == 1)
      ends = np.flatnonzero(np.diff(np.concatenate([[0], tied.astype(np.int8), [0]])) == -1) + 1
      for a, b in zip(starts.tolist(), ends.tolist()):
        ids = self.rows_of.ids(rows[a:b])
        within = sorted(range(b - a), key=lambda j: ids[j], reverse=True)
        for array in (rows, lines):
          array[a:b] = array[a:b][within]
    return qi, rows, scores, lines

  def _cut(self, f) -> None:
    self.check_repeats(f)
    qi, rows, scores, lines = self._ranked()
    rank = _rank_within(qi)
    keep = rank < self.depth
    self.blocks = [tuple(a[keep] for a in (qi, rows, scores, lines))]
    self.size = int(keep.sum())

  def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    qi, rows, scores, _ = self._ranked()
    lengths = np.bincount(qi, minlength=self.q).astype(np.int32)
    k = self.depth if self.depth else int(lengths.max(initial=0))
    rank = _rank_within(qi)
    keep = rank < k
    out_rows = np.full((self.q, k), -1, np.int32)
    out_scores = np.full((self.q, k), -np.inf, np.float32)
    out_rows[qi[keep], rank[keep]] = rows[keep]
    out_scores[qi[keep], rank[keep]] = scores[keep]
    return out_rows, out_scores, np.minimum(lengths, k).astype(np.int32)


def _rank_within(qi: np.ndarray) -> np.ndarray:
  """0, 1, 2, ... within each run of equal values of a sorted array."""
  if not len(qi):
    return np.zeros(0, np.int64)
  starts = np.concatenate([[0], np.flatnonzero(qi[1:] != qi[:-1]) + 1])
  first = np.repeat(starts, np.diff(np.concatenate([starts, [len(qi)]])))
  return np.arange(len(qi)) - first
