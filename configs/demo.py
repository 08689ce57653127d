"""The built-in default: fine-tune the bundled MiniLM on the standard-library docstring dataset with in-batch
negatives, evaluating before and after. No download; minutes on two CPU cores. The one recipe whose data is the
built-in dataset (`data.dataset=builtin`); it follows no paper and has no full version.

| setting | value | value (`:tiny`) | source | departs / why |
|---|---|---|---|---|
| data | the standard library's docstrings (`data.dataset=builtin`), queries 32 / documents 128 tokens | the same | jdr's | |
| starting model | the bundled MiniLM, mean pooling, L2-normalized | a fresh 2 x 64 BERT, mean pooling, L2-normalized | jdr's | |
| negatives, loss | the batch's other documents; softmax NLL, temperature 0.05 | the same | sentence-transformers' scale of 20 for cosine scores | |
| optimizer | AdamW 2e-5, 20 warm-up steps | AdamW 1e-3 | jdr's | fresh weights take a larger rate |
| batch, steps | 16, 200 | the same | jdr's | |

  python -m jdr.train --config configs/demo.py --workdir runs/demo
  python -m jdr.train --config configs/demo.py:tiny --workdir runs/demo-tiny   # a tiny random BERT instead
"""

import base

ARGS = dict(tiny=False)


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  c = base.get_config()
  c.data.dataset = "builtin"
  c.data.query_max_length = 32
  c.data.doc_max_length = 128
  c.negatives.source = "none"
  c.negatives.in_batch = True
  c.loss.name = "softmax_nll"
  # MiniLM's embeddings are L2-normalized, so scores are cosines in [-1, 1]: a temperature of 0.05 (a
  # scale of 20, as sentence-transformers trains it) gives the softmax room to separate positives.
  c.loss.temperature = 0.05
  c.batch_size = 16
  c.num_train_steps = 200
  c.optimizer.learning_rate = 2e-5
  c.optimizer.warmup_steps = 20
  c.log_every = 10
  c.checkpoint_every = 100
  if a.tiny:
    c.model.init_from = ""
    c.model.fresh = "tiny"
    c.model.pooling = "mean"
    c.model.normalize = 1  # like MiniLM, so the same temperature suits it
    c.optimizer.learning_rate = 1e-3
  return c
