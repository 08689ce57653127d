"""Readers and writers for BEIR, MS MARCO and TREC files, with line-level validation.

Formats (the reader picks one from the file's extension and first line):

  corpus   BEIR `corpus.jsonl` ({"_id", "title", "text"} per line) or MS MARCO `collection.tsv` (`pid\\ttext`)
  queries  BEIR `queries.jsonl` ({"_id", "text"}) or MS MARCO `queries.tsv` (`qid\\ttext`)
  qrels    BEIR `qrels/<split>.tsv` (header `query-id\\tcorpus-id\\tscore`, then tab-separated rows) or
           TREC four columns `qid 0 docid rel` (any whitespace; MS MARCO's `qrels.*.tsv` are this kind)
  runs     TREC six columns `qid Q0 docid rank score tag`

Every problem in a file raises `DataFormatError` naming the file, the 1-based line and the reason, so a broken
download is found at load time rather than as a silently wrong metric. Files are read as bytes and decoded one
line at a time: bad UTF-8 is reported with its line number, and only `\\n` ends a line (a str-mode
`splitlines` would also split on U+2028 and friends, which occur inside real passages). With
`skip_invalid=True` bad records are dropped and a count per reason is printed to stderr, never silently.
Blank lines are not records and are ignored. Readers keep file order (dicts preserve insertion order).
"""

import collections
import contextlib
import dataclasses
import gzip
import json
import math
import os
import sys
from collections.abc import Container, Iterator, Mapping
from typing import NamedTuple

from jdr.runtime import atomic
from jdr.runtime import paths

PathLike = str | os.PathLike


class Doc(NamedTuple):
  id: str
  title: str
  text: str


Corpus = dict[str, Doc]
Queries = dict[str, str]
Qrels = dict[str, dict[str, int]]
Run = dict[str, dict[str, float]]

# The reasons a record is rejected; `skip_invalid` counts per reason.
MALFORMED = "malformed line"
DUPLICATE = "duplicate id"
EMPTY = "empty text"
BAD_UTF8 = "bad UTF-8"
UNKNOWN = "unknown id"

_BEIR_QRELS_HEADER = ("query-id", "corpus-id", "score")


class DataFormatError(ValueError):
  """A data file is malformed; `str()` is "{path}:{line}: {reason}" (line is 1-based, None for the whole file)."""

  def __init__(self, path: PathLike, line: int | None, reason: str):
    # Passing all three to ValueError keeps the exception picklable (multiprocessing, pytest-xdist).
    super().__init__(str(path), line, reason)
    self.path = str(path)
    self.line = line
    self.reason = reason

  def __str__(self) -> str:
    where = self.path if self.line is None else f"{self.path}:{self.line}"
    return f"{where}: {self.reason}"


class Invalid(Exception):
  """A bad record found while parsing one line; `_File.bad` turns it into an error or a count."""

  def __init__(self, kind: str, detail: str):
    super().__init__(kind, detail)
    self.kind = kind
    self.detail = detail


@dataclasses.dataclass
class _File:
  """One file being read: yields its decoded lines and either raises on bad records or counts them.

  With `byte_range` only the lines that start inside [start, end) are read (a host's part of a corpus): their
  numbers are counted from the range's first line, and turned into the file's own line numbers (`line`) only
  when a message needs one, by counting the newlines before the range then.
  """

  path: paths.epath.Path
  skip_invalid: bool
  byte_range: tuple[int, int | None] | None = None  # end None: to the end of the file
  counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  first_line: dict = dataclasses.field(default_factory=dict)
  _lines_before: int | None = None

  def line(self, local: int) -> int:
    """The file's 1-based line number of the range's `local`-th line."""
    if self.byte_range is None or self.byte_range[0] == 0:
      return local
    if self._lines_before is None:
      self._lines_before = line_number_at(self.path, self.byte_range[0]) - 1
    return self._lines_before + local

  def bad(self, lineno: int, err: Invalid) -> None:
    if not self.skip_invalid:
      raise DataFormatError(self.path, self.line(lineno), f"{err.kind}: {err.detail}")
    self.counts[err.kind] += 1
    self.first_line.setdefault(err.kind, lineno)

  def _raw_lines(self) -> Iterator[tuple[int, bytes]]:
    """(byte offset, raw line); offsets count the decompressed bytes of a gzip file."""
    start, end = self.byte_range or (0, None)
    with _open_bytes(self.path) as f:
      if self.byte_range is None and self.path.suffix == ".gz":
        f = gzip.open(f, "rb")
      f.seek(start)
      at = start
      while end is None or at < end:
        raw = f.readline()
        if not raw:
          break
        yield at, raw
        at += len(raw)

  def lines(self) -> Iterator[tuple[int, str]]:
    for lineno, _, _, line in self.lines_at():
      yield lineno, line

  def lines_at(self) -> Iterator[tuple[int, int, int, str]]:
    """(line number, byte offset, byte length, decoded line) of each non-blank line (a leading byte-order mark
    is outside the offset and length)."""
    at_file_start = self.byte_range is None or self.byte_range[0] == 0
    for lineno, (offset, raw) in enumerate(self._raw_lines(), 1):
      if lineno == 1 and at_file_start and raw.startswith(b"\xef\xbb\xbf"):
        raw, offset = raw[3:], offset + 3  # a UTF-8 byte-order mark, as some Windows tools write
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        self.bad(lineno, Invalid(BAD_UTF8, f"invalid byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line"))
        continue
      line = line.rstrip("\r\n")
      if line.strip():
        yield lineno, offset, len(raw), line

  def report(self) -> None:
    if self.counts:
      parts = ", ".join(f"{n} {kind} (first on line {self.line(self.first_line[kind])})"
                        for kind, n in sorted(self.counts.items()))
      total = sum(self.counts.values())
      print(f"jdr: skipped {total} invalid record{'' if total == 1 else 's'} in {self.path}: {parts}", file=sys.stderr)


def _open_bytes(path: PathLike, mode: str = "rb"):
  """A binary file on local disk or object storage (gs://, s3://: etils.epath)."""
  return paths.as_path(path).open(mode)


@contextlib.contextmanager
def reading(path: PathLike, skip_invalid: bool, byte_range: tuple[int, int | None] | None = None,
             lines_before: int | None = None) -> Iterator[_File]:
  f = _File(paths.as_path(path), skip_invalid, byte_range, _lines_before=lines_before)
  try:
    yield f
  finally:
    # Also runs when a streaming consumer stops early, so skipped records are always reported.
    f.report()


def is_jsonl(path: paths.epath.Path) -> bool:
  """BEIR JSONL or a TSV? By extension, else by whether the first non-blank byte opens a JSON object."""
  name = path.name[:-3] if path.name.endswith(".gz") else path.name
  if name.endswith((".jsonl", ".json")):
    return True
  if name.endswith((".tsv", ".txt")):
    return False
  with _open_bytes(path) as f:
    return (gzip.open(f, "rb") if path.suffix == ".gz" else f).read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{")




def json_record(line: str) -> dict:
  try:
    obj = json.loads(line)
  except json.JSONDecodeError as e:
    # json's messages may end in "at" ("Unterminated string starting at"): the column completes them.
    raise Invalid(MALFORMED, f"bad JSON ({e.msg}{'' if e.msg.endswith(' at') else ' at'} column {e.colno})") from None
  if not isinstance(obj, dict):
    raise Invalid(MALFORMED, f"expected a JSON object, got {type(obj).__name__}")
  return obj


def _json_field(obj: dict, key: str, *, required: bool = True) -> str:
  value = obj.get(key)
  if value is None:
    if required:
      raise Invalid(MALFORMED, f"missing field {key!r}")
    return ""
  if key == "_id" and isinstance(value, int) and not isinstance(value, bool):
    return str(value)  # some BEIR exports write numeric ids; BEIR itself treats ids as strings
  if not isinstance(value, str):
    raise Invalid(MALFORMED, f"field {key!r} must be a string, got {type(value).__name__}")
  return value


def _tsv_fields(line: str, n: int, what: str) -> list[str]:
  fields = line.split("\t")
  if len(fields) != n:
    raise Invalid(MALFORMED, f"expected {n} tab-separated columns ({what}), got {len(fields)}")
  return fields


def check_id(value: str, what: str) -> str:
  if not value.strip():
    raise Invalid(MALFORMED, f"empty {what} id")
  return value


def _check_new(seen: dict, key, what: str, line=lambda local: local) -> None:
  if key in seen:
    raise Invalid(DUPLICATE, already(what, key, line(seen[key])))


def already(what: str, key, line: int) -> str:
  """The detail of a duplicate: "doc id 'd1' already on line 3"."""
  return f"{what} {key!r} already on line {line}"


# ---------------------------------------------------------------------------------------------------------------
# Corpus and queries
# ---------------------------------------------------------------------------------------------------------------


def corpus_file(path: PathLike) -> paths.epath.Path:
  """The corpus file a path names: itself, or a directory's corpus.jsonl (BEIR), else its collection.tsv (MS
  MARCO's own files)."""
  path = paths.as_path(path)
  if path.is_dir():
    beir, msmarco = path / "corpus.jsonl", path / "collection.tsv"
    path = msmarco if msmarco.exists() and not beir.exists() else beir
  return path




def iter_corpus(path: PathLike, *, skip_invalid: bool = False, part: int = 0, parts: int = 1) -> Iterator[Doc]:
  """Streams a corpus file (or a BEIR directory) one validated `Doc` at a time; see `read_corpus`.

  With parts > 1 it streams only part `part` of `parts`: the lines that start in that part's equal share of
  the file's bytes, so each host of a job reads and parses only its own part (`corpus_part_bytes`). Ids are
  then checked for duplicates within the part; a job's merged output checks across parts.
  """
  for doc, _, _ in iter_corpus_lines(path, skip_invalid=skip_invalid, part=part, parts=parts):
    yield doc


def iter_corpus_lines(path: PathLike, *, skip_invalid: bool = False, part: int = 0,
                      parts: int = 1) -> Iterator[tuple[Doc, int, int]]:
  """`iter_corpus` with where each document's line lies in the file: (doc, byte offset, byte length)."""
  path = corpus_file(path)
  byte_range = None
  if parts > 1:
    if path.suffix == ".gz":
      raise ValueError(f"{path}: a gzip file cannot be split into parts by bytes; decompress it first")
    byte_range = corpus_part_bytes(path, part, parts)
  seen: dict[str, int] = {}  # id -> line; the only per-document state kept while streaming
  for _, offset, length, doc in _corpus_records(path, skip_invalid, byte_range, None, seen):
    yield doc, offset, length


def iter_corpus_records(path: PathLike, *, skip_invalid: bool = False,
                        start: tuple[int, int] = (0, 1)) -> Iterator[tuple[int, int, int, Doc]]:
  """(line number, byte offset, byte length, doc) of each valid document from byte offset `start[0]`, the
  start of line `start[1]`, to the end of the file, with every check but one: ids are not checked for
  duplicates, so nothing is kept per document. A caller that keeps its ids elsewhere (jdr.data.prepared, in
  arrays) checks them itself; starting mid-file lets it resume where it stopped."""
  path = corpus_file(path)
  offset, line = start
  if offset and path.suffix == ".gz":
    raise ValueError(f"{path}: a gzip file cannot be read from a byte offset; decompress it first")
  byte_range, before = ((offset, None), line - 1) if offset else (None, 0)
  for local, offset, length, doc in _corpus_records(path, skip_invalid, byte_range, before, None):
    yield before + local, offset, length, doc


def _corpus_records(path: paths.epath.Path, skip_invalid: bool, byte_range, lines_before: int | None,
                    seen: dict[str, int] | None) -> Iterator[tuple[int, int, int, Doc]]:
  """The validated records of a corpus file, line numbers counted from the range's first line; ids are checked
  for duplicates against `seen` unless None."""
  jsonl = is_jsonl(path)
  with reading(path, skip_invalid, byte_range, lines_before) as f:
    for lineno, offset, length, line in f.lines_at():
      try:
        doc = parse_doc(line, jsonl)
        if seen is not None:
          _check_new(seen, doc.id, "doc id", f.line)
        if not doc.title.strip() and not doc.text.strip():
          raise Invalid(EMPTY, f"doc {doc.id!r} has empty title and text")
      except Invalid as e:
        f.bad(lineno, e)
        continue
      if seen is not None:
        seen[doc.id] = lineno
      yield lineno, offset, length, doc


def parse_doc(line: str, jsonl: bool) -> Doc:
  """One corpus line (BEIR JSON or `pid\ttext`) -> Doc; raises Invalid (a malformed line)."""
  if jsonl:
    obj = json_record(line)
    return Doc(check_id(_json_field(obj, "_id"), "doc"), _json_field(obj, "title", required=False),
               _json_field(obj, "text"))
  doc_id, text = _tsv_fields(line, 2, "pid, text")
  return Doc(check_id(doc_id, "doc"), "", text)


def line_number_at(path: PathLike, offset: int) -> int:
  """The 1-based line number of the line starting at byte `offset` of a file (for messages: reads the bytes
  before it)."""
  count, left = 0, offset
  with _open_bytes(path) as f:
    while left:
      chunk = f.read(min(left, 1 << 24))
      if not chunk:
        break
      count, left = count + chunk.count(b"\n"), left - len(chunk)
  return count + 1


def corpus_part_bytes(path: PathLike, part: int, parts: int) -> tuple[int, int]:
  """Byte range [start, end) of part `part` of `parts` of a file: the lines whose first byte lies in the
  part's equal share of the bytes. Parts are contiguous and in order, and cover every line exactly once;
  finding a boundary reads one line."""
  if not 0 <= part < parts:
    raise ValueError(f"part {part} is not in 0..{parts - 1}")
  path = paths.as_path(corpus_file(path))
  size = path.stat().length

  def line_start(offset: int) -> int:  # where the first line starting at or after `offset` begins
    if offset <= 0:
      return 0
    if offset >= size:
      return size
    with _open_bytes(path) as f:
      f.seek(offset - 1)
      return offset - 1 + len(f.readline())

  return line_start(size * part // parts), line_start(size * (part + 1) // parts)


def read_corpus(path: PathLike, *, skip_invalid: bool = False, part: int = 0, parts: int = 1) -> Corpus:
  """Reads BEIR corpus.jsonl, an MS MARCO collection TSV (`pid\\ttext`), or a BEIR directory -> {id: Doc}; with
  parts > 1 only part `part` of them (see `iter_corpus`)."""
  return {doc.id: doc for doc in iter_corpus(path, skip_invalid=skip_invalid, part=part, parts=parts)}


def iter_queries(path: PathLike, *, skip_invalid: bool = False,
                 only: Container[str] | None = None) -> Iterator[tuple[str, str]]:
  """Streams (query id, text) pairs from BEIR queries.jsonl or an MS MARCO queries TSV (`qid\\ttext`).

  With `only`, every line is still validated but only the queries it names are yielded, and only they are
  checked for duplicates: MS MARCO's queries.train.tsv holds 808,731 queries of which the training qrels judge
  502,939, and remembering every id's line would cost a Python object per unused query."""
  path = paths.as_path(path)
  jsonl = is_jsonl(path)
  seen: dict[str, int] = {}
  with reading(path, skip_invalid) as f:
    for lineno, line in f.lines():
      try:
        if jsonl:
          obj = json_record(line)
          qid, text = check_id(_json_field(obj, "_id"), "query"), _json_field(obj, "text")
        else:
          qid, text = _tsv_fields(line, 2, "qid, text")
          check_id(qid, "query")
        wanted = only is None or qid in only
        if wanted:
          _check_new(seen, qid, "query id")
        if not text.strip():
          raise Invalid(EMPTY, f"query {qid!r} has empty text")
        if not wanted:
          continue
      except Invalid as e:
        f.bad(lineno, e)
        continue
      seen[qid] = lineno
      yield qid, text


def read_queries(path: PathLike, *, skip_invalid: bool = False, only: Container[str] | None = None) -> Queries:
  """Reads BEIR queries.jsonl or an MS MARCO queries TSV -> {query id: text} (with `only`, just those ids)."""
  return dict(iter_queries(path, skip_invalid=skip_invalid, only=only))


# ---------------------------------------------------------------------------------------------------------------
# Qrels
# ---------------------------------------------------------------------------------------------------------------


def read_qrels(path: PathLike, *, doc_ids: Container[str] | None = None, query_ids: Container[str] | None = None,
               skip_invalid: bool = False) -> Qrels:
  """Reads BEIR qrels TSV (with header) or TREC `qid 0 docid rel` -> {query id: {doc id: relevance}}.

  The format is detected from the first line: the BEIR header (or three tab-separated columns) means BEIR,
  four whitespace-separated columns mean TREC; every later line must match it. Relevance must be an integer.
  With `doc_ids` / `query_ids` (e.g. the corpus and queries dicts), a judgment naming an id outside them is an
  error too: such a judgment can never be retrieved or asked, and would silently skew recall.

  A `doc_ids` with a `contains(ids) -> bool array` method (a `jdr.data.prepared.PreparedCorpus`) is asked in
  blocks of lines rather than once a line: one lookup there costs microseconds, and MS MARCO's training qrels
  are half a million lines. The result and the errors are the same, line for line.
  """
  path = paths.as_path(path)
  qrels: Qrels = {}
  seen: dict[tuple[str, str], int] = {}
  trec = None  # decided on the first line
  contains = getattr(doc_ids, "contains", None) if doc_ids is not None else None
  pending: list[tuple[int, str, str, int]] = []  # (line, qid, doc id, relevance) whose doc id is still to check

  def settle(f: _File) -> None:
    """Checks the pending lines' doc ids, in line order, as if each had been checked on its own line."""
    known = contains([doc_id for _, _, doc_id, _ in pending]) if pending else ()
    for (lineno, qid, doc_id, rel), ok in zip(pending, known):
      if ok:
        qrels.setdefault(qid, {})[doc_id] = rel
      else:
        del seen[(qid, doc_id)]  # a rejected line is no pair a later line could repeat
        f.bad(lineno, Invalid(UNKNOWN, f"doc id {doc_id!r} is not in the corpus"))
    pending.clear()

  with reading(path, skip_invalid) as f:
    for lineno, line in f.lines():
      try:
        if trec is None:
          if tuple(line.split("\t")) == _BEIR_QRELS_HEADER:
            trec = False
            continue
          trec = len(line.split()) == 4 and len(line.split("\t")) != 3
        if trec:
          fields = line.split()
          if len(fields) != 4:
            raise Invalid(MALFORMED, f"expected 4 columns (TREC qrels: qid 0 docid rel), got {len(fields)}")
          qid, _, doc_id, rel = fields
        else:
          qid, doc_id, rel = _tsv_fields(line, 3, "BEIR qrels: query-id, corpus-id, score")
          check_id(qid, "query")
          check_id(doc_id, "doc")
        try:
          rel = int(rel)
        except ValueError:
          raise Invalid(MALFORMED, f"relevance {rel!r} is not an integer") from None
        if pending and seen.get((qid, doc_id), 0) >= pending[0][0]:
          settle(f)  # a repeat of a pending pair: a duplicate only if that pair's doc id is known
        _check_new(seen, (qid, doc_id), "qrels pair")
        if query_ids is not None and qid not in query_ids:
          raise Invalid(UNKNOWN, f"query id {qid!r} is not among the queries")
        if contains is None and doc_ids is not None and doc_id not in doc_ids:
          raise Invalid(UNKNOWN, f"doc id {doc_id!r} is not in the corpus")
      except Invalid as e:
        settle(f)  # earlier lines' errors come first
        f.bad(lineno, e)
        continue
      seen[(qid, doc_id)] = lineno
      if contains is None:
        qrels.setdefault(qid, {})[doc_id] = rel
        continue
      pending.append((lineno, qid, doc_id, rel))
      if len(pending) >= QRELS_BLOCK:
        settle(f)
    settle(f)
  return qrels


QRELS_BLOCK = 1 << 16  # lines whose doc ids read_qrels checks at once against a corpus that looks up in bulk


def write_qrels(path: PathLike, qrels: Mapping[str, Mapping[str, int]], *, trec: bool = False) -> None:
  """Writes BEIR qrels (header + `qid\\tdocid\\trel`), or TREC `qid 0 docid rel` lines when `trec`."""
  lines = [] if trec else ["\t".join(_BEIR_QRELS_HEADER)]
  for qid, docs in qrels.items():
    for doc_id, rel in docs.items():
      _check_writable_id(qid), _check_writable_id(doc_id)
      lines.append(f"{qid} 0 {doc_id} {int(rel)}" if trec else f"{qid}\t{doc_id}\t{int(rel)}")
  _write_lines(path, lines)


# ---------------------------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------------------------


def ranked(scores: Mapping[str, float]) -> list[tuple[str, float]]:
  """One query's (doc id, score) pairs in rank order: score descending, ties by doc id descending.

  That is trec_eval's order (it ignores the rank column and re-sorts this way), so a run written here and a
  metric computed by trec_eval / pytrec_eval agree on every tie.
  """
  return sorted(scores.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)


def read_run(path: PathLike, *, skip_invalid: bool = False) -> Run:
  """Reads a TREC run (`qid Q0 docid rank score tag`) -> {query id: {doc id: score}}.

  Queries keep file order; each query's docs are in rank order as `ranked` defines it (trec_eval's), not the
  file's rank column, so iterating a query's dict walks its ranking.
  """
  path = paths.as_path(path)
  run: Run = {}
  seen: dict[tuple[str, str], int] = {}
  with reading(path, skip_invalid) as f:
    for lineno, line in f.lines():
      try:
        fields = line.split()
        if len(fields) != 6:
          raise Invalid(MALFORMED, f"expected 6 columns (TREC run: qid Q0 docid rank score tag), got {len(fields)}")
        qid, _, doc_id, rank, score, _ = fields
        try:
          int(rank)
        except ValueError:
          raise Invalid(MALFORMED, f"rank {rank!r} is not an integer") from None
        try:
          score = float(score)
        except ValueError:
          raise Invalid(MALFORMED, f"score {score!r} is not a number") from None
        if not math.isfinite(score):
          raise Invalid(MALFORMED, f"score {score!r} is not finite")
        _check_new(seen, (qid, doc_id), "run pair")
      except Invalid as e:
        f.bad(lineno, e)
        continue
      seen[(qid, doc_id)] = lineno
      run.setdefault(qid, {})[doc_id] = score
  return {qid: dict(ranked(docs)) for qid, docs in run.items()}


def write_run(path: PathLike, run: Mapping[str, Mapping[str, float]], tag: str = "jdr") -> None:
  """Writes a TREC run: per query (in the mapping's order) docs sorted by `ranked`, ranks from 1.

  Scores are written with `repr` so reading the file back gives the same floats and the same tie order.
  """
  if not tag or any(c.isspace() for c in tag):
    raise ValueError(f"run tag must be non-empty without whitespace, got {tag!r}")
  lines = []
  for qid, docs in run.items():
    _check_writable_id(qid)
    for rank, (doc_id, score) in enumerate(ranked({d: float(s) for d, s in docs.items()}), 1):
      _check_writable_id(doc_id)
      lines.append(f"{qid} Q0 {doc_id} {rank} {score!r} {tag}")
  _write_lines(path, lines)


# ---------------------------------------------------------------------------------------------------------------
# Writers and BEIR directories
# ---------------------------------------------------------------------------------------------------------------


def _check_writable_id(value: str) -> None:
  if not value or any(c.isspace() for c in value):
    raise ValueError(f"id {value!r} cannot be written to a TSV/TREC file (empty or contains whitespace)")


def _check_tsv_text(value: str, what: str) -> None:
  if "\t" in value or "\n" in value or "\r" in value:
    raise ValueError(f"{what} contains a tab or newline, which a TSV file cannot hold; write JSONL instead")


def _write_lines(path: PathLike, lines: list[str]) -> None:
  """Writes through a temporary file and a rename, so readers never see half a file and reruns are idempotent."""
  atomic.write_atomic(path, lambda f: f.writelines(line.encode("utf-8") + b"\n" for line in lines))


def write_corpus(path: PathLike, corpus: Mapping[str, Doc]) -> None:
  """Writes BEIR corpus.jsonl, or an MS MARCO collection TSV when the name ends in .tsv (no titles allowed)."""
  path = paths.as_path(path)
  if path.suffix == ".tsv":
    for doc in corpus.values():
      if doc.title:
        raise ValueError(f"doc {doc.id!r} has a title, which an MS MARCO TSV cannot hold; write JSONL instead")
      _check_writable_id(doc.id), _check_tsv_text(doc.text, f"doc {doc.id!r}")
    _write_lines(path, [f"{doc.id}\t{doc.text}" for doc in corpus.values()])
  else:
    _write_lines(path, [json.dumps({"_id": d.id, "title": d.title, "text": d.text}, ensure_ascii=False)
                        for d in corpus.values()])


def write_queries(path: PathLike, queries: Mapping[str, str]) -> None:
  """Writes BEIR queries.jsonl, or an MS MARCO queries TSV when the name ends in .tsv."""
  path = paths.as_path(path)
  if path.suffix == ".tsv":
    for qid, text in queries.items():
      _check_writable_id(qid), _check_tsv_text(text, f"query {qid!r}")
    _write_lines(path, [f"{qid}\t{text}" for qid, text in queries.items()])
  else:
    _write_lines(path, [json.dumps({"_id": qid, "text": text}, ensure_ascii=False) for qid, text in queries.items()])


def write_beir(directory: PathLike, corpus: Mapping[str, Doc], queries: Mapping[str, str],
               qrels: Mapping[str, Mapping[str, int]] | None = None, split: str = "test") -> None:
  """Writes the BEIR layout: corpus.jsonl, queries.jsonl and (with qrels) qrels/<split>.tsv."""
  directory = paths.as_path(directory)
  write_corpus(directory / "corpus.jsonl", corpus)
  write_queries(directory / "queries.jsonl", queries)
  if qrels is not None:
    write_qrels(directory / "qrels" / f"{split}.tsv", qrels)


def load_beir(directory: PathLike, split: str | None = None, *, skip_invalid: bool = False,
              corpus: Mapping[str, Doc] | None = None) -> tuple[Corpus, Queries, Qrels | None]:
  """Loads a BEIR directory -> (corpus, queries, qrels or None); `corpus`, when given, is its corpus.jsonl
  already read (jdr.data.corpus_by_host's, on several hosts).

  With a split, qrels/<split>.tsv is checked against the corpus and queries (unknown ids are errors), and the
  queries are narrowed to those the split judges, as BEIR's GenericDataLoader does: SciFact's queries.jsonl
  holds train and test queries together, and evaluating the unjudged ones would score them as zero.
  """
  directory = paths.as_path(directory)
  if not directory.is_dir():
    raise FileNotFoundError(f"BEIR directory not found: {directory}")
  if corpus is None:
    corpus = read_corpus(directory / "corpus.jsonl", skip_invalid=skip_invalid)
  queries = read_queries(directory / "queries.jsonl", skip_invalid=skip_invalid)
  if split is None:
    return corpus, queries, None
  qrels_path = directory / "qrels" / f"{split}.tsv"
  if not qrels_path.exists():
    splits = sorted(p.stem for p in (directory / "qrels").glob("*.tsv"))
    raise FileNotFoundError(f"no split {split!r} in {directory}: {qrels_path} is missing (splits: {splits})")
  _some_queries(queries, directory / "queries.jsonl")
  qrels = read_qrels(qrels_path, doc_ids=corpus, query_ids=queries, skip_invalid=skip_invalid)
  return corpus, {qid: text for qid, text in queries.items() if qid in qrels}, qrels


def _some_queries(queries: Queries, path) -> None:
  """An empty queries file is its own error, not the qrels' first id "not among the queries"."""
  if not queries:
    raise DataFormatError(path, None, "holds no queries (an empty file?), so its qrels judge none")


def load_queries(path: str, split: str | None, *, skip_invalid: bool = False) -> dict[str, str]:
  """Queries from a BEIR directory (optionally only those judged in qrels/SPLIT.tsv) or a file."""
  path_ = paths.as_path(path)
  if path_.is_dir():
    queries = read_queries(path_ / "queries.jsonl", skip_invalid=skip_invalid)
    if split is None:
      return queries
    qrels_path = path_ / "qrels" / f"{split}.tsv"
    if not qrels_path.exists():
      raise FileNotFoundError(f"--split {split}: {qrels_path} is missing")
    _some_queries(queries, path_ / "queries.jsonl")
    qrels = read_qrels(qrels_path, query_ids=queries, skip_invalid=skip_invalid)
    return {q: queries[q] for q in qrels}
  if split is not None:
    raise ValueError(f"--split needs a BEIR directory, but {path} is a file")
  return read_queries(path_, skip_invalid=skip_invalid)
