"""A cross-encoder (FGD's teacher, and a reranker): an encoder over `[CLS] q [SEP] d [SEP]` with a one-logit
head, trained with softmax NLL over each query's positive and n BM25 negatives (no in-batch negatives: every
pair is a forward pass of its own), evaluated by reranking a first stage (BM25 unless eval.rerank_run names a
run).

No seed paper trains one: FGD (Zhou et al., Sec. 3.3) distills from R2ANKER (Zhou et al. 2022), whose recipe is
not among the papers jdr implements, so the settings below are jdr's, and the full recipe trains the teacher
configs/fgd.py reads (`runs/msmarco-cross`).

| setting | value (full) | value (runlocal) | source | departs / why |
|---|---|---|---|---|
| data | MS MARCO passage (`data.dataset=data/msmarco-passage`), evaluated on `dev` | SciFact (the shared copy), evaluated on `test` | FGD Sec. 3.3 / Table 3 (a passage ranker as teacher) | |
| starting model | RoBERTa-base (`model.init_from=models/roberta-base`), a fresh one-logit head | the bundled MiniLM (6 x 384), a fresh head | jdr's | jdr/training/distill.py builds the teacher's pairs from the student's token ids, so FGD's teacher shares its student's (RoBERTa) tokenizer |
| negatives | 7 from the query's BM25 top 100, none in-batch | 3 | jdr's | runlocal: 2-core budget |
| loss | softmax NLL over the positive and its negatives, temperature 1 | the same | jdr's | |
| optimizer | AdamW 2e-5, 10% warm-up then linear decay, weight decay 0.01 | AdamW 3e-5, 10% warm-up | jdr's | |
| batch | 64 queries | 16 | jdr's | runlocal: 2-core budget |
| lengths | pairs of 256 tokens, queries up to 32 | the same | jdr's | |
| steps | 2,000 | 120 (about two epochs of SciFact's 919 training pairs) | jdr's | |
| evaluation | reranking the first stage's top 100 | the same | jdr's | |

  python -m jdr.train --config configs/cross_encoder.py:runlocal --workdir runs/cross \\
      --config.eval.rerank_run=runs/scifact-minilm.trec
  python -m jdr.rerank --model runs/cross --queries ../shared/data/scifact --split test \\
      --corpus ../shared/data/scifact --run runs/scifact-minilm.trec --depth 100 --out runs/reranked.trec
  python -m jdr.train --config configs/cross_encoder.py --workdir runs/msmarco-cross
"""

import base

ARGS = dict(runlocal=False)


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  c = base.get_config()
  c.model.architecture = "cross_encoder"
  c.data.query_max_length = 32
  c.data.doc_max_length = 256  # the pair's length
  c.negatives.source = "bm25"
  c.negatives.in_batch = False
  c.loss.name = "softmax_nll"
  c.eval.rerank_depth = 100
  c.eval.diagnostic_queries = 0
  c.eval_before_training = False  # a fresh head ranks at random: the first stage's own metrics say more
  if a.runlocal:
    c.data.dataset, c.data.description = base.shared("scifact")
    c.model.init_from = "minilm"
    c.negatives.per_query = 3
    c.batch_size = 16
    c.num_train_steps = 120
    c.optimizer.learning_rate = 3e-5
  else:
    c.data.dataset, c.data.description = base.MSMARCO_PASSAGE
    c.data.eval_split = "dev"
    c.model.init_from, c.model.description = base.ROBERTA_BASE
    c.negatives.per_query = 7
    c.batch_size = 64
    c.num_train_steps = 2000
    c.optimizer.learning_rate = 2e-5
  c.optimizer.warmup_steps = c.num_train_steps // 10
  c.checkpoint_every = c.num_train_steps // 2
  return c
