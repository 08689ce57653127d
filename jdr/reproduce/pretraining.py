"""The pretraining ablation of Chang et al. (ICLR 2020, Tables 3-5) in miniature, row by row.

`python -m jdr.reproduce pretrain-ablation --out DIR`. A row is one pretraining recipe run for
`--pretrain-steps` steps of its runlocal batch (the same steps x batch for every row), then, from its workdir:

  scifact_all    configs/finetune.py:runlocal on every SciFact training query (90 steps), test nDCG@10, R@100
                 (documents at 128 tokens, the training length, to keep a row short);
  scifact_10pct  the same on a fixed 10% of the training queries (data.train_fraction=0.1, 30 steps: about ten
                 epochs of them);
  reqa           the pretrained towers zero-shot on reqa-squad-sample (question -> answer sentence, the
                 document being "paragraph title [SEP] sentence"), Recall@1/5/10/100 as the paper's ReQA.

Rows: `none` (random weights: the recipe with 0 steps), `mlm`, `ict`, `bfs`, `wlp`, `ict_bfs_wlp`, `bow_mlp`
(the BoW-MLP tower on ICT+BFS+WLP) and `bm25` (bm25s, no training, run once). Every stage of a dense row is a
process of the public commands (jdr.train, jdr.encode, jdr.retrieve, jdr.evaluate: `commands.py`), so a row is
what a user would run. OUT/runs/ROW_sSEED holds a row's stages, each with its record once it finished, and the
row's done.json once it has every figure: a re-run skips what finished, and a stopped training resumes from its
workdir's checkpoint. The pretraining steps are fixed for an output directory (OUT/plan.json); seeds and rows
only add runs. OUT/table.md (each figure the mean ± sample standard deviation over the row's seeds, and the
paper's findings judged by seed as `claims.py` judges the methods table's) and OUT/runs.csv are written from
the records.

  python -m jdr.reproduce pretrain-ablation --out runs/ablation [--methods none,mlm,ict,...] [--seeds 0,1]
      [--pretrain-steps 250]
  python -m jdr.reproduce pretrain-ablation --out runs/ablation --report-only   # the outputs from disk
  python -m jdr.reproduce pretrain-ablation --out runs/ablation-tiny --tiny     # a tiny random BERT on the
                                                                                # built-in data (its test)
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

from jdr.runtime import atomic
from jdr.runtime import cli
from jdr.reproduce import claims as claims_lib
from jdr.reproduce import commands
from jdr.reproduce import report
from jdr.reproduce import rows as rows_lib
from jdr.reproduce import runs as runs_lib

ROWS = ("none", "ict", "mlm", "bfs", "wlp", "ict_bfs_wlp", "bow_mlp", "bm25")
RECIPE = {"none": "pretrain_ict", "mlm": "pretrain_mlm", "ict": "pretrain_ict", "bfs": "pretrain_bfs",
          "wlp": "pretrain_wlp", "ict_bfs_wlp": "pretrain_ict_bfs_wlp", "bow_mlp": "pretrain_ict_bfs_wlp"}
FINETUNES = {"scifact_all": [], "scifact_10pct": ["--config.data.train_fraction=0.1",
                                                  "--config.num_train_steps=30",
                                                  "--config.optimizer.warmup_steps=3"]}
SCIFACT_METRICS = "ndcg@10,mrr@10,recall@100"  # the fine-tuning recipe's evaluation metrics, for BM25's row
REQA_METRICS = "recall@1,recall@5,recall@10,recall@100"
COLUMNS = (("scifact_all/ndcg@10", "SciFact nDCG@10"), ("scifact_all/recall@100", "SciFact R@100"),
           ("scifact_10pct/ndcg@10", "SciFact 10% nDCG@10"), ("scifact_10pct/recall@100", "SciFact 10% R@100"),
           ("reqa/recall@1", "ReQA R@1"), ("reqa/recall@5", "ReQA R@5"), ("reqa/recall@10", "ReQA R@10"),
           ("reqa/recall@100", "ReQA R@100"))

# The paper's findings (Tables 3-5), in the low-label regime where pretraining matters most, each judged from
# two rows' figures paired by seed.
CLAIMS = (
    claims_lib.Claim("ICT pretraining beats no pretraining", "ict", "none", "scifact_10pct/ndcg@10"),
    claims_lib.Claim("ICT+BFS+WLP beats ICT alone", "ict_bfs_wlp", "ict", "scifact_10pct/ndcg@10"),
    claims_lib.Claim("ICT+BFS+WLP beats the masked-LM baseline", "ict_bfs_wlp", "mlm", "scifact_10pct/ndcg@10"),
    claims_lib.Claim("the Transformer beats the BoW-MLP tower on the same pretraining", "ict_bfs_wlp", "bow_mlp",
                     "scifact_10pct/ndcg@10"),
)

# --tiny: a 2 x 64 random BERT pretrained on the standard library's articles and fine-tuned on the built-in
# dataset, two steps a stage: the command's own test, which measures nothing.
TINY_PRETRAIN = ("data.pretrain_source=builtin", "model.fresh=tiny", "model.projection_dim=16", "batch_size=8",
                 "data.query_max_length=16", "data.doc_max_length=32")
TINY_FINETUNE = ("num_train_steps=2", "optimizer.warmup_steps=1", "batch_size=8", "data.query_max_length=16",
                 "data.doc_max_length=32", "eval.doc_max_length=32")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What every row shares: its pretraining steps (at the recipes' runlocal batch of 32) and, for the dense
  rows, the seeds (`--config.seed` of pretraining and fine-tuning)."""
  steps: int = 250
  seeds: tuple[int, ...] = (0, 1)
  tiny: bool = False


def tiny_plan() -> Plan:
  return Plan(steps=2, seeds=(0,), tiny=True)


@dataclasses.dataclass(frozen=True)
class Data:
  scifact: pathlib.Path  # fine-tuning (train) and its test
  reqa: pathlib.Path  # the zero-shot test


def run_name(row: str, seed: int) -> str:
  return row if row == "bm25" else f"{row}_s{seed}"


def _overrides(items) -> list[str]:
  return [f"--config.{item}" for item in items]


def _stage(directory: pathlib.Path, name: str, work) -> dict:
  """A stage's record (OUT/runs/RUN/NAME.json), running `work()` -> figures unless it finished before."""
  path = directory / f"{name}.json"
  record = runs_lib.read_json(path)
  if record is None:
    started = time.perf_counter()
    record = {"test": work(), "seconds": round(time.perf_counter() - started, 1)}
    atomic.write_text(path, json.dumps(record, indent=1))
  return record


def dense_row(plan: Plan, data: Data, row: str, seed: int, directory: pathlib.Path) -> dict:
  """Pretrains, fine-tunes twice and scores zero-shot; returns the row's record."""
  log = directory / "log.txt"
  pretrain = directory / "pretrain"
  steps = 0 if row == "none" else plan.steps

  def pretraining():
    extra = ["--config.model.tower=bow_mlp"] if row == "bow_mlp" else []
    commands.run_command(commands.command(
        "jdr.train", "--config", f"{rows_lib.CONFIGS_DIR / RECIPE[row]}.py:runlocal", "--workdir", pretrain,
        f"--config.seed={seed}", f"--config.num_train_steps={steps}",
        f"--config.optimizer.warmup_steps={steps // 10}", f"--config.checkpoint_every={max(steps, 1)}", *extra,
        *_overrides(TINY_PRETRAIN if plan.tiny else ())), log)
    return {}

  stages = {"pretrain": _stage(directory, "pretrain", pretraining)}
  for name, extra in FINETUNES.items():
    workdir = directory / name

    def finetuning(workdir=workdir, extra=extra):
      commands.run_command(commands.command(
          "jdr.train", "--config", f"{rows_lib.CONFIGS_DIR / 'finetune'}.py:runlocal", "--workdir", workdir,
          f"--config.model.init_from={pretrain}", f"--config.seed={seed}", f"--config.data.dataset={data.scifact}",
          "--config.eval_before_training=False", "--config.eval.diagnostic_queries=0",
          "--config.eval.doc_max_length=128", *extra, *_overrides(TINY_FINETUNE if plan.tiny else ())), log)
      return commands.final_eval(workdir)

    stages[name] = _stage(directory, name, finetuning)

  def zero_shot():
    encoded, run = directory / "reqa_encoded", directory / "reqa.trec"
    commands.run_command(commands.command("jdr.encode", "--model", pretrain, "--corpus", data.reqa, "--out", encoded,
                                          "--max-length", 128), log)
    commands.run_command(commands.command("jdr.retrieve", "--model", pretrain, "--index", encoded, "--queries",
                                          data.reqa, "--split", "test", "--top-k", 100, "--run", run,
                                          "--max-length", 32), log)
    return json.loads(commands.run_command(commands.command(
        "jdr.evaluate", "--qrels", data.reqa / "qrels" / "test.tsv", "--run", run, "--metrics", REQA_METRICS,
        "--missing", "zero", "--json"), log))

  stages["reqa"] = _stage(directory, "reqa", zero_shot)
  return {"run": directory.name, "method": row, "seed": seed, "steps": steps,
          "test": {f"{name}/{k}": v for name, s in stages.items() for k, v in s["test"].items()},
          "stage_seconds": {name: s["seconds"] for name, s in stages.items()}}


def bm25_row(data: Data) -> dict:
  """BM25 (bm25s, Anserini's k1 0.9 and b 0.4) on the same test sets; it trains on nothing, so its figures
  are the same in both fine-tuning regimes."""
  from jdr.evaluation import metrics  # pylint: disable=g-import-not-at-top
  from jdr.data import formats  # pylint: disable=g-import-not-at-top
  from jdr.negatives import sampled  # pylint: disable=g-import-not-at-top
  test = {}
  for key, directory, wanted in (("scifact_all", data.scifact, SCIFACT_METRICS), ("reqa", data.reqa, REQA_METRICS)):
    corpus = formats.read_corpus(directory / "corpus.jsonl")
    queries = formats.read_queries(directory / "queries.jsonl")
    qrels = formats.read_qrels(directory / "qrels" / "test.tsv", doc_ids=corpus, query_ids=queries)
    run = sampled.bm25_run(corpus, queries, sorted(qrels), 100, show_progress=False)
    test.update({f"{key}/{k}": v for k, v in metrics.evaluate(qrels, run, wanted.split(","), missing="zero").items()})
  test.update({k.replace("scifact_all/", "scifact_10pct/"): v for k, v in test.items() if k.startswith("scifact_all/")})
  return {"run": "bm25", "method": "bm25", "seed": None, "steps": 0, "test": test}


def planned(plan: Plan, selected: list[str]) -> list[tuple[str, int]]:
  """(row, seed) of every run of a selection, seed by seed; BM25 once."""
  jobs = [(row, seed) for seed in plan.seeds for row in selected if row != "bm25"]
  return jobs + ([("bm25", plan.seeds[0])] if "bm25" in selected else [])


def run_rows(plan: Plan, data: Data, selected: list[str], out: pathlib.Path) -> None:
  jobs = planned(plan, selected)
  kind = lambda key: "BM25 row" if key[1] == "bm25" else "pretrained row"
  keys = {("row", run_name(row, seed)): 0 for row, seed in jobs}
  finished = {key for key in keys if (out / "runs" / key[1] / "done.json").exists()}
  progress = runs_lib.Progress(keys, write=lambda line: print(line, flush=True), finished=finished, kind=kind)
  for row, seed in jobs:
    directory = out / "runs" / run_name(row, seed)
    if (directory / "done.json").exists():
      progress.skip(directory.name)
      continue
    directory.mkdir(parents=True, exist_ok=True)
    if row == "bm25":
      progress.begin("bm25: BM25 on the test sets")
    else:
      progress.begin(f"{directory.name}: pretrain {plan.steps if row != 'none' else 0} steps, fine-tune twice, ReQA "
                     f"zero-shot (log in {directory / 'log.txt'})")
    started = time.perf_counter()
    record = bm25_row(data) if row == "bm25" else dense_row(plan, data, row, seed, directory)
    record["seconds"] = round(time.perf_counter() - started, 1)
    atomic.write_text(directory / "done.json", json.dumps(record, indent=1))
    progress.end(kind(("row", row)), 1, record["seconds"])


def final_runs(out: pathlib.Path) -> dict[str, list[dict]]:
  """{row: its finished runs' records, by seed}, in the table's order."""
  found: dict[str, list[dict]] = {}
  for path in sorted((out / "runs").glob("*/done.json")):
    record = json.loads(path.read_text())
    found.setdefault(record["method"], []).append(record)
  return {row: sorted(found[row], key=lambda r: r["seed"] or 0) for row in ROWS if row in found}


def table_markdown(plan: Plan, out: pathlib.Path) -> str:
  finals = final_runs(out)
  lines = ["# The pretraining ablation (Chang et al. 2020, Tables 3-5) in miniature"
           + (" (tiny model, built-in data)" if plan.tiny else ""), "",
           f"Every dense row pretrains {plan.steps} steps of its recipe's runlocal batch (`none`: 0 steps, random "
           "weights), then is fine-tuned from that workdir on SciFact's training queries (all of them; a fixed 10%) "
           "and scored on its test queries; the pretrained towers are also scored zero-shot on ReQA "
           "(reqa-squad-sample). BM25 trains nothing: one run, the same figures in both regimes.", "",
           "| row | seeds | " + " | ".join(label for _, label in COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
  for row, found in finals.items():
    seeds = "—" if row == "bm25" else ",".join(str(r["seed"]) for r in found)
    cells = [report.mean_std([r["test"][key] for r in found if key in r["test"]]) for key, _ in COLUMNS]
    lines.append(f"| {row} | {seeds} | " + " | ".join(cells) + " |")
  lines += ["", "Mean ± sample standard deviation over the seeds listed (one seed: its figure).", "",
            "## Claims (paired by seed)", ""]
  lines += [claims_lib.judge(claim, finals, "").line() for claim in CLAIMS]
  lines += ["", "A claim that X beats Y holds when the mean paired gain is larger than the sample std of the paired "
            "gains.", ""]
  return "\n".join(lines)


def write_csv(out: pathlib.Path) -> pathlib.Path:
  """runs.csv: one line per finished run, its figures as test_STAGE/METRIC and its stages' seconds."""
  lines = []
  for found in final_runs(out).values():
    for r in found:
      line = {k: r.get(k, "") for k in ("run", "method", "steps", "seed", "seconds")}
      line.update(report.flat("seconds_", r.get("stage_seconds")))
      line.update(report.flat("test_", r.get("test")))
      lines.append({k: "" if v is None else v for k, v in line.items()})
  return report.write_rows_csv(out / "runs.csv", lines)


def write_report(plan: Plan, out: pathlib.Path) -> str:
  """Writes table.md and runs.csv; returns the table's markdown."""
  return commands.write_outputs(out, table_markdown(plan, out), write_csv)


def add_arguments(parser) -> None:
  parser.add_argument("--out", required=True, help="output directory (runs, table, CSV); a re-run goes on there")
  parser.add_argument("--methods", default="", help=f"comma-separated rows of {','.join(ROWS)} (default: all)")
  parser.add_argument("--seeds", default="", help="comma-separated seeds of the dense rows (default 0,1)")
  parser.add_argument("--pretrain-steps", type=int, default=0,
                      help="pretraining steps of every dense row, at the recipes' runlocal batch of 32 (default "
                           "250); fixed for an output directory")
  parser.add_argument("--tiny", action="store_true", help="a tiny random BERT, two steps a stage, on the built-in "
                      "data: checks the whole command, measures nothing")
  parser.add_argument("--report-only", action="store_true", help="write the outputs from the finished runs")


def main(args, parser) -> str:
  plan = tiny_plan() if args.tiny else Plan()
  if args.pretrain_steps:
    plan = dataclasses.replace(plan, steps=args.pretrain_steps)
  if args.seeds:
    plan = dataclasses.replace(plan, seeds=commands.seeds_of(args.seeds))
  selected = [m.strip() for m in args.methods.split(",") if m.strip()] or list(ROWS)
  unknown = [m for m in selected if m not in ROWS]
  if unknown:
    parser.error(f"--methods: unknown row(s) {', '.join(unknown)}; the rows are {', '.join(ROWS)}")
  out = pathlib.Path(args.out)
  if args.report_only:
    plan = rows_lib.recorded_plan(plan, out)
  with cli.reporting_errors():
    if not args.report_only:
      rows_lib.record_plan(plan, out, free=("seeds",))
      commands.record_device(out)
      if plan.tiny:
        scifact = reqa = commands.builtin_data(out)
      else:
        scifact, reqa = commands.shared_data("scifact"), commands.shared_data("reqa-squad-sample")
      with commands.finished_stages_kept():
        run_rows(plan, Data(scifact, reqa), selected, out)
    text = write_report(plan, out)
  print(text)
  print(f"wrote {out / 'table.md'}, {out / 'runs.csv'}")
  return text
