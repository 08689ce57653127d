"""python -m jdr.reproduce: the dev split, the rows as trainer configs at one budget, the job count, and the
command end to end on a tiny random BERT and the built-in dataset (outputs written, a re-run skips)."""

import csv
import dataclasses
import json
import pathlib
import types

import pytest

from conftest import write_tiny_beir
from jdr.reproduce import devsplit
from jdr.reproduce import rows as rows_lib
from jdr.reproduce import runs as runs_lib


def test_dev_split_is_fixed_disjoint_and_a_fifth():
  qids = [f"q{i}" for i in range(809)]
  train, dev = devsplit.split_queries(qids, 0.2, seed=0)
  assert len(dev) == 162 and len(train) == 647
  assert not set(train) & set(dev) and set(train) | set(dev) == set(qids)
  assert devsplit.split_queries(list(reversed(qids)), 0.2, seed=0) == (train, dev)  # input order is irrelevant
  assert devsplit.split_queries(qids, 0.2, seed=1)[1] != dev
  with pytest.raises(ValueError, match="fraction"):
    devsplit.split_queries(qids, 1.0, seed=0)


def test_writing_the_dev_split_again_leaves_its_files_as_they_were(tmp_path):
  # A second build beside a running one writes the split again; a rewritten corpus file (new modification
  # time) would invalidate the prepared corpus the running build reads from it.
  write_tiny_beir(tmp_path / "src")
  target = devsplit.write_dev_split(tmp_path / "src", tmp_path / "out", fraction=0.2, seed=0)
  files = sorted(p for p in target.rglob("*") if p.is_file())
  assert {p.relative_to(target).as_posix() for p in files} == {
      "corpus.jsonl", "queries.jsonl", "split.json", "qrels/train.tsv", "qrels/dev.tsv", "qrels/test.tsv"}
  before = {p: (p.stat().st_mtime_ns, p.stat().st_ino, p.read_bytes()) for p in files}
  assert devsplit.write_dev_split(tmp_path / "src", tmp_path / "out", fraction=0.2, seed=0) == target
  assert {p: (p.stat().st_mtime_ns, p.stat().st_ino, p.read_bytes()) for p in files} == before
  assert sorted(p for p in target.rglob("*") if p.is_file()) == files  # no scratch left behind
  # A changed source is copied again.
  with open(tmp_path / "src" / "corpus.jsonl", "a") as f:
    f.write('{"_id": "extra", "title": "", "text": "one more"}\n')
  devsplit.write_dev_split(tmp_path / "src", tmp_path / "out", fraction=0.2, seed=0)
  assert (target / "corpus.jsonl").read_bytes() == (tmp_path / "src" / "corpus.jsonl").read_bytes()
  assert (target / "qrels" / "dev.tsv").read_bytes() == before[target / "qrels" / "dev.tsv"][2]


def test_every_row_is_a_recipe_config_at_the_same_budget():
  plan = rows_lib.Plan()
  expect = {"inbatch": ("none", "softmax_nll"), "bm25_neg": ("bm25", "softmax_nll"),
            "star": ("dense_static", "ranknet"), "ance": ("ance", "softmax_nll"), "adore": ("retrieval", "lambdarank"),
            "adore_ranknet": ("retrieval", "ranknet"), "adore_static": ("retrieval", "lambdarank"),
            "adore_star": ("retrieval", "lambdarank"), "ltre_pq": ("retrieval", "ranknet"),
            "bm25_neg_ce": ("mined", "softmax_nll"), "margin_mse": ("mined", "softmax_nll")}
  for row in rows_lib.rows(plan):
    if not row.stages:
      continue
    assert sum(s.steps for s in row.stages) == plan.steps, row
    for i, stage in enumerate(row.stages):
      c = rows_lib.stage_config(plan, stage.method, steps=stage.steps, rate=5e-5, seed=2, dataset="D",
                                init_from="W" if i else "")
      assert (c.negatives.source, c.loss.name) == expect[stage.method], stage
      assert (c.num_train_steps, c.batch_size, c.optimizer.learning_rate, c.seed) == (stage.steps, 32, 5e-5, 2)
      assert (c.data.train_split, c.data.eval_split) == ("train", "dev")
      assert c.model.init_from == ("W" if i else "minilm")
  static = rows_lib.stage_config(plan, "adore_static", steps=8, rate=1e-4, seed=0, dataset="D")
  assert static.negatives.retrieval.every == 0
  ltre = rows_lib.stage_config(plan, "ltre_pq", steps=8, rate=1e-4, seed=0, dataset="D")
  assert ltre.negatives.retrieval.index_factory == "OPQ48,IVF1,PQ48"
  assert ltre.eval.factories.split(";") == ["OPQ48,IVF1,PQ48", "Flat"]
  assert [s.method for s in {r.name: r for r in rows_lib.rows(plan)}["adore_star"].stages] == \
      ["bm25_neg", "star", "adore_star"]
  # The mined rows are the BM25-negative recipe on a mined pool; MarginMSE reads the pool's teacher scores.
  bm25 = rows_lib.stage_config(plan, "bm25_neg", steps=8, rate=1e-4, seed=0, dataset="OUT/data/D")
  for method, folder in rows_lib.MINED.items():
    c = rows_lib.stage_config(plan, method, steps=8, rate=1e-4, seed=0, dataset="OUT/data/D")
    assert c.negatives.mined.file == str(pathlib.Path("OUT/data") / folder)
    assert (c.negatives.per_query, c.negatives.in_batch, c.loss.temperature) == \
        (bm25.negatives.per_query, bm25.negatives.in_batch, bm25.loss.temperature)
    assert (c.distill.teacher, c.distill.margin_mse) == (("mined", True) if method == "margin_mse" else ("", False))
  teacher = rows_lib.teacher_config(plan, "OUT/data/D")
  assert (teacher.model.architecture, teacher.num_train_steps, teacher.data.eval_split) == ("cross_encoder", 400, "dev")


def test_full_table_job_count():
  """11 trained rows: a 3-rate grid at seed 0, two more seeds at the chosen rate; the three warm-ups
  (BM25 104 steps, shared by STAR and ANCE; BM25 52 -> STAR 52 before ADORE+STAR) once per seed; the
  cross-encoder and the mining once, for the two mined rows."""
  plan = rows_lib.Plan()
  jobs = runs_lib.planned_jobs(plan, rows_lib.row_names(plan), [0, 1, 2])
  trains = {k: v for k, v in jobs.items() if k[0] == "train"}
  assert len(trains) == 33 + 22 + 3 * 3
  assert {k: v for k, v in jobs.items() if k[0] == "prepare"} == {("prepare", "teacher"): 400, ("prepare", "mined"): 0}
  assert len(jobs) - len(trains) == 11 * 3 + 1 + 2
  assert sum(trains.values()) == 3 * 1560 + 2 * 1560 + 3 * (104 + 52 + 52) + 2 * 5 * 208
  assert not any(k[0] == "prepare" for k in runs_lib.planned_jobs(plan, ["star"], [0]))
  # A row alone still trains the grids its warm-ups' rates come from.
  star = runs_lib.planned_jobs(plan, ["star"], [0])
  assert {k[1][-1][0] for k in star if k[0] == "train"} == {"bm25_neg", "star"}
  assert runs_lib.needed_rows(plan, ["adore_star"]) == ["start", "bm25_neg", "star", "adore_star"]


@pytest.mark.long
def test_tiny_table_end_to_end_and_rerun_skips(tmp_path, monkeypatch, capsys):
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
  from jdr.reproduce import __main__ as command  # pylint: disable=g-import-not-at-top
  out = tmp_path / "repro"
  argv = ["scifact", "--out", str(out), "--tiny", "--methods", "inbatch", "--seeds", "0,1", "--rates", "3e-3"]
  command.main(argv)
  first = capsys.readouterr().out
  assert "run 5 of 5: score inbatch/8steps_lr0.003_seed1" in first and "ETA" in first

  split = out / "data" / "stdlib-docstrings-dev"
  record = json.loads((split / "split.json").read_text())
  train_q = {l.split("\t")[0] for l in (split / "qrels" / "train.tsv").read_text().splitlines()[1:]}
  dev_q = {l.split("\t")[0] for l in (split / "qrels" / "dev.tsv").read_text().splitlines()[1:]}
  assert dev_q == set(record["dev_queries"]) and not train_q & dev_q
  assert len(dev_q) == round(0.2 * (len(dev_q) + len(train_q)))

  table = (out / "table.md").read_text()
  assert "| in-batch negatives | 0.003 |" in table and "| start (no training) |" in table
  assert "- STAR beats BM25 negatives at the same budget: not yet scored" in table  # its rows were not run
  with open(out / "runs.csv") as f:
    lines = list(csv.DictReader(f))
  assert [l["run"] for l in lines] == ["start", "inbatch/8steps_lr0.003_seed0", "inbatch/8steps_lr0.003_seed1"]
  assert all(0.0 <= float(l["test_ndcg@10"]) <= 1.0 for l in lines)
  for png in ("dev_curves.png", "test_ndcg.png"):
    assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  curve = json.loads((out / "runs" / "inbatch" / "8steps_lr0.003_seed0" / "done.json").read_text())["dev_curve"]
  assert [step for step, _ in curve] == [0, 4, 8]
  # Scoring read the corpus vectors the run's last evaluation wrote, and scored what a fresh encode scores.
  seed0 = out / "runs" / "inbatch" / "8steps_lr0.003_seed0"
  assert "corpus vectors of this document side read from" in (seed0 / "score.log").read_text()
  model, params, tokenizer, _ = build_lib.load_jdr_model(seed0)
  fresh = types.SimpleNamespace(plan=rows_lib.tiny_plan(), dataset=split, zero_shot=None,
                                vector_cache=tmp_path / "empty-cache")
  rescored = runs_lib.score_model(fresh, model, params, tokenizer, compressed=False)
  assert rescored["test"] == json.loads((seed0 / "test.json").read_text())["test"]

  # A second call trains and scores nothing...
  def refuse(*args, **kwargs):
    raise AssertionError("a finished run was run again")
  with monkeypatch.context() as m:
    m.setattr(trainer, "train_and_evaluate", refuse)
    m.setattr(runs_lib, "score_model", refuse)
    command.main(argv)
  second = capsys.readouterr().out
  assert second.count("finished before, skipped") == 5 and "ETA" not in second
  assert (out / "table.md").read_text() == table
  # ...and a run that did not finish goes back to the trainer, which resumes from its checkpoint.
  seed1 = out / "runs" / "inbatch" / "8steps_lr0.003_seed1"
  (seed1 / "done.json").unlink()
  command.main(argv)
  assert "resumed from" in (seed1 / "train.log").read_text()
  assert json.loads((seed1 / "done.json").read_text())["steps"] == 8


@pytest.mark.long
def test_the_mined_rows_train_a_cross_encoder_then_mine_and_filter_on_dev(tmp_path, capsys):
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jdr.negatives import mining  # pylint: disable=g-import-not-at-top
  from jdr.reproduce import __main__ as command  # pylint: disable=g-import-not-at-top
  out = tmp_path / "repro"
  # The MarginMSE row alone: it prepares both mined directories, and trains on the mined source with the
  # teacher's scores (the filtered row's config differs only in the directory it reads: the test above).
  command.main(["scifact", "--out", str(out), "--tiny", "--methods", "margin_mse", "--seeds", "0",
                "--rates", "3e-3", "--zero-shot", "none"])
  printed = capsys.readouterr().out
  assert "train the cross-encoder (4 steps)" in printed and "mine BM25's top 20" in printed
  teacher = json.loads((runs_lib.teacher_dir(out) / "done.json").read_text())
  assert teacher["steps"] == 4 and "ndcg@10" in teacher["dev"]
  split = out / "data" / "stdlib-docstrings-dev"
  everything = mining.read(rows_lib.mined_dir(split.parent, "margin_mse"))
  filtered = mining.read(rows_lib.mined_dir(split.parent, "bm25_neg_ce"))
  report = everything.meta["report"]
  assert report["dev"]["split"] == "dev" and everything.teacher is not None
  threshold = filtered.meta["report"]["chosen_on_dev"]["ce_threshold"]
  assert threshold == mining.choose_on_dev(report["dev"], "ce_threshold")
  # The filtered pools are the unfiltered ones without the candidates the cross-encoder scores above it.
  assert filtered.qids == everything.qids
  for i in range(len(everything.qids)):
    alive = everything.rows[i] >= 0
    keep = alive & ~(everything.teacher[i] > threshold)
    got = filtered.rows[i][filtered.rows[i] >= 0]
    np.testing.assert_array_equal(got, everything.rows[i][keep])
  assert filtered.meta["report"]["training"]["dropped"]["ce_threshold"] > 0
  table = (out / "table.md").read_text()
  assert "## The mined rows' cross-encoder and negatives" in table and "(chosen)" in table
  assert "| BM25 negatives + MarginMSE from the cross-encoder | 0.003 |" in table
  log = (out / "runs" / "margin_mse" / "8steps_lr0.003_seed0" / "train.log").read_text()
  assert "kd_margin_mse" in (out / "runs" / "margin_mse" / "8steps_lr0.003_seed0" / "metrics.jsonl").read_text(), log[-2000:]


def test_an_output_directory_keeps_its_plan(tmp_path):
  plan = rows_lib.tiny_plan()
  rows_lib.record_plan(plan, tmp_path)
  rows_lib.record_plan(dataclasses.replace(plan, rates=(1e-2,), seeds=(5,)), tmp_path)  # adds runs only
  with pytest.raises(ValueError, match="steps 8 -> 16"):
    rows_lib.record_plan(dataclasses.replace(plan, steps=16), tmp_path)


def _finals(**rows):
  """{row: final-run records} from {row: [(seed, {metric: value}), ...]}."""
  return {name: [{"seed": seed, "test": test} for seed, test in runs] for name, runs in rows.items()}


def test_claims_are_judged_on_gains_paired_by_seed():
  from jdr.reproduce import claims  # pylint: disable=g-import-not-at-top
  star = claims.CLAIMS[0]
  assert (star.row, star.baseline) == ("star", "bm25_neg")
  # Paired gains 0.02, 0.03, 0.04: mean 0.03 > std 0.01.
  finals = _finals(star=[(0, {"ndcg@10": 0.72}), (1, {"ndcg@10": 0.70}), (2, {"ndcg@10": 0.75})],
                   bm25_neg=[(0, {"ndcg@10": 0.70}), (1, {"ndcg@10": 0.67}), (2, {"ndcg@10": 0.71}),
                             (3, {"ndcg@10": 0.10})])  # a seed the other row lacks is not paired
  v = claims.judge(star, finals, "PQ")
  assert v.seeds == (0, 1, 2) and v.gain == pytest.approx(0.03) and v.spread == pytest.approx(0.01)
  assert v.holds and "**holds** (ndcg@10 +0.0300 ± 0.0100" in v.line()
  # A gain inside its spread does not hold; nor does a loss.
  finals["star"][2]["test"]["ndcg@10"] = 0.66  # gains 0.02, 0.03, -0.05
  assert claims.judge(star, finals, "PQ").holds is False
  # "At least": a small loss inside the spread still holds, a clear one does not.
  at_least = next(c for c in claims.CLAIMS if c.at_least)
  near = _finals(adore_star=[(0, {"ndcg@10": 0.80}), (1, {"ndcg@10": 0.81})],
                 adore=[(0, {"ndcg@10": 0.81}), (1, {"ndcg@10": 0.80})])
  assert claims.judge(at_least, near, "PQ").holds is True
  worse = _finals(adore_star=[(0, {"ndcg@10": 0.70}), (1, {"ndcg@10": 0.71})],
                  adore=[(0, {"ndcg@10": 0.81}), (1, {"ndcg@10": 0.80})])
  assert claims.judge(at_least, worse, "PQ").holds is False
  # The compressed-index claim reads the metric on the plan's index; a missing row or one seed is no verdict.
  pq = next(c for c in claims.CLAIMS if "compressed" in c.metric)
  one = _finals(ltre_pq=[(0, {"PQ/ndcg@10": 0.8})], adore_ranknet=[(0, {"PQ/ndcg@10": 0.7, "ndcg@10": 0.9})])
  v = claims.judge(pq, one, "PQ")
  assert v.metric == "PQ/ndcg@10" and v.holds is None and "one seed" in v.line()
  assert "not yet scored" in claims.judge(pq, {}, "PQ").line()
  assert len(claims.judge_all({}, "PQ")) == len(claims.CLAIMS) == 9


@pytest.mark.slow
def test_a_signal_in_a_run_ends_the_table_with_one_resume_line(tmp_path, monkeypatch, capsys):
  """SIGTERM in a run: the trainer saved its step; the table says where, and that the same command resumes
  it, with the signal's status and no traceback. Ctrl-C while scoring: one line, status 130."""
  from jdr.training import preemption  # pylint: disable=g-import-not-at-top
  from jdr.reproduce import __main__ as command  # pylint: disable=g-import-not-at-top
  argv = ["scifact", "--out", str(tmp_path / "repro"), "--tiny", "--methods", "inbatch", "--seeds", "0"]
  workdir = tmp_path / "repro" / "runs" / "inbatch" / "w"

  def stopped(*args, **kwargs):
    raise preemption.Stopped(15, 3, workdir)

  def exits(status):
    raise SystemExit(status)
  monkeypatch.setattr(runs_lib, "run_table", stopped)
  monkeypatch.setattr(preemption.os, "_exit", exits)
  with pytest.raises(SystemExit) as ended:
    command.main(argv)
  err = capsys.readouterr().err
  assert ended.value.code == 143 and "Traceback" not in err
  assert f"after step 3; its checkpoint is in {workdir}/checkpoints; resume with: python -m jdr.reproduce " \
         f"scifact --out {tmp_path / 'repro'} --tiny" in err

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt
  monkeypatch.setattr(runs_lib, "run_table", interrupted)
  with pytest.raises(SystemExit) as ended:
    command.main(argv)
  assert ended.value.code == 130 and "the same command goes on" in capsys.readouterr().err


def test_the_eta_prices_only_unfinished_runs_by_their_kind(tmp_path):
  """Runs finished in an earlier sitting cost nothing wherever they come in the order (the ADORE rows come
  after STAR and ANCE); query-only steps are priced apart from two-tower steps, and ANCE's (with their corpus
  re-encodings) by their own rate, named apart until measured."""
  plan = rows_lib.Plan()
  jobs = runs_lib.planned_jobs(plan, [r for r in rows_lib.row_names(plan) if r not in rows_lib.MINED], [0, 1, 2])
  out = tmp_path / "repro"
  for name in ("inbatch/208steps_lr2e-05_seed0", "inbatch/208steps_lr0.0001_seed1", "adore/208steps_lr2e-05_seed0",
               "star/104steps_lr5e-05_seed0_after_bm25_neg104lr2e-05"):
    (out / "runs" / name).mkdir(parents=True)
    (out / "runs" / name / "done.json").write_text("{}")
  (out / "runs" / "inbatch" / "208steps_lr0.0001_seed1" / "test.json").write_text("{}")
  (out / "choices.json").write_text(json.dumps({"inbatch": {"rate": 1e-4}}))
  finished = runs_lib.finished_jobs(out, plan, jobs)
  # The STAR run's warm-up rate is not chosen: it cannot have been this one.
  assert finished == {("train", (("inbatch", 208, 2e-5),), 0), ("train", (("adore", 208, 2e-5),), 0),
                      ("train", (("inbatch", 208, ("chosen", "inbatch")),), 1), ("score", "inbatch", 1)}
  progress = runs_lib.Progress(jobs, write=lambda line: None, finished=finished)
  two_tower = sum(s for k, s in jobs.items() if runs_lib.job_kind(k) == "two-tower step") - 2 * 208
  query_only = sum(s for k, s in jobs.items() if runs_lib.job_kind(k) == "query-only step") - 208
  ance = sum(s for k, s in jobs.items() if runs_lib.job_kind(k) == "ANCE step")
  assert ance == 5 * 104  # its rate grid and two more seeds, each after its warm-up
  assert dict(progress.left) == {"two-tower step": two_tower, "query-only step": query_only, "ANCE step": ance,
                                 "score": 28 - 1}
  assert progress.eta() == "ETA after the first run"
  progress.end("two-tower step", 100, 1000.0)  # 10 s a step; query-only steps not timed: at most that
  left = runs_lib.duration(10 * (two_tower - 100 + query_only))
  assert progress.eta() == f"ETA {left} + {ance} ANCE steps (not timed yet) + 27 scorings (not timed yet)"
  progress.end("query-only step", 100, 100.0)
  progress.end("score", 1, 60.0)
  left = 10 * (two_tower - 100) + query_only - 100 + 26 * 60
  assert progress.eta() == f"ETA {runs_lib.duration(left)} + {ance} ANCE steps (not timed yet)"
  progress.end("ANCE step", 104, 2080.0)
  assert progress.eta() == f"ETA {runs_lib.duration(left + 20 * (ance - 104))}"


def test_a_resumed_run_prices_the_eta_by_the_steps_it_ran(tmp_path, monkeypatch):
  """A run resumed from a checkpoint ran only the steps after it in this sitting: the ETA divides its seconds by
  those, not by the run's whole length (which would make the rest look several times faster)."""
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  plan = rows_lib.tiny_plan()
  first = runs_lib.StageRun((("bm25_neg", 8, 1e-3),), 0)
  second = runs_lib.StageRun((("bm25_neg", 8, 3e-3),), 0)
  out = tmp_path / "repro"
  (out / "runs" / first.name / "checkpoints" / "6").mkdir(parents=True)  # an earlier sitting stopped at step 6
  clock = iter([0.0, 20.0])  # the sitting's 2 steps take 20 s

  def fake_train(config, workdir):
    (pathlib.Path(workdir) / "checkpoints" / str(config.num_train_steps)).mkdir(parents=True, exist_ok=True)
    return {"after": {"ndcg@10": 0.8}}

  monkeypatch.setattr(trainer, "train_and_evaluate", fake_train)
  monkeypatch.setattr(runs_lib, "release", lambda: None)
  monkeypatch.setattr(runs_lib, "time", types.SimpleNamespace(perf_counter=lambda: next(clock)))
  jobs = {("train", first.chain, 0): 8, ("train", second.chain, 0): 8}
  lines = []
  progress = runs_lib.Progress(jobs, write=lines.append)
  ctx = runs_lib.Context(plan=plan, out=out, dataset=tmp_path / "data", zero_shot=None, progress=progress)
  runs_lib.train(ctx, first)
  assert progress.eta() == f"ETA {runs_lib.duration(8 * 10.0)}"  # 10 s a step, not 20 s / 8 steps

  progress.end("two-tower step", 8, 5.0, resumed_at=8)  # a run stopped after its last step: no step timed
  assert progress.eta() == "ETA 0m00s"
  assert progress.units["two-tower step"] == 2


def test_given_warm_up_rates_train_no_grid_and_are_marked(tmp_path, monkeypatch):
  """A row rebuilt on its own takes its warm-ups' rates as given: only its own grid and seeds are trained,
  choices.json and the dev-grid table say the rates were given, a selected row given its rate trains its
  seeds only, and a rate this directory chose on dev is not overridden by a different given one."""
  plan = rows_lib.Plan()
  given = {"bm25_neg": 1e-4, "star": 5e-5}
  jobs = runs_lib.planned_jobs(plan, ["adore_star"], [0, 1, 2], given)
  trains = [k for k in jobs if k[0] == "train"]
  assert len(trains) == 2 + 3 + 2 * 3  # seed 0's warm-ups once, the grid of 3, two seeds' chains
  assert {k[1][-1][0] for k in trains} == {"bm25_neg", "star", "adore_star"}
  assert sum(jobs[k] for k in trains) == 3 * (52 + 52) + 5 * 104

  out = tmp_path / "repro"
  runs_lib.record_given_rates(out, given, ["adore_star"])
  choices = json.loads((out / "choices.json").read_text())
  assert choices["star"] == {"rate": 5e-5, "given": True, "dev_ndcg@10": {}}

  trained = []
  monkeypatch.setattr(runs_lib, "score_start", lambda ctx: {})
  monkeypatch.setattr(runs_lib, "score", lambda ctx, run: {})
  monkeypatch.setattr(runs_lib, "train", lambda ctx, run: trained.append(run) or {"dev": {"ndcg@10": run.rate}})
  ctx = types.SimpleNamespace(plan=plan, out=out)
  grid = runs_lib.run_table(ctx, ["adore_star"], [0, 1])
  assert {run.method for run in trained} == {"adore_star"}  # no BM25 or STAR grid
  assert [run.chain[:-1] for run in trained][0] == (("bm25_neg", 52, 1e-4), ("star", 52, 5e-5))
  assert grid["adore_star"]["rate"] == 1e-4 and grid["star"]["given"]
  from jdr.reproduce import report  # pylint: disable=g-import-not-at-top
  assert "| STAR (BM25-neg warm-up) | — | — | — | 5e-05 (given) |" in report.table_markdown(plan, out)

  # A selected row given its rate: its three seeds at that rate, no grid; seed 0's dev figure is the table's.
  assert [k for k in runs_lib.planned_jobs(plan, ["bm25_neg"], [0, 1, 2], {"bm25_neg": 1e-4}) if k[0] == "train"] \
      == [("train", (("bm25_neg", 208, ("chosen", "bm25_neg")),), s) for s in (0, 1, 2)]
  trained.clear()
  grid = runs_lib.run_table(ctx, ["bm25_neg"], [0, 1, 2])
  assert [(run.method, run.rate, run.seed) for run in trained] == [("bm25_neg", 1e-4, s) for s in (0, 1, 2)]
  assert grid["bm25_neg"] == {"rate": 1e-4, "given": True, "dev_ndcg@10": {"0.0001": 1e-4}}

  (out / "choices.json").write_text(json.dumps({"star": {"rate": 2e-5, "dev_ndcg@10": {"2e-05": 0.7}}}))
  with pytest.raises(ValueError, match="chosen on dev here as 2e-05, not 5e-05"):
    runs_lib.record_given_rates(out, given, ["adore_star"])


def test_run_records_round_trip_through_runs_csv_and_imported_warm_ups_are_retrained(tmp_path, monkeypatch):
  """A runs.csv restores the done.json / test.json it was written from (another output directory, such as a
  fresh checkout's, takes its runs as finished); a warm-up imported without its weights is trained again when
  a new stage starts from it; a malformed line is refused by file, line and run."""
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.reproduce import report  # pylint: disable=g-import-not-at-top
  plan = rows_lib.tiny_plan()
  bm25 = runs_lib.StageRun((("bm25_neg", 4, 1e-3),), 0)
  star = runs_lib.StageRun(bm25.chain + (("star", 4, 3e-3),), 0)
  first = tmp_path / "first"
  records = {
      "start/test.json": {"dev": {"ndcg@10": 0.5}, "test": {"ndcg@10": 0.4, "mrr@10": 0.3},
                          "zero_shot": {"recall@1": 0.2}, "score_seconds": 1.5},
      f"{bm25.name}/done.json": {"run": bm25.name, "method": "bm25_neg", "steps": 4, "batch_size": 8, "rate": 1e-3,
                                 "seed": 0, "after": "", "parent": "", "dev": {"ndcg@10": 0.6},
                                 "dev_curve": [[0, 0.5], [4, 0.6]], "seconds": 3.0},
      f"{star.name}/done.json": {"run": star.name, "method": "star", "steps": 4, "batch_size": 8, "rate": 3e-3,
                                 "seed": 0, "after": "bm25_neg 4 steps lr 0.001", "parent": bm25.name,
                                 "dev": {"ndcg@10": 0.7, "mrr@10": 0.65}, "dev_curve": [[4, 0.7]], "seconds": 4.0},
      f"{star.name}/test.json": {"test": {"ndcg@10": 0.66, "OPQ/ndcg@10": 0.61}, "zero_shot": {"ndcg@10": 0.5},
                                 "score_seconds": 2.0},
  }
  for name, record in records.items():
    (first / "runs" / name).parent.mkdir(parents=True, exist_ok=True)
    (first / "runs" / name).write_text(json.dumps(record))
  csv_path = report.write_csv(first)
  second = tmp_path / "second"
  assert report.import_records(csv_path, second) == 4
  for name, record in records.items():
    restored = json.loads((second / "runs" / name).read_text())
    assert restored.pop("imported", False) == name.endswith("done.json")
    assert restored == record
  assert report.import_records(csv_path, second) == 0  # what is there is kept

  bad = tmp_path / "bad.csv"
  bad.write_text(csv_path.read_text().replace(",4,8,", ",four,8,", 1))
  with pytest.raises(ValueError, match=rf"bad.csv:3: run '{bm25.name}'"):
    report.import_records(bad, tmp_path / "third")

  trained = []

  def fake_train(config, workdir):
    trained.append(pathlib.Path(workdir).relative_to(out / "runs").as_posix())
    (pathlib.Path(workdir) / "checkpoints" / str(config.num_train_steps)).mkdir(parents=True, exist_ok=True)
    return {"after": {"ndcg@10": 0.8}}

  out = second
  monkeypatch.setattr(trainer, "train_and_evaluate", fake_train)
  monkeypatch.setattr(runs_lib, "release", lambda: None)
  lines = []
  progress = runs_lib.Progress({("train", star.chain, 0): 4}, write=lines.append,
                               finished={("train", star.chain, 0)})
  ctx = runs_lib.Context(plan=plan, out=second, dataset=tmp_path / "data", zero_shot=None, progress=progress)
  runs_lib.train(ctx, star)  # finished (imported): nothing trains
  assert trained == []
  adore_star = runs_lib.StageRun(star.chain + (("adore_star", 4, 1e-3),), 0)
  runs_lib.train(ctx, adore_star)
  assert trained == [bm25.name, star.name, adore_star.name]
  assert not json.loads((second / "runs" / star.name / "done.json").read_text()).get("imported")
  assert not (second / "runs" / star.name / "test.json").exists()  # scored again if it is a final run

  # A retraining of an imported warm-up that was stopped early leaves a checkpoint before its last step; the
  # next build imports its record again, and the warm-up is still trained before a stage starts from it.
  out = tmp_path / "fourth"
  report.import_records(csv_path, out)
  (out / "runs" / bm25.name / "checkpoints" / "2").mkdir(parents=True)
  trained.clear()
  ctx = runs_lib.Context(plan=plan, out=out, dataset=tmp_path / "data", zero_shot=None, progress=progress)
  ance = runs_lib.StageRun(bm25.chain + (("ance", 4, 1e-3),), 0)
  runs_lib.train(ctx, ance)
  assert trained == [bm25.name, ance.name]
  trained.clear()
  (out / "runs" / ance.name / "done.json").unlink()
  runs_lib.train(ctx, ance)  # the warm-up has its last step now
  assert trained == [ance.name]
