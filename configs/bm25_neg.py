"""BM25 negatives ("BM25 Neg", ANCE / Gao et al. 2020): one negative per query drawn uniformly from its BM25
top 100 (mined once with bm25s and cached in the workdir), plus the batch's other documents. `runlocal`: the
in-batch recipe's (208 steps x 32, AdamW 1e-4), whose rate `python -m jdr.reproduce scifact` also chose for this
row on dev (dev nDCG@10 0.7383 / 0.7703 / 0.7860 at 2e-5 / 5e-5 / 1e-4, seed 0).

  python -m jdr.train --config configs/bm25_neg.py:runlocal --workdir runs/bm25_neg \
      --config.data.dataset=../shared/data/scifact
"""

import base
import inbatch

ARGS = dict(runlocal=False)


def get_config(arg=None):
  c = inbatch.recipe(base.parse_arg(arg, **ARGS))
  c.negatives.source = "bm25"
  c.negatives.per_query = 1
  c.negatives.bm25_top_k = 100
  return c
