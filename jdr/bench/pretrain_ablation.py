"""The pretraining ablation of Chang et al. (ICLR 2020, Tables 3-5) in miniature, row by row.

  python -m jdr.bench pretrain-ablation --out runs/ablation [--rows none,mlm,ict,...] [--seeds 0,1]
      [--pretrain-steps 300]
  python -m jdr.bench pretrain-ablation --out runs/ablation --table

A row is one pretraining recipe run with `--pretrain-steps` steps of its runlocal batch (the same steps x batch
for every row), then, from its workdir:

  scifact-all   configs/finetune.py:runlocal on every SciFact training query (90 steps), test nDCG@10, R@100
                (documents at 128 tokens, the training length, to keep a row short);
  scifact-10%   the same on a fixed 10% of the training queries (data.train_fraction=0.1, 30 steps: about ten
                epochs of them);
  reqa          the pretrained towers zero-shot on reqa-squad-sample (question -> answer sentence, the
                document being "paragraph title [SEP] sentence"), Recall@1/5/10/100 as the paper's ReQA.

Rows: `none` (random weights: the recipe with 0 steps), `mlm`, `ict`, `bfs`, `wlp`, `ict_bfs_wlp`, `bow_mlp`
(the BoW-MLP tower on ICT+BFS+WLP) and `bm25` (bm25s, no training). Every step is a subprocess of the public
commands (jdr.train, jdr.encode, jdr.retrieve, jdr.evaluate), so a row is what a user would run; each writes
`result.json` into its directory and is skipped when that exists, so the driver resumes after an interruption.
`--table` prints the mean and the spread (max - min) over seeds of every metric, as markdown.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

import numpy as np

ROWS = ("none", "ict", "mlm", "bfs", "wlp", "ict_bfs_wlp", "bow_mlp", "bm25")
RECIPE = {"none": "pretrain_ict", "mlm": "pretrain_mlm", "ict": "pretrain_ict", "bfs": "pretrain_bfs",
          "wlp": "pretrain_wlp", "ict_bfs_wlp": "pretrain_ict_bfs_wlp", "bow_mlp": "pretrain_ict_bfs_wlp"}
FINETUNES = {"scifact_all": [], "scifact_10pct": ["--config.data.train_fraction=0.1",
                                                  "--config.num_train_steps=30",
                                                  "--config.optimizer.warmup_steps=3"]}
REQA_METRICS = "recall@1,recall@5,recall@10,recall@100"


def _run(cmd: list[str], log: pathlib.Path) -> str:
  """Runs one command, its stderr appended to `log`; returns its stdout; raises with the log's tail."""
  with open(log, "a") as err:
    err.write(f"\n$ {' '.join(cmd)}\n")
    err.flush()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, check=False)
  if done.returncode:
    tail = log.read_text().splitlines()[-15:]
    raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}; the end of {log}:\n" + "\n".join(tail))
  return done.stdout


def _final_eval(workdir: pathlib.Path) -> dict:
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line]
  evals = [r for r in records if any(k.startswith("eval/") for k in r)]
  if not evals:
    raise RuntimeError(f"{workdir / 'metrics.jsonl'}: no evaluation record")
  return {k[len("eval/"):]: v for k, v in evals[-1].items() if k.startswith("eval/")}


def _shared(name: str) -> pathlib.Path:
  from jdr.data import shared  # pylint: disable=g-import-not-at-top
  directory = shared.shared_dataset(name)
  if directory is None:
    raise FileNotFoundError(f"../shared/data/{name} is needed by the ablation and is absent")
  return directory


def _dense_row(row: str, seed: int, steps: int, out: pathlib.Path) -> dict:
  py = sys.executable
  log = out / "log.txt"
  pretrain = out / "pretrain"
  result: dict = {}
  started = time.time()
  cmd = [py, "-m", "jdr.train", "--config", f"configs/{RECIPE[row]}.py:runlocal", "--workdir", str(pretrain),
         f"--config.seed={seed}", f"--config.num_train_steps={0 if row == 'none' else steps}",
         f"--config.optimizer.warmup_steps={0 if row == 'none' else steps // 10}",
         f"--config.checkpoint_every={max(steps, 1)}"]
  if row == "bow_mlp":
    cmd.append("--config.model.tower=bow_mlp")
  _run(cmd, log)
  result["pretrain_seconds"] = round(time.time() - started, 1)
  for name, extra in FINETUNES.items():
    started = time.time()
    workdir = out / name
    _run([py, "-m", "jdr.train", "--config", "configs/finetune.py:runlocal", "--workdir", str(workdir),
          f"--config.model.init_from={pretrain}", f"--config.seed={seed}", "--config.eval_before_training=False",
          "--config.eval.diagnostic_queries=0", "--config.eval.doc_max_length=128", *extra], log)
    result[name] = _final_eval(workdir)
    result[f"{name}_seconds"] = round(time.time() - started, 1)
  reqa = _shared("reqa-squad-sample")
  encoded, run = out / "reqa_encoded", out / "reqa.trec"
  _run([py, "-m", "jdr.encode", "--model", str(pretrain), "--corpus", str(reqa), "--out", str(encoded),
        "--max-length", "128"], log)
  _run([py, "-m", "jdr.retrieve", "--model", str(pretrain), "--index", str(encoded), "--queries", str(reqa),
        "--split", "test", "--top-k", "100", "--run", str(run), "--max-length", "32"], log)
  result["reqa"] = json.loads(_run([py, "-m", "jdr.evaluate", "--qrels", str(reqa / "qrels" / "test.tsv"),
                                    "--run", str(run), "--metrics", REQA_METRICS, "--missing", "zero",
                                    "--json"], log))
  return result


def _bm25_row() -> dict:
  from jdr.evaluation import metrics  # pylint: disable=g-import-not-at-top
  from jdr.data import formats  # pylint: disable=g-import-not-at-top
  from jdr.negatives import sampled  # pylint: disable=g-import-not-at-top
  result = {}
  for key, name, wanted in (("scifact_all", "scifact", "ndcg@10,mrr@10,recall@100"),
                            ("reqa", "reqa-squad-sample", REQA_METRICS)):
    directory = _shared(name)
    corpus = formats.read_corpus(directory / "corpus.jsonl")
    queries = formats.read_queries(directory / "queries.jsonl")
    qrels = formats.read_qrels(directory / "qrels" / "test.tsv", doc_ids=corpus, query_ids=queries)
    run = sampled.bm25_run(corpus, queries, sorted(qrels), 100)
    result[key] = metrics.evaluate(qrels, run, wanted.split(","), missing="zero")
  result["scifact_10pct"] = result["scifact_all"]  # BM25 trains on nothing: the same row in both regimes
  return result


def run_rows(rows: list[str], seeds: list[int], steps: int, out: pathlib.Path) -> None:
  for seed in seeds:
    for row in rows:
      if row == "bm25" and seed != seeds[0]:
        continue  # deterministic: one run
      directory = out / (row if row == "bm25" else f"{row}_s{seed}")
      done = directory / "result.json"
      if done.exists():
        print(f"{directory.name}: done already", file=sys.stderr)
        continue
      directory.mkdir(parents=True, exist_ok=True)
      started = time.time()
      print(f"{directory.name}: running (log in {directory / 'log.txt'})", file=sys.stderr, flush=True)
      result = _bm25_row() if row == "bm25" else _dense_row(row, seed, steps, directory)
      result.update(row=row, seed=None if row == "bm25" else seed, pretrain_steps=steps,
                    seconds=round(time.time() - started, 1))
      done.write_text(json.dumps(result, indent=1) + "\n")
      print(f"{directory.name}: {json.dumps(result)}", file=sys.stderr, flush=True)


COLUMNS = (("scifact_all", "ndcg@10"), ("scifact_all", "recall@100"), ("scifact_10pct", "ndcg@10"),
           ("scifact_10pct", "recall@100"), ("reqa", "recall@1"), ("reqa", "recall@5"), ("reqa", "recall@10"),
           ("reqa", "recall@100"))


def table(out: pathlib.Path) -> str:
  results: dict[str, list[dict]] = {}
  for path in sorted(out.glob("*/result.json")):
    r = json.loads(path.read_text())
    results.setdefault(r["row"], []).append(r)
  header = ["row", "seeds"] + [f"{'SciFact' if k != 'reqa' else 'ReQA'} {'10%' if '10' in k else ''} {m}".replace(
      "  ", " ") for k, m in COLUMNS]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for row in ROWS:
    if row not in results:
      continue
    rs = results[row]
    cells = [row, ",".join(str(r["seed"]) for r in rs) if rs[0]["seed"] is not None else "-"]
    for key, metric in COLUMNS:
      values = np.array([r[key][metric] for r in rs])
      cell = f"{values.mean():.3f}"
      if len(values) > 1:
        cell += f" ±{(values.max() - values.min()) / 2:.3f}"
      cells.append(cell)
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench pretrain-ablation", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="directory of the rows (resumes: finished rows are kept)")
  parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list from {','.join(ROWS)}")
  parser.add_argument("--seeds", default="0,1")
  parser.add_argument("--pretrain-steps", type=int, default=250,
                      help="pretraining steps of every row (at the recipes' runlocal batch of 32)")
  parser.add_argument("--table", action="store_true", help="print the table of the finished rows and exit")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out)
  if args.table:
    print(table(out))
    return
  rows = args.rows.split(",")
  unknown = sorted(set(rows) - set(ROWS))
  if unknown:
    parser.error(f"--rows: unknown {unknown}; choose from {ROWS}")
  run_rows(rows, [int(s) for s in args.seeds.split(",")], args.pretrain_steps, out)
  print(table(out))


if __name__ == "__main__":
  main()
