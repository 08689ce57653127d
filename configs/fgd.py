"""FGD (Zhou et al., fine-grained distillation for long documents) and its ablation, on long-document SciFact.

Two stages, chained by init_from, as the paper:

  stage 1 (`:runlocal,warmup`): contrastive training only (softmax NLL over the positive, 3 hard negatives
      drawn from the starting model's top 4, and the batch), no teacher;
  stage 2 (`:runlocal`): from stage 1's towers, negatives re-mined by them, FGD: lambda x contrastive NLL +
      KL from the cross-encoder teacher at passage (128-token) and sentence (64-token) level (Eq. 12-13),
      pieces embedded from the document's own forward pass (Eq. 7).

The ablation rows are overrides of stage 2: contrastive only `--config.distill.teacher=`; document-level
KD `--config.distill.granularities= --config.distill.document=True`; without passage / sentence
`--config.distill.granularities=sentence` / `=passage`; FG pooling `--config.distill.pooling=mean`; FGD +
document KD `--config.distill.document=True`.

`runlocal`: MiniLM (its own normalized vectors, [CLS] pooling so Eq. 7 applies; cosine scores at temperature
0.05), documents of 512 tokens (FirstP), queries of 32, batch 8, AdamW 2e-5, 120 steps a stage. The data is
`python -m jdr.data.longdocs --source ../shared/data/scifact --out runs/scifact-long`, the teacher
configs/cross_encoder.py's workdir (runs/cross). Without `runlocal`: batch 32, 7 negatives from the top 100,
2,000 steps.

  python -m jdr.train --config configs/fgd.py:runlocal,warmup --workdir runs/fgd-warmup
  python -m jdr.train --config configs/fgd.py:runlocal --workdir runs/fgd --config.model.init_from=runs/fgd-warmup
"""

import base

ARGS = dict(runlocal=False, warmup=False)


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  c = base.get_config()
  c.data.dataset = "runs/scifact-long"
  c.data.query_max_length = 32
  c.data.doc_max_length = 512
  c.model.pooling = "cls"
  c.negatives.source = "dense_static"
  c.negatives.in_batch = True
  c.loss.name = "softmax_nll"
  c.loss.temperature = 0.05
  c.eval.metrics = "mrr@100,ndcg@10,recall@100"
  c.eval.diagnostic_queries = 0
  c.distill.teacher = "" if a.warmup else "runs/cross"
  c.distill.granularities = "passage,sentence"
  c.distill.contrastive_weight = 1.0
  if a.runlocal:
    c.negatives.per_query = 3
    c.negatives.top_n = 4  # the teacher scores every document of a query's pool: keep it small on a CPU
    c.batch_size = 8
    c.num_train_steps = 120
    c.optimizer.learning_rate = 2e-5
  else:
    c.negatives.per_query = 7
    c.negatives.top_n = 100
    c.batch_size = 32
    c.num_train_steps = 2000
    c.optimizer.learning_rate = 2e-5
  c.optimizer.warmup_steps = c.num_train_steps // 10
  return c
