"""FGD's experiments (Zhou et al.) in miniature on long-document SciFact, row by row, through the public commands.

  python -m jdr.bench fgd-ablation --out runs/fgd [--rows contrastive,document_kd,fgd,...] [--seeds 0,1,2]
      [--single-seed-rows no_passage,no_sentence,fg_pooling,fgd_document_kd] [--steps 120] [--jobs 1]
      [--backend faiss|jax] [--source ../shared/data/scifact] [--teacher-steps 120] [--extras-row fgd]
      [--set model.encode_chunk_rows=4 ...]
  python -m jdr.bench fgd-ablation --out runs/fgd --table

Steps, each skipped when its output exists (so the driver resumes):
  data       `python -m jdr.data.longdocs --source ../shared/data/scifact --out OUT/scifact-long`
  teacher    (beside the warm-ups) configs/cross_encoder.py:runlocal trained on SciFact (abstract level),
             OUT/teacher; then the MiniLM first stage on SciFact test (`jdr.encode` + `jdr.retrieve`, 256
             tokens) reranked by it with `jdr.rerank` at depths 10, 30 and 100: nDCG@10 and ms/query of each
             (docs/results.md, "The cross-encoder teacher, reranking")
  warmup_S   stage 1 (configs/fgd.py:runlocal,warmup) with seed S on long-document SciFact
  ROW_S      stage 2 from warmup_S with the row's overrides (contrastive only, document-level KD, FGD, FGD
             without passage / sentence, FG pooling, FGD + document KD); its final evaluation (MRR@100,
             nDCG@10, R@100 on the test queries, FirstP at 512 tokens)
  fgd_S extras   for the first seed's FGD workdir (--extras-row: another row's): MaxP (`jdr.encode --passages
             4`) against FirstP, and the Eq. 16 ensemble (`jdr.encode --pieces passage:128,sentence:64`,
             `jdr.retrieve --ensemble-gamma G`) for G in 0, 0.1, 0.3, 1
`--table` prints every finished row: the mean over seeds and ± half their range ((max - min) / 2).

`--jobs N` runs up to N stages at once (a seed's rows wait for its warm-up), each with its own log
(OUT/NAME.log): on an accelerator, where a stage is mostly process start-up and compilation, this is what
makes the whole ablation fit a short time on the device. `--backend jax` retrieves with jdr's exact JAX top-k instead of
Faiss (the same ranking, and no Faiss needed). `out/device.json` records where the rows ran.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import pathlib
import subprocess
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


def long_documents(out: pathlib.Path, scifact: pathlib.Path) -> None:
  long_dir = out / "scifact-long"
  if not (long_dir / "stats.json").exists():
    _run([sys.executable, "-m", "jdr.data.longdocs", "--source", str(scifact), "--out", str(long_dir)],
         out / "log.txt")


def train_teacher(out: pathlib.Path, scifact: pathlib.Path, teacher_steps: int | None) -> None:
  teacher = out / "teacher"
  if (teacher / "done.json").exists():
    return
  steps = [] if teacher_steps is None else [f"--config.num_train_steps={teacher_steps}",
                                            f"--config.optimizer.warmup_steps={teacher_steps // 10}",
                                            f"--config.checkpoint_every={max(teacher_steps // 2, 1)}"]
  _run([sys.executable, "-m", "jdr.train", "--config", "configs/cross_encoder.py:runlocal", "--workdir",
        str(teacher), f"--config.data.dataset={scifact}", "--config.data.eval_split=", *steps], out / "teacher.log")
  (teacher / "done.json").write_text("{}\n")


def teacher_and_rerank(out: pathlib.Path, scifact: pathlib.Path, backend: str, teacher_steps: int | None) -> dict:
  py = sys.executable
  log = out / "rerank.log"
  result_path = out / "teacher.json"
  if result_path.exists():
    return json.loads(result_path.read_text())
  teacher = out / "teacher"
  train_teacher(out, scifact, teacher_steps)
  first = out / "minilm-256"
  _run([py, "-m", "jdr.encode", "--model", "minilm", "--corpus", str(scifact), "--out", str(first),
        "--max-length", "256"], log)
  run = out / "minilm.trec"
  _run([py, "-m", "jdr.retrieve", "--index", str(first), "--queries", str(scifact), "--split", "test",
        "--run", str(run), "--top-k", "100", "--backend", backend], log)
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


def _stage(py, out: pathlib.Path, workdir: pathlib.Path, arg: str, seed: int, steps: int, extra: list[str],
           backend: str = "faiss") -> dict:
  log = out / f"{workdir.name}.log"
  if not (workdir / "done.json").exists():
    _run([py, "-m", "jdr.train", "--config", f"configs/fgd.py:{arg}", "--workdir", str(workdir),
          f"--config.data.dataset={out / 'scifact-long'}", f"--config.seed={seed}",
          f"--config.num_train_steps={steps}", f"--config.optimizer.warmup_steps={steps // 10}",
          f"--config.distill.teacher={out / 'teacher'}" if "warmup" not in arg else "--config.distill.teacher=",
          "--config.eval_before_training=False", f"--config.negatives.retrieval_backend={backend}",
          f"--config.eval.backend={backend}", *extra], log)
    (workdir / "done.json").write_text(json.dumps(_final_eval(workdir)) + "\n")
  return json.loads((workdir / "done.json").read_text())


def long_doc_extras(py, out: pathlib.Path, workdir: pathlib.Path, backend: str) -> dict:
  """MaxP vs FirstP and the Eq. 16 gamma sweep for one trained model."""
  path = workdir / "extras.json"
  if path.exists():
    return json.loads(path.read_text())
  log, long_dir = out / f"{workdir.name}.log", out / "scifact-long"
  qrels = long_dir / "qrels" / "test.tsv"
  result = {}
  for name, flags in (("firstp", ["--pieces", "passage:128,sentence:64"]), ("maxp", ["--passages", "4"])):
    enc = workdir / f"enc-{name}"
    _run([py, "-m", "jdr.encode", "--model", str(workdir), "--corpus", str(long_dir), "--out", str(enc),
          "--max-length", "512", *flags], log)
    run = workdir / f"{name}.trec"
    _run([py, "-m", "jdr.retrieve", "--index", str(enc), "--queries", str(long_dir), "--split", "test", "--run",
          str(run), "--top-k", "100", "--backend", backend], log)
    result[name] = _evaluate_run(py, qrels, run, log)
  for gamma in GAMMAS:
    run = workdir / f"ensemble-{gamma}.trec"
    _run([py, "-m", "jdr.retrieve", "--index", str(workdir / "enc-firstp"), "--queries", str(long_dir), "--split",
          "test", "--run", str(run), "--top-k", "100", "--ensemble-gamma", str(gamma), "--backend", backend], log)
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


def _device(out: pathlib.Path) -> None:
  """Records where the rows ran (the figures of a GPU run and of a CPU run are not comparable)."""
  path = out / "device.json"
  if not path.exists():
    probe = "import jax, json; d = jax.devices()[0]; print(json.dumps({'platform': d.platform, " \
            "'device_kind': d.device_kind, 'count': jax.device_count(), 'jax': jax.__version__}))"
    path.write_text(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                   check=True).stdout)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench fgd-ablation", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True)
  parser.add_argument("--rows", default="contrastive,document_kd,fgd")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--single-seed-rows", default="no_passage,no_sentence,fg_pooling,fgd_document_kd")
  parser.add_argument("--steps", type=int, default=120, help="training steps of each stage")
  parser.add_argument("--teacher-steps", type=int, default=None, help="default: configs/cross_encoder.py's")
  parser.add_argument("--source", default=None, help="the SciFact BEIR directory (default ../shared/data/scifact)")
  parser.add_argument("--backend", choices=["faiss", "jax"], default="faiss", help="jdr.retrieve's back-end")
  parser.add_argument("--jobs", type=int, default=1, help="stages run at once")
  parser.add_argument("--extras-row", default="fgd", choices=sorted(ROWS),
                      help="the row whose first-seed model gets MaxP vs FirstP and the Eq. 16 gamma sweep")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="a config override for every training stage, e.g. model.encode_chunk_rows=4 (CPU)")
  parser.add_argument("--table", action="store_true")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  if args.table:
    print(table(out))
    return
  seeds = [int(s) for s in args.seeds.split(",")]
  plan = [(row, s) for s in seeds for row in args.rows.split(",") if row]
  plan += [(row, seeds[0]) for row in args.single_seed_rows.split(",") if row]
  for row, _ in plan:
    if row not in ROWS:
      parser.error(f"unknown row {row!r}; choose from {sorted(ROWS)}")
  if args.extras_row not in [row for row, _ in plan]:
    parser.error(f"--extras-row {args.extras_row} is not among the rows this run trains")
  if args.extras_row == "fg_pooling":
    parser.error("--extras-row fg_pooling: its pieces are mean-pooled, and jdr.encode --pieces stores Eq. 7's")
  for item in args.set:
    if "=" not in item:
      parser.error(f"--set {item!r}: expected KEY=VALUE")
  overrides = [f"--config.{item}" for item in args.set]
  out.mkdir(parents=True, exist_ok=True)
  _device(out)
  py = sys.executable
  scifact = pathlib.Path(args.source) if args.source else _shared("scifact")
  long_documents(out, scifact)

  def teacher():
    train_teacher(out, scifact, args.teacher_steps)

  def rerank():
    result = teacher_and_rerank(out, scifact, args.backend, args.teacher_steps)
    print(f"teacher: {json.dumps(result)}", file=sys.stderr, flush=True)

  def warmup(seed):
    return _stage(py, out, out / f"warmup_s{seed}", "runlocal,warmup", seed, args.steps, overrides, args.backend)

  def row_stage(row, seed, warm, taught):
    warm.result()
    taught.result()
    extra = ROWS[row] + [f"--config.model.init_from={out / f'warmup_s{seed}'}"] + overrides
    result = _stage(py, out, out / f"{row}_s{seed}", "runlocal", seed, args.steps, extra, args.backend)
    print(f"{row}_s{seed}: {json.dumps(result)}", file=sys.stderr, flush=True)
    if row == args.extras_row and seed == seeds[0]:  # MaxP and the Eq. 16 sweep on one model
      print(json.dumps(long_doc_extras(py, out, out / f"{row}_s{seed}", args.backend)), file=sys.stderr, flush=True)

  # The teacher (and its reranking figures) and the warm-ups need nothing of each other; they are queued
  # first, so a row blocked on them never holds the last free worker.
  with concurrent.futures.ThreadPoolExecutor(max(args.jobs, 1)) as pool:
    taught = pool.submit(teacher)
    reranked = pool.submit(lambda: (taught.result(), rerank()))  # the teacher's own figures, beside the rows
    warm = {s: pool.submit(warmup, s) for s in dict.fromkeys(s for _, s in plan)}
    rows = {"rerank": reranked}
    rows.update({f"{row}_s{seed}": pool.submit(row_stage, row, seed, warm[seed], taught) for row, seed in plan})
    failed = {}
    for name, f in rows.items():
      try:
        f.result()
      except Exception as e:  # pylint: disable=broad-except  (one failed row must not hide the others)
        failed[name] = e
        print(f"{name} failed: {e}", file=sys.stderr, flush=True)
  print(table(out))
  if failed:
    raise SystemExit(f"rows failed: {sorted(failed)}")


if __name__ == "__main__":
  main()
