"""NCE negatives ("NCE Neg", ANCE Table 1): for each query only the highest-scored negative in the batch is
kept (noise-contrastive estimation with the hardest in-batch noise).

Everything else is configs/inbatch.py's (its table gives the model, data, towers, optimizer, batch, lengths and
steps, with their sources); the rows below are what this recipe changes.

| setting | value (full) | value (runlocal) | source | departs / why |
|---|---|---|---|---|
| negatives | the highest-scored other document of the batch, one a query | the same | ANCE Sec. 5 ("hardest negatives in batch") | |
| loss | softmax NLL, temperature 1 | softmax NLL, temperature 0.05 (configs/inbatch.py's) | ANCE Appendix A.1 ("BERT-Siamese, NLL loss, and dot product") | runlocal: cosines in [-1, 1] need the temperature |
| optimizer, batch, steps | configs/inbatch.py's (LAMB 2e-4, batch 256, 20,000 steps) | configs/inbatch.py's | STAR Sec. 7.3 (its baselines) | ANCE does not state its baselines' optimizer; the STAR baselines' is the one on record |

  python -m jdr.train --config configs/nce_neg.py:runlocal --workdir runs/nce_neg
  python -m jdr.train --config configs/nce_neg.py --workdir runs/msmarco-nce_neg
"""

import base
import inbatch

ARGS = dict(runlocal=False)


def get_config(arg=None):
  c = inbatch.recipe(base.parse_arg(arg, **ARGS))
  c.negatives.hardest_in_batch = True
  c.loss.name = "softmax_nll"
  return c
