"""ADORE+STAR (Zhan et al., SIGIR 2021, Table 3's best row): ADORE's query-tower training over the fixed
index of a STAR-trained document tower. Train STAR first, then start ADORE from its workdir:

  python -m jdr.train --config configs/star.py:runlocal --workdir runs/star \\
      --config.data.dataset=../shared/data/scifact --config.eval.doc_max_length=256
  python -m jdr.train --config configs/adore_star.py:runlocal --workdir runs/adore_star \\
      --config.data.dataset=../shared/data/scifact --config.model.init_from=runs/star

The STAR model's shared tower is split: its copy on the document side is frozen and indexes the corpus, its
copy on the query side trains. Every setting not in the table is ADORE's (configs/adore.py: the appended
positives, the position weights, MRR@200 in full, AdamW 5e-6 with 2,000 warm-up steps, 64 query tokens), and
every argument of configs/adore.py applies.

| setting | full | runlocal | source | where jdr departs, and why |
|---|---|---|---|---|
| starting model | a trained STAR model (`model.init_from`, a workdir or export) | `runs/star` from configs/star.py:runlocal | DRhard README (ADORE trained from the STAR checkpoint, its passage vectors as the index) | runlocal: jdr's own STAR run |
| data | MS MARCO passage | SciFact train | DRhard README | runlocal: offline |
| learning rate | 5e-6 | 1e-4 | DRhard adore/train.py | runlocal: the rate a dev split of the training queries chose in `python -m jdr.reproduce scifact` |
| steps | 60,000 | 208 (104 in `python -m jdr.reproduce scifact`, after 52 of BM25 negatives and 52 of STAR) | ADORE's (configs/adore.py) | runlocal: the reproduction shares one budget along the chain |
"""

import adore
import base

ARGS = adore.ARGS


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  c = adore.recipe(a)
  if a.runlocal:
    c.model.init_from, c.model.description = "runs/star", "a STAR model: the workdir of configs/star.py:runlocal"
  else:
    c.model.init_from, c.model.description = base.STAR
  return c
