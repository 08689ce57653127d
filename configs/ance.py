"""ANCE (Xiong et al., ICLR 2021): negatives from the top-200 of the model's own ANN index, refreshed every m
steps by re-encoding the corpus in the background with a recent snapshot of the weights; tied towers.

As the authors ran it: each refresh trains on a chunk of the training queries, a fifth of them in turn; each
query of the chunk becomes 20 (query, positive, negative) triples with the one positive ANCE's loader keeps (the
last its qrels list), negatives drawn at random from its top 200 skipping that positive only; the chunk's
queries are shuffled and dealt in turn to 4 readers (ANCE's GPUs), each reading its queries' triples in order,
and a batch is the next 16 triples of each. The loss is one two-way softmax per triple, no in-batch negatives
(the paper argues against them).

| setting | full | runlocal | source | where jdr departs, and why |
|---|---|---|---|---|
| starting model | ANCE's released BM25-negative warm-up (`model.init_from`, default `models/ance/bm25-warmup`) | a warm-up of its own, from `configs/bm25_neg.py:runlocal` | paper Sec. 5 ("ANCE is also warmed up by BM25 negatives"); ANCE README ("ANCE training starts from a pretrained BM25 warmup checkpoint") | runlocal: MiniLM, not RoBERTa-base |
| where it is published | ANCE README, "pretrained BM25 warmup checkpoint" (60K steps, MS MARCO dev MRR@10 0.311): https://webdatamltrainingdiag842.blob.core.windows.net/semistructstore/OpenSource/warmup_checpoint.zip; DRhard's README links the same model on Google Drive (file id 1URYU1gxNgcuC81jPAev1ksZjMKgQQFoD) | none: jdr trains it | ANCE README (Results, Warmup for Training) | |
| its format | ANCE's `RobertaDot_NLL_LN` as transformers 2.3's `save_pretrained` writes it: config.json and pytorch_model.bin with `roberta.*`, `embeddingHead.{weight,bias}` (Linear 768->768) and `norm.{weight,bias}` (LayerNorm) on [CLS], no normalization, plus the unused `roberta.pooler.*` and `classifier.*` of RobertaForSequenceClassification; roberta-base's tokenizer files beside them; texts are lowercased before tokenizing | a jdr workdir | ANCE `model/models.py`, `drivers/run_warmup.py` (model and tokenizer `save_pretrained`), `data/msmarco_data.py` (`do_lower_case=True`) | |
| what you pass | the unzipped folder that holds config.json, as downloaded: `--config.model.init_from=models/ance/bm25-warmup` (a missing folder is refused in one line naming the download); jdr's own warm-up instead: `--config.model.init_from=runs/msmarco-bm25-warmup`, configs/bm25_neg.py's workdir | `--config.model.init_from=runs/bm25_warmup` | | |
| towers | shared, CLS + Dense(768) + LayerNorm, dot product | MiniLM's mean pooling, normalized, temperature 0.05 | paper Sec. 5 (BERT-Siamese, 768 projection + LayerNorm) | cosines need a temperature |
| data | MS MARCO passage (`data.dataset`) | SciFact train | paper Sec. 5 | |
| negatives | 20 triples a query a refresh (`negatives.ance.triples_per_query`), uniform from its top 200 without the positive it trains with; its other positives can be drawn, as ANCE's (`negatives.ance.triples_over=queries`) | the same | ANCE `run_train.sh` (`--negative_sample 20 --topk_training 200`), `run_ann_data_gen.py` (`load_positive_ids` keeps one positive a query; `GenerateNegativePassaageID` skips only it), `msmarco_data.py` (`GetTripletTrainingDataProcessingFn`) | the triples are drawn lazily per (seed, generation, pair), so 20 costs nothing at SciFact size; `triples_over=pairs` is jdr's other reading: every (query, positive) pair, negatives skipping all the query's positives |
| queries a refresh | one chunk: generation g trains on chunk g mod 5 of the training queries in their fixed order, 502,939 // 5 each (`negatives.ance.refresh_chunks=5`) | the same (SciFact: 161 of 809) | ANCE `run_ann_data_gen.py` (`--ann_chunk_factor`, 5 by default; `effective_idx = output_num % chunk_factor`) | every query's top 200 is still mined at each refresh (the diagnostics compare them); `refresh_chunks=1` trains on every query at every refresh |
| loss | NLL of the positive in a softmax over (positive, negative), no in-batch | the same | ANCE `model.py` (`rdot_nll`), paper Eq. 5 | |
| refresh | every 10,000 steps, in force when mined | every 34 steps, in force 17 after | paper Sec. 5 | jdr switches on a fixed schedule so a resume is exact |
| optimizer | LAMB (weight norm clamped at 10), 1e-6, 5,000 warm-up steps, no weight decay | AdamW 2e-5, 10 warm-up steps | ANCE `run_train.sh` (`--optimizer lamb`, `--learning_rate 1e-6`, `--warmup_steps 5000`), `run_ann.py` (weight_decay 0), `utils/lamb.py` | runlocal: the rate chosen on dev by `python -m jdr.reproduce scifact` |
| schedule | one linear warm-up and decay reaching 0 at step 1,000,000 (`optimizer.schedule_steps`), so at step 600,000 the rate is 0.40 of its peak | decay to 0 at its last step | ANCE `run_train.sh` (`--single_warmup`, no `--max_steps`), `run_ann.py` (`max_steps` 1,000,000 by default) | runlocal: its own short schedule |
| batch | 64 triples: 16 consecutive triples from each of 4 readers (8 a GPU x 4 GPUs x 2 accumulated; `negatives.ance.triple_readers=4`) | 32: 8 from each of 4 | ANCE `run_train.sh` (4 GPUs), `run_ann.py` (a chunk's lines cut to a multiple of the GPUs, line i read by GPU i mod 4; `StreamingDataset` yields a line's triples in order) | 2-core budget; a reader at the end of its lines goes on from its first, where ANCE's last micro-batch of a pass is short; `triple_readers=0` shuffles the triples across queries |
| corpus precision | float32: the passages mined in float32 (`negatives.ance.corpus_dtype=float32`) | the same | ANCE `run_ann_data_gen.py` (Faiss `IndexFlatIP` over float32 vectors) | `corpus_dtype=auto` keeps a bfloat16 corpus on GPUs and TPUs (docs/performance.md) |
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
  c.negatives.ance.top_n = 200
  c.negatives.per_query = 1
  c.negatives.ance.triples_per_query = 20
  c.negatives.in_batch = False
  c.negatives.ance.triples_over = "queries"  # one positive a query, its other positives not skipped (ANCE's)
  c.negatives.ance.refresh_chunks = 5  # ANCE's ann_chunk_factor: a fifth of the queries each refresh
  c.negatives.ance.triple_readers = 4  # ANCE's 4 GPUs, each reading its lines' triples in order
  c.negatives.ance.corpus_dtype = "float32"  # ANCE mines on a float32 Faiss index
  c.loss.name = "softmax_nll"
  if a.runlocal:
    c.num_train_steps = 104
    c.optimizer.learning_rate = 2e-5  # chosen on dev by jdr.reproduce (docs/results.md)
    c.optimizer.warmup_steps = 10
    c.negatives.ance.refresh_every = 34
    c.negatives.ance.refresh_delay = 17
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
    c.optimizer.schedule_steps = 1_000_000  # run_ann.py's max_steps, over which --single_warmup decays
    c.negatives.ance.refresh_every = 10_000
    c.negatives.ance.refresh_delay = 10_000
  return c
