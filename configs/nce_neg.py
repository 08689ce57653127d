"""NCE negatives ("NCE Neg", ANCE Table 1): for each query only the highest-scored negative in the batch is
kept (noise-contrastive estimation with the hardest in-batch noise).

  python -m jdr.train --config configs/nce_neg.py:runlocal --workdir runs/nce_neg \
      --config.data.dataset=../shared/data/scifact
"""

import base
import inbatch

ARGS = dict(runlocal=False)


def get_config(arg=None):
  c = inbatch.recipe(base.parse_arg(arg, **ARGS))
  c.negatives.hardest_in_batch = True
  return c
