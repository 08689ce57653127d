"""In-batch negatives (DPR / STAR's "In-Batch Neg"): each query's negatives are the other queries' positives.

STAR paper baseline (Zhan et al. 2021, Sec. 7.2): LAMB, batch 256, learning rate 2e-4. `runlocal` scales it
to a 2-core x86 CPU: the bundled MiniLM, batch 32, 208 steps (about seven epochs of SciFact's 919 training
pairs), AdamW 1e-4: the rate `python -m jdr.reproduce scifact` chose on a dev split of the training queries at
that budget (dev nDCG@10 0.7155 / 0.7432 / 0.7625 at 2e-5 / 5e-5 / 1e-4, seed 0; docs/results.md). The
recipes built on this one (rand_neg, bm25_neg, nce_neg, bm25_rand) take the same budget and rate.

  python -m jdr.train --config configs/inbatch.py:runlocal --workdir runs/inbatch \
      --config.data.dataset=../shared/data/scifact --config.eval.doc_max_length=256
"""

import base

ARGS = dict(runlocal=False)


def get_config(arg=None):
  return recipe(base.parse_arg(arg, **ARGS))


def recipe(a):
  """The recipe for parsed arguments `a` (the recipes built on this one pass theirs)."""
  c = base.get_config()
  c.negatives.source = "none"
  c.negatives.in_batch = True
  c.loss.name = "softmax_nll"
  if a.runlocal:
    c.batch_size = 32
    c.num_train_steps = 208  # about seven epochs of SciFact's 919 training pairs: jdr.reproduce's budget
    c.optimizer.learning_rate = 1e-4  # chosen on dev by jdr.reproduce (see above)
    c.optimizer.warmup_steps = 20
    c.loss.temperature = 0.05  # MiniLM's embeddings are normalized: scores are cosines
  else:
    c.batch_size = 256
    c.optimizer.name = "lamb"
    c.optimizer.learning_rate = 2e-4
    c.optimizer.warmup_steps = 1000
    c.num_train_steps = 20000
  return c
