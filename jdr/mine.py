"""Mine hard negatives for training queries, with false-negative filters chosen on dev: `python -m jdr.mine`.

  python -m jdr.mine --data DIR --out MINED [--split train] [--dev-split dev | --dev-fraction 0.2]
                     [--retriever bm25 | --retriever model --model M [--encoding ENC] | --retriever run --run R]
                     [--depth 200] [--skip-ranks R] [--positive-fraction F]
                     [--cross-encoder CE [--ce-threshold T | --ce-margin M]] [--keep N]
  python -m jdr.mine --from MINED --out MINED2 [--skip-ranks R] [--ce-threshold T | --ce-margin M] [--keep N]

For every training query (qrels/SPLIT with a positive), the retriever's top --depth documents are the
candidates; its labeled positives go, then the filters run in order (jdr.negatives.mining's docstring says
each). With a cross-encoder, every candidate the cheap filters keep and every positive get its score, written
beside the negatives as the teacher's (for MarginMSE or listwise distillation), whether or not a cross-encoder
filter is on. With --dev-split (held-out training queries, e.g. python -m jdr.reproduce's dev split), each
filter is measured alone on those queries at a grid of thresholds: the share of candidates it drops and the
false-negative rate it leaves (labeled positives among what it keeps); without it, on a fixed 20% of the
training queries (--dev-fraction). Choose thresholds there, never on test: a filter's value "dev" takes the
report's choice (`jdr.negatives.mining.choose_on_dev`: the best F1 at dropping the dev queries' hidden
positives). --from filters a finished directory again, without retrieving or scoring anything: read its dev
report, then choose (the cross-encoder's scores are kept for every candidate it did not filter).

The output directory (jdr.negatives.mining's layout) is what `jdr.train --config.negatives.source=mined
--config.negatives.mined=MINED` reads. A killed run resumes: the retriever's candidates are cached
(BM25's arrays, the corpus encoding's shards) and the filtered chunks of queries are kept as they finish.
Standard output gets a report of what each filter dropped and the dev table, and, last, one JSON line.
"""

from __future__ import annotations

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

import argparse
import dataclasses
import json
import pathlib
import shutil
import sys
import time
from collections.abc import Iterable

import numpy as np
import tqdm

from jdr.runtime import cli
from jdr.retrieval import flags
from jdr.runtime import defaults
from jdr.runtime import paths
from jdr.runtime import workdir_lock
from jdr.data import pairs
from jdr.negatives import mining
from jdr.negatives import sources

RETRIEVERS = ("bm25", "model", "run")


DEV = "dev"  # a filter's value chosen on the dev report
# A chunk's worth of cross-encoder pairs: seconds on an accelerator, about a quarter of an hour on a 2-core CPU
# (tens of pairs a second), so a stop loses little of either.
CE_CHUNK_PAIRS = 16384


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m jdr.mine", description=__doc__.splitlines()[0])
  parser.add_argument("--data", default=None, help="dataset directory (BEIR's layout or MS MARCO's own files)")
  parser.add_argument("--from", dest="source", default=None,
                      help="instead of --data: a finished jdr.mine directory to filter again (no retrieval or "
                           "scoring; --positive-fraction needs the retriever and is refused)")
  parser.add_argument("--out", required=True, help="output directory (resumes if it holds an unfinished run)")
  parser.add_argument("--split", default="train", help="the training queries' qrels split")
  parser.add_argument("--dev-split", default="",
                      help="held-out training queries' qrels split for the filters' dev report (e.g. jdr.reproduce's "
                           "dev); without it, --dev-fraction of the training queries")
  parser.add_argument("--dev-fraction", type=float, default=0.2,
                      help="without --dev-split: the report's queries, a fixed fraction of the training queries (by a "
                           "hash of the id; they are mined too); 0: no report")
  parser.add_argument("--retriever", choices=RETRIEVERS, default="bm25")
  parser.add_argument("--model", default=None, help="--retriever model: a jdr model, published directory or hub "
                      "id, or minilm")
  parser.add_argument("--doc-model", default=None, help="--retriever model: the documents' encoder when it is "
                      "published apart (DPR's context encoder); default: --model")
  flags.add_prompt_flags(parser, "query", "doc")
  parser.add_argument("--encoding", default=None,
                      help="--retriever model: the corpus's jdr.encode directory (default: encoded into OUT)")
  parser.add_argument("--run", default=None, help="--retriever run: a TREC run or MS MARCO top1000 file")
  parser.add_argument("--depth", type=int, default=200, help="candidates a query, before filtering")
  parser.add_argument("--skip-ranks", type=_int_or_dev, default=0, help="drop each query's best R candidates")
  parser.add_argument("--positive-fraction", type=_float_or_dev, default=None,
                      help="drop candidates scoring above F x the query's lowest positive retriever score")
  parser.add_argument("--cross-encoder", default=None, help="a jdr cross-encoder (workdir or export) or HF dir")
  parser.add_argument("--ce-threshold", type=_float_or_dev, default=None,
                      help="drop candidates the cross-encoder scores above T")
  parser.add_argument("--ce-margin", type=_float_or_dev, default=None,
                      help="drop candidates the cross-encoder scores above the lowest positive's score - M")
  parser.add_argument("--keep", type=int, default=0, help="at most N negatives a query (0: all that are left)")
  parser.add_argument("--query-max-length", type=int, default=32)
  parser.add_argument("--doc-max-length", type=int, default=256)
  parser.add_argument("--ce-max-length", type=int, default=256, help="tokens per (query, document) pair")
  parser.add_argument("--chunk", type=int, default=0,
                      help="queries filtered (and saved) at a time; 0: 4096, or with --cross-encoder about "
                           f"{CE_CHUNK_PAIRS:,} (query, candidate) pairs' worth")
  cli.add_skip_invalid_flag(parser)
  parser.add_argument("--force", action="store_true", help="run even when another live run writes --out")
  return parser


def chunk_queries(chunk: int, depth: int, cross_encoder: bool) -> int:
  """Queries a chunk holds: --chunk, or when it is 0, 4096, or CE_CHUNK_PAIRS' worth of a cross-encoder's pairs."""
  return chunk or (max(1, CE_CHUNK_PAIRS // depth) if cross_encoder else 4096)


def _int_or_dev(text: str):
  return text if text == DEV else int(text)


def _float_or_dev(text: str):
  return text if text == DEV else float(text)


def _check(args, parser) -> tuple[mining.Filters, list[str]]:
  """The filters with every "dev" value left off, and the names of those (chosen once the dev report is in)."""
  if (args.data is None) == (args.source is None):
    parser.error("give --data (mine) or --from (filter a finished directory again), one of them")
  on_dev = [name for name in mining.CHOOSABLE if getattr(args, name) == DEV]
  if on_dev and args.source is None and args.dev_fraction == 0 and not args.dev_split:
    parser.error(f"--{on_dev[0].replace('_', '-')} dev needs a dev report: --dev-split or --dev-fraction > 0")
  if args.source is not None and args.positive_fraction is not None:
    parser.error("--from: --positive-fraction needs the positives' retriever scores, which a mined directory "
                 "does not keep; mine again with --data")
  if args.depth < 1 or args.chunk < 0:
    parser.error("--depth must be >= 1 and --chunk >= 0")
  args.chunk = chunk_queries(args.chunk, args.depth, bool(args.cross_encoder))
  if not 0 <= args.dev_fraction <= 1:
    parser.error("--dev-fraction must be in [0, 1]")
  if args.retriever == "model" and not args.model:
    parser.error("--retriever model needs --model")
  if args.retriever == "run" and not args.run:
    parser.error("--retriever run needs --run")
  if (args.ce_threshold is not None or args.ce_margin is not None) and not (args.cross_encoder or args.source):
    parser.error("--ce-threshold and --ce-margin need --cross-encoder")
  if args.ce_threshold is not None and args.ce_margin is not None:  # "dev" values are None in Filters: ask here
    parser.error("ce_threshold and ce_margin are two ways of one filter: give one")
  values = {name: None if getattr(args, name) == DEV else getattr(args, name) for name in mining.CHOOSABLE}
  values["skip_ranks"] = values["skip_ranks"] or 0
  try:
    return mining.Filters(**values, keep=args.keep), on_dev
  except ValueError as e:
    parser.error(str(e))


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

  def __init__(self, args, data, out: pathlib.Path):
    self.args, self.data, self.out, self.kind = args, data, out, args.retriever
    self._index = self._doc_emb = self._query_runtime = None

  def candidates(self, qids: list[str], tag: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(rows int32 [Q, depth], scores float32 [Q, depth], query vectors or None)."""
    depth, texts = self.args.depth, [self.data.queries[q] for q in qids]
    if self.kind == "bm25":
      from jdr.retrieval import bm25  # pylint: disable=g-import-not-at-top  (only BM25 users need numba)
      if self._index is None:
        self._index = bm25.corpus_index(self.data.corpus, cache_dir=self.out / "cache")
      mined = bm25.mine(self._index, texts, min(depth, len(self._index)), self.out / "cache", query_ids=qids,
                        desc=f"BM25 candidates ({tag})")
      return np.asarray(mined.rows, np.int32), np.asarray(mined.scores, np.float32), None
    if self.kind == "run":
      from jdr.data import run_arrays  # pylint: disable=g-import-not-at-top
      ranked = run_arrays.read(self.args.run, qids, self.data.corpus, depth=depth,
                               skip_invalid=self.args.skip_invalid)
      missing = [q for q, n in zip(qids, ranked.lengths.tolist()) if n == 0]
      if missing:
        print(f"jdr.mine: {self.args.run} ranks nothing for {len(missing)} of the {len(qids)} {tag} queries "
              f"(e.g. {missing[:3]}): they get no negatives", file=sys.stderr)
      return ranked.rows, np.where(ranked.rows >= 0, ranked.scores, np.nan).astype(np.float32), None
    from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
    from jdr.retrieval import host_search  # pylint: disable=g-import-not-at-top
    doc_emb = self.doc_emb()
    if self._query_runtime is None:
      self._query_runtime = encoder_runtime.load_runtime(self.args.model, side="query",
                                                    max_length=self.args.query_max_length,
                                                    prompt=self.args.query_prompt)
      print(encoder_runtime.length_line(self._query_runtime, "queries"), file=sys.stderr)
    query_emb = encoder_runtime.encode_texts(self._query_runtime, texts)
    rows, scores = host_search.exact_top_rows(doc_emb, query_emb, depth, progress=f"dense candidates ({tag})")
    return rows, np.where(rows >= 0, scores, np.nan).astype(np.float32), query_emb

  def doc_emb(self):
    from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
    from jdr.retrieval import encodings  # pylint: disable=g-import-not-at-top
    if self._doc_emb is None:
      encoding = self.args.encoding
      if encoding:
        encodings.check_ids_match(encoding, self.data.corpus, f"--encoding vs --data {self.args.data}")
      else:
        encoding = self.out / "encoding"
        doc_model = self.args.doc_model or self.args.model
        runtime = encoder_runtime.load_runtime(doc_model, side="doc", max_length=self.args.doc_max_length,
                                               prompt=self.args.doc_prompt)
        print(encoder_runtime.length_line(runtime, "documents"), file=sys.stderr)
        encodings.encode_corpus(runtime, self.data.corpus, encoding,
                                settings=encodings.corpus_settings(runtime, doc_model, self.args.data))
      self._doc_emb, _, _ = encodings.load_embeddings(encoding)
    return self._doc_emb

  def positive_scores(self, qids: list[str], positives: np.ndarray, rows: np.ndarray, scores: np.ndarray,
                      query_emb) -> np.ndarray:
    if self.kind == "bm25":
      return mining.bm25_scores(self._index, [self.data.queries[q] for q in qids], positives)
    if self.kind == "model":
      return mining.dot_scores(query_emb, self.doc_emb(), positives)
    return mining.run_scores(rows, scores, positives)  # a run scores only what it ranks


def scorer(args):
  """The cross-encoder's (query, document) scorer of --cross-encoder, or None."""
  if not args.cross_encoder:
    return None
  import jax  # pylint: disable=g-import-not-at-top
  from jdr.evaluation import reranking  # pylint: disable=g-import-not-at-top
  from jdr.models import cross  # pylint: disable=g-import-not-at-top
  model, params, tokenizer = cross.load_cross_encoder(args.cross_encoder)
  if args.ce_max_length > model.config.max_length:
    raise ValueError(f"--ce-max-length {args.ce_max_length} exceeds the cross-encoder's "
                     f"{model.config.max_length} positions")
  return reranking.make_scorer(model, jax.device_put(params), tokenizer, max_length=args.ce_max_length)


def _cheap(filters: mining.Filters) -> mining.Filters:
  """The filters before the cross-encoder's: what it need not score."""
  return mining.Filters(filters.skip_ranks, filters.positive_fraction)


def _candidate_plan(args) -> dict:
  """Every setting a chunk's candidates and teacher scores depend on: a resume under any other starts over."""
  return {"data": str(paths.absolute(args.data)), "split": args.split, "retriever": args.retriever,
          "model": args.model, "encoding": args.encoding and str(paths.absolute(args.encoding)), "run": args.run,
          **({"doc_model": args.doc_model} if args.doc_model else {}),  # absent: earlier plans still resume
          "depth": args.depth, "query_max_length": args.query_max_length, "doc_max_length": args.doc_max_length,
          "skip_invalid": args.skip_invalid, "cross_encoder": args.cross_encoder,
          "ce_max_length": args.ce_max_length,
          # Only when given: a plan from before the flags existed (the model's own prompts) still matches.
          **{f"{side}_prompt": getattr(args, f"{side}_prompt") for side in ("query", "doc")
             if getattr(args, f"{side}_prompt", None) is not None}}


def mine_queries(args, data, out: pathlib.Path, retriever: Retriever, score, filters: mining.Filters,
                 qids: list[str]) -> tuple[dict, dict]:
  """Filters the training queries chunk by chunk (resumable) and writes the directory; (dropped, no_bound)."""
  rows, scores, query_emb = retriever.candidates(qids, "training")
  positives = sources.positive_rows(data.train_qrels, data.corpus, qids)
  pos_scores = None
  if filters.positive_fraction is not None:
    pos_scores = retriever.positive_scores(qids, positives, rows, scores, query_emb)
  width = filters.keep or rows.shape[1]
  plan = {**_candidate_plan(args), "filters": dataclasses.asdict(filters)}
  chunks = mining.Chunks(out, plan, len(qids), args.chunk)
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


def dev_queries(args, data, out: pathlib.Path, retriever: Retriever, score, filters: mining.Filters
                ) -> dict | None:
  if args.dev_split:
    qrels, what = data.eval_qrels or {}, f"--dev-split {args.dev_split}"
  elif args.dev_fraction > 0:
    qrels, what = pairs.keep_fraction(data.train_qrels, args.dev_fraction), f"--dev-fraction {args.dev_fraction}"
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
    teacher, pos_teacher = dev_teacher_scores(args, data, out, score, qids, rows, positives)
  return mining.dev_report(rows, scores, positives, filters, positive_scores=pos_scores, teacher=teacher,
                           positive_teacher=pos_teacher)


def dev_teacher_scores(args, data, out: pathlib.Path, score, qids: list[str], rows: np.ndarray,
                       positives: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """The cross-encoder's scores of every dev candidate and positive, chunk by chunk under OUT/partial-dev (a
  restart scores only the chunks it had not finished), with a bar of pairs."""
  plan = {"dev": [args.dev_split, args.dev_fraction], **_candidate_plan(args)}
  chunks = mining.Chunks(out, plan, len(qids), args.chunk, folder=mining.PARTIAL_DEV)
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


def _score_part(score, data, qids: list[str], rows: np.ndarray, positives: np.ndarray, alive: np.ndarray | None,
                bar) -> tuple[np.ndarray, np.ndarray]:
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


def refilter(args, filters: mining.Filters, on_dev: list[str]) -> dict:
  """--from: the finished directory's negatives through `filters` (on top of its own), written to --out."""
  source = pathlib.Path(args.source)
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
  mining.write(pathlib.Path(args.out), mined.qids, kept[0], kept[1], np.asarray(mined.positives), meta,
               teacher=teacher, positive_teacher=None if teacher is None else np.asarray(mined.positive_teacher))
  return report


def main(argv: Iterable[str] | None = None) -> None:
  parser = _parser()
  args = parser.parse_args(argv)
  filters, on_dev = _check(args, parser)
  out = pathlib.Path(args.out)
  start = time.perf_counter()
  with cli.reporting_errors(skip_flag="--skip-invalid"), workdir_lock.held(out, "python -m jdr.mine",
                                                                            force=args.force):
    if args.source is not None:
      report = refilter(args, filters, on_dev)
      print(describe(report))
      print(json.dumps(report))
      return
    data_cfg = defaults.get_config().data
    data_cfg.dataset, data_cfg.train_split, data_cfg.eval_split = args.data, args.split, args.dev_split
    data = pairs.load(data_cfg, out)
    qids = sorted(q for q, docs in data.train_qrels.items() if any(r > 0 for r in docs.values()))
    if data.files is None or not hasattr(data.corpus, "row_of"):
      raise ValueError(f"--data {args.data}: jdr.mine reads a local corpus file it can prepare (rows by id)")
    score = scorer(args)
    retriever = Retriever(args, data, out)
    # The dev report first: a filter whose value is "dev" is chosen on it before the training queries are mined.
    dev = dev_queries(args, data, out, retriever, score, filters)
    filters = choose(filters, on_dev, dev, "jdr.mine")
    mined, counts = mine_queries(args, data, out, retriever, score, filters, qids)
    report = {"queries": len(qids), "retriever": args.retriever, "depth": args.depth, "training": counts,
              **_kept(mined["rows"], filters, on_dev), "seconds": round(time.perf_counter() - start, 1)}
    if dev is not None:
      report["dev"] = {"split": args.dev_split or f"{args.dev_fraction:g} of {args.split}", **dev}
    meta = {"data": str(pathlib.Path(args.data).absolute()), "split": args.split, "dev_split": args.dev_split,
            "corpus": data.corpus.manifest.get("source") if hasattr(data.corpus, "manifest") else None,
            "num_docs": len(data.corpus), "retriever": args.retriever, "model": args.model, "run": args.run,
            "cross_encoder": args.cross_encoder, "filters": dataclasses.asdict(filters), "report": report}
    mining.write(out, qids, mined["rows"], mined["scores"], mined["positives"], meta, teacher=mined["teacher"],
                 positive_teacher=mined["positive_teacher"])
    mined["chunks"].remove()
    shutil.rmtree(out / mining.PARTIAL_DEV, ignore_errors=True)
  print(describe(report))
  print(json.dumps(report))


if __name__ == "__main__":
  main()
