"""The masked-LM baseline of Chang et al. (ICLR 2020): pretrain the shared encoder with BERT's token
cross-entropy (15% of tokens chosen; 80% [MASK], 10% random, 10% kept: jdr.data.pretrain.mask_tokens), then
fine-tune both towers from it with configs/finetune.py.

The text is the passages the paragraph-level tasks draw from ("title [SEP] passage", up to
data.doc_max_length tokens), B of them a step, so a row of the ablation sees the same budget (steps x batch)
as the ICT / BFS / WLP rows. The masked-LM head (BERT's, tied to the word embeddings) is trained here and left
out of the model that fine-tuning, jdr.encode and jdr.export read from the workdir; the projection head stays
at its initialization. Everything not below is configs/pretrain_ict_bfs_wlp.py's (its table gives the data,
model, optimizer, batch, lengths and steps, full and runlocal, with their sources).

| setting | value (full) | value (runlocal) | source | departs / why |
|---|---|---|---|---|
| task | masked LM over passages (`data.pretrain_task=mlm`), 15% of tokens | the same | Sec. 3 (the MLM baseline); Devlin et al. 2019 (15%, 80/10/10) | |
| batch | 8,192 passages, no gradient caching | 32 | Sec. 4.1 (the rows share a budget) | the token loss has no batch softmax, so there is nothing for gradient caching to keep exact |

  python -m jdr.train --config configs/pretrain_mlm.py:runlocal --workdir runs/pretrain_mlm
  python -m jdr.train --config configs/pretrain_mlm.py --workdir runs/wikipedia-mlm
"""

import pretrain_ict_bfs_wlp

ARGS = pretrain_ict_bfs_wlp.ARGS


def get_config(arg=None):
  c = pretrain_ict_bfs_wlp.pretrain_config("mlm", arg)
  c.grad_cache.chunk_size = 0  # jdr refuses gradient caching without a batch softmax
  return c
