"""Two-tower pretraining on BFS pairs alone (Chang et al., ICLR 2020).

Body First Selection: query = a random sentence of an article's lead section; document = a random
passage of the same article's body.

The setup (paper and `runlocal`: a 4x256 BERT from random weights on the shared Wikispeedia articles, batch
32, 600 steps, about 7.5 minutes on 2 CPU cores) is configs/pretrain_ict_bfs_wlp.py's; only the
task differs.

  python -m jdr.train --config configs/pretrain_bfs.py:runlocal --workdir runs/pretrain_bfs
"""

import pretrain_ict_bfs_wlp

ARGS = pretrain_ict_bfs_wlp.ARGS

def get_config(arg=None):
  return pretrain_ict_bfs_wlp.pretrain_config("bfs", arg)
