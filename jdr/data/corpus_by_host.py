"""A training corpus that each host of a job parses only its own part of, its documents read when asked.

With several processes (`jax.process_count() > 1`) and a local, uncompressed corpus file, each host validates
and parses only the lines starting in its equal share of the file's bytes (`formats.corpus_part_bytes`, as
`jdr.encode` does) and keeps where each document lies. The hosts swap those (id, byte offset, byte length)
lists through the workdir, so every host knows every id (batches name documents anywhere in the corpus), and
an id in two parts is found here, before training, with both line numbers. `LineCorpus` then reads a
document's one line from the file when a batch, an encoding or a miner asks for it (`os.pread`: no shared file
position, so ANCE's refresh thread can read beside the batches).

On one host, or for a gzip or object-storage (gs://) corpus, the trainer reads the whole file as before.
"""

from __future__ import annotations

import collections.abc
import io
import os
import pathlib
import sys
from typing import Iterator

import numpy as np

from jdr.runtime import parallel
from jdr.runtime import paths
from jdr.data import formats


class LineCorpus(collections.abc.Mapping):
  """{doc id: formats.Doc} over a corpus file's lines, each parsed when looked up (already validated)."""

  def __init__(self, path: str | pathlib.Path, ids: list[str], offsets: np.ndarray, lengths: np.ndarray):
    self.path = str(path)
    self._jsonl = formats.is_jsonl(paths.as_path(path))
    self._ids = ids
    self._row = {doc_id: i for i, doc_id in enumerate(ids)}
    self._offsets, self._lengths = offsets, lengths
    self._fd = os.open(self.path, os.O_RDONLY)

  def __getitem__(self, doc_id: str) -> formats.Doc:
    i = self._row[doc_id]
    raw = os.pread(self._fd, int(self._lengths[i]), int(self._offsets[i]))
    return formats.parse_doc(raw.decode("utf-8").rstrip("\r\n"), self._jsonl)

  def __contains__(self, doc_id) -> bool:
    return doc_id in self._row

  def __iter__(self) -> Iterator[str]:
    return iter(self._ids)

  def __len__(self) -> int:
    return len(self._ids)

  def __del__(self):
    if getattr(self, "_fd", None) is not None:
      os.close(self._fd)
      self._fd = None


def _part_name(part: int, parts: int) -> str:
  return f"part-{part:05d}-of-{parts:05d}.npz"


def readable_by_parts(path: str | pathlib.Path) -> bool:
  """Whether hosts can each parse a part of this corpus file and read lines at offsets: local, uncompressed."""
  path = paths.as_path(path)
  return not str(path).startswith(("gs://", "s3://")) and path.suffix != ".gz" and path.is_file()


def swap_parts(directory: str | pathlib.Path, part: int, parts: int, arrays: dict[str, np.ndarray],
               sync=None) -> list[dict[str, np.ndarray]]:
  """Every host's `arrays` for its part, in part order: each host writes its own to `directory` (which the
  hosts share), waits for all (`sync(name)`, default jax's multihost_utils.sync_global_devices) and reads
  every part's. For lists each host builds from its part of a file (ids, offsets) that all hosts need."""
  if sync is None:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    sync = multihost_utils.sync_global_devices
  directory = paths.as_path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  buffer = io.BytesIO()  # np.savez / np.load want seekable files; gs:// objects are written whole
  np.savez(buffer, **arrays)
  (directory / _part_name(part, parts)).write_bytes(buffer.getvalue())
  sync(f"jdr.data.corpus_by_host.swap_parts: {directory}")
  out = []
  for k in range(parts):
    part_file = directory / _part_name(k, parts)
    if not part_file.exists():
      raise FileNotFoundError(f"{part_file} is missing after every host wrote its part: it must be one "
                              "directory all hosts share (a network filesystem or gs://)")
    with np.load(io.BytesIO(part_file.read_bytes())) as f:
      out.append({name: f[name] for name in f.files})
  return out


def read_by_hosts(path: str | pathlib.Path, exchange_dir: str | pathlib.Path, *, skip_invalid: bool = False,
                  part: int | None = None, parts: int | None = None, sync=None) -> LineCorpus:
  """Parses this host's part of the corpus, swaps the parts' (id, offset, length) lists through
  `exchange_dir` (shared by the hosts: the workdir) and returns the whole corpus as a LineCorpus.

  `part` / `parts` default to jax.process_index() / process_count(); `sync(name)` waits for every host
  (default: jax's multihost_utils.sync_global_devices). A bad line in any part stops every host.
  """
  import jax  # pylint: disable=g-import-not-at-top
  part = jax.process_index() if part is None else part
  parts = jax.process_count() if parts is None else parts
  path = formats.corpus_file(path)
  error, ids, offsets, lengths = None, [], [], []
  try:
    for doc, offset, length in formats.iter_corpus_lines(path, skip_invalid=skip_invalid, part=part, parts=parts):
      ids.append(doc.id)
      offsets.append(offset)
      lengths.append(length)
  except (ValueError, OSError) as e:
    error = e
  parallel.raise_if_any_host_failed(error, f"reading {path}")
  swapped = swap_parts(paths.as_path(exchange_dir) / "corpus-parts", part, parts,
                       {"ids": np.asarray(ids, dtype=str), "offsets": np.asarray(offsets, np.int64),
                        "lengths": np.asarray(lengths, np.int64)}, sync)
  ids, offsets, lengths, where, skipped = [], [], [], {}, 0
  for arrays in swapped:
    for doc_id, offset, length in zip(arrays["ids"].tolist(), arrays["offsets"].tolist(),
                                      arrays["lengths"].tolist()):
      if doc_id in where:  # within a part iter_corpus_lines has checked already: this one spans two parts
        if not skip_invalid:
          raise formats.DataFormatError(
              path, formats.line_number_at(path, offset), f"{formats.DUPLICATE}: doc id {doc_id!r} already on "
              f"line {formats.line_number_at(path, where[doc_id])}")
        skipped += 1
        continue
      where[doc_id] = offset
      ids.append(doc_id)
      offsets.append(offset)
      lengths.append(length)
  if skipped:
    print(f"jdr: skipped {skipped} documents of {path} whose ids an earlier part holds", file=sys.stderr)
  return LineCorpus(path, ids, np.asarray(offsets, np.int64), np.asarray(lengths, np.int64))
