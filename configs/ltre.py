"""LTRe, Learning To Retrieve (Zhan et al. 2020, Algorithm 1): the query tower trained against the top-n of a
full retrieval at every step over a fixed document index; RankNet (LambdaRank via `:lambdarank`).

It is configs/adore.py's recipe with LTRe's own rule for a query none of whose n retrieved documents is
relevant (the n-th is replaced by its positive) and RankNet as the loss; every setting not in the table is
ADORE's (see configs/adore.py), and every argument of configs/adore.py (runlocal, static, jax, pq, ndcg)
applies.

| setting | full | runlocal | source | where jdr departs, and why |
|---|---|---|---|---|
| no relevant in the top n | the n-th retrieved replaced by the batch positive (`negatives.retrieval.missing_positive=replace_last`) | the same | LTRe Algorithm 1, line 4 | |
| loss | RankNet, log(1 + exp(s_irrelevant - s_relevant)), mean over (relevant, irrelevant) pairs | the same | LTRe Eq. 1 | |
| `:lambdarank` | ADORE's: abs(1/p_i - 1/p_j) by list position, MRR@200 | MRR@10 | LTRe Eq. 2; the weight as DRhard adore/train.py computes it | the paper's delta M read as the authors' code reads it |
| optimizer | AdamW 5e-6, betas (0.9, 0.999), weight decay 0.01 | AdamW 1e-4 | LTRe's experimental settings | runlocal: ADORE's scaled run |
| schedule | 2,000 warm-up steps, then linear decay reaching 0 at its last step (`optimizer.schedule_steps=0`, not ADORE's 6-epoch total) | 20 warm-up steps | LTRe's experimental settings | the total of LTRe's own code is not among the sources jdr read; runlocal: scaled to its steps |
| batch, depth, dropout | 32 queries, top 200, 0.1 | the same | LTRe's experimental settings | |
| query tokens | 64 | 32 | DRhard adore/train.py (ADORE's) | not among the LTRe settings jdr cites |

  python -m jdr.train --config configs/ltre.py:runlocal --workdir runs/ltre \\
      --config.data.dataset=../shared/data/scifact
"""

import adore
import base

ARGS = dict(adore.ARGS, lambdarank=False)


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  a.ranknet = a.ranknet or not a.lambdarank  # RankNet unless LambdaRank is asked for
  c = adore.recipe(a)
  c.negatives.retrieval.missing_positive = "replace_last"
  if not a.runlocal:
    c.optimizer.warmup_steps = 2000
    c.optimizer.schedule_steps = 0  # ADORE's is DRhard's 6 epochs; LTRe's decays over its own steps
  return c
