"""Rebuild the SciFact methods table: `python -m jdr.reproduce scifact --out runs/repro`.

Every row trains the same budget (208 steps x 32 pairs, warm-ups included) at the learning rate its dev
nDCG@10 chose from {2e-5, 5e-5, 1e-4}, on 80% of SciFact's training queries (the fixed dev split is the
rest, written to OUT/data). The final models (three seeds a row) are scored once on test, on Flat and on
OPQ48,IVF1,PQ48, and zero-shot on reqa-squad-sample. The two mined rows first train a cross-encoder on the same
training queries and mine BM25's top 100 with it (`python -m jdr.mine`, its threshold chosen on the dev
queries' report), into OUT/data. Writes OUT/table.md (also printed), OUT/runs.csv,
OUT/dev_curves.png, OUT/test_ndcg.png. Each run is its own workdir under OUT/runs: run the command again to
go on after a stop (finished runs are skipped, a killed one resumes from its checkpoint).

  python -m jdr.reproduce scifact --out runs/repro
  python -m jdr.reproduce scifact --out runs/repro --methods star,ance --seeds 0   # part of the table
  python -m jdr.reproduce scifact --out runs/repro --methods adore_star \\
      --given-rates bm25_neg=1e-4,star=5e-5                                      # warm-ups' rates from an
                                                                                  # earlier build
  python -m jdr.reproduce scifact --out runs/repro --records-from docs/scifact-table/runs.csv  # go on from
                                                                                  # the committed records
  python -m jdr.reproduce scifact --out runs/repro --report-only                  # the outputs from disk
  python -m jdr.reproduce scifact --out runs/repro-tiny --tiny                    # a tiny random BERT on the
                                                                                  # built-in dataset (its test)

The ablations are experiments of the same runner, each with its own flags (`EXPERIMENT --help`), the same
resume, runs.csv and table statistic (mean ± sample std over seeds):

  python -m jdr.reproduce pretrain-ablation --out runs/ablation   # Chang et al.'s pretraining tasks (pretraining.py)
  python -m jdr.reproduce fgd-ablation --out runs/fgd             # FGD on long-document SciFact (fgd.py)
  python -m jdr.reproduce inbatch-ablation --out runs/inbatch      # guided false negatives, Matryoshka (inbatch.py)
"""

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

import argparse
import dataclasses
import pathlib
import sys

from jdr.runtime import cli
from jdr.runtime import workdir_lock
from jdr.data import shared
from jdr.reproduce import devsplit
from jdr.reproduce import fgd
from jdr.reproduce import inbatch
from jdr.reproduce import pretraining
from jdr.reproduce import report
from jdr.reproduce import rows as rows_lib
from jdr.reproduce import runs as runs_lib


def _ints(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> tuple[float, ...]:
  return tuple(float(x) for x in text.split(",") if x.strip())


# The experiments besides the SciFact table: {name: module with add_arguments(parser) and main(args, parser)}.
EXPERIMENTS = {"pretrain-ablation": pretraining, "fgd-ablation": fgd, "inbatch-ablation": inbatch}


def main(argv=None) -> str:
  top = argparse.ArgumentParser(prog="python -m jdr.reproduce",
                                description="Rebuilds an experiment's table from its runs, training what is missing.")
  experiments = top.add_subparsers(dest="table", required=True, metavar="EXPERIMENT",
                                   help=f"scifact, {', '.join(EXPERIMENTS)} (EXPERIMENT --help: its flags)")
  parser = experiments.add_parser("scifact", help="the SciFact table of the hard-negative methods",
                                  description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="output directory (runs, dev split, table, CSV, plots)")
  parser.add_argument("--methods", default="", help="comma-separated rows (default: all); rows a warm-up "
                      "needs are trained for their rate choice too")
  parser.add_argument("--seeds", default="", help="comma-separated seeds of the final runs (default 0,1,2)")
  parser.add_argument("--rates", default="", help="the learning-rate grid (default 2e-5,5e-5,1e-4)")
  parser.add_argument("--given-rates", default="", help="ROW=RATE,...: rates chosen on dev in an earlier "
                      "build of the same plan (a selected row's warm-ups, or a selected row whose recipe has not "
                      "changed): their grids are not retrained, and choices.json and the table mark them as given")
  parser.add_argument("--records-from", default="", help="a runs.csv an earlier build wrote (such as the "
                      "one docs/ keeps): its runs count as finished here, and a warm-up a new stage needs is "
                      "retrained for its weights")
  parser.add_argument("--eval-every", type=int, default=0, help="steps between dev evaluations, the curves' "
                      "points (default 52; each evaluation of a two-tower row encodes the corpus)")
  parser.add_argument("--data", default="", help="the SciFact BEIR directory (default: the shared data's)")
  parser.add_argument("--zero-shot", default="", help="a BEIR dataset with qrels/test.tsv scored zero-shot "
                      "(default: the shared reqa-squad-sample; 'none' to skip)")
  parser.add_argument("--tiny", action="store_true", help="a tiny random BERT, a few steps, on the built-in "
                      "dataset: checks the whole command in about a minute, measures nothing")
  parser.add_argument("--report-only", action="store_true", help="write the outputs from the finished runs")
  for name, module in EXPERIMENTS.items():
    module.add_arguments(experiments.add_parser(name, help=module.__doc__.splitlines()[0], description=module.__doc__,
                                                formatter_class=argparse.RawDescriptionHelpFormatter))
  for sub in experiments.choices.values():
    sub.add_argument("--force", action="store_true", help="run even when another live run writes --out")
  args = top.parse_args(argv)
  if args.report_only:
    return _run(args, experiments, argv)
  # One build per output directory: a second launch on it refuses before anything is written.
  with cli.reporting_errors(), workdir_lock.held(args.out, f"python -m jdr.reproduce {args.table}", force=args.force):
    return _run(args, experiments, argv)


def _run(args, experiments, argv) -> str:
  if args.table in EXPERIMENTS:
    return EXPERIMENTS[args.table].main(args, experiments.choices[args.table])
  parser = experiments.choices["scifact"]

  plan = rows_lib.tiny_plan() if args.tiny else rows_lib.Plan()
  if args.rates:
    plan = dataclasses.replace(plan, rates=_floats(args.rates))
  if args.eval_every:
    plan = dataclasses.replace(plan, eval_every=args.eval_every)
  if args.seeds:
    plan = dataclasses.replace(plan, seeds=tuple(_ints(args.seeds)))
  names = rows_lib.row_names(plan)
  selected = [m.strip() for m in args.methods.split(",") if m.strip()] or names
  unknown = [m for m in selected if m not in names]
  if unknown:
    parser.error(f"--methods: unknown row(s) {', '.join(unknown)}; the rows are {', '.join(names)}")
  given = {}
  for item in (x.strip() for x in args.given_rates.split(",") if x.strip()):
    name, _, rate = item.partition("=")
    if name not in names or not rate:
      parser.error(f"--given-rates: {item!r} is not ROW=RATE with a row of {', '.join(names)}")
    given[name] = float(rate)
  out = pathlib.Path(args.out)

  with cli.reporting_errors():
    if not args.report_only:
      if args.tiny:
        from jdr.data import builtin  # pylint: disable=g-import-not-at-top
        source = builtin.write_builtin(out / "data" / "stdlib-docstrings")
      else:
        source = pathlib.Path(args.data) if args.data else shared.shared_dataset("scifact")
        if source is None or not source.is_dir():
          raise FileNotFoundError(f"SciFact not found at {args.data or shared.shared_data_dir() / 'scifact'}: "
                                  "pass --data DIR (BEIR layout with qrels/train.tsv and qrels/test.tsv)")
      rows_lib.record_plan(plan, out)
      runs_lib.record_given_rates(out, given, selected)
      if args.records_from:
        print(f"{report.import_records(pathlib.Path(args.records_from), out)} run records restored from "
              f"{args.records_from}", flush=True)
      dataset = devsplit.write_dev_split(source, out, fraction=plan.dev_fraction, seed=plan.split_seed)
      zero_shot = None
      if args.zero_shot != "none":
        zero_shot = pathlib.Path(args.zero_shot) if args.zero_shot else shared.shared_dataset("reqa-squad-sample")
        if zero_shot is None:
          print(f"no zero-shot dataset at {shared.shared_data_dir() / 'reqa-squad-sample'}: the zero-shot "
                "columns stay empty", file=sys.stderr)
        elif not (zero_shot / "qrels" / "test.tsv").exists():
          raise FileNotFoundError(f"{zero_shot / 'qrels' / 'test.tsv'}: the zero-shot dataset needs test qrels")
      chosen = runs_lib.read_json(out / "choices.json") or {}
      jobs = runs_lib.planned_jobs(plan, selected, list(plan.seeds),
                                   {name: g["rate"] for name, g in chosen.items() if g.get("given")})
      progress = runs_lib.Progress(jobs, write=lambda line: print(line, flush=True),
                                   finished=runs_lib.finished_jobs(out, plan, jobs))
      ctx = runs_lib.Context(plan=plan, out=out, dataset=dataset, zero_shot=zero_shot, progress=progress)
      from jdr.training import preemption  # pylint: disable=g-import-not-at-top  (JAX starts with the runs)
      try:
        runs_lib.run_table(ctx, selected, list(plan.seeds))
      except preemption.Stopped as stopped:  # SIGTERM / SIGINT in a run: its step is saved, the rest resumes
        preemption.exit_stopped(stopped, sys.argv[1:] if argv is None else list(argv), "jdr.reproduce")
      except KeyboardInterrupt:  # outside a run's steps (scoring, a run's start): nothing half-written stays
        print("jdr.reproduce: interrupted; finished runs are kept, and the same command goes on from there",
              file=sys.stderr)
        raise SystemExit(130) from None
    text = report.write_report(plan, out)
  print(text)
  print(f"wrote {out / 'table.md'}, {out / 'runs.csv'}, {out / 'dev_curves.png'}, {out / 'test_ndcg.png'}")
  return text


if __name__ == "__main__":
  main()
