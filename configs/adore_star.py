"""ADORE+STAR (Zhan et al., SIGIR 2021, Table 3's best row): ADORE's query-tower training over the fixed
index of a STAR-trained document tower. Train STAR first, then start ADORE from its workdir:

  python -m jdr.train --config configs/star.py:runlocal --workdir runs/star \
      --config.data.dataset=../shared/data/scifact --config.eval.doc_max_length=256
  python -m jdr.train --config configs/adore_star.py:runlocal --workdir runs/adore_star \
      --config.data.dataset=../shared/data/scifact --config.model.init_from=runs/star

The STAR model's shared tower is split: its copy on the document side is frozen and indexes the corpus,
its copy on the query side trains. Every argument of configs/adore.py applies; `runlocal` trains at 1e-4.
In `python -m jdr.reproduce scifact` the row's budget is shared along the chain (52 steps of BM25 negatives at
1e-4, 52 of STAR at 5e-5, then 104 of this recipe, `--config.num_train_steps=104`), and a dev split of the
training queries chose 1e-4 for the last stage: dev nDCG@10 at 2e-5 / 5e-5 / 1e-4, seed 0, 0.7644 / 0.7897 /
0.8026.
"""

import adore
import base

ARGS = adore.ARGS


def get_config(arg=None):
  c = adore.recipe(base.parse_arg(arg, **ARGS))
  c.model.init_from = "runs/star"  # a STAR workdir or export; override on the command line
  return c
