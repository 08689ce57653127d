"""The masked-LM baseline of Chang et al. (ICLR 2020): pretrain the shared encoder with BERT's token
cross-entropy (15% of tokens chosen; 80% [MASK], 10% random, 10% kept: jdr.data.pretrain.mask_tokens), then
fine-tune both towers from it with configs/finetune.py.

The text is the passages the paragraph-level tasks draw from ("title [SEP] passage", up to
data.doc_max_length tokens), B of them a step, so a row of the ablation sees the same budget (steps x batch)
as the ICT / BFS / WLP rows; the rest of the setup is configs/pretrain_ict_bfs_wlp.py's. The masked-LM head
(BERT's, tied to the word embeddings) is trained here and left out of the model that fine-tuning, jdr.encode
and jdr.export read from the workdir; the projection head stays at its initialization.

  python -m jdr.train --config configs/pretrain_mlm.py:runlocal --workdir runs/pretrain_mlm
"""

import pretrain_ict_bfs_wlp

ARGS = pretrain_ict_bfs_wlp.ARGS

def get_config(arg=None):
  return pretrain_ict_bfs_wlp.pretrain_config("mlm", arg)
