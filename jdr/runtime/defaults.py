"""Shared defaults of every jdr recipe: `get_config()` returns the base ConfigDict.

Recipes in configs/ start from these (through configs/base.py, which recipes import as `base`) and change
what differs; library code that needs a full config (the benchmarks) imports this module instead of
putting configs/ on sys.path. Not a recipe by itself.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  del arg
  c = ml_collections.ConfigDict()
  c.seed = 0  # the data order, negatives, dropout and fresh weights all follow from it

  # --- data ---
  c.data = ml_collections.ConfigDict()
  c.data.kind = "pairs"  # "pairs" (supervised qrels) | "pretrain" (ICT / BFS / WLP pairs from articles)
  # A BEIR directory (corpus.jsonl, queries.jsonl, qrels/SPLIT.tsv) or MS MARCO's own files (collection.tsv,
  # queries.SPLIT.tsv, qrels.SPLIT.tsv: split dev.small reads qrels.dev.small.tsv; jdr/data/msmarco.py)
  c.data.dataset = "builtin"  # "builtin" (stdlib docstrings) or a BEIR / MS MARCO directory
  c.data.description = ""  # what the recipe's data is, said when it is missing ("" = any dataset directory)
  c.data.source = "files"  # "files" (read the directory) or "tfds" (the jdr TFDS builder's array_record)
  c.data.tfds_data_dir = ""  # where TFDS keeps prepared data ("" = WORKDIR/tfds)
  c.data.train_split = "train"  # qrels/SPLIT.tsv (MS MARCO: qrels.SPLIT.tsv) of the training pairs
  c.data.eval_split = "test"  # the qrels evaluated before, during and after training ("" = none)
  c.data.train_fraction = 1.0  # < 1 trains on a fixed subset of the training queries (by a hash of the id)
  # pairs: each epoch every (query, positive) pair once, so a query with several positives can fill several rows
  # of a batch; queries: every training query once, with one of its positives drawn at random (DRhard's STAR)
  c.data.epoch_over = "pairs"  # pairs | queries (see above)
  # Several datasets in one run, each batch from one of them; jdr/data/mixture.py has the grammar and the options
  # (weight, negatives, in_batch, prompt, split, source, mined, static_run, triples_file, name) and what is refused
  c.data.mixture = ""  # "" = off; "DIR:weight=2,negatives=bm25,in_batch=0,prompt='q: ',split=train;DIR2": the first DIR's data.eval_split is evaluated
  c.data.mixture_sampling = "proportional"  # data.mixture: each step's dataset drawn by weight | round_robin (by weight, in turn)
  c.data.query_max_length = 32  # training tokens per query (an export serves longer ones)
  c.data.doc_max_length = 128  # training tokens per document (a cross-encoder: per pair)
  # data.kind="pretrain" (jdr/data/pretrain_batches.py); data.dataset may name the Wikispeedia directory
  c.data.pretrain_source = "wikispeedia"  # "wikispeedia" | "builtin" (stdlib modules) | a Wikipedia XML dump
  c.data.pretrain_task = "mixed"  # ict | bfs | wlp | mixed (ICT+BFS+WLP) | mlm (the masked-LM baseline)
  c.data.keep_sentence_prob = 0.1  # ICT: the query sentence stays in its document this often

  # --- model ---
  c.model = ml_collections.ConfigDict()
  c.model.architecture = "two_tower"  # "two_tower" | "cross_encoder" (pairs [CLS] q [SEP] d: a reranker / teacher)
  c.model.init_from = "minilm"  # "minilm", a Hugging Face dir or hub id, a jdr workdir / export, or "" (fresh)
  # A sentence-transformers directory's prompts, or a jdr model's recorded ones, are "the model's own".
  c.model.doc_init_from = ""  # a second published dir or hub id for the document tower (DPR's context encoder); needs model.shared=False
  c.model.query_prompt = "auto"  # text put before every query ("query: ", an instruction); auto = the model's own, "" = none
  c.model.doc_prompt = "auto"  # text put before every document ("passage: "); auto = the model's own, "" = none
  c.model.description = ""  # what the recipe's starting model is, said when init_from is missing
  c.model.fresh = "tiny"  # architecture for init_from="": "tiny" (2x64), "small" (4x256), "mini" (6x384), "base" (12x768)
  c.model.tower = "transformer"  # "transformer" | "bow_mlp" (Chang et al.'s BoW-MLP; fresh weights only)
  c.model.tokenizer = ""  # "" = init_from's own (the MiniLM one for fresh models)
  c.model.pooling = ""  # "" = the checkpoint's own (mean for minilm, cls otherwise)
  c.model.normalize = -1  # -1 = the checkpoint's own, 0 = off, 1 = L2-normalize
  c.model.projection_dim = 0  # 0 = the checkpoint's head, if any; N adds Dense(N) + LayerNorm (the ANCE / STAR head)
  c.model.shared = True  # one tower for queries and documents
  c.model.train_towers = "both"  # "both" or "query" (ADORE / LTRe keep the document tower fixed)
  c.model.dtype = "auto"  # compute dtype: float32, bfloat16, or auto (bfloat16 on GPU / TPU, float32 on CPU)
  c.model.remat = False  # recompute each layer's activations in the backward pass: less memory, more time
  # > 0: in the train step the towers encode a batch's rows this many at a time (jax.lax.map), their
  # [rows, heads, L, L] attention tensors then fit a CPU's cache, which makes long documents train faster
  # there (docs/performance.md, `fgd-step`). Same math; each chunk draws its own dropout masks. 0 = all rows at
  # once (accelerators want big batches).
  c.model.encode_chunk_rows = 0  # encode this many rows at a time in the step (0 = all; see above)
  c.model.dropout = 0.1  # hidden and attention dropout of the encoders
  # At 0 the attention runs fused (cuDNN on GPUs), whose kernel draws no dropout mask.
  c.model.attention_dropout = -1.0  # dropout of the attention probabilities alone; -1 = model.dropout
  # auto: cuDNN's fused kernel on GPUs when no attention dropout is drawn, else einsums. flash: jdr's Pallas
  # kernel, which draws attention dropout itself (GPUs; interpreted, slowly, elsewhere).
  c.model.attention = "auto"  # auto | einsum | fused | flash (jdr's GPU kernel, draws attention dropout itself)
  # LoRA on a decoder tower (Llama / Mistral / Qwen): the encoder's weights stay frozen (no gradients, no optimizer
  # moments) and low-rank adapters on the named projections train; the head, if any, trains too.
  c.model.lora_rank = 0  # adapters' rank r (0 = no LoRA: every weight trains)
  c.model.lora_alpha = 16.0  # the adapters' output is scaled by lora_alpha / lora_rank (PEFT's scaling)
  c.model.lora_dropout = 0.0  # dropout on the adapters' input
  c.model.lora_targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # projections with adapters
  c.model.param_dtype = "auto"  # decoders' weight storage: float32, bfloat16, or auto (bfloat16 for a base LoRA freezes when computing in bfloat16)
  c.model.append_eos = False  # put the tokenizer's EOS token after every text (RepLLaMA: the token a decoder pools)

  # --- negatives and loss: together they are the method ---
  c.negatives = ml_collections.ConfigDict()
  c.negatives.source = "none"  # none | random | bm25 | bm25_random | static | triples | mined | dense_static | ance
  # | retrieval
  c.negatives.per_query = 0  # sampled negatives per query
  c.negatives.in_batch = True  # other queries' documents in the batch are negatives too
  c.negatives.mask_duplicate_texts = True  # a negative whose text is one of the query's positives' (another id) is masked
  c.negatives.hardest_in_batch = False  # NCE Neg: keep only the highest-scored negative per query
  # How pairwise losses weigh a token batch's pairs: none (each query's mean, then the mean over queries) |
  # batch_mean (one mean over every pair of the batch: STAR's code) | alpha (STAR's Eq. 13, random_weight below)
  c.negatives.pair_weighting = "none"  # none | batch_mean (STAR's code) | alpha (STAR's Eq. 13)
  c.negatives.random_weight = 0.0  # pair_weighting=alpha: weight of the batch's other docs as random negatives
  # Each group below belongs to one unit, which alone reads it (jdr/negatives/sources.py: `SOURCES` names each
  # source's group); the keys above are read for every source by the batches and the step.
  # In-batch false negatives by a guide (jdr/training/guide.py, GISTEmbed): a negative the guide scores above the
  # row's positive is masked
  c.negatives.guide = ml_collections.ConfigDict()
  c.negatives.guide.model = ""  # "" = off | self (the trained model's own scores) | a bi-encoder or jdr cross-encoder
  c.negatives.guide.margin = 0.0  # masked when guide(q, neg) > guide(q, pos) - margin (< 0: only clearly above)
  c.negatives.bm25 = ml_collections.ConfigDict()  # sources bm25 and bm25_random
  c.negatives.bm25.top_k = 100  # BM25 pool the hard negatives are drawn from (ANCE / DPR: top 100)
  c.negatives.static = ml_collections.ConfigDict()
  c.negatives.static.run = ""  # TREC run of a warm-up model (static source)
  # triples: each query's negatives from its lines of MS MARCO's triples.train.small.tsv (query, positive and
  # negative passage texts), mapped to rows once and cached beside the prepared corpus (jdr/data/triples.py)
  c.negatives.triples = ml_collections.ConfigDict()
  c.negatives.triples.file = ""  # triples source: the file ("" = data.dataset's triples.train.small.tsv)
  c.negatives.triples.skip_invalid = False  # triples source: count and skip unmatched or bad lines, not stop
  # mined: Tevatron's JSONL (v1, v2) or sentence-transformers' rows (JSONL, Parquet), jdr/negatives/training_files.py
  c.negatives.mined = ml_collections.ConfigDict()
  c.negatives.mined.file = ""  # mined source: a `python -m jdr.mine` directory, or a file of training records with negatives
  # dense_static (STAR): the starting model's own top n, mined once and cached
  c.negatives.dense_static = ml_collections.ConfigDict()
  c.negatives.dense_static.top_n = 200  # pool depth (the papers' 200)
  c.negatives.dense_static.extra = 0  # mines top_n + this, drops positives, keeps top_n (STAR: 10)
  c.negatives.dense_static.query_length = 0  # mines with queries of this many tokens (0 = data.query_max_length)
  c.negatives.dense_static.backend = "auto"  # where it mines: auto (the JAX top-k on the devices
  # when there is an accelerator, else Faiss on the host) | faiss | jax
  c.negatives.dense_static.corpus_dtype = "auto"  # the corpus mined, on the devices: auto (bfloat16 on GPU/TPU,
  # float32 on CPU) | float32 | bfloat16 | int8 (one scale per row, approximate); scores are float32 always
  # ance: the model's own top-n, re-mined in the background every refresh_every steps
  c.negatives.ance = ml_collections.ConfigDict()
  c.negatives.ance.top_n = 200  # pool depth (the papers' 200)
  c.negatives.ance.backend = "auto"  # where it mines: auto (the JAX top-k on the devices
  # when there is an accelerator, else Faiss on the host) | faiss | jax
  c.negatives.ance.corpus_dtype = "auto"  # the corpus mined, on the devices: auto (bfloat16 on GPU/TPU, float32
  # on CPU) | float32 | bfloat16 | int8 (one scale per row, approximate); scores are float32 always
  c.negatives.ance.refresh_every = 0  # m: steps between snapshots (0 = never; ance needs >= 1)
  c.negatives.ance.refresh_delay = 0  # a snapshot's negatives come into force this many steps after it
  c.negatives.ance.refresh_max_wait_s = -1.0  # wait for a late refresh at most this long (-1 = always: exact resume)
  c.negatives.ance.triples_per_query = 0  # each refresh turns every pair into this many triples (ANCE: 20)
  # ance's triples (jdr/data/refresh_triples.py): queries = each query once a generation with the last positive
  # its qrels list, negatives skipping only that positive (ANCE's); pairs = every (query, positive) pair,
  # negatives skipping all of the query's positives
  c.negatives.ance.triples_over = "pairs"  # queries (ANCE's) | pairs (see above)
  c.negatives.ance.refresh_chunks = 1  # generation g trains on chunk g mod this of the training queries (ANCE: 5)
  # A generation's lines (a query's triples) dealt in turn to this many readers, each reading its triples
  # in order, a batch the next batch_size / readers of each (ANCE's 4 GPUs); 0 = triples shuffled across queries
  c.negatives.ance.triple_readers = 0  # readers of consecutive triples (ANCE: 4); 0 = shuffled (see above)
  # retrieval (ADORE / LTRe): a fixed corpus index, candidates retrieved by the query tower being trained
  c.negatives.retrieval = ml_collections.ConfigDict()
  c.negatives.retrieval.top_n = 200  # retrieval depth (the papers' 200)
  c.negatives.retrieval.every = 1  # 1 = at every step (ADORE / LTRe); 0 = once before training (static ablation)
  c.negatives.retrieval.missing_positive = "append"  # none of the top n relevant: append (DRhard) | replace_last (LTRe Alg. 1)
  c.negatives.retrieval.backend = "faiss"  # faiss (host, between steps) | jax (exact top-k inside the step)
  c.negatives.retrieval.top_k_recall_target = 1.0  # backend=jax: < 1 takes jax.lax.approx_max_k (fast on TPUs)
  c.negatives.retrieval.corpus_dtype = "auto"  # the fixed corpus on the devices: auto (bfloat16 on GPU/TPU, float32 on
  # CPU) | float32 | bfloat16 | int8 (one scale per row, approximate); scores are float32 always
  c.negatives.retrieval.index_factory = "Flat"  # Faiss factory of the fixed index, e.g. "OPQ48,IVF1,PQ48" (LTRe Table 4)
  c.negatives.retrieval.corpus_encoding = ""  # a jdr.encode directory to use as the fixed index ("" = encode at start)
  c.loss = ml_collections.ConfigDict()
  c.loss.name = "softmax_nll"  # softmax_nll | ranknet | lambdarank | hinge | bce
  c.loss.temperature = 1.0  # scores are divided by it (softmax_nll)
  c.loss.margin = 1.0  # hinge
  c.loss.lambda_metric = "mrr@10"  # lambdarank: |delta M| of swapping a pair, M = mrr@K or ndcg@K
  c.loss.lambda_delta = "positions"  # |1/p_i - 1/p_j|, p = list position (DRhard; mrr only) | exact (swap by score)
  c.loss.logq_correction = False  # sampled softmax: score - log Q(doc), Q from the batch's `doc_logq`
  # Matryoshka (Kusupati et al. 2022): the loss (contrastive, ranking and distillation terms) summed over the
  # embedding's first d dimensions for each d listed, re-normalized where the towers normalize, so each prefix is
  # a usable embedding (`jdr.encode --dim d`); the full width trains only when listed
  c.loss.matryoshka_dims = ""  # e.g. "384,256,128,64": the prefixes the loss is summed over; "" = off
  c.loss.matryoshka_weights = ""  # one weight per dim, same order ("" = 1 each, as sentence-transformers)

  # --- gradient caching (jdr/training/gradcache.py): encode the batch in chunks of this many rows; 0 = off ---
  # --- distillation from a cross-encoder (jdr/training/distill.py): FGD and document-level KD ---
  c.distill = ml_collections.ConfigDict()
  c.distill.teacher = ""  # a cross-encoder (jdr workdir / export, HF directory) | mined (negatives.mined.file's
  # scores); "" = no distillation
  c.distill.document = False  # document-level KD (the "brute-force" baseline, FGD Eq. 5): listwise KL
  c.distill.margin_mse = False  # MarginMSE over each query's positive and negatives (Hofstaetter et al., 2020)
  c.distill.granularities = "passage,sentence"  # FGD levels (Eq. 12); "" = none
  c.distill.passage_tokens = 128  # FGD passage windows, in tokens
  c.distill.sentence_tokens = 64  # FGD sentence windows, in tokens
  c.distill.pooling = "attention"  # student piece vectors: attention (Eq. 7) | mean ("FG pooling")
  c.distill.contrastive_weight = 1.0  # lambda of Eq. 13
  c.distill.negative_pieces = 0  # 0 = every window of the negative documents; m = Eq. 14-15's hierarchy, top m
  c.distill.temperature = 1.0  # the teacher's logits / this; the student's scores / loss.temperature
  # Pairs per teacher batch; 0 = by tokens, as jdr.rerank and jdr.encode batch (about 1,024 padded tokens a
  # batch on a CPU, 16,384 on accelerators): token batches score faster than a fixed count on a CPU
  # (docs/performance.md, `cross-encoder`), and FGD's 64- to 512-token pieces vary in length.
  c.distill.teacher_batch_size = 0  # pairs per teacher batch (0 = by tokens; see above)

  c.grad_cache = ml_collections.ConfigDict()
  c.grad_cache.chunk_size = 0  # rows encoded at a time under exact gradient caching (0 = off)

  # --- optimizer (LTRe / STAR: AdamW, warm-up then linear decay, weight decay 0.01) ---
  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = "adamw"  # adamw | lamb (STAR / ANCE's, weight norm clamped at 10) | optax_lamb
  c.optimizer.learning_rate = 2e-5  # peak, after the warm-up; then linear decay to 0
  c.optimizer.warmup_steps = 100  # linear warm-up from 0
  # The authors' schedules span the run they planned; their papers stop earlier, at num_train_steps
  c.optimizer.schedule_steps = 0  # the step where the linear decay reaches 0 (0 = num_train_steps)
  c.optimizer.weight_decay = 0.01  # decoupled, not on biases and LayerNorm
  c.optimizer.b1 = 0.9  # Adam / LAMB first-moment decay
  c.optimizer.b2 = 0.999  # second-moment decay
  c.optimizer.eps = 1e-8  # added to the second moment's square root
  c.optimizer.grad_clip_norm = 1.0  # 0 = no clipping

  # --- loop ---
  c.batch_size = 32  # global, over all devices and hosts
  c.num_train_steps = 1000  # optimizer steps
  c.log_every = 10  # steps between lines of WORKDIR/metrics.jsonl (means over the steps since)
  c.eval_every = 0  # 0 = only before training and at the end
  c.eval_before_training = True  # evaluate the starting model too (step 0)
  c.checkpoint_every = 500  # steps between checkpoints (also saved at the end and on SIGTERM / SIGINT; 0 = only then)
  c.keep_checkpoints = 3  # the newest N checkpoints are kept

  # --- evaluation ---
  c.eval = ml_collections.ConfigDict()
  c.eval.metrics = "ndcg@10,mrr@10,recall@100"  # jdr.evaluation.metrics names, comma-separated
  c.eval.top_k = 100  # documents retrieved per evaluation query
  # What the evaluations before and during training score (jdr/evaluation/periodic.py: Evaluator, periodic_kind):
  # full = the whole corpus, encoded each time; bm25 / run = each query's BM25 / run-file candidates, re-ranked
  # (only they are encoded: the cost follows the queries, not the corpus; metrics prefixed "bm25-top100/");
  # auto = run when eval.candidates_run is set, else full when queries x depth >= documents or the document
  # tower is frozen, else bm25
  c.eval.candidates = "auto"  # auto | full | bm25 | run (see above)
  # 100: ANCE / DPR's BM25 depth, 10x cheaper than 1,000; @10 metrics come out near the full corpus's
  # (docs/performance.md, `eval-candidates`), recall@depth is the candidates' own: 1000 to follow recall@100
  c.eval.candidates_depth = 100  # candidates per query (see above)
  c.eval.candidates_run = ""  # eval.candidates=run: a TREC run or MS MARCO top1000.dev.tsv (jdr/data/run_arrays.py)
  c.eval.final = "full"  # the end of training: full (streamed, resumable; plus the periodic kind) | candidates
  c.eval.backend = "jax"  # jax (exact top-k on the mesh) | faiss
  c.eval.corpus_dtype = "float32"  # backend=jax storage: float32 keeps reported metrics exact on every platform
  # (auto = bfloat16 on GPU/TPU, as negatives.retrieval.corpus_dtype; int8 approximate)
  c.eval.max_queries = 0  # 0 = every query of the eval split
  c.eval.doc_max_length = 0  # 0 = data.doc_max_length
  c.eval.tokens_per_batch = 0  # 0 = jdr.encode's default for the device (small on CPU, large on GPU/TPU)
  c.eval.corpus_cache = ""  # a folder of corpus vectors by document side: a run encoding one again reads them
  # cross-encoders are evaluated by reranking a first stage (eval.rerank_run, or BM25 when "")
  c.eval.rerank_run = ""  # cross-encoders: the first-stage TREC run they rerank ("" = BM25)
  c.eval.rerank_depth = 100  # cross-encoders: documents reranked per query
  c.eval.rerank_batch_size = 0  # 0 = about 1,024 tokens a batch on CPU, 16,384 on accelerators (as jdr.encode)
  c.eval.factories = "Flat"  # Faiss indexes to evaluate on, ';'-separated ("Flat;OPQ48,IVF1,PQ48")
  c.eval.diagnostic_queries = 200  # training queries for the overlap diagnostics (0 = off)
  # The suite (jdr/evaluation/suite.py): small tasks of other domains scored at every evaluation beside the run's
  # own, as eval/suite/TASK/ndcg@10 and eval/suite/mean/ndcg@10: does the run over-fit its own domain? Named
  # tasks are the shared data folder's (scifact, trec-dl-sample, reqa-squad); NAME:SPLIT picks a split (else test,
  # or dev); any other entry is a BEIR directory's path
  c.eval.suite = ""  # comma-separated suite tasks: scifact, trec-dl-sample, reqa-squad or BEIR dirs ("" = off)
  # 2,000 and 50: NanoBEIR's tasks are 50 queries over 2-5k documents, and fewer documents would leave TREC DL's
  # sample (~95 judged passages a query) a handful of queries. What an evaluation of them costs: docs/performance.md,
  # `suite` (`python -m jdr.bench suite`)
  c.eval.suite_max_docs = 2000  # documents a suite task keeps: its queries' judged ones + a fixed sample (0 = all)
  c.eval.suite_max_queries = 50  # queries a suite task scores, a fixed sample (0 = as many as the document cap fits)

  # --- parallelism ---
  c.mesh = ml_collections.ConfigDict()
  c.mesh.shape = (-1, 1, 1)  # (data, fsdp, model); -1 takes the remaining devices
  c.mesh.rules = "dp"  # dp | fsdp | tp | fsdp_tp (see jdr/runtime/parallel.py)
  # A host without accelerators as this many XLA CPU devices: two on a 2-core CPU keep both cores busy
  # (parallel.use_cpu_devices; docs/performance.md, "Two CPU devices"). The batch must split over them. -1
  # chooses from the host: one per core where the batch splits and memory holds each device's copy of the
  # training state (parallel.auto_cpu_devices); 0 keeps JAX's one device.
  c.mesh.cpu_devices = -1  # split a CPU-only host into this many XLA devices (-1 = one per core; 0 = one)
  return c
