"""FGD (Zhou et al., fine-grained distillation for long-document retrieval) and its ablation.

Two stages, chained by model.init_from, as the paper's Sec. 3.2:

  stage 1 (`:warmup`): contrastive training only (Eq. 3: softmax NLL over the positive and the query's hard
      negatives, mined by the starting model), no teacher;
  stage 2 (no `warmup`): from stage 1's towers, negatives re-mined by them, FGD: lambda x contrastive NLL + KL
      from the cross-encoder teacher at passage (128-token) and sentence (64-token) level (Eq. 12-13), pieces
      embedded from the document's own forward pass (Eq. 7), negative pieces chosen hierarchically (Eq. 14-15).

The ablation rows are overrides of stage 2: contrastive only `--config.distill.teacher=`; document-level KD
`--config.distill.granularities= --config.distill.document=True`; without passage / sentence
`--config.distill.granularities=sentence` / `=passage`; FG pooling `--config.distill.pooling=mean`; FGD +
document KD `--config.distill.document=True`; every piece of the negatives instead of the hierarchy
`--config.distill.negative_pieces=0`.

| setting | value (full) | value (runlocal) | source | departs / why |
|---|---|---|---|---|
| data | MS MARCO document (`data.dataset=data/msmarco-doc`), evaluated on `dev` (MRR@100, R@100) | long-document SciFact (`runs/scifact-long`, 2-3 abstracts a document), evaluated on `test` | Sec. 3.1 | runlocal: a long-document set a CPU trains on |
| starting model, stage 1 | a STAR model (`model.init_from=runs/msmarco-star`, configs/star.py's RoBERTa-base workdir) | the bundled MiniLM | Sec. 3.3 (RoBERTa-base; "a supervised pre-training on passage retrieval by default"); Table 3 (STAR as student) | jdr has no ED-MLM corpus-aware pre-training (Sec. 3.3); STAR is the paper's passage-trained RoBERTa student |
| starting model, stage 2 | stage 1's workdir (`runs/msmarco-fgd-warmup`) | stage 1's workdir (`runs/fgd-warmup`) | Sec. 3.3 ("the second-stage model initializes from the first-stage retriever") | |
| towers | [CLS] pooling (Eq. 6-7), dot product, the starting model's head | [CLS] pooling, MiniLM's L2-normalized vectors | Eq. 1, 6-7 | runlocal: cosines, so the scores are divided by 0.05 |
| teacher | configs/cross_encoder.py's RoBERTa-base workdir (`distill.teacher=runs/msmarco-cross`), logits at temperature 1 | configs/cross_encoder.py:runlocal's (`runs/cross`) | Sec. 3.3 (R2ANKER) | R2ANKER is not among jdr's recipes; the teacher must share the student's tokenizer |
| negatives | 8 a query, uniform from the starting model's top 100 (`dense_static`), no in-batch negatives | 3 from the top 4, no in-batch negatives | Sec. 3.3 ("1 positive and 8 negative documents", "a depth of 100"); Eq. 2-3 (a softmax over each query's own candidates) | runlocal: the teacher scores every document of a pool, so the pool stays small on a CPU; in-batch is off in both, a fidelity choice (Eq. 2-3), where docs/results.md's FGD table ran with it on |
| hierarchical negatives | the 8 best-scored negative passages, then the 8 best sentences inside them (`distill.negative_pieces=8`) | 3 and 3 | Eq. 14-15 (the hierarchy); Sec. 3.3 gives no count | m = the number of negative documents, so every level is 1 positive piece against as many negatives as the document level; on in runlocal too, a fidelity choice, where docs/results.md's FGD table scored every piece |
| loss | lambda x NLL + passage KL + sentence KL, lambda 1, temperature 1 | the same, student scores / 0.05 | Eq. 2 (tau = 1), Eq. 12-13 | Sec. 3.3 does not give lambda; 1 weighs the terms alike |
| pieces | passages of 128 and sentences of 64 consecutive tokens | the same | Sec. 3.3 | |
| optimizer | Adam 3e-6 (AdamW, weight decay 0.01), 1,000 warm-up steps then linear decay | AdamW 2e-5, 10% warm-up | Sec. 3.3 | runlocal: docs/results.md's budget |
| batch | 64 queries | 8 | Sec. 3.3 | runlocal: 2-core budget |
| lengths | queries 32, documents 512 tokens (FirstP) | the same | Sec. 3.3 | |
| steps | stage 1: 2 epochs (11,469 steps); stage 2: 20 epochs (114,691) of the 367,013 training pairs | 120 a stage | Sec. 3.3 (epochs), Sec. 3.1 (367 thousand training queries) | runlocal: docs/results.md's budget |

  python -m jdr.data.longdocs --source ../shared/data/scifact --out runs/scifact-long
  python -m jdr.train --config configs/fgd.py:runlocal,warmup --workdir runs/fgd-warmup
  python -m jdr.train --config configs/fgd.py:runlocal --workdir runs/fgd
  python -m jdr.train --config configs/fgd.py:warmup --workdir runs/msmarco-fgd-warmup
  python -m jdr.train --config configs/fgd.py --workdir runs/msmarco-fgd
"""

import base

ARGS = dict(runlocal=False, warmup=False)

MSMARCO_DOC_TRAIN_PAIRS = 367_013  # qrels/train.tsv of MS MARCO document ranking: one positive a query


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  c = base.get_config()
  c.data.query_max_length = 32
  c.data.doc_max_length = 512
  c.model.pooling = "cls"
  c.negatives.source = "dense_static"
  c.negatives.in_batch = False
  c.loss.name = "softmax_nll"
  c.eval.metrics = "mrr@100,ndcg@10,recall@100"
  c.eval.diagnostic_queries = 0
  c.distill.granularities = "passage,sentence"
  c.distill.passage_tokens, c.distill.sentence_tokens = 128, 64
  c.distill.contrastive_weight = 1.0
  c.distill.temperature = 1.0
  if a.runlocal:
    c.data.dataset, c.data.description = base.SCIFACT_LONG
    if a.warmup:
      c.model.init_from = "minilm"
    else:
      c.model.init_from = "runs/fgd-warmup"
      c.model.description = "stage 1's workdir: configs/fgd.py:runlocal,warmup"
    c.distill.teacher = "runs/cross"  # configs/cross_encoder.py:runlocal's workdir
    c.loss.temperature = 0.05  # MiniLM's vectors are normalized: scores are cosines
    c.negatives.per_query = 3
    c.negatives.dense_static.top_n = 4  # the teacher scores every document of a query's pool: keep it small on a CPU
    c.batch_size = 8
    c.num_train_steps = 120
    c.optimizer.learning_rate = 2e-5
    c.optimizer.warmup_steps = c.num_train_steps // 10
  else:
    c.data.dataset, c.data.description = base.MSMARCO_DOC
    c.data.eval_split = "dev"
    if a.warmup:
      c.model.init_from, c.model.description = base.STAR
    else:
      c.model.init_from = "runs/msmarco-fgd-warmup"
      c.model.description = "stage 1's workdir: configs/fgd.py:warmup"
    c.model.normalize = 0
    c.distill.teacher = "runs/msmarco-cross"  # configs/cross_encoder.py's workdir
    c.loss.temperature = 1.0
    c.negatives.per_query = 8
    c.negatives.dense_static.top_n = 100
    c.batch_size = 64
    c.num_train_steps = (2 if a.warmup else 20) * MSMARCO_DOC_TRAIN_PAIRS // c.batch_size
    c.optimizer.learning_rate = 3e-6
    c.optimizer.warmup_steps = 1000
    c.optimizer.weight_decay = 0.01
  c.distill.negative_pieces = c.negatives.per_query  # Eq. 14-15; see the table for why m = the negatives
  if a.warmup:
    c.distill.teacher = ""
  return c
