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
converted first (an int8 corpus: --config.negatives.retrieval.corpus_dtype=int8) shows the conversion as a kernel of its
own, where on the card autotuning picks a Triton fusion that converts on the way. Its times are bounds, not
measurements: `python -m jdr.bench device --profile` measures on a GPU. For Triton (Pallas) kernels it also
reads the PTX XLA writes for the card: which tensor-core instructions their products use, and, where ptxas is
found (the CUDA plugin's nvidia-cuda-nvcc has one), registers a thread, spills and ptxas's performance warnings.

The programs have the device benchmark's shapes: the forward of one full batch (256 rows of 256 tokens, the
accelerators' 65,536 tokens a batch), mean pooling; the in-batch train step with 128 queries of 32 tokens and
128 documents of 256, AdamW, dropout 0.1; and (not by default) ADORE's step, 32 queries of 32 tokens against
a fixed corpus of MS MARCO's 8,841,823 passages, its top-200 retrieved in the step (adore) or given
(adore-given). Weights and corpora are never created: everything is compiled on abstract values.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import ml_collections

from jdr.runtime import config_files
from jdr.runtime import defaults
from jdr.runtime import parallel
from jdr.training import sizing
from jdr.bench import kernel_profile

PROGRAMS = ("forward", "train", "adore", "adore-given")
_TRITON_NAME = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?name = "([^"]+)"')
_PTX_ENTRY = re.compile(r"\.entry\s+([A-Za-z0-9_$]+)")
_PTXAS_FIGURES = {"registers": re.compile(r"Used (\d+) registers"),
                  "spill_bytes": re.compile(r"(\d+) bytes spill stores"),
                  "stack_bytes": re.compile(r"(\d+) bytes stack frame")}


def triton_kernel_names(hlo_text: str) -> set[str]:
  """The kernels a compiled module runs through Triton (jdr's Pallas kernels on GPUs), by name."""
  return set(_TRITON_NAME.findall(hlo_text))


def ptx_kernel(ptx_text: str, ptxas_output: str | None = None) -> dict:
  """What one Triton kernel's PTX says of its speed before it runs: which tensor-core instructions its
  products use (Hopper's asynchronous `wgmma`, the older warp-level `mma.sync`, or none: a product on plain
  FMA units would be an order of magnitude slower), and, from `ptxas -v`'s report, the registers a thread
  holds (occupancy), bytes spilled to local memory (a spill in the inner loop costs memory traffic), its
  stack frame, and ptxas's own performance warnings (C7515: wgmma instructions serialized)."""
  entry = _PTX_ENTRY.search(ptx_text)
  target = re.search(r"\.target\s+(\S+)", ptx_text)
  kinds = [kind for kind, marker in (("wgmma", "wgmma.mma_async"), ("mma.sync", "mma.sync")) if marker in ptx_text]
  out = {"name": entry.group(1) if entry else None, "target": target.group(1) if target else None,
         "tensor_cores": "+".join(kinds) or "none"}
  for key, pattern in _PTXAS_FIGURES.items():
    found = pattern.search(ptxas_output or "")
    out[key] = int(found.group(1)) if found else None
  # ptxas's own performance warnings, e.g. C7515: wgmma instructions serialized.
  out["warnings"] = [w.strip() for w in re.findall(r"Potential Performance Loss:([^\n]*)", ptxas_output or "")]
  return out


def triton_kernel_report(dump_dir: str, names: set[str]) -> list[dict]:
  """`ptx_kernel` of every Triton kernel named in `names` whose PTX XLA dumped into `dump_dir`
  (compiler option xla_dump_to), with ptxas's figures when ptxas is found (the CUDA plugin's nvidia-cuda-nvcc
  has one)."""
  ptxas = find_ptxas()
  kernels = []
  for path in sorted(pathlib.Path(dump_dir).glob("*.ptx")):
    text = path.read_text()
    entry = _PTX_ENTRY.search(text)
    if not entry or re.sub(r"__\d+$", "", entry.group(1)) not in names:
      continue
    report = None
    target = re.search(r"\.target\s+(\S+)", text)
    if ptxas and target:
      run = subprocess.run([ptxas, f"-arch={target.group(1)}", "-v", str(path), "-o", os.devnull],
                           capture_output=True, text=True, check=False)
      report = run.stdout + run.stderr
    kernels.append(ptx_kernel(text, report))
  return sorted(kernels, key=lambda k: k["name"])


def find_ptxas() -> str | None:
  """NVIDIA's PTX assembler: on PATH, else the one the CUDA plugin's nvidia-cuda-nvcc wheel carries."""
  found = shutil.which("ptxas")
  if found:
    return found
  try:
    import nvidia.cuda_nvcc  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  for root in getattr(nvidia.cuda_nvcc, "__path__", []):
    candidate = pathlib.Path(root) / "bin" / "ptxas"
    if candidate.exists():
      return str(candidate)
  return None


def triton_table(kernels: list[dict]) -> str:
  lines = ["  Triton kernels (their PTX; registers a thread, spills and stack from ptxas -v):"]
  for k in kernels:
    figures = ("" if k["registers"] is None else
               f"  {k['registers']} registers, {k['spill_bytes']} B spilled, {k['stack_bytes']} B stack")
    lines.append(f"    {k['name']:28s} {k['target'] or '':8s} tensor cores: {k['tensor_cores']:15s}{figures}")
    lines.extend(f"      ptxas: {w}" for w in k["warnings"])
  return "\n".join(lines)


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
  ADORE section times, to tell the retrieval's share): jdr.training.sizing.compile_corpus_step, as --compile-only."""
  return sizing.compile_corpus_step(config, devices, corpus_rows, "in_step" if retrieval_in_step else "given",
                                    compiler_options).compiled


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
    options = dict(sizing.DEVICELESS_GPU_OPTIONS)
  # The PTX XLA makes for the GPU, read for its Triton (Pallas) kernels; one folder per program.
  dump = None
  config = make_config(args.fresh, args.train_batch, args.query_length, args.doc_length, overrides)
  out = {"benchmark": "compiled", "target": args.target, "device_kind": device_kind, "fresh": args.fresh,
         "overrides": overrides, "bandwidth": bandwidth, "jax": jax.__version__, "programs": {}}
  with parallel.compiling_for(platform):
    for program in programs:
      start = time.perf_counter()
      if options is not None:
        dump = tempfile.TemporaryDirectory(prefix="jdr-compiled-")
        options = {**options, "xla_dump_to": dump.name}
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
      text = compiled.as_text()
      summary = kernel_profile.compiled_summary(text, bandwidth, args.top)
      summary["compile_s"] = round(time.perf_counter() - start, 1)
      if dump is not None:
        summary["triton_kernels"] = triton_kernel_report(dump.name, triton_kernel_names(text))
      out["programs"][program] = summary
      print(kernel_profile.compiled_table(summary, f"{title} on {device_kind}"), flush=True)
      if summary.get("triton_kernels"):
        print(triton_table(summary["triton_kernels"]), flush=True)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
