"""A cross-encoder (FGD's teacher, and a reranker): BERT over `[CLS] q [SEP] d [SEP]` with a one-logit head,
trained with softmax NLL over each query's positive and n BM25 negatives (no in-batch negatives: every pair
is a forward pass of its own), evaluated by reranking a first stage (BM25 unless eval.rerank_run names a run).

`runlocal`: the bundled MiniLM (a fresh head; 6 x 384), SciFact train when ../shared/data has it, pairs of
256 tokens (queries up to 32), batch 16 x (1 positive + 3 BM25 negatives), AdamW 3e-5 with 10% warm-up,
120 steps (about two epochs of the 919 training pairs), reranking the top 100. Without `runlocal`: 7
negatives, batch 64, 2e-5, 2,000 steps.

  python -m jdr.train --config configs/cross_encoder.py:runlocal --workdir runs/cross \
      --config.eval.rerank_run=runs/scifact-minilm.trec
  python -m jdr.rerank --model runs/cross --queries ../shared/data/scifact --split test \
      --corpus ../shared/data/scifact --run runs/scifact-minilm.trec --depth 100 --out runs/reranked.trec
"""

import base
from jdr.data import shared

ARGS = dict(runlocal=False)


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  c = base.get_config()
  c.model.architecture = "cross_encoder"
  c.model.init_from = "minilm"
  scifact = shared.shared_dataset("scifact")
  c.data.dataset = str(scifact) if scifact else "builtin"
  c.data.query_max_length = 32
  c.data.doc_max_length = 256  # the pair's length
  c.negatives.source = "bm25"
  c.negatives.in_batch = False
  c.loss.name = "softmax_nll"
  c.eval.rerank_depth = 100
  c.eval.diagnostic_queries = 0
  c.eval_before_training = False  # a fresh head ranks at random: the first stage's own metrics say more
  if a.runlocal:
    c.negatives.per_query = 3
    c.batch_size = 16
    c.num_train_steps = 120
    c.optimizer.learning_rate = 3e-5
  else:
    c.negatives.per_query = 7
    c.batch_size = 64
    c.num_train_steps = 2000
    c.optimizer.learning_rate = 2e-5
  c.optimizer.warmup_steps = c.num_train_steps // 10
  c.checkpoint_every = c.num_train_steps // 2
  return c
