"""Fine-tune a pretrained two-tower model with in-batch negatives (the second stage of Chang et al., ICLR 2020):
the towers, head and tokenizer come from a pretraining workdir (or any jdr workdir / export) named by
model.init_from; evaluation on the test queries at the end.

| setting | value (full) | value (runlocal) | source | departs / why |
|---|---|---|---|---|
| data | ReQA SQuAD (`data.dataset=data/reqa-squad`), trained on `train`, evaluated on `test` | SciFact (the shared copy), `train` / `test` | Sec. 4.1 (ReQA SQuAD and Natural Questions, splits of the questions) | runlocal: SciFact has a training split; the shared ReQA sample is test-only |
| starting model | configs/pretrain_ict_bfs_wlp.py's workdir (`model.init_from=runs/wikipedia-ict_bfs_wlp`) | configs/pretrain_ict_bfs_wlp.py:runlocal's (`runs/pretrain_ict_bfs_wlp`) | Sec. 4.1 ("pre-train ... then fine-tune") | |
| towers | the pretrained model's own (pooling, head, normalization) | the same | Sec. 4.1 (a linear layer on [CLS]) | |
| negatives | the batch's other documents (sampled softmax) | the same | Sec. 2 (Eq. 3, the sampled softmax) | |
| loss | softmax NLL, temperature 1 | softmax NLL, temperature 0.05 | Sec. 2 (Eq. 1, inner products) | runlocal: the runlocal pretraining recipes' cosine scores |
| optimizer | Adam 5e-5 (AdamW without weight decay), 10% warm-up then linear decay | AdamW 5e-5, weight decay 0.01, 9 warm-up steps | Sec. 4.1 (fine-tuning: Adam 5e-5) | the fine-tuning warm-up is not stated: the pre-training's 10%; runlocal: the weight decay docs/results.md's pretraining ablation ran with |
| batch | 512 | 32 | Sec. 4.1 | runlocal: 2-core budget |
| lengths | queries 64, documents 288 tokens | 32 / 128, evaluated at 256 | Sec. 4.1 | runlocal: the runlocal pretraining lengths |
| steps | 2,000 | 90 (about three epochs of SciFact's 919 training pairs) | Sec. 4.1 | runlocal: 2-core budget |

  python -m jdr.train --config configs/finetune.py:runlocal --workdir runs/finetune_ict \\
      --config.model.init_from=runs/pretrain_ict
  python -m jdr.train --config configs/finetune.py --workdir runs/reqa-finetune
"""

import base

ARGS = dict(runlocal=False)


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  c = base.get_config()
  c.model.normalize = -1  # the pretrained model's own settings (pooling, head) are kept
  c.data.eval_split = "test"
  c.negatives.source = "none"
  c.negatives.in_batch = True
  c.loss.name = "softmax_nll"
  c.optimizer.learning_rate = 5e-5
  if a.runlocal:
    c.data.dataset, c.data.description = base.shared("scifact")
    c.model.init_from = "runs/pretrain_ict_bfs_wlp"
    c.model.description = "a pretraining workdir: configs/pretrain_ict_bfs_wlp.py:runlocal's, or another jdr model"
    c.data.query_max_length = 32
    c.data.doc_max_length = 128
    c.batch_size = 32
    c.num_train_steps = 90
    c.optimizer.warmup_steps = 9
    c.loss.temperature = 0.05
    c.eval.doc_max_length = 256
  else:
    c.data.dataset, c.data.description = base.REQA_SQUAD
    c.model.init_from = "runs/wikipedia-ict_bfs_wlp"
    c.model.description = "a pretraining workdir: configs/pretrain_ict_bfs_wlp.py's, or another jdr model"
    c.data.query_max_length = 64
    c.data.doc_max_length = 288
    c.batch_size = 512
    c.num_train_steps = 2000
    c.optimizer.warmup_steps = 200
    c.optimizer.weight_decay = 0.0  # Adam
  return c
