"""The rows of the methods table, the budget they share, and the trainer config of each stage.

A row is a chain of stages. Each stage is one run of `jdr.training.trainer.train_and_evaluate` on a recipe of
configs/; a later stage starts from the workdir of the one before it (the papers' warm-ups: BM25
negatives before STAR and ANCE, STAR before ADORE+STAR). The warm-up steps are part of the row's budget,
so every row trains `Plan.steps` steps of `Plan.batch_size` in all. A warm-up stage trains at the rate
chosen on dev for its own row; the last stage's rate is the row's, chosen from `Plan.rates`.

Every row is a recipe's ConfigDict with fields set here, never a trainer of its own: `recipe_config` is
the one place that names a recipe argument.

Two rows train on negatives `python -m jdr.mine` wrote (`MINED`): BM25's top 100 of each training query (the
BM25-negative row's own pool), scored by a cross-encoder trained on the same training queries (`teacher_config`,
its steps fixed by the plan), once unfiltered and once with the cross-encoder threshold chosen on the dev
queries' report. `runs.prepare_mined` makes both before the first of these rows trains.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import ml_collections

from jdr.runtime import atomic
from jdr.runtime import config_files

CONFIGS_DIR = pathlib.Path(__file__).resolve().parents[2] / "configs"


@dataclasses.dataclass(frozen=True)
class Plan:
  """What every row shares. The defaults are ADORE's runlocal budget: 208 steps x 32 pairs (about seven
  epochs of SciFact's 919 training pairs; the dev split leaves about 730 of them)."""
  steps: int = 208
  batch_size: int = 32
  rates: tuple[float, ...] = (2e-5, 5e-5, 1e-4)
  seeds: tuple[int, ...] = (0, 1, 2)
  eval_every: int = 52  # dev evaluations (and checkpoints) per stage: the curve's points
  query_max_length: int = 32
  eval_doc_length: int = 256
  compressed: str = "OPQ48,IVF1,PQ48"  # the LTRe row trains and serves on it; every row is also scored on it
  dev_fraction: float = 0.2
  split_seed: int = 0
  teacher_steps: int = 400  # the cross-encoder of the mined rows (configs/cross_encoder.py:runlocal, seed 0)
  tiny: bool = False  # a tiny random BERT instead of MiniLM: the command's own test


def record_plan(plan, out: pathlib.Path, free: tuple[str, ...] = ("rates", "seeds")) -> None:
  """Writes OUT/plan.json, or refuses a plan that differs from the one its runs were trained under in
  anything but the `free` fields (the table's: the rate grid and the seeds, which only add runs). `plan` is
  a frozen dataclass: this table's Plan, or an ablation's."""
  path = pathlib.Path(out) / "plan.json"
  # JSON has lists where a plan has tuples: compared as JSON holds them.
  fixed = {k: v for k, v in json.loads(json.dumps(dataclasses.asdict(plan))).items() if k not in free}
  if path.exists():
    # A field added to the plan after a directory's runs were trained reads as its default there.
    defaults = json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(plan)}))
    old = {k: v for k, v in {**defaults, **json.loads(path.read_text())}.items() if k not in free}
    if old != fixed:
      changed = ", ".join(f"{k} {old.get(k)!r} -> {v!r}" for k, v in fixed.items() if old.get(k) != v)
      raise ValueError(f"{path}: the runs here were trained under another plan ({changed}); use another "
                       "output directory")
  atomic.write_text(path, json.dumps(dataclasses.asdict(plan), indent=1))


def recorded_plan(plan, out: pathlib.Path):
  """The plan OUT/plan.json records, as `plan`'s type (a field it lacks keeps `plan`'s value), or `plan` where
  none is recorded: what a report of the runs there states."""
  path = pathlib.Path(out) / "plan.json"
  if not path.exists():
    return plan
  names = {f.name for f in dataclasses.fields(plan)}
  return dataclasses.replace(plan, **{k: tuple(v) if isinstance(v, list) else v
                                      for k, v in json.loads(path.read_text()).items() if k in names})


# Rows whose last stage trains the query tower only, over a fixed document index: their test is also scored
# on the compressed index (the LTRe row trains on it; ADORE, RankNet = LTRe on Flat, is what it is compared
# with). The start has their document tower, so its scores there come with no training of its own; the
# two-tower rows' indexes would each cost an OPQ training of minutes.
QUERY_ONLY = ("adore", "adore_ranknet", "adore_static", "adore_star", "ltre_pq")


def tiny_plan() -> Plan:
  """A few steps of a 2x64 random BERT. Its compressed index is a PQ of 16 sub-vectors with 4-bit codes,
  which 1,200 documents can train, and no OPQ: OPQ's rotation is slow to train on a small CPU next to the rest
  of a tiny run (docs/performance.md, "Measured outside the benchmarks")."""
  return Plan(steps=8, batch_size=8, rates=(1e-3, 3e-3), eval_every=4, query_max_length=16, eval_doc_length=32,
              compressed="IVF1,PQ16x4", teacher_steps=4, tiny=True)


@dataclasses.dataclass(frozen=True)
class Stage:
  method: str  # the row whose recipe (and, before the last stage, chosen rate) the stage uses
  steps: int


@dataclasses.dataclass(frozen=True)
class Row:
  name: str
  label: str
  stages: tuple[Stage, ...]  # () for the start: the model before any training

  @property
  def depends_on(self) -> tuple[str, ...]:
    """Rows whose chosen rate a warm-up stage of this row needs."""
    return tuple(s.method for s in self.stages[:-1])


def rows(plan: Plan) -> list[Row]:
  """The table's rows, each row after the rows it depends on."""
  b = plan.steps
  half, quarter = b // 2, b // 4
  return [
      Row("start", "start (no training)", ()),
      Row("inbatch", "in-batch negatives", (Stage("inbatch", b),)),
      Row("bm25_neg", "BM25 negatives", (Stage("bm25_neg", b),)),
      Row("star", "STAR (BM25-neg warm-up)", (Stage("bm25_neg", half), Stage("star", b - half))),
      Row("ance", "ANCE (BM25-neg warm-up)", (Stage("bm25_neg", half), Stage("ance", b - half))),
      Row("adore", "ADORE (LambdaRank MRR@10)", (Stage("adore", b),)),
      Row("adore_ranknet", "ADORE, RankNet", (Stage("adore_ranknet", b),)),
      Row("adore_static", "ADORE, static negatives", (Stage("adore_static", b),)),
      Row("adore_star", "ADORE+STAR", (Stage("bm25_neg", quarter), Stage("star", half - quarter),
                                        Stage("adore_star", b - half))),
      Row("ltre_pq", f"LTRe-style on {plan.compressed}", (Stage("ltre_pq", b),)),
      Row("bm25_neg_ce", "BM25 negatives, cross-encoder filtered", (Stage("bm25_neg_ce", b),)),
      Row("margin_mse", "BM25 negatives + MarginMSE from the cross-encoder", (Stage("margin_mse", b),)),
  ]


# The rows trained on `python -m jdr.mine`'s negatives: the directory each reads under OUT/data (where the dev
# split is). The unfiltered one holds the cross-encoder's score of every candidate (MarginMSE's teacher).
MINED = {"bm25_neg_ce": "mined-bm25-ce-filtered", "margin_mse": "mined-bm25"}


def mined_dir(data_root: pathlib.Path | str, method: str) -> pathlib.Path:
  """The mined directory `method` (a key of MINED) trains on, under OUT/data."""
  return pathlib.Path(data_root) / MINED[method]


def row_names(plan: Plan) -> list[str]:
  return [r.name for r in rows(plan)]


def budget_text(plan: Plan) -> str:
  """The budget statement the table carries."""
  lines = [f"Every row trains {plan.steps} steps x {plan.batch_size} (query, positive) pairs in all, warm-ups "
           "included:"]
  for row in rows(plan):
    if len(row.stages) > 1:
      lines.append(f"- {row.label}: " + " -> ".join(f"{s.method} {s.steps} steps" for s in row.stages))
  return "\n".join(lines)


def recipe_config(method: str, configs_dir: pathlib.Path = CONFIGS_DIR) -> ml_collections.ConfigDict:
  """The runlocal ConfigDict of the recipe a method runs. The only coupling to recipe argument strings:
  variants of a recipe (RankNet, static, the compressed index) are set as fields by `stage_config`."""
  recipe = {"adore_ranknet": "adore", "adore_static": "adore", "ltre_pq": "ltre", "bm25_neg_ce": "bm25_neg",
            "margin_mse": "bm25_neg", "cross_encoder": "cross_encoder"}.get(method, method)
  path = pathlib.Path(configs_dir) / f"{recipe}.py"
  return config_files.load_config_file(f"{path}:runlocal")


def stage_config(plan: Plan, method: str, *, steps: int, rate: float, seed: int, dataset: pathlib.Path,
                 init_from: str = "", configs_dir: pathlib.Path = CONFIGS_DIR) -> ml_collections.ConfigDict:
  """One stage's trainer config: the recipe, then what the table fixes for every row."""
  c = recipe_config(method, configs_dir)
  if method == "adore_ranknet":
    c.loss.name = "ranknet"
  elif method == "adore_static":
    c.negatives.retrieval.every = 0  # candidates retrieved once before training
  elif method == "ltre_pq":
    c.negatives.retrieval.index_factory = plan.compressed
    c.eval.factories = f"{plan.compressed};Flat"  # dev is scored on the index the row serves from
    c.eval.backend = "faiss"
  elif method in MINED:
    # One negative a step from the mined pool, as bm25_neg draws from its BM25 top 100.
    c.negatives.source, c.negatives.mined.file = "mined", str(mined_dir(pathlib.Path(dataset).parent, method))
    if method == "margin_mse":  # added to the recipe's contrastive loss, teacher scores read from the pool
      c.distill.teacher, c.distill.margin_mse = "mined", True
      c.distill.document, c.distill.granularities = False, ""
  c.data.dataset = str(dataset)
  c.data.train_split, c.data.eval_split = "train", "dev"
  c.seed = seed
  c.mesh.cpu_devices = 0  # one device, as the tables were trained (commands.ONE_DEVICE)
  c.batch_size = plan.batch_size
  c.num_train_steps = steps
  c.optimizer.learning_rate = rate
  c.optimizer.warmup_steps = max(1, steps // 10)  # the recipes' 10%
  c.eval_every = plan.eval_every
  c.eval_before_training = not init_from  # a warm-started stage begins where its warm-up's curve ended
  c.checkpoint_every = plan.eval_every  # a killed run loses at most one evaluation interval
  c.keep_checkpoints = 1
  c.log_every = min(c.log_every, steps)
  c.data.query_max_length = plan.query_max_length
  c.eval.doc_max_length = plan.eval_doc_length
  c.eval.diagnostic_queries = 0
  if c.negatives.source == "retrieval":
    c.data.doc_max_length = plan.eval_doc_length  # the fixed index is encoded at the evaluation length
  if method == "ance":
    # Three refreshes in the stage, each in force half an interval after its snapshot (runlocal: 30 of 90).
    c.negatives.ance.refresh_every = max(1, steps // 3)
    c.negatives.ance.refresh_delay = c.negatives.ance.refresh_every // 2
  if plan.tiny:
    c.model.pooling, c.model.normalize = "mean", 1  # like MiniLM, so the recipes' temperature suits it
    c.data.doc_max_length = plan.eval_doc_length
    from jdr.negatives import sources  # pylint: disable=g-import-not-at-top  (JAX loads with the runs)
    own = sources.section(c.negatives)  # the source's pool or retrieval depth, where it has one
    if own is not None and "top_n" in own:
      own.top_n = min(own.top_n, 50)
    c.negatives.bm25.top_k = min(c.negatives.bm25.top_k, 20)  # and the mined rows' depth: a tiny teacher's pairs
    c.model.init_from, c.model.fresh = "", "tiny"
  if init_from:
    c.model.init_from = init_from
  return c


def teacher_config(plan: Plan, dataset: pathlib.Path, configs_dir: pathlib.Path = CONFIGS_DIR):
  """The mined rows' cross-encoder: configs/cross_encoder.py:runlocal (MiniLM, a fresh one-logit head, BM25
  negatives) on the same training queries as every row, `plan.teacher_steps` steps at its own rate, seed 0,
  scored once at the end by reranking BM25's top 100 of the dev queries."""
  c = recipe_config("cross_encoder", configs_dir)
  c.data.dataset = str(dataset)
  c.data.train_split, c.data.eval_split = "train", "dev"
  c.seed = 0
  c.mesh.cpu_devices = 0  # one device, as the tables were trained (commands.ONE_DEVICE)
  c.num_train_steps = plan.teacher_steps
  c.optimizer.warmup_steps = max(1, plan.teacher_steps // 10)
  c.eval_every = c.checkpoint_every = plan.teacher_steps
  c.keep_checkpoints = 1
  c.data.query_max_length = plan.query_max_length
  c.data.doc_max_length = plan.eval_doc_length
  if plan.tiny:
    c.model.init_from, c.model.fresh = "", "tiny"
    c.batch_size, c.eval.rerank_depth = 4, 20
  return c


def start_config(plan: Plan, dataset: pathlib.Path, configs_dir: pathlib.Path = CONFIGS_DIR):
  """The config whose starting model is the start row (the in-batch recipe's: MiniLM, one shared tower)."""
  return stage_config(plan, "inbatch", steps=plan.steps, rate=plan.rates[0], seed=0, dataset=dataset,
                      configs_dir=configs_dir)
