"""What the encoder's forward and the train step ask of a GPU, read from their compiled HLO without one.

  python -m jdr.bench compiled                      # BERT-base-shaped, compiled for an NVIDIA H200
  python -m jdr.bench compiled --target h100 --config.model.attention_dropout=0
  python -m jdr.bench compiled --target host --fresh tiny --rows 8 --length 32 --train-batch 4

XLA's GPU compiler runs on a CPU host when jax's CUDA plugin is installed (pip install 'jax[cuda12]'; no GPU
needed): given a GPU's hardware description it builds the same optimized module as on the card, short of
autotuning. For each program this prints its kernels by kind of work (matmuls, fused attention, transposes
and copies, other fusions), the least bytes they must move and that traffic's time at the card's bandwidth,
and the largest groups of alike kernels (the same work in every layer). It is where to look before a GPU is
at hand, and what a change to the model's structure shows at once: a transpose or a materialized broadcast
is a kernel in this list. Matmuls run as cuBLAS calls, as autotuning chose for BERT-base's matmuls on an
NVIDIA H200 (without autotuning XLA would make every one a Triton fusion). Its times are bounds, not
measurements: `python -m jdr.bench device --profile` measures on a GPU.

The programs have the device benchmark's shapes: the forward of one full batch (256 rows of 256 tokens, the
accelerators' 65,536 tokens a batch), mean pooling; the in-batch train step with 128 queries of 32 tokens and
128 documents of 256, AdamW, dropout 0.1. Weights are never created: everything is compiled on abstract values.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections

from jdr import config_files
from jdr import defaults
from jdr import optimizers
from jdr import parallel
from jdr import sizing
from jdr import step as step_lib
from jdr.bench import kernel_profile
from jdr.models import build as build_lib

PROGRAMS = ("forward", "train")


def make_config(fresh: str, batch: int, query_length: int, doc_length: int,
                overrides: list[str]) -> ml_collections.ConfigDict:
  c = defaults.get_config()
  c.model.init_from, c.model.fresh = "", fresh
  c.model.pooling, c.model.normalize = "mean", False
  c.data.query_max_length, c.data.doc_max_length = query_length, doc_length
  c.batch_size = batch
  c.optimizer.learning_rate, c.optimizer.warmup_steps = 2e-5, 0
  c.num_train_steps = 10_000
  config_files.apply_overrides(c, overrides)
  return c


def compile_forward(config: ml_collections.ConfigDict, devices, rows: int, length: int,
                    compiler_options: dict | None):
  """The document tower's forward of one [rows, length] batch, compiled on abstract parameters."""
  mesh = parallel.make_mesh(config.mesh.shape, devices=devices)
  built = build_lib.build(config.model, config.data)
  tx = optimizers.make_optimizer(config.optimizer, config.num_train_steps, config.model.train_towers)
  abstract, _ = step_lib.abstract_train_state(built.model, tx, config, mesh, parallel.rules_for(config.mesh.rules))
  ids = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=parallel.batch_sharding(mesh))
  model = built.model
  forward = jax.jit(lambda p, i, m: model.apply({"params": p}, i, m, method=type(model).encode_doc))
  return forward.lower(abstract.params, ids, ids).compile(compiler_options)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench compiled", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--target", default="h200", choices=("host", *sorted(sizing.GPU_TARGETS)),
                      help="a GPU to compile for (needs jax's CUDA plugin, not the GPU), or host: this host's "
                           "own backend")
  parser.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma-separated, of {PROGRAMS}")
  parser.add_argument("--fresh", default="base", help="model.fresh: the architecture (tiny, small, mini, base)")
  parser.add_argument("--rows", type=int, default=256, help="forward: rows of the batch")
  parser.add_argument("--length", type=int, default=256, help="forward: tokens a row")
  parser.add_argument("--train-batch", type=int, default=128)
  parser.add_argument("--query-length", type=int, default=32)
  parser.add_argument("--doc-length", type=int, default=256)
  parser.add_argument("--top", type=int, default=12, help="groups of alike kernels to list")
  argv, overrides = config_files.split_config_args(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(argv)
  programs = [p for p in args.programs.split(",") if p]
  unknown = sorted(set(programs) - set(PROGRAMS))
  if unknown:
    parser.error(f"unknown programs {unknown}; choose from {PROGRAMS}")

  if args.target == "host":
    devices, platform, bandwidth, options = None, jax.default_backend(), None, None
    device_kind = jax.devices()[0].device_kind
  else:
    try:
      devices, platform = sizing.gpu_target_devices(args.target), "gpu"
    except ValueError as e:
      parser.error(str(e))
    bandwidth = sizing.GPU_TARGETS[args.target]["bandwidth"]
    device_kind = sizing.GPU_TARGETS[args.target]["name"]
    options = {"xla_gpu_enable_triton_gemm": False}
  config = make_config(args.fresh, args.train_batch, args.query_length, args.doc_length, overrides)
  out = {"benchmark": "compiled", "target": args.target, "device_kind": device_kind, "fresh": args.fresh,
         "overrides": overrides, "bandwidth": bandwidth, "jax": jax.__version__, "programs": {}}
  with parallel.compiling_for(platform):
    for program in programs:
      start = time.perf_counter()
      if program == "forward":
        compiled = compile_forward(config, devices, args.rows, args.length, options)
        title = f"forward of [{args.rows}, {args.length}]"
      else:
        compiled = sizing.compile_step(config, devices, options).compiled
        title = (f"train step, {args.train_batch} x {args.query_length} queries + {args.train_batch} x "
                 f"{args.doc_length} documents")
      summary = kernel_profile.compiled_summary(compiled.as_text(), bandwidth, args.top)
      summary["compile_s"] = round(time.perf_counter() - start, 1)
      out["programs"][program] = summary
      print(kernel_profile.compiled_table(summary, f"{title} on {device_kind}"), flush=True)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
