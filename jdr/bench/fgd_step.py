"""What FGD adds to a training step: contrastive-only vs FGD (passage + sentence pieces, Eq. 7 and 12) vs
document-level KD, the same jitted trainer step, batch and model, one process.

  python -m jdr.bench fgd-step [--batch-size 8] [--negatives 3] [--doc-length 512] [--steps 5]

MiniLM towers with [CLS] pooling, queries of 32 tokens, documents of `--doc-length` (all real tokens, so every
window exists), `--negatives` hard negatives per query plus the batch; teacher scores are random numbers (their
values do not change the step's cost; they are computed once per stage, outside the step). The last line is
JSON with each variant's median step time and its overhead over contrastive-only (the paper calls it small).
"""

import argparse
import json
import sys
import time

import jax
import numpy as np

from jdr.runtime import defaults
from jdr.training import step as step_lib


def _config(args, variant: str):
  c = defaults.get_config()
  c.model.init_from = "minilm"
  c.model.pooling = "cls"
  c.data.query_max_length, c.data.doc_max_length = 32, args.doc_length
  c.batch_size = args.batch_size
  c.negatives.source, c.negatives.per_query = "static", args.negatives
  c.loss.temperature = 0.05
  c.optimizer.warmup_steps = 0
  c.num_train_steps = 10_000
  c.model.encode_chunk_rows = getattr(args, "encode_chunk_rows", 0)
  if variant != "contrastive":
    c.distill.teacher = "bench"  # any non-empty name: the step only reads the teacher fields of the batch
    c.distill.document = variant == "document_kd"
    c.distill.granularities = "passage,sentence" if variant == "fgd" else ""
  return c


def _batch(args, config) -> dict:
  from jdr.training import distill  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  b, n, length = args.batch_size, args.negatives, args.doc_length
  c = b * (1 + n)
  batch = {"query_ids": rng.integers(1000, 30000, (b, 32)).astype(np.int32), "query_mask": np.ones((b, 32), np.int32),
           "doc_ids": rng.integers(1000, 30000, (c, length)).astype(np.int32), "doc_mask": np.ones((c, length), np.int32),
           "valid": np.ones((b, c), bool), "teacher_doc": rng.normal(size=(b, 1 + n)).astype(np.float32)}
  for name, size in distill.levels(config.distill) if distill.enabled(config.distill) else []:
    k = -(-(length - 1) // size)
    batch[f"teacher_{name}_pos"] = rng.normal(size=(b, k)).astype(np.float32)
    batch[f"teacher_{name}_neg"] = rng.normal(size=(b, n, k)).astype(np.float32)
  return batch


def step_seconds(args, variant: str) -> float:
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  from jdr.training import optimizers
  from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
  config = _config(args, variant)
  built = build_lib.build(config.model, config.data)
  tx = optimizers.make_optimizer(config.optimizer, config.num_train_steps)
  params = trainer.initial_params(built.model, built, config, jax.random.PRNGKey(0), None)
  state = {"s": step_lib.TrainState(step=jax.numpy.int32(0), params=params, opt_state=tx.init(params),
                                 rng=jax.random.PRNGKey(1))}
  step_fn = step_lib.jit(step_lib.make_train_step(built.model, tx, config), donate_argnums=(0,))
  batch = _batch(args, config)

  def run():
    state["s"], metrics = step_fn(state["s"], batch)
    jax.block_until_ready(metrics["loss"])

  run()  # compile
  times = []
  for _ in range(args.steps):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench fgd-step", description=__doc__.splitlines()[0])
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--negatives", type=int, default=3)
  parser.add_argument("--doc-length", type=int, default=512)
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--encode-chunk-rows", type=int, default=0,
                      help="model.encode_chunk_rows: the towers encode this many rows at a time (0: all)")
  args = parser.parse_args(argv)
  seconds = {v: step_seconds(args, v) for v in ("contrastive", "document_kd", "fgd")}
  result = {"benchmark": "fgd-step", "units": "seconds/step", "batch_size": args.batch_size,
            "negatives": args.negatives, "doc_length": args.doc_length, "encode_chunk_rows": args.encode_chunk_rows,
            "device": jax.devices()[0].device_kind,
            **{v: round(s, 4) for v, s in seconds.items()},
            "fgd_overhead": round(seconds["fgd"] / seconds["contrastive"] - 1, 4),
            "document_kd_overhead": round(seconds["document_kd"] / seconds["contrastive"] - 1, 4)}
  print(" ".join(f"{v} {s:.3f} s" for v, s in seconds.items()) + f"; FGD overhead {result['fgd_overhead']:+.1%}",
        file=sys.stderr)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
