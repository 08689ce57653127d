"""Fine-tune a pretrained two-tower model on SciFact with in-batch negatives (the second stage of Chang et
al. 2020): the towers, head and tokenizer come from a pretraining workdir (or any jdr workdir / export),
named by model.init_from; evaluation on SciFact's test queries at the end.

  python -m jdr.train --config configs/finetune.py:runlocal --workdir runs/finetune_ict \
      --config.model.init_from=runs/pretrain_ict

`runlocal`: batch 32, Adam 5e-5 (the paper's fine-tuning rate) with 10% warm-up, 90 steps (about three epochs
of SciFact's 919 training pairs), cosine scores at temperature 0.05 (the runlocal pretraining recipes' own);
the query / document lengths stay the pretraining ones (32 / 128). Without `runlocal`: the paper's
lengths (64 / 288), batch 512, 1e-5, 5000 steps.
"""

import base
from jdr.data import shared

ARGS = dict(runlocal=False)


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  c = base.get_config()
  c.model.init_from = "runs/pretrain_ict_bfs_wlp"  # override: any pretraining workdir
  c.model.normalize = -1  # the pretrained model's own settings (pooling, head) are kept
  scifact = shared.shared_dataset("scifact")
  c.data.dataset = str(scifact) if scifact else "builtin"
  c.data.eval_split = "test"
  c.negatives.source = "none"
  c.negatives.in_batch = True
  c.loss.name = "softmax_nll"
  if a.runlocal:
    c.data.query_max_length = 32
    c.data.doc_max_length = 128
    c.batch_size = 32
    c.num_train_steps = 90
    c.optimizer.learning_rate = 5e-5
    c.optimizer.warmup_steps = 9
    c.loss.temperature = 0.05
    c.eval.doc_max_length = 256
  else:
    c.data.query_max_length = 64
    c.data.doc_max_length = 288
    c.batch_size = 512
    c.num_train_steps = 5000
    c.optimizer.learning_rate = 1e-5
    c.optimizer.warmup_steps = 500
  return c
