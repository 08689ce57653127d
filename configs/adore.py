"""ADORE (Zhan et al., SIGIR 2021): train only the query tower against a full retrieval at every step over a
fixed document index, LambdaRank with M = MRR@K over the retrieved list.

The recipe runs what DRhard's adore/train.py (the code behind the paper's tables) runs. At every step each
query's top 200 come from the index; a query none of whose 200 is relevant gets all its positives appended
after them; every (relevant, irrelevant) pair of the list costs |1/p_i - 1/p_j| * log(1 + exp(s_j - s_i)),
p its position in the list, 1/p read as 0 beyond K; a query's loss is the mean over its pairs.

| setting | full | runlocal | source | where jdr departs, and why |
|---|---|---|---|---|
| starting model | DRhard's released STAR model (`model.init_from`, default `models/drhard/star`): its query encoder trains, its document encoder indexes | the bundled MiniLM | paper Sec. 6.3 ("using STAR to train the document encoder and using ADORE to further train the query encoder"); DRhard README (`adore/train.py --init_path ./data/passage/trained_models/star`, "our provided STAR checkpoint as the fixed document encoder") | runlocal: offline and CPU-sized |
| where it is published | DRhard README, passage table, STAR's "Model": https://drive.google.com/drive/folders/1bJw8P15cFiV239mTgFQxVilXMWqzqXUU (dev MRR@10 0.340) | none | DRhard README (Retrieval Results and Trained Models) | |
| its format | DRhard's `RobertaDot` as `save_pretrained` writes it: config.json and pytorch_model.bin with `roberta.*` (no pooler), `embeddingHead.{weight,bias}` (Linear 768->768) and `norm.{weight,bias}` (LayerNorm) on [CLS], no normalization; one tower for queries and passages; roberta-base's tokenizer (transformers 2.x behaviour, lowercased: star_tokenizer.py) | MiniLM | DRhard `model.py` (`RobertaDot`), `star/inference.py`, README (Data Preprocess) | |
| what you pass | the downloaded folder that holds config.json: `--config.model.init_from=models/drhard/star` (a missing folder is refused in one line naming the download); jdr's own STAR instead: `--config.model.init_from=runs/msmarco-star`, configs/star.py's workdir; configs/ltre.py keeps its own starting model | nothing | | |
| towers | query tower trained; the document tower frozen, the corpus encoded once | the same (MiniLM's shared tower split in two) | DRhard adore/train.py (only the query encoder is loaded; passage vectors read from a memmap) | |
| data | MS MARCO passage | SciFact train | DRhard README | runlocal: offline |
| candidates | top 200 of the whole index, retrieved at every step | the same | adore/train.py (`--neg_topk 200`, `index.search` in the loop) | |
| no relevant in the top n | every positive of the query appended after the n (`negatives.retrieval.missing_positive=append`) | the same | adore/train.py (`np.hstack` of the query's positives when `target_labels` sums to 0) | jdr's rows are (query, positive) pairs, so its batch positive is appended first (the appended ones all weigh 1/p_j against a retrieved p_j, so their order changes nothing) |
| batches | an epoch over every (query, positive) pair (`data.epoch_over=pairs`) | the same | DRhard adore/train.py (`TrainQueryDataset`: every training query once an epoch, `RandomSampler`) | a departure still open: DRhard goes over queries, `data.epoch_over=queries` (configs/star.py's); this recipe's SciFact rows were trained over pairs |
| pair weight | abs(1/p_i - 1/p_j), p the list position, 0 beyond K (`loss.lambda_delta=positions`) | the same | adore/train.py `metric_weights`; JPQ run_train.py `compute_loss` | `:ndcg` takes the exact swap change: the authors wrote no NDCG weight |
| K | MRR@200 | MRR@10 | DRhard README (passage: `--metric_cut 200`) | runlocal keeps the cut its runs were chosen with |
| pair loss | log(1 + exp(s_irrelevant - s_relevant)), mean over the pairs, weight-0 pairs counted | the same | adore/train.py (`C_pos` on (relevant, irrelevant) pairs, `C_neg` on the reverse order: the same charge for each, over twice the pairs); paper (LambdaLoss over RankNet); JPQ run_train.py | |
| optimizer | AdamW 5e-6, betas (0.9, 0.999), eps 1e-8, weight decay 0.01 (not biases, LayerNorm) | AdamW 1e-4 | adore/train.py defaults | runlocal: the rate `python -m jdr.reproduce scifact` chose on a dev split |
| schedule | 2,000 warm-up steps, then linear decay reaching 0 at step 94,302 (`optimizer.schedule_steps`): 6 epochs of 15,717 batches, so at step 60,000 the rate is 0.37 of its peak | 20 warm-up steps, decay to 0 at its last step | adore/train.py (`get_linear_schedule_with_warmup` over `t_total = len(train_dataloader) * num_train_epochs`, 6 epochs) | runlocal: scaled to its steps |
| corpus precision | float32: the index searched and scored in float32 (`negatives.retrieval.corpus_dtype=float32`, the `:jax` search's storage; Faiss's is float32 always) | the same | adore/train.py (a float32 memmap of passage vectors; Faiss `Flat`, `useFloat16 = False` on GPUs) | `corpus_dtype=auto` keeps a bfloat16 corpus on GPUs and TPUs: half the memory (docs/performance.md) |
| gradient clip | global norm 1.0 | the same | adore/train.py `--max_grad_norm` | |
| batch | 32 | 32 | adore/train.py `--per_gpu_batch_size` | |
| query tokens | 64 | 32 | adore/train.py `--max_seq_length` | runlocal: SciFact's claims are short |
| document tokens | 256 (the index) | 256 | DRhard README (`star/inference.py --max_doc_length 256` for passages) | |
| dropout | 0.1, on in the query tower | 0.1 | RoBERTa's config; `model.train()` in adore/train.py | |
| temperature | 1 (raw inner products) | 0.05 | adore/train.py | runlocal: MiniLM's cosines in [-1, 1] need room |
| steps | 60,000 | 208 | adore/train.py runs 6 epochs; the README sees the gain within one | jdr's budget between the two |

Arguments (comma-separated, after the colon; another name is an error):
  runlocal    the scaled-down run above (a 2-core x86 CPU, SciFact)
  ranknet     RankNet instead of LambdaRank (the LTRe / ADORE ablation)
  ndcg        LambdaRank with M = NDCG@10 (exact swap weights)
  static      candidates retrieved once before training, then fixed (isolates "dynamic")
  jax         retrieval inside the jitted step (exact JAX top-k on the mesh) instead of Faiss on the host
  pq          train and serve on an OPQ48,IVF1,PQ48 index (LTRe Table 4); evaluated on it and on Flat

  python -m jdr.train --config configs/adore.py:runlocal --workdir runs/adore \\
      --config.data.dataset=../shared/data/scifact

The full recipe, from the released STAR model (MS MARCO passage in data/msmarco-passage):

  python -m jdr.train --config configs/adore.py --workdir runs/msmarco-adore \\
      --config.data.dataset=data/msmarco-passage --config.model.init_from=models/drhard/star
"""

import math

import base

ARGS = dict(runlocal=False, ranknet=False, ndcg=False, static=False, jax=False, pq=False)

DRHARD_EPOCHS = 6  # adore/train.py's num_train_epochs: its schedule's length; the paper reports earlier

# DRhard's released STAR model (passage), which ADORE's query encoder starts from and whose document encoder
# indexes the corpus: (path, what it holds and where it is published), said in full when the folder is missing.
RELEASED_STAR = (
    "models/drhard/star",
    "DRhard's released STAR model: the folder holding config.json and pytorch_model.bin (RobertaDot: roberta.* + "
    "embeddingHead + norm on [CLS]) downloaded from https://drive.google.com/drive/folders/"
    "1bJw8P15cFiV239mTgFQxVilXMWqzqXUU (jingtaozhan/DRhard README, passage STAR, Model)")


def get_config(arg=None):
  a = base.parse_arg(arg, **ARGS)
  c = recipe(a)
  if not a.runlocal:
    c.model.init_from, c.model.description = RELEASED_STAR
  return c


def recipe(a):
  """The recipe for parsed arguments `a` (configs/ltre.py and adore_star.py pass theirs)."""
  c = base.get_config()
  c.model.shared = False
  c.model.train_towers = "query"
  c.negatives.source = "retrieval"
  c.negatives.retrieval.top_n = 200
  c.negatives.retrieval.every = 0 if a.static else 1
  c.negatives.retrieval.backend = "jax" if a.jax else "faiss"
  c.negatives.in_batch = False
  c.negatives.retrieval.missing_positive = "append"
  # DRhard searches and scores a float32 index (the :jax search's storage)
  c.negatives.retrieval.corpus_dtype = "float32"
  c.loss.name = "ranknet" if a.ranknet else "lambdarank"
  c.loss.lambda_metric = "ndcg@10" if a.ndcg else "mrr@10" if a.runlocal else "mrr@200"
  c.loss.lambda_delta = "exact" if a.ndcg else "positions"
  c.optimizer.name = "adamw"
  c.optimizer.learning_rate = 5e-6
  c.optimizer.weight_decay = 0.01
  c.optimizer.b1, c.optimizer.b2, c.optimizer.eps = 0.9, 0.999, 1e-8
  c.optimizer.grad_clip_norm = 1.0
  c.optimizer.warmup_steps = 2000
  c.batch_size = 32
  c.model.dropout = 0.1
  c.data.doc_max_length = 256  # the fixed index is encoded at this length
  c.eval.doc_max_length = 256
  if a.pq:
    c.negatives.retrieval.index_factory = "OPQ48,IVF1,PQ48"
    c.eval.factories = "OPQ48,IVF1,PQ48;Flat"
    c.eval.backend = "faiss"
  if a.runlocal:
    c.data.dataset, c.data.description = base.shared("scifact")
    c.data.query_max_length = 32
    c.num_train_steps = 208
    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_steps = 20
    c.loss.temperature = 0.05
    c.checkpoint_every = 104
    c.log_every = 8
  else:
    c.data.dataset, c.data.description = base.MSMARCO_PASSAGE
    c.data.eval_split = "dev"
    # A trained STAR model: its document tower indexes the corpus, its query tower trains (DRhard README).
    c.model.init_from, c.model.description = base.STAR
    c.model.pooling, c.model.normalize, c.model.projection_dim = "cls", 0, 768
    c.loss.temperature = 1.0
    c.data.query_max_length = 64
    c.num_train_steps = 60_000
    # t_total = len(train_dataloader) * num_train_epochs: 6 epochs of ceil(502,939 / 32) batches
    c.optimizer.schedule_steps = DRHARD_EPOCHS * math.ceil(base.MSMARCO_TRAIN_QUERIES / c.batch_size)
  return c
