"""Two-tower pretraining on WLP pairs alone (Chang et al., ICLR 2020).

Wiki Link Prediction: query = a random sentence of article B's lead; document = a passage of an article A
linking to B (one that mentions B when there is one).

Everything but the task is configs/pretrain_ict_bfs_wlp.py's (its table gives the data, model, towers, loss,
optimizer, batch, lengths and steps, full and runlocal, with their sources).

| setting | value (full) | value (runlocal) | source | departs / why |
|---|---|---|---|---|
| task | WLP alone (`data.pretrain_task=wlp`) | the same | Sec. 3 (WLP); Tables 3-5 (one task a row) | |

  python -m jdr.train --config configs/pretrain_wlp.py:runlocal --workdir runs/pretrain_wlp
  python -m jdr.train --config configs/pretrain_wlp.py --workdir runs/wikipedia-wlp
"""

import pretrain_ict_bfs_wlp

ARGS = pretrain_ict_bfs_wlp.ARGS


def get_config(arg=None):
  return pretrain_ict_bfs_wlp.pretrain_config("wlp", arg)
