"""BM25 + random negatives, 1:1 (DPR, Karpukhin et al. 2020; ANCE's "DPR (BM25 + Rand Neg)").

Everything else is configs/inbatch.py's (its table gives the model, data, towers, optimizer, batch, lengths and
steps, with their sources); the rows below are what this recipe changes.

| setting | value (full) | value (runlocal) | source | departs / why |
|---|---|---|---|---|
| negatives | per query one from its BM25 top 100 and one uniform corpus document, plus the batch's other documents | the same | ANCE Sec. 5 ("the 1:1 combination of BM25 and Random negatives") | |
| loss | softmax NLL, temperature 1 | softmax NLL, temperature 0.05 (configs/inbatch.py's) | ANCE Appendix A.1 ("BERT-Siamese, NLL loss, and dot product") | runlocal: cosines in [-1, 1] need the temperature |
| optimizer, batch, steps | configs/inbatch.py's (LAMB 2e-4, batch 256, 20,000 steps) | configs/inbatch.py's | STAR Sec. 7.3 (its baselines) | ANCE does not state its baselines' optimizer; the STAR baselines' is the one on record |

  python -m jdr.train --config configs/bm25_rand.py:runlocal --workdir runs/bm25_rand
  python -m jdr.train --config configs/bm25_rand.py --workdir runs/msmarco-bm25_rand
"""

import base
import inbatch

ARGS = dict(runlocal=False)


def get_config(arg=None):
  c = inbatch.recipe(base.parse_arg(arg, **ARGS))
  c.negatives.source = "bm25_random"
  c.negatives.per_query = 2  # one BM25, one random
  c.loss.name = "softmax_nll"
  return c
