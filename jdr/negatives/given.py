"""Negatives a dataset gives with it: MS MARCO's training triples (`negatives.source=triples`).

`triples.train.small.tsv` pairs each training query with BM25-retrieved negatives (its official baseline's);
jdr.data.triples maps the file's texts to rows once. Each training query's pool is the distinct negatives of its
triples; a batch row's negatives are drawn uniformly from it without replacement, its positives excluded (all the
qrels judge relevant, not only the triple's), and topped up with random corpus documents when the pool runs short
or the query has no triples, counted in `stats` so a pool that is mostly missing shows. Training pairs still come
from the qrels, as with every other source. Its settings are the group `negatives.triples` (`check`, `sampler`).
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from jdr.data import msmarco
from jdr.data import prepared
from jdr.data import triples as triples_lib
from jdr.negatives import sampled
from jdr.runtime import config_files
from jdr.runtime import paths

# What the file holds, for the refusal when it is missing.
TRIPLES = "MS MARCO's triples.train.small.tsv: query, positive and negative passage texts a line"


class TriplesNegatives:
  """Uniform negatives from each query's triples (a `sampled.NegativeSource`)."""

  def __init__(self, mapped: triples_lib.Triples, corpus: Mapping, qrels: Mapping[str, Mapping[str, int]]):
    self.mapped, self.qrels = mapped, qrels
    self._index = {q: i for i, q in enumerate(mapped.qids)}
    if isinstance(corpus, prepared.PreparedCorpus):
      self._ids = corpus.id_sequence()  # decoded when a row is asked: no list of 8.8M strings
    else:
      self._ids = list(corpus)
    self._fallback = None  # made when first needed: random documents for pools that run short
    self.sampled_negatives = self.fallback_negatives = self.fallback_queries = 0

  def has_triples(self, qid: str) -> bool:
    i = self._index.get(qid)
    return i is not None and len(self.mapped.pool(i)) > 0

  def pool(self, qid: str) -> list[str]:
    """The query's candidate doc ids (its triples' distinct negatives); [] without triples."""
    i = self._index.get(qid)
    return [] if i is None else [self._ids[int(r)] for r in self.mapped.pool(i)]

  def sample(self, query_ids: Sequence[str], positives: Sequence[str], rng: np.random.Generator, n: int, *,
             exclude: Sequence[Collection[str]] | None = None) -> list[list[str]]:
    if len(query_ids) != len(positives) or (exclude is not None and len(exclude) != len(query_ids)) or n < 0:
      raise ValueError(f"{len(query_ids)} queries, {len(positives)} positives, n={n}: one positive a query, n >= 0")
    out = []
    for b, (qid, positive) in enumerate(zip(query_ids, positives)):
      excluded = set(sampled.positive_ids(self.qrels, qid)) | {positive} | set(exclude[b] if exclude else ())
      i = self._index.get(qid)
      pool = self.mapped.pool(i) if i is not None else np.zeros(0, np.int32)
      chosen = []
      # A random order of the pool, read until n are kept: as uniform as drawing from the pool with the
      # positives removed, and only the ids looked at are decoded.
      for j in rng.permutation(len(pool)).tolist() if n else ():
        doc = self._ids[int(pool[j])]
        if doc not in excluded:
          chosen.append(doc)
          if len(chosen) == n:
            break
      self.sampled_negatives += len(chosen)
      if len(chosen) < n:
        self.fallback_negatives += n - len(chosen)
        self.fallback_queries += 1
        if self._fallback is None:
          self._fallback = sampled.RandomNegatives(self._ids, self.qrels)
        chosen += self._fallback.sample_one(qid, excluded | set(chosen), rng, n - len(chosen))
      out.append(chosen)
    return out

  def stats(self) -> dict[str, int]:
    return {"sampled_negatives": self.sampled_negatives, "fallback_negatives": self.fallback_negatives,
            "fallback_queries": self.fallback_queries}


def check(triples, run, chosen: bool) -> None:
  """Refuses a triples file another source would ignore, and a missing one, before anything is read (`run`: the
  run's `jdr.negatives.sources.Run`, whose dataset holds the default file)."""
  if triples.file and not chosen:
    raise config_files.ConfigError(f"negatives.triples.file={triples.file} is read by negatives.source=triples only")
  if chosen and run.data_kind == "pairs":
    path = triples.file or ("" if run.dataset == "builtin" else str(paths.as_path(run.dataset) / msmarco.TRIPLES))
    if not path or not paths.as_path(path).is_file():
      raise config_files.ConfigError(config_files.not_found("negatives.triples.file", path, TRIPLES, kind="file"))


def sampler(triples, data, cache_dir) -> TriplesNegatives:
  """negatives.source=triples: (its group, data, cache dir) -> the sampler, mapping the file first if no run has
  (beside the prepared corpus, else in `cache_dir`)."""
  if data.files is None:
    raise ValueError("negatives.source=triples reads a triples file of a dataset directory (data.dataset)")
  path = triples.file or str(data.files.directory / msmarco.TRIPLES)
  mapped = triples_lib.load(path, data.queries, data.train_qrels, data.corpus, cache_dir=cache_dir,
                            skip_invalid=triples.skip_invalid)
  source = TriplesNegatives(mapped, data.corpus, data.train_qrels)
  train_qids = {q for q, docs in data.train_qrels.items() if any(r > 0 for r in docs.values())}
  without = sum(1 for q in train_qids if not source.has_triples(q))
  print(f"jdr: negatives from {len(mapped)} triples of {path}; {without} of {len(train_qids)} training queries have "
        "none (their negatives are random, counted in negatives stats)", file=sys.stderr)
  return source
