"""The negatives a config names, built once before training: `make(config, ...) -> Negatives`.

`negatives.source`:
  none | random | bm25 | bm25_random | static   sampled from fixed pools into token batches (DPR-style)
  triples        pools = the negatives of a dataset's own triples file (MS MARCO's triples.train.small.tsv)
  mined          pools = a `python -m jdr.mine` directory's filtered negatives, or a Tevatron or
                 sentence-transformers file's (`negatives.mined`, jdr.negatives.training_files)
  dense_static   pools = the starting model's own top-n, mined once and cached (STAR's static hard negatives)
  ance           pools = the model's own top-n, re-mined every `refresh_every` steps in the background (ANCE)
  retrieval      candidates = rows of a fixed corpus index: retrieved at every step (`retrieve_every=1`,
                 ADORE / LTRe) or once before training (`retrieve_every=0`, the static ablation)

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


def check(config: ml_collections.ConfigDict) -> None:
  """Refuses inconsistent negative settings before anything is loaded."""
  neg = config.negatives
  if neg.source not in SOURCES:
    raise ValueError(f"negatives.source must be one of {', '.join(SOURCES)}; got {neg.source!r}")
  if neg.source == "none" and neg.per_query:
    raise ValueError("negatives.per_query > 0 needs negatives.source (random, bm25, ...)")
  if neg.source not in ("none", "retrieval") and neg.per_query < 1:
    raise ValueError(f"negatives.source={neg.source!r} needs negatives.per_query >= 1")
  if neg.source == "retrieval":
    if config.model.train_towers != "query":
      raise ValueError("negatives.source='retrieval' scores against a fixed corpus index, so only the query "
                       "tower may train: set model.train_towers=query (and model.shared=False)")
    if neg.retrieval_backend not in ("faiss", "jax"):
      raise ValueError(f"negatives.retrieval_backend must be faiss or jax, got {neg.retrieval_backend!r}")
    if neg.retrieval_backend == "jax" and neg.index_factory.strip().lower() != "flat":
      raise ValueError(f"negatives.index_factory={neg.index_factory!r} needs retrieval_backend=faiss "
                       "(the JAX back-end is exact top-k over the flat matrix)")
  if neg.source in ("dense_static", "ance"):
    host_search.mining_backend(neg.mine_backend)  # refuses an unknown name before anything is loaded
  if neg.source == "ance" and neg.refresh_every < 1:
    raise ValueError("negatives.source='ance' needs negatives.refresh_every >= 1 (steps between refreshes)")
  if neg.pair_weighting != "none" and neg.source == "retrieval":
    raise ValueError("negatives.pair_weighting weighs token batches' pairs, not source=retrieval's candidates")
  if neg.mine_extra < 0 or (neg.mine_extra and neg.source != "dense_static"):
    raise ValueError(f"negatives.mine_extra={neg.mine_extra!r}: an int >= 0, read by source=dense_static only")
  if neg.triples_per_query < 0 or (neg.triples_per_query and neg.source != "ance"):
    raise ValueError(f"negatives.triples_per_query={neg.triples_per_query!r}: an int >= 0, read by source=ance "
                     "only (each refresh generation's triples)")
  plan = triple_plan(neg)  # refuses a bad value before anything is loaded
  if plan != refresh_triples.TriplePlan() and not neg.triples_per_query:
    raise ValueError("negatives.triples_over, refresh_chunks and triple_readers shape ANCE's triples: they are "
                     "read with source=ance and triples_per_query > 0 only")
  if neg.triples_per_query and plan.readers and config.batch_size % plan.readers:
    raise ValueError(f"batch_size={config.batch_size} must be a multiple of negatives.triple_readers="
                     f"{plan.readers}: each reader gives a batch the same number of triples")
  mine_length = neg.get("mine_query_length", 0)
  if mine_length < 0 or (mine_length and neg.source != "dense_static"):
    raise ValueError(f"negatives.mine_query_length={mine_length!r}: an int >= 0, read by source=dense_static only")
  if candidates(config) == "pairs":
    check_cross_encoder(config)


def triple_plan(neg: ml_collections.ConfigDict) -> refresh_triples.TriplePlan:
  """How ANCE's refresh generations become triples (jdr/data/refresh_triples.py), from `negatives`."""
  return refresh_triples.TriplePlan(neg.get("triples_over", "pairs"), neg.get("refresh_chunks", 1),
                                    neg.get("triple_readers", 0))


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
  out = SOURCES[config.negatives.source].build(config, data, workdir, encoder, initial_params, mesh,
                                               step_query_encoder)
  out.candidates = candidates(config)
  return out


def _sampled_source(config, data, workdir, *_) -> Negatives:
  """none | random | bm25 | bm25_random | static | triples: fixed pools, sampled on the host into token batches."""
  neg = config.negatives
  return Negatives("tokens", sampler=SAMPLERS[neg.source](neg, data, workdir / "cache"))


def _dense_static(config, data, workdir, encoder, initial_params, *_) -> Negatives:
  """STAR's static hard negatives: the starting model's own top-n, mined once and cached, held as rows."""
  neg, train_qids = config.negatives, pairs.training_queries(data.train_qrels)
  depth = neg.top_n + neg.mine_extra
  encoder = at_query_length(encoder, neg.get("mine_query_length", 0))
  rows = mine_rows(encoder, initial_params, train_qids, depth,
                   workdir / "cache" / _cache_name("dense_static", depth, encoder, train_qids),
                   neg.mine_backend, neg.corpus_dtype, shards_dir=workdir / "cache" / "encoding")
  # STAR's prepare_hardneg.py mines the top 210 and keeps the first 200 that are not positives.
  rows = sampled.drop_rows(rows, positive_rows(data.train_qrels, data.corpus, train_qids), neg.top_n)
  sampler = sampled.RowPools(rows, train_qids, data.train_qrels, data.corpus, "dense_static")
  return Negatives("tokens", sampler=sampler, top_n=neg.top_n, pools_in_use=sampler.rows_of)


def _ance(config, data, workdir, encoder, initial_params, *_) -> Negatives:
  """ANCE: the model's own top-n, re-mined every `refresh_every` steps by a background re-encode."""
  neg, qid_list = config.negatives, pairs.training_queries(data.train_qrels)

  def mine(params, generation):
    # Runs in the refresher's worker thread, beside training (jitted calls release the GIL); on several
    # hosts on the trainer's thread (inline), so the gather of the hosts' corpus parts, a collective, is
    # issued in the same order as the step's own on every host.
    return mine_rows(encoder, params, qid_list, neg.top_n, None, neg.mine_backend, neg.corpus_dtype,
                     shards_dir=workdir / "ance" / "encoding")

  max_wait = float("inf") if neg.refresh_max_wait_s < 0 else float(neg.refresh_max_wait_s)
  refresher = refresh.AsyncRefresher(mine, every=neg.refresh_every, delay=neg.refresh_delay,
                                     directory=workdir / "ance", max_wait_s=max_wait, log=retrieved.log,
                                     initial_params=initial_params, inline=jax.process_count() > 1)
  sampler = RefreshedNegatives(refresher, qid_list, data.train_qrels, data.corpus, neg.top_n, triple_plan(neg))
  return Negatives("tokens", sampler=sampler, refresher=refresher, top_n=neg.top_n,
                   pools_in_use=sampler.rows_of)


def _retrieval(config, data, workdir, encoder, initial_params, mesh, step_query_encoder) -> Negatives:
  """ADORE / LTRe: candidates are rows of a fixed corpus index, retrieved at every step (in the jitted step
  or on the host) or once before training (`retrieve_every=0`).

  The corpus matrix exists once: memory-mapped on the host for Faiss (the batch carries its candidates'
  vectors), or on the devices for the in-step JAX search (the host keeps only the map)."""
  neg, cache, train_qids = config.negatives, workdir / "cache", pairs.training_queries(data.train_qrels)
  corpus_ids = prepared.id_sequence(data.corpus)
  emb = corpus_embeddings(neg, encoder, initial_params, cache, corpus_ids)
  out = Negatives("corpus", top_n=neg.top_n, doc_emb=emb)
  if neg.retrieval_backend == "jax" and neg.retrieve_every != 0:
    out.corpus = retrieved.put_corpus(emb, corpus_ids, mesh, neg.corpus_dtype)
    out.retrieve_in_step = True
    return out
  index = host_search.HostIndex(emb, neg.index_factory, seed=config.seed)
  if neg.retrieve_every == 0:
    # Mined once with the starting query tower, then fixed: the ablation that isolates "dynamic".
    path = cache / _cache_name("retrieval_static", neg.top_n, encoder, train_qids)
    if path.exists():
      static = paths.load_npy(path)
    else:
      static = index.search(encoder.queries(initial_params, train_qids), neg.top_n)
      atomic.write_atomic(path, lambda f: np.save(f, static))
    out.host_fields = lambda batch, state: retrieved.with_vectors(batch, static[batch["query_index"]],
                                                                  index.vectors)
    out.pools_in_use = lambda qids: static[[train_qids.index(q) for q in qids]]
  else:
    out.host_fields = retrieved.HostRetrieval(index, neg.top_n, step_query_encoder, mesh)
  return out


def _bm25(neg, data, cache_dir):
  return sampled.BM25Negatives(data.corpus, data.queries, data.train_qrels, top_k=neg.bm25_top_k,
                               cache_dir=cache_dir)


def _random(neg, data, cache_dir):
  return sampled.RandomNegatives(data.corpus, data.train_qrels)


def _bm25_random(neg, data, cache_dir):
  # DPR's mix, 1:1 (ANCE's "BM25 + Rand Neg").
  return sampled.MixedNegatives([(_bm25(neg, data, cache_dir), 0.5), (_random(neg, data, cache_dir), 0.5)])


def _static(neg, data, cache_dir):
  if not neg.static_run:
    raise ValueError("negatives.source='static' needs negatives.static_run (a TREC run file)")
  return sampled.StaticNegatives(neg.static_run, data.train_qrels, corpus_ids=data.corpus)


# The host samplers of the fixed-pool sources: (negatives config, data, cache dir) -> NegativeSource | None.
def _mined(neg, data, cache_dir):
  del cache_dir
  if not neg.mined:
    raise ValueError("negatives.source='mined' needs negatives.mined (the --out of python -m jdr.mine, or a "
                     "Tevatron or sentence-transformers file)")
  mined = training_files.load(neg.mined, data.corpus, data.queries, data.train_qrels)
  qids, rows = mined.qids, mined.rows
  if not paths.as_path(neg.mined).is_dir():
    retrieved.log(f"negatives from {neg.mined} ({mined.meta['schema']}): {len(qids)} queries, "
                  f"{int((rows >= 0).sum())} negatives; {mined.meta['dropped_positives']} dropped as judged relevant")
  train = {q for q, docs in data.train_qrels.items() if any(r > 0 for r in docs.values())}
  without = len(train - set(qids))
  if without:
    retrieved.log(f"{without} of {len(train)} training queries have no negatives in {neg.mined} (theirs are "
                  "random, counted in negatives stats)")
  return sampled.RowPools(rows, qids, data.train_qrels, data.corpus, "mined")


SAMPLERS = {"none": lambda neg, data, cache_dir: None, "random": _random, "bm25": _bm25,
            "bm25_random": _bm25_random, "static": _static, "triples": given.sampler, "mined": _mined}


@dataclasses.dataclass(frozen=True)
class Source:
  """One value of `negatives.source`: how it is built and what the rest of jdr may ask of it."""
  build: Callable  # (config, data, workdir, encoder, initial_params, mesh, step_query_encoder) -> Negatives
  candidates: str = "tokens"  # the batches' candidate kind (see `candidates`)
  needs_towers: bool = False  # mined with the model's own towers (so not for a cross-encoder)
  fixed_pool: bool = False  # each query's negatives come from a pool known before training (a teacher can
                            # score them once)


SOURCES = {
    "none": Source(_sampled_source),
    "random": Source(_sampled_source),
    "bm25": Source(_sampled_source, fixed_pool=True),
    "bm25_random": Source(_sampled_source),
    "static": Source(_sampled_source, fixed_pool=True),
    "triples": Source(_sampled_source, fixed_pool=True),
    "mined": Source(_sampled_source, fixed_pool=True),
    "dense_static": Source(_dense_static, needs_towers=True, fixed_pool=True),
    "ance": Source(_ance, needs_towers=True),
    "retrieval": Source(_retrieval, candidates="corpus", needs_towers=True),
}


def named(predicate: Callable[[Source], bool]) -> list[str]:
  """The source names whose `Source` satisfies `predicate`, in table order (for error messages)."""
  return [name for name, source in SOURCES.items() if predicate(source)]


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
                       "(training queries x negatives.top_n): its directory is another run's")
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


def corpus_embeddings(neg, encoder, params, cache: pathlib.Path, corpus_ids: list[str]) -> np.ndarray:
  """The fixed document vectors: a `jdr.encode` directory when given, else the starting document tower's."""
  if neg.corpus_encoding:
    # Refused before step 0: rows of another corpus would silently score the wrong documents.
    encodings.check_ids_match(neg.corpus_encoding, corpus_ids,
                               f"negatives.corpus_encoding vs data.dataset={encoder.data.name}")
    emb, _, meta = encodings.load_embeddings(neg.corpus_encoding)
    run_prompt = text_lib.prompt_of(getattr(encoder, "doc_tokenizer", None))
    if meta.get("doc_prompt", "") != run_prompt:
      retrieved.log(f"note: negatives.corpus_encoding={neg.corpus_encoding} was encoded with the document prompt "
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
  where `negatives.mine_backend` says (the JAX top-k on the devices, or Faiss on the host).

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
