"""Two-tower pretraining on ICT pairs alone (Chang et al., ICLR 2020).

Inverse Cloze Task: query = a random sentence of a passage; document = the article's title and the rest of the
passage (the sentence is kept with probability data.keep_sentence_prob = 0.1, as Lee et al. 2019).

Everything but the task is configs/pretrain_ict_bfs_wlp.py's (its table gives the data, model, towers, loss,
optimizer, batch, lengths and steps, full and runlocal, with their sources).

| setting | value (full) | value (runlocal) | source | departs / why |
|---|---|---|---|---|
| task | ICT alone (`data.pretrain_task=ict`) | the same | Sec. 3 (ICT); Lee et al. 2019 (0.1); Tables 3-5 (one task a row) | |

  python -m jdr.train --config configs/pretrain_ict.py:runlocal --workdir runs/pretrain_ict
  python -m jdr.train --config configs/pretrain_ict.py --workdir runs/wikipedia-ict
"""

import pretrain_ict_bfs_wlp

ARGS = pretrain_ict_bfs_wlp.ARGS


def get_config(arg=None):
  return pretrain_ict_bfs_wlp.pretrain_config("ict", arg)
