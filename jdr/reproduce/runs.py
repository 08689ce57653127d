"""Running the table: every stage in its own workdir, rates chosen on dev, final models scored once.

OUT/runs/METHOD/NAME is a `jdr.train` workdir; its done.json (dev metrics, dev curve) is written when the
stage finished, and test.json (test metrics on Flat and the compressed index, zero-shot metrics) when a
final model was scored. A run with done.json is skipped; a run without it is handed to the trainer, which
resumes from the workdir's checkpoint. So the table can be built over several sittings, and a selection
of rows and seeds rebuilds part of it.

Order: a row's rate is chosen from its seed-0 runs over the grid (dev nDCG@10 after the whole budget; ties
go to the lower rate); then every asked seed trains at that rate and is scored on test and zero-shot. The
model scored is the last step's: the budget is fixed, no checkpoint is picked.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gc
import json
import os
import pathlib
import sys
import time
from typing import Callable

from jdr.runtime import atomic
from jdr.training import metric_writers
from jdr.reproduce import rows as rows_lib

TEST_METRICS = ("ndcg@10", "mrr@10", "recall@100")
ZERO_SHOT_METRICS = ("recall@1", "recall@5", "recall@100", "ndcg@10")


@dataclasses.dataclass(frozen=True)
class StageRun:
  """One trainer run: the (method, steps, rate) of every stage up to and including this one, and the seed."""
  chain: tuple[tuple[str, int, float], ...]
  seed: int

  @property
  def method(self) -> str:
    return self.chain[-1][0]

  @property
  def steps(self) -> int:
    return self.chain[-1][1]

  @property
  def rate(self) -> float:
    return self.chain[-1][2]

  @property
  def parent(self) -> StageRun | None:
    return StageRun(self.chain[:-1], self.seed) if len(self.chain) > 1 else None

  @property
  def name(self) -> str:
    own = f"{self.method}/{self.steps}steps_lr{self.rate:g}_seed{self.seed}"
    before = "_".join(f"{m}{s}lr{r:g}" for m, s, r in reversed(self.chain[:-1]))
    return f"{own}_after_{before}" if before else own


def chain_for(row: rows_lib.Row, rate: float, seed: int, choices: dict[str, float]) -> StageRun:
  """The last stage of `row` at `rate`, its warm-ups at the rates chosen for their own rows."""
  chain = tuple((s.method, s.steps, choices[s.method]) for s in row.stages[:-1])
  last = row.stages[-1]
  return StageRun(chain + ((last.method, last.steps, rate),), seed)


def needed_rows(plan: rows_lib.Plan, selected: list[str]) -> list[str]:
  """The selected rows, the start, and every row whose rate a selected row's warm-up needs, in table order."""
  by_name = {r.name: r for r in rows_lib.rows(plan)}
  need = {"start"}
  todo = list(selected)
  while todo:
    name = todo.pop()
    if name not in need:
      need.add(name)
      todo.extend(by_name[name].depends_on)
  return [r.name for r in rows_lib.rows(plan) if r.name in need]


def planned_jobs(plan: rows_lib.Plan, selected: list[str], seeds: list[int],
                 given: dict[str, float] | None = None) -> dict[tuple, int]:
  """{job key: training steps (0 for scoring)} of every job a selection runs, counted before any rate is
  chosen: a warm-up's rate is the symbol ("chosen", row), one run whatever the rate turns out to be. A row
  whose rate is `given` trains no grid."""
  given = given or {}
  by_name = {r.name: r for r in rows_lib.rows(plan)}
  jobs: dict[tuple, int] = {("score", "start"): 0}

  def add_chain(row, last_rate, seed):
    chain = tuple((s.method, s.steps, ("chosen", s.method)) for s in row.stages[:-1])
    chain += ((row.stages[-1].method, row.stages[-1].steps, last_rate),)
    for k in range(len(chain)):
      jobs[("train", chain[:k + 1], seed)] = chain[k][1]

  if set(needed_rows(plan, selected)) & set(rows_lib.MINED):
    jobs[("prepare", "teacher")] = plan.teacher_steps
    jobs[("prepare", "mined")] = 0
  for name in needed_rows(plan, selected):
    if by_name[name].stages and name not in given:
      for rate in plan.rates:
        add_chain(by_name[name], rate, 0)
  for name in selected:
    if not by_name[name].stages:
      continue
    for seed in seeds:
      if seed != 0 or name in given:  # seed 0 at the chosen rate is one of the grid runs, if there is a grid
        add_chain(by_name[name], ("chosen", name), seed)
      jobs[("score", name, seed)] = 0
  return jobs


def finished_jobs(out: pathlib.Path, plan: rows_lib.Plan, jobs: dict[tuple, int]) -> set[tuple]:
  """The jobs of `planned_jobs` whose done.json / test.json is there, warm-ups' rates read from the choices
  OUT/choices.json recorded (a job whose rates are not chosen yet cannot have run)."""
  chosen = {row: grid["rate"] for row, grid in (read_json(out / "choices.json") or {}).items()}
  by_name = {r.name: r for r in rows_lib.rows(plan)}

  def rate(value):
    return chosen.get(value[1]) if isinstance(value, tuple) else value

  finished = set()
  for key in jobs:
    if key == ("score", "start"):
      path = out / "runs" / "start" / "test.json"
    elif key == ("prepare", "teacher"):
      path = teacher_dir(out) / "done.json"
    elif key == ("prepare", "mined"):
      path = mined_done(out)
    elif key[0] == "score":
      row, seed = by_name[key[1]], key[2]
      if any(s.method not in chosen for s in row.stages):
        continue
      path = out / "runs" / chain_for(row, chosen[row.name], seed, chosen).name / "test.json"
    else:
      chain = tuple((m, steps, rate(r)) for m, steps, r in key[1])
      if any(r is None for _, _, r in chain):
        continue
      path = out / "runs" / StageRun(chain, key[2]).name / "done.json"
    if path.exists():
      finished.add(key)
  return finished


def duration(seconds: float) -> str:
  seconds = int(round(seconds))
  if seconds >= 3600:
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
  return f"{seconds // 60}m{seconds % 60:02d}s"


def step_kind(method: str) -> str:
  """The ADORE / LTRe steps train one tower over a fixed index, far cheaper than a two-tower step. ANCE's steps
  carry its refreshes' corpus re-encodings, dearer than a two-tower step (the figures: docs/performance.md,
  "Measured outside the benchmarks"), so they are priced by their own measurements."""
  if method in rows_lib.QUERY_ONLY:
    return "query-only step"
  return "ANCE step" if method == "ance" else "two-tower step"


def job_kind(key: tuple) -> str:
  """What a `planned_jobs` job's time is priced by: a scoring, the cross-encoder's steps, the mining, or a step
  of its last stage's kind."""
  if key[0] == "prepare":
    return "cross-encoder step" if key[1] == "teacher" else "mining"
  return "score" if key[0] == "score" else step_kind(key[1][-1][0])


class Progress:
  """Prints "run i of n: WHAT (ETA ...)" before each job; the ETA prices what is left of each kind of work
  (`job_kind`) at the seconds per unit measured so far in this invocation; a two-tower or query-only step not
  measured yet at the other's rate, ANCE steps and scorings not measured yet are named apart. The `finished`
  jobs (done in an earlier sitting) cost nothing. `kind` names a job's kind of work (the table's `job_kind`
  by default; an ablation passes its own)."""

  def __init__(self, jobs: dict[tuple, int], write: Callable[[str], None], finished: set[tuple] = frozenset(),
               kind: Callable[[tuple], str] = job_kind):
    self.total = len(jobs)
    self.left = collections.Counter()
    for key, steps in jobs.items():
      if key not in finished:
        self.left[kind(key)] += steps or 1  # a step count, or one scoring / mining
    self.write = write
    self.index = 0
    self.seconds, self.units = collections.Counter(), collections.Counter()
    self._visited: set[tuple] = set()

  def first_visit(self, key: tuple) -> bool:
    """Whether a job is met for the first time (a warm-up is met by every row and seed that needs it)."""
    first = key not in self._visited
    self._visited.add(key)
    return first

  def eta(self) -> str:
    if not self.units:
      return "ETA after the first run"
    rates = {kind: self.seconds[kind] / self.units[kind] for kind in self.units}
    steps = [rates[kind] for kind in ("two-tower step", "query-only step") if kind in rates]
    if steps:  # one of these not timed yet is priced at the other's rate: an upper bound for query-only steps
      rates = {"two-tower step": max(steps), "query-only step": min(steps)} | rates
    noun = {"score": "scoring"}
    untimed = [f"{n} {noun.get(kind, kind)}{'s' if n > 1 else ''}" for kind, n in sorted(self.left.items())
               if n and kind not in rates]
    timed = sum(n * rates[kind] for kind, n in self.left.items() if kind in rates)
    return f"ETA {duration(timed)}" + "".join(f" + {what} (not timed yet)" for what in untimed)

  def begin(self, what: str) -> None:
    self.index += 1
    self.write(f"run {self.index} of {self.total}: {what} ({self.eta()})")

  def skip(self, what: str) -> None:
    self.index += 1
    self.write(f"run {self.index} of {self.total}: {what}: finished before, skipped")

  def add(self, kind: str, units: int) -> None:
    """A job counted as finished turned out to need running (an imported warm-up retrained for its weights)."""
    self.total += 1
    self.left[kind] += units

  def end(self, kind: str, units: int, seconds: float, resumed_at: int = 0) -> None:
    """A job of `kind` finished: `units` steps (1 for a scoring), of which those after `resumed_at` (a checkpoint
    an earlier sitting left) ran in `seconds`. Only those price the rest: a resumed run's seconds over all its
    steps would make the ETA too short."""
    self.left[kind] = max(0, self.left[kind] - units)
    if units > resumed_at:
      self.seconds[kind] += seconds
      self.units[kind] += units - resumed_at


@dataclasses.dataclass
class Context:
  plan: rows_lib.Plan
  out: pathlib.Path
  dataset: pathlib.Path  # the dev-split dataset (devsplit.write_dev_split)
  zero_shot: pathlib.Path | None  # a BEIR test-only dataset, or None
  progress: Progress
  configs_dir: pathlib.Path = rows_lib.CONFIGS_DIR

  def workdir(self, run: StageRun) -> pathlib.Path:
    return self.out / "runs" / run.name

  @property
  def vector_cache(self) -> pathlib.Path:
    """Corpus vectors by document side (`jdr.retrieval.corpus_cache`), shared by every run and scoring: a model's last
    evaluation, its scoring, its successor's mining and fixed index, and every start from MiniLM encode the
    same corpus with the same tower (minutes each on the 2-core CPU)."""
    return self.out / "data" / "corpus-vectors"


@contextlib.contextmanager
def output_to(path: pathlib.Path):
  """The trainer's prints and progress bars go to the run's log, and so do Faiss' own (C++) warnings, by file
  descriptor: the terminal keeps the progress lines and the table."""
  path.parent.mkdir(parents=True, exist_ok=True)
  sys.stdout.flush(), sys.stderr.flush()
  saved = [os.dup(1), os.dup(2)]
  try:
    with open(path, "a", encoding="utf-8") as log:
      os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
      with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
          yield
        finally:
          sys.stdout.flush(), sys.stderr.flush()
  finally:
    os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    os.close(saved[0]), os.close(saved[1])


def release() -> None:
  """Drops the finished run's compiled programs: dozens of runs share one process."""
  import jax  # pylint: disable=g-import-not-at-top
  jax.clear_caches()
  gc.collect()


def dev_curve(workdir: pathlib.Path, metric: str = "ndcg@10") -> list[tuple[int, float]]:
  """(step, dev metric) of a stage; a resumed run's repeated steps keep their last value."""
  points = {}
  for record in metric_writers.read(workdir):
    if f"eval/{metric}" in record:
      points[record["step"]] = record[f"eval/{metric}"]
  return sorted(points.items())


def read_json(path: pathlib.Path) -> dict | None:
  return json.loads(path.read_text()) if path.exists() else None


def _checkpoint_step(workdir: pathlib.Path) -> int:
  """The step of `workdir`'s latest checkpoint (0 without one): where a training run resumes."""
  from jdr.runtime import checkpoint  # pylint: disable=g-import-not-at-top  (it loads the checkpoint library)
  return checkpoint.latest_step(workdir) or 0


def trained_to(workdir: pathlib.Path, steps: int) -> bool:
  """Whether `workdir` holds a checkpoint at step `steps` or later (the trainer saves its last step)."""
  return _checkpoint_step(workdir) >= steps


def train(ctx: Context, run: StageRun) -> dict:
  """The stage's done.json record, training it (and its warm-ups first) unless it finished before."""
  workdir = ctx.workdir(run)
  first = ctx.progress.first_visit(("train", run.name))
  init_from = ""
  done = read_json(workdir / "done.json")
  if run.parent is not None:  # visited even when this stage finished, so the progress count stays exact
    parent_dir = ctx.workdir(run.parent)
    parent = read_json(parent_dir / "done.json")
    if done is None and parent is not None and parent.get("imported") and not trained_to(parent_dir, run.parent.steps):
      # Its record came from another build's runs.csv, its weights did not (or a retraining of it was stopped
      # before its last step, and the record was imported again): train it again here, from its checkpoint.
      (parent_dir / "done.json").unlink()
      (parent_dir / "test.json").unlink(missing_ok=True)
      ctx.progress.add(step_kind(run.parent.method), run.parent.steps)
    train(ctx, run.parent)
    init_from = str(parent_dir)
  if done is not None:
    if first:
      ctx.progress.skip(f"train {run.name}")
    return done
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top  (JAX starts here, not at import)
  config = rows_lib.stage_config(ctx.plan, run.method, steps=run.steps, rate=run.rate, seed=run.seed,
                                 dataset=ctx.dataset, init_from=init_from, configs_dir=ctx.configs_dir)
  ctx.progress.begin(f"train {run.name}")
  resumed_at = _checkpoint_step(workdir)
  start = time.perf_counter()
  config.eval.corpus_cache = str(ctx.vector_cache)
  with output_to(workdir / "train.log"):
    results = trainer.train_and_evaluate(config, workdir)
  seconds = time.perf_counter() - start
  record = {"run": run.name, "method": run.method, "steps": run.steps, "batch_size": ctx.plan.batch_size,
            "rate": run.rate, "seed": run.seed,
            "after": " -> ".join(f"{m} {s} steps lr {r:g}" for m, s, r in run.chain[:-1]),
            "parent": run.parent.name if run.parent else "",
            "dev": {k: float(v) for k, v in results["after"].items()}, "dev_curve": dev_curve(workdir),
            "seconds": round(seconds, 1)}
  atomic.write_text(workdir / "done.json", json.dumps(record, indent=1))
  del results
  release()
  ctx.progress.end(step_kind(run.method), run.steps, seconds, resumed_at)
  return record


def choose_rate(ctx: Context, row: rows_lib.Row, choices: dict[str, float]) -> dict:
  """Trains the row's seed-0 grid and records, in `choices`, the rate with the best dev nDCG@10."""
  dev = {}
  for rate in ctx.plan.rates:
    dev[rate] = train(ctx, chain_for(row, rate, 0, choices))["dev"]["ndcg@10"]
  best = max(ctx.plan.rates, key=lambda r: (dev[r], -r))
  choices[row.name] = best
  return {"rate": best, "dev_ndcg@10": {f"{r:g}": v for r, v in dev.items()}}


# Trained Faiss indexes by (corpus vectors, factory). The ADORE / LTRe rows keep the starting document tower,
# so all their models share one corpus encoding: OPQ48,IVF1,PQ48 over SciFact is slow to train on a small CPU
# (docs/performance.md, "Measured outside the benchmarks"), and is trained once per sitting for them instead
# of once per model.
_INDEXES: dict[tuple[str, str], object] = {}


def evaluate_on(model, params, tokenizer, dataset: pathlib.Path, split: str, metrics: tuple[str, ...],
                factories: list[str], *, query_max_length: int, doc_max_length: int,
                vector_cache: pathlib.Path, prompts: dict | None = None) -> dict[str, float]:
  """A model's metrics on one split of a BEIR dataset, on each Faiss index factory (the first unprefixed,
  the others "FACTORY/metric"), encoded by the trainer's own TowerEncoder (after the model's `prompts`) and
  read from the trainer's cache where a run encoded the corpus with this document side before (its last
  evaluation, or the start's)."""
  import hashlib  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import retrievers  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import tower_encoder  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import index as index_lib  # pylint: disable=g-import-not-at-top
  from jdr.evaluation import metrics as metrics_lib  # pylint: disable=g-import-not-at-top
  from jdr.data import formats  # pylint: disable=g-import-not-at-top
  from jdr.data import pairs  # pylint: disable=g-import-not-at-top
  corpus, queries, qrels = formats.load_beir(dataset, split)
  data = pairs.RetrievalData(corpus, queries, {}, qrels, pathlib.Path(dataset).name)
  encoder = tower_encoder.TowerEncoder(model, tokenizer, data, query_max_length=query_max_length,
                                    doc_max_length=doc_max_length, cache_dir=str(vector_cache), prompts=prompts)
  doc_emb = encoder.corpus(params, progress=True)
  qids = sorted(qrels)
  query_emb = encoder.queries(params, qids)
  digest = hashlib.sha1(doc_emb.tobytes()).hexdigest()
  results = {}
  for i, factory in enumerate(factories):
    key = (digest, factory)
    if key not in _INDEXES:
      _INDEXES[key] = retrievers.build_index(doc_emb, encoder.doc_ids, "faiss", factory)
    scores, ids = _INDEXES[key].search(query_emb, min(100, len(encoder.doc_ids)))
    scored = metrics_lib.evaluate(qrels, index_lib.to_run(qids, scores, ids), list(metrics))
    results.update({("" if i == 0 else f"{factory}/") + k: float(v) for k, v in scored.items()})
  return results


def score_model(ctx: Context, model, params, tokenizer, compressed: bool, prompts: dict | None = None) -> dict:
  """Test metrics on Flat (and on the compressed index), zero-shot metrics when a dataset is given."""
  lengths = dict(query_max_length=ctx.plan.query_max_length, doc_max_length=ctx.plan.eval_doc_length,
                 vector_cache=ctx.vector_cache, prompts=prompts)
  factories = ["Flat", ctx.plan.compressed] if compressed else ["Flat"]
  record = {"test": evaluate_on(model, params, tokenizer, ctx.dataset, "test", TEST_METRICS, factories, **lengths)}
  if ctx.zero_shot is not None:
    record["zero_shot"] = evaluate_on(model, params, tokenizer, ctx.zero_shot, "test", ZERO_SHOT_METRICS,
                                      ["Flat"], **lengths)
  return record


def score(ctx: Context, run: StageRun) -> dict:
  """A final model's test.json: scored once, on test and zero-shot."""
  path = ctx.workdir(run) / "test.json"
  record = read_json(path)
  if record is not None:
    if ctx.progress.first_visit(("score", run.name)):
      ctx.progress.skip(f"score {run.name}")
    return record
  ctx.progress.first_visit(("score", run.name))
  from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
  ctx.progress.begin(f"score {run.name} on test" + (" and zero-shot" if ctx.zero_shot else ""))
  start = time.perf_counter()
  with output_to(ctx.workdir(run) / "score.log"):
    model, params, tokenizer, description = build_lib.load_jdr_model(ctx.workdir(run))
    record = score_model(ctx, model, params, tokenizer, run.method in rows_lib.QUERY_ONLY,
                         prompts=description.get("prompts"))
  record["score_seconds"] = round(time.perf_counter() - start, 1)
  atomic.write_text(path, json.dumps(record, indent=1))
  release()
  ctx.progress.end("score", 1, record["score_seconds"])
  return record


def score_start(ctx: Context) -> dict:
  """The start row: the model every row starts from, on dev, test and zero-shot."""
  path = ctx.out / "runs" / "start" / "test.json"
  record = read_json(path)
  if record is not None:
    ctx.progress.skip("score the start model")
    return record
  import jax  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
  ctx.progress.begin("score the start model on dev, test" + (" and zero-shot" if ctx.zero_shot else ""))
  start = time.perf_counter()
  with output_to(path.parent / "score.log"):
    config = rows_lib.start_config(ctx.plan, ctx.dataset, ctx.configs_dir)
    built = build_lib.build(config.model, config.data)
    params = trainer.initial_params(built.model, built, config, jax.random.PRNGKey(config.seed), None)
    dev = evaluate_on(built.model, params, built.tokenizer, ctx.dataset, "dev", TEST_METRICS, ["Flat"],
                      query_max_length=ctx.plan.query_max_length, doc_max_length=ctx.plan.eval_doc_length,
                      vector_cache=ctx.vector_cache, prompts=built.description.get("prompts"))
    record = {"dev": dev, **score_model(ctx, built.model, params, built.tokenizer, True,
                                        prompts=built.description.get("prompts"))}
  record["score_seconds"] = round(time.perf_counter() - start, 1)
  atomic.write_text(path, json.dumps(record, indent=1))
  release()
  ctx.progress.end("score", 1, record["score_seconds"])
  return record


def teacher_dir(out: pathlib.Path) -> pathlib.Path:
  """The mined rows' cross-encoder: a trainer workdir beside the data (not under OUT/runs, whose stages are the
  table's rows)."""
  return out / "data" / "cross-encoder"


def mined_done(out: pathlib.Path) -> pathlib.Path:
  """The file whose presence says both mined directories are finished (the filtered one is written last)."""
  return rows_lib.mined_dir(out / "data", "bm25_neg_ce") / "meta.json"


def train_teacher(ctx: Context) -> dict:
  """Trains the mined rows' cross-encoder (`rows.teacher_config`) unless it finished before; its done.json holds
  its dev figures (BM25's top 100 reranked)."""
  workdir = teacher_dir(ctx.out)
  done = read_json(workdir / "done.json")
  first = ctx.progress.first_visit(("prepare", "teacher"))
  if done is not None:
    if first:
      ctx.progress.skip("train the cross-encoder")
    return done
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  config = rows_lib.teacher_config(ctx.plan, ctx.dataset, ctx.configs_dir)
  ctx.progress.begin(f"train the cross-encoder ({config.num_train_steps} steps) and rerank dev")
  resumed_at = _checkpoint_step(workdir)
  start = time.perf_counter()
  with output_to(workdir / "train.log"):
    results = trainer.train_and_evaluate(config, workdir)
  seconds = time.perf_counter() - start
  done = {"steps": config.num_train_steps, "rate": config.optimizer.learning_rate, "seed": config.seed,
          "dev": {k: float(v) for k, v in results["after"].items()}, "seconds": round(seconds, 1)}
  atomic.write_text(workdir / "done.json", json.dumps(done, indent=1))
  del results
  release()
  ctx.progress.end("cross-encoder step", config.num_train_steps, seconds, resumed_at)
  return done


def prepare_mined(ctx: Context) -> None:
  """The mined rows' negatives: `python -m jdr.mine` over the training queries (BM25's top 100, the BM25-negative
  row's pool, every candidate scored by the cross-encoder; the dev split's report), then the same directory
  filtered again with the cross-encoder threshold chosen on that report."""
  train_teacher(ctx)
  first = ctx.progress.first_visit(("prepare", "mined"))
  if mined_done(ctx.out).exists():
    if first:
      ctx.progress.skip("mine BM25 negatives with the cross-encoder's scores")
    return
  from jdr import mine  # pylint: disable=g-import-not-at-top
  everything = rows_lib.mined_dir(ctx.out / "data", "margin_mse")
  filtered = rows_lib.mined_dir(ctx.out / "data", "bm25_neg_ce")
  depth = rows_lib.stage_config(ctx.plan, "bm25_neg", steps=1, rate=0.0, seed=0, dataset=ctx.dataset,
                                configs_dir=ctx.configs_dir).negatives.bm25.top_k
  ctx.progress.begin(f"mine BM25's top {depth} with the cross-encoder's scores, then filter on dev")
  start = time.perf_counter()
  with output_to(everything.parent / "mine.log"):
    mine.main(["--data", str(ctx.dataset), "--out", str(everything), "--dev-split", "dev", "--depth", str(depth),
               "--cross-encoder", str(teacher_dir(ctx.out)), "--ce-max-length", str(ctx.plan.eval_doc_length)])
    mine.main(["--from", str(everything), "--out", str(filtered), "--ce-threshold", "dev"])
  ctx.progress.end("mining", 1, time.perf_counter() - start)
  release()


def record_given_rates(out: pathlib.Path, given: dict[str, float], selected: list[str]) -> None:
  """Writes rates chosen on dev in an earlier build (same plan, same dev split) into OUT/choices.json, marked as
  given, so the rows whose warm-ups they are can be rebuilt without retraining the grids that chose them, and
  a selected row whose recipe has not changed trains its final seeds only (its seed 0's dev figure is filled
  in when it has trained). A rate this directory chose on dev already is kept (and must agree)."""
  del selected  # a selected row may be given its rate too: it then trains no grid
  if not given:
    return
  path = out / "choices.json"
  grid = read_json(path) or {}
  for name, rate in given.items():
    if name in grid and not grid[name].get("given") and float(grid[name]["rate"]) != rate:
      raise ValueError(f"{path}: {name}'s rate was chosen on dev here as {float(grid[name]['rate']):g}, "
                       f"not {rate:g}")
    grid.setdefault(name, {"rate": rate, "given": True, "dev_ndcg@10": {}})
  path.parent.mkdir(parents=True, exist_ok=True)
  atomic.write_text(path, json.dumps(grid, indent=1))


def run_table(ctx: Context, selected: list[str], seeds: list[int]) -> dict:
  """Runs (or skips) every job of the selection; returns the choices, also written to OUT/choices.json.
  A row that OUT/choices.json marks as given (`record_given_rates`) keeps that rate and trains no grid."""
  by_name = {r.name: r for r in rows_lib.rows(ctx.plan)}
  choices_file = ctx.out / "choices.json"
  choices, grid = {}, read_json(choices_file) or {}
  for name in needed_rows(ctx.plan, selected):
    row = by_name[name]
    if not row.stages:
      score_start(ctx)
      continue
    given = grid.get(name, {}).get("given")
    if name in rows_lib.MINED and (name in selected or not given):
      prepare_mined(ctx)
    if given:
      choices[name] = float(grid[name]["rate"])
    else:
      grid[name] = choose_rate(ctx, row, choices)
      atomic.write_text(choices_file, json.dumps(grid, indent=1))
    if name in selected:
      for seed in seeds:
        run = chain_for(row, choices[name], seed, choices)
        record = train(ctx, run)
        if given and seed == 0:  # the given rate's dev figure, measured here
          grid[name]["dev_ndcg@10"][f"{choices[name]:g}"] = record["dev"]["ndcg@10"]
          atomic.write_text(choices_file, json.dumps(grid, indent=1))
        score(ctx, run)
  print(f"rates chosen on dev: {', '.join(f'{k} {v:g}' for k, v in choices.items())}", file=sys.stderr)
  return grid
