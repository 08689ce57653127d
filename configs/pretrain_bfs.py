"""Two-tower pretraining on BFS pairs alone (Chang et al., ICLR 2020).

Body First Selection: query = a random sentence of an article's lead section; document = a random passage of the
same article's body.

Everything but the task is configs/pretrain_ict_bfs_wlp.py's (its table gives the data, model, towers, loss,
optimizer, batch, lengths and steps, full and runlocal, with their sources).

| setting | value (full) | value (runlocal) | source | departs / why |
|---|---|---|---|---|
| task | BFS alone (`data.pretrain_task=bfs`) | the same | Sec. 3 (BFS); Tables 3-5 (one task a row) | |

  python -m jdr.train --config configs/pretrain_bfs.py:runlocal --workdir runs/pretrain_bfs
  python -m jdr.train --config configs/pretrain_bfs.py --workdir runs/wikipedia-bfs
"""

import pretrain_ict_bfs_wlp

ARGS = pretrain_ict_bfs_wlp.ARGS


def get_config(arg=None):
  return pretrain_ict_bfs_wlp.pretrain_config("bfs", arg)
