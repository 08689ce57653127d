"""Where a training batch's negatives come from (the "negatives" column of docs/architecture.md's recipe table).

  sources.py         the one entry point: `negatives.source` -> the built negatives the trainer calls
  sampled.py         host-side samplers of static pools: random, BM25, a TREC run, mixtures (the candidate mask
                     is the batch contract's: jdr/data/batch.py)
  given.py           the negatives of a dataset's own triples file (MS MARCO's triples.train.small.tsv)
  training_files.py  mined negatives written by other toolkits (Tevatron's JSONL, sentence-transformers' rows)
  retrieved.py       candidates retrieved from a fixed corpus index: ADORE / LTRe at every step, or once (static)
  refresh.py         ANCE's asynchronously refreshed pools (a background re-encode of the corpus every m steps)
  mining.py          the false-negative filters of mined lists and their dev-split choice
  mined_lists.py     mining every training query's list and writing the directory `python -m jdr.mine` makes

Every source has the hook `prepare(step, state)`, called by the trainer between steps (a no-op for the
static ones), so a method that does work between steps needs no change to the trainer's loop.
"""

from jdr.data.batch import candidate_mask
from jdr.negatives.sampled import (BM25Negatives, MixedNegatives, NegativeSource, RandomNegatives,
                                   StaticNegatives, positive_ids)

__all__ = ["BM25Negatives", "MixedNegatives", "NegativeSource", "RandomNegatives", "StaticNegatives",
           "candidate_mask", "positive_ids"]
