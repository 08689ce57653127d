"""Where a training batch's negatives come from (the "negatives come from" column of DESIGN.md).

  sampled.py   host-side samplers of static pools: random, BM25, a TREC run, mixtures (the candidate mask
               is the batch contract's: jdr/data/batch.py)
  retrieved.py candidates retrieved from a fixed corpus index: ADORE / LTRe at every step, or once (static)
  refresh.py   ANCE's asynchronously refreshed pools (a background re-encode of the corpus every m steps)

Every source has the hook `prepare(step, state)`, called by the trainer between steps (a no-op for the
static ones), so a method that does work between steps needs no change to the trainer's loop.
"""

from jdr.data.batch import candidate_mask
from jdr.negatives.sampled import (BM25Negatives, MixedNegatives, NegativeSource, RandomNegatives,
                                   StaticNegatives, positive_ids)

__all__ = ["BM25Negatives", "MixedNegatives", "NegativeSource", "RandomNegatives", "StaticNegatives",
           "candidate_mask", "positive_ids"]
