"""FGD's experiments (Zhou et al.) in miniature on long-document SciFact, row by row, through the public commands.

  python -m jdr.bench fgd-ablation --out runs/fgd [--rows contrastive,document_kd,fgd,...] [--seeds 0,1,2]
      [--single-seed-rows no_passage,no_sentence,fg_pooling,fgd_document_kd] [--steps 120]
  python -m jdr.bench fgd-ablation --out runs/fgd --table

Steps, each skipped when its output exists (so the driver resumes):
  data       `python -m jdr.data.longdocs --source ../shared/data/scifact --out OUT/scifact-long`
  teacher    configs/cross_encoder.py:runlocal trained on SciFact (abstract level), OUT/teacher; then the
             MiniLM first stage on SciFact test (`jdr.encode` + `jdr.retrieve`, 256 tokens) reranked by it with
             `jdr.rerank` at depths 10, 30 and 100: nDCG@10 and ms/query of each (the issue's item 2)
  warmup_S   stage 1 (configs/fgd.py:runlocal,warmup) with seed S on long-document SciFact
  ROW_S      stage 2 from warmup_S with the row's overrides (contrastive only, document-level KD, FGD, FGD
             without passage / sentence, FG pooling, FGD + document KD); its final evaluation (MRR@100,
             nDCG@10, R@100 on the test queries, FirstP at 512 tokens)
  fgd_S extras   for each FGD workdir: MaxP (`jdr.encode --passages 4`) against FirstP, and the Eq. 16
             ensemble (`jdr.encode --pieces passage:128,sentence:64`, `jdr.retrieve --ensemble-gamma G`) for
             G in 0, 0.1, 0.3, 1
`--table` prints every finished row, the mean and spread (max - min) over seeds.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

from jdr.bench.pretrain_ablation import _final_eval, _run, _shared

ROWS = {
    "contrastive": ["--config.distill.teacher="],
    "document_kd": ["--config.distill.granularities=", "--config.distill.document=True"],
    "fgd": [],
    "no_passage": ["--config.distill.granularities=sentence"],
    "no_sentence": ["--config.distill.granularities=passage"],
    "fg_pooling": ["--config.distill.pooling=mean"],
    "fgd_document_kd": ["--config.distill.document=True"],
}
METRICS = "mrr@100,ndcg@10,recall@100"
GAMMAS = (0.0, 0.1, 0.3, 1.0)


def _evaluate_run(py, qrels: pathlib.Path, run: pathlib.Path, log: pathlib.Path) -> dict:
  return json.loads(_run([py, "-m", "jdr.evaluate", "--qrels", str(qrels), "--run", str(run), "--metrics", METRICS,
                          "--missing", "zero", "--json"], log))


def data_and_teacher(out: pathlib.Path, steps: int) -> dict:
  py = sys.executable
  log = out / "log.txt"
  scifact = _shared("scifact")
  long_dir = out / "scifact-long"
  if not (long_dir / "stats.json").exists():
    _run([py, "-m", "jdr.data.longdocs", "--source", str(scifact), "--out", str(long_dir)], log)
  result_path = out / "teacher.json"
  if result_path.exists():
    return json.loads(result_path.read_text())
  teacher = out / "teacher"
  _run([py, "-m", "jdr.train", "--config", "configs/cross_encoder.py:runlocal", "--workdir", str(teacher),
        f"--config.data.dataset={scifact}", "--config.data.eval_split="], log)
  first = out / "minilm-256"
  _run([py, "-m", "jdr.encode", "--model", "minilm", "--corpus", str(scifact), "--out", str(first),
        "--max-length", "256"], log)
  run = out / "minilm.trec"
  _run([py, "-m", "jdr.retrieve", "--index", str(first), "--queries", str(scifact), "--split", "test",
        "--run", str(run), "--top-k", "100"], log)
  qrels = scifact / "qrels" / "test.tsv"
  result = {"first_stage": _evaluate_run(py, qrels, run, log)}
  for depth in (10, 30, 100):
    reranked = out / f"reranked-{depth}.trec"
    with open(log, "a") as f:
      f.write(f"\n# rerank depth {depth}\n")
    before = log.stat().st_size
    _run([py, "-m", "jdr.rerank", "--model", str(teacher), "--queries", str(scifact), "--split", "test",
          "--corpus", str(scifact), "--run", str(run), "--depth", str(depth), "--out", str(reranked)], log)
    line = [l for l in log.read_text()[before:].splitlines() if l.startswith("reranked ")][-1]
    ms = float(line.split(": ")[1].split(" ms/query")[0])
    result[f"rerank@{depth}"] = {**_evaluate_run(py, qrels, reranked, log), "ms_per_query": ms}
  result_path.write_text(json.dumps(result, indent=1) + "\n")
  return result


def _stage(py, out: pathlib.Path, workdir: pathlib.Path, arg: str, seed: int, steps: int, extra: list[str]) -> dict:
  if not (workdir / "done.json").exists():
    _run([py, "-m", "jdr.train", "--config", f"configs/fgd.py:{arg}", "--workdir", str(workdir),
          f"--config.data.dataset={out / 'scifact-long'}", f"--config.seed={seed}",
          f"--config.num_train_steps={steps}", f"--config.optimizer.warmup_steps={steps // 10}",
          f"--config.distill.teacher={out / 'teacher'}" if "warmup" not in arg else "--config.distill.teacher=",
          "--config.eval_before_training=False", *extra], out / "log.txt")
    (workdir / "done.json").write_text(json.dumps(_final_eval(workdir)) + "\n")
  return json.loads((workdir / "done.json").read_text())


def long_doc_extras(py, out: pathlib.Path, workdir: pathlib.Path) -> dict:
  """MaxP vs FirstP and the Eq. 16 gamma sweep for one trained model."""
  path = workdir / "extras.json"
  if path.exists():
    return json.loads(path.read_text())
  log, long_dir = out / "log.txt", out / "scifact-long"
  qrels = long_dir / "qrels" / "test.tsv"
  result = {}
  for name, flags in (("firstp", ["--pieces", "passage:128,sentence:64"]), ("maxp", ["--passages", "4"])):
    enc = workdir / f"enc-{name}"
    _run([py, "-m", "jdr.encode", "--model", str(workdir), "--corpus", str(long_dir), "--out", str(enc),
          "--max-length", "512", *flags], log)
    run = workdir / f"{name}.trec"
    _run([py, "-m", "jdr.retrieve", "--index", str(enc), "--queries", str(long_dir), "--split", "test", "--run",
          str(run), "--top-k", "100"], log)
    result[name] = _evaluate_run(py, qrels, run, log)
  for gamma in GAMMAS:
    run = workdir / f"ensemble-{gamma}.trec"
    _run([py, "-m", "jdr.retrieve", "--index", str(workdir / "enc-firstp"), "--queries", str(long_dir), "--split",
          "test", "--run", str(run), "--top-k", "100", "--ensemble-gamma", str(gamma)], log)
    result[f"ensemble_gamma_{gamma}"] = _evaluate_run(py, qrels, run, log)
  path.write_text(json.dumps(result, indent=1) + "\n")
  return result


def table(out: pathlib.Path) -> str:
  lines = []
  teacher = out / "teacher.json"
  if teacher.exists():
    t = json.loads(teacher.read_text())
    lines += ["| SciFact test, MiniLM top-100 | nDCG@10 | MRR@100 | ms/query |", "|---|---|---|---|"]
    for key in ("first_stage", "rerank@10", "rerank@30", "rerank@100"):
      if key in t:
        lines.append(f"| {key} | {t[key]['ndcg@10']:.4f} | {t[key]['mrr@100']:.4f} | "
                     f"{t[key].get('ms_per_query', float('nan')):.1f} |")
    lines.append("")
  lines += ["| row | seeds | MRR@100 | nDCG@10 | R@100 |", "|---|---|---|---|---|"]
  for row in ROWS:
    found = sorted(out.glob(f"{row}_s*/done.json"))
    if not found:
      continue
    values = [json.loads(p.read_text()) for p in found]
    seeds = ",".join(p.parent.name.rsplit("_s", 1)[1] for p in found)
    cells = []
    for metric in ("mrr@100", "ndcg@10", "recall@100"):
      v = np.array([r[metric] for r in values])
      cells.append(f"{v.mean():.4f}" + (f" ±{(v.max() - v.min()) / 2:.4f}" if len(v) > 1 else ""))
    lines.append(f"| {row} | {seeds} | " + " | ".join(cells) + " |")
  for extras in sorted(out.glob("*_s*/extras.json")):
    e = json.loads(extras.read_text())
    lines.append(f"\n{extras.parent.name}: " + ", ".join(f"{k} nDCG@10 {v['ndcg@10']:.4f}" for k, v in e.items()))
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench fgd-ablation", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True)
  parser.add_argument("--rows", default="contrastive,document_kd,fgd")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--single-seed-rows", default="no_passage,no_sentence,fg_pooling,fgd_document_kd")
  parser.add_argument("--steps", type=int, default=120, help="training steps of each stage")
  parser.add_argument("--table", action="store_true")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  if args.table:
    print(table(out))
    return
  out.mkdir(parents=True, exist_ok=True)
  py = sys.executable
  print(json.dumps(data_and_teacher(out, args.steps)), file=sys.stderr, flush=True)
  seeds = [int(s) for s in args.seeds.split(",")]
  plan = [(row, s) for s in seeds for row in args.rows.split(",") if row]
  plan += [(row, seeds[0]) for row in args.single_seed_rows.split(",") if row]
  for row, seed in plan:
    if row not in ROWS:
      parser.error(f"unknown row {row!r}; choose from {sorted(ROWS)}")
    _stage(py, out, out / f"warmup_s{seed}", "runlocal,warmup", seed, args.steps, [])
    extra = ROWS[row] + [f"--config.model.init_from={out / f'warmup_s{seed}'}"]
    result = _stage(py, out, out / f"{row}_s{seed}", "runlocal", seed, args.steps, extra)
    print(f"{row}_s{seed}: {json.dumps(result)}", file=sys.stderr, flush=True)
    if row == "fgd":
      print(json.dumps(long_doc_extras(py, out, out / f"{row}_s{seed}")), file=sys.stderr, flush=True)
  print(table(out))


if __name__ == "__main__":
  main()
