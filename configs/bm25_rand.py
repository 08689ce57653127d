"""BM25 + random negatives, 1:1 (DPR, Karpukhin et al. 2020; ANCE's "DPR (BM25 + Rand Neg)").

  python -m jdr.train --config configs/bm25_rand.py:runlocal --workdir runs/bm25_rand \
      --config.data.dataset=../shared/data/scifact
"""

import base
import inbatch

ARGS = dict(runlocal=False)


def get_config(arg=None):
  c = inbatch.recipe(base.parse_arg(arg, **ARGS))
  c.negatives.source = "bm25_random"
  c.negatives.per_query = 2  # one BM25, one random
  return c
