"""Fingerprints of the recipes: each trained a few steps, its losses and a hash of its final parameters.

Taken before and after a change of the code that should change nothing a recipe trains (keys renamed, modules
moved), they tell bitwise whether it did.

  python -m jdr.bench fingerprint --out before.json [--recipes inbatch,adore] [--steps 3] [--work DIR]
  python -m jdr.bench fingerprint --out after.json --compare before.json    # exit 1 on any difference
  python -m jdr.bench fingerprint --out after.json --compare before.json --no-run   # compare the two files

Each recipe (demo with `:tiny`, the others `:runlocal`) runs `python -m jdr.train` in a process of its own, as a
user runs it, with overrides that make it small and fast on a CPU and that touch only the data, the starting model
and the loop (`overrides` below; each result lists its own). The recipe's method is left as it is: its negatives
and loss settings, its optimizer, its seed. A fresh tiny BERT (2 x 64) replaces a pretrained starting model, with
the pooling and normalization the recipe would have had (MiniLM's when it leaves them to the model); the recipes
whose runlocal variant starts from another recipe's workdir start from that recipe's run here (`CHAINS`), which
runs first. BEIR recipes read SciFact (`--scifact`), pretraining ones the standard library's modules
(`data.pretrain_source=builtin`), and nothing is evaluated.

Prepared corpora (and BM25 beside them) are shared by the recipes of one invocation through JDR_CACHE, a folder
of --work, and with no other run. Each recipe's workdir is made anew, so nothing is resumed.

The output maps each recipe to {"losses": train/loss at steps 1..N, "param_sha256": sha256 over the final
checkpoint's parameters (each leaf in sorted key order: its key path, dtype, shape and bytes), "seconds": the
run's wall time, "overrides": the --config. overrides it ran with}, or {"skipped": why} where a recipe cannot run
here, or {"failed": the run's last line} where it failed. Compare fingerprints taken on one machine: XLA's CPU
kernels and their thread count decide the last bits of a float.
"""

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from jdr.bench import recipes
from jdr.data import shared

ROOT = recipes.CONFIGS.parent  # the checkout whose configs/ and jdr/ are fingerprinted

# The argument each recipe is fingerprinted with (the others: runlocal).
ARGS = {"demo": "tiny"}
# Recipes that cannot run here, with why (none at present: each runlocal variant runs on a CPU).
SKIPPED: dict[str, str] = {}
# A recipe whose runlocal variant reads another recipe's workdir: (its key, the recipe whose run it reads).
CHAINS = {
    "adore_star": ("model.init_from", "star"),  # configs/adore_star.py:runlocal starts from runs/star
    "finetune": ("model.init_from", "pretrain_ict_bfs_wlp"),  # from runs/pretrain_ict_bfs_wlp
    "fgd": ("distill.teacher", "cross_encoder"),  # the teacher: runs/cross
}


def all_recipes() -> list[str]:
  return sorted(p.stem for p in recipes.CONFIGS.glob("*.py") if p.stem != "base")


def ordered(names: list[str]) -> list[str]:
  """`names` with the recipes they read added, each after the one it reads."""
  out = []

  def add(name):
    if name in out:
      return
    if name in CHAINS:
      add(CHAINS[name][1])
    out.append(name)

  for name in names:
    add(name)
  return out


def overrides(name: str, steps: int, scifact: str, workdirs: dict[str, pathlib.Path]) -> list[str]:
  """The `--config.` overrides (KEY=VALUE) of recipe `name`'s fingerprint run. Only data.*, model.*, the loop's
  keys and distill.teacher are set: the keys a rewrite of the method's settings leaves alone."""
  c = recipes.load(name, ARGS.get(name, "runlocal"))
  out = [f"num_train_steps={steps}", "log_every=1", "eval_every=0", "eval_before_training=False",
         "checkpoint_every=0", "data.eval_split="]
  if c.data.kind == "pretrain":
    out.append("data.pretrain_source=builtin")  # the standard library's modules: no dataset needed
  elif c.data.dataset != "builtin":
    out.append(f"data.dataset={scifact}")
  chained = CHAINS.get(name)
  if chained:
    out.append(f"{chained[0]}={workdirs[chained[1]]}")
  from_run = chained is not None and chained[0] == "model.init_from"  # that run's model, its pooling and head
  if c.model.init_from and not from_run:
    out += ["model.init_from=", "model.fresh=tiny"]
    if c.model.architecture == "two_tower":
      # Shaped as the recipe's towers would be: its own pooling and normalization, else MiniLM's (mean,
      # L2-normalized), which every runlocal variant starts from, directly or through another recipe's run.
      out += [f"model.pooling={c.model.pooling or 'mean'}",
              f"model.normalize={c.model.normalize if c.model.normalize >= 0 else 1}"]
  elif c.model.fresh in ("small", "mini", "base"):
    out.append("model.fresh=tiny")  # fresh already (pretraining): a smaller encoder; decoders keep theirs
  if c.model.get("doc_init_from"):
    out.append("model.doc_init_from=")
  return out


def child_env(cache: pathlib.Path) -> dict[str, str]:
  """The environment of each training process: this checkout's jdr first on the path (an installed one may be
  another checkout), the invocation's own corpus cache, and a fixed string hash order."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
  env["JDR_CACHE"] = str(cache)
  env["PYTHONHASHSEED"] = "0"
  return env


def last_line(path: pathlib.Path) -> str:
  lines = [line.strip() for line in path.read_text(errors="replace").replace("\r", "\n").splitlines()]
  return next((line for line in reversed(lines) if line), "")


def params_sha256(params) -> str:
  """sha256 over every leaf of a nested dict of arrays, in sorted key order: key path, dtype, shape, bytes."""
  digest = hashlib.sha256()

  def visit(node, path):
    if isinstance(node, dict):
      for key in sorted(node):
        visit(node[key], f"{path}/{key}")
      return
    array = np.ascontiguousarray(np.asarray(node))
    digest.update(f"{path}|{array.dtype}|{array.shape}|".encode())
    digest.update(array.tobytes())

  visit(params, "")
  return digest.hexdigest()


def fingerprint(workdir: pathlib.Path, steps: int) -> dict:
  """(losses at steps 1..steps, the final parameters' hash) of a finished run's workdir."""
  # jax and orbax: needed only to read a finished run (--no-run compares without them)
  from jdr.runtime import checkpoint  # pylint: disable=g-import-not-at-top
  from jdr.training import metric_writers  # pylint: disable=g-import-not-at-top
  by_step = {r["step"]: r["train/loss"] for r in metric_writers.read(workdir) if "train/loss" in r}
  missing = [s for s in range(1, steps + 1) if s not in by_step]
  if missing:
    raise ValueError(f"{workdir}/metrics.jsonl has no train/loss at steps {missing}")
  saved = checkpoint.latest_step(workdir)
  if saved != steps:
    raise ValueError(f"{workdir}: the latest checkpoint is step {saved}, not {steps}")
  return {"losses": [by_step[s] for s in range(1, steps + 1)],
          "param_sha256": params_sha256(checkpoint.latest_params(workdir))}


def run_recipe(name: str, args, work: pathlib.Path, workdirs: dict[str, pathlib.Path], results: dict) -> dict:
  if name in SKIPPED:
    return {"skipped": SKIPPED[name]}
  chained = CHAINS.get(name)
  if chained and "losses" not in results.get(chained[1], {}):
    return {"skipped": f"it reads {chained[1]}'s run ({chained[0]}), which did not finish"}
  workdir = workdirs[name]
  if workdir.exists():
    shutil.rmtree(workdir)  # an existing workdir would be resumed
  keys = overrides(name, args.steps, args.scifact, workdirs)
  command = [sys.executable, "-m", "jdr.train", "--config", f"{recipes.CONFIGS / name}.py:{ARGS.get(name, 'runlocal')}",
             "--workdir", str(workdir), *(f"--config.{k}" for k in keys)]
  log = work / "logs" / f"{name}.log"
  log.parent.mkdir(parents=True, exist_ok=True)
  print(f"{name}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
  start = time.perf_counter()
  with open(log, "wb") as out:
    # A session of its own, so a timeout ends whatever the run started too (tokenizer workers).
    process = subprocess.Popen(command, cwd=ROOT, env=child_env(work / "cache"), stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
      code = process.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
      os.killpg(process.pid, 9)
      process.wait()
      return {"failed": f"no result after {args.timeout} s (log: {log})", "overrides": keys}
  seconds = round(time.perf_counter() - start, 1)
  if code != 0:
    return {"failed": f"exit {code}: {last_line(log)} (log: {log})", "overrides": keys}
  try:
    found = fingerprint(workdir, args.steps)
  except (ValueError, FileNotFoundError) as e:
    return {"failed": f"{e} (log: {log})", "overrides": keys}
  return {**found, "seconds": seconds, "overrides": keys}


def print_table(results: dict) -> None:
  print(f"{'recipe':22} {'seconds':>8}  {'param_sha256':16}  losses / why not")
  for name, r in results.items():
    if "losses" in r:
      losses = " ".join(f"{x:.6g}" for x in r["losses"])
      print(f"{name:22} {r['seconds']:8.1f}  {r['param_sha256'][:16]}  {losses}")
    else:
      status = "skipped" if "skipped" in r else "FAILED"
      print(f"{name:22} {'':8}  {status:16}  {r.get('skipped') or r.get('failed')}")


def compare(mine: dict, other: dict, mine_name: str, other_name: str, only: list[str] | None = None) -> bool:
  """Prints each recipe's verdict; whether every recipe of either file (of `only`, when given) is equal, or
  skipped in both."""
  same = True
  for name in sorted(set(only) if only else set(mine) | set(other)):
    a, b = mine.get(name), other.get(name)
    if a is None or b is None:
      verdict = f"DIFFERENT (only in {mine_name if b is None else other_name})"
    elif "skipped" in a and "skipped" in b:
      verdict = "skipped"
    elif "failed" in a or "failed" in b:
      verdict = "FAILED: " + "; ".join(f"{n}: {r['failed']}" for n, r in ((mine_name, a), (other_name, b))
                                       if "failed" in r)
    elif "losses" not in a or "losses" not in b:
      verdict = f"DIFFERENT (skipped in {mine_name if 'losses' not in a else other_name})"
    else:
      # Bitwise: JSON keeps each float32 loss exactly (a float's repr round-trips).
      diffs = [f"loss at step {i + 1}: {x!r} vs {y!r}" for i, (x, y) in enumerate(zip(a["losses"], b["losses"]))
               if np.float64(x).tobytes() != np.float64(y).tobytes()]
      if len(a["losses"]) != len(b["losses"]):
        diffs.append(f"{len(a['losses'])} steps vs {len(b['losses'])}")
      if a["param_sha256"] != b["param_sha256"]:
        diffs.append("parameters")
      verdict = "equal" if not diffs else "DIFFERENT: " + "; ".join(diffs)
    same = same and verdict in ("equal", "skipped")
    print(f"{name:22} {verdict}")
  return same


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench fingerprint", description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="the fingerprints, JSON")
  parser.add_argument("--recipes", default="", help="comma-separated configs/ names (default: all but base); the "
                      "recipes they read from (CHAINS) run too")
  parser.add_argument("--steps", type=int, default=3, help="training steps a recipe")
  parser.add_argument("--work", default="", help="workdirs, logs and the corpus cache (default: a new temporary "
                      "folder, removed at the end)")
  scifact = shared.shared_dataset("scifact")
  parser.add_argument("--scifact", default=str(scifact) if scifact else "",
                      help="SciFact in BEIR layout, the BEIR recipes' data (default: the shared data folder's, "
                           "$JDR_SHARED_DATA or ../shared/data)")
  parser.add_argument("--timeout", type=float, default=3600, help="seconds a recipe may run")
  parser.add_argument("--compare", default="", help="another run's --out: say per recipe whether it is equal")
  parser.add_argument("--no-run", action="store_true", help="with --compare: compare the existing --out, run nothing")
  args = parser.parse_args(argv)
  if args.no_run and not args.compare:
    parser.error("--no-run goes with --compare")
  out = pathlib.Path(args.out)
  asked = [n for n in args.recipes.split(",") if n]
  unknown = sorted(set(asked) - set(all_recipes()))
  if unknown:
    parser.error(f"no such recipe in {recipes.CONFIGS}: {', '.join(unknown)}")
  names = ordered(asked or all_recipes())

  if args.no_run:
    results = json.loads(out.read_text())
  else:
    if not args.scifact or not pathlib.Path(args.scifact).is_dir():
      parser.error(f"--scifact={args.scifact!r}: not a directory; set it, or $JDR_SHARED_DATA")
    args.scifact = str(pathlib.Path(args.scifact).resolve())
    temporary = not args.work
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="jdr-fingerprint-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    workdirs = {n: work / "runs" / n for n in names}
    results = {}
    try:
      for name in names:
        results[name] = run_recipe(name, args, work, workdirs, results)
        r = results[name]
        print(f"{name}: " + (f"{r['seconds']} s, losses {r['losses']}, params {r['param_sha256'][:16]}"
                             if "losses" in r else r.get("skipped") or r.get("failed")), file=sys.stderr, flush=True)
        out.write_text(json.dumps(results, indent=1) + "\n")  # as far as it got, should a later recipe hang
    finally:
      if temporary:
        shutil.rmtree(work, ignore_errors=True)
    print_table(results)
  if args.compare:
    same = compare(results, json.loads(pathlib.Path(args.compare).read_text()), str(out), args.compare,
                   names if asked else None)
    print("equal" if same else "DIFFERENT")
    if not same:
      raise SystemExit(1)


if __name__ == "__main__":
  main()
