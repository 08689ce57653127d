"""Two-tower pretraining on ICT pairs alone (Chang et al., ICLR 2020).

Inverse Cloze Task: query = a random sentence of a passage; document = the article's title and the
rest of the passage (the sentence is kept with probability data.keep_sentence_prob = 0.1, as Lee et al. 2019).

The setup (paper and `runlocal`: a 4x256 BERT from random weights on the shared Wikispeedia articles, batch
32, 600 steps, about 7.5 minutes on 2 CPU cores) is configs/pretrain_ict_bfs_wlp.py's; only the
task differs.

  python -m jdr.train --config configs/pretrain_ict.py:runlocal --workdir runs/pretrain_ict
"""

import pretrain_ict_bfs_wlp

ARGS = pretrain_ict_bfs_wlp.ARGS

def get_config(arg=None):
  return pretrain_ict_bfs_wlp.pretrain_config("ict", arg)
