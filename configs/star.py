"""STAR (Zhan et al., SIGIR 2021, Sec. 6.1): static hard negatives from a warm-up model's top-200 (positives
removed), plus every other document of the batch reused as a random negative; RankNet over every (query,
negative) pair of the batch.

By default the recipe runs what the authors' code ran: one mean over all the batch's pairs, a query's own hard
negative in the same pool as the other rows' documents (DRhard `model.py`, `inbatch_train`), which has no
alpha. The paper's Eq. 13 (L_s + alpha * L_r over per-part means) is the argument `alpha`. An epoch goes over
the training queries, each once with one of its positives drawn at random, as DRhard's dataset does, so a query
fills one row of a batch (`data.epoch_over=queries`; `pairs` goes over (query, positive) pairs instead).

| setting | full | runlocal | source | where jdr departs, and why |
|---|---|---|---|---|
| starting model | the BM25 Neg warm-up, which ANCE released: configs/ance.py's (`model.init_from`, default `models/ance/bm25-warmup`) | a warm-up of its own, from `configs/bm25_neg.py:runlocal` | paper Sec. 7.3 ("STAR uses the BM25 Neg model as the warm-up model, which is the same as ANCE"; "We use the open-sourced BM25 Neg model"); DRhard README ("We use the same warmup model as ANCE") | runlocal: MiniLM, not RoBERTa-base |
| where it is published | ANCE README, "pretrained BM25 warmup checkpoint": https://webdatamltrainingdiag842.blob.core.windows.net/semistructstore/OpenSource/warmup_checpoint.zip; DRhard's README links its copy: https://drive.google.com/file/d/1URYU1gxNgcuC81jPAev1ksZjMKgQQFoD (extracted to `./data/passage/warmup` there) | none: jdr trains it | ANCE README; DRhard README (Train, STAR) | |
| its format | ANCE's `RobertaDot_NLL_LN` (transformers 2.3): config.json and pytorch_model.bin with `roberta.*`, `embeddingHead.{weight,bias}` (Linear 768->768) and `norm.{weight,bias}` (LayerNorm) on [CLS], no normalization, plus the unused `roberta.pooler.*` and `classifier.*`; roberta-base's tokenizer files; texts lowercased (DRhard's star_tokenizer.py keeps transformers 2.x's `do_lower_case`) | a jdr workdir | ANCE `model/models.py`; DRhard `star/train.py` (`--init_path`, config and tokenizer read from it), `preprocess.py` | |
| what you pass | the unzipped folder that holds config.json, as downloaded: `--config.model.init_from=models/ance/bm25-warmup` (a missing folder is refused in one line naming the download); jdr's own warm-up instead: `--config.model.init_from=runs/msmarco-bm25-warmup`, configs/bm25_neg.py's workdir | `--config.model.init_from=runs/bm25_warmup` | | |
| towers | shared, CLS + Dense(768) + LayerNorm, dot product | MiniLM's mean pooling, normalized, temperature 0.05 | DRhard `model.py` (`RobertaDot`) | cosines need a temperature for RankNet to have room |
| data | MS MARCO passage (`data.dataset`) | SciFact train | paper Sec. 7.1 | |
| hard negatives | 1 a query, uniform from the top 200 left after dropping positives from the warm-up's top 210 | the same | DRhard `star/prepare_hardneg.py` (`topk + 10`, filter, `[:topk]`), paper Sec. 6.1 | |
| random negatives | every other document of the batch | the same | paper Fig. 1b, DRhard `inbatch_train` | |
| batches | every training query once an epoch, with one of its positives drawn at random, epochs shuffled (`data.epoch_over=queries`) | the same | DRhard `dataset.py` (`TrainInbatchWithHardDataset`: its length is the queries', `random.choice` of a query's positives), `star/train.py` (the Trainer's random sampler) | an epoch's last batch runs on into the next epoch, where DRhard's is short (502,939 = 1,964 x 256 + 155): jdr's batches have one shape; `data.epoch_over=pairs` is jdr's other reading, every (query, positive) pair an epoch |
| weighting | one mean over every pair (`negatives.pair_weighting=batch_mean`) | the same | DRhard `model.py` | `:alpha` gives Eq. 13, alpha 0.1 |
| loss | RankNet, log(1 + exp(s_neg - s_pos)) | the same | paper Eq. 14; DRhard's two-way log-softmax | |
| optimizer | LAMB (weight norm clamped at 10), 1e-4, 1,000 warm-up steps, weight decay 0.01, clip 1.0 | AdamW 2e-5, 10 warm-up steps | DRhard README (`--optimizer_str lamb --learning_rate 1e-4`), `star/train.py` defaults, `lamb.py` | runlocal: the rate chosen on dev by `python -m jdr.reproduce scifact` |
| schedule | linear warm-up, then linear decay reaching 0 at step 196,500 (`optimizer.schedule_steps`): 100 epochs of 1,965 batches, so at step 50,000 the rate is 0.75 of its peak | decay to 0 at its last step | DRhard `star/train.py` (`num_train_epochs` 100; `get_linear_schedule_with_warmup` over the Trainer's total), README ("likely to converge within 50k steps ... you can manually kill the process") | runlocal: its own short schedule |
| batch | 256 queries | 32 | paper Sec. 7.1 | 2-core budget |
| lengths | queries 24, passages 120 tokens; mining with queries at 32 (`negatives.dense_static.query_length`), passages at 256 (`eval.doc_max_length`) | 32 / 256, mining too (jdr.reproduce's) | DRhard README (`star/train.py --max_query_length 24 --max_doc_length 120`; `prepare_hardneg.py --max_query_length 32 --max_doc_length 256`) | the evaluation encodes queries at the training length, 24, where DRhard's `star/inference.py` takes 32; runlocal: the table's shared lengths |
| corpus precision | float32: the warm-up's passage vectors mined in float32 (`negatives.dense_static.corpus_dtype=float32`) | the same | DRhard `prepare_hardneg.py` (float32 memmaps, a Faiss flat index) | `corpus_dtype=auto` keeps a bfloat16 corpus on GPUs and TPUs: half the memory, 0.9987 of the float32 top 200 on SciFact (docs/performance.md) |
| steps | 50,000 | 104 after a 104-step warm-up | DRhard README ("converges within 50k steps") | jdr.reproduce's 208-step budget |

  python -m jdr.train --config configs/bm25_neg.py:runlocal --workdir runs/bm25_warmup \\
      --config.data.dataset=../shared/data/scifact --config.num_train_steps=104 --config.optimizer.warmup_steps=10
  python -m jdr.train --config configs/star.py:runlocal --workdir runs/star \\
      --config.data.dataset=../shared/data/scifact --config.model.init_from=runs/bm25_warmup

The full recipe, from the released warm-up (MS MARCO passage in data/msmarco-passage):

  python -m jdr.train --config configs/star.py --workdir runs/msmarco-star \\
      --config.data.dataset=data/msmarco-passage --config.model.init_from=models/ance/bm25-warmup

Arguments: `runlocal` (above), `alpha` (the paper's Eq. 13 with alpha 0.1 instead of the code's batch mean).
"""

import math

import ance
import base
import inbatch

ARGS = dict(runlocal=False, alpha=False)

DRHARD_EPOCHS = 100  # star/train.py's num_train_epochs: the run its schedule plans, stopped by hand near 50k steps


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  c = inbatch.recipe(a)  # runlocal: the same budget and optimizer as the in-batch baseline
  c.negatives.source = "dense_static"
  c.negatives.dense_static.top_n = 200
  c.negatives.dense_static.extra = 10
  c.negatives.per_query = 1
  c.negatives.in_batch = True
  c.data.epoch_over = "queries"  # DRhard's dataset: each query once an epoch, with a positive drawn at random
  c.negatives.dense_static.corpus_dtype = "float32"  # DRhard mines on a float32 Faiss index
  if a.alpha:
    c.negatives.pair_weighting, c.negatives.random_weight = "alpha", 0.1
  else:
    c.negatives.pair_weighting = "batch_mean"
  c.loss.name = "ranknet"
  if a.runlocal:
    c.num_train_steps = 104
    c.optimizer.learning_rate = 2e-5  # chosen on dev by jdr.reproduce (docs/results.md)
    c.optimizer.warmup_steps = 10
    c.eval.doc_max_length = 256
  else:
    c.data.dataset, c.data.description = base.MSMARCO_PASSAGE
    c.model.init_from, c.model.description = ance.RELEASED_WARMUP  # ANCE's BM25 Neg warm-up, as the paper's
    c.model.pooling, c.model.normalize, c.model.projection_dim = "cls", 0, 768
    c.loss.temperature = 1.0
    c.batch_size = 256
    c.optimizer.name = "lamb"
    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_steps = 1000
    c.optimizer.weight_decay = 0.01
    c.num_train_steps = 50_000
    # DRhard's Trainer decays over all its epochs' batches; the paper's model is the one at 50k steps.
    c.optimizer.schedule_steps = DRHARD_EPOCHS * math.ceil(base.MSMARCO_TRAIN_QUERIES / c.batch_size)
    c.data.query_max_length, c.data.doc_max_length = 24, 120
    c.eval.doc_max_length = 256  # the static negatives are mined at prepare_hardneg's lengths
    c.negatives.dense_static.query_length = 32
  return c
