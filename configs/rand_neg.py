"""Random negatives ("Rand Neg", STAR Sec. 7.2.2 / ANCE Table 1 / LTRe baselines): one uniformly sampled corpus
document per query, scored against the batch's other documents as well.

Everything else is configs/inbatch.py's (its table gives the model, data, towers, optimizer, batch, lengths and
steps, with their sources); the rows below are what this recipe changes.

| setting | value (full) | value (runlocal) | source | departs / why |
|---|---|---|---|---|
| negatives | 1 uniform corpus document a query (`negatives.source=random`), plus the batch's other documents | the same | STAR Sec. 7.2.2 ("randomly samples negatives from the entire corpus"); ANCE Sec. 5 ("random sampling in batch") | STAR's code (DRhard `randneg_train`) scores only the sampled documents, a number the paper does not give (`--per_query_hard_num`); jdr keeps the batch's documents as ANCE's reading does, and one sample a query |
| loss | RankNet, temperature 1 (configs/inbatch.py's) | softmax NLL, temperature 0.05 (configs/inbatch.py's) | STAR Sec. 7.3 ("use the RankNet loss") | runlocal: what docs/results.md's table ran |

  python -m jdr.train --config configs/rand_neg.py:runlocal --workdir runs/rand_neg
  python -m jdr.train --config configs/rand_neg.py --workdir runs/msmarco-rand_neg
"""

import base
import inbatch

ARGS = dict(runlocal=False)


def get_config(arg=None):
  c = inbatch.recipe(base.parse_arg(arg, **ARGS))
  c.negatives.source = "random"
  c.negatives.per_query = 1
  return c
