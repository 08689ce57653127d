"""Random negatives ("Rand Neg", ANCE Table 1 / LTRe / STAR baselines): one uniformly sampled corpus document
per query, scored against the batch's other documents as well.

  python -m jdr.train --config configs/rand_neg.py:runlocal --workdir runs/rand_neg \
      --config.data.dataset=../shared/data/scifact
"""

import inbatch


def get_config(arg=None):
  c = inbatch.get_config(arg)
  c.negatives.source = "random"
  c.negatives.per_query = 1
  return c
