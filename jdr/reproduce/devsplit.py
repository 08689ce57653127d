"""A fixed dev split of a BEIR dataset's training queries, written beside the runs that use it.

`write_dev_split(source, out)` writes OUT/data/NAME-dev: the source's corpus, queries and test qrels, its
training qrels split by query into train (the rest) and dev (`fraction` of the queries, drawn with `seed`),
and split.json naming the dev queries. Every choice of the table (the learning rate) is made on dev; the
test queries are only scored for the final models. A second call with the same settings writes the same
bytes, and leaves a file that already holds them untouched: its modification time stays, so a prepared
corpus another build running beside it reads from the file stays valid (a prepared corpus is keyed on the
file's size and modification time). An output directory made with other settings is refused, since its runs
trained on another split.
"""

from __future__ import annotations

import filecmp
import json
import pathlib
import shutil
import tempfile

import numpy as np

from jdr.runtime import atomic
from jdr.data import formats


def split_queries(qids: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
  """(train, dev) query ids: round(fraction x n) of them (at least one) drawn with `seed`, both sorted."""
  if not 0.0 < fraction < 1.0:
    raise ValueError(f"the dev fraction must be in (0, 1), got {fraction!r}")
  ordered = sorted(qids)
  if len(ordered) < 2:
    raise ValueError(f"{len(ordered)} training queries cannot be split into train and dev")
  n_dev = min(len(ordered) - 1, max(1, round(fraction * len(ordered))))
  picked = set(np.random.default_rng(seed).permutation(len(ordered))[:n_dev].tolist())
  dev = [q for i, q in enumerate(ordered) if i in picked]
  train = [q for i, q in enumerate(ordered) if i not in picked]
  return train, dev


def _copy(src: pathlib.Path, dst: pathlib.Path) -> None:
  """Copies src to dst unless dst already holds the same bytes."""
  if dst.is_file() and filecmp.cmp(src, dst, shallow=False):
    return

  def write(f):
    with open(src, "rb") as s:
      shutil.copyfileobj(s, f)
  atomic.write_atomic(dst, write)


def _write_unless_same(dst: pathlib.Path, write) -> None:
  """`write(path)` writes dst's new content; dst is replaced only when that content differs from its own."""
  with tempfile.TemporaryDirectory(dir=dst.parent) as scratch:
    fresh = pathlib.Path(scratch) / dst.name
    write(fresh)
    _copy(fresh, dst)


def write_dev_split(source: pathlib.Path, out: pathlib.Path, *, fraction: float, seed: int) -> pathlib.Path:
  """Writes OUT/data/NAME-dev (BEIR layout with qrels/{train,dev,test}.tsv) and returns it."""
  source, out = pathlib.Path(source), pathlib.Path(out)
  train_file = source / "qrels" / "train.tsv"
  qrels = formats.read_qrels(train_file)
  judged = [q for q, docs in qrels.items() if any(r > 0 for r in docs.values())]
  train, dev = split_queries(judged, fraction, seed)
  record = {"source": str(source.resolve()), "fraction": fraction, "seed": seed, "train_queries": len(train),
            "dev_queries": dev}
  target = out / "data" / f"{source.name}-dev"
  record_file = target / "split.json"
  if record_file.exists():
    old = json.loads(record_file.read_text())
    if {k: old.get(k) for k in ("fraction", "seed", "dev_queries")} != \
        {k: record[k] for k in ("fraction", "seed", "dev_queries")}:
      raise ValueError(f"{record_file}: this output directory holds runs trained on another dev split "
                       f"(fraction {old.get('fraction')}, seed {old.get('seed')}); use another output directory")
  (target / "qrels").mkdir(parents=True, exist_ok=True)
  for name in ("corpus.jsonl", "queries.jsonl", "qrels/test.tsv"):
    _copy(source / name, target / name)
  # Queries judged with relevance 0 only cannot be trained on or scored; they stay out of both parts.
  for name, part in (("train.tsv", train), ("dev.tsv", dev)):
    _write_unless_same(target / "qrels" / name, lambda path, part=part: formats.write_qrels(
        path, {q: qrels[q] for q in part}))
  _write_unless_same(record_file, lambda path: atomic.write_text(path, json.dumps(record, indent=1)))
  return target
