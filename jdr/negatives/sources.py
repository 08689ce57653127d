"""The negatives a config names, built once before training: `make(config, ...) -> Negatives`.

`negatives.source`, and the group of settings each reads (negatives.GROUP, its alone):
  none | random                 in-batch only, or uniform corpus documents (no group)
  bm25 | bm25_random            pools = each query's BM25 top k (negatives.bm25)
  static                        pools = a warm-up model's TREC run (negatives.static)
  triples        pools = the negatives of a dataset's own triples file, MS MARCO's triples.train.small.tsv
                 (negatives.triples, jdr.negatives.given)
  mined          pools = a `python -m jdr.mine` directory's filtered negatives, or a Tevatron or
                 sentence-transformers file's (negatives.mined.file, jdr.negatives.training_files)
  dense_static   pools = the starting model's own top-n, mined once and cached (STAR's static hard negatives;
                 negatives.dense_static)
  ance           pools = the model's own top-n, re-mined every `refresh_every` steps in the background (ANCE;
                 negatives.ance)
  retrieval      candidates = rows of a fixed corpus index: retrieved at every step (`every=1`, ADORE / LTRe)
                 or once before training (`every=0`, the static ablation; negatives.retrieval,
                 jdr.negatives.retrieved)

A source is one unit: its builder and its check receive its own group and the few values of the run they need
(`Run`), never the whole config; `check` and `make` are where the config is taken apart. The keys flat in
`negatives` (per_query, in_batch, pair_weighting, ...) are the batches' and the step's, read for every source.

The trainer calls `negatives.prepare(step, state)` before building each batch and, in corpus mode,
`negatives.complete(batch, state)` after, and nothing else: a method is these choices, not a trainer fork.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import pathlib
from typing import Any, Callable

import jax
import ml_collections
import numpy as np

from jdr.data import prepared
from jdr.runtime import atomic
from jdr.runtime import config_files
from jdr.data import pairs
from jdr.data import refresh_triples
from jdr.data import text as text_lib
from jdr.retrieval import encodings
from jdr.runtime import paths
from jdr.negatives import given
from jdr.negatives import refresh
from jdr.retrieval import host_search
from jdr.negatives import retrieved
from jdr.negatives import sampled
from jdr.negatives import training_files

# The pool depth of a source that has none of its own (the diagnostics' overlap@n; the papers' 200).
DEFAULT_DEPTH = 200


@dataclasses.dataclass
class Negatives:
  candidates: str  # "tokens" (documents as token ids, encoded in the step) | "corpus" (rows of `corpus`) |
                   # "pairs" (a cross-encoder's joint inputs); set by `make` from `candidates(config)`
  sampler: Any = None  # for token batches: a sampled.NegativeSource, or None (in-batch only)
  corpus: retrieved.CorpusMatrix | None = None
  doc_emb: np.ndarray | None = None  # corpus mode: the fixed document vectors (before any compression)
  retrieve_in_step: bool = False  # corpus mode: the jitted step retrieves (JAX back-end)
  host_fields: Callable | None = None  # corpus mode: (batch, state) -> batch with `cand_rows`
  top_n: int = 0
  refresher: Any = None
  pools_in_use: Callable | None = None  # qids -> [Q, n] rows of the negatives in use (diagnostics)
  triples_per_query: int = 0  # ANCE: each refresh generation's triples a (query, positive) pair (pairs.Batches)
  timings: dict = dataclasses.field(default_factory=dict)

  def prepare(self, step: int, state) -> None:
    """The hook between steps: ANCE's refresh schedule; a no-op for every other source."""
    if self.refresher is not None:
      self.refresher.prepare(step, state.params)
      self.sampler.step = step

  def complete(self, batch: dict, state) -> dict:
    return self.host_fields(batch, state) if self.host_fields is not None else batch

  def log_scalars(self, step: int) -> dict[str, float]:
    """What the logs show of the negatives: ANCE's refresh state and staleness, host retrieval time."""
    out = {}
    if self.refresher is not None:
      stats = self.refresher.stats()
      out["negatives/staleness_steps"] = float(self.refresher.staleness(step))
      out.update({f"negatives/{k}": float(v) for k, v in stats.items()
                  if isinstance(v, (int, float)) and v is not None})
    if isinstance(self.host_fields, retrieved.HostRetrieval):
      out["negatives/host_retrieval_seconds_total"] = self.host_fields.seconds
    return out

  def close(self, wait: bool = True) -> None:
    if self.refresher is not None:
      self.refresher.close(wait=wait)


@dataclasses.dataclass(frozen=True)
class Run:
  """What of the run outside `negatives` a source's check or builder reads: named here, so a unit's reads are
  its own group and these."""
  batch_size: int
  train_towers: str  # model.train_towers
  dataset: str  # data.dataset
  data_kind: str  # data.kind
  seed: int
  num_train_steps: int

  @classmethod
  def of(cls, config: ml_collections.ConfigDict) -> Run:
    return cls(batch_size=config.batch_size, train_towers=config.model.train_towers, dataset=config.data.dataset,
               data_kind=config.data.kind, seed=config.seed, num_train_steps=config.num_train_steps)


@dataclasses.dataclass(frozen=True)
class Build:
  """What a builder works with besides its group and `Run`: the data, the workdir, the towers."""
  data: Any
  workdir: pathlib.Path
  encoder: Any = None
  initial_params: Any = None
  mesh: Any = None
  step_query_encoder: Callable | None = None


def section(neg: ml_collections.ConfigDict) -> ml_collections.ConfigDict | None:
  """The chosen source's own group of `neg` (the config's `negatives`), None for a source without one."""
  group = SOURCES[neg.source].group
  return neg[group] if group else None


def depth(neg: ml_collections.ConfigDict) -> int:
  """The chosen source's pool or retrieval depth (its group's top_n), else DEFAULT_DEPTH: what the evaluation's
  diagnostics and the benchmarks read as "n", without reaching into a group."""
  own = section(neg)
  return own.top_n if own is not None and "top_n" in own else DEFAULT_DEPTH


def check(config: ml_collections.ConfigDict) -> None:
  """Refuses inconsistent negative settings before anything is loaded: the keys every source shares here, then
  each group by its own check (told whether its source is the one chosen)."""
  neg = config.negatives
  if neg.source not in SOURCES:
    raise ValueError(f"negatives.source must be one of {', '.join(SOURCES)}; got {neg.source!r}")
  if neg.source == "none" and neg.per_query:
    raise ValueError("negatives.per_query > 0 needs negatives.source (random, bm25, ...)")
  if neg.source not in ("none", "retrieval") and neg.per_query < 1:
    raise ValueError(f"negatives.source={neg.source!r} needs negatives.per_query >= 1")
  if neg.pair_weighting != "none" and SOURCES[neg.source].candidates != "tokens":
    raise ValueError("negatives.pair_weighting weighs token batches' pairs, not source=retrieval's candidates")
  run, chosen = Run.of(config), SOURCES[neg.source].group
  for group, check_group in GROUPS.items():
    check_group(neg[group], run, chosen=group == chosen)
  if candidates(config) == "pairs":
    check_cross_encoder(config)


def check_cross_encoder(config: ml_collections.ConfigDict) -> None:
  """Refuses what a cross-encoder cannot train with, before anything is read."""
  neg = config.negatives
  if config.data.kind != "pairs":
    raise ValueError("model.architecture=cross_encoder trains on supervised pairs: set data.kind=pairs")
  allowed = [name for name in named(lambda s: not s.needs_towers) if name != "none"]
  if neg.source not in allowed or neg.per_query < 1 or neg.in_batch:
    raise ValueError("model.architecture=cross_encoder scores each query's own candidates: set "
                     f"negatives.source to {' | '.join(allowed)}, negatives.per_query >= 1 and "
                     "negatives.in_batch=False")
  if config.grad_cache.chunk_size:
    raise ValueError("model.architecture=cross_encoder: gradient caching is for two towers; set "
                     "grad_cache.chunk_size=0")


def candidates(config: ml_collections.ConfigDict) -> str:
  """The candidate kind of `config`'s batches, the one place it is decided (`Negatives.candidates`, which
  the step's scoring function and the batches follow): "pairs" for a cross-encoder, else the source's."""
  if config.model.get("architecture", "two_tower") == "cross_encoder":
    return "pairs"
  return SOURCES[config.negatives.source].candidates


def make(config: ml_collections.ConfigDict, data, workdir: pathlib.Path, encoder, initial_params, mesh,
         step_query_encoder: Callable | None = None) -> Negatives:
  """Builds the negatives of `config` (mining with `initial_params` where the method needs it)."""
  check(config)
  neg = config.negatives
  out = SOURCES[neg.source].build(section(neg), Run.of(config),
                                  Build(data, workdir, encoder, initial_params, mesh, step_query_encoder))
  out.candidates = candidates(config)
  return out


# ------------------------------------------------------------------------------------------------ the sources
# A builder: (its group, Run, Build) -> Negatives. A group's check: (the group, Run, chosen=...) -> None.


def _no_check(group, run: Run, chosen: bool) -> None:
  del group, run, chosen


def _sampled(name: str) -> Callable:
  """The builder of a fixed-pool source: SAMPLERS[name], sampled on the host into token batches."""

  def build(group, run: Run, env: Build) -> Negatives:
    del run
    return Negatives("tokens", sampler=SAMPLERS[name](group, env.data, env.workdir / "cache"))

  return build


def _check_dense_static(dense_static, run: Run, chosen: bool) -> None:
  del run
  if chosen:
    check_mining_backend(dense_static.backend)
  for key in ("extra", "query_length"):
    value = dense_static[key]
    if value < 0 or (value and not chosen):
      raise ValueError(f"negatives.dense_static.{key}={value!r}: an int >= 0, read by source=dense_static only")


def _dense_static(dense_static, run: Run, env: Build) -> Negatives:
  """STAR's static hard negatives: the starting model's own top-n, mined once and cached, held as rows."""
  del run
  data, workdir, top_n = env.data, env.workdir, dense_static.top_n
  train_qids = pairs.training_queries(data.train_qrels)
  depth = top_n + dense_static.extra
  encoder = at_query_length(env.encoder, dense_static.query_length)
  rows = mine_rows(encoder, env.initial_params, train_qids, depth,
                   workdir / "cache" / _cache_name("dense_static", depth, encoder, train_qids),
                   dense_static.backend, dense_static.corpus_dtype, shards_dir=workdir / "cache" / "encoding")
  # STAR's prepare_hardneg.py mines the top 210 and keeps the first 200 that are not positives.
  rows = sampled.drop_rows(rows, positive_rows(data.train_qrels, data.corpus, train_qids), top_n)
  sampler = sampled.RowPools(rows, train_qids, data.train_qrels, data.corpus, "dense_static")
  return Negatives("tokens", sampler=sampler, top_n=top_n, pools_in_use=sampler.rows_of)


def triple_plan(ance: ml_collections.ConfigDict) -> refresh_triples.TriplePlan:
  """How ANCE's refresh generations become triples (jdr/data/refresh_triples.py), from `negatives.ance`."""
  return refresh_triples.TriplePlan(ance.triples_over, ance.refresh_chunks, ance.triple_readers)


def _check_ance(ance, run: Run, chosen: bool) -> None:
  if chosen:
    check_mining_backend(ance.backend)
    if ance.refresh_every < 1:
      raise ValueError("negatives.source='ance' needs negatives.ance.refresh_every >= 1 (steps between refreshes)")
  if ance.triples_per_query < 0 or (ance.triples_per_query and not chosen):
    raise ValueError(f"negatives.ance.triples_per_query={ance.triples_per_query!r}: an int >= 0, read by "
                     "source=ance only (each refresh generation's triples)")
  plan = triple_plan(ance)  # refuses a bad value before anything is loaded
  if plan != refresh_triples.TriplePlan() and not ance.triples_per_query:
    raise ValueError("negatives.ance.triples_over, refresh_chunks and triple_readers shape ANCE's triples: they "
                     "are read with source=ance and triples_per_query > 0 only")
  if ance.triples_per_query and plan.readers and run.batch_size % plan.readers:
    raise ValueError(f"batch_size={run.batch_size} must be a multiple of negatives.ance.triple_readers="
                     f"{plan.readers}: each reader gives a batch the same number of triples")


def _ance(ance, run: Run, env: Build) -> Negatives:
  """ANCE: the model's own top-n, re-mined every `refresh_every` steps by a background re-encode."""
  data, workdir, encoder, top_n = env.data, env.workdir, env.encoder, ance.top_n
  qid_list = pairs.training_queries(data.train_qrels)
  backend, dtype = ance.backend, ance.corpus_dtype

  def mine(params, generation):
    # Runs in the refresher's worker thread, beside training (jitted calls release the GIL); on several
    # hosts on the trainer's thread (inline), so the gather of the hosts' corpus parts, a collective, is
    # issued in the same order as the step's own on every host.
    return mine_rows(encoder, params, qid_list, top_n, None, backend, dtype, shards_dir=workdir / "ance" / "encoding")

  max_wait = float("inf") if ance.refresh_max_wait_s < 0 else float(ance.refresh_max_wait_s)
  refresher = refresh.AsyncRefresher(mine, every=ance.refresh_every, delay=ance.refresh_delay,
                                     directory=workdir / "ance", max_wait_s=max_wait, log=retrieved.log,
                                     initial_params=env.initial_params, inline=jax.process_count() > 1,
                                     last_step=run.num_train_steps)
  sampler = RefreshedNegatives(refresher, qid_list, data.train_qrels, data.corpus, top_n, triple_plan(ance))
  return Negatives("tokens", sampler=sampler, refresher=refresher, top_n=top_n, pools_in_use=sampler.rows_of,
                   triples_per_query=ance.triples_per_query)


def _retrieval(retrieval, run: Run, env: Build) -> Negatives:
  """ADORE / LTRe: candidates are rows of a fixed corpus index, retrieved at every step (in the jitted step
  or on the host) or once before training (`every=0`).

  The corpus matrix exists once: memory-mapped on the host for Faiss (the batch carries its candidates'
  vectors), or on the devices for the in-step JAX search (the host keeps only the map)."""
  settings = retrieved.settings(retrieval)
  data, encoder, mesh, top_n = env.data, env.encoder, env.mesh, settings.top_n
  cache, train_qids = env.workdir / "cache", pairs.training_queries(data.train_qrels)
  corpus_ids = prepared.id_sequence(data.corpus)
  emb = corpus_embeddings(settings.corpus_encoding, encoder, env.initial_params, cache, corpus_ids)
  out = Negatives("corpus", top_n=top_n, doc_emb=emb)
  if settings.in_step:
    out.corpus = retrieved.put_corpus(emb, corpus_ids, mesh, settings.corpus_dtype)
    out.retrieve_in_step = True
    return out
  index = host_search.HostIndex(emb, settings.index_factory, seed=run.seed)
  if settings.every == 0:
    # Mined once with the starting query tower, then fixed: the ablation that isolates "dynamic".
    path = cache / _cache_name("retrieval_static", top_n, encoder, train_qids)
    if path.exists():
      static = paths.load_npy(path)
    else:
      static = index.search(encoder.queries(env.initial_params, train_qids), top_n)
      atomic.write_atomic(path, lambda f: np.save(f, static))
    out.host_fields = lambda batch, state: retrieved.with_vectors(batch, static[batch["query_index"]],
                                                                  index.vectors)
    out.pools_in_use = lambda qids: static[[train_qids.index(q) for q in qids]]
  else:
    out.host_fields = retrieved.HostRetrieval(index, top_n, env.step_query_encoder, mesh)
  return out


# The host samplers of the fixed-pool sources: (their group, data, cache dir) -> NegativeSource | None.
def _bm25(bm25, data, cache_dir):
  return sampled.BM25Negatives(data.corpus, data.queries, data.train_qrels, top_k=bm25.top_k, cache_dir=cache_dir)


def _random(group, data, cache_dir):
  del group
  return sampled.RandomNegatives(data.corpus, data.train_qrels)


def _bm25_random(bm25, data, cache_dir):
  # DPR's mix, 1:1 (ANCE's "BM25 + Rand Neg").
  return sampled.MixedNegatives([(_bm25(bm25, data, cache_dir), 0.5), (_random(None, data, cache_dir), 0.5)])


def _static(static, data, cache_dir):
  del cache_dir
  if not static.run:
    raise ValueError("negatives.source='static' needs negatives.static.run (a TREC run file)")
  return sampled.StaticNegatives(static.run, data.train_qrels, corpus_ids=data.corpus)


def _check_mined(mined, run: Run, chosen: bool) -> None:
  del run
  if chosen and mined.file and not paths.as_path(mined.file).exists():
    raise config_files.ConfigError(config_files.not_found(
        "negatives.mined.file", mined.file, "the --out of python -m jdr.mine, or a Tevatron or sentence-transformers "
        "file", kind="directory or file"))


def _mined(mined, data, cache_dir):
  del cache_dir
  if not mined.file:
    raise ValueError("negatives.source='mined' needs negatives.mined.file (the --out of python -m jdr.mine, or a "
                     "Tevatron or sentence-transformers file)")
  loaded = training_files.load(mined.file, data.corpus, data.queries, data.train_qrels)
  qids, rows = loaded.qids, loaded.rows
  if not paths.as_path(mined.file).is_dir():
    retrieved.log(f"negatives from {mined.file} ({loaded.meta['schema']}): {len(qids)} queries, "
                  f"{int((rows >= 0).sum())} negatives; {loaded.meta['dropped_positives']} dropped as judged relevant")
  train = {q for q, docs in data.train_qrels.items() if any(r > 0 for r in docs.values())}
  without = len(train - set(qids))
  if without:
    retrieved.log(f"{without} of {len(train)} training queries have no negatives in {mined.file} (theirs are "
                  "random, counted in negatives stats)")
  return sampled.RowPools(rows, qids, data.train_qrels, data.corpus, "mined")


SAMPLERS = {"none": lambda group, data, cache_dir: None, "random": _random, "bm25": _bm25,
            "bm25_random": _bm25_random, "static": _static, "triples": given.sampler, "mined": _mined}


@dataclasses.dataclass(frozen=True)
class Source:
  """One value of `negatives.source`: how it is built and what the rest of jdr may ask of it."""
  build: Callable  # (its group, Run, Build) -> Negatives
  group: str = ""  # negatives.GROUP, the settings it alone reads ("" = none)
  candidates: str = "tokens"  # the batches' candidate kind (see `candidates`)
  needs_towers: bool = False  # mined with the model's own towers (so not for a cross-encoder)
  fixed_pool: bool = False  # each query's negatives come from a pool known before training (a teacher can
                            # score them once)


SOURCES = {
    "none": Source(_sampled("none")),
    "random": Source(_sampled("random")),
    "bm25": Source(_sampled("bm25"), "bm25", fixed_pool=True),
    "bm25_random": Source(_sampled("bm25_random"), "bm25"),
    "static": Source(_sampled("static"), "static", fixed_pool=True),
    "triples": Source(_sampled("triples"), "triples", fixed_pool=True),
    "mined": Source(_sampled("mined"), "mined", fixed_pool=True),
    "dense_static": Source(_dense_static, "dense_static", needs_towers=True, fixed_pool=True),
    "ance": Source(_ance, "ance", needs_towers=True),
    "retrieval": Source(_retrieval, "retrieval", candidates="corpus", needs_towers=True),
}

# Each group's check, run for every group (`chosen`: its source is the run's): what its source refuses, and
# the settings that would do nothing under another source.
GROUPS = {"bm25": _no_check, "static": _no_check, "triples": given.check, "mined": _check_mined,
          "dense_static": _check_dense_static, "ance": _check_ance, "retrieval": retrieved.check}


def named(predicate: Callable[[Source], bool]) -> list[str]:
  """The source names whose `Source` satisfies `predicate`, in table order (for error messages)."""
  return [name for name, source in SOURCES.items() if predicate(source)]


def check_mining_backend(backend: str) -> None:
  """Refuses an unknown mining back-end by name alone: resolving `auto` would start JAX's backend, which must
  wait for the mesh's CPU devices and the hosts' start-up."""
  if backend not in host_search.MINE_BACKENDS:
    host_search.mining_backend(backend)  # its refusal, word for word


class RefreshedNegatives(sampled.RowPools):
  """ANCE: uniform negatives from the pools of the refresh generation in force at the current step: each
  generation is rows [Q, top_n] for the training queries `qids` (the refresher's arrays, never id lists)."""

  def __init__(self, refresher, qids, qrels, corpus_ids, top_n: int,
               plan: refresh_triples.TriplePlan | None = None):
    super().__init__(np.full((len(qids), top_n), -1, np.int32), qids, qrels, corpus_ids, "ANCE")
    self.refresher, self.top_n, self.step = refresher, top_n, 0
    self.triple_plan = plan or refresh_triples.TriplePlan()  # read by the batches (pairs.Batches)

  def current_rows(self) -> np.ndarray:
    rows = self.refresher.pools(self.step)
    if rows is None:  # nothing mined yet: every pool empty, so random negatives (counted)
      return self.rows
    if rows.shape != self.rows.shape:
      raise ValueError(f"ANCE: a refresh generation holds rows of shape {rows.shape}, not {self.rows.shape} "
                       "(training queries x negatives.ance.top_n): its directory is another run's")
    return rows

  def generation(self, step: int) -> tuple[int, int]:
    """The generation in force at `step` and its first step by the schedule (the triples' order follows it)."""
    return self.refresher.generation(step)


# ------------------------------------------------------------------------------------------------ mining


def positive_rows(qrels, corpus, qids: list[str]) -> np.ndarray:
  """int32 [Q, P] corpus rows of each query's positives (relevance > 0) in `qrels`, -1 padded: what a miner
  drops."""
  positives = [[d for d, r in qrels.get(q, {}).items() if r > 0] for q in qids]
  width = max((len(p) for p in positives), default=0)
  flat = [d for p in positives for d in p]
  if hasattr(corpus, "row_of"):
    found = corpus.row_of(flat, missing=-1)
  else:
    row = {d: i for i, d in enumerate(corpus)}
    found = np.array([row.get(d, -1) for d in flat], np.int64)
  out, at = np.full((len(qids), max(width, 1)), -1, np.int32), 0
  for b, p in enumerate(positives):
    out[b, :len(p)] = found[at:at + len(p)]
    at += len(p)
  return out


def corpus_embeddings(corpus_encoding: str, encoder, params, cache: pathlib.Path, corpus_ids: list[str]) -> np.ndarray:
  """The fixed document vectors: a `jdr.encode` directory (`corpus_encoding`) when given, else the starting
  document tower's."""
  if corpus_encoding:
    # Refused before step 0: rows of another corpus would silently score the wrong documents.
    encodings.check_ids_match(corpus_encoding, corpus_ids,
                               f"negatives.retrieval.corpus_encoding vs data.dataset={encoder.data.name}")
    emb, _, meta = encodings.load_embeddings(corpus_encoding)
    run_prompt = text_lib.prompt_of(getattr(encoder, "doc_tokenizer", None))
    if meta.get("doc_prompt", "") != run_prompt:
      retrieved.log(f"note: negatives.retrieval.corpus_encoding={corpus_encoding} was encoded with the document prompt "
                    f"{meta.get('doc_prompt', '')!r}, this run's document tower reads {run_prompt!r}")
    return emb
  # Encoded a shard at a time into the workdir (resumable; named for the weights, so a resumed run finds the
  # starting tower's) and read back memory-mapped: the shards are the one copy of the matrix the host keeps.
  retrieved.log(f"the corpus ({len(corpus_ids)} documents) under the starting document tower, in {cache / 'encoding'}")
  return encoder.corpus(params, progress=True, shards_dir=cache / "encoding")


def at_query_length(encoder, length: int):
  """`encoder` encoding queries at `length` tokens (0: its own length), e.g. DRhard's prepare_hardneg.py mining at
  32 where STAR trains at 24. A shallow copy with its own token cache, so the trainer's encoder, which
  evaluates at the training length, never reads a query tokenized at the mining length."""
  if not length or length == encoder.query_max_length:
    return encoder
  other = copy.copy(encoder)
  other.query_max_length = length
  other._query_tokens = {}  # pylint: disable=protected-access  (the copy's own: see above)
  return other


def mine_rows(encoder, params, qids: list[str], n: int, path: pathlib.Path | None,
              backend: str = "auto", dtype: str = "auto", shards_dir: pathlib.Path | None = None) -> np.ndarray:
  """int32 [Q, n] corpus rows of each query's top n under `params` (both towers), exact inner product, searched
  where `backend` says (a source's mining back-end: the JAX top-k on the devices, or Faiss on the host).

  With `path`, the result is cached there: what the starting weights mined stays what a resumed run uses.
  With `shards_dir`, the corpus is encoded into shards there and searched memory-mapped, never held whole.
  """
  if path is not None and path.exists():
    return paths.load_npy(path)
  doc_emb = encoder.corpus(params, progress=path is not None, shards_dir=shards_dir)
  rows, _ = host_search.exact_top_rows(doc_emb, encoder.queries(params, qids), n, backend, dtype,
                                     progress="mining" if path is not None else None)
  if path is not None:
    atomic.write_atomic(path, lambda f: np.save(f, rows))
  return rows


def _cache_name(tag: str, n: int, encoder, ids: list[str]) -> str:
  """A workdir cache file for what the starting weights mined: the settings and ids are in the name, so a
  changed dataset, length or prompt is mined anew rather than read from a stale file."""
  settings = [encoder.query_max_length, encoder.doc_max_length, n]
  prompts = [text_lib.prompt_of(getattr(encoder, f"{side}_tokenizer", None)) for side in ("query", "doc")]
  if any(prompts):  # only then: an unprompted run's cache keeps its name
    settings.append({"prompts": prompts})
  h = hashlib.sha256(json.dumps(settings).encode())
  h.update("\0".join(ids).encode())
  return f"{tag}-top{n}-{h.hexdigest()[:12]}.npy"
