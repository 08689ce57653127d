"""Two-tower pretraining on ICT + BFS + WLP pairs (Chang et al., ICLR 2020), the paper's best setup.

Each pair comes from one of the three tasks, chosen uniformly (data.pretrain_task="mixed"); the loss is the
sampled softmax over the documents of the global batch (in-batch negatives, gathered across devices and hosts
by the sharded step). The other pretraining recipes (pretrain_ict.py, pretrain_bfs.py, pretrain_wlp.py,
pretrain_mlm.py) are this one with another task; fine-tune from the workdir with configs/finetune.py.

| setting | value (full) | value (runlocal) | source | departs / why |
|---|---|---|---|---|
| data | English Wikipedia (`data.pretrain_source=data/enwiki-pages-articles.xml.bz2`, a pages-articles dump) | the Wikispeedia articles (`data.dataset`, the shared copy) | Sec. 4.1 ("generated from the Wikipedia corpus") | runlocal: 1,629 hyperlinked articles a CPU reads at once |
| task | ICT, BFS or WLP, uniform per pair; ICT keeps its sentence with probability 0.1 | the same | Sec. 3, 4.1 ("uniformly sampled from the three pre-training tasks"); Lee et al. 2019 (0.1) | |
| starting model | fresh weights, BERT-base (12 x 768) (`model.init_from=`, `model.fresh=base`) | fresh weights, 4 x 256 | Sec. 4.1 ("the 12 layers BERT-base model") | runlocal: a model a CPU trains |
| tokenizer | BERT uncased WordPiece (the bundled MiniLM's vocabulary) | the same | Sec. 4.1 (WordPiece) | |
| towers | one shared tower, [CLS] + Dense(512) + LayerNorm, dot product | mean pooling + Dense(512) + LayerNorm, L2-normalized | Sec. 4.1 ("a linear layer on the hidden state of the [CLS] token", 512) | jdr's head adds a LayerNorm; the paper does not say whether the towers are tied; runlocal: from random weights at this budget [CLS] with raw inner products stayed at chance |
| loss | sampled softmax over the global batch, temperature 1 | the same, temperature 0.05 | Sec. 2 (Eq. 3, the sampled softmax) | runlocal: cosines in [-1, 1] need the temperature |
| optimizer | Adam 1e-4 (AdamW without weight decay), 10% warm-up then linear decay | the same | Sec. 4.1 | |
| batch | 8,192, through exact gradient caching (`grad_cache.chunk_size=256`) | 32, no caching | Sec. 4.1 (8,192 on 32 TPU v3 chips) | caching makes 8,192 fit any device; runlocal: 2-core budget |
| lengths | queries 64, documents 288 tokens | 32 / 128 | Sec. 4.1 | runlocal: 2-core budget |
| steps | 100,000 | 600 | Sec. 4.1 | runlocal: 2-core budget |

  python -m jdr.train --config configs/pretrain_ict_bfs_wlp.py:runlocal --workdir runs/pretrain_ict_bfs_wlp
  python -m jdr.train --config configs/pretrain_ict_bfs_wlp.py --workdir runs/wikipedia-ict_bfs_wlp
"""

import base

ARGS = dict(runlocal=False)


def pretrain_config(task: str, arg=None):
  """The shared pretraining recipe for `task` (ict | bfs | wlp | mixed | mlm); `arg` as the recipes' (ARGS)."""
  a = base.parse_arg(arg, **ARGS)
  c = base.get_config()
  c.data.kind = "pretrain"
  c.data.pretrain_task = task
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
    c.data.pretrain_source = "wikispeedia"
    c.data.dataset, c.data.description = base.shared("wikispeedia")
    # From random weights at this budget [CLS] pooling does not train, where mean pooling with cosine scores at
    # temperature 0.05 does (the runs: docs/results.md, "Pretraining two towers").
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
    c.data.pretrain_source, c.data.description = base.WIKIPEDIA
    c.data.dataset = ""
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
