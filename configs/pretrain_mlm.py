"""The masked-LM baseline of Chang et al. (ICLR 2020): pretrain the shared encoder with BERT's token
cross-entropy (15% of tokens chosen; 80% [MASK], 10% random, 10% kept: jdr.data.pretrain.mask_tokens), then
fine-tune both towers from it with configs/finetune.py.

NOT IMPLEMENTED YET in the trainer: the MLM head and step are still to come, and `jdr.train` refuses this
recipe with a clear error. The settings below are the ones it is meant to run with (those of
configs/pretrain_ict_bfs_wlp.py).

  python -m jdr.train --config configs/pretrain_mlm.py:runlocal --workdir runs/pretrain_mlm
"""

import pretrain_ict_bfs_wlp


def get_config(arg=None):
  return pretrain_ict_bfs_wlp.pretrain_config("mlm", arg)
