"""LTRe, Learning To Retrieve (Zhan et al. 2020, Algorithm 1): the query tower trained against the top-n of a
full retrieval at every step over a fixed document index; RankNet (LambdaRank via `:lambdarank`).

Paper: AdamW 5e-6, betas (0.9, 0.999), weight decay 0.01, batch 32, warm-up 2,000 steps then linear decay,
dropout 0.1, top-200. It is ADORE's recipe with RankNet as the default loss and LTRe's warm-up; every
argument of configs/adore.py (runlocal, static, jax, pq, ndcg) applies.

  python -m jdr.train --config configs/ltre.py:runlocal --workdir runs/ltre \
      --config.data.dataset=../shared/data/scifact
"""

import adore
import base

ARGS = dict(adore.ARGS, lambdarank=False)


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  a.ranknet = a.ranknet or not a.lambdarank  # RankNet unless LambdaRank is asked for
  c = adore.recipe(a)
  if not a.runlocal:
    c.optimizer.warmup_steps = 2000
  return c
