"""ANCE (Xiong et al., ICLR 2021): negatives from the top-200 of the model's own ANN index, refreshed every m
steps by re-encoding the corpus in the background with a recent snapshot of the weights; tied towers.

As the authors ran it: at each refresh every training query becomes 20 (query, positive, negative) triples,
negatives drawn at random from its top 200 (positives skipped), shuffled into batches of triples; the loss is
one two-way softmax per triple, no in-batch negatives (the paper argues against them).

| setting | full | runlocal | source | where jdr departs, and why |
|---|---|---|---|---|
| starting model | ANCE's released BM25-negative warm-up (`model.init_from`, default `models/ance/bm25-warmup`) | a warm-up of its own, from `configs/bm25_neg.py:runlocal` | paper Sec. 5 ("ANCE is also warmed up by BM25 negatives"); ANCE README ("ANCE training starts from a pretrained BM25 warmup checkpoint") | runlocal: MiniLM, not RoBERTa-base |
| where it is published | ANCE README, "pretrained BM25 warmup checkpoint" (60K steps, MS MARCO dev MRR@10 0.311): https://webdatamltrainingdiag842.blob.core.windows.net/semistructstore/OpenSource/warmup_checpoint.zip; DRhard's README links the same model on Google Drive (file id 1URYU1gxNgcuC81jPAev1ksZjMKgQQFoD) | none: jdr trains it | ANCE README (Results, Warmup for Training) | |
| its format | ANCE's `RobertaDot_NLL_LN` as transformers 2.3's `save_pretrained` writes it: config.json and pytorch_model.bin with `roberta.*`, `embeddingHead.{weight,bias}` (Linear 768->768) and `norm.{weight,bias}` (LayerNorm) on [CLS], no normalization, plus the unused `roberta.pooler.*` and `classifier.*` of RobertaForSequenceClassification; roberta-base's tokenizer files beside them; texts are lowercased before tokenizing | a jdr workdir | ANCE `model/models.py`, `drivers/run_warmup.py` (model and tokenizer `save_pretrained`), `data/msmarco_data.py` (`do_lower_case=True`) | |
| what you pass | the unzipped folder that holds config.json, as downloaded: `--config.model.init_from=models/ance/bm25-warmup` (a missing folder is refused in one line naming the download); jdr's own warm-up instead: `--config.model.init_from=runs/msmarco-bm25-warmup`, configs/bm25_neg.py's workdir | `--config.model.init_from=runs/bm25_warmup` | | |
| towers | shared, CLS + Dense(768) + LayerNorm, dot product | MiniLM's mean pooling, normalized, temperature 0.05 | paper Sec. 5 (BERT-Siamese, 768 projection + LayerNorm) | cosines need a temperature |
| data | MS MARCO passage (`data.dataset`) | SciFact train | paper Sec. 5 | |
| negatives | 20 triples a query a refresh, uniform from the top 200 (`negatives.triples_per_query`) | the same | ANCE `run_train.sh` (`--negative_sample 20`), `run_ann_data_gen.py`, `msmarco_data.py` (`GetTripletTrainingDataProcessingFn`) | the triples are drawn lazily per (seed, generation, pair), so 20 costs nothing at SciFact size |
| loss | NLL of the positive in a softmax over (positive, negative), no in-batch | the same | ANCE `model.py` (`rdot_nll`), paper Eq. 5 | |
| refresh | every 10,000 steps, in force when mined | every 34 steps, in force 17 after | paper Sec. 5 | jdr switches on a fixed schedule so a resume is exact |
| optimizer | LAMB (weight norm clamped at 10), 1e-6, 5,000 warm-up steps, no weight decay | AdamW 2e-5, 10 warm-up steps | ANCE `run_train.sh` (`--optimizer lamb`, `--learning_rate 1e-6`, `--warmup_steps 5000`), `run_ann.py` (weight_decay 0), `utils/lamb.py` | runlocal: the rate chosen on dev by `python -m jdr.reproduce scifact` |
| batch | 64 triples (8 a GPU x 4 GPUs x 2 accumulated) | 32 | ANCE `run_train.sh` | 2-core budget |
| lengths | queries 64, passages 512 tokens | 32 / 256 (jdr.reproduce's) | ANCE `run_train.sh` (`seq_length=512`), `msmarco_data.py` | runlocal: the table's shared lengths |
| steps | 600,000 | 104 after a 104-step warm-up | paper Sec. 5 | jdr.reproduce's 208-step budget |

  python -m jdr.train --config configs/bm25_neg.py:runlocal --workdir runs/bm25_warmup \\
      --config.data.dataset=../shared/data/scifact --config.num_train_steps=104 --config.optimizer.warmup_steps=10
  python -m jdr.train --config configs/ance.py:runlocal --workdir runs/ance \\
      --config.data.dataset=../shared/data/scifact --config.model.init_from=runs/bm25_warmup

The full recipe, from the released warm-up (MS MARCO passage in data/msmarco-passage):

  python -m jdr.train --config configs/ance.py --workdir runs/msmarco-ance \\
      --config.data.dataset=data/msmarco-passage --config.model.init_from=models/ance/bm25-warmup
"""

import base
import inbatch

ARGS = dict(runlocal=False)

# ANCE's released BM25-negative warm-up, which ANCE and STAR (configs/star.py) start from: (path, what it holds
# and where it is published), said in full when the folder is missing.
RELEASED_WARMUP = (
    "models/ance/bm25-warmup",
    "ANCE's released BM25-negative warm-up: the folder holding config.json and pytorch_model.bin (RobertaDot_NLL_LN: "
    "roberta.* + embeddingHead + norm on [CLS]) unzipped from https://webdatamltrainingdiag842.blob.core.windows.net"
    "/semistructstore/OpenSource/warmup_checpoint.zip (microsoft/ANCE README; jingtaozhan/DRhard's README links the "
    "same model: https://drive.google.com/file/d/1URYU1gxNgcuC81jPAev1ksZjMKgQQFoD)")


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  c = inbatch.recipe(a)  # runlocal: the same budget and optimizer as the in-batch baseline
  c.model.shared = True
  c.negatives.source = "ance"
  c.negatives.top_n = 200
  c.negatives.per_query = 1
  c.negatives.triples_per_query = 20
  c.negatives.in_batch = False
  c.loss.name = "softmax_nll"
  if a.runlocal:
    c.num_train_steps = 104
    c.optimizer.learning_rate = 2e-5  # chosen on dev by jdr.reproduce (docs/results.md)
    c.optimizer.warmup_steps = 10
    c.negatives.refresh_every = 34
    c.negatives.refresh_delay = 17
    c.eval.doc_max_length = 256
  else:
    c.data.dataset, c.data.description = base.MSMARCO_PASSAGE
    c.model.init_from, c.model.description = RELEASED_WARMUP  # RoBERTa-base after BM25 negatives
    c.model.pooling, c.model.normalize, c.model.projection_dim = "cls", 0, 768
    c.loss.temperature = 1.0
    c.batch_size = 64
    c.data.query_max_length, c.data.doc_max_length = 64, 512  # ANCE's passage FirstP
    c.optimizer.name = "lamb"
    c.optimizer.learning_rate = 1e-6
    c.optimizer.warmup_steps = 5000
    c.optimizer.weight_decay = 0.0
    c.num_train_steps = 600_000
    c.negatives.refresh_every = 10_000
    c.negatives.refresh_delay = 10_000
  return c
