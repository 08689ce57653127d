"""Two-tower pretraining on WLP pairs alone (Chang et al., ICLR 2020).

Wiki Link Prediction: query = a random sentence of article B's lead; document = a passage of an
article A linking to B (one that mentions B when there is one).

The setup (paper and `runlocal`: a 4x256 BERT from random weights on the shared Wikispeedia articles, batch
32, 600 steps, about 7.5 minutes on 2 CPU cores) is configs/pretrain_ict_bfs_wlp.py's; only the
task differs.

  python -m jdr.train --config configs/pretrain_wlp.py:runlocal --workdir runs/pretrain_wlp
"""

import pretrain_ict_bfs_wlp

ARGS = pretrain_ict_bfs_wlp.ARGS

def get_config(arg=None):
  return pretrain_ict_bfs_wlp.pretrain_config("wlp", arg)
