"""Random negatives ("Rand Neg", ANCE Table 1 / LTRe / STAR baselines): one uniformly sampled corpus document
per query, scored against the batch's other documents as well.

  python -m jdr.train --config configs/rand_neg.py:runlocal --workdir runs/rand_neg \
      --config.data.dataset=../shared/data/scifact
"""

import base
import inbatch

ARGS = dict(runlocal=False)


def get_config(arg=None):
  c = inbatch.recipe(base.parse_arg(arg, **ARGS))
  c.negatives.source = "random"
  c.negatives.per_query = 1
  return c
