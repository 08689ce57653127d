"""Two-tower pretraining on ICT + BFS + WLP pairs (Chang et al., ICLR 2020), the paper's best setup.

Each pair comes from one of the three tasks, chosen uniformly (data.pretrain_task="mixed"); the loss is the
sampled softmax over the documents of the global batch (in-batch negatives, gathered across devices and hosts
by the sharded step). The paper: query 64 tokens, document 288, a 512-dimensional linear layer on [CLS]
(here Dense(512) + LayerNorm, jdr's projection head), Adam at 1e-4 with 10% warm-up, batch 8192, made to fit
through exact gradient caching (grad_cache.chunk_size rows encoded at once). BERT-base sized towers, shared.

`runlocal` scales it to a 2-core x86 CPU: a small BERT from random weights (4 layers, 256 wide, the
MiniLM vocabulary; mean pooling and cosine scores at temperature 0.05, since [CLS] with raw inner products did
not leave chance level at this budget), the shared Wikispeedia articles, query 32 / document 128 tokens, batch 32, 600 steps, no
gradient caching (nothing to save at batch 32). About 7.5 minutes on 2 CPU cores (0.73 s a step, measured
alone on a 2-core x86 CPU); the ablation in the README runs 300 of these steps a row.

  python -m jdr.train --config configs/pretrain_ict_bfs_wlp.py:runlocal --workdir runs/pretrain_ict_bfs_wlp

then fine-tune from the workdir with configs/finetune.py. The other pretraining recipes (pretrain_ict.py,
pretrain_bfs.py, pretrain_wlp.py, pretrain_mlm.py) are this one with another task.
"""

import base

ARGS = dict(runlocal=False)


def pretrain_config(task: str, arg=None):
  """The shared pretraining recipe for `task` (ict | bfs | wlp | mixed | mlm); `arg` as the recipes' (ARGS)."""
  a = base.parse_arg(arg, **ARGS)
  c = base.get_config()
  c.data.kind = "pretrain"
  c.data.pretrain_task = task
  c.data.pretrain_source = "wikispeedia"  # data.dataset names another copy; "builtin" or an XML dump path
  c.data.dataset = ""  # "" = the shared Wikispeedia directory
  c.data.eval_split = ""  # pretraining does not evaluate: the fine-tuning recipe does
  c.eval_before_training = False
  c.negatives.source = "none"
  c.negatives.in_batch = True
  c.loss.name = "softmax_nll"
  c.model.init_from = ""
  c.model.pooling = "cls"
  c.model.normalize = 0
  c.model.projection_dim = 512
  c.model.shared = True
  c.optimizer.name = "adamw"
  c.optimizer.weight_decay = 0.0  # Adam
  c.optimizer.learning_rate = 1e-4
  if a.runlocal:
    # From random weights at this budget [CLS] pooling does not train: the loss stayed at log(32) (chance)
    # for 300 steps with raw inner products at lr 1e-4, for 120 with cosine scores at temperature 0.05, and
    # for 80 at lr 5e-4; mean pooling with cosine / 0.05 reached 30% in-batch accuracy in 80 steps (measured).
    c.model.pooling = "mean"
    c.model.normalize = 1
    c.loss.temperature = 0.05
    c.model.fresh = "small"
    c.data.query_max_length = 32
    c.data.doc_max_length = 128
    c.batch_size = 32
    c.num_train_steps = 600
    c.grad_cache.chunk_size = 0
    c.checkpoint_every = 200
  else:
    c.model.fresh = "base"
    c.data.query_max_length = 64
    c.data.doc_max_length = 288
    c.batch_size = 8192
    c.num_train_steps = 100_000
    c.grad_cache.chunk_size = 256
    c.checkpoint_every = 2000
    c.log_every = 50
  c.optimizer.warmup_steps = c.num_train_steps // 10
  return c


def get_config(arg=None):
  return pretrain_config("mixed", arg)
