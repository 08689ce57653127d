"""Hard negatives for training queries, filtered against false negatives: the filters `python -m jdr.mine` applies
(jdr/negatives/mined_lists.py runs them over every training query).

Each query's candidates are the top `depth` of one first-stage retriever (BM25, a model through jdr's encode
and search path, or a run file) as corpus rows with the retriever's scores. A query's labeled positives are
never its negatives and go first. Then the filters, each optional, in this order, so the cross-encoder scores
only what the cheap ones keep:

  skip_ranks r         drop the r best candidates left (the ranks nearest the positives, where relevant but
                       unlabeled documents gather)
  positive_fraction f  drop a candidate the retriever scores above f x the query's lowest positive score
                       (positive-aware mining, NV-Retriever's TopK-PercPos: a negative must stay below every
                       positive the query may be paired with); needs non-negative scores (BM25, cosines)
  ce_threshold t       drop a candidate the cross-encoder scores above t
  ce_margin m          drop a candidate the cross-encoder scores above the query's lowest positive score - m
  keep n               the first n left, in retriever order

Every filter is a pure function of arrays ([Q, depth] candidates, -1 past a query's last), so the same code
filters the training queries and measures a threshold on dev queries (`dev_report`): there the labeled
positives are what the filter should catch, and the report gives, per threshold, the share of candidates it
drops and the share of the candidates it keeps that are labeled positives (the false-negative rate that
threshold leaves). Thresholds are chosen on that report, never on test.

The result is a directory (`write` / `read`):
  meta.json           settings, counts, what each filter dropped, the dev report, the corpus's fingerprint
  qids.txt            the training queries, one a line: row i of every array is query i
  rows.npy            int32 [Q, n] negatives as corpus rows, best first, -1 past a query's last
  scores.npy          float32 [Q, n] their retriever scores (NaN past the last)
  teacher.npy         float32 [Q, n] their cross-encoder scores (with a cross-encoder)
  positives.npy       int32 [Q, P] the query's labeled positives as corpus rows, -1 padded
  positive_teacher.npy  float32 [Q, P] their cross-encoder scores (with a cross-encoder)
A run is resumable: chunks of queries are written as they finish (partial/), a killed run starts after the
last one, and the directory is complete once meta.json says so.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys
from collections.abc import Callable, Sequence

import numpy as np

from jdr.runtime import atomic
from jdr.data import prepared

FORMAT = 1
PARTIAL = "partial"
PARTIAL_DEV = "partial-dev"  # the dev report's cross-encoder scores, chunk by chunk
# Pairs a cross-encoder call scores between progress updates: large enough to fill its length-bucketed batches.
SCORE_SLICE = 2048
FILTERS = ("positives", "skip_ranks", "positive_fraction", "ce_threshold", "ce_margin", "keep")


@dataclasses.dataclass(frozen=True)
class Filters:
  """Which filters run (None / 0: off), with their thresholds."""
  skip_ranks: int = 0
  positive_fraction: float | None = None
  ce_threshold: float | None = None
  ce_margin: float | None = None
  keep: int = 0  # at most this many negatives a query (0: all that are left)

  def __post_init__(self):
    if self.skip_ranks < 0 or self.keep < 0:
      raise ValueError(f"skip_ranks and keep must be >= 0, got {self.skip_ranks} and {self.keep}")
    if self.positive_fraction is not None and not self.positive_fraction > 0:
      raise ValueError(f"positive_fraction must be > 0, got {self.positive_fraction}")
    if self.ce_margin is not None and self.ce_threshold is not None:
      raise ValueError("ce_threshold and ce_margin are two ways of one filter: give one")

  @property
  def needs_teacher(self) -> bool:
    return self.ce_threshold is not None or self.ce_margin is not None


# ------------------------------------------------------------------------------------------------ filters


def positive_mask(rows: np.ndarray, positives: np.ndarray) -> np.ndarray:
  """bool [Q, D]: candidates that are one of their query's labeled positives (-1 pads both)."""
  rows, positives = np.asarray(rows), np.asarray(positives)
  out = np.zeros(rows.shape, bool)
  # One positive column at a time: a [Q, D, P] temporary is P times the candidates (MS MARCO at depth 1,000 with
  # one query of seven positives: 3.5 GB).
  for j in range(positives.shape[1]):
    column = positives[:, j:j + 1]
    out |= (rows == column) & (column >= 0)
  return out & (rows >= 0)


def skip_mask(alive: np.ndarray, r: int) -> np.ndarray:
  """bool [Q, D]: the first r candidates still alive in each row."""
  return alive & (np.cumsum(alive, axis=1) <= r)


def above_mask(alive: np.ndarray, scores: np.ndarray, bound: np.ndarray) -> np.ndarray:
  """bool [Q, D]: alive candidates scoring above their query's bound [Q] (no bound, NaN: none)."""
  bound = np.asarray(bound, np.float64)[:, None]
  with np.errstate(invalid="ignore"):
    return alive & ~np.isnan(bound) & (np.asarray(scores, np.float64) > bound)


def fraction_bound(positive_scores: np.ndarray, fraction: float, qids: Sequence[str] | None = None) -> np.ndarray:
  """[Q] f x each query's lowest positive score (NaN where no positive has a score); a negative score is
  refused, since f x a negative score is above it."""
  lowest = _lowest(positive_scores)
  bad = np.flatnonzero(lowest < 0)
  if len(bad):
    name = repr(qids[bad[0]]) if qids is not None else f"row {bad[0]}"
    raise ValueError(f"positive_fraction needs non-negative retriever scores; a positive of query {name} scores "
                     f"{lowest[bad[0]]:.4g} (use the cross-encoder's margin, or a retriever scoring in [0, inf))")
  return fraction * lowest


def margin_bound(positive_teacher: np.ndarray, margin: float) -> np.ndarray:
  return _lowest(positive_teacher) - margin


def _lowest(scores: np.ndarray) -> np.ndarray:
  """[Q] the lowest finite score of each row, NaN for a row with none."""
  scores = np.asarray(scores, np.float64)
  finite = np.where(np.isfinite(scores), scores, np.inf)
  lowest = finite.min(axis=1, initial=np.inf)
  return np.where(np.isinf(lowest), np.nan, lowest)


def keep_mask(alive: np.ndarray, n: int) -> np.ndarray:
  """bool [Q, D]: alive candidates past the first n of their row (what `keep n` drops)."""
  return alive & (np.cumsum(alive, axis=1) > n)


@dataclasses.dataclass
class Filtered:
  alive: np.ndarray  # bool [Q, D]: the candidates kept
  dropped: dict[str, int]  # candidates each filter dropped (in FILTERS order), of those the ones before kept
  no_bound: dict[str, int]  # queries a positive-relative filter could not judge (no positive score)


def apply(rows: np.ndarray, scores: np.ndarray, positives: np.ndarray, filters: Filters, *,
          positive_scores: np.ndarray | None = None, teacher: np.ndarray | None = None,
          positive_teacher: np.ndarray | None = None, qids: Sequence[str] | None = None) -> Filtered:
  """The filters in order over [Q, D] candidates; each drops only what the ones before it kept."""
  alive = np.asarray(rows) >= 0
  dropped, no_bound = {}, {}

  def drop(name: str, mask: np.ndarray) -> None:
    nonlocal alive
    dropped[name] = int(mask.sum())
    alive = alive & ~mask

  drop("positives", positive_mask(rows, positives))
  if filters.skip_ranks:
    drop("skip_ranks", skip_mask(alive, filters.skip_ranks))
  if filters.positive_fraction is not None:
    if positive_scores is None:
      raise ValueError("positive_fraction needs the positives' retriever scores")
    bound = fraction_bound(positive_scores, filters.positive_fraction, qids)
    no_bound["positive_fraction"] = int(np.isnan(bound).sum())
    drop("positive_fraction", above_mask(alive, scores, bound))
  if filters.needs_teacher and teacher is None:
    raise ValueError("a cross-encoder filter needs the cross-encoder's scores")
  if filters.ce_threshold is not None:
    drop("ce_threshold", above_mask(alive, teacher, np.full(len(alive), filters.ce_threshold)))
  if filters.ce_margin is not None:
    bound = margin_bound(positive_teacher, filters.ce_margin)
    no_bound["ce_margin"] = int(np.isnan(bound).sum())
    drop("ce_margin", above_mask(alive, teacher, bound))
  if filters.keep:
    drop("keep", keep_mask(alive, filters.keep))
  return Filtered(alive, dropped, no_bound)


def compact(alive: np.ndarray, *arrays: np.ndarray, width: int, fill=(-1,)) -> list[np.ndarray]:
  """Each array's alive entries moved to the front of its row, in order, cut or padded to `width` columns
  (with `fill`, one value an array, the last repeated)."""
  order = np.argsort(~alive, axis=1, kind="stable")
  kept = np.take_along_axis(alive, order, axis=1)[:, :width]
  out = []
  for i, array in enumerate(arrays):
    pad = fill[min(i, len(fill) - 1)]
    moved = np.take_along_axis(np.asarray(array), order, axis=1)[:, :width]
    full = np.full((len(alive), width), pad, dtype=np.asarray(array).dtype)
    full[:, :moved.shape[1]] = np.where(kept, moved, pad)
    out.append(full)
  return out


# ------------------------------------------------------------------------------------------------ dev report

POSITIVE_FRACTIONS = (0.8, 0.9, 0.95, 0.98, 1.0)
SKIP_RANKS = (0, 1, 3, 10, 30)
CE_MARGINS = (0.0, 0.5, 1.0, 2.0, 4.0)
CE_QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)  # of the dev positives' cross-encoder scores: ce_threshold's grid


def _rates(alive_before: np.ndarray, dropped: np.ndarray, hidden: np.ndarray) -> dict:
  """What dropping `dropped` of the candidates `alive_before` does, when `hidden` marks the labeled positives:
  the share dropped, and the share of what is left that are labeled positives (the false-negative rate)."""
  total = int(alive_before.sum())
  kept = alive_before & ~dropped
  positives = int((alive_before & hidden).sum())
  caught = int((dropped & hidden).sum())
  return {"dropped": round(float(dropped.sum()) / max(total, 1), 4),
          "false_negative_rate": round(float((kept & hidden).sum()) / max(int(kept.sum()), 1), 4),
          "positives_dropped": round(caught / max(positives, 1), 4),
          # F1 of the filter as a detector of the hidden positives: what `choose_on_dev` maximizes.
          "f1": round(2 * caught / max(int(dropped.sum()) + positives, 1), 4)}


CHOOSABLE = ("skip_ranks", "positive_fraction", "ce_threshold", "ce_margin")


def choose_on_dev(dev: dict, name: str) -> float:
  """The value of filter `name` that the dev report (`dev_report`) prefers: the highest F1 of "dropped" as a
  detector of the dev queries' hidden labeled positives, which weighs the false negatives a threshold removes
  against the real negatives it throws away; among equal F1s the value that drops least. A value of
  `dev_report`'s grid, so it was measured on dev and never on test."""
  grid = {value: r for value, r in (dev.get(name) or {}).items() if value != "queries"}
  if not grid:
    raise ValueError(f"choosing {name} on dev: the dev report has no {name} grid (a cross-encoder filter needs "
                     "--cross-encoder; a relative one needs dev queries with two positives or more)")
  best = max(grid, key=lambda value: (grid[value]["f1"], -grid[value]["dropped"]))
  return float(best)


def dev_report(rows: np.ndarray, scores: np.ndarray, positives: np.ndarray, filters: Filters, *,
               positive_scores: np.ndarray | None = None, teacher: np.ndarray | None = None,
               positive_teacher: np.ndarray | None = None) -> dict:
  """Each filter alone, at each threshold of its grid and the chosen one, on dev queries whose labeled
  positives are left among the candidates: what it drops and the false-negative rate it leaves.

  Filters that need no positive's score judge every dev query, with all its positives hidden among the
  candidates. Those relative to a positive (positive_fraction, ce_margin) judge the queries with two or more
  positives: the first (by corpus row) is the known positive, the others are hidden; `queries` says how many."""
  rows = np.asarray(rows)
  alive = rows >= 0
  hidden = positive_mask(rows, positives)
  out = {"queries": int(len(rows)), "candidates": int(alive.sum()),
         "positives_among_candidates": int(hidden.sum()),
         "unfiltered": _rates(alive, np.zeros_like(alive), hidden)}
  grid = {"skip_ranks": sorted(set(SKIP_RANKS) | {filters.skip_ranks})}
  out["skip_ranks"] = {str(r): _rates(alive, skip_mask(alive, r), hidden) for r in grid["skip_ranks"]}
  if teacher is not None:
    pos_t = np.asarray(positive_teacher, np.float64)
    finite = pos_t[np.isfinite(pos_t)]
    # Rounded before they are measured, so a value read back from the report's keys is the one measured.
    values = [float(f"{np.quantile(finite, q):.4g}") for q in CE_QUANTILES] if len(finite) else []
    if filters.ce_threshold is not None:
      values.append(filters.ce_threshold)
    out["ce_threshold"] = {f"{t:.4g}": _rates(alive, above_mask(alive, teacher, np.full(len(rows), t)), hidden)
                           for t in sorted(set(values))}
  # The relative filters: one known positive (the lowest row), the rest hidden.
  known = np.sort(np.where(positives >= 0, positives, np.iinfo(np.int32).max), axis=1)
  several = (known[:, 1:2] < np.iinfo(np.int32).max).ravel() if known.shape[1] > 1 else np.zeros(len(rows), bool)
  if several.any():
    first = known[several, :1]
    rel_hidden = hidden[several] & (rows[several] != first)
    rel_alive = alive[several] & (rows[several] != first)
    is_first = np.asarray(positives)[several] == first
    if positive_scores is not None and not (np.nan_to_num(np.asarray(positive_scores)[several]) < 0).any():
      first_score = np.where(is_first, np.asarray(positive_scores, np.float64)[several], np.nan)
      out["positive_fraction"] = {"queries": int(several.sum())}
      for f in sorted(set(POSITIVE_FRACTIONS) | ({filters.positive_fraction} - {None})):
        bound = fraction_bound(first_score, f)
        out["positive_fraction"][f"{f:g}"] = _rates(rel_alive, above_mask(rel_alive, scores[several], bound),
                                                    rel_hidden)
    if teacher is not None:
      first_t = np.where(is_first, np.asarray(positive_teacher, np.float64)[several], np.nan)
      out["ce_margin"] = {"queries": int(several.sum())}
      for m in sorted(set(CE_MARGINS) | ({filters.ce_margin} - {None})):
        out["ce_margin"][f"{m:g}"] = _rates(rel_alive, above_mask(rel_alive, teacher[several],
                                                                   margin_bound(first_t, m)), rel_hidden)
  return out


# ------------------------------------------------------------------------------------------------ scores


def teacher_scores(score: Callable[[Sequence[tuple[str, str]]], np.ndarray], corpus, query_texts: Sequence[str],
                   rows: np.ndarray, alive: np.ndarray | None = None, bar=None) -> np.ndarray:
  """float32 [Q, D] the cross-encoder's score of each (query, candidate) (NaN where rows is -1 or not alive),
  every distinct document read once. `bar` (a tqdm), if given, advances by the pairs scored, SCORE_SLICE at a
  time: a cross-encoder on a CPU scores tens of pairs a second, so a chunk of queries is minutes to hours."""
  rows = np.asarray(rows)
  out = np.full(rows.shape, np.nan, np.float32)
  qi, di = np.nonzero(scored_mask(rows, alive))
  if not len(qi):
    return out
  unique, inverse = np.unique(rows[qi, di], return_inverse=True)
  texts = corpus.texts(unique.tolist())  # a prepared corpus: read from its file, as the encoders read them
  pairs = [(query_texts[q], texts[j]) for q, j in zip(qi.tolist(), inverse.tolist())]
  got = np.empty((len(pairs),), np.float32)
  for lo in range(0, len(pairs), SCORE_SLICE):
    got[lo:lo + SCORE_SLICE] = score(pairs[lo:lo + SCORE_SLICE])
    if bar is not None:
      bar.update(len(pairs[lo:lo + SCORE_SLICE]))
  out[qi, di] = got
  return out


def scored_mask(rows: np.ndarray, alive: np.ndarray | None = None) -> np.ndarray:
  """The (query, candidate) cells `teacher_scores` scores: a row, and alive where `alive` is given."""
  rows = np.asarray(rows)
  return (rows >= 0) if alive is None else (np.asarray(alive) & (rows >= 0))


def bm25_scores(index, query_texts: Sequence[str], rows: np.ndarray) -> np.ndarray:
  """float32 [Q, P] BM25 score of each query with each of its rows (-1: NaN), from `jdr.retrieval.bm25`'s index: the
  same sum `jdr.retrieval.bm25.search` ranks by."""
  rows = np.asarray(rows)
  terms, starts = index.query_terms(query_texts)
  out = np.where(rows >= 0, 0.0, np.nan)
  for q in range(len(rows)):
    mine = rows[q]
    if not (mine >= 0).any():
      continue
    for t in terms[starts[q]:starts[q + 1]].tolist():
      lo, hi = int(index.indptr[t]), int(index.indptr[t + 1])
      docs = index.indices[lo:hi]
      at = np.searchsorted(docs, mine)
      hit = (at < len(docs)) & (mine >= 0)
      hit[hit] = docs[at[hit]] == mine[hit]
      out[q, hit] += index.data[lo:hi][at[hit]]
  return out.astype(np.float32)


def dot_scores(query_emb: np.ndarray, doc_emb, rows: np.ndarray) -> np.ndarray:
  """float32 [Q, P] inner product of each query's vector with its rows' vectors (-1: NaN)."""
  rows = np.asarray(rows)
  out = np.full(rows.shape, np.nan, np.float32)
  qi, pi = np.nonzero(rows >= 0)
  if len(qi):
    wanted = rows[qi, pi]
    unique, inverse = np.unique(wanted, return_inverse=True)
    vectors = np.asarray(doc_emb[unique], np.float32)  # a memmap or the shards' ShardedRows: only these rows read
    out[qi, pi] = np.einsum("nd,nd->n", np.asarray(query_emb, np.float32)[qi], vectors[inverse])
  return out


def run_scores(cand_rows: np.ndarray, cand_scores: np.ndarray, rows: np.ndarray) -> np.ndarray:
  """float32 [Q, P] each row's score in its query's candidates (NaN where the run does not rank it)."""
  rows, cand_rows = np.asarray(rows), np.asarray(cand_rows)
  cand_scores = np.asarray(cand_scores, np.float32)
  out = np.full(rows.shape, np.nan, np.float32)
  for j in range(rows.shape[1]):  # a column at a time, as positive_mask
    match = (cand_rows == rows[:, j:j + 1]) & (rows[:, j:j + 1] >= 0)
    at = match.argmax(axis=1)
    out[:, j] = np.where(match.any(axis=1), cand_scores[np.arange(len(rows)), at], np.nan)
  return out


# ------------------------------------------------------------------------------------------------ the directory


def write(out: pathlib.Path, qids: Sequence[str], rows: np.ndarray, scores: np.ndarray, positives: np.ndarray,
          meta: dict, *, teacher: np.ndarray | None = None, positive_teacher: np.ndarray | None = None) -> None:
  """The finished directory (see the module docstring); meta.json last, marked complete."""
  out.mkdir(parents=True, exist_ok=True)
  # A directory written over (`--from X --out X`, or mined again) reads as unfinished until its new meta.json
  # lands: a kill between its arrays must not leave old and new arrays marked complete.
  atomic.write_text(out / "meta.json", json.dumps({"format": FORMAT, "complete": False}))
  atomic.write_text(out / "qids.txt", "".join(q + "\n" for q in qids))
  arrays = {"rows": rows.astype(np.int32), "scores": scores.astype(np.float32),
            "positives": positives.astype(np.int32)}
  if teacher is not None:
    arrays["teacher"] = teacher.astype(np.float32)
    arrays["positive_teacher"] = positive_teacher.astype(np.float32)
  for name, array in arrays.items():
    atomic.write_atomic(out / f"{name}.npy", lambda f, a=array: np.save(f, a))
  atomic.write_text(out / "meta.json", json.dumps({**meta, "format": FORMAT, "complete": True,
                                                   "queries": len(qids), "width": int(rows.shape[1]),
                                                   "teacher": teacher is not None}, indent=1))


@dataclasses.dataclass
class Mined:
  """A finished mining directory, its arrays memory-mapped."""
  qids: list[str]
  rows: np.ndarray
  scores: np.ndarray
  positives: np.ndarray
  teacher: np.ndarray | None
  positive_teacher: np.ndarray | None
  meta: dict


def read(directory: str | pathlib.Path) -> Mined:
  directory = pathlib.Path(directory)
  meta_path = directory / "meta.json"
  if not meta_path.exists():
    raise FileNotFoundError(f"{meta_path}: no meta.json; is {directory} the --out of python -m jdr.mine?")
  meta = json.loads(meta_path.read_text())
  if not meta.get("complete"):
    raise ValueError(f"{directory}: the mining is unfinished; run python -m jdr.mine again to resume it")
  if meta.get("format") != FORMAT:
    raise ValueError(f"{directory}: mined by a jdr of format {meta.get('format')}, this one reads {FORMAT}")
  load = lambda name: np.load(directory / f"{name}.npy", mmap_mode="r")
  qids = (directory / "qids.txt").read_text().splitlines()
  names = ["rows", "scores", "positives"] + (["teacher", "positive_teacher"] if meta.get("teacher") else [])
  arrays = {name: load(name) for name in names}
  for name, array in arrays.items():
    like = {"scores": "rows", "teacher": "rows", "positive_teacher": "positives"}.get(name, name)
    if array.ndim != 2 or array.shape[0] != len(qids) or array.shape != arrays[like].shape:
      raise ValueError(f"{directory}: {name}.npy has shape {array.shape}, against {len(qids)} queries in qids.txt "
                       f"and {like}.npy's {arrays[like].shape}: the directory is corrupt")
  return Mined(qids, arrays["rows"], arrays["scores"], arrays["positives"], arrays.get("teacher"),
               arrays.get("positive_teacher"), meta)


def check_corpus(mined: Mined, corpus, where) -> None:
  """Refuses a mining of another corpus: its rows would name other documents."""
  source = corpus.manifest.get("source") if isinstance(corpus, prepared.PreparedCorpus) else None
  recorded = mined.meta.get("corpus") or {}
  same = lambda a, b: all(a.get(k) == b.get(k) for k in ("size", "ends_sha1"))  # a moved copy is the same
  if mined.meta.get("num_docs") != len(corpus) or (source and recorded and not same(source, recorded)):
    raise ValueError(f"{where}: mined from a corpus of {mined.meta.get('num_docs')} documents "
                     f"({(mined.meta.get('corpus') or {}).get('path', '?')}), not this one ({len(corpus)}); its rows "
                     "would name other documents: mine it again for this corpus")


class Chunks:
  """A resumable pass over query chunks: each finished chunk's arrays saved under partial/, with the plan that
  made them (a changed plan starts over)."""

  def __init__(self, out: pathlib.Path, plan: dict, num_queries: int, chunk: int, folder: str = PARTIAL):
    self.folder, self.num_queries, self.chunk = out / folder, num_queries, chunk
    plan = json.dumps({**plan, "queries": num_queries, "chunk": chunk}, sort_keys=True)
    if (self.folder / "plan.json").exists() and (self.folder / "plan.json").read_text() != plan:
      print(f"jdr.mine: {self.folder} was made with other settings; starting over", file=sys.stderr)
      shutil.rmtree(self.folder)
    self.folder.mkdir(parents=True, exist_ok=True)
    atomic.write_text(self.folder / "plan.json", plan)

  def bounds(self) -> list[tuple[int, int]]:
    return [(lo, min(self.num_queries, lo + self.chunk)) for lo in range(0, self.num_queries, self.chunk)]

  def path(self, k: int) -> pathlib.Path:
    return self.folder / f"chunk-{k:05d}.npz"

  def done(self, k: int) -> bool:
    return self.path(k).exists()

  def save(self, k: int, **arrays: np.ndarray) -> None:
    atomic.write_atomic(self.path(k), lambda f: np.savez(f, **arrays))

  def load(self, k: int) -> dict[str, np.ndarray]:
    with np.load(self.path(k)) as z:
      return {name: z[name] for name in z.files}

  def remove(self) -> None:
    shutil.rmtree(self.folder, ignore_errors=True)
