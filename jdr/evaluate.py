"""Scores a TREC run against qrels: `python -m jdr.evaluate --qrels FILE --run FILE`.

  python -m jdr.evaluate --qrels scifact/qrels/test.tsv --run run.trec \\
      --metrics ndcg@10,mrr@10,recall@100 [--json] [--missing zero] [--per-query out.json]

Qrels: BEIR TSV (with header) or TREC `qid 0 docid rel`; run: TREC `qid Q0 docid rank score tag`.
Metrics and the query-averaging conventions are jdr.evaluation.metrics' (equal to trec_eval per query).
"""

from __future__ import annotations

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

import argparse
import json
import sys
from typing import Sequence

from jdr.runtime import atomic
from jdr.runtime import cli
from jdr.evaluation import metrics
from jdr.data import formats

DEFAULT_METRICS = "ndcg@10,mrr@10,recall@100,map"


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
  parser = argparse.ArgumentParser(prog="python -m jdr.evaluate", description=__doc__.splitlines()[0])
  parser.add_argument("--qrels", required=True, help="BEIR qrels TSV or TREC qrels")
  parser.add_argument("--run", required=True, help="TREC run file")
  parser.add_argument("--metrics", default=DEFAULT_METRICS,
                      help=f"comma-separated, from: {', '.join(metrics.VALID_METRICS)} (default {DEFAULT_METRICS})")
  parser.add_argument("--json", action="store_true", help="print one JSON object {metric: mean}")
  parser.add_argument("--missing", choices=["skip", "zero"], default="skip",
                      help="qrels queries absent from the run: skip them (trec_eval, BEIR) or score 0 (trec_eval -c)")
  parser.add_argument("--per-query", metavar="FILE", help="also write {qid: {metric: value}} as JSON (- = standard output; the means then go to stderr)")
  cli.add_skip_invalid_flag(parser)
  args = parser.parse_args(argv)

  names = [m.strip() for m in args.metrics.split(",") if m.strip()]
  try:
    for name in names:
      metrics.parse_metric(name)
  except ValueError as e:
    parser.error(str(e))
  if not names:
    parser.error("--metrics is empty")

  with cli.reporting_errors(skip_flag="--skip-invalid"):
    qrels = formats.read_qrels(args.qrels, skip_invalid=args.skip_invalid)
    run = formats.read_run(args.run, skip_invalid=args.skip_invalid)
    per_query = metrics.evaluate(qrels, run, names, per_query=True, missing=args.missing)
    if not per_query:
      raise ValueError(
          f"no query to evaluate: {len(qrels)} queries in {args.qrels}, {len(run)} in {args.run}, "
          f"{sum(1 for q in qrels if q in run)} in both (queries without a relevant document are skipped)")
  results = metrics.mean(per_query)

  # Say what was left out of the mean, so a half-written run is not mistaken for a bad model.
  judged = [q for q, docs in qrels.items() if any(r > 0 for r in docs.values())]
  not_run = sum(1 for q in judged if q not in run)
  notes = [f"{len(per_query)} queries evaluated"]
  if not_run:
    notes.append(f"{not_run} judged queries absent from the run "
                 f"({'skipped' if args.missing == 'skip' else 'scored 0'})")
  if len(judged) < len(qrels):
    notes.append(f"{len(qrels) - len(judged)} qrels queries without a relevant document skipped")
  unjudged = sum(1 for q in run if q not in qrels)
  if unjudged:
    notes.append(f"{unjudged} run queries not in qrels ignored")
  print("; ".join(notes), file=sys.stderr)

  if args.per_query:
    with cli.reporting_errors():
      atomic.write_text(args.per_query, json.dumps(per_query, indent=1))
  summary = sys.stderr if args.per_query == atomic.STDOUT else sys.stdout  # stdout holds the one JSON document
  if args.json:
    print(json.dumps(results), file=summary)
  else:
    print(metrics.format_table(results, num_queries=len(per_query)), file=summary)
  return results


if __name__ == "__main__":
  main()
