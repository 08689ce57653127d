"""MS MARCO's training triples as arrays: `triples.train.small.tsv` mapped once to (query, positive, negative).

The file (~39.8M lines, ~27 GB) holds texts, `query\\tpositive passage\\tnegative passage` a line, not ids. It
is streamed once and every line turned into three int32s:

  query     the index of its query in `qids` (the loaded queries, matched by their exact text)
  positive  the corpus row of its positive passage
  negative  the corpus row of its negative passage

Passages are found by their text's 64-bit hash: every corpus text is hashed once into a sorted array searched
with np.searchsorted a chunk of lines at a time, so memory is a few arrays of the corpus's length, never a dict
of 8.8M texts. A hit is confirmed against the corpus: the text's length always, the whole text the first time a
row is hit (once per distinct passage, read from the corpus). Where rows share a hash, each is compared; MS
MARCO has passages with one text under several pids, and of those a positive takes one its query's qrels judge
relevant, a negative the first (counted). A query text several queries share goes to the one whose qrels judge
the positive.

A malformed line, or one whose query or passage is not found, is a `formats.DataFormatError` ("FILE:LINE:
reason"); with `skip_invalid` such lines are counted per reason and the counts printed, never dropped silently.

The result is kept in a folder named by the file's fingerprint, the corpus, the queries and the positive qrels
(another eval split or train fraction is another folder): under the prepared corpus's folder (`triples/`)
when there is one, else `cache_dir`. Lines are mapped in chunks of CHUNK_LINES, each chunk's arrays written
whole to `partial/`, and a killed pass resumes after the last chunk; a lock keeps two processes from mapping
one folder at once.

  FOLDER/manifest.json                  written last: counts, skipped lines per reason
         qids.txt                       the query ids `query` indexes, one a line
         query.npy positive.npy negative.npy   int32 [T], in file order
         pool_offsets.npy pool_rows.npy each query's distinct negative rows, sorted: query i's are
                                        pool_rows[pool_offsets[i]:pool_offsets[i + 1]]
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import sys
from collections.abc import Mapping

import numpy as np
import tqdm

from jdr.runtime import atomic
from jdr.runtime import paths
from jdr.data import formats
from jdr.data import prepared

FORMAT = 1
CHUNK_LINES = 1 << 16  # lines mapped together (their texts are held until then) and written as one chunk
MANIFEST, PARTIAL, LOCK = "manifest.json", "partial", ".lock"
UNKNOWN_QUERY = "unknown query"
UNKNOWN_PASSAGE = "unknown passage"
AMBIGUOUS_QUERY = "ambiguous query"
_SHOWN = 60  # characters of a text an error shows


@dataclasses.dataclass
class Triples:
  """A mapped triples file: arrays memory-mapped from its folder."""
  folder: pathlib.Path
  qids: list[str]
  query: np.ndarray
  positive: np.ndarray
  negative: np.ndarray
  pool_offsets: np.ndarray
  pool_rows: np.ndarray
  manifest: dict

  def __len__(self) -> int:
    return len(self.query)

  def pool(self, index: int) -> np.ndarray:
    """The distinct negative rows of query `qids[index]`'s triples."""
    return self.pool_rows[int(self.pool_offsets[index]):int(self.pool_offsets[index + 1])]


def load(path: formats.PathLike, queries: Mapping[str, str], qrels: Mapping[str, Mapping[str, int]],
         corpus: Mapping, *, cache_dir: formats.PathLike | None = None, skip_invalid: bool = False,
         progress: bool = True) -> Triples:
  """The triples of `path` over `corpus` (a prepared corpus or a {doc id: Doc} mapping, rows in its order) and
  `queries` ({query id: text}; `qrels` settles texts several queries or passages share), mapped now unless an
  earlier run did."""
  path = pathlib.Path(os.fspath(path))
  if not path.is_file():
    raise FileNotFoundError(f"{path}: triples file not found")
  if path.suffix == ".gz":
    raise ValueError(f"{path}: a gzip file cannot be resumed by byte offset; decompress it first")
  qids = sorted(queries)
  texts = CorpusTexts(corpus)
  key = _key(path, texts, queries, qids, qrels, skip_invalid)
  folder = _root(corpus, cache_dir) / f"{_name(path)}-{key[:20]}"
  if not (folder / MANIFEST).exists():
    with atomic.exclusive(folder / LOCK, waiting=f"jdr: waiting for another process mapping {path} into {folder}"):
      if not (folder / MANIFEST).exists():
        Mapper(path, folder, qids, queries, qrels, texts, skip_invalid, progress).run()
  return read(folder)


def read(folder: formats.PathLike) -> Triples:
  folder = pathlib.Path(os.fspath(folder))
  manifest = json.loads((folder / MANIFEST).read_text())
  if manifest.get("format") != FORMAT:
    raise ValueError(f"{folder}: triples mapped by another jdr (format {manifest.get('format')}); delete it")
  load_ = lambda name: np.load(folder / name, mmap_mode="r").view(np.ndarray)
  qids = (folder / "qids.txt").read_text(encoding="utf-8").split("\n")[:-1]
  return Triples(folder, qids, load_("query.npy"), load_("positive.npy"), load_("negative.npy"),
                 load_("pool_offsets.npy"), load_("pool_rows.npy"), manifest)


# ---------------------------------------------------------------------------------------------------------------
# Where and under which name
# ---------------------------------------------------------------------------------------------------------------


def _root(corpus: Mapping, cache_dir: formats.PathLike | None) -> pathlib.Path:
  """Beside the prepared corpus when it can be written there: one mapping for every run over that corpus."""
  if isinstance(corpus, prepared.PreparedCorpus) and os.access(corpus.folder, os.W_OK):
    return corpus.folder / "triples"
  if cache_dir and paths.is_local(cache_dir):  # arrays are memory-mapped: a workdir on gs:// cannot hold them
    return pathlib.Path(os.fspath(cache_dir)) / "triples"
  return prepared.default_cache_dir().parent / "triples"


def _name(path: pathlib.Path) -> str:
  return "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem)[:40]


def _key(path: pathlib.Path, texts: CorpusTexts, queries: Mapping[str, str], qids: list[str],
         qrels: Mapping[str, Mapping[str, int]], skip_invalid: bool) -> str:
  digest = hashlib.sha1(json.dumps([FORMAT, prepared.fingerprint(path), texts.identity(), skip_invalid]).encode())
  for qid in qids:
    digest.update(f"{qid}\t{queries[qid]}\n".encode("utf-8", "surrogatepass"))
  for qid in sorted(qrels):
    digest.update(("\0" + qid + "\t" + "\t".join(sorted(d for d, r in qrels[qid].items() if r > 0))).encode())
  return digest.hexdigest()


class CorpusTexts:
  """The passage texts of a corpus by row: a prepared corpus reads them from its file, a mapping by its ids."""

  def __init__(self, corpus: Mapping):
    self.corpus = corpus
    self.prepared = isinstance(corpus, prepared.PreparedCorpus)
    self.ids = None if self.prepared else list(corpus)
    self._row = None
    if len(corpus) >= 2 ** 31:
      raise ValueError(f"a corpus of {len(corpus)} documents does not fit int32 rows")

  def __len__(self) -> int:
    return len(self.corpus)

  def identity(self) -> str:
    if self.prepared:
      return self.corpus.manifest["key"]
    digest = hashlib.sha1()
    for doc_id in self.ids:
      digest.update(f"{doc_id}\t{self.corpus[doc_id].text}\n".encode("utf-8", "surrogatepass"))
    return digest.hexdigest()

  def chunks(self, size: int = prepared.INDEX_CHUNK):
    for lo in range(0, len(self), size):
      yield self.texts(range(lo, min(len(self), lo + size)))

  def texts(self, rows) -> list[str]:
    if self.prepared:
      return [doc.text for doc in self.corpus.docs(rows)]
    return [self.corpus[self.ids[r]].text for r in rows]

  def rows_of(self, doc_ids: list[str]) -> np.ndarray:
    if self.prepared:
      return self.corpus.row_of(doc_ids, missing=-1)
    if self._row is None:
      self._row = {d: i for i, d in enumerate(self.ids)}
    return np.array([self._row.get(d, -1) for d in doc_ids], np.int64)


class PassageRows:
  """Passage texts to corpus rows, by their 64-bit hashes: every corpus text hashed once into a sorted array,
  searched a chunk of texts at a time. A hit is confirmed against the corpus: the length always, the whole text
  the first time a row is hit; rows sharing a hash are compared one by one."""

  def __init__(self, texts: CorpusTexts, *, progress: bool = True, desc: str = "hash the corpus"):
    self.texts = texts
    n = len(texts)
    hashes, lengths = np.empty(n, np.int64), np.empty(n, np.int32)
    bar = tqdm.tqdm(total=n, unit="passage", mininterval=1.0, disable=not progress, desc=desc)
    at = 0
    for chunk in texts.chunks():
      # Python's str hash (64 bits, salted per process): the table lives only as long as this pass.
      hashes[at:at + len(chunk)] = np.fromiter(map(hash, chunk), np.int64, len(chunk))
      lengths[at:at + len(chunk)] = np.fromiter(map(len, chunk), np.int32, len(chunk))
      at += len(chunk)
      bar.update(len(chunk))
    bar.close()
    order = np.argsort(hashes, kind="stable")  # rows of equal hashes stay in row order: the first comes first
    self.hashes, self.rows, self.lengths = hashes[order], order.astype(np.int32), lengths
    self.verified = np.zeros(n, bool)

  def lookup(self, texts: list[str]) -> tuple[np.ndarray, dict[int, list[int]]]:
    """Each text's corpus row: int64 [n], -1 where no row holds exactly it and -2 where several do, their rows
    then in the dict by position."""
    wanted = np.fromiter(map(hash, texts), np.int64, len(texts))
    lengths = np.fromiter(map(len, texts), np.int32, len(texts))
    lo = np.searchsorted(self.hashes, wanted, "left")
    hi = np.searchsorted(self.hashes, wanted, "right")
    if not len(self.rows):
      return np.full(len(texts), -1, np.int64), {}
    row = self.rows[np.minimum(lo, len(self.rows) - 1)].astype(np.int64)
    single = (hi - lo == 1) & (self.lengths[row] == lengths)
    out = np.where(single, row, -1)
    # The first hit of a row is compared whole, once per distinct row of the chunk.
    check = np.nonzero(single & ~self.verified[row])[0]
    if len(check):
      distinct = np.unique(row[check])
      corpus_text = dict(zip(distinct.tolist(), self.texts.texts(distinct)))
      for i in check.tolist():
        if corpus_text[int(row[i])] != texts[i]:
          out[i] = -1  # another text under the same hash and length: not in the corpus
        else:
          self.verified[row[i]] = True
    several = {}
    for i in np.nonzero(hi - lo > 1)[0].tolist():  # rows sharing the hash: compared one by one
      rows = self.rows[lo[i]:hi[i]]
      same = [int(r) for r, t in zip(rows.tolist(), self.texts.texts(rows)) if t == texts[i]]
      out[i] = same[0] if len(same) == 1 else (-2 if same else -1)
      if len(same) > 1:
        several[i] = same
    return out, several


# ---------------------------------------------------------------------------------------------------------------
# The mapping pass
# ---------------------------------------------------------------------------------------------------------------


def shown(text: str) -> str:
  return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


class Mapper:
  """Streams the file once: lines are parsed here, their passages looked up a chunk at a time."""

  def __init__(self, path, folder, qids, queries, qrels, texts: CorpusTexts, skip_invalid, progress):
    self.path, self.folder, self.qids, self.qrels = path, folder, qids, qrels
    self.texts, self.skip_invalid, self.progress = texts, skip_invalid, progress
    self.partial = folder / PARTIAL
    self.query_of: dict[str, int] = {}  # query text -> index in qids; texts several queries share -> -1
    self.shared: dict[str, list[int]] = {}
    for i, qid in enumerate(qids):
      text = queries[qid]
      if text in self.shared:
        self.shared[text].append(i)
      elif text in self.query_of:
        self.shared[text] = [self.query_of[text], i]
        self.query_of[text] = -1
      else:
        self.query_of[text] = i
    self.counts: collections.Counter = collections.Counter()  # skipped lines per reason
    self.first: dict[str, int] = {}
    self.same_text = 0  # passages whose text several rows share (the first or a judged one taken)
    self._positives: dict[int, np.ndarray] = {}

  def _query_positives(self, q: int) -> np.ndarray:
    if q not in self._positives:
      judged = [d for d, r in self.qrels.get(self.qids[q], {}).items() if r > 0]
      self._positives[q] = self.texts.rows_of(judged)
    return self._positives[q]

  def _settle(self, lines: list[tuple[int, int, str, str, str]]) -> tuple[np.ndarray, ...]:
    """(query, positive, negative) int32 arrays of a chunk's parsed lines, the lines that fail counted or
    raised (the earliest first)."""
    query = np.fromiter((q for _, q, _, _, _ in lines), np.int64, len(lines))
    positive, several_positive = self.passages.lookup([p for _, _, _, p, _ in lines])
    negative, several_negative = self.passages.lookup([n for _, _, _, _, n in lines])
    keep = (positive != -1) & (negative != -1)
    problems = []
    for i in np.nonzero(~keep)[0].tolist():
      which, text = ("positive", lines[i][3]) if positive[i] == -1 else ("negative", lines[i][4])
      problems.append((lines[i][0], UNKNOWN_PASSAGE, f"the {which} passage {shown(text)} is not in the corpus"))
    # Texts of several queries or several rows: settled one by one (the qrels decide).
    for i in np.nonzero(keep & ((query < 0) | (positive < 0) | (negative < 0)))[0].tolist():
      lineno, q, text, _, _ = lines[i]
      if q < 0 or positive[i] < 0:
        q, positive[i] = self._settle_shared(q, text, several_positive.get(i, [int(positive[i])]))
        if q < 0:
          keep[i] = False
          problems.append((lineno, AMBIGUOUS_QUERY, f"the query text {shown(text)} is the text of queries "
                           f"{', '.join(repr(self.qids[c]) for c in self.shared[text][:3])}, none of whose qrels "
                           "judge its positive relevant"))
          continue
        query[i] = q
      if negative[i] < 0:
        self.same_text += 1
        negative[i] = several_negative[i][0]
    for lineno, kind, detail in sorted(problems):
      self._bad(lineno, kind, detail)
    return query[keep].astype(np.int32), positive[keep].astype(np.int32), negative[keep].astype(np.int32)

  def _settle_shared(self, q: int, query: str, rows: list[int]) -> tuple[int, int]:
    """(query, positive row) where the query's text is several queries' (q < 0) or the positive's text several
    rows': the first query whose qrels judge one of the rows, and that row. (-1, _) when the text is several
    queries' and none judges it."""
    candidates = [q] if q >= 0 else self.shared[query]
    judging = [(c, r) for c in candidates for r in rows if r in set(self._query_positives(c).tolist())]
    if len(rows) > 1:
      self.same_text += 1
    if judging:
      return judging[0]
    return (candidates[0] if len(candidates) == 1 else -1), rows[0]

  def _bad(self, lineno: int, kind: str, detail: str) -> None:
    if not self.skip_invalid:
      raise formats.DataFormatError(self.path, lineno, f"{kind}: {detail}")
    self.counts[kind] += 1
    self.first.setdefault(kind, lineno)

  # ---------------------------------------------------------------------------------- the pass

  def _resume(self) -> tuple[int, int, int]:
    """(chunks done, byte offset, line number) to go on from."""
    done = 0
    while (self.partial / f"chunk-{done:05d}.npz").exists():
      done += 1
    if not done:
      return 0, 0, 1
    with np.load(self.partial / f"chunk-{done - 1:05d}.npz") as last:
      end = last["end"].tolist()
      state = json.loads(str(last["state"]))
    self.counts.update(state["counts"])
    self.first.update(state["first"])
    self.same_text = state["same_text"]
    print(f"jdr: resuming the mapping of {self.path} at line {end[1]}", file=sys.stderr)
    return done, end[0], end[1]

  def run(self) -> None:
    self.partial.mkdir(parents=True, exist_ok=True)
    self.passages = PassageRows(self.texts, progress=self.progress, desc=f"triples {self.path.name}: hash the corpus")
    done, offset, lineno = self._resume()
    size = self.path.stat().st_size
    bar = tqdm.tqdm(total=size, initial=offset, unit="B", unit_scale=True, mininterval=1.0,
                    disable=not self.progress, desc=f"triples {self.path.name}: map")
    lines: list[tuple[int, int, str, str, str]] = []
    read = 0  # lines read into this chunk, blank and bad ones included
    with open(self.path, "rb") as f:
      f.seek(offset)
      for raw in iter(f.readline, b""):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
          raw = raw[3:]
        try:
          self._parse(raw, lineno, lines)
        except _Problem as e:
          if not self.skip_invalid and lines:
            self._settle(lines)  # an earlier line's lookup error comes first
          self._bad(lineno, e.kind, e.detail)
        lineno += 1
        read += 1
        offset += len(raw)
        if read == CHUNK_LINES:
          self.write_arrays(done, self._settle(lines), (offset, lineno))
          bar.update(offset - bar.n)
          done, lines, read = done + 1, [], 0
    if read:
      self.write_arrays(done, self._settle(lines), (offset, lineno))
      done += 1
    bar.update(size - bar.n)
    bar.close()
    self._report()
    self._finish(done)

  def _parse(self, raw: bytes, lineno: int, lines: list) -> None:
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise _Problem(formats.BAD_UTF8, f"invalid byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line") from None
    line = line.rstrip("\r\n")
    if not line.strip():
      return
    fields = line.split("\t")
    if len(fields) != 3:
      raise _Problem(formats.MALFORMED, f"expected 3 tab-separated columns (query, positive passage, negative "
                                        f"passage), got {len(fields)}")
    query, positive, negative = fields
    q = self.query_of.get(query)
    if q is None:
      raise _Problem(UNKNOWN_QUERY, f"the query text {shown(query)} is not among the queries of the dataset's "
                                    "splits")
    lines.append((lineno, q, query, positive, negative))

  def write_arrays(self, k: int, arrays: tuple[np.ndarray, ...], end: tuple[int, int]) -> None:
    state = {"counts": dict(self.counts), "first": self.first, "same_text": self.same_text}
    query, positive, negative = arrays
    atomic.write_atomic(self.partial / f"chunk-{k:05d}.npz", lambda f: np.savez(
        f, query=query, positive=positive, negative=negative, end=np.asarray(end, np.int64),
        state=np.asarray(json.dumps(state))))

  def _report(self) -> None:
    if self.counts:
      total = sum(self.counts.values())
      parts = ", ".join(f"{n} {kind} (first on line {self.first[kind]})" for kind, n in sorted(self.counts.items()))
      print(f"jdr: skipped {total} invalid triple{'' if total == 1 else 's'} in {self.path}: {parts}",
            file=sys.stderr)
    if self.same_text:
      print(f"jdr: {self.same_text} passages of {self.path} have their text under several pids of the corpus: "
            "a positive took a pid its query's qrels judge, a negative the first", file=sys.stderr)

  def _finish(self, chunks: int) -> None:
    files = [self.partial / f"chunk-{k:05d}.npz" for k in range(chunks)]
    total = 0
    for chunk in files:
      with np.load(chunk) as arrays:
        total += len(arrays["query"])

    def pieces(name):
      for chunk in files:
        with np.load(chunk) as arrays:
          yield arrays[name]

    write = prepared.write_npy  # the prepared corpus's writer: piece by piece
    for name in ("query", "positive", "negative"):
      write(self.folder / f"{name}.npy", np.int32, total, pieces(name))
    query = np.load(self.folder / "query.npy", mmap_mode="r")
    negative = np.load(self.folder / "negative.npy", mmap_mode="r")
    # Each query's distinct negatives: one sort of (query, row) keys.
    keys = np.unique((query.astype(np.int64) << 32) | negative.astype(np.int64))
    offsets = np.searchsorted(keys >> 32, np.arange(len(self.qids) + 1), "left").astype(np.int64)
    write(self.folder / "pool_rows.npy", np.int32, len(keys), [keys & 0xFFFFFFFF])
    write(self.folder / "pool_offsets.npy", np.int64, len(offsets), [offsets])
    atomic.write_text(self.folder / "qids.txt", "".join(q + "\n" for q in self.qids))
    manifest = {"format": FORMAT, "source": prepared.fingerprint(self.path), "triples": total,
                "queries": len(self.qids), "queries_with_triples": int(np.count_nonzero(np.diff(offsets))),
                "corpus": self.texts.identity() if self.texts.prepared else len(self.texts),
                "skipped": dict(self.counts), "first_skipped_line": self.first, "same_text_passages": self.same_text}
    atomic.write_text(self.folder / MANIFEST, json.dumps(manifest, indent=1))
    shutil.rmtree(self.partial, ignore_errors=True)
    print(f"jdr: mapped {manifest['triples']} triples of {manifest['queries_with_triples']} queries from {self.path} "
          f"into {self.folder}", file=sys.stderr)


class _Problem(Exception):
  def __init__(self, kind: str, detail: str):
    super().__init__(kind, detail)
    self.kind, self.detail = kind, detail
