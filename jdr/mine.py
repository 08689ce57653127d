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
--config.negatives.mined.file=MINED` reads. A killed run resumes: the retriever's candidates are cached
(BM25's arrays, the corpus encoding's shards) and the filtered chunks of queries are kept as they finish.
Standard output gets a report of what each filter dropped and the dev table, and, last, one JSON line.
"""

from __future__ import annotations

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

import argparse
import json
import pathlib
import time
from collections.abc import Iterable

from jdr.runtime import cli
from jdr.retrieval import flags
from jdr.runtime import workdir_lock
from jdr.negatives import mined_lists
from jdr.negatives import mining

RETRIEVERS = ("bm25", "model", "run")


DEV = "dev"  # a filter's value chosen on the dev report


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
                           f"{mined_lists.CE_CHUNK_PAIRS:,} (query, candidate) pairs' worth")
  cli.add_skip_invalid_flag(parser)
  parser.add_argument("--force", action="store_true", help="run even when another live run writes --out")
  return parser


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
  args.chunk = mined_lists.chunk_queries(args.chunk, args.depth, bool(args.cross_encoder))
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


def _settings(args) -> mined_lists.MineSettings:
  retriever = mined_lists.RetrieverSettings(
      kind=args.retriever, depth=args.depth, model=args.model, doc_model=args.doc_model, encoding=args.encoding,
      run=args.run, query_max_length=args.query_max_length, doc_max_length=args.doc_max_length,
      query_prompt=args.query_prompt, doc_prompt=args.doc_prompt, skip_invalid=args.skip_invalid)
  return mined_lists.MineSettings(data=args.data, retriever=retriever, split=args.split, dev_split=args.dev_split,
                                  dev_fraction=args.dev_fraction, chunk=args.chunk, cross_encoder=args.cross_encoder,
                                  ce_max_length=args.ce_max_length)


def scorer(settings: mined_lists.MineSettings) -> mined_lists.Scorer | None:
  """The cross-encoder's (query, document) scorer of --cross-encoder, or None (built here: reranking stands on a
  floor above jdr.negatives)."""
  if not settings.cross_encoder:
    return None
  import jax  # pylint: disable=g-import-not-at-top
  from jdr.evaluation import reranking  # pylint: disable=g-import-not-at-top
  from jdr.models import cross  # pylint: disable=g-import-not-at-top
  model, params, tokenizer = cross.load_cross_encoder(settings.cross_encoder)
  if settings.ce_max_length > model.config.max_length:
    raise ValueError(f"--ce-max-length {settings.ce_max_length} exceeds the cross-encoder's "
                     f"{model.config.max_length} positions")
  return reranking.make_scorer(model, jax.device_put(params), tokenizer, max_length=settings.ce_max_length)


def main(argv: Iterable[str] | None = None) -> None:
  parser = _parser()
  args = parser.parse_args(argv)
  filters, on_dev = _check(args, parser)
  out = pathlib.Path(args.out)
  start = time.perf_counter()
  with cli.reporting_errors(skip_flag="--skip-invalid"), workdir_lock.held(out, "python -m jdr.mine",
                                                                            force=args.force):
    if args.source is not None:
      report = mined_lists.refilter(pathlib.Path(args.source), out, filters, on_dev)
      print(mined_lists.describe(report))
      print(json.dumps(report))
      return
    settings = _settings(args)
    data, qids = mined_lists.load_training(settings, out)
    report = mined_lists.mine(settings, data, qids, out, scorer(settings), filters, on_dev, started=start)
  print(mined_lists.describe(report))
  print(json.dumps(report))


if __name__ == "__main__":
  main()
