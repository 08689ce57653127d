"""How each stage of jdr grows with the corpus: its time and peak memory on an MS MARCO-shaped dataset of N passages.

  python -m jdr.bench scale --passages 100000 [--out runs/bench-scale] [--seed 0] [--stages load,bm25_mine,...]
                            [--stage-timeout 7200] [--dense-backend auto|faiss|jax] [--cache DIR] [--keep-work]
                            [--layout beir|msmarco] [--vectors encode|random] [--dense-queries 0]
                            [--config.KEY=VALUE ...]

The data is jdr.data.synthetic's (generated under --out the first time, reused for the same passages and seed), in
BEIR's layout or, with --layout msmarco, MS MARCO's own files (collection.tsv, queries and qrels TSVs; evaluated
on dev.small).
The model is the full in-batch recipe (configs/inbatch.py) with fresh `tiny` towers (model.init_from="",
model.fresh=tiny): two layers 64 wide, so the model's compute does not hide the data stages, under the recipe's
768-wide output head, so the vectors take the room a RoBERTa-base run's take. `--config.KEY=VALUE` changes the
recipe for every stage. Each stage runs as the library runs it today, in a process of its own, so its peak
memory is its own:

  generate          the dataset, when --out does not hold it yet
  load              jdr.data.pairs.load, the dataset as jdr.train reads it; `text` has the characters, words and
                    word pieces (the fresh model's tokenizer) per passage and query of its first thousand;
                    held_anon_bytes_per_passage: the anonymous memory (beyond mapped files) the loaded data holds
                    once loading is over, per passage
  train_first_step  python -m jdr.train with num_train_steps=1 and no evaluation: seconds until the first step's
                    log line (total_s: until the command returns, its last checkpoint written); the first
                    command on a corpus prepares it (prepare_index_s, prepare_tokens_s: its two passes)
  first_step_prepared  the same command again in a new workdir: the start of every later run, the corpus
                    already prepared
  bm25_first_step   train_first_step with BM25 negatives (negatives.source=bm25, one a query from the top 200,
                    as configs/bm25_neg.py): the first run builds the BM25 index and mines every training query
                    (bm25_index_s, bm25_mine_s; of which bm25_build_s and bm25_search_s are the building and
                    the scoring), beside the prepared corpus
  bm25_first_step_again  the same command in a new workdir: what every later run of a sweep, a seed or another
                    BM25-negative recipe pays before its first step, index and lists read back
  bm25_mine         BM25Negatives' top 200 of every training query; load_s is reading the dataset first, and
                    index_s / mine_s the library's index and mining calls inside it, where this jdr has them
  tiny_model        a fresh model saved as a training workdir (0 steps, on the builtin data), for the stages
                    that read a model; run whenever one of them is
  encode_corpus     python -m jdr.encode of the corpus with that model; with --vectors random, seeded random unit
                    vectors written in jdr.encode's layout instead (its shards, ids and meta.json), for sizes where
                    the tiny model's encoding alone would take hours: the later stages read them as they read an
                    encoding, and what they measure (memory, search) does not depend on the vectors' values
  dense_mine        jdr.retrieval.host_search.exact_top_rows: the top 200 of every training query (--dense-queries N:
                    a seeded sample of N of them) over encode_corpus's vectors (load_s: reading them,
                    encode_queries_s: the queries' vectors; seconds_per_query: the search's)
  adore_index       ADORE's fixed index as the trainer holds it (Faiss): encode_corpus's vectors memory-mapped,
                    searched and gathered for a few batches; matrix_copies = its added peak in float32 matrices
                    (the mapped pages read count), anonymous_copies = its anonymous memory (beyond the map)
  mine              python -m jdr.mine over BM25's top 200 of every training query, skipping the top 3, dropping
                    what scores above 0.95 of the positive, keeping 50, with its report on 20% of them (no
                    cross-encoder: at these sizes on a CPU it would be the whole cost)
  evaluate          the trainer's evaluation of the dev queries: jdr.train at step 0, timed around its evaluator,
                    of which encode_corpus_s and diagnostics_s are parts (setup_s: the trainer before it)

The stages share one JDR_CACHE (--cache; by default a new folder of the run's), so the first stage that reads
the corpus prepares it (jdr.data.prepared), as a user's first command does, and the later ones find it.

Every stage reports `status` (ok | failed | timeout | skipped), `seconds` (its own work, without starting Python
and importing jdr; `process_s` is the whole process) and `peak_rss_gib`, the VmHWM of its process. Worker
processes have memory of their own: for the stages that start workers (BM25's tokenizing pool),
`group_peak_pss_gib` is the peak of their summed proportional set sizes (pages they share counted once),
sampled every 0.5 s for 10 s and every 2 s after, and `group_processes` their largest number. Stages whose memory grows with the corpus report `bytes_per_passage` =
(the larger of the two peaks - `baseline_rss_gib`, the peak of a process that only imports jax) / passages;
those whose work is per query also `queries` and `bytes_per_query`. A stage that fails or outlives
--stage-timeout is reported with the last line it printed (`error`), and the stages that read its output are
skipped, as is a stage whose library code this jdr does not have. Adding a stage is a function and a line in
STAGES.

Standard output has one line per stage as it finishes and, last, one JSON object with everything (counts,
hardware, versions); standard error has the stages' own output, also kept in WORK/STAGE.log with --keep-work.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import itertools
import json
import os
import pathlib
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

RECIPE = "inbatch"
TOP_N = 200  # negatives mined per training query (the papers' pools)
GIB = 1 << 30


@dataclasses.dataclass
class Context:
  """What a stage's process is told: where things are, and the settings every stage shares."""
  data: str
  work: str
  passages: int
  seed: int
  train_queries: int
  dev_queries: int
  overrides: list[str]
  dense_backend: str = "auto"
  cache: str = ""  # JDR_CACHE of every stage: where a corpus prepared by one stage is found by the next
  layout: str = "beir"  # the dataset's files: "beir" or "msmarco" (jdr.data.synthetic's layouts)
  vectors: str = "encode"  # encode_corpus: "encode" (jdr.encode with the tiny model) or "random"
  dense_queries: int = 0  # dense_mine: training queries searched (0: all)

  def path(self, name: str) -> pathlib.Path:
    return pathlib.Path(self.work) / name


@dataclasses.dataclass(frozen=True)
class Stage:
  run: Callable[[Context], dict]  # in the stage's process; returns its figures, `seconds` among them
  # what its memory grows with: "passage", "query" (and the passages), or "fixed" (neither: no per-unit figure)
  per: str = "passage"
  needs: tuple[str, ...] = ()  # stages whose output it reads: run first, and its reason to skip if they fail
  requires: tuple[str, ...] = ()  # "module:attribute" it calls; absent from this jdr = skipped
  internal: bool = False  # run only for the stages that need it, not by default
  workers: bool = False  # starts worker processes: their group's memory is sampled (`group_peak_pss_gib`)


def _overrides(ctx: Context, *stage: str) -> list[str]:
  """The recipe's changes: the data and the fresh model, then the user's, then what the stage itself needs."""
  split = ["data.eval_split=dev.small"] if ctx.layout == "msmarco" else []  # MS MARCO's name for the dev queries
  return [f"data.dataset={ctx.data}", *split, "model.init_from=", "model.fresh=tiny", *ctx.overrides, *stage]


def _config(ctx: Context, *stage: str):
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  from jdr.bench import recipes  # pylint: disable=g-import-not-at-top
  config = recipes.load(RECIPE)
  config_files.apply_overrides(config, _overrides(ctx, *stage))
  return config


def _train_command(ctx: Context, workdir: pathlib.Path, *stage: str) -> list[str]:
  """`python -m jdr.train`'s arguments for the recipe with these changes."""
  from jdr.bench import recipes  # pylint: disable=g-import-not-at-top
  return (["--config", str(recipes.CONFIGS / f"{RECIPE}.py"), "--workdir", str(workdir)]
          + [f"--config.{o}" for o in _overrides(ctx, *stage)])


def _baseline(ctx: Context) -> dict:
  del ctx
  import jax  # pylint: disable=g-import-not-at-top
  # Measured before the backend starts: some stages (load, bm25_mine) never start one.
  peak = peak_rss_bytes()
  return {"seconds": 0.0, "peak_rss_bytes": peak, "platform": jax.default_backend(),
          "device": jax.devices()[0].device_kind, "devices": jax.device_count()}


def _generate(ctx: Context) -> dict:
  from jdr.data import synthetic  # pylint: disable=g-import-not-at-top
  directory = pathlib.Path(ctx.data)
  start = time.perf_counter()
  if directory.name != synthetic.name(ctx.passages, ctx.seed, ctx.layout):
    raise ValueError(f"{directory} is not where jdr.data.synthetic keeps {ctx.passages} passages of seed {ctx.seed}")
  synthetic.dataset(directory.parent, ctx.passages, seed=ctx.seed, layout=ctx.layout)
  return {"seconds": time.perf_counter() - start}


def _load(ctx: Context) -> dict:
  from jdr.data import pairs  # pylint: disable=g-import-not-at-top
  import gc  # pylint: disable=g-import-not-at-top
  config = _config(ctx)
  gc.collect()
  anon_before = anonymous_rss_bytes()
  start = time.perf_counter()
  data = pairs.load(config.data, ctx.path("load"))
  seconds = time.perf_counter() - start
  peak = peak_rss_bytes()  # before the sample below loads a tokenizer
  gc.collect()
  held = {}
  if anon_before is not None:
    # What the loaded data holds beyond the maps, once loading is over: the corpus's per-passage cost (and the
    # queries' and qrels' dicts, which grow with the queries).
    anon = anonymous_rss_bytes() - anon_before
    held = {"held_anon_gib": round(anon / GIB, 3), "held_anon_bytes_per_passage": round(anon / len(data.corpus), 1)}
  return {"seconds": seconds, "peak_rss_bytes": peak, **held, "documents": len(data.corpus),
          "train_queries": len(data.train_qrels), "eval_queries": len(data.eval_qrels or {}),
          "text": text_sample(data)}


def text_sample(data, count: int = 1000) -> dict:
  """Characters, words and word pieces (the fresh model's tokenizer) per passage and per query, over the first
  `count` of each: what turns the dataset's words into the encoders' work."""
  from jdr.data import text as text_lib  # pylint: disable=g-import-not-at-top
  from jdr.models import hf  # pylint: disable=g-import-not-at-top
  tokenizer = text_lib.load_tokenizer(str(hf.minilm_path()))
  out = {"sample": count}
  docs = [text_lib.doc_text(data.corpus[d]) for d in itertools.islice(data.corpus, count)]
  for kind, texts in (("passage", docs), ("query", list(itertools.islice(data.queries.values(), count)))):
    pieces = tokenizer(texts, add_special_tokens=False)["input_ids"]
    out[f"chars_per_{kind}"] = round(sum(map(len, texts)) / len(texts), 1)
    out[f"words_per_{kind}"] = round(sum(len(t.split()) for t in texts) / len(texts), 2)
    out[f"tokens_per_{kind}"] = round(sum(map(len, pieces)) / len(texts), 2)
  return out


def _train_first_step(ctx: Context, workdir_name: str = "train") -> dict:
  from jdr import train  # pylint: disable=g-import-not-at-top
  from jdr.training import metric_writers
  from jdr.runtime import timings  # pylint: disable=g-import-not-at-top
  workdir = ctx.path(workdir_name)
  argv = _train_command(ctx, workdir, "data.eval_split=", "num_train_steps=1", "log_every=1",
                        "eval_before_training=false", "checkpoint_every=0")
  wall, start = time.time(), time.perf_counter()
  with timings.window() as marks:  # the preparing passes, which run only where the corpus is not prepared yet
    train.main(argv)
  total = time.perf_counter() - start
  first = next(r for r in metric_writers.read(workdir) if "train/loss" in r)
  return {"seconds": first["time"] - wall, "total_s": total, "prepare_index_s": marks.seconds["prepare_index"],
          "prepare_tokens_s": marks.seconds["prepare_tokens"],
          "loss": first["train/loss"]}


def _first_step_prepared(ctx: Context) -> dict:
  return _train_first_step(ctx, "train-again")


BM25_NEGATIVES = ("negatives.source=bm25", "negatives.per_query=1", f"negatives.bm25.top_k={TOP_N}")


def _bm25_first_step(ctx: Context, workdir_name: str = "train-bm25") -> dict:
  from jdr import train  # pylint: disable=g-import-not-at-top
  from jdr.training import metric_writers  # pylint: disable=g-import-not-at-top
  from jdr.runtime import timings  # pylint: disable=g-import-not-at-top
  workdir = ctx.path(workdir_name)
  argv = _train_command(ctx, workdir, "data.eval_split=", "num_train_steps=1", "log_every=1",
                        "eval_before_training=false", "checkpoint_every=0", *BM25_NEGATIVES)
  wall, start = time.time(), time.perf_counter()
  with timings.window() as marks:
    train.main(argv)
  total = time.perf_counter() - start
  first = next(r for r in metric_writers.read(workdir) if "train/loss" in r)
  # bm25_build_s / bm25_search_s: building the index and scoring queries, 0 when the kept ones were read.
  return {"seconds": first["time"] - wall, "total_s": total, "bm25_index_s": marks.seconds["bm25_index"],
          "bm25_mine_s": marks.seconds["bm25_mine"], "bm25_build_s": marks.seconds["bm25_build"],
          "bm25_search_s": marks.seconds["bm25_search"], "prepare_index_s": marks.seconds["prepare_index"],
          "prepare_tokens_s": marks.seconds["prepare_tokens"], "loss": first["train/loss"]}


def _bm25_first_step_again(ctx: Context) -> dict:
  return _bm25_first_step(ctx, "train-bm25-again")


def _bm25_mine(ctx: Context) -> dict:
  from jdr.data import pairs  # pylint: disable=g-import-not-at-top
  from jdr.negatives import sampled  # pylint: disable=g-import-not-at-top
  from jdr.runtime import timings  # pylint: disable=g-import-not-at-top
  config = _config(ctx)
  start = time.perf_counter()
  data = pairs.load(config.data, ctx.path("bm25"))
  load_s = time.perf_counter() - start
  # BM25Negatives indexes and mines in its constructor: timing the library's two calls splits it.
  start = time.perf_counter()
  with timings.window() as marks:
    negatives = sampled.BM25Negatives(data.corpus, data.queries, data.train_qrels, top_k=TOP_N,
                                      cache_dir=ctx.path("bm25-cache"))
  return {"seconds": time.perf_counter() - start, "load_s": load_s, "index_s": marks.seconds["bm25_index"],
          "mine_s": marks.seconds["bm25_mine"], "queries": len(negatives.qids),
          "top_k": negatives.top_k}


def _tiny_model(ctx: Context) -> dict:
  from jdr import train  # pylint: disable=g-import-not-at-top
  from jdr.models import saved  # pylint: disable=g-import-not-at-top
  workdir = ctx.path("tiny-model")
  start = time.perf_counter()
  train.main(_train_command(ctx, workdir, "data.dataset=builtin", "data.eval_split=", "num_train_steps=0",
                            "eval_before_training=false", "checkpoint_every=0"))
  description = saved.description(workdir)
  return {"seconds": time.perf_counter() - start, "projection_dim": description["doc"].get("projection_dim")}


def _encode_corpus(ctx: Context) -> dict:
  from jdr import encode  # pylint: disable=g-import-not-at-top
  out = ctx.path("encoding")
  start = time.perf_counter()
  if ctx.vectors == "random":
    random_encoding(ctx.data, out, seed=ctx.seed)
  else:
    encode.main(["--model", str(ctx.path("tiny-model")), "--corpus", ctx.data, "--out", str(out)])
  seconds = time.perf_counter() - start
  meta = json.loads((out / "meta.json").read_text())
  return {"seconds": seconds, "vectors": ctx.vectors, "dim": meta["dim"], "max_length": meta.get("max_length"),
          "disk_bytes": sum(p.stat().st_size for p in out.iterdir())}


RANDOM_DIM = 768  # the recipe's output head: the width a RoBERTa-base run's vectors have
SHARD_SIZE = 10_000  # jdr.encode's default


def random_encoding(corpus: str, out: pathlib.Path, *, seed: int = 0, dim: int = RANDOM_DIM) -> dict:
  """An encoding directory as jdr.encode writes one (float32 shards, their ids, meta.json marked complete and
  `vectors: random`), of seeded random unit vectors for the corpus' documents in corpus order."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tqdm  # pylint: disable=g-import-not-at-top
  from jdr.runtime import atomic  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encodings  # pylint: disable=g-import-not-at-top
  from jdr.data import formats  # pylint: disable=g-import-not-at-top
  from jdr.data import prepared  # pylint: disable=g-import-not-at-top
  corpus_file = formats.corpus_file(corpus)
  # The prepared corpus's ids, read a shard at a time (a dict of 8.8M documents would take gigabytes).
  ids = (prepared.prepare(corpus_file).id_sequence() if prepared.can_prepare(corpus_file)
         else list(formats.read_corpus(corpus)))
  out.mkdir(parents=True, exist_ok=True)
  num_shards = -(-len(ids) // SHARD_SIZE)
  rng = np.random.default_rng(seed)
  for shard in tqdm.tqdm(range(num_shards), desc="random vectors", unit="shard", mininterval=1.0):
    lo, hi = shard * SHARD_SIZE, min(len(ids), (shard + 1) * SHARD_SIZE)
    emb = rng.standard_normal((hi - lo, dim), dtype=np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    emb_path, ids_path = encodings.shard_paths(out, shard)  # jdr.encode's layout
    atomic.write_text(ids_path, "".join(i + "\n" for i in ids[lo:hi]))
    encodings.save_npy(emb_path, emb)
  meta = {"num_docs": len(ids), "shard_size": SHARD_SIZE, "num_shards": num_shards, "vectors": "random",
          "seed": seed, "corpus": str(pathlib.Path(corpus).absolute()), "complete": True, "dim": dim}
  atomic.write_text(out / "meta.json", json.dumps(meta, indent=1))
  return meta


def _dense_mine(ctx: Context) -> dict:
  from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encodings  # pylint: disable=g-import-not-at-top
  from jdr.data import formats  # pylint: disable=g-import-not-at-top
  from jdr.data import msmarco  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import host_search  # pylint: disable=g-import-not-at-top
  where = msmarco.files(ctx.data, "train")
  start = time.perf_counter()
  doc_emb, _, _ = encodings.load_embeddings(ctx.path("encoding"))
  queries = formats.read_queries(where.train_queries)
  qrels = formats.read_qrels(where.train_qrels)
  qids = sorted(q for q, docs in qrels.items() if any(r > 0 for r in docs.values()))  # as the miners do
  total = len(qids)
  if 0 < ctx.dense_queries < total:
    import numpy as np  # pylint: disable=g-import-not-at-top
    picked = np.sort(np.random.default_rng(ctx.seed).choice(total, ctx.dense_queries, replace=False))
    qids = [qids[i] for i in picked]
  loaded = time.perf_counter()
  runtime = encoder_runtime.load_runtime(str(ctx.path("tiny-model")), side="query")
  query_emb = encoder_runtime.encode_texts(runtime, [queries[q] for q in qids])
  encoded = time.perf_counter()
  rows, _ = host_search.exact_top_rows(doc_emb, query_emb, TOP_N, ctx.dense_backend)
  end = time.perf_counter()
  return {"seconds": end - encoded, "load_s": loaded - start, "encode_queries_s": encoded - loaded,
          "queries": len(qids), "training_queries": total, "seconds_per_query": (end - encoded) / len(qids),
          "top_n": int(rows.shape[1]), "backend": ctx.dense_backend}


ADORE_STEPS = 4  # host retrievals timed by adore_index, each a batch of 32 queries


def _adore_index(ctx: Context) -> dict:
  """ADORE's fixed index as the trainer holds it with Faiss (negatives.source=retrieval, the default back-end):
  the encoding memory-mapped, retrieval over it and the batch's candidates' vectors, for ADORE_STEPS batches.
  `matrix_copies` is the peak memory this adds over the process before loading, in float32 matrices."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encodings  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import host_search  # pylint: disable=g-import-not-at-top
  from jdr.negatives import retrieved  # pylint: disable=g-import-not-at-top
  before, anon_before = peak_rss_bytes(), anonymous_rss_bytes()
  anon_peak = anon_before
  start = time.perf_counter()
  emb, _, _ = encodings.load_embeddings(ctx.path("encoding"))
  index = host_search.HostIndex(emb, "Flat")
  built = time.perf_counter()
  rng = np.random.default_rng(ctx.seed)
  for _ in range(ADORE_STEPS):
    # Documents' own vectors stand in for the query tower's: the same width and norms.
    queries = np.asarray(emb[np.sort(rng.choice(len(emb), 32, replace=False))], np.float32)
    batch = {"positive_rows": rng.integers(0, len(emb), size=(32, 1)).astype(np.int32)}
    rows = index.search(queries, TOP_N)
    batch = retrieved.with_vectors(batch, rows, index.vectors)
    if anon_before is not None:
      anon_peak = max(anon_peak, anonymous_rss_bytes())
  end = time.perf_counter()
  matrix_bytes = len(emb) * emb.shape[1] * 4
  out = {"seconds": end - start, "index_s": built - start, "step_s": (end - built) / ADORE_STEPS,
         "matrix_gib": matrix_bytes / GIB, "matrix_copies": (peak_rss_bytes() - before) / matrix_bytes,
         "steps": ADORE_STEPS}
  if anon_before is not None:
    # Beyond the mapped encoding (whose pages count in the peak while read, up to the memory the host has):
    # what the index and the steps hold of their own, sampled after each step.
    out["anonymous_copies"] = (anon_peak - anon_before) / matrix_bytes
  return out


def _evaluate(ctx: Context) -> dict:
  from jdr.training import trainer
  from jdr.runtime import timings  # pylint: disable=g-import-not-at-top
  # The full-corpus evaluation, as the end of training runs it (python -m jdr.bench eval-candidates times the
  # candidates the evaluations during training score).
  config = _config(ctx, "num_train_steps=0", "eval_before_training=false", "checkpoint_every=0",
                   "eval.candidates=full")
  start = time.perf_counter()
  with timings.window() as marks:
    results = trainer.train_and_evaluate(config, ctx.path("evaluate"))
  if "evaluate" not in marks.first_start:
    raise ValueError(f"the trainer evaluated nothing (data.eval_split={config.data.eval_split!r})")
  return {"seconds": marks.seconds["evaluate"], "setup_s": marks.first_start["evaluate"] - start,
          "encode_corpus_s": marks.seconds["encode_corpus"], "diagnostics_s": marks.seconds["diagnostics"],
          "queries": ctx.dev_queries, "split": config.data.eval_split, "metrics": results.get("after", {})}


def _mine(ctx: Context) -> dict:
  from jdr import mine  # pylint: disable=g-import-not-at-top
  out = ctx.path("mined")
  start = time.perf_counter()
  mine.main(["--data", ctx.data, "--out", str(out), "--depth", str(TOP_N), "--skip-ranks", "3",
             "--positive-fraction", "0.95", "--keep", "50"])
  seconds = time.perf_counter() - start
  report = json.loads((out / "meta.json").read_text())["report"]
  return {"seconds": seconds, "queries": report["queries"], "negatives": report["negatives"],
          "dropped": report["training"]["dropped"], "disk_bytes": sum(p.stat().st_size for p in out.iterdir()
                                                                     if p.is_file())}


STAGES = {
    "generate": Stage(_generate, per="fixed", requires=("jdr.data.synthetic:dataset",), internal=True),
    "load": Stage(_load, needs=("generate",), requires=("jdr.data.pairs:load",)),
    "train_first_step": Stage(_train_first_step, needs=("generate",), requires=("jdr.train:main",)),
    "first_step_prepared": Stage(_first_step_prepared, needs=("train_first_step",), requires=("jdr.train:main",)),
    "bm25_first_step": Stage(_bm25_first_step, needs=("generate",), workers=True, requires=("jdr.train:main",)),
    "bm25_first_step_again": Stage(_bm25_first_step_again, needs=("bm25_first_step",), workers=True,
                                   requires=("jdr.retrieval.bm25:kept_beside",)),
    "bm25_mine": Stage(_bm25_mine, per="query", needs=("generate",), workers=True,
                       requires=("jdr.negatives.sampled:BM25Negatives",)),
    "tiny_model": Stage(_tiny_model, per="fixed", requires=("jdr.train:main",), internal=True),
    "encode_corpus": Stage(_encode_corpus, needs=("generate", "tiny_model"), requires=("jdr.encode:main",)),
    "dense_mine": Stage(_dense_mine, per="query", needs=("encode_corpus", "tiny_model"),
                        requires=("jdr.retrieval.host_search:exact_top_rows",)),
    "adore_index": Stage(_adore_index, needs=("encode_corpus",), requires=("jdr.retrieval.host_search:HostIndex",)),
    "mine": Stage(_mine, per="query", needs=("generate",), workers=True, requires=("jdr.mine:main",)),
    "evaluate": Stage(_evaluate, per="query", needs=("generate",),
                      requires=("jdr.evaluation.periodic:Evaluator", "jdr.retrieval.tower_encoder:TowerEncoder",
                                "jdr.evaluation.periodic:TrainingDiagnostics")),
}
BASELINE = Stage(_baseline)


def plan(asked: list[str]) -> list[str]:
  """The asked stages and those they need, in STAGES order."""
  wanted = set()

  def add(name: str) -> None:
    if name not in wanted:
      wanted.add(name)
      for need in STAGES[name].needs:
        add(need)

  for name in asked:
    add(name)
  return [name for name in STAGES if name in wanted]


# ------------------------------------------------------------------------------------------------ a stage's process


def _missing(requires: tuple[str, ...]) -> list[str]:
  out = []
  for item in requires:
    module, _, attr = item.partition(":")
    try:
      found = importlib.import_module(module)
    except ModuleNotFoundError as e:
      if e.name is None or not module.startswith(e.name):
        raise  # the module is there but imports something absent: a real failure, not a missing stage
      out.append(item)
      continue
    if attr and not hasattr(found, attr):
      out.append(item)
  return out


def _status_bytes(field: str) -> int | None:
  """A memory line of /proc/self/status ("VmHWM", "RssAnon") in bytes; None where there is none."""
  try:
    with open("/proc/self/status", encoding="ascii") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def peak_rss_bytes() -> int:
  """This process's peak resident memory (VmHWM), from /proc where there is one, else getrusage."""
  peak = _status_bytes("VmHWM")
  if peak is not None:
    return peak
  import resource  # pylint: disable=g-import-not-at-top
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return peak if sys.platform == "darwin" else peak * 1024


def anonymous_rss_bytes() -> int | None:
  """This process's resident anonymous memory now (RssAnon): what it holds beyond mapped files, so beyond a
  prepared corpus's map. None where /proc has no such line."""
  return _status_bytes("RssAnon")


def _stage_process(argv: list[str]) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--stage", required=True)
  parser.add_argument("--context", required=True)
  parser.add_argument("--result", required=True)
  args = parser.parse_args(argv)
  stage = BASELINE if args.stage == "baseline" else STAGES[args.stage]
  ctx = Context(**json.loads(args.context))
  missing = _missing(stage.requires)
  if missing:
    result = {"status": "skipped", "error": f"this jdr has no {', '.join(missing)}"}
  else:
    result = {"status": "ok", **stage.run(ctx)}
  result.setdefault("peak_rss_bytes", peak_rss_bytes())
  pathlib.Path(args.result).write_text(json.dumps(result, default=str))


# ------------------------------------------------------------------------------------------------ the bench


def group_memory_bytes(group: int) -> tuple[int, int] | None:
  """(the summed proportional set size, PSS, of a process group's processes, their number), from /proc; None
  where there is none. PSS splits a page shared by several processes (a forked worker's inherited memory)
  between them, so the sum counts it once, where summing RSS would count it in every process."""
  try:
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
  except OSError:
    return None
  total, count = 0, 0
  for pid in pids:
    try:
      with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
      if int(fields[2]) != group:
        continue
      with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
        total += next(int(line.split()[1]) for line in f if line.startswith(b"Pss:")) * 1024
      count += 1
    except (OSError, IndexError, ValueError, StopIteration):
      continue  # gone since the listing
  return total, count


def _last_line(output: bytes) -> str:
  lines = [line.strip() for line in output.decode("utf-8", "replace").replace("\r", "\n").split("\n")]
  return next((line for line in reversed(lines) if line), "")


def run_stage(name: str, ctx: Context, timeout: float | None) -> dict:
  """Runs one stage in a process of its own (its output passed on to standard error and kept in
  WORK/NAME.log); its figures, or why there are none."""
  result_path, log_path = ctx.path(f"{name}.result.json"), ctx.path(f"{name}.log")
  result_path.unlink(missing_ok=True)
  command = [sys.executable, "-m", "jdr.bench.scale", "--stage", name, "--context",
             json.dumps(dataclasses.asdict(ctx)), "--result", str(result_path)]
  tail = bytearray()
  start = time.perf_counter()
  # A session of its own, so a timeout ends whatever the stage started too.
  env = {**os.environ, "JDR_CACHE": ctx.cache} if ctx.cache else None
  process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                             env=env)

  def pump():
    stderr = sys.stderr  # looked up now: a caller (a test) may have replaced it
    with open(log_path, "wb") as log:
      while chunk := os.read(process.stdout.fileno(), 1 << 16):
        if hasattr(stderr, "buffer"):
          stderr.buffer.write(chunk)
        else:
          stderr.write(chunk.decode("utf-8", "replace"))
        stderr.flush()
        log.write(chunk)
        tail.extend(chunk)
        del tail[:-(1 << 14)]

  # Worker processes (a tokenizer pool) have memory of their own, which the stage's VmHWM does not count: the
  # whole group's is sampled too, for the stages that start workers. Only for those: reading a process's
  # smaps_rollup walks its page tables under its memory-map lock, which its own threads then wait for (a
  # tokenizing stage sampled twice a second ran far below its unsampled rate: docs/performance.md, `scale`).
  group_peak, group_size, done = 0, 0, threading.Event()

  def sample():
    nonlocal group_peak, group_size
    if not STAGES.get(name, BASELINE).workers:
      return
    # Twice a second for the first 10 s, then every 2 s.
    waited = 0.0
    while not done.wait(0.5 if waited < 10 else 2.0):
      waited += 0.5 if waited < 10 else 2.0
      found = group_memory_bytes(process.pid)
      if found:
        group_peak, group_size = max(group_peak, found[0]), max(group_size, found[1])

  reader = threading.Thread(target=pump, daemon=True)
  reader.start()
  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  timed_out = False
  try:
    process.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    timed_out = True
  finally:
    if process.poll() is None:  # timed out, or this bench is being stopped: the stage goes with it
      os.killpg(process.pid, signal.SIGKILL)
      process.wait()
    done.set()
    reader.join()
    sampler.join()
    process.stdout.close()
  seconds = time.perf_counter() - start
  group = {"group_peak_pss_bytes": group_peak, "group_processes": group_size} if group_size > 1 else {}
  if timed_out:
    return {"status": "timeout", "process_s": seconds, **group,
            "error": f"still running after {timeout:g} s; last line: {_last_line(bytes(tail))}"}
  if process.returncode != 0 or not result_path.exists():
    code = process.returncode
    why = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
    if code == -signal.SIGKILL:
      why += " (out of memory?)"
    return {"status": "failed", "process_s": seconds, **group, "error": f"{why}: {_last_line(bytes(tail))}"}
  return {**json.loads(result_path.read_text()), "process_s": seconds, **group}


def _figures(name: str, result: dict, passages: int, baseline: int | None) -> dict:
  """A stage's entry of the JSON: its own figures, its memory in GiB and per passage (and query)."""
  out = dict(result)
  for key in ("peak_rss_bytes", "group_peak_pss_bytes"):
    if key in out:
      out[key.replace("_bytes", "_gib")] = round(out.pop(key) / GIB, 3)
  peak = max(result.get("peak_rss_bytes", 0), result.get("group_peak_pss_bytes", 0))
  per = STAGES[name].per
  if peak and baseline is not None and out.get("status") == "ok" and per != "fixed":
    out["bytes_per_passage"] = round((peak - baseline) / passages)
    if per == "query" and out.get("queries"):
      out["bytes_per_query"] = round((peak - baseline) / out["queries"])
  return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def describe(name: str, figures: dict) -> str:
  """The stage's line on standard output."""
  status = figures.get("status", "?")
  line = f"{name:<17} {status:<8}"
  if status in ("ok", "reused") and "seconds" in figures:
    line += f" {figures['seconds']:10.1f} s"
  if "peak_rss_gib" in figures:
    line += f"  peak {figures['peak_rss_gib']:7.3f} GiB"
  if "group_peak_pss_gib" in figures:
    line += f" ({figures['group_processes']} processes: {figures['group_peak_pss_gib']:.3f} GiB)"
  if "bytes_per_passage" in figures:
    line += f"  {figures['bytes_per_passage']:>10,} B/passage"
  if "bytes_per_query" in figures:
    line += f"  {figures['bytes_per_query']:>10,} B/query"
  if figures.get("error"):
    line += f"  {figures['error']}"
  return line


def hardware() -> dict:
  from jdr.bench import peak  # pylint: disable=g-import-not-at-top
  cpu = peak.cpu_info()["model"]
  memory = None
  try:
    with open("/proc/meminfo", encoding="ascii") as f:
      memory = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
  except OSError:
    pass
  usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": usable,
          "memory_gib": None if memory is None else round(memory / GIB, 1)}


def versions() -> dict:
  out = {"python": platform.python_version()}
  for key, dists in (("jax", ["jax"]), ("jaxlib", ["jaxlib"]), ("flax", ["flax"]), ("numpy", ["numpy"]),
                     ("faiss", ["faiss-cpu", "faiss-gpu-cu12", "faiss-gpu"]), ("bm25s", ["bm25s"]),
                     ("tokenizers", ["tokenizers"]), ("jdr", ["jdr"])):
    for dist in dists:
      try:
        out[key] = importlib.metadata.version(dist)
        break
      except importlib.metadata.PackageNotFoundError:
        continue
  return out


def main(argv=None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--stage"]:  # a stage's own process (run_stage)
    _stage_process(argv)
    return
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  from jdr.data import synthetic  # pylint: disable=g-import-not-at-top
  rest, overrides = config_files.split_config_args(argv)
  public = [name for name, stage in STAGES.items() if not stage.internal]
  parser = argparse.ArgumentParser(prog="python -m jdr.bench scale", description=__doc__.splitlines()[0],
                                   epilog="--config.KEY=VALUE: changes configs/inbatch.py for every stage")
  parser.add_argument("--passages", type=int, required=True)
  parser.add_argument("--seed", type=int, default=0, help="of the generated dataset")
  parser.add_argument("--out", default="runs/bench-scale",
                      help="where the datasets are kept (and each run's work, deleted afterwards)")
  parser.add_argument("--stages", default=",".join(public),
                      help=f"comma-separated, from {', '.join(STAGES)} (default: {', '.join(public)})")
  parser.add_argument("--stage-timeout", type=float, default=7200.0, help="seconds a stage may take (0: no limit)")
  parser.add_argument("--dense-backend", choices=("auto", "faiss", "jax"), default="auto",
                      help="where dense_mine searches (negatives.dense_static.backend; auto: the devices when there is "
                           "an accelerator, else Faiss)")
  parser.add_argument("--cache", default="",
                      help="JDR_CACHE of the stages (prepared corpora); default: a new folder in the run's work, so "
                           "the first stage to read the corpus prepares it, as a user's first command does")
  parser.add_argument("--keep-work", action="store_true", help="keep the stages' outputs and logs")
  parser.add_argument("--layout", choices=synthetic.LAYOUTS, default="beir",
                      help="the dataset's files: BEIR's, or MS MARCO's own (collection.tsv, queries and qrels TSVs)")
  parser.add_argument("--vectors", choices=("encode", "random"), default="encode",
                      help="encode_corpus: the tiny model's encoding (jdr.encode), or seeded random unit vectors in "
                           "its layout, for the stages that read an encoding at sizes where encoding takes hours")
  parser.add_argument("--dense-queries", type=int, default=0,
                      help="dense_mine: search a seeded sample of this many training queries (0: all of them)")
  args = parser.parse_args(rest)
  asked = [s.strip() for s in args.stages.split(",") if s.strip()]
  unknown = [s for s in asked if s not in STAGES]
  if unknown or not asked:
    parser.error(f"--stages: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(STAGES)}")
  if args.passages < synthetic.MIN_PASSAGES:
    parser.error(f"--passages must be at least {synthetic.MIN_PASSAGES}")
  if args.stage_timeout < 0:
    parser.error("--stage-timeout must be >= 0")
  if args.dense_queries < 0:
    parser.error("--dense-queries must be >= 0")
  timeout = args.stage_timeout or None

  out = pathlib.Path(args.out).absolute()
  data = out / synthetic.name(args.passages, args.seed, args.layout)
  work = out / f"work-N{args.passages}-{os.getpid()}"
  work.mkdir(parents=True, exist_ok=True)
  train_queries, dev_queries = synthetic.query_counts(args.passages)
  ctx = Context(str(data), str(work), args.passages, args.seed, train_queries, dev_queries, overrides,
                args.dense_backend, str(pathlib.Path(args.cache).absolute() if args.cache else work / "cache"),
                args.layout, args.vectors, args.dense_queries)
  stages: dict[str, dict] = {}
  # A terminated bench ends its stage too (run_stage kills the stage's process group on the way out), as an
  # interrupted one does: a stage runs in a session of its own, which signals to the bench do not reach.
  signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
  try:
    base = run_stage("baseline", ctx, timeout)
    if base.get("status") != "ok":
      raise SystemExit(f"the baseline process (python + jax) failed: {base.get('error')}")
    baseline = base.pop("peak_rss_bytes")
    failed = set()
    for name in plan(asked):
      blocked = [need for need in STAGES[name].needs if need in failed]
      if name == "generate" and (data / synthetic.MANIFEST).exists():
        result = {"status": "reused", "seconds": 0.0}
      elif blocked:
        result = {"status": "skipped", "error": f"needs {', '.join(blocked)}, which did not finish"}
      else:
        result = run_stage(name, ctx, timeout)
      if result.get("status") not in ("ok", "reused"):
        failed.add(name)
      stages[name] = _figures(name, result, args.passages, baseline)
      print(describe(name, stages[name]), flush=True)
  finally:
    if not args.keep_work:
      shutil.rmtree(work, ignore_errors=True)

  manifest = synthetic.manifest(data) if (data / synthetic.MANIFEST).exists() else {}
  print(json.dumps({
      "benchmark": "scale",
      "units": "seconds; *_gib: GiB (peak_rss: the stage process's VmHWM, group_peak_pss: its processes' "
               "summed PSS, sampled); bytes_per_passage (_per_query): (the larger peak - baseline) / passages "
               "(queries)",
      "passages": args.passages, "seed": args.seed, "dataset": str(data), "layout": args.layout,
      "counts": {"passages": args.passages, "train_queries": train_queries, "dev_queries": dev_queries,
                 **{k: manifest[k] for k in ("train_pairs", "dev_pairs", "words_per_passage", "words_per_query")
                    if k in manifest}},
      "model": {"recipe": f"configs/{RECIPE}.py", "overrides": _overrides(ctx)[1:]},
      "stage_timeout_s": timeout, "dense_backend": args.dense_backend, "vectors": args.vectors,
      "dense_queries": args.dense_queries or train_queries,
      "baseline_rss_gib": round(baseline / GIB, 3),
      "hardware": {**hardware(), **{k: base[k] for k in ("platform", "device", "devices")}},
      "versions": versions(),
      "stages": stages,
  }))


if __name__ == "__main__":
  main()
