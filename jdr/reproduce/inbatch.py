"""In-batch variants on SciFact: guided false-negative masking and Matryoshka widths, at the table's budget.

`python -m jdr.reproduce inbatch-ablation --out DIR`. Every row is the SciFact table's in-batch row (the recipe
configs/inbatch.py:runlocal, MiniLM, `Plan.steps` steps x `Plan.batch_size` pairs, on the training queries
outside the fixed dev split) with one setting changed, at one learning rate for every row (`--rate`, the
in-batch row's choice on dev in the table's build), seeds 0-2:

  inbatch      the row itself (exact duplicate texts and known positives masked, as every row)
  guided       + negatives.guide.model=minilm: the starting model, frozen, masks an in-batch negative it scores above
               the row's positive (GISTEmbed's rule, margin 0)
  self_guided  + negatives.guide.model=self with negatives.guide.margin=--self-margin: the model's own scores
  matryoshka   + loss.matryoshka_dims=384,256,128,64 (each weight 1)
  dim256, dim128, dim64   + loss.matryoshka_dims=D: trained at that width alone

Nothing is chosen here (one given rate, the settings fixed above), so no dev evaluation is run; each model is
scored once on test: the corpus encoded once at 256 tokens, searched exactly at each width of 384, 256, 128, 64
(the vectors' prefixes, re-normalized, as `jdr.encode --dim` serves them). `--steps` sets every row's budget
(default the table's 208). OUT/runs/ROW_sSEED holds a run's workdir and, once scored, done.json; a re-run
skips what finished and resumes a stopped training from its checkpoint. OUT/table.md (mean ± sample std over
seeds, and paired differences by seed) and OUT/runs.csv are written from the records.

  python -m jdr.reproduce inbatch-ablation --out runs/inbatch-ablation [--methods inbatch,guided] [--seeds 0,1,2]
  python -m jdr.reproduce inbatch-ablation --out runs/inbatch-ablation --report-only
  python -m jdr.reproduce inbatch-ablation --out runs/inbatch-tiny --tiny        # its test: measures nothing
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
from jdr.reproduce import devsplit
from jdr.reproduce import report
from jdr.reproduce import rows as rows_lib
from jdr.reproduce import runs as runs_lib

WIDTHS = (384, 256, 128, 64)
ROWS = ("inbatch", "guided", "self_guided", "matryoshka", "dim256", "dim128", "dim64")
LABELS = {"inbatch": "in-batch negatives", "guided": "+ guide: the starting MiniLM, frozen",
          "self_guided": "+ guide: the model's own scores", "matryoshka": "+ Matryoshka 384,256,128,64",
          "dim256": "trained at 256 alone", "dim128": "trained at 128 alone", "dim64": "trained at 64 alone"}
METRICS = ("ndcg@10", "mrr@10", "recall@100")

CLAIMS = (
    claims_lib.Claim("masking what the frozen starting model ranks above the positive helps", "guided", "inbatch",
                     "ndcg@10"),
    claims_lib.Claim("masking what the model itself ranks above the positive helps", "self_guided", "inbatch",
                     "ndcg@10"),
    claims_lib.Claim("Matryoshka at 384 is at least training at 384 alone", "matryoshka", "inbatch", "ndcg@10",
                     at_least=True),
    *(claims_lib.Claim(f"Matryoshka at {d} beats truncating a model trained at 384", "matryoshka", "inbatch",
                       f"dim{d}/ndcg@10") for d in WIDTHS[1:]),
)


@dataclasses.dataclass(frozen=True)
class Plan:
  """What every row shares (the SciFact table's budget and lengths) and the one rate they train at."""
  steps: int = 208
  batch_size: int = 32
  rate: float = 1e-4
  seeds: tuple[int, ...] = (0, 1, 2)
  self_margin: float = 0.0
  tiny: bool = False


def tiny_plan() -> Plan:
  return Plan(steps=2, batch_size=8, rate=1e-3, seeds=(0,), tiny=True)


def row_overrides(row: str, plan: Plan) -> dict:
  """The one setting a row changes, as config fields."""
  if row == "guided":
    return {"negatives.guide.model": "minilm"}
  if row == "self_guided":
    return {"negatives.guide.model": "self", "negatives.guide.margin": plan.self_margin}
  if row == "matryoshka":
    return {"loss.matryoshka_dims": ",".join(map(str, _widths(plan)))}
  if row.startswith("dim"):
    return {"loss.matryoshka_dims": row[3:] if not plan.tiny else str(int(row[3:]) // 6)}
  return {}


def _widths(plan: Plan) -> tuple[int, ...]:
  # The tiny model's vectors are 64 wide: the same ratios.
  return tuple(w // 6 for w in WIDTHS) if plan.tiny else WIDTHS


def run_config(plan: Plan, row: str, seed: int, dataset: pathlib.Path):
  """The table's in-batch stage config (rows.stage_config) at this plan's rate, its one change applied, and no
  evaluation while training (nothing is chosen on dev)."""
  table = dataclasses.replace(rows_lib.tiny_plan() if plan.tiny else rows_lib.Plan(), steps=plan.steps,
                              batch_size=plan.batch_size)
  c = rows_lib.stage_config(table, "inbatch", steps=plan.steps, rate=plan.rate, seed=seed, dataset=dataset)
  c.eval_every, c.eval_before_training, c.data.eval_split = 0, False, ""
  for key, value in row_overrides(row, plan).items():
    *sections, name = key.split(".")
    node = c
    for section in sections:
      node = node[section]
    node[name] = value
  if plan.tiny and row == "guided":
    c.negatives.guide.model = "self"  # the tiny model has no published twin to guide it
  return c


def score_widths(workdir: pathlib.Path, dataset: pathlib.Path, widths, *, query_max_length: int,
                 doc_max_length: int, cache: pathlib.Path) -> dict[str, float]:
  """Test metrics of the model in `workdir` at each width: the corpus encoded once, each width's prefixes
  searched exactly ("ndcg@10" at the full width, "dim<w>/ndcg@10" below it)."""
  # pylint: disable=g-import-not-at-top  (JAX starts with the runs)
  from jdr.data import formats
  from jdr.data import pairs
  from jdr.evaluation import metrics as metrics_lib
  from jdr.retrieval import tower_encoder  # pylint: disable=g-import-not-at-top
  from jdr.evaluation import periodic
  from jdr.models import build as build_lib
  from jdr.retrieval import host_search  # pylint: disable=g-import-not-at-top
  model, params, tokenizer, description = build_lib.load_jdr_model(workdir)
  corpus, queries, qrels = formats.load_beir(dataset, "test")
  data = pairs.RetrievalData(corpus, queries, {}, qrels, pathlib.Path(dataset).name)
  encoder = tower_encoder.TowerEncoder(model, tokenizer, data, query_max_length=query_max_length,
                                  doc_max_length=doc_max_length, cache_dir=str(cache),
                                  prompts=description.get("prompts"))
  doc_emb, qids = encoder.corpus(params, progress=True), sorted(qrels)
  query_emb = encoder.queries(params, qids)
  results = {}
  for width in widths:
    cut = lambda x: periodic.prefix_vectors(x, width, model.query.normalize)
    rows, scores = host_search.exact_top_rows(cut(doc_emb), cut(query_emb), 100, "faiss", "float32")
    run = {q: {encoder.doc_ids[int(r)]: float(v) for r, v in zip(row, score) if r >= 0}
           for q, row, score in zip(qids, rows, scores)}
    prefix = "" if width >= doc_emb.shape[1] else f"dim{width}/"
    results.update({prefix + k: float(v) for k, v in metrics_lib.evaluate(qrels, run, list(METRICS)).items()})
  return results


def run_one(plan: Plan, row: str, seed: int, dataset: pathlib.Path, out: pathlib.Path) -> dict:
  """Trains (or resumes) one run and scores it; returns its record."""
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  directory = out / "runs" / f"{row}_s{seed}"
  workdir = directory / "workdir"
  started = time.perf_counter()
  with runs_lib.output_to(directory / "log.txt"):
    results = trainer.train_and_evaluate(run_config(plan, row, seed, dataset), workdir)
    del results
    logged = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    masked = [x["train/masked_by_guide"] for x in logged if "train/masked_by_guide" in x]
    trained = time.perf_counter() - started
    table = rows_lib.tiny_plan() if plan.tiny else rows_lib.Plan()  # the SciFact table's lengths
    test = score_widths(workdir, dataset, _widths(plan), query_max_length=table.query_max_length,
                        doc_max_length=table.eval_doc_length, cache=out / "vector-cache")
  record = {"run": directory.name, "method": row, "seed": seed, "rate": plan.rate, "steps": plan.steps,
            "overrides": row_overrides(row, plan), "test": test,
            "masked_by_guide": sum(masked) / len(masked) if masked else None,
            "train_seconds": round(trained, 1), "seconds": round(time.perf_counter() - started, 1)}
  atomic.write_text(directory / "done.json", json.dumps(record, indent=1))
  runs_lib.release()
  return record


def final_runs(out: pathlib.Path) -> dict[str, list[dict]]:
  found: dict[str, list[dict]] = {}
  for path in sorted((out / "runs").glob("*/done.json")):
    record = json.loads(path.read_text())
    found.setdefault(record["method"], []).append(record)
  return {row: sorted(found[row], key=lambda r: r["seed"]) for row in ROWS if row in found}


def table_markdown(plan: Plan, out: pathlib.Path) -> str:
  finals = final_runs(out)
  widths = _widths(plan)
  keys = ["ndcg@10"] + [f"dim{w}/ndcg@10" for w in widths[1:]]
  lines = ["# In-batch variants on SciFact: guided false negatives and Matryoshka widths"
           + (" (tiny model, built-in data)" if plan.tiny else ""), "",
           f"Every row trains {plan.steps} steps x {plan.batch_size} pairs at learning rate {plan.rate:g}; test "
           f"nDCG@10 at each width (the first {', '.join(map(str, widths))} dimensions, re-normalized).", "",
           "| row | seeds | " + " | ".join(f"test nDCG@10 at {w}" for w in widths)
           + " | test Recall@100 | masked by the guide per batch |",
           "|---|---|" + "---|" * len(widths) + "---|---|"]
  for row, found in finals.items():
    seeds = ",".join(str(r["seed"]) for r in found)
    cells = [report.mean_std([r["test"][k] for r in found if k in r["test"]]) for k in keys]
    cells.append(report.mean_std([r["test"]["recall@100"] for r in found]))
    masked = [r.get("masked_by_guide") for r in found if r.get("masked_by_guide") is not None]
    cells.append(report.mean_std(masked) if masked else "—")
    lines.append(f"| {LABELS[row]} | {seeds} | " + " | ".join(cells) + " |")
  lines += ["", "Mean ± sample standard deviation over the seeds listed.", "", "## Paired by seed", ""]
  lines += [claims_lib.judge(claim, finals, "").line() for claim in CLAIMS if not plan.tiny]
  if {"matryoshka"} <= set(finals):
    for w in widths[1:]:
      single = f"dim{w}" if not plan.tiny else f"dim{w * 6}"
      if single in finals:
        lines.append(claims_lib.judge(claims_lib.Claim(
            f"Matryoshka at {w} against a model trained at {w} alone", "matryoshka", single,
            f"dim{w}/ndcg@10"), finals, "").line())
  lines += ["", "A claim that X beats Y holds when the mean paired gain is larger than the sample std of the paired "
            "gains.", ""]
  return "\n".join(lines)


def write_csv(out: pathlib.Path) -> pathlib.Path:
  lines = []
  for found in final_runs(out).values():
    for r in found:
      line = {k: r.get(k, "") for k in ("run", "method", "seed", "rate", "steps", "train_seconds", "seconds")}
      line.update(report.flat("test_", r.get("test")))
      lines.append({k: "" if v is None else v for k, v in line.items()})
  return report.write_rows_csv(out / "runs.csv", lines)


def add_arguments(parser) -> None:
  parser.add_argument("--out", required=True, help="output directory (runs, table, CSV); a re-run goes on there")
  parser.add_argument("--methods", default="", help=f"comma-separated rows of {','.join(ROWS)} (default: all)")
  parser.add_argument("--seeds", default="", help="comma-separated seeds (default 0,1,2)")
  parser.add_argument("--steps", type=int, default=0, help="every row's training steps (default 208, the "
                      "SciFact table's budget); fixed for an output directory")
  parser.add_argument("--rate", type=float, default=0.0, help="every row's learning rate (default 1e-4: the "
                      "in-batch row's choice on dev in the SciFact table)")
  parser.add_argument("--self-margin", type=float, default=None, help="negatives.guide.margin of self_guided "
                      "(default 0)")
  parser.add_argument("--tiny", action="store_true", help="a tiny random BERT, two steps, on the built-in data: "
                      "checks the whole command, measures nothing")
  parser.add_argument("--report-only", action="store_true", help="write the outputs from the finished runs")


def main(args, parser) -> str:
  plan = tiny_plan() if args.tiny else Plan()
  if args.rate:
    plan = dataclasses.replace(plan, rate=args.rate)
  if args.steps:
    plan = dataclasses.replace(plan, steps=args.steps)
  if args.self_margin is not None:
    plan = dataclasses.replace(plan, self_margin=args.self_margin)
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
        source = commands.builtin_data(out)
      else:
        source = commands.shared_data("scifact")
      table = rows_lib.tiny_plan() if plan.tiny else rows_lib.Plan()
      dataset = devsplit.write_dev_split(source, out, fraction=table.dev_fraction, seed=table.split_seed)
      jobs = [(row, seed) for seed in plan.seeds for row in selected]
      keys = {("run", f"{row}_s{seed}"): 0 for row, seed in jobs}
      finished = {k for k in keys if (out / "runs" / k[1] / "done.json").exists()}
      progress = runs_lib.Progress(keys, write=lambda line: print(line, flush=True), finished=finished,
                                   kind=lambda key: "run")
      for row, seed in jobs:
        name = f"{row}_s{seed}"
        if (out / "runs" / name / "done.json").exists():
          progress.skip(name)
          continue
        progress.begin(f"{name}: train {plan.steps} steps, score test at {len(_widths(plan))} widths")
        record = run_one(plan, row, seed, dataset, out)
        progress.end("run", 1, record["seconds"])
    text = commands.write_outputs(out, table_markdown(plan, out), write_csv)
  print(text)
  print(f"wrote {out / 'table.md'}, {out / 'runs.csv'}")
  return text
