"""Which (query, positive, negative) triples a refresh generation trains on, and where each batch row reads them.

ANCE's data generation (`run_ann_data_gen.py`) writes one line per query and generation: the query, one positive
and `negative_sample` negatives, and its trainer (`run_ann.py`) reads the lines' triples in order. jdr's
batches (`pairs.Batches`, ANCE's triples) take a generation's lines from `lines` and each batch row's
(line, triple) from `reader_rows` or, with the triples shuffled, a permutation the batches keep. A line is a
row of `pairs.training_pairs`: a query and the positive it trains with. The settings, `TriplePlan`, come with the
negative source (`negatives.ance`: `triples_over`, `refresh_chunks`, `triple_readers`):

  over="queries"  each query of the generation's chunk once, with the last positive its qrels list (ANCE's
                  loader keeps one positive a query, each qrels line overwriting the one before); its negatives
                  skip only that positive, so another positive of the query can be one, as in ANCE
  over="pairs"    every (query, positive) pair of the chunk, negatives skipping all of the query's positives
  chunks=C        generation g covers chunk g mod C of the training queries, in their fixed order: n // C
                  queries each, the last chunk the rest (ANCE's `ann_chunk_factor`, 5: 100k of MS MARCO's ~500k
                  queries a refresh)
  readers=R       the lines, shuffled once a generation and cut to a multiple of R, are dealt in turn to R
                  readers (ANCE's GPUs: line i to rank i mod R); each reads its lines' triples in order, again
                  from its first when it reaches its last, and a batch takes the next batch_size / R triples of
                  each (ANCE: 4 GPUs x 8 triples x 2 accumulated = 64)
  readers=0       a generation's triples shuffled across queries, a new order each pass (jdr's earlier batches)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

TRIPLES_OVER = ("queries", "pairs")


@dataclasses.dataclass(frozen=True)
class TriplePlan:
  """How a refresh generation becomes triples; the defaults are every pair, each refresh, shuffled."""
  over: str = "pairs"
  chunks: int = 1
  readers: int = 0

  def __post_init__(self):
    if self.over not in TRIPLES_OVER:
      raise ValueError(f"negatives.ance.triples_over must be one of {', '.join(TRIPLES_OVER)}, got {self.over!r}")
    if self.chunks < 1:
      raise ValueError(f"negatives.ance.refresh_chunks must be >= 1, got {self.chunks}")
    if self.readers < 0:
      raise ValueError(f"negatives.ance.triple_readers must be >= 0, got {self.readers}")


def chunk_bounds(num_queries: int, generation: int, chunks: int) -> tuple[int, int]:
  """[lo, hi) of the training queries generation `generation` covers: ANCE's chunk `generation mod chunks`."""
  at = generation % chunks
  size = num_queries // chunks
  return at * size, num_queries if at == chunks - 1 else (at + 1) * size


def lines(pairs: Sequence[tuple[str, str]], qrels: Mapping[str, Mapping[str, int]], plan: TriplePlan,
          generation: int, seed: int) -> np.ndarray:
  """int64 rows of `pairs` (sorted (query, positive) pairs, so a query's rows are consecutive) that generation
  `generation` trains on, in the order the readers deal them (with readers=0 the order is the pairs' own)."""
  starts = [0] + [i for i in range(1, len(pairs)) if pairs[i][0] != pairs[i - 1][0]]
  ends = starts[1:] + [len(pairs)]
  lo, hi = chunk_bounds(len(starts), generation, plan.chunks)
  if plan.over == "pairs":
    out = np.arange(starts[lo], ends[hi - 1], dtype=np.int64) if hi > lo else np.zeros(0, np.int64)
  else:
    out = np.array([_last_listed(pairs, qrels, s, e) for s, e in zip(starts[lo:hi], ends[lo:hi])], np.int64)
  if plan.readers:
    out = out[np.random.default_rng([seed, generation, 4]).permutation(len(out))]
    out = out[:len(out) // plan.readers * plan.readers]  # ANCE keeps a multiple of its GPUs' lines
  if not len(out):
    raise ValueError(f"refresh generation {generation} has no lines: a chunk of {hi - lo} training queries "
                     f"(negatives.ance.refresh_chunks={plan.chunks}) for negatives.ance.triple_readers={plan.readers}")
  return out


def _last_listed(pairs, qrels, start: int, end: int) -> int:
  """The row of the query's positive that its qrels list last (the rows start..end-1 are its pairs)."""
  q = pairs[start][0]
  last = [d for d, rel in qrels[q].items() if rel > 0][-1]
  return next(i for i in range(start, end) if pairs[i][1] == last)


def reader_rows(offset: int, batch_size: int, num_lines: int, per_line: int, readers: int
                ) -> tuple[np.ndarray, np.ndarray]:
  """(line index [B], triple of that line [B]) of the batch `offset` batches into a generation: reader r
  (rows r*m .. r*m + m - 1, m = B / readers) holds lines r, r + readers, ... and reads their triples in order."""
  per = batch_size // readers
  lines_each = num_lines // readers
  reader, j = np.divmod(np.arange(batch_size), per)
  position = (offset * per + j) % (lines_each * per_line)
  line, slot = np.divmod(position, per_line)
  return reader + readers * line, slot
