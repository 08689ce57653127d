"""A mining run from first stage to directory: what `python -m jdr.mine` does between its flags and its report.

`RetrieverSettings` and `MineSettings` are the run's settings, built once from the command's flags. A
`Retriever` gives each query's top `depth` candidates (BM25, a model's exact search over the corpus encoding, or
a run file) and the positives' first-stage scores. `load_training` reads the dataset and its training
queries; `mine` measures the filters on the dev queries (`dev_queries`), chooses any value left to dev
(`choose`), filters the training queries chunk by chunk (`mine_queries`, resumable: a chunk's plan names every
setting its arrays depend on) and writes jdr.negatives.mining's directory; `refilter` runs a finished
directory through other filters. `describe` is the report as text.

The cross-encoder comes in as a scorer of (query, document) pairs, or None: the caller builds it, since
reranking stands on a floor above this one.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import tqdm

from jdr.runtime import defaults
from jdr.runtime import paths
from jdr.data import pairs
from jdr.negatives import mining
from jdr.negatives import sources

Scorer = Callable[[Sequence[tuple[str, str]]], np.ndarray]

# A chunk's worth of cross-encoder pairs: seconds on an accelerator, about a quarter of an hour on a 2-core CPU
# (tens of pairs a second), so a stop loses little of either.
CE_CHUNK_PAIRS = 16384


def chunk_queries(chunk: int, depth: int, cross_encoder: bool) -> int:
  """Queries a chunk holds: --chunk, or when it is 0, 4096, or CE_CHUNK_PAIRS' worth of a cross-encoder's pairs."""
  return chunk or (max(1, CE_CHUNK_PAIRS // depth) if cross_encoder else 4096)


@dataclasses.dataclass(frozen=True)
class RetrieverSettings:
  """The first stage: its kind ("bm25", "model" or "run"), its depth, and what the kind reads."""
  kind: str
  depth: int
  model: str | None = None
  doc_model: str | None = None  # the documents' encoder when it is published apart; None: `model`
  encoding: str | None = None  # the corpus's jdr.encode directory; None: encoded into the output directory
  run: str | None = None
  query_max_length: int = 32
  doc_max_length: int = 256
  query_prompt: str | None = None  # None: the model's own
  doc_prompt: str | None = None
  skip_invalid: bool = False


@dataclasses.dataclass(frozen=True)
class MineSettings:
  """The dataset, its splits, the chunking and the cross-encoder of a mining run."""
  data: str
  retriever: RetrieverSettings
  split: str = "train"
  dev_split: str = ""
  dev_fraction: float = 0.2
  chunk: int = 4096  # queries a chunk, already resolved by `chunk_queries`
  cross_encoder: str | None = None
  ce_max_length: int = 256


def choose(filters: mining.Filters, on_dev: list[str], dev: dict | None, where: str) -> mining.Filters:
  """`filters` with each of `on_dev` set to the dev report's choice."""
  if not on_dev:
    return filters
  if dev is None:
    raise ValueError(f"{where}: has no dev report to choose {', '.join(on_dev)} on")
  chosen = {name: mining.choose_on_dev(dev, name) for name in on_dev}
  if "skip_ranks" in chosen:
    chosen["skip_ranks"] = int(chosen["skip_ranks"])
  return dataclasses.replace(filters, **chosen)


class Retriever:
  """Candidates and the positives' scores from the chosen first stage."""

  def __init__(self, settings: RetrieverSettings, data: pairs.RetrievalData, out: pathlib.Path, dataset: str):
    # `dataset`: the directory `data` was read from, named in errors and in a corpus encoding's settings.
    self.settings, self.data, self.out, self.dataset, self.kind = settings, data, out, dataset, settings.kind
    self._index = self._doc_emb = self._query_runtime = None

  def candidates(self, qids: list[str], tag: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(rows int32 [Q, depth], scores float32 [Q, depth], query vectors or None)."""
    s = self.settings
    depth, texts = s.depth, [self.data.queries[q] for q in qids]
    if self.kind == "bm25":
      from jdr.retrieval import bm25  # pylint: disable=g-import-not-at-top  (only BM25 users need numba)
      if self._index is None:
        self._index = bm25.corpus_index(self.data.corpus, cache_dir=self.out / "cache")
      mined = bm25.mine(self._index, texts, min(depth, len(self._index)), self.out / "cache", query_ids=qids,
                        desc=f"BM25 candidates ({tag})")
      return np.asarray(mined.rows, np.int32), np.asarray(mined.scores, np.float32), None
    if self.kind == "run":
      from jdr.data import run_arrays  # pylint: disable=g-import-not-at-top
      ranked = run_arrays.read(s.run, qids, self.data.corpus, depth=depth, skip_invalid=s.skip_invalid)
      missing = [q for q, n in zip(qids, ranked.lengths.tolist()) if n == 0]
      if missing:
        print(f"jdr.mine: {s.run} ranks nothing for {len(missing)} of the {len(qids)} {tag} queries "
              f"(e.g. {missing[:3]}): they get no negatives", file=sys.stderr)
      return ranked.rows, np.where(ranked.rows >= 0, ranked.scores, np.nan).astype(np.float32), None
    from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
    from jdr.retrieval import host_search  # pylint: disable=g-import-not-at-top
    doc_emb = self.doc_emb()
    if self._query_runtime is None:
      self._query_runtime = encoder_runtime.load_runtime(s.model, side="query", max_length=s.query_max_length,
                                                         prompt=s.query_prompt)
      print(encoder_runtime.length_line(self._query_runtime, "queries"), file=sys.stderr)
    query_emb = encoder_runtime.encode_texts(self._query_runtime, texts)
    rows, scores = host_search.exact_top_rows(doc_emb, query_emb, depth, progress=f"dense candidates ({tag})")
    return rows, np.where(rows >= 0, scores, np.nan).astype(np.float32), query_emb

  def doc_emb(self):
    from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
    from jdr.retrieval import encodings  # pylint: disable=g-import-not-at-top
    if self._doc_emb is None:
      s = self.settings
      encoding = s.encoding
      if encoding:
        encodings.check_ids_match(encoding, self.data.corpus, f"--encoding vs --data {self.dataset}")
      else:
        encoding = self.out / "encoding"
        doc_model = s.doc_model or s.model
        runtime = encoder_runtime.load_runtime(doc_model, side="doc", max_length=s.doc_max_length,
                                               prompt=s.doc_prompt)
        print(encoder_runtime.length_line(runtime, "documents"), file=sys.stderr)
        encodings.encode_corpus(runtime, self.data.corpus, encoding,
                                settings=encodings.corpus_settings(runtime, doc_model, self.dataset))
      self._doc_emb, _, _ = encodings.load_embeddings(encoding)
    return self._doc_emb

  def positive_scores(self, qids: list[str], positives: np.ndarray, rows: np.ndarray, scores: np.ndarray,
                      query_emb) -> np.ndarray:
    if self.kind == "bm25":
      return mining.bm25_scores(self._index, [self.data.queries[q] for q in qids], positives)
    if self.kind == "model":
      return mining.dot_scores(query_emb, self.doc_emb(), positives)
    return mining.run_scores(rows, scores, positives)  # a run scores only what it ranks


def _cheap(filters: mining.Filters) -> mining.Filters:
  """The filters before the cross-encoder's: what it need not score."""
  return mining.Filters(filters.skip_ranks, filters.positive_fraction)


def _candidate_plan(settings: MineSettings) -> dict:
  """Every setting a chunk's candidates and teacher scores depend on: a resume under any other starts over."""
  r = settings.retriever
  return {"data": str(paths.absolute(settings.data)), "split": settings.split, "retriever": r.kind,
          "model": r.model, "encoding": r.encoding and str(paths.absolute(r.encoding)), "run": r.run,
          **({"doc_model": r.doc_model} if r.doc_model else {}),  # absent: earlier plans still resume
          "depth": r.depth, "query_max_length": r.query_max_length, "doc_max_length": r.doc_max_length,
          "skip_invalid": r.skip_invalid, "cross_encoder": settings.cross_encoder,
          "ce_max_length": settings.ce_max_length,
          # Only when given: a plan from before the flags existed (the model's own prompts) still matches.
          **{f"{side}_prompt": getattr(r, f"{side}_prompt") for side in ("query", "doc")
             if getattr(r, f"{side}_prompt") is not None}}


def load_training(settings: MineSettings, out: pathlib.Path) -> tuple[pairs.RetrievalData, list[str]]:
  """The dataset (its corpus prepared under `out`) and its training queries with a positive, sorted."""
  data_cfg = defaults.get_config().data
  data_cfg.dataset, data_cfg.train_split, data_cfg.eval_split = settings.data, settings.split, settings.dev_split
  data = pairs.load(data_cfg, out)
  qids = sorted(q for q, docs in data.train_qrels.items() if any(r > 0 for r in docs.values()))
  if data.files is None or not hasattr(data.corpus, "row_of"):
    raise ValueError(f"--data {settings.data}: jdr.mine reads a local corpus file it can prepare (rows by id)")
  return data, qids


def mine(settings: MineSettings, data: pairs.RetrievalData, qids: list[str], out: pathlib.Path, score: Scorer | None,
         filters: mining.Filters, on_dev: list[str], *, started: float) -> dict:
  """Mines `qids` into `out` (the dev report first, so a value left to dev is chosen before the training queries
  are filtered) and returns the report; `started` is the time.perf_counter() its seconds count from."""
  retriever = Retriever(settings.retriever, data, out, settings.data)
  dev = dev_queries(settings, data, out, retriever, score, filters)
  filters = choose(filters, on_dev, dev, "jdr.mine")
  mined, counts = mine_queries(settings, data, out, retriever, score, filters, qids)
  r = settings.retriever
  report = {"queries": len(qids), "retriever": r.kind, "depth": r.depth, "training": counts,
            **_kept(mined["rows"], filters, on_dev), "seconds": round(time.perf_counter() - started, 1)}
  if dev is not None:
    report["dev"] = {"split": settings.dev_split or f"{settings.dev_fraction:g} of {settings.split}", **dev}
  meta = {"data": str(pathlib.Path(settings.data).absolute()), "split": settings.split,
          "dev_split": settings.dev_split,
          "corpus": data.corpus.manifest.get("source") if hasattr(data.corpus, "manifest") else None,
          "num_docs": len(data.corpus), "retriever": r.kind, "model": r.model, "run": r.run,
          "cross_encoder": settings.cross_encoder, "filters": dataclasses.asdict(filters), "report": report}
  mining.write(out, qids, mined["rows"], mined["scores"], mined["positives"], meta, teacher=mined["teacher"],
               positive_teacher=mined["positive_teacher"])
  mined["chunks"].remove()
  shutil.rmtree(out / mining.PARTIAL_DEV, ignore_errors=True)
  return report


def mine_queries(settings: MineSettings, data: pairs.RetrievalData, out: pathlib.Path, retriever: Retriever,
                 score: Scorer | None, filters: mining.Filters, qids: list[str]) -> tuple[dict, dict]:
  """Filters the training queries chunk by chunk (resumable) and writes the directory; (dropped, no_bound)."""
  rows, scores, query_emb = retriever.candidates(qids, "training")
  positives = sources.positive_rows(data.train_qrels, data.corpus, qids)
  pos_scores = None
  if filters.positive_fraction is not None:
    pos_scores = retriever.positive_scores(qids, positives, rows, scores, query_emb)
  width = filters.keep or rows.shape[1]
  plan = {**_candidate_plan(settings), "filters": dataclasses.asdict(filters)}
  chunks = mining.Chunks(out, plan, len(qids), settings.chunk)
  bounds = chunks.bounds()
  todo = [k for k in range(len(bounds)) if not chunks.done(k)]
  cheap = None
  if score is not None:  # what the cross-encoder must score, known before it starts: its bar counts pairs
    cheap = mining.apply(rows, scores, positives, _cheap(filters), positive_scores=pos_scores, qids=qids).alive
    bar = _pairs_bar("training", rows, positives, cheap, [bounds[k] for k in todo])
  else:
    bar = tqdm.tqdm(total=len(qids), initial=len(qids) - sum(hi - lo for lo, hi in (bounds[k] for k in todo)),
                    desc="filter", unit="query", mininterval=1.0, file=sys.stderr)
  for k in todo:
    lo, hi = bounds[k]
    part = slice(lo, hi)
    part_pos_scores = None if pos_scores is None else pos_scores[part]
    teacher = pos_teacher = None
    if score is not None:
      teacher, pos_teacher = _score_part(score, data, qids[part], rows[part], positives[part], cheap[part], bar)
    result = mining.apply(rows[part], scores[part], positives[part], filters, positive_scores=part_pos_scores,
                          teacher=teacher, positive_teacher=pos_teacher, qids=qids[part])
    kept = mining.compact(result.alive, rows[part], scores[part], *([teacher] if teacher is not None else []),
                          width=width, fill=(-1, np.nan))
    arrays = {"rows": kept[0], "scores": kept[1], "dropped": np.asarray([result.dropped.get(f, 0)
                                                                         for f in mining.FILTERS], np.int64),
              "no_bound": np.asarray([result.no_bound.get(f, 0) for f in mining.FILTERS], np.int64)}
    if teacher is not None:
      arrays["teacher"], arrays["positive_teacher"] = kept[2], pos_teacher
    chunks.save(k, **arrays)
    if score is None:
      bar.update(hi - lo)
  bar.close()
  parts = [chunks.load(k) for k in range(len(bounds))]
  join = lambda name: np.concatenate([p[name] for p in parts]) if parts else None
  dropped = dict(zip(mining.FILTERS, np.sum([p["dropped"] for p in parts], axis=0).tolist()))
  no_bound = dict(zip(mining.FILTERS, np.sum([p["no_bound"] for p in parts], axis=0).tolist()))
  teacher = join("teacher") if score is not None else None
  return (dict(rows=join("rows"), scores=join("scores"), positives=positives, teacher=teacher,
               positive_teacher=join("positive_teacher") if score is not None else None, chunks=chunks),
          _training(filters, dropped, no_bound, rows))


def _training(filters: mining.Filters, dropped: dict, no_bound: dict, rows: np.ndarray) -> dict:
  """The report's "training" part: the candidates, what each filter that ran dropped, the queries a relative
  filter could not judge."""
  on = lambda f: getattr(filters, f) is not None and getattr(filters, f) != 0
  return {"dropped": {f: v for f, v in dropped.items() if f == "positives" or on(f)},
          "no_bound": {f: v for f, v in no_bound.items() if v}, "candidates": int((np.asarray(rows) >= 0).sum())}


def _kept(rows: np.ndarray, filters: mining.Filters, on_dev: list[str]) -> dict:
  """The report's figures of the negatives written, and the filter values chosen on dev."""
  alive = np.asarray(rows) >= 0
  return {"negatives": int(alive.sum()), "queries_without_negatives": int((~alive.any(axis=1)).sum()),
          "chosen_on_dev": {name: getattr(filters, name) for name in on_dev}}


def dev_queries(settings: MineSettings, data: pairs.RetrievalData, out: pathlib.Path, retriever: Retriever,
                score: Scorer | None, filters: mining.Filters) -> dict | None:
  if settings.dev_split:
    qrels, what = data.eval_qrels or {}, f"--dev-split {settings.dev_split}"
  elif settings.dev_fraction > 0:
    qrels = pairs.keep_fraction(data.train_qrels, settings.dev_fraction)
    what = f"--dev-fraction {settings.dev_fraction}"
  else:
    return None
  qids = sorted(q for q, docs in qrels.items() if any(r > 0 for r in docs.values()) and q in data.queries)
  if not qids:
    raise ValueError(f"{what}: no query with a positive")
  rows, scores, query_emb = retriever.candidates(qids, "dev")
  positives = sources.positive_rows(qrels, data.corpus, qids)
  pos_scores = retriever.positive_scores(qids, positives, rows, scores, query_emb)
  teacher = pos_teacher = None
  if score is not None:
    teacher, pos_teacher = dev_teacher_scores(settings, data, out, score, qids, rows, positives)
  return mining.dev_report(rows, scores, positives, filters, positive_scores=pos_scores, teacher=teacher,
                           positive_teacher=pos_teacher)


def dev_teacher_scores(settings: MineSettings, data: pairs.RetrievalData, out: pathlib.Path, score: Scorer,
                       qids: list[str], rows: np.ndarray, positives: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The cross-encoder's scores of every dev candidate and positive, chunk by chunk under OUT/partial-dev (a
  restart scores only the chunks it had not finished), with a bar of pairs."""
  plan = {"dev": [settings.dev_split, settings.dev_fraction], **_candidate_plan(settings)}
  chunks = mining.Chunks(out, plan, len(qids), settings.chunk, folder=mining.PARTIAL_DEV)
  bounds = chunks.bounds()
  todo = [k for k in range(len(bounds)) if not chunks.done(k)]
  bar = _pairs_bar("dev", rows, positives, None, [bounds[k] for k in todo])
  for k in todo:
    lo, hi = bounds[k]
    teacher, pos_teacher = _score_part(score, data, qids[lo:hi], rows[lo:hi], positives[lo:hi], None, bar)
    chunks.save(k, teacher=teacher, positive_teacher=pos_teacher)
  bar.close()
  parts = [chunks.load(k) for k in range(len(bounds))]
  return (np.concatenate([p["teacher"] for p in parts]), np.concatenate([p["positive_teacher"] for p in parts]))


def _score_part(score: Scorer, data: pairs.RetrievalData, qids: list[str], rows: np.ndarray, positives: np.ndarray,
                alive: np.ndarray | None, bar) -> tuple[np.ndarray, np.ndarray]:
  """The cross-encoder's scores of some queries' candidates (those alive) and positives."""
  texts = [data.queries[q] for q in qids]
  return (mining.teacher_scores(score, data.corpus, texts, rows, alive, bar=bar),
          mining.teacher_scores(score, data.corpus, texts, positives, bar=bar))


def _pairs_bar(tag: str, rows: np.ndarray, positives: np.ndarray, alive: np.ndarray | None,
               bounds: list[tuple[int, int]]):
  """A bar of the pairs `_score_part` will score over the query ranges `bounds`."""
  total = sum(int(mining.scored_mask(rows[lo:hi], None if alive is None else alive[lo:hi]).sum()
                  + mining.scored_mask(positives[lo:hi]).sum()) for lo, hi in bounds)
  return tqdm.tqdm(total=total, desc=f"cross-encoder ({tag})", unit="pair", mininterval=5.0, file=sys.stderr)


def refilter(source: pathlib.Path, out: pathlib.Path, filters: mining.Filters, on_dev: list[str]) -> dict:
  """A finished directory's negatives through `filters` (on top of its own), written to `out`; the report."""
  mined = mining.read(source)
  old = mined.meta.get("report") or {}
  filters = choose(filters, on_dev, old.get("dev"), f"--from {source}")
  if filters.needs_teacher and mined.teacher is None:
    raise ValueError(f"--from {source}: a cross-encoder filter needs the cross-encoder's scores, which this "
                     "directory was mined without (--cross-encoder)")
  rows = np.asarray(mined.rows)
  result = mining.apply(rows, mined.scores, mined.positives, filters, teacher=mined.teacher,
                        positive_teacher=mined.positive_teacher, qids=mined.qids)
  arrays = [rows, mined.scores] + ([mined.teacher] if mined.teacher is not None else [])
  kept = mining.compact(result.alive, *arrays, width=filters.keep or rows.shape[1], fill=(-1, np.nan))
  teacher = kept[2] if mined.teacher is not None else None
  report = {"queries": len(mined.qids), "retriever": old.get("retriever"), "depth": old.get("depth"),
            "from": str(source.absolute()), "training": _training(filters, result.dropped, result.no_bound, rows),
            **_kept(kept[0], filters, on_dev)}
  if old.get("dev"):
    report["dev"] = old["dev"]
  meta = {**mined.meta, "from": str(source.absolute()), "filters": dataclasses.asdict(filters),
          "filters_before": mined.meta.get("filters"), "report": report}
  for key in ("format", "complete", "queries", "width", "teacher"):
    meta.pop(key, None)
  mining.write(out, mined.qids, kept[0], kept[1], np.asarray(mined.positives), meta,
               teacher=teacher, positive_teacher=None if teacher is None else np.asarray(mined.positive_teacher))
  return report


def describe(report: dict) -> str:
  """The report as text: what each filter dropped, then the dev table."""
  lines = [f"{report['queries']} training queries, {report['training']['candidates']} candidates "
           f"({report['retriever']}, depth {report['depth']})"]
  for name, count in report["training"]["dropped"].items():
    lines.append(f"  {name:<18} dropped {count:>10,}")
  for name, value in (report.get("chosen_on_dev") or {}).items():
    lines.append(f"  {name} chosen on dev: {value:g}")
  lines.append(f"  kept {report['negatives']:,} negatives ({report['negatives'] / max(report['queries'], 1):.1f} a "
               f"query; {report['queries_without_negatives']} queries with none)")
  dev = report.get("dev")
  if dev:
    lines.append(f"dev ({dev['queries']} queries, {dev['candidates']} candidates, {dev['positives_among_candidates']} "
                 "labeled positives among them): each filter alone")
    lines.append(f"  {'filter':<18} {'value':>8} {'dropped':>8} {'FN rate':>8} {'pos. dropped':>12} {'F1':>6}")
    u = dev["unfiltered"]
    lines.append(f"  {'none':<18} {'':>8} {u['dropped']:>8.2%} {u['false_negative_rate']:>8.2%} "
                 f"{u['positives_dropped']:>12.2%}")
    for name in ("skip_ranks", "positive_fraction", "ce_threshold", "ce_margin"):
      for value, r in dev.get(name, {}).items():
        if value == "queries":
          continue
        lines.append(f"  {name:<18} {value:>8} {r['dropped']:>8.2%} {r['false_negative_rate']:>8.2%} "
                     f"{r['positives_dropped']:>12.2%} {r.get('f1', float('nan')):>6.3f}")
  return "\n".join(lines)
