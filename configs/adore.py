"""ADORE (Zhan et al., SIGIR 2021, Sec. 6.2): train only the query tower against a full retrieval at every
step over a fixed document index, LambdaRank with M = MRR@10 (their document task; MRR@200 on passages).

Paper: AdamW, learning rate 5e-6, batch 32, top-200, dropout 0.1, a trained model's document tower frozen.
`runlocal` scales it to a 2-core x86 CPU and SciFact: the bundled MiniLM (its shared tower split
into a trainable query tower and a frozen document tower), 208 steps (about 7 epochs of 919 pairs).
MiniLM's vectors are L2-normalized, so scores are cosines in [-1, 1]: a temperature of 0.05 gives the
pairwise losses the same room the unnormalized RoBERTa scores of the paper have, and the learning rate is
1e-4, the rate `python -m jdr.reproduce scifact` chose on a dev split of the training queries for this short
run (only the query tower moves). Dev nDCG@10 at 2e-5 / 5e-5 / 1e-4, seed 0: LambdaRank 0.7366 / 0.7701 /
0.7923, `ranknet` 0.7357 / 0.7782 / 0.7889, `static` 0.7335 / 0.7729 / 0.7935; configs/ltre.py:runlocal,pq
(RankNet on the compressed index) 0.7246 / 0.7681 / 0.7911. Arguments (comma-separated, after the colon; another name is an error):
  runlocal    the scaled-down run above
  ranknet     RankNet instead of LambdaRank (the LTRe / ADORE ablation)
  ndcg        LambdaRank with M = NDCG@10
  static      candidates retrieved once before training, then fixed (isolates "dynamic")
  jax         retrieval inside the jitted step (exact JAX top-k on the mesh) instead of Faiss on the host
  pq          train and serve on an OPQ48,IVF1,PQ48 index (LTRe Table 4); evaluated on it and on Flat

  python -m jdr.train --config configs/adore.py:runlocal --workdir runs/adore \
      --config.data.dataset=../shared/data/scifact
"""

import base

ARGS = dict(runlocal=False, ranknet=False, ndcg=False, static=False, jax=False, pq=False)


def get_config(arg=None):
  return recipe(base.parse_arg(arg, **ARGS))


def recipe(a):
  """The recipe for parsed arguments `a` (configs/ltre.py and adore_star.py pass theirs)."""
  c = base.get_config()
  c.model.shared = False
  c.model.train_towers = "query"
  c.negatives.source = "retrieval"
  c.negatives.top_n = 200
  c.negatives.retrieve_every = 0 if a.static else 1
  c.negatives.retrieval_backend = "jax" if a.jax else "faiss"
  c.negatives.in_batch = False
  c.loss.name = "ranknet" if a.ranknet else "lambdarank"
  c.loss.lambda_metric = "ndcg@10" if a.ndcg else "mrr@10"
  c.optimizer.name = "adamw"
  c.optimizer.learning_rate = 5e-6
  c.optimizer.weight_decay = 0.01
  c.optimizer.warmup_steps = 0
  c.batch_size = 32
  c.model.dropout = 0.1
  if a.pq:
    c.negatives.index_factory = "OPQ48,IVF1,PQ48"
    c.eval.factories = "OPQ48,IVF1,PQ48;Flat"
    c.eval.backend = "faiss"
  if a.runlocal:
    c.data.query_max_length = 32
    c.data.doc_max_length = 256  # the fixed index is encoded at the evaluation length
    c.eval.doc_max_length = 256
    c.num_train_steps = 208
    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_steps = 20
    c.loss.temperature = 0.05
    c.checkpoint_every = 104
    c.log_every = 8
  else:
    c.num_train_steps = 60_000  # ADORE on MS MARCO passage: 60k steps at batch 32
    c.data.doc_max_length = 512
  return c
