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
NVIDIA H200 (without autotuning XLA would make every one a Triton fusion); a matmul whose operand must be
converted first (an int8 corpus: --config.negatives.corpus_dtype=int8) shows the conversion as a kernel of its
own, where on the card autotuning picks a Triton fusion that converts on the way. Its times are bounds, not
measurements: `python -m jdr.bench device --profile` measures on a GPU.

The programs have the device benchmark's shapes: the forward of one full batch (256 rows of 256 tokens, the
accelerators' 65,536 tokens a batch), mean pooling; the in-batch train step with 128 queries of 32 tokens and
128 documents of 256, AdamW, dropout 0.1; and (not by default) ADORE's step, 32 queries of 32 tokens against
a fixed corpus of MS MARCO's 8,841,823 passages, its top-200 retrieved in the step (adore) or given
(adore-given). Weights and corpora are never created: everything is compiled on abstract values.
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
from jdr import parallel
from jdr import sizing
from jdr import step as step_lib
from jdr.bench import kernel_profile

PROGRAMS = ("forward", "train", "adore", "adore-given")


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
  """The document tower's forward of one [rows, length] batch, compiled on abstract parameters as encoding
  holds them (`towers.serving_params`: matmul weights in the compute dtype)."""
  from jdr.models import towers  # pylint: disable=g-import-not-at-top
  setup = sizing.abstract_model(config, devices)
  ids = jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=parallel.batch_sharding(setup.mesh))
  model = setup.model
  params = setup.abstract.params
  serving = jax.tree.map(lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=p.sharding),
                         jax.eval_shape(lambda p: towers.serving_params(p, model), params), params)
  forward = jax.jit(lambda p, i, m: model.apply({"params": p}, i, m, method=type(model).encode_doc))
  return forward.lower(serving, ids, ids).compile(compiler_options)


def compile_adore(config: ml_collections.ConfigDict, devices, corpus_rows: int, retrieval_in_step: bool,
                  compiler_options: dict | None):
  """ADORE's step (configs/adore.py: the query tower trains against the fixed corpus) with its top-n over
  [corpus_rows, dim] retrieved inside the step, or given as candidate rows (what the device benchmark's
  ADORE section times, to tell the retrieval's share)."""
  from jdr import topk  # pylint: disable=g-import-not-at-top
  setup = sizing.abstract_model(config, devices)
  mesh = setup.mesh
  batch_sharding = parallel.batch_sharding(mesh)
  b, length = config.batch_size, config.data.query_max_length
  batch = {"query_ids": ((b, length), jnp.int32), "query_mask": ((b, length), jnp.int32),
           "positive_rows": ((b, 1), jnp.int32)}
  if not retrieval_in_step:
    batch["cand_rows"] = ((b, config.negatives.top_n), jnp.int32)
  batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding) for k, (shape, dtype) in batch.items()}
  dim = int(jax.eval_shape(step_lib.make_step_query_vectors(setup.model), setup.abstract, batch["query_ids"],
                           batch["query_mask"]).shape[-1])
  corpus, bias = topk.abstract_corpus(corpus_rows, dim, mesh, config.negatives.corpus_dtype)
  rows_sharding, bias_sharding = topk.row_shardings(mesh)
  step = step_lib.jit(step_lib.make_train_step(setup.model, setup.tx, config, mesh, "corpus", retrieval_in_step),
                      in_shardings=(setup.shardings, batch_sharding, rows_sharding, bias_sharding),
                      out_shardings=(setup.shardings, parallel.replicated(mesh)), donate_argnums=(0,))
  return step.lower(setup.abstract, batch, corpus, bias).compile(compiler_options)


def adore_config(fresh: str, batch: int, query_length: int, top_n: int, overrides: list[str]):
  """configs/adore.py as the ADORE benchmark sets it up, with a fresh model of `fresh`'s shape."""
  from jdr.bench import adore_step  # pylint: disable=g-import-not-at-top
  c = adore_step.recipe_config(argparse.Namespace(
      model=fresh, top_n=top_n, query_length=query_length, batch_size=batch))
  config_files.apply_overrides(c, overrides)
  return c


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.bench compiled", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--target", default="h200", choices=("host", *sorted(sizing.GPU_TARGETS)),
                      help="a GPU to compile for (needs jax's CUDA plugin, not the GPU), or host: this host's "
                           "own backend")
  parser.add_argument("--programs", default="forward,train", help=f"comma-separated, of {PROGRAMS}")
  parser.add_argument("--fresh", default="base", help="model.fresh: the architecture (tiny, small, mini, base)")
  parser.add_argument("--rows", type=int, default=256, help="forward: rows of the batch")
  parser.add_argument("--length", type=int, default=256, help="forward: tokens a row")
  parser.add_argument("--train-batch", type=int, default=128)
  parser.add_argument("--query-length", type=int, default=32)
  parser.add_argument("--doc-length", type=int, default=256)
  parser.add_argument("--corpus-rows", type=int, default=8_841_823,
                      help="adore: rows of the fixed corpus (default MS MARCO's passages)")
  parser.add_argument("--adore-batch", type=int, default=32, help="adore: queries a step")
  parser.add_argument("--top-n", type=int, default=200, help="adore: candidates retrieved a query")
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
      elif program.startswith("adore"):
        in_step = program == "adore"
        adore = adore_config(args.fresh, args.adore_batch, args.query_length, args.top_n, overrides)
        compiled = compile_adore(adore, devices, args.corpus_rows, in_step, options)
        title = (f"ADORE step, {args.adore_batch} x {args.query_length} queries, top-{args.top_n} of "
                 f"{args.corpus_rows:,} rows {'retrieved in the step' if in_step else 'given'}")
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
