"""BM25 as a first-stage retriever over a corpus of any size: an index on disk, and top-k mining as arrays.

Scoring is Lucene's (Anserini's) BM25, the one bm25s calls method="lucene":

  score(q, d) = sum over the query's tokens t (repeats counted) of
                idf(t) * tf / (tf + k1 * (1 - b + b * |d| / avgdl)),   idf(t) = log(1 + (N - df + 0.5) / (df + 0.5))

with Anserini's MS MARCO settings k1=0.9, b=0.4, and bm25s's tokenization: lowercase, the token pattern
`\\b\\w\\w+\\b`, its English stopwords, no stemming. |d| is exact (Lucene rounds it to one byte).

`index_for(texts, count, ...)` streams a corpus once: worker processes tokenize chunks of texts, postings spill
to disk, and a counting sort writes a term-major sparse matrix of precomputed term weights (`Index`), memory-
mapped when read. Built indexes are keyed by the corpus fingerprint and the settings; one process builds or
loads an index once (`OPEN`), and a cache directory keeps it across runs. A killed build resumes at its
last finished chunk.

`mine(index, queries, k, ...)` scores queries on every core (numba): each query adds up only the postings of
its own terms, then keeps its k best, ties broken by the lower row, so results do not depend on threads or
chunking. Rows are int32 (-1 where fewer than k docs share a term with the query), scores float32. With a
cache directory the arrays are written chunk by chunk and a killed mine resumes at its last finished chunk.

Cache layout (NAME = the first 20 hex digits of the key):
  bm25-index-NAME/  meta.json, data.npy (float32 [nnz] weights), indices.npy (int32 [nnz] doc rows, ascending
                    within a term), indptr.npy (int64 [V + 1]), lengths.npy (int32 [N]), vocab.txt (V lines)
  bm25-QUERIES-top{k}/ meta.json, rows.npy (int32 [Q, k]), scores.npy (float32 [Q, k]); QUERIES names the
                    index, the queries and their ids, so a list at a larger k serves a smaller one
  ....partial/      the same while being written, with progress.json (what is finished)
A prepared corpus (jdr.data.prepared) keeps its index and lists in its own folder's bm25/ (`kept_beside`): a
second run, a learning-rate sweep or `jdr.mine` over the same corpus reads them instead of building again.
"""

from __future__ import annotations

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import multiprocessing
import os
import pathlib
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numba
import numpy as np

from jdr.runtime import atomic
from jdr.runtime import paths
from jdr.runtime import timings
from jdr.data.text import doc_text

log = logging.getLogger(__name__)

K1, B = 0.9, 0.4  # Anserini's MS MARCO passage settings
TOKEN_PATTERN = r"(?u)\b\w\w+\b"
# Lucene's English stop set (Anserini's), the list bm25s's stopwords="en" removes; copied, not imported:
# importing bm25s imports JAX.
STOPWORDS = frozenset(("a", "an", "and", "are", "as", "at", "be", "but", "by", "for", "if", "in", "into", "is",
                       "it", "no", "not", "of", "on", "or", "such", "that", "the", "their", "then", "there",
                       "these", "they", "this", "to", "was", "will", "with"))
# Bump when what an index or a mined file holds changes, so old caches are not reused.
_INDEX_VERSION = 1
_MINE_VERSION = 2  # 2: lists named by their queries, then depth (a deeper one serves a shallower)

_split = re.compile(TOKEN_PATTERN).findall


def tokenize(text: str) -> list[str]:
  """bm25s.tokenize(text, stopwords="en")'s tokens, in order."""
  return [t for t in _split(text.lower()) if t not in STOPWORDS]


def _settings(k1: float, b: float) -> dict:
  stop = hashlib.sha256("\n".join(sorted(STOPWORDS)).encode()).hexdigest()
  return dict(k1=float(k1), b=float(b), method="lucene", lower=True, pattern=TOKEN_PATTERN, stopwords=stop)


def text_fingerprint(texts: Iterable[str], count: int) -> str:
  """A hash of `count` texts in order; an error if `texts` holds another number of them."""
  h = hashlib.sha256(f"{count}\0".encode())
  seen = 0
  for batch in _batches(texts):
    seen += len(batch)
    # NUL separators keep ("ab", "c") and ("a", "bc") apart; texts never contain NUL in valid data.
    h.update(("\0".join(batch) + "\0").encode())
  _check_count(seen, count)
  return h.hexdigest()


def _check_count(seen: int, count: int) -> None:
  if seen != count:
    raise ValueError(f"the corpus gave {seen} texts, not the {count} its count says")


def _hexkey(head: dict, texts: Iterable[str] = ()) -> str:
  h = hashlib.sha256(json.dumps(head, sort_keys=True).encode())
  for batch in _batches(texts):
    h.update(("\0".join(batch) + "\0").encode())
  return h.hexdigest()


def _batches(items: Iterable[str], size: int = 4096) -> Iterator[list[str]]:
  items = iter(items)
  while batch := list(itertools.islice(items, size)):
    yield batch


# ---------------------------------------------------------------------------------------------- the index

@dataclasses.dataclass
class Index:
  """A built index, its arrays memory-mapped: `data[indptr[t]:indptr[t + 1]]` are term t's weights in the docs
  `indices[...]` (corpus rows)."""
  path: pathlib.Path
  meta: dict
  data: np.ndarray
  indices: np.ndarray
  indptr: np.ndarray
  lengths: np.ndarray
  _vocab: dict | None = None
  _tmp: object = None  # the temporary directory of an index built without a cache, kept alive with it
  mined_dir: pathlib.Path | None = None  # where `mine` keeps lists over it (beside a prepared corpus)

  @classmethod
  def load(cls, path: str | os.PathLike) -> "Index":
    path = pathlib.Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("version") != _INDEX_VERSION:
      raise ValueError(f"{path}: a BM25 index of format {meta.get('version')}, not {_INDEX_VERSION}; delete it "
                       "to rebuild")
    arrays = {n: np.load(path / f"{n}.npy", mmap_mode="r") for n in ("data", "indices", "indptr", "lengths")}
    return cls(path, meta, **arrays)

  @property
  def key(self) -> str:
    return self.meta["key"]

  def __len__(self) -> int:
    return self.meta["num_docs"]

  @property
  def vocab(self) -> dict[str, int]:
    if self._vocab is None:  # read on first query: a large corpus has millions of terms
      words = (self.path / "vocab.txt").read_text(encoding="utf-8").split("\n")[:self.meta["num_terms"]]
      self._vocab = dict(zip(words, range(len(words))))
    return self._vocab

  def query_terms(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The texts' term ids, flat (int32), and each text's start in them ([len + 1] int64); unknown tokens
    are dropped, since no document holds them."""
    get = self.vocab.get
    ids = [[i for i in map(get, tokenize(t)) if i is not None] for t in texts]
    starts = np.zeros(len(ids) + 1, np.int64)
    np.cumsum([len(q) for q in ids], out=starts[1:])
    return np.fromiter(itertools.chain.from_iterable(ids), np.int32, int(starts[-1])), starts


# One process builds or loads each index once, whoever asks (negatives, evaluation, reranking).
OPEN: dict[str, Index] = {}


def index_for(texts: Iterable[str], count: int, *, fingerprint: str | None = None,
              cache_dir: str | os.PathLike | None = None, k1: float = K1, b: float = B, workers: int | None = None,
              chunk_docs: int = 8192, show_progress: bool = True) -> Index:
  """The BM25 index of `count` texts (corpus rows in order): this process's, else the cache's, else built.

  `fingerprint` identifies the texts (e.g. a prepared corpus's own); without it the texts are hashed in a
  first pass, so they must be re-iterable (a list, a dict's values), not a one-shot iterator.
  `workers` tokenizing processes (default: every core). `cache_dir` (local or object storage) keeps the index.
  """
  if count < 1:
    raise ValueError(f"a BM25 index needs at least one document, got a count of {count}")
  if fingerprint is None:
    if iter(texts) is texts:
      raise ValueError("texts is a one-shot iterator: pass fingerprint= (one that names these texts) or texts "
                       "that can be read twice")
    fingerprint = text_fingerprint(texts, count)
  settings = _settings(k1, b)
  key = _hexkey(dict(version=_INDEX_VERSION, fingerprint=fingerprint, num_docs=count, **settings))
  if key in OPEN:
    return OPEN[key]
  name = f"bm25-index-{key[:20]}"
  meta = dict(version=_INDEX_VERSION, key=key, fingerprint=fingerprint, num_docs=count, **settings)
  if cache_dir is None:
    tmp = tempfile.TemporaryDirectory(prefix="jdr-bm25-")
    index = Index.load(build_index(texts, count, pathlib.Path(tmp.name) / name, meta, workers=workers,
                              chunk_docs=chunk_docs, show_progress=show_progress))
    index._tmp = tmp
  else:
    place = _Place(cache_dir, name)
    with _exclusive(place.local):
      if not place.fetch():
        try:
          build_index(texts, count, place.local, meta, workers=workers, chunk_docs=chunk_docs,
                      show_progress=show_progress)
        except OSError as e:  # a full disk names the index being written, not just "no space left"
          raise atomic.naming(e, place.local) from None
        place.publish()
    index = Index.load(place.local)
    if index.key != key:
      raise ValueError(f"{place.local}: holds the index of another corpus or settings; delete it")
  OPEN[key] = index
  return index


def kept_beside(corpus) -> pathlib.Path | None:
  """Where a prepared corpus (jdr.data.prepared) keeps its BM25 index and mined lists: a folder beside its own
  arrays, shared by every run and `jdr.mine` that reads it (built once, whole or not at all, one builder at a
  time); None for a corpus that is not prepared."""
  folder = getattr(corpus, "folder", None)
  return pathlib.Path(folder) / "bm25" if folder is not None and getattr(corpus, "manifest", None) else None


@timings.timed("bm25_index")
def corpus_index(corpus: Mapping, **kwargs) -> Index:
  """`index_for` over a {doc id: Doc} corpus, each document as `doc_text` (title + " " + text). A prepared
  corpus is named by its own key (no pass over the texts to hash them) and its index is kept beside it
  (`kept_beside`), whatever `cache_dir` says."""
  beside = kept_beside(corpus)
  if beside is not None:
    kwargs = {**kwargs, "cache_dir": beside, "fingerprint": f"prepared:{corpus.manifest['key']}"}
  index = index_for(_Texts(corpus), len(corpus), **kwargs)
  if beside is not None:
    index.mined_dir = beside  # `mine` keeps its lists there too, for every run over this corpus
  return index


class _Texts:
  """A corpus dict's texts, re-iterable without holding them."""

  def __init__(self, corpus: Mapping):
    self.corpus = corpus

  def __iter__(self) -> Iterator[str]:
    return map(doc_text, self.corpus.values())


class _Place:
  """A cache entry `name` under `cache_dir`. Memory maps and resumable writes need local disk, so for object
  storage the entry is built in a local folder and uploaded when finished, and downloaded to be read."""

  def __init__(self, cache_dir, name: str):
    self.remote = None if paths.is_local(cache_dir) else paths.as_path(cache_dir) / name
    if self.remote is None:
      root = pathlib.Path(os.fspath(cache_dir))
    else:
      root = pathlib.Path(tempfile.gettempdir()) / ("jdr-bm25-" + hashlib.sha256(
          os.fspath(cache_dir).encode()).hexdigest()[:16])
    self.local = root / name

  def fetch(self) -> bool:
    """Whether the finished entry is (now) on local disk."""
    if (self.local / "meta.json").exists():
      return True
    if self.remote is None or not (self.remote / "meta.json").exists():
      return False
    with paths.local_copy(self.remote) as copy:
      shutil.copytree(copy, self.local, dirs_exist_ok=True)
    return True

  def publish(self) -> None:
    if self.remote is not None:
      paths.upload_dir(self.local, self.remote)


def tokenize_chunk(texts: Sequence[str]):
  """One chunk's doc lengths [n], its terms (local ids in first-seen order) and its postings (doc, term, tf),
  sorted by doc. Runs in a worker process."""
  n = len(texts)
  joined = "\0".join(texts).lower().split("\0")  # one lower() for the chunk; NUL is no token character
  if len(joined) != n:  # a text held a NUL: lowercase one by one
    joined = [t.lower() for t in texts]
  per_doc = list(map(_split, joined))
  raw_lengths = np.fromiter(map(len, per_doc), np.int64, n)
  local = collections.defaultdict(itertools.count().__next__)
  ids = np.fromiter(map(local.__getitem__, itertools.chain.from_iterable(per_doc)), np.int64,
                    int(raw_lengths.sum()))
  kept = np.fromiter((w not in STOPWORDS for w in local), bool, len(local))
  renumber = np.cumsum(kept) - 1  # local ids without the stopwords
  doc = np.repeat(np.arange(n, dtype=np.int64), raw_lengths)
  keep = kept[ids]
  doc, ids = doc[keep], renumber[ids[keep]]
  width = max(int(kept.sum()), 1)
  pairs, tf = np.unique(doc * width + ids, return_counts=True)
  words = [w for w, k in zip(local, kept) if k]
  return (np.bincount(doc, minlength=n).astype(np.int32), words, (pairs // width).astype(np.int32),
          (pairs % width).astype(np.int32), tf.astype(np.int32))


def _tokenized(chunks: Iterator[list[str]], workers: int) -> Iterator[tuple]:
  """tokenize_chunk over the chunks, in order, on `workers` processes, with a bounded number in flight."""
  if workers <= 1:
    yield from map(tokenize_chunk, chunks)
    return
  # fork, not spawn: a spawned child re-runs the caller's main script, which is only safe behind an
  # `if __name__ == "__main__"` a user script may lack. A forked child inherits the threads' locks of JAX (and
  # JAX says so), but runs only regex and numpy sorting here, never JAX, numba or BLAS.
  with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
    pending = collections.deque()
    for chunk in chunks:
      with warnings.catch_warnings():  # a submit forks the workers it still lacks
        warnings.filterwarnings("ignore", r"os\.fork\(\) was called", RuntimeWarning)
        pending.append(pool.submit(tokenize_chunk, chunk))
      if len(pending) > 2 * workers:
        yield pending.popleft().result()
    while pending:
      yield pending.popleft().result()


_SPILL = ("docs", "terms", "tfs")  # int32 postings in doc order, appended chunk by chunk while tokenizing


@timings.timed("bm25_build")
def build_index(texts: Iterable[str], count: int, final: pathlib.Path, meta: dict, *, workers: int | None,
           chunk_docs: int, show_progress: bool) -> pathlib.Path:
  """Writes the index of `texts` to `final` through `final`.partial, resuming a killed build there."""
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
  partial = final.with_name(final.name + ".partial")
  progress_path = partial / "progress.json"
  progress = json.loads(progress_path.read_text()) if progress_path.exists() else None
  if progress is not None and progress.get("finished") and progress["key"] == meta["key"]:
    return _publish_index(partial, final)  # killed between the last write and the rename
  if progress is None or progress["key"] != meta["key"]:
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    progress = dict(key=meta["key"], docs=0, postings=0, vocab_bytes=0, terms=0)
    np.lib.format.open_memmap(partial / "lengths.npy", "w+", np.int32, (count,)).flush()
    for name in (*_SPILL, "vocab"):
      (partial / f"{name}.bin").touch()
  elif progress["docs"]:
    log.info("BM25 index: resuming at document %d of %d", progress["docs"], count)
  # Back to the last recorded chunk: whatever a killed build wrote after it is dropped.
  for name in _SPILL:
    os.truncate(partial / f"{name}.bin", 4 * progress["postings"])
  os.truncate(partial / "vocab.bin", progress["vocab_bytes"])
  words = (partial / "vocab.bin").read_bytes().decode("utf-8").split("\n")[:progress["terms"]]
  vocab = collections.defaultdict(itertools.count(len(words)).__next__, zip(words, range(len(words))))
  lengths = np.load(partial / "lengths.npy", mmap_mode="r+")
  workers = workers or len(os.sched_getaffinity(0))
  if count - progress["docs"] <= chunk_docs:
    workers = 1  # a single chunk is not worth starting processes for

  stream = iter(texts)
  seen = sum(1 for _ in itertools.islice(stream, progress["docs"]))
  _check_count(seen, progress["docs"])
  files = {name: open(partial / f"{name}.bin", "ab") for name in (*_SPILL, "vocab")}
  try:
    with tqdm(total=count, initial=progress["docs"], desc="BM25 index", unit="doc", disable=not show_progress,
              smoothing=0.05) as bar:
      for chunk_lengths, local_words, docs, local_terms, tfs in _tokenized(_batches(stream, chunk_docs), workers):
        start, n = progress["docs"], len(chunk_lengths)
        if start + n > count:
          _check_count(start + n, count)
        known = len(vocab)
        ids = np.fromiter(map(vocab.__getitem__, local_words), np.int32, len(local_words))
        new = "".join(w + "\n" for w, i in zip(local_words, ids) if i >= known).encode("utf-8")
        lengths[start:start + n] = chunk_lengths
        files["docs"].write((docs + np.int32(start)).tobytes())
        files["terms"].write(ids[local_terms].tobytes())
        files["tfs"].write(tfs.tobytes())
        files["vocab"].write(new)
        for f in files.values():
          f.flush()
        lengths.flush()
        progress.update(docs=start + n, postings=progress["postings"] + len(docs),
                        vocab_bytes=progress["vocab_bytes"] + len(new), terms=len(vocab))
        atomic.write_text(progress_path, json.dumps(progress))
        bar.update(n)
  finally:
    for f in files.values():
      f.close()
  _check_count(progress["docs"], count)
  del lengths
  _finish(partial, meta, progress, show_progress)
  atomic.write_text(progress_path, json.dumps(dict(progress, finished=True)))
  return _publish_index(partial, final)


def _publish_index(partial: pathlib.Path, final: pathlib.Path) -> pathlib.Path:
  for name in (*_SPILL, "vocab"):
    (partial / f"{name}.bin").unlink(missing_ok=True)
  _rename(partial, final)
  return final


def _rename(partial: pathlib.Path, final: pathlib.Path) -> None:
  """Makes a finished .partial entry the cache entry. Its progress record goes last, so a kill at any point
  leaves either the entry or a .partial that knows it is finished."""
  try:
    os.replace(partial, final)
  except OSError:  # another process finished the same entry first
    if not (final / "meta.json").exists():
      raise
    shutil.rmtree(partial, ignore_errors=True)
  (final / "progress.json").unlink(missing_ok=True)


def _finish(partial: pathlib.Path, meta: dict, progress: dict, show_progress: bool) -> None:
  """The spilled postings, counting-sorted by term into the index's arrays, with their BM25 weights."""
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
  nnz, n_terms, block = progress["postings"], progress["terms"], 1 << 24
  df = np.zeros(n_terms, np.int64)
  for start in range(0, nnz, block):
    df += np.bincount(np.fromfile(partial / "terms.bin", np.int32, min(block, nnz - start), offset=4 * start),
                      minlength=n_terms)
  indptr = np.zeros(n_terms + 1, np.int64)
  np.cumsum(df, out=indptr[1:])
  lengths = np.load(partial / "lengths.npy")
  n_docs = len(lengths)
  avgdl = float(lengths.sum(dtype=np.int64)) / max(n_docs, 1)
  idf = np.log1p((n_docs - df + 0.5) / (df + 0.5))
  data = np.lib.format.open_memmap(partial / "data.npy", "w+", np.float32, (nnz,))
  indices = np.lib.format.open_memmap(partial / "indices.npy", "w+", np.int32, (nnz,))
  heads = indptr[:-1].copy()
  with tqdm(total=nnz, desc="BM25 index: weights", unit="posting", unit_scale=True,
            disable=not show_progress) as bar:
    for start in range(0, nnz, block):
      size = min(block, nnz - start)
      spilled = [np.fromfile(partial / f"{name}.bin", np.int32, size, offset=4 * start) for name in _SPILL]
      _scatter(*spilled, lengths, idf, meta["k1"], meta["b"], avgdl, heads, np.asarray(indices), np.asarray(data))
      bar.update(size)
  data.flush()
  indices.flush()
  del data, indices
  np.save(partial / "indptr.npy", indptr)
  shutil.copyfile(partial / "vocab.bin", partial / "vocab.txt")
  atomic.write_text(partial / "meta.json", json.dumps(dict(meta, num_terms=n_terms, nnz=nnz, avgdl=avgdl),
                                                       indent=1))


@numba.njit(cache=True, nogil=True)
def _scatter(docs, terms, tfs, lengths, idf, k1, b, avgdl, heads, indices, data):
  # Postings arrive in doc order, so each term's list comes out sorted by doc.
  for i in range(len(docs)):
    t, d, tf = terms[i], docs[i], float(tfs[i])
    pos = heads[t]
    heads[t] = pos + 1
    indices[pos] = d
    data[pos] = idf[t] * tf / (tf + k1 * (1.0 - b + b * lengths[d] / avgdl))


# --------------------------------------------------------------------------------------------------- mining

@numba.njit(cache=True, nogil=True, inline="always")
def _worse(s1, r1, s2, r2):
  return s1 < s2 or (s1 == s2 and r1 > r2)


@numba.njit(cache=True, nogil=True)
def _sift_up(hs, hr, i):
  s, r = hs[i], hr[i]
  while i > 0:
    p = (i - 1) // 2
    if not _worse(s, r, hs[p], hr[p]):
      break
    hs[i], hr[i] = hs[p], hr[p]
    i = p
  hs[i], hr[i] = s, r


@numba.njit(cache=True, nogil=True)
def _sift_down(hs, hr, size, i):
  s, r = hs[i], hr[i]
  while True:
    c = 2 * i + 1
    if c >= size:
      break
    if c + 1 < size and _worse(hs[c + 1], hr[c + 1], hs[c], hr[c]):
      c += 1
    if not _worse(hs[c], hr[c], s, r):
      break
    hs[i], hr[i] = hs[c], hr[c]
    i = c
  hs[i], hr[i] = s, r


# Docs are scored a block at a time, so a query's sums and its list of docs reached (256 KiB) stay in a
# core's L2 cache whatever the corpus size.
BLOCK = 1 << 15


@numba.njit(cache=True, nogil=True)
def _one_query(data, indices, indptr, terms, acc, touched, hs, hr, out_rows, out_scores):
  # acc is all zeros between uses and weights are > 0, so acc[d] == 0 means "d not seen yet": only the docs
  # the query's postings reach are selected and reset, never the whole corpus.
  block, n_terms = len(acc), len(terms)
  cursor, end = np.empty(n_terms, np.int64), np.empty(n_terms, np.int64)
  for j in range(n_terms):
    cursor[j], end[j] = indptr[terms[j]], indptr[terms[j] + 1]
  k, size = len(hs), 0
  worst_s, worst_r = np.float32(-1.0), 0  # the heap's root once full: most docs fall below it
  while True:
    first = -1  # the next doc any term reaches; its block is scored next (empty blocks are skipped)
    for j in range(n_terms):
      if cursor[j] < end[j] and (first < 0 or indices[cursor[j]] < first):
        first = indices[cursor[j]]
    if first < 0:
      break
    lo = first - first % block
    n = 0
    for j in range(n_terms):
      stop = cursor[j] + np.searchsorted(indices[cursor[j]:end[j]], lo + block)
      for p in range(cursor[j], stop):
        d = indices[p] - lo
        a = acc[d]
        touched[n] = d
        n += a == 0  # no branch: whether a posting reaches a new doc is a coin toss to the CPU
        acc[d] = a + data[p]
      cursor[j] = stop
    for i in range(n):  # a heap of the k best so far, its root the worst of them
      d = touched[i]
      s = acc[d]
      acc[d] = 0
      if s < worst_s:
        continue
      r = d + lo
      if size < k:
        hs[size], hr[size] = s, r
        _sift_up(hs, hr, size)
        size += 1
        if size == k:
          worst_s, worst_r = hs[0], hr[0]
      elif _worse(worst_s, worst_r, s, r):
        hs[0], hr[0] = s, r
        _sift_down(hs, hr, size, 0)
        worst_s, worst_r = hs[0], hr[0]
  found = size
  for j in range(found - 1, -1, -1):  # pop the worst into the last free place: best first
    out_scores[j], out_rows[j] = hs[0], hr[0]
    size -= 1
    hs[0], hr[0] = hs[size], hr[size]
    _sift_down(hs, hr, size, 0)
  for j in range(found, k):
    out_scores[j], out_rows[j] = 0.0, -1


@numba.njit(parallel=True, cache=True, nogil=True)
def _top_k(data, indices, indptr, terms, starts, acc, touched, out_rows, out_scores):
  lanes, n_queries, k = acc.shape[0], len(starts) - 1, out_rows.shape[1]
  for lane in numba.prange(lanes):  # one lane a thread, each with its own scratch; queries dealt round-robin
    hs, hr = np.empty(k, np.float32), np.empty(k, np.int32)
    for q in range(lane, n_queries, lanes):
      _one_query(data, indices, indptr, terms[starts[q]:starts[q + 1]], acc[lane], touched[lane], hs, hr,
                 out_rows[q], out_scores[q])


class Scorer:
  """The top-k kernel over an index with per-thread scratch, on n_threads cores (-1: all; 0, as bm25s: one)."""

  def __init__(self, index: Index, n_queries: int, n_threads: int):
    cores = len(os.sched_getaffinity(0)) if n_threads is None or n_threads < 0 else n_threads
    self.lanes = max(1, min(cores, numba.config.NUMBA_NUM_THREADS, n_queries))
    self.index = index
    block = min(BLOCK, max(len(index), 1))
    self.acc = np.zeros((self.lanes, block), np.float32)
    self.touched = np.empty((self.lanes, block + 1), np.int32)  # + 1: the slot a seen doc writes, uncounted
    self.arrays = [np.asarray(a) for a in (index.data, index.indices, index.indptr)]

  @timings.timed("bm25_search")
  def __call__(self, texts: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
    terms, starts = self.index.query_terms(texts)
    rows, scores = np.empty((len(texts), k), np.int32), np.empty((len(texts), k), np.float32)
    before = numba.get_num_threads()
    numba.set_num_threads(self.lanes)
    try:
      _top_k(*self.arrays, terms, starts, self.acc, self.touched, rows, scores)
    finally:
      numba.set_num_threads(before)
    return rows, scores


def search(index: Index, texts: Sequence[str], k: int, *, n_threads: int = -1) -> tuple[np.ndarray, np.ndarray]:
  """Top-k rows (int32, -1 past the docs that share a term with the query) and scores (float32) [Q, k]."""
  if k < 1:
    raise ValueError(f"k must be >= 1, got {k}")
  if not texts:
    return np.zeros((0, k), np.int32), np.zeros((0, k), np.float32)
  return Scorer(index, len(texts), n_threads)(texts, k)


@dataclasses.dataclass
class Mined:
  rows: np.ndarray  # int32 [Q, k], -1 past the docs that share a term with the query
  scores: np.ndarray  # float32 [Q, k]
  path: pathlib.Path | None  # the cache entry (None without a cache)
  from_cache: bool  # whether it was read whole from the cache, nothing mined


@timings.timed("bm25_mine")
def mine(index: Index, texts: Sequence[str], k: int, cache_dir: str | os.PathLike | None = None, *,
         query_ids: Sequence[str] | None = None, chunk_size: int = 4096, n_threads: int = -1,
         show_progress: bool = True, desc: str = "BM25 mining") -> Mined:
  """`search` for many queries, chunk by chunk on every core, with a progress bar. With `cache_dir`, the
  result is kept there (memory-mapped when read back) under a key of the index, the query texts and `query_ids`
  (when given) and k, and a killed mine resumes at its last finished chunk. A kept list of the same queries at a
  larger k serves a smaller one (its first k columns: each row is sorted by score)."""
  if k < 1:
    raise ValueError(f"k must be >= 1, got {k}")
  # An index kept beside a prepared corpus keeps its mined lists beside it too, whatever `cache_dir` says.
  cache_dir = getattr(index, "mined_dir", None) or cache_dir
  if query_ids is not None and len(query_ids) != len(texts):
    raise ValueError(f"{len(query_ids)} query ids for {len(texts)} query texts")
  from tqdm.auto import tqdm  # pylint: disable=g-import-not-at-top
  with contextlib.ExitStack() as stack:
    n = len(texts)
    place = None
    if cache_dir is not None and n:  # nothing to keep for no queries (and no empty file can be mapped)
      head = dict(version=_MINE_VERSION, index=index.key, queries=n, ids=query_ids is not None)
      queries_key = _hexkey(head, itertools.chain(query_ids or (), texts))
      key = _hexkey(dict(queries=queries_key, k=k))
      deeper = _deeper(cache_dir, queries_key, n, k)
      if deeper is not None:
        return deeper
      place = _Place(cache_dir, f"bm25-{queries_key[:20]}-top{k}")
      stack.enter_context(_exclusive(place.local))
      if place.fetch():
        return Mined(*_load_mined(place.local, key, n, k), place.local, True)
      partial = place.local.with_name(place.local.name + ".partial")
      rows, scores, done, chunk_size = _open_partial(partial, key, n, k, chunk_size)
    else:
      rows, scores, done = np.empty((n, k), np.int32), np.empty((n, k), np.float32), 0
    scorer = Scorer(index, n, n_threads) if n else None
    with tqdm(total=n, initial=min(done * chunk_size, n), desc=desc, unit="query", disable=not show_progress,
              smoothing=0.05) as bar:
      for start in range(done * chunk_size, n, chunk_size):
        end = min(start + chunk_size, n)
        rows[start:end], scores[start:end] = scorer(texts[start:end], k)
        if place is not None:
          rows.flush()
          scores.flush()
          atomic.write_text(partial / "progress.json", json.dumps(dict(key=key, chunks=start // chunk_size + 1,
                                                                       chunk_size=chunk_size)))
        bar.update(end - start)
    if place is None:
      return Mined(rows, scores, None, False)
    del rows, scores
    atomic.write_text(partial / "meta.json", json.dumps(dict(key=key, queries_key=queries_key, queries=n, k=k,
                                                             index=index.key), indent=1))
    _rename(partial, place.local)
    place.publish()
    return Mined(*_load_mined(place.local, key, n, k), place.local, False)


def _deeper(cache_dir, queries_key: str, n: int, k: int) -> Mined | None:
  """The first k columns of a finished local list of the same queries mined to a larger depth, or None."""
  if not paths.is_local(cache_dir) or not pathlib.Path(os.fspath(cache_dir)).is_dir():
    return None
  found = []
  for path in pathlib.Path(os.fspath(cache_dir)).glob(f"bm25-{queries_key[:20]}-top*"):
    depth = path.name.rsplit("-top", 1)[1]
    if depth.isdigit() and int(depth) > k and (path / "meta.json").exists():
      found.append((int(depth), path))
  if not found:
    return None
  depth, path = min(found)
  meta = json.loads((path / "meta.json").read_text())
  if meta.get("queries_key") != queries_key:
    return None
  rows, scores = _load_mined(path, meta["key"], n, depth)
  return Mined(rows[:, :k], scores[:, :k], path, True)


def _exclusive(local: pathlib.Path):
  """One process at a time builds or mines a cache entry; the lock sits beside the entry, which is renamed
  into place from its .partial."""
  return atomic.exclusive(local.with_name(local.name + ".lock"),
                          waiting=f"jdr: waiting for another process building {local}")


def _open_partial(partial: pathlib.Path, key: str, n: int, k: int, chunk_size: int):
  """The arrays of an unfinished mine and how many chunks of which size it finished (0 for a new one)."""
  progress_path = partial / "progress.json"
  progress = json.loads(progress_path.read_text()) if progress_path.exists() else None
  if progress is not None and progress["key"] == key:
    log.info("BM25 mining: resuming at chunk %d", progress["chunks"])
    return (np.load(partial / "rows.npy", mmap_mode="r+"), np.load(partial / "scores.npy", mmap_mode="r+"),
            progress["chunks"], progress["chunk_size"])
  shutil.rmtree(partial, ignore_errors=True)
  partial.mkdir(parents=True)
  rows = np.lib.format.open_memmap(partial / "rows.npy", "w+", np.int32, (n, k))
  scores = np.lib.format.open_memmap(partial / "scores.npy", "w+", np.float32, (n, k))
  atomic.write_text(progress_path, json.dumps(dict(key=key, chunks=0, chunk_size=chunk_size)))
  return rows, scores, 0, chunk_size


def _load_mined(path: pathlib.Path, key: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
  meta = json.loads((path / "meta.json").read_text())
  rows, scores = np.load(path / "rows.npy", mmap_mode="r"), np.load(path / "scores.npy", mmap_mode="r")
  if meta.get("key") != key or rows.shape != (n, k) or scores.shape != (n, k):
    raise ValueError(f"{path}: holds BM25 results for other queries or settings; delete it to mine again")
  return rows, scores
