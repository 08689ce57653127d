"""What ANCE's background refresh costs the trainer: time spent waiting for negatives, and steps slowed by a mine.

  python -m jdr.bench ance-refresh [--dataset builtin] [--steps 60] [--refresh-every 20] [--delay 10]

Trains the bundled MiniLM with the settings of configs/ance.py:runlocal (tied towers, one ANN negative per
query from the top 200 plus in-batch, softmax NLL at temperature 0.05, AdamW 2e-5, batch 32, mining at 256
document tokens) through `jdr.training.trainer.train_and_evaluate`, with a log line every step and no evaluation, in a
fresh workdir. From the workdir's metrics.jsonl it reports

  wait_fraction  the refresher's wait_seconds over the training wall time (goal 0: a mine should finish
                 within its `delay` steps, so the trainer never blocks);
  slowdown       median step time while a mine is in flight over the median without one, minus 1 (the
                 mine shares the machine with training).

Step durations are differences of consecutive log lines' "time" (the first logged step, which compiles, is
left out), minus any wait for negatives inside the step, so a wait is counted once, in wait_fraction. A step
is "in flight" when the refresher had a mine pending at its start or its end (`negatives/pending` of the two
log lines); that includes the snapshot step, whose copy and save of the params is part of the refresh cost.
"""

import argparse
import json
import pathlib
import shutil
import sys
import tempfile
import time

import jax
import ml_collections
import numpy as np

from jdr.bench import recipes


def _config(args) -> ml_collections.ConfigDict:
  """The ANCE recipe's runlocal variant (configs/ance.py), on this benchmark's schedule."""
  c = recipes.load("ance", "runlocal")
  if args.model == "minilm":
    c.model.init_from = "minilm"
  else:  # a fresh 2x64 tower: only for smoke tests of the benchmark itself
    c.model.init_from, c.model.fresh, c.model.pooling = "", "tiny", "mean"
  c.batch_size = args.batch_size
  c.optimizer.warmup_steps = max(1, args.steps // 10)
  # ... logging every step, without evaluation or checkpoints inside the loop
  c.data.dataset = args.dataset
  c.data.eval_split = ""
  c.num_train_steps = args.steps
  c.negatives.ance.refresh_every = args.refresh_every
  c.negatives.ance.refresh_delay = args.delay
  c.log_every = 1
  c.eval_before_training = False
  c.checkpoint_every = args.steps + 1  # the one checkpoint is saved after the loop, outside the timings
  return c


def analyse(records: list[dict]) -> dict:
  """The wait fraction and the in-flight slowdown from the per-step training log lines."""
  rows = sorted((r for r in records if "train/loss" in r), key=lambda r: r["step"])
  if len(rows) < 3:
    raise ValueError(f"need at least 3 logged steps, got {len(rows)}")
  steps = np.array([r["step"] for r in rows])
  if np.any(np.diff(steps) != 1):
    raise ValueError("the log must have a line for every step (log_every=1)")
  times = np.array([r["time"] for r in rows], float)
  waits = np.array([r.get("train/negatives/wait_seconds", 0.0) for r in rows], float)
  pending = np.array([r.get("train/negatives/pending", 0.0) for r in rows], float) > 0
  # Step i's duration: from the log line of step i-1 to its own; rows[0] (compilation) only starts the clock.
  durations = np.diff(times) - np.diff(waits)
  in_flight = pending[:-1] | pending[1:]
  loop_seconds = float(times[-1] - times[0])
  wait_seconds = float(waits[-1] - waits[0])
  with_mine, without = durations[in_flight], durations[~in_flight]
  med_with = float(np.median(with_mine)) if len(with_mine) else None
  med_without = float(np.median(without)) if len(without) else None
  slowdown = med_with / med_without - 1 if med_with is not None and med_without else None
  last = rows[-1]
  return {
      "timed_steps": int(len(durations)), "loop_seconds": round(loop_seconds, 3),
      "wait_seconds": round(wait_seconds, 3), "wait_fraction": round(wait_seconds / loop_seconds, 4),
      "wait_seconds_total": round(float(waits[-1]), 3),
      "steps_in_flight": int(in_flight.sum()), "steps_without": int((~in_flight).sum()),
      "median_step_in_flight_s": None if med_with is None else round(med_with, 4),
      "median_step_without_s": None if med_without is None else round(med_without, 4),
      "slowdown": None if slowdown is None else round(slowdown, 4),
      "mines": int(last.get("train/negatives/mines", 0)),
      "last_mine_seconds": last.get("train/negatives/mine_seconds"),
      "failed": int(last.get("train/negatives/failed", 0)),
      "late_switches": int(last.get("train/negatives/late_switches", 0)),
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench ance-refresh", description=__doc__.splitlines()[0])
  parser.add_argument("--dataset", default="builtin", help="builtin or a BEIR directory")
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--refresh-every", type=int, default=20)
  parser.add_argument("--delay", type=int, default=10, help="steps from a snapshot until its negatives are due")
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--model", choices=("minilm", "tiny"), default="minilm",
                      help="tiny: a fresh 2x64 tower, for smoke tests only")
  parser.add_argument("--workdir", default="", help="a new directory to train in (default: a temporary one, "
                      "deleted afterwards)")
  args = parser.parse_args(argv)
  if args.steps < 3:
    parser.error("--steps must be at least 3")
  if args.workdir and pathlib.Path(args.workdir).exists() and any(pathlib.Path(args.workdir).iterdir()):
    parser.error(f"--workdir {args.workdir} is not empty (the trainer would resume from it)")

  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.training import metric_writers
  workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="jdr-ance-refresh-"))
  try:
    start = time.perf_counter()
    trainer.train_and_evaluate(_config(args), workdir)
    total = time.perf_counter() - start
    result = analyse(metric_writers.read(workdir))
  finally:
    if not args.workdir:
      shutil.rmtree(workdir, ignore_errors=True)

  fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
  print(f"\nANCE refresh every {args.refresh_every} steps, due {args.delay} steps later, {args.steps} steps "
        f"({result['timed_steps']} timed, {result['loop_seconds']:.1f} s):", file=sys.stderr)
  print(f"  waited for negatives   {result['wait_seconds']:.2f} s = {result['wait_fraction']:.1%} of the "
        f"training time (goal 0)", file=sys.stderr)
  print(f"  median step, mine in flight   {fmt(result['median_step_in_flight_s'], '.3f')} s "
        f"({result['steps_in_flight']} steps)", file=sys.stderr)
  print(f"  median step, no mine          {fmt(result['median_step_without_s'], '.3f')} s "
        f"({result['steps_without']} steps)", file=sys.stderr)
  print(f"  slowdown while mining         {fmt(result['slowdown'], '+.1%')}", file=sys.stderr)
  print(f"  mines {result['mines']} (last {fmt(result['last_mine_seconds'], '.1f')} s), failed "
        f"{result['failed']}, late switches {result['late_switches']}", file=sys.stderr)
  print(json.dumps({
      "benchmark": "ance-refresh", "units": "seconds; wait_fraction and slowdown are ratios (goal: 0)",
      "device": jax.devices()[0].device_kind, "devices": jax.device_count(), "model": args.model,
      "dataset": args.dataset, "steps": args.steps, "refresh_every": args.refresh_every, "delay": args.delay,
      "batch_size": args.batch_size, "run_seconds": round(total, 2), **result}))


if __name__ == "__main__":
  main()
