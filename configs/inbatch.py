"""In-batch negatives (DPR / STAR's "In-Batch Neg"): each query's negatives are the other queries' positives.

The full recipe is the STAR paper's In-Batch Neg baseline (Zhan et al., SIGIR 2021, Sec. 7.2-7.3) as its
authors' code runs it (jingtaozhan/DRhard `star/train.py` without hard negatives, `model.py` `inbatch_train`).
The recipes built on this one (rand_neg, bm25_neg, nce_neg, bm25_rand, star, ance) start from its model, data
and budget and change the rows their own tables name.

| setting | value (full) | value (runlocal) | source | departs / why |
|---|---|---|---|---|
| data | MS MARCO passage (`data.dataset=data/msmarco-passage`), evaluated on `dev` | SciFact (the shared copy), evaluated on `test` | STAR Sec. 7.1 | runlocal: a 2-core CPU's dataset |
| starting model | RoBERTa-base (`model.init_from=models/roberta-base`) | the bundled MiniLM | STAR Sec. 7.3 ("All DR models use the RoBERTa_base") | runlocal: a model a CPU trains in minutes |
| towers | one shared tower, [CLS] + Dense(768) + LayerNorm, dot product | MiniLM's own: mean pooling, L2-normalized | STAR Sec. 7.3 ("[CLS]", "inner product"); DRhard `model.py` (`RobertaDot`) | |
| negatives | the batch's other positives | the same | STAR Sec. 7.2.2; DRhard `inbatch_train` | |
| loss | RankNet, one mean over every (query, other document) pair, temperature 1 | softmax NLL over the batch, temperature 0.05 | STAR Sec. 7.3 ("use the RankNet loss"); DRhard `inbatch_train` (a two-way log-softmax per pair) | runlocal: what docs/results.md's table ran; cosines in [-1, 1] need the temperature |
| optimizer | `lamb` 2e-4, 1,000 warm-up steps then linear decay, weight decay 0.01, clip 1.0 | AdamW 1e-4, 20 warm-up steps | STAR Sec. 7.3 (LAMB, 2e-4); DRhard `star/train.py` defaults (warm-up, weight decay, max_grad_norm) | runlocal: the rate `python -m jdr.reproduce scifact` chose on a dev split of the training queries (each rate's dev nDCG@10: docs/results.md, "SciFact methods at one budget") |
| batch | 256 queries | 32 | STAR Sec. 7.3 | runlocal: 2-core budget |
| lengths | queries 24, passages 120 tokens | 32 / 128 | DRhard README (`--max_query_length 24 --max_doc_length 120`); STAR Sec. 7.3 (120) | runlocal: jdr's defaults |
| steps | 20,000 | 208 (about seven epochs of SciFact's 919 training pairs) | not stated: DRhard trains until stopped by hand | full: jdr's budget; runlocal: jdr.reproduce's |

`data/msmarco-passage` is BEIR's `msmarco` folder; `models/roberta-base` a local copy of the Hugging Face
`roberta-base` repository. jdr.train refuses to start, naming the key to set, when either is missing.

  python -m jdr.train --config configs/inbatch.py:runlocal --workdir runs/inbatch --config.eval.doc_max_length=256
  python -m jdr.train --config configs/inbatch.py --workdir runs/msmarco-inbatch
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
  if a.runlocal:
    c.data.dataset, c.data.description = base.shared("scifact")
    c.loss.name = "softmax_nll"
    c.loss.temperature = 0.05  # MiniLM's embeddings are normalized: scores are cosines
    c.batch_size = 32
    c.num_train_steps = 208  # about seven epochs of SciFact's 919 training pairs: jdr.reproduce's budget
    c.optimizer.learning_rate = 1e-4  # chosen on dev by jdr.reproduce (see above)
    c.optimizer.warmup_steps = 20
  else:
    c.data.dataset, c.data.description = base.MSMARCO_PASSAGE
    c.data.eval_split = "dev"
    c.data.query_max_length, c.data.doc_max_length = 24, 120
    c.model.init_from, c.model.description = base.ROBERTA_BASE
    c.model.pooling, c.model.normalize, c.model.projection_dim = "cls", 0, 768
    c.model.shared = True
    c.loss.name = "ranknet"
    c.loss.temperature = 1.0
    c.batch_size = 256
    c.optimizer.name = "lamb"
    c.optimizer.learning_rate = 2e-4
    c.optimizer.warmup_steps = 1000
    c.optimizer.weight_decay = 0.01
    c.optimizer.grad_clip_norm = 1.0
    c.num_train_steps = 20_000
  return c
