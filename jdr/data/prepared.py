"""A corpus prepared once on disk and memory-mapped: its ids, where each line lies, and its token ids.

Held as Python objects (a dict of documents, a dict of rows) a corpus costs several objects a passage and a
slow read, and tokenizing it for each evaluation far more; at MS MARCO's size (8.8M passages) both dominate a
run (docs/performance.md, `scale`). So a corpus file is read and validated once into arrays, and tokenized once per (tokenizer,
max_length); every run after that maps the arrays and holds nothing per passage:

  corpus = prepared.prepare("msmarco/corpus.jsonl")                   # validated and indexed, once
  corpus = prepared.prepare("msmarco/corpus.jsonl", tokenizer, 256)   # and tokenized, once per tokenizer+length
  rows = corpus.row_of(["7", "42"])        # ids -> rows, vectorized (KeyError naming unknown ids)
  corpus.ids(rows), corpus.texts(rows)     # texts are read from the corpus file by byte offset when asked
  ids, mask = corpus.tokens(rows, 256)     # int32 [n, 256], padded
  corpus["7"], "7" in corpus, list(corpus) # also a Mapping {doc id: formats.Doc}, in file order

Where: one folder per corpus file under the cache folder, `$JDR_CACHE/prepared`, else
`$XDG_CACHE_HOME/jdr/prepared`, else `~/.cache/jdr/prepared` (`out_dir` of `prepare` chooses another). Not the
workdir: each run has its own, and preparing again for every run is what this avoids. Not beside the dataset:
datasets are often shared and read-only. The folder's name is a digest of the corpus file's fingerprint: its
absolute path, size, modification time and the SHA-1 of its first and last MiB, the format version and
`skip_invalid`. A changed, touched or moved file is another folder (prepared again), never a stale one; folders
whose file has gone or changed are removed when another corpus is prepared beside them.

  FOLDER/manifest.json        written last: a folder without it is unfinished and never read
         source.json          the fingerprint, written first (to find stale folders)
         ids.npy              uint8: every id's UTF-8 bytes, back to back, in file order
         id_offsets.npy       int64 [N + 1]: id i is ids[id_offsets[i]:id_offsets[i + 1]]
         id_hashes.npy        uint64 [N]: the ids' FNV-1a hashes, sorted
         id_hash_rows.npy     int32 / int64 [N]: the row of each sorted hash (ties by row)
         line_offsets.npy     int64 [N]: where each document's line starts in the corpus file
         line_lengths.npy     int32 [N]: its length in bytes, line end included
         tokens/NAME-LENGTH-DIGEST/   one per (tokenizer, max_length); DIGEST covers the tokenizer's whole
                                      definition (tokenizer.json but its truncation and padding), the prompt
                                      it puts before each text (a model's document prompt), and the length
           manifest.json, tokens.npy (uint16 where the vocabulary fits, else int32: every token id back to
           back), token_offsets.npy (int64 [N + 1])

Both passes (indexing, tokenizing) write their work in chunks (`partial/`, each file written whole or not at
all) and resume from the chunks a killed run left; the final arrays and the manifest come from them. A lock
file keeps two processes from preparing one folder at once: the second waits, then reads the first's.
Tokens are exactly `jdr.data.text.tokenize`'s of `text.doc_text(doc)`, tokenized by a thread of their own
(the fast tokenizer's batch call runs outside the GIL, on every core unless TOKENIZERS_PARALLELISM=false)
while this one reads and parses the next chunk.

Validation is `formats.iter_corpus_records`'s: a bad line raises `formats.DataFormatError` (file:line: reason)
as soon as it is read. Duplicate ids are found with the hashes, a chunk at a time, and raised with both lines
as `formats.read_corpus` words them.
"""

from __future__ import annotations

import collections.abc
import concurrent.futures
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import sys
import weakref
from typing import Iterable, Iterator, Sequence

import numpy as np
import tqdm

from jdr.runtime import atomic
from jdr.runtime import paths
from jdr.runtime import timings
from jdr.data import formats
from jdr.data import text as text_lib

FORMAT = 1
MANIFEST, SOURCE, LOCK, PARTIAL = "manifest.json", "source.json", ".lock", "partial"
INDEX_CHUNK = 1 << 17  # documents a chunk of the indexing pass: a resume redoes at most this many
TOKENS_CHUNK = 1 << 15  # documents a chunk of tokenizing
_FINGERPRINT_BYTES = 1 << 20  # hashed at each end of the corpus file
_FNV_OFFSET, _FNV_PRIME, _MASK = 0xcbf29ce484222325, 0x100000001b3, (1 << 64) - 1


def default_cache_dir() -> pathlib.Path:
  """Where prepared corpora go unless told: $JDR_CACHE/prepared, else the user's cache folder (XDG)."""
  root = os.environ.get("JDR_CACHE")
  if not root:
    root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jdr")
  return pathlib.Path(root) / "prepared"


def can_prepare(corpus_file: formats.PathLike) -> bool:
  """Whether a corpus file can be prepared: lines are read back by byte offset, so a local, uncompressed file."""
  if not paths.is_local(corpus_file):
    return False
  path = pathlib.Path(os.fspath(formats.corpus_file(corpus_file)))
  return path.suffix != ".gz" and path.is_file()


def fingerprint(corpus_file: formats.PathLike) -> dict:
  """What names a corpus file's folder: absolute path, size, modification time, SHA-1 of its first and last
  MiB. Cheap at any size, and any edit but one that keeps the size, the time and both ends changes it."""
  path = pathlib.Path(os.fspath(formats.corpus_file(corpus_file))).resolve()
  stat = path.stat()
  digest = hashlib.sha1()
  with open(path, "rb") as f:
    digest.update(f.read(_FINGERPRINT_BYTES))
    if stat.st_size > _FINGERPRINT_BYTES:
      f.seek(max(_FINGERPRINT_BYTES, stat.st_size - _FINGERPRINT_BYTES))
      digest.update(f.read())
  return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "ends_sha1": digest.hexdigest()}


def tokenizer_fingerprint(tokenizer) -> str | None:
  """A digest of everything that decides `text.tokenize`'s ids, or None for a tokenizer it cannot name (not
  a Hugging Face one). A fast tokenizer's tokenizer.json is read without its truncation and padding, which the
  wrapper resets at every call. Kept per tokenizer object (a large vocabulary's JSON takes a while) until
  its vocabulary or truncation side changes. A `text.Prompted` tokenizer's digest covers its prompt too (the
  bare tokenizer's, digested with the prompt), so a prompted corpus's ids are never another's."""
  bare, prompt = text_lib.unprompted(tokenizer)
  if prompt:
    digest = tokenizer_fingerprint(bare)
    if digest is None:
      return None
    return hashlib.sha1(json.dumps([digest, "prompt", prompt]).encode()).hexdigest()
  try:
    state = (len(tokenizer), getattr(tokenizer, "truncation_side", "right"))
    known = _fingerprints.get(tokenizer)
  except TypeError:  # no len, or not weakly referenceable: not cached
    state, known = None, None
  if known is not None and known[0] == state:
    return known[1]
  digest = _fingerprint(tokenizer)
  if state is not None:
    _fingerprints[tokenizer] = (state, digest)
  return digest


_fingerprints = weakref.WeakKeyDictionary()


def _fingerprint(tokenizer) -> str | None:
  rust = getattr(tokenizer, "backend_tokenizer", None)
  if rust is not None and getattr(tokenizer, "is_fast", False):
    spec = json.loads(rust.to_str())
    spec.pop("truncation", None)
    spec.pop("padding", None)
    body = json.dumps(spec, sort_keys=True)
  elif callable(getattr(tokenizer, "get_vocab", None)):
    body = json.dumps([sorted(tokenizer.get_vocab().items()), getattr(tokenizer, "init_kwargs", {})],
                      sort_keys=True, default=str)
  else:
    return None
  extra = [type(tokenizer).__name__, getattr(tokenizer, "truncation_side", "right"), FORMAT]
  return hashlib.sha1((body + json.dumps(extra)).encode()).hexdigest()


def can_tokenize(tokenizer) -> bool:
  return tokenizer_fingerprint(tokenizer) is not None


def prepare(corpus_file: formats.PathLike, tokenizer=None, max_length: int | None = None,
            out_dir: formats.PathLike | None = None, *, skip_invalid: bool = False,
            progress: bool = True) -> PreparedCorpus:
  """The prepared corpus of a corpus file (BEIR corpus.jsonl or a BEIR directory, MS MARCO collection.tsv),
  preparing what is missing: the index always, the token ids when a tokenizer is given (`max_length` then
  too). `out_dir` is the cache folder the corpus's own folder goes in (default `default_cache_dir()`).
  Raises formats.DataFormatError for a bad line, ValueError for a file that cannot be prepared."""
  path = pathlib.Path(os.fspath(formats.corpus_file(corpus_file)))
  if not can_prepare(path):
    raise ValueError(f"{path}: only a local, uncompressed corpus file can be prepared (its lines are read back "
                     "by byte offset)")
  root = pathlib.Path(os.fspath(out_dir)) if out_dir else default_cache_dir()
  source = fingerprint(path)
  key = hashlib.sha1(json.dumps([source, skip_invalid, FORMAT], sort_keys=True).encode()).hexdigest()
  folder = root / f"{_name(path.resolve())}-{key[:20]}"
  if not (folder / MANIFEST).exists():
    with _locked(folder):
      if not (folder / MANIFEST).exists():
        _remove_stale(root, folder)
        atomic.write_text(folder / SOURCE, json.dumps(source, indent=1))
        Indexer(path, folder, source, skip_invalid, progress).run()
  corpus = PreparedCorpus(folder)
  if tokenizer is not None:
    if max_length is None:
      raise ValueError("prepare: a tokenizer needs its max_length")
    corpus = corpus.tokenized(tokenizer, max_length, progress=progress)
  return corpus


# ---------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------


def id_sequence(corpus: collections.abc.Sequence | collections.abc.Mapping) -> collections.abc.Sequence:
  """The corpus's doc ids in row order, without a list of N strings where the corpus can avoid one: a
  prepared corpus gives its memory-mapped ids (decoded when indexed), a sequence is kept as it is."""
  if hasattr(corpus, "id_sequence"):
    return corpus.id_sequence()
  if isinstance(corpus, collections.abc.Mapping):
    return list(corpus)
  return corpus


class PreparedCorpus(collections.abc.Mapping):
  """A prepared corpus, memory-mapped: rows are documents in file order. Also a Mapping {doc id: Doc} in
  that order (what RetrievalData.corpus always was), its documents read from the corpus file when asked.

  Nothing is held per document: lookups search the sorted hashes, texts are read by byte offset."""

  def __init__(self, folder: formats.PathLike, tokens_folder: formats.PathLike | None = None):
    self.folder = pathlib.Path(os.fspath(folder))
    manifest = _read_manifest(self.folder, "index")
    self.manifest = manifest
    self.source = pathlib.Path(manifest["source"]["path"])
    try:
      stat = self.source.stat()
      same = (stat.st_size, stat.st_mtime_ns) == (manifest["source"]["size"], manifest["source"]["mtime_ns"])
    except FileNotFoundError:
      same = False
    if not same:
      raise ValueError(f"{self.folder}: prepared from {self.source}, which has changed or gone since; prepare "
                       "it again (jdr.data.prepared.prepare)")
    self._jsonl = manifest["jsonl"]
    load = lambda name: _load(self.folder / name)
    self._id_blob, self._id_offsets = load("ids.npy"), load("id_offsets.npy")
    self._hashes, self._hash_rows = load("id_hashes.npy"), load("id_hash_rows.npy")
    self._line_offsets, self._line_lengths = load("line_offsets.npy"), load("line_lengths.npy")
    self._n = int(manifest["num_docs"])
    self._fd = os.open(self.source, os.O_RDONLY)  # pread: no shared file position between threads
    weakref.finalize(self, os.close, self._fd)  # unlike __del__, also runs at interpreter exit, os still there
    self.tokens_folder = self.tokens_manifest = None
    if tokens_folder is not None:
      self._attach_tokens(pathlib.Path(os.fspath(tokens_folder)))

  def _attach_tokens(self, folder: pathlib.Path) -> None:
    manifest = _read_manifest(folder, "tokens")
    if manifest["index"] != self.manifest["key"] or manifest["num_docs"] != self._n:
      raise ValueError(f"{folder}: token ids of another corpus than {self.folder}")
    self.tokens_folder, self.tokens_manifest = folder, manifest
    self.max_length, self.pad_id = int(manifest["max_length"]), int(manifest["pad_id"])
    self._tokens, self._token_offsets = _load(folder / "tokens.npy"), _load(folder / "token_offsets.npy")

  def __getstate__(self):  # memory maps and a file descriptor do not pickle; the folders do
    return {"folder": self.folder, "tokens_folder": self.tokens_folder}

  def __setstate__(self, state):
    self.__init__(state["folder"], state["tokens_folder"])

  # -------------------------------------------------------------------------------- ids

  def __len__(self) -> int:
    return self._n

  def __iter__(self) -> Iterator[str]:
    for lo in range(0, self._n, INDEX_CHUNK):
      yield from self.ids(range(lo, min(self._n, lo + INDEX_CHUNK)))

  def __contains__(self, doc_id) -> bool:
    return isinstance(doc_id, str) and self._row(doc_id) >= 0

  def __getitem__(self, doc_id: str) -> formats.Doc:
    row = self._row(doc_id) if isinstance(doc_id, str) else -1
    if row < 0:
      raise KeyError(doc_id)
    return self.docs([row])[0]

  def values(self):
    return _Docs(self)

  def items(self):
    return _Items(self)

  def ids(self, rows: Iterable[int]) -> list[str]:
    """The ids of `rows`."""
    rows = _rows(rows)
    if not len(rows):
      return []
    starts, ends = self._id_offsets[rows], self._id_offsets[rows + 1]
    if _contiguous(rows):  # one slice of the blob, cut in Python
      base = int(starts[0])
      blob = self._id_blob[base:int(ends[-1])].tobytes()
      return [blob[s - base:e - base].decode("utf-8") for s, e in zip(starts.tolist(), ends.tolist())]
    return [self._id_blob[s:e].tobytes().decode("utf-8") for s, e in zip(starts.tolist(), ends.tolist())]

  def id_sequence(self) -> Sequence[str]:
    """Every id in row order as a lazy sequence: `ids[i]` is decoded when asked (no list of N strings)."""
    return _Ids(self)

  def row_of(self, doc_ids: Iterable[str], *, missing: int | None = None) -> np.ndarray:
    """int64 rows of `doc_ids`, looked up together. An unknown id is a KeyError naming it (and how many more),
    or, with `missing`, that value in its place."""
    doc_ids = list(doc_ids)
    rows = self._lookup(doc_ids)
    unknown = np.nonzero(rows < 0)[0]
    if len(unknown):
      if missing is None:
        shown = ", ".join(repr(doc_ids[i]) for i in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise KeyError(f"doc id {shown}{more} not in the corpus {self.source}")
      rows[unknown] = missing
    return rows

  def contains(self, doc_ids: Iterable[str]) -> np.ndarray:
    """bool [n]: whether each id is in the corpus (what formats.read_qrels asks in bulk)."""
    return self._lookup(list(doc_ids)) >= 0

  def _lookup(self, doc_ids: list) -> np.ndarray:
    rows = np.full(len(doc_ids), -1, np.int64)
    if not doc_ids or not self._n:
      return rows
    blob, offsets = _encode_ids(doc_ids)
    hashes = hash_ids(blob, offsets)
    lo = np.searchsorted(self._hashes, hashes, "left")
    hi = np.searchsorted(self._hashes, hashes, "right")
    candidate = self._hash_rows[np.minimum(lo, self._n - 1)].astype(np.int64)
    hit = lo < hi
    same = hit & self._same_ids(candidate, blob, offsets)
    rows[same] = candidate[same]
    for i in np.nonzero(hit & ~same & (hi - lo > 1))[0]:  # ids sharing a hash: the others of its run
      wanted = blob[offsets[i]:offsets[i + 1]].tobytes()
      for p in range(int(lo[i]) + 1, int(hi[i])):
        if self._id_bytes(int(self._hash_rows[p])) == wanted:
          rows[i] = int(self._hash_rows[p])
          break
    return rows

  def _same_ids(self, rows: np.ndarray, blob: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Whether id i of (blob, offsets) is the id of rows[i], for all i at once."""
    lengths = np.diff(offsets)
    same = lengths == self._id_offsets[rows + 1] - self._id_offsets[rows]
    check = np.nonzero(same & (lengths > 0))[0]
    if len(check):
      n = lengths[check]
      segment = np.repeat(np.arange(len(check)), n)
      within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
      mine = self._id_blob[np.repeat(self._id_offsets[rows[check]], n) + within]
      theirs = blob[np.repeat(offsets[check], n) + within]
      same[check] = np.bincount(segment, weights=mine != theirs, minlength=len(check)) == 0
    return same

  def _row(self, doc_id: str) -> int:
    """One id's row (-1: absent) without numpy's per-call overhead on arrays: `in` and `[]` are asked often."""
    wanted = doc_id.encode("utf-8")
    h = hash_one(wanted)
    p = int(self._hashes.searchsorted(np.uint64(h)))
    while p < self._n and int(self._hashes[p]) == h:
      row = int(self._hash_rows[p])
      if self._id_bytes(row) == wanted:
        return row
      p += 1
    return -1

  def _id_bytes(self, row: int) -> bytes:
    return self._id_blob[int(self._id_offsets[row]):int(self._id_offsets[row + 1])].tobytes()

  # -------------------------------------------------------------------------------- texts

  def docs(self, rows: Iterable[int]) -> list[formats.Doc]:
    """The documents of `rows`, read from the corpus file (consecutive rows in one read)."""
    rows = _rows(rows)
    if not len(rows):
      return []
    offsets, lengths = self._line_offsets[rows].tolist(), self._line_lengths[rows].tolist()
    if _contiguous(rows):
      base = offsets[0]
      data = _pread(self._fd, offsets[-1] + lengths[-1] - base, base)
      raws = [data[o - base:o - base + n] for o, n in zip(offsets, lengths)]
    else:
      raws = [_pread(self._fd, n, o) for o, n in zip(offsets, lengths)]
    try:
      return [formats.parse_doc(raw.decode("utf-8").rstrip("\r\n"), self._jsonl) for raw in raws]
    except (UnicodeDecodeError, formats.Invalid) as e:
      raise ValueError(f"{self.source} no longer holds the lines {self.folder} was prepared from ({e}); "
                       "prepare it again") from None

  def texts(self, rows: Iterable[int]) -> list[str]:
    """What each of `rows` is encoded as (`text.doc_text`: title and text), read from the corpus file."""
    return [text_lib.doc_text(doc) for doc in self.docs(rows)]

  # -------------------------------------------------------------------------------- tokens

  def tokenized(self, tokenizer, max_length: int, *, progress: bool = True) -> PreparedCorpus:
    """This corpus with the token ids of (tokenizer, max_length), tokenizing it first if no run has."""
    key = tokenizer_fingerprint(tokenizer)
    if key is None:
      raise ValueError(f"{type(tokenizer).__name__} is not a Hugging Face tokenizer: its token ids cannot be "
                       "prepared (tokenize the texts instead)")
    if self.tokens_manifest and self.tokens_manifest["tokenizer"]["digest"] == key and self.max_length == max_length:
      return self
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in type(text_lib.unprompted(tokenizer)[0]).__name__)
    folder = self.folder / "tokens" / f"{name}-{int(max_length)}-{key[:16]}"
    if not (folder / MANIFEST).exists():
      with _locked(folder):
        if not (folder / MANIFEST).exists():
          Tokenizer(self, tokenizer, int(max_length), key, folder, progress).run()
    return PreparedCorpus(self.folder, folder)

  def _need_tokens(self) -> None:
    if self.tokens_manifest is None:
      raise ValueError(f"{self.folder}: no token ids attached; call tokenized(tokenizer, max_length) first")

  def token_lengths(self, rows: Iterable[int]) -> np.ndarray:
    self._need_tokens()
    rows = _rows(rows)
    return self._token_offsets[rows + 1] - self._token_offsets[rows]

  def token_ids(self, rows: Iterable[int]) -> list[np.ndarray]:
    """Each row's unpadded token ids (views of the map)."""
    self._need_tokens()
    rows = _rows(rows)
    return [self._tokens[s:e] for s, e in zip(self._token_offsets[rows].tolist(),
                                              self._token_offsets[rows + 1].tolist())]

  def token_rows(self, lo: int = 0, hi: int | None = None) -> TokenRows:
    """Rows [lo, hi) as a sequence of unpadded token id arrays with their `lengths`, made when read."""
    self._need_tokens()
    hi = self._n if hi is None else hi
    return TokenRows(self._tokens, self._token_offsets[lo:hi + 1])

  def tokens(self, rows: Iterable[int], max_length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, attention mask), int32 [n, max_length] (default: the prepared length), padded with the
    tokenizer's pad id: what padding `text.tokenize`'s ids gives. A row longer than max_length is an error."""
    self._need_tokens()
    rows = _rows(rows)
    length = self.max_length if max_length is None else int(max_length)
    starts = self._token_offsets[rows]
    lengths = self._token_offsets[rows + 1] - starts
    if len(rows) and int(lengths.max()) > length:
      raise ValueError(f"{self.tokens_folder}: a row has {int(lengths.max())} tokens, more than {length}")
    columns = np.arange(length)
    mask = columns[None, :] < lengths[:, None]
    where = np.where(mask, starts[:, None] + columns[None, :], 0)
    ids = np.where(mask, self._tokens[where] if len(self._tokens) else 0, self.pad_id).astype(np.int32)
    return ids, mask.astype(np.int32)


class TokenRows(collections.abc.Sequence):
  """Consecutive rows of a token table: `rows[i]` is row i's unpadded ids (a view of the map), `lengths` all
  their lengths at once (what batch planning reads)."""

  def __init__(self, tokens: np.ndarray, offsets: np.ndarray):
    self._tokens, self._offsets = tokens, offsets
    self.lengths = np.diff(offsets)

  def __len__(self) -> int:
    return len(self.lengths)

  def __getitem__(self, i):
    if isinstance(i, slice):
      lo, hi, step = i.indices(len(self))
      if step != 1:
        raise ValueError("TokenRows slices take consecutive rows")
      return TokenRows(self._tokens, self._offsets[lo:max(lo, hi) + 1])
    i = range(len(self))[i]  # negative indices, and IndexError past the end
    return self._tokens[int(self._offsets[i]):int(self._offsets[i + 1])]


class _Ids(collections.abc.Sequence):
  def __init__(self, corpus: PreparedCorpus):
    self._corpus = corpus

  def __len__(self) -> int:
    return len(self._corpus)

  def __getitem__(self, i):
    if isinstance(i, slice):
      return self._corpus.ids(range(len(self))[i])
    return self._corpus.ids([range(len(self))[i]])[0]

  def __iter__(self) -> Iterator[str]:
    return iter(self._corpus)


class _Docs(collections.abc.ValuesView):
  def __iter__(self) -> Iterator[formats.Doc]:
    corpus = self._mapping
    for lo in range(0, len(corpus), TOKENS_CHUNK):  # one read a chunk, not one a document
      yield from corpus.docs(range(lo, min(len(corpus), lo + TOKENS_CHUNK)))


class _Items(collections.abc.ItemsView):
  def __iter__(self) -> Iterator[tuple[str, formats.Doc]]:
    for doc in _Docs(self._mapping):
      yield doc.id, doc


def _rows(rows) -> np.ndarray:
  if isinstance(rows, range):
    return np.arange(rows.start, rows.stop, rows.step, dtype=np.int64)
  return np.asarray(rows, dtype=np.int64).reshape(-1)


def _contiguous(rows: np.ndarray) -> bool:
  return len(rows) > 1 and int(rows[-1]) - int(rows[0]) == len(rows) - 1 and bool(np.all(np.diff(rows) == 1))


def _pread(fd: int, size: int, offset: int) -> bytes:
  parts = []
  while size > 0:
    part = os.pread(fd, size, offset)
    if not part:
      break
    parts.append(part)
    size, offset = size - len(part), offset + len(part)
  return b"".join(parts)


def _load(path: pathlib.Path) -> np.ndarray:
  # A plain ndarray over the map: np.memmap's subclass hooks cost microseconds on every small lookup.
  return np.load(path, mmap_mode="r").view(np.ndarray)


def _read_manifest(folder: pathlib.Path, kind: str) -> dict:
  path = folder / MANIFEST
  if not path.exists():
    raise FileNotFoundError(f"{folder}: no {MANIFEST}; not a finished prepared corpus (prepare it)")
  manifest = json.loads(path.read_text())
  if manifest.get("format") != FORMAT or manifest.get("kind") != kind:
    raise ValueError(f"{path}: a prepared {manifest.get('kind')} of format {manifest.get('format')}; this jdr "
                     f"reads a {kind} of format {FORMAT} (prepare it again)")
  return manifest


# ---------------------------------------------------------------------------------------------------------------
# Ids as arrays
# ---------------------------------------------------------------------------------------------------------------


def _encode_ids(doc_ids: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
  """(uint8 blob, int64 offsets [n + 1]) of the ids' UTF-8 bytes."""
  encoded = [d.encode("utf-8") for d in doc_ids]
  offsets = np.zeros(len(encoded) + 1, np.int64)
  np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=offsets[1:])
  return np.frombuffer(b"".join(encoded), np.uint8), offsets


def hash_ids(blob: np.ndarray, offsets: np.ndarray) -> np.ndarray:
  """64-bit FNV-1a of each id, vectorized over ids: one pass per byte position, over the ids that long."""
  lengths = np.diff(offsets)
  out = np.full(len(lengths), _FNV_OFFSET, np.uint64)
  if not len(lengths):
    return out
  order = np.argsort(-lengths, kind="stable")  # longest first: the ids still going are a prefix
  by_length, starts, h = lengths[order], offsets[:-1][order], out[order]
  prime = np.uint64(_FNV_PRIME)
  for j in range(int(by_length[0])):
    k = int(np.searchsorted(-by_length, -j, "left"))  # ids longer than j
    h[:k] = (h[:k] ^ blob[starts[:k] + j].astype(np.uint64)) * prime  # wraps mod 2**64, as FNV does
  out[order] = h
  return out


def hash_one(data: bytes) -> int:
  h = _FNV_OFFSET
  for byte in data:
    h = ((h ^ byte) * _FNV_PRIME) & _MASK
  return h


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------


def _name(path: pathlib.Path) -> str:
  """A readable folder name part: the corpus file's folder and stem (msmarco-corpus)."""
  raw = f"{path.parent.name}-{path.stem}" if path.parent.name else path.stem
  return "".join(c if c.isalnum() or c in "-_." else "_" for c in raw)[:60]


def _locked(folder: pathlib.Path):
  """Holds folder/.lock: one process prepares a folder, another waits for it, then finds it finished."""
  return atomic.exclusive(folder / LOCK, waiting=f"jdr: waiting for another process preparing {folder}")


def _remove_stale(root: pathlib.Path, keep: pathlib.Path) -> None:
  """Removes prepared folders whose corpus file has gone or changed: their offsets read nothing valid."""
  if not root.is_dir():
    return
  for folder in root.iterdir():
    source = folder / SOURCE
    if folder == keep or not source.is_file():
      continue
    try:
      recorded = json.loads(source.read_text())
      if "ends_sha1" not in recorded:
        continue  # not one of ours
      stat = os.stat(recorded["path"])
      if (stat.st_size, stat.st_mtime_ns) == (recorded["size"], recorded["mtime_ns"]):
        continue
    except FileNotFoundError:
      pass
    except (OSError, ValueError, KeyError):
      continue  # not one of ours, or being written: leave it
    with open(folder / LOCK, "a+b") as f:
      try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        continue  # in use
      shutil.rmtree(folder, ignore_errors=True)
    print(f"jdr: removed {folder}: its corpus file {recorded.get('path')} has changed or gone", file=sys.stderr)


def _save_npz(path: pathlib.Path, **arrays) -> None:
  atomic.write_atomic(path, lambda f: np.savez(f, **arrays))


def write_npy(path: pathlib.Path, dtype, size: int, pieces: Iterable[np.ndarray]) -> None:
  """A 1-D .npy of `size` items written piece by piece (never whole in memory), atomically."""
  dtype = np.dtype(dtype)

  def write(f):
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                             "shape": (size,)})
    written = 0
    for piece in pieces:
      piece = np.ascontiguousarray(piece, dtype=dtype)
      f.write(piece.tobytes())
      written += len(piece)
    if written != size:
      raise RuntimeError(f"{path}: wrote {written} items, expected {size}")

  atomic.write_atomic(path, write)


def _chunk_files(partial: pathlib.Path, prefix: str) -> list[pathlib.Path]:
  """The chunks written so far, in order: the longest run numbered from 0 (each was written whole)."""
  out = []
  while (partial / f"{prefix}-{len(out):05d}.npz").exists():
    out.append(partial / f"{prefix}-{len(out):05d}.npz")
  return out


class Indexer:
  """The indexing pass: validated lines -> ids, hashes and line positions, in chunks, then the final arrays."""

  def __init__(self, path: pathlib.Path, folder: pathlib.Path, source: dict, skip_invalid: bool, progress: bool):
    self.path, self.folder, self.source, self.skip_invalid = path, folder, source, skip_invalid
    self.progress = progress
    self.partial = folder / PARTIAL
    self.chunks: list[pathlib.Path] = []
    self.starts = [0]  # the first row of each chunk, and the next one's
    self.hashes = np.zeros(0, np.uint64)  # every row so far, sorted by (hash, row)
    self.hash_rows = np.zeros(0, np.int64)
    self.skipped_duplicates, self.first_skipped = 0, None
    self._cached = (None, None)

  @timings.timed("prepare_index")
  def run(self) -> None:
    self.partial.mkdir(parents=True, exist_ok=True)
    start = self._resume()
    bar = tqdm.tqdm(total=self.source["size"], initial=start[0], unit="B", unit_scale=True, mininterval=1.0,
                    desc=f"prepare {self.path.name}: index", disable=not self.progress)
    ids, where = [], []  # this chunk's ids and (line, offset, length): at most INDEX_CHUNK of each
    records = formats.iter_corpus_records(self.path, skip_invalid=self.skip_invalid, start=start)
    while True:
      try:
        lineno, offset, length, doc = next(records)
      except StopIteration:
        break
      except formats.DataFormatError:
        self._duplicates(ids, where)  # a duplicate on an earlier line is the first error
        raise
      ids.append(doc.id)
      where.append((lineno, offset, length))
      if len(ids) == INDEX_CHUNK:
        self._flush(ids, where)
        bar.update(offset + length - bar.n)
        ids, where = [], []
    if ids:
      self._flush(ids, where)
    bar.update(self.source["size"] - bar.n)
    bar.close()
    if self.skipped_duplicates:
      print(f"jdr: skipped {self.skipped_duplicates} duplicate doc ids in {self.path} (first on line "
            f"{self.first_skipped})", file=sys.stderr)
    self._finish()

  def _resume(self) -> tuple[int, int]:
    """(byte offset, line number) to read on from, after the chunks an earlier run finished."""
    self.chunks = _chunk_files(self.partial, "index")
    if not self.chunks:
      return 0, 1
    hashes = []
    for chunk in self.chunks:
      with np.load(chunk) as arrays:
        hashes.append(arrays["hashes"])
        end = arrays["end"]
      self.starts.append(self.starts[-1] + len(hashes[-1]))
    hashes = np.concatenate(hashes)
    self.hash_rows = np.argsort(hashes, kind="stable").astype(np.int64)  # ties by row, as merging keeps them
    self.hashes = hashes[self.hash_rows]
    print(f"jdr: resuming {self.folder} after {self.starts[-1]} documents", file=sys.stderr)
    return int(end[0]), int(end[1])

  def _duplicates(self, ids: list[str], where: list[tuple[int, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(which of this chunk's documents to keep, their ids' hashes): raises (or, skipping, drops) a duplicate
    of an earlier id, the earliest first. Earlier chunks are asked through their sorted hashes; an id is read
    back from its chunk file only when its hash is shared."""
    keep = np.ones(len(ids), bool)
    earlier: dict[int, int] = {}  # position in the chunk -> line of the id's first occurrence
    if len(set(ids)) < len(ids):
      first: dict[str, int] = {}
      for i, doc_id in enumerate(ids):
        if doc_id in first:
          earlier[i] = where[first[doc_id]][0]
        else:
          first[doc_id] = i
    blob, offsets = _encode_ids(ids)
    hashes = hash_ids(blob, offsets)
    lo = np.searchsorted(self.hashes, hashes, "left")
    hi = np.searchsorted(self.hashes, hashes, "right")
    for i in np.nonzero(hi > lo)[0].tolist():
      for row in self.hash_rows[lo[i]:hi[i]].tolist():
        ids_there, lines_there = self._chunk_of(row)
        at = row - self.starts[self._chunk_index(row)]
        if ids_there[at] == ids[i]:
          earlier[i] = int(lines_there[at])
          break
    for i in sorted(earlier):
      detail = formats.already("doc id", ids[i], earlier[i])
      if not self.skip_invalid:
        raise formats.DataFormatError(self.path, where[i][0], f"{formats.DUPLICATE}: {detail}")
      keep[i] = False
      self.skipped_duplicates += 1
      self.first_skipped = self.first_skipped or where[i][0]
    return keep, hashes

  def _chunk_index(self, row: int) -> int:
    return int(np.searchsorted(self.starts, row, "right")) - 1

  def _chunk_of(self, row: int) -> tuple[list[str], np.ndarray]:
    """(ids, line numbers) of the written chunk holding `row`: read back only for a shared hash."""
    k = self._chunk_index(row)
    if self._cached[0] != k:
      with np.load(self.chunks[k]) as arrays:
        blob, offsets = arrays["ids"], arrays["id_offsets"].tolist()
        ids = [blob[s:e].tobytes().decode("utf-8") for s, e in zip(offsets[:-1], offsets[1:])]
        self._cached = (k, (ids, arrays["line_numbers"]))
    return self._cached[1]

  def _flush(self, ids: list[str], where: list[tuple[int, int, int]]) -> None:
    keep, hashes = self._duplicates(ids, where)
    hashes = hashes[keep]
    kept = [d for d, k in zip(ids, keep) if k]
    lines = np.asarray(where, np.int64).reshape(-1, 3)
    end = lines[-1, 1] + lines[-1, 2], lines[-1, 0] + 1  # where the next chunk starts reading
    lines = lines[keep]
    blob, offsets = _encode_ids(kept)
    chunk = self.partial / f"index-{len(self.chunks):05d}.npz"
    _save_npz(chunk, ids=blob, id_offsets=offsets, hashes=hashes, line_numbers=lines[:, 0],
              line_offsets=lines[:, 1], line_lengths=lines[:, 2].astype(np.int32), end=np.asarray(end, np.int64))
    self.chunks.append(chunk)
    rows = self.starts[-1] + np.arange(len(kept), dtype=np.int64)
    self.starts.append(self.starts[-1] + len(kept))
    order = np.argsort(hashes, kind="stable")
    at = np.searchsorted(self.hashes, hashes[order], "right")  # after equal hashes: earlier rows stay first
    self.hashes = np.insert(self.hashes, at, hashes[order])
    self.hash_rows = np.insert(self.hash_rows, at, rows[order])

  def _finish(self) -> None:
    n = self.starts[-1]

    def column(name, dtype=None):
      for chunk in self.chunks:
        with np.load(chunk) as arrays:
          yield arrays[name] if dtype is None else arrays[name].astype(dtype)

    id_offsets = np.zeros(n + 1, np.int64)
    at = 0
    for lengths in (np.diff(o) for o in column("id_offsets")):
      id_offsets[at + 1:at + 1 + len(lengths)] = id_offsets[at] + np.cumsum(lengths)
      at += len(lengths)
    write_npy(self.folder / "ids.npy", np.uint8, int(id_offsets[-1]), column("ids"))
    write_npy(self.folder / "id_offsets.npy", np.int64, n + 1, [id_offsets])
    write_npy(self.folder / "id_hashes.npy", np.uint64, n, [self.hashes])
    row_type = np.int32 if n < 2 ** 31 else np.int64
    write_npy(self.folder / "id_hash_rows.npy", row_type, n, [self.hash_rows])
    write_npy(self.folder / "line_offsets.npy", np.int64, n, column("line_offsets"))
    write_npy(self.folder / "line_lengths.npy", np.int32, n, column("line_lengths"))
    manifest = {"format": FORMAT, "kind": "index", "key": self.folder.name, "source": self.source,
                "skip_invalid": self.skip_invalid, "jsonl": formats.is_jsonl(formats.corpus_file(self.path)),
                "num_docs": n, "id_bytes": int(id_offsets[-1]), "hash": "fnv1a-64"}
    atomic.write_text(self.folder / MANIFEST, json.dumps(manifest, indent=1))
    shutil.rmtree(self.partial, ignore_errors=True)


class Tokenizer:
  """The tokenizing pass: a chunk's texts read and parsed here while a thread tokenizes the one before."""

  def __init__(self, corpus: PreparedCorpus, tokenizer, max_length: int, key: str, folder: pathlib.Path,
               progress: bool):
    self.corpus, self.tokenizer, self.max_length, self.key = corpus, tokenizer, max_length, key
    self.folder, self.partial, self.progress = folder, folder / PARTIAL, progress
    vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size
    self.dtype = np.dtype(np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.int32)

  @timings.timed("prepare_tokens")
  def run(self) -> None:
    n = len(self.corpus)
    bounds = [(lo, min(n, lo + TOKENS_CHUNK)) for lo in range(0, n, TOKENS_CHUNK)]
    plan = json.dumps({"chunk": TOKENS_CHUNK, "num_docs": n})
    if (self.partial / "plan.json").exists() and (self.partial / "plan.json").read_text() != plan:
      shutil.rmtree(self.partial)  # chunks cut another way (an older jdr): not this run's rows
    self.partial.mkdir(parents=True, exist_ok=True)
    atomic.write_text(self.partial / "plan.json", plan)
    done = len(_chunk_files(self.partial, "tokens"))
    if done:
      print(f"jdr: resuming {self.folder} after {bounds[done - 1][1]} documents", file=sys.stderr)
    bar = tqdm.tqdm(total=n, initial=bounds[done - 1][1] if done else 0, unit="doc", mininterval=1.0,
                    desc=f"prepare {self.corpus.source.name}: tokens ({self.max_length})",
                    disable=not self.progress)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jdr-prepare") as pool:
      running = None
      for k in range(done, len(bounds)):
        texts = self.corpus.texts(range(*bounds[k]))
        if running is not None:
          bar.update(running.result())
        running = pool.submit(self._chunk, k, texts)
      if running is not None:
        bar.update(running.result())
    bar.close()
    self._finish(len(bounds))

  def _chunk(self, k: int, texts: list[str]) -> int:
    ids = text_lib.tokenize(self.tokenizer, texts, self.max_length)
    flat = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    if len(flat) and (int(flat.min()) < 0 or int(flat.max()) > np.iinfo(self.dtype).max):
      raise ValueError(f"{self.folder}: token id {int(flat.max())} does not fit {self.dtype}")
    _save_npz(self.partial / f"tokens-{k:05d}.npz", tokens=flat.astype(self.dtype),
              lengths=np.fromiter(map(len, ids), np.int32, len(ids)))
    return len(ids)

  def _finish(self, num_chunks: int) -> None:
    chunks = [self.partial / f"tokens-{k:05d}.npz" for k in range(num_chunks)]
    offsets = np.zeros(len(self.corpus) + 1, np.int64)
    at = 0
    for chunk in chunks:
      with np.load(chunk) as arrays:
        lengths = arrays["lengths"]
      offsets[at + 1:at + 1 + len(lengths)] = offsets[at] + np.cumsum(lengths)
      at += len(lengths)
    if at != len(self.corpus):
      raise RuntimeError(f"{self.partial}: its chunks hold {at} documents, the corpus {len(self.corpus)}")

    def pieces():
      for chunk in chunks:
        with np.load(chunk) as arrays:
          yield arrays["tokens"]

    write_npy(self.folder / "tokens.npy", self.dtype, int(offsets[-1]), pieces())
    write_npy(self.folder / "token_offsets.npy", np.int64, len(offsets), [offsets])
    tok, prompt = text_lib.unprompted(self.tokenizer)
    manifest = {"format": FORMAT, "kind": "tokens", "index": self.corpus.manifest["key"],
                "num_docs": len(self.corpus), "num_tokens": int(offsets[-1]), "max_length": self.max_length,
                "dtype": self.dtype.name, "pad_id": int(getattr(tok, "pad_token_id", None) or 0),
                "tokenizer": {"digest": self.key, "class": type(tok).__name__,
                              "name_or_path": str(getattr(tok, "name_or_path", "")),
                              "vocab_size": len(tok) if hasattr(tok, "__len__") else tok.vocab_size,
                              "truncation_side": getattr(tok, "truncation_side", "right")}}
    if prompt:
      manifest["tokenizer"]["prompt"] = prompt
    atomic.write_text(self.folder / MANIFEST, json.dumps(manifest, indent=1))
    shutil.rmtree(self.partial, ignore_errors=True)
