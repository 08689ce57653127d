"""FGD's experiments (Zhou et al.) in miniature on long-document SciFact, through the public commands.

`python -m jdr.reproduce fgd-ablation --out DIR`. Stages, each skipped when its record is there (so a re-run
goes on where the last one stopped; a stopped training resumes from its workdir's checkpoint), each a process
of the public commands (`commands.py`):
  data       `python -m jdr.data.longdocs --source SCIFACT --out OUT/data/scifact-long`
  teacher    configs/cross_encoder.py:runlocal trained on SciFact (abstract level), OUT/data/cross-encoder
  rerank     (beside the warm-ups) the MiniLM first stage on SciFact test (`jdr.encode` + `jdr.retrieve`, 256
             tokens) reranked by the teacher with `jdr.rerank` at depths 10, 30 and 100: nDCG@10 and ms/query
             of each (docs/results.md, "The cross-encoder teacher, reranking"), OUT/runs/rerank
  warmup_S   stage 1 (configs/fgd.py:runlocal,warmup) with seed S on long-document SciFact, OUT/runs/warmup_S
  ROW_S      stage 2 from warmup_S with the row's overrides (contrastive only, document-level KD, FGD, FGD
             without passage / sentence, FG pooling, FGD + document KD); its final evaluation (MRR@100,
             nDCG@10, R@100 on the test queries, FirstP at 512 tokens), OUT/runs/ROW_S
  extras     for the first seed's model of --extras-row (FGD's by default): MaxP (`jdr.encode --passages 4`)
             against FirstP, and the Eq. 16 ensemble (`jdr.encode --pieces passage:128,sentence:64`,
             `jdr.retrieve --ensemble-gamma G`) for G in 0, 0.1, 0.3, 1, OUT/runs/ROW_S/extras.json

--methods rows train every seed, --single-seed-methods rows the first seed only. The stage steps, the teacher's
steps, the depths, the gammas and the --set overrides are fixed for an output directory (OUT/plan.json); seeds
and rows only add runs. OUT/table.md gives each row's test figures as the mean ± sample standard deviation over
its seeds, and judges the paper's claims by seed (`claims.py`); OUT/runs.csv holds every stage's record and
OUT/device.json where they ran.

`--jobs N` runs up to N stages at once (a seed's rows wait for its warm-up), each with its own log
(OUT/logs/NAME.log): on an accelerator, where a stage is mostly process start-up and compilation, this is what
makes the whole ablation fit a short time on the device. `--backend jax` retrieves with jdr's exact JAX top-k
instead of Faiss (the same ranking, and no Faiss needed).

  python -m jdr.reproduce fgd-ablation --out runs/fgd [--methods contrastive,document_kd,fgd] [--seeds 0,1,2]
      [--single-seed-methods no_passage,no_sentence,fg_pooling,fgd_document_kd] [--steps 120] [--jobs 1]
      [--backend faiss|jax] [--data ../shared/data/scifact] [--teacher-steps 400] [--extras-row fgd]
      [--set model.encode_chunk_rows=4 ...]
  python -m jdr.reproduce fgd-ablation --out runs/fgd --report-only   # the outputs from disk
  python -m jdr.reproduce fgd-ablation --out runs/fgd-tiny --tiny     # a tiny random BERT on the built-in
                                                                      # data (its test)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import pathlib
import sys
import threading
import time

from jdr.runtime import atomic
from jdr.runtime import cli
from jdr.reproduce import claims as claims_lib
from jdr.reproduce import commands
from jdr.reproduce import report
from jdr.reproduce import rows as rows_lib
from jdr.reproduce import runs as runs_lib

ROWS = {
    "contrastive": ["--config.distill.teacher="],
    "document_kd": ["--config.distill.granularities=", "--config.distill.document=True"],
    "fgd": [],
    "no_passage": ["--config.distill.granularities=sentence"],
    "no_sentence": ["--config.distill.granularities=passage"],
    "fg_pooling": ["--config.distill.pooling=mean"],
    "fgd_document_kd": ["--config.distill.document=True"],
}
LABELS = {"warmup": "stage 1 only (the warm-up every row starts from)", "contrastive": "contrastive only",
          "document_kd": "document-level KD", "fgd": "FGD (passage + sentence, Eq. 7)",
          "no_passage": "FGD without passage", "no_sentence": "FGD without sentence",
          "fg_pooling": "FG pooling (mean-pooled pieces)", "fgd_document_kd": "FGD + document-level KD"}
METRICS = "mrr@100,ndcg@10,recall@100"
CLAIMS = (
    claims_lib.Claim("FGD beats contrastive training alone", "fgd", "contrastive", "ndcg@10"),
    claims_lib.Claim("FGD beats document-level KD", "fgd", "document_kd", "ndcg@10"),
)

# --tiny: 2 x 64 random BERTs (the student [CLS]-pooled and normalized, as MiniLM) on long documents built from
# the built-in dataset, two steps a stage, and the seed-0 warm-up as the reranking's first stage (for
# MiniLM's): the command's own test, which measures nothing.
TINY_STAGE = ("model.fresh=tiny", "model.normalize=1", "batch_size=4", "data.query_max_length=16")
TINY_TEACHER = ("model.init_from=", "model.fresh=tiny", "batch_size=4", "data.doc_max_length=64")


@dataclasses.dataclass(frozen=True)
class Plan:
  """What every stage shares. teacher_steps None: configs/cross_encoder.py:runlocal's own."""
  steps: int = 120
  teacher_steps: int | None = None
  seeds: tuple[int, ...] = (0, 1, 2)
  depths: tuple[int, ...] = (10, 30, 100)
  gammas: tuple[float, ...] = (0.0, 0.1, 0.3, 1.0)
  overrides: tuple[str, ...] = ()  # KEY=VALUE for every training stage (--set)
  tiny: bool = False


def tiny_plan() -> Plan:
  return Plan(steps=2, teacher_steps=2, seeds=(0,), depths=(10,), gammas=(0.3,), tiny=True)


@dataclasses.dataclass
class Context:
  plan: Plan
  out: pathlib.Path
  scifact: pathlib.Path  # the short-document source: the teacher's training data and the reranking's test
  backend: str  # jdr.retrieve's, the negatives' and the evaluation's: faiss | jax
  progress: runs_lib.Progress
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

  @property
  def long_dir(self) -> pathlib.Path:
    return self.out / "data" / "scifact-long"

  @property
  def teacher(self) -> pathlib.Path:
    return self.out / "data" / "cross-encoder"

  def log(self, name: str) -> pathlib.Path:
    return self.out / "logs" / f"{name}.log"

  def begin(self, what: str) -> float:
    with self.lock:
      self.progress.begin(what)
    return time.perf_counter()

  def skip(self, what: str) -> None:
    with self.lock:
      self.progress.skip(what)

  def end(self, kind: str, started: float) -> float:
    seconds = time.perf_counter() - started
    with self.lock:
      self.progress.end(kind, 1, seconds)
    return round(seconds, 1)


def job_kind(key: tuple) -> str:
  return {"teacher": "cross-encoder", "rerank": "reranking", "train": "stage", "extras": "extras"}[key[0]]


def evaluate_run(ctx: Context, qrels: pathlib.Path, run: pathlib.Path, log: pathlib.Path) -> dict:
  return json.loads(commands.run_command(commands.command(
      "jdr.evaluate", "--qrels", qrels, "--run", run, "--metrics", METRICS, "--missing", "zero", "--json"), log))


def long_documents(ctx: Context) -> None:
  if not (ctx.long_dir / "stats.json").exists():
    commands.run_command(commands.command("jdr.data.longdocs", "--source", ctx.scifact, "--out", ctx.long_dir),
                         ctx.log("data"))


def train_teacher(ctx: Context) -> dict:
  done = runs_lib.read_json(ctx.teacher / "done.json")
  if done is not None:
    ctx.skip("train the cross-encoder")
    return done
  steps = ctx.plan.teacher_steps
  flags = [] if steps is None else [f"--config.num_train_steps={steps}",
                                    f"--config.optimizer.warmup_steps={steps // 10}",
                                    f"--config.checkpoint_every={max(steps // 2, 1)}"]
  started = ctx.begin(f"train the cross-encoder (log in {ctx.log('teacher')})")
  commands.run_command(commands.command(
      "jdr.train", "--config", f"{rows_lib.CONFIGS_DIR / 'cross_encoder'}.py:runlocal", "--workdir", ctx.teacher,
      f"--config.data.dataset={ctx.scifact}", "--config.data.eval_split=", *flags,
      *(f"--config.{o}" for o in (TINY_TEACHER if ctx.plan.tiny else ()))), ctx.log("teacher"))
  done = {"run": "cross-encoder", "method": "cross_encoder", "steps": steps,
          "seconds": ctx.end("cross-encoder", started)}
  atomic.write_text(ctx.teacher / "done.json", json.dumps(done, indent=1))
  return done


def rerank(ctx: Context, first_stage: str) -> dict:
  """The teacher reranking a first stage's top 100 of SciFact's test queries, at each depth of the plan."""
  directory = ctx.out / "runs" / "rerank"
  record = runs_lib.read_json(directory / "done.json")
  if record is not None:
    ctx.skip("rerank with the cross-encoder")
    return record
  log = ctx.log("rerank")
  started = ctx.begin(f"rerank the first stage's top 100 with the cross-encoder (log in {log})")
  encoded, run = directory / "first-stage", directory / "first-stage.trec"
  commands.run_command(commands.command("jdr.encode", "--model", first_stage, "--corpus", ctx.scifact, "--out",
                                        encoded, "--max-length", 256), log)
  commands.run_command(commands.command("jdr.retrieve", "--index", encoded, "--queries", ctx.scifact, "--split",
                                        "test", "--run", run, "--top-k", 100, "--backend", ctx.backend), log)
  qrels = ctx.scifact / "qrels" / "test.tsv"
  test = {f"first_stage/{k}": v for k, v in evaluate_run(ctx, qrels, run, log).items()}
  for depth in ctx.plan.depths:
    reranked = directory / f"reranked-{depth}.trec"
    before = log.stat().st_size
    commands.run_command(commands.command(
        "jdr.rerank", "--model", ctx.teacher, "--queries", ctx.scifact, "--split", "test", "--corpus", ctx.scifact,
        "--run", run, "--depth", depth, "--out", reranked), log)
    line = [l for l in log.read_text()[before:].splitlines() if l.startswith("reranked ")][-1]
    test[f"rerank@{depth}/ms_per_query"] = float(line.split(": ")[1].split(" ms/query")[0])
    test.update({f"rerank@{depth}/{k}": v for k, v in evaluate_run(ctx, qrels, reranked, log).items()})
  record = {"run": "rerank", "method": "rerank", "first_stage": first_stage, "test": test}
  record["seconds"] = ctx.end("reranking", started)
  atomic.write_text(directory / "done.json", json.dumps(record, indent=1))
  return record


def train_stage(ctx: Context, name: str, row: str, seed: int, extra: list[str]) -> dict:
  """One FGD training stage, OUT/runs/NAME: the warm-up (row "warmup") or a row's stage 2."""
  workdir = ctx.out / "runs" / name
  record = runs_lib.read_json(workdir / "done.json")
  if record is not None:
    ctx.skip(f"train {name}")
    return record
  warmup = row == "warmup"
  steps = ctx.plan.steps
  tiny = (list(TINY_STAGE) + (["model.init_from="] if warmup else [])) if ctx.plan.tiny else []
  started = ctx.begin(f"train {name} (log in {ctx.log(name)})")
  commands.run_command(commands.command(
      "jdr.train", "--config", f"{rows_lib.CONFIGS_DIR / 'fgd'}.py:runlocal" + (",warmup" if warmup else ""),
      "--workdir", workdir, f"--config.data.dataset={ctx.long_dir}", f"--config.seed={seed}",
      f"--config.num_train_steps={steps}", f"--config.optimizer.warmup_steps={steps // 10}",
      "--config.distill.teacher=" if warmup else f"--config.distill.teacher={ctx.teacher}",
      "--config.eval_before_training=False", f"--config.negatives.retrieval.backend={ctx.backend}",
      f"--config.eval.backend={ctx.backend}", *extra, *(f"--config.{o}" for o in tiny + list(ctx.plan.overrides))),
      ctx.log(name))
  record = {"run": name, "method": row, "seed": seed, "steps": steps,
            "after": "" if warmup else f"warmup_s{seed}", "test": commands.final_eval(workdir)}
  record["seconds"] = ctx.end("stage", started)
  atomic.write_text(workdir / "done.json", json.dumps(record, indent=1))
  return record


def long_doc_extras(ctx: Context, name: str) -> dict:
  """MaxP against FirstP and the Eq. 16 gamma sweep for one trained model."""
  workdir = ctx.out / "runs" / name
  path = workdir / "extras.json"
  if path.exists():
    ctx.skip(f"FirstP, MaxP and the Eq. 16 ensemble of {name}")
    return json.loads(path.read_text())
  log = ctx.log(f"{name}-extras")
  started = ctx.begin(f"FirstP, MaxP and the Eq. 16 ensemble of {name} (log in {log})")
  qrels = ctx.long_dir / "qrels" / "test.tsv"
  result = {}
  for kind, flags in (("firstp", ["--pieces", "passage:128,sentence:64"]), ("maxp", ["--passages", "4"])):
    encoded = workdir / f"enc-{kind}"
    commands.run_command(commands.command("jdr.encode", "--model", workdir, "--corpus", ctx.long_dir, "--out",
                                          encoded, "--max-length", 512, *flags), log)
    run = workdir / f"{kind}.trec"
    commands.run_command(commands.command("jdr.retrieve", "--index", encoded, "--queries", ctx.long_dir, "--split",
                                          "test", "--run", run, "--top-k", 100, "--backend", ctx.backend), log)
    result[kind] = evaluate_run(ctx, qrels, run, log)
  for gamma in ctx.plan.gammas:
    run = workdir / f"ensemble-{gamma}.trec"
    commands.run_command(commands.command(
        "jdr.retrieve", "--index", workdir / "enc-firstp", "--queries", ctx.long_dir, "--split", "test", "--run", run,
        "--top-k", 100, "--ensemble-gamma", gamma, "--backend", ctx.backend), log)
    result[f"ensemble_gamma_{gamma}"] = evaluate_run(ctx, qrels, run, log)
  ctx.end("extras", started)
  atomic.write_text(path, json.dumps(result, indent=1))
  return result


def planned(plan: Plan, rows: list[str], single_seed: list[str]) -> list[tuple[str, int]]:
  """(row, seed) of every stage-2 run: `rows` at every seed, `single_seed` at the first."""
  plan_rows = [(row, s) for s in plan.seeds for row in rows]
  return plan_rows + [(row, plan.seeds[0]) for row in single_seed if (row, plan.seeds[0]) not in plan_rows]


def run_stages(ctx: Context, plan_rows: list[tuple[str, int]], extras_row: str, jobs: int) -> dict[str, Exception]:
  """Runs (or skips) every stage, up to `jobs` at once; returns the failed ones by name."""
  plan = ctx.plan
  long_documents(ctx)
  first = plan.seeds[0]
  warm_seeds = list(dict.fromkeys(s for _, s in plan_rows))

  def row_stage(row, seed, warm, taught):
    warm.result()
    taught.result()
    extra = ROWS[row] + [f"--config.model.init_from={ctx.out / 'runs' / f'warmup_s{seed}'}"]
    train_stage(ctx, f"{row}_s{seed}", row, seed, extra)
    if row == extras_row and seed == first:  # MaxP and the Eq. 16 sweep on one model
      long_doc_extras(ctx, f"{row}_s{seed}")

  def reranking(taught, warm_first):
    taught.result()
    if plan.tiny:
      warm_first.result()
    return rerank(ctx, str(ctx.out / "runs" / f"warmup_s{first}") if plan.tiny else "minilm")

  # The teacher and the warm-ups need nothing of each other; they are queued first, so a row blocked on them
  # never holds the last free worker; the reranking (the teacher's own figures) runs beside the rows.
  with concurrent.futures.ThreadPoolExecutor(max(jobs, 1)) as pool:
    taught = pool.submit(train_teacher, ctx)
    warm = {s: pool.submit(train_stage, ctx, f"warmup_s{s}", "warmup", s, []) for s in warm_seeds}
    futures = {"rerank": pool.submit(reranking, taught, warm.get(first))}
    futures.update({f"{row}_s{seed}": pool.submit(row_stage, row, seed, warm[seed], taught)
                    for row, seed in plan_rows})
    failed = {}
    for name, future in futures.items():
      try:
        future.result()
      except Exception as e:  # pylint: disable=broad-except  (one failed row must not hide the others)
        failed[name] = e
        print(f"{name} failed: {e}", file=sys.stderr, flush=True)
  return failed


def planned_jobs(plan: Plan, plan_rows: list[tuple[str, int]], extras_row: str) -> dict[tuple, int]:
  jobs = {("teacher",): 0, ("rerank",): 0}
  jobs.update({("train", f"warmup_s{s}"): 0 for s in dict.fromkeys(s for _, s in plan_rows)})
  jobs.update({("train", f"{row}_s{seed}"): 0 for row, seed in plan_rows})
  if (extras_row, plan.seeds[0]) in plan_rows:
    jobs[("extras", f"{extras_row}_s{plan.seeds[0]}")] = 0
  return jobs


def finished_jobs(out: pathlib.Path, jobs: dict[tuple, int]) -> set[tuple]:
  path = {"teacher": lambda key: out / "data" / "cross-encoder" / "done.json",
          "rerank": lambda key: out / "runs" / "rerank" / "done.json",
          "train": lambda key: out / "runs" / key[1] / "done.json",
          "extras": lambda key: out / "runs" / key[1] / "extras.json"}
  return {key for key in jobs if path[key[0]](key).exists()}


def stage_records(out: pathlib.Path) -> dict[str, list[dict]]:
  """{row: its finished stage records, by seed} ("warmup" for the warm-ups), in the table's order."""
  found: dict[str, list[dict]] = {}
  for path in sorted((out / "runs").glob("*_s*/done.json")):
    record = json.loads(path.read_text())
    found.setdefault(record["method"], []).append(record)
  return {row: sorted(found[row], key=lambda r: r["seed"]) for row in LABELS if row in found}


def table_markdown(plan: Plan, out: pathlib.Path) -> str:
  device = runs_lib.read_json(out / "device.json") or {}
  lines = ["# FGD on long-document SciFact (Zhou et al.) in miniature" + (" (tiny model, built-in data)"
                                                                         if plan.tiny else ""), ""]
  where = f"{device.get('device_kind', '?')} ({device.get('platform', '?')})" if device else "an unrecorded device"
  lines += [f"Every stage trains {plan.steps} steps (configs/fgd.py:runlocal; stage 2 from its seed's warm-up"
            + (", with " + ", ".join(f"`{o}`" for o in plan.overrides) if plan.overrides else "")
            + f"), on {where}; test figures, FirstP at 512 tokens.", ""]
  rerank = runs_lib.read_json(out / "runs" / "rerank" / "done.json")
  if rerank is not None:
    test = rerank["test"]
    lines += [f"## The teacher reranking SciFact test (first stage: {pathlib.Path(rerank['first_stage']).name}, "
              "top 100)", "", "| | nDCG@10 | MRR@100 | ms/query |", "|---|---|---|---|"]
    for key in ["first_stage"] + [f"rerank@{d}" for d in plan.depths]:
      if f"{key}/ndcg@10" in test:
        ms = test.get(f"{key}/ms_per_query")
        lines.append(f"| {key} | {test[f'{key}/ndcg@10']:.4f} | {test[f'{key}/mrr@100']:.4f} | "
                     + ("—" if ms is None else f"{ms:.1f}") + " |")
    lines.append("")
  finals = stage_records(out)
  lines += ["## Stage 2 rows", "", "| row | seeds | MRR@100 | nDCG@10 | R@100 |", "|---|---|---|---|---|"]
  for row, found in finals.items():
    cells = [report.mean_std([r["test"][m] for r in found if m in r["test"]]) for m in METRICS.split(",")]
    lines.append(f"| {LABELS[row]} | {','.join(str(r['seed']) for r in found)} | " + " | ".join(cells) + " |")
  lines += ["", "Mean ± sample standard deviation over the seeds listed (one seed: its figure).", ""]
  for extras in sorted((out / "runs").glob("*_s*/extras.json")):
    e = json.loads(extras.read_text())
    lines += [f"## FirstP, MaxP and the Eq. 16 ensemble: {extras.parent.name}", "",
              "| | MRR@100 | nDCG@10 | R@100 |", "|---|---|---|---|"]
    lines += [f"| {k} | " + " | ".join(f"{v[m]:.4f}" for m in METRICS.split(",")) + " |" for k, v in e.items()]
    lines.append("")
  lines += ["## Claims (paired by seed)", ""] + [claims_lib.judge(c, finals, "").line() for c in CLAIMS]
  lines += ["", "A claim that X beats Y holds when the mean paired gain is larger than the sample std of the paired "
            "gains.", ""]
  return "\n".join(lines)


def write_csv(out: pathlib.Path) -> pathlib.Path:
  """runs.csv: one line per finished stage (the cross-encoder, the reranking, the warm-ups, the rows), figures
  as test_METRIC, a row's long-document extras as extras_KIND/METRIC."""
  records = []
  teacher = runs_lib.read_json(out / "data" / "cross-encoder" / "done.json")
  rerank_record = runs_lib.read_json(out / "runs" / "rerank" / "done.json")
  records += [r for r in (teacher, rerank_record) if r is not None]
  for found in stage_records(out).values():
    records += found
  lines = []
  for r in records:
    line = {k: r.get(k, "") for k in ("run", "method", "steps", "seed", "after", "seconds")}
    line.update(report.flat("test_", r.get("test")))
    extras = runs_lib.read_json(out / "runs" / r["run"] / "extras.json") or {}
    for kind, values in extras.items():
      line.update(report.flat(f"extras_{kind}/", values))
    lines.append({k: "" if v is None else v for k, v in line.items()})
  return report.write_rows_csv(out / "runs.csv", lines)


def write_report(plan: Plan, out: pathlib.Path) -> str:
  """Writes table.md and runs.csv; returns the table's markdown."""
  return commands.write_outputs(out, table_markdown(plan, out), write_csv)


def add_arguments(parser) -> None:
  parser.add_argument("--out", required=True, help="output directory (data, runs, table, CSV); a re-run goes on "
                      "there")
  parser.add_argument("--methods", default="contrastive,document_kd,fgd",
                      help=f"comma-separated rows trained at every seed, of {','.join(ROWS)}")
  parser.add_argument("--single-seed-methods", default="no_passage,no_sentence,fg_pooling,fgd_document_kd",
                      help="comma-separated rows trained at the first seed only")
  parser.add_argument("--seeds", default="", help="comma-separated seeds (default 0,1,2)")
  parser.add_argument("--steps", type=int, default=0, help="training steps of each stage (default 120)")
  parser.add_argument("--teacher-steps", type=int, default=None, help="default: configs/cross_encoder.py's")
  parser.add_argument("--data", default="", help="the SciFact BEIR directory (default: the shared data's)")
  parser.add_argument("--backend", choices=["faiss", "jax"], default="faiss", help="jdr.retrieve's back-end")
  parser.add_argument("--jobs", type=int, default=1, help="stages run at once")
  parser.add_argument("--extras-row", default="fgd", choices=sorted(ROWS),
                      help="the row whose first-seed model gets MaxP vs FirstP and the Eq. 16 gamma sweep")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="a config override for every training stage, e.g. model.encode_chunk_rows=4 (CPU)")
  parser.add_argument("--tiny", action="store_true", help="tiny random BERTs, two steps a stage, on the built-in "
                      "data: checks the whole command, measures nothing")
  parser.add_argument("--report-only", action="store_true", help="write the outputs from the finished stages")


def main(args, parser) -> str:
  plan = tiny_plan() if args.tiny else Plan()
  if args.steps:
    plan = dataclasses.replace(plan, steps=args.steps)
  if args.teacher_steps is not None:
    plan = dataclasses.replace(plan, teacher_steps=args.teacher_steps)
  if args.seeds:
    plan = dataclasses.replace(plan, seeds=commands.seeds_of(args.seeds))
  for item in args.set:
    if "=" not in item:
      parser.error(f"--set {item!r}: expected KEY=VALUE")
  if args.set:
    plan = dataclasses.replace(plan, overrides=tuple(args.set))
  rows = [r.strip() for r in args.methods.split(",") if r.strip()]
  single = [r.strip() for r in args.single_seed_methods.split(",") if r.strip()]
  unknown = [r for r in rows + single if r not in ROWS]
  if unknown:
    parser.error(f"unknown row(s) {', '.join(unknown)}; the rows are {', '.join(ROWS)}")
  plan_rows = planned(plan, rows, single)
  if not args.report_only:
    if (args.extras_row, plan.seeds[0]) not in plan_rows:
      parser.error(f"--extras-row {args.extras_row} is not among the rows this run trains")
    if args.extras_row == "fg_pooling":
      parser.error("--extras-row fg_pooling: its pieces are mean-pooled, and jdr.encode --pieces stores Eq. 7's")
  out = pathlib.Path(args.out)
  if args.report_only:
    plan = rows_lib.recorded_plan(plan, out)
  failed = {}
  with cli.reporting_errors():
    if not args.report_only:
      rows_lib.record_plan(plan, out, free=("seeds",))
      commands.record_device(out)
      if plan.tiny:
        scifact = commands.builtin_data(out)
      else:
        scifact = pathlib.Path(args.data) if args.data else commands.shared_data("scifact")
      jobs = planned_jobs(plan, plan_rows, args.extras_row)
      progress = runs_lib.Progress(jobs, write=lambda line: print(line, flush=True),
                                   finished=finished_jobs(out, jobs), kind=job_kind)
      ctx = Context(plan=plan, out=out, scifact=scifact, backend=args.backend, progress=progress)
      with commands.finished_stages_kept():
        failed = run_stages(ctx, plan_rows, args.extras_row, args.jobs)
    text = write_report(plan, out)
  print(text)
  print(f"wrote {out / 'table.md'}, {out / 'runs.csv'}")
  if failed:
    raise SystemExit(f"stages failed: {', '.join(sorted(failed))}")
  return text
