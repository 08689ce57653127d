"""Sizing a job before it runs: `python -m jdr.train --config ... --compile-only`.

Lowers and compiles the configured train step for the configured mesh, on abstract values (no data is read,
no weights are loaded, nothing is allocated), and reports per device: the bytes of the parameters and of the
optimizer state (from their shardings), the step's compiled memory (XLA's memory analysis: arguments,
outputs, temporaries, i.e. activations and gradients) and the FLOPs each device executes per step (XLA's
cost analysis of the partitioned module). Token batches (in-batch, sampled negatives, pretraining pairs) and
ADORE / LTRe's corpus batches; masked-LM pretraining is not covered.

ADORE / LTRe score against a fixed corpus matrix of N rows (`corpus_rows`, by default MS MARCO passage's
8,841,823, the size their full recipes train on), which is abstract here too (jdr.retrieval.topk.abstract_corpus). With
`negatives.retrieval.backend=jax` its row shard is an argument of the step, so the step's total per device
includes it; with Faiss (the recipes' default) the matrix stays memory-mapped on the host, the batch carries
the candidates' vectors, and the report gives the host's bytes beside the devices'.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jdr.training import distill
from jdr.training import optimizers
from jdr.runtime import parallel
from jdr.training import step as step_lib
from jdr.data import pretrain_batches
from jdr.models import build as build_lib
from jdr.models import decoder
from jdr.negatives import retrieved
from jdr.negatives import sources


def per_device_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard of each leaf)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
    total += int(np.prod(shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize
  return total


def corpus_matrix_bytes(num_docs: int, dim: int, devices: int, dtype: str = "float32") -> int:
  """Per-device bytes of a corpus matrix [num_docs, dim] sharded by rows over `devices` (padded evenly)."""
  rows = math.ceil(num_docs / devices)
  return rows * dim * jnp.dtype(dtype).itemsize


# MS MARCO passage ranking's corpus: the rows ADORE / LTRe's full recipes search at every step.
MSMARCO_PASSAGES = 8_841_823


def abstract_batch(config: ml_collections.ConfigDict, sharding) -> dict:
  b = config.batch_size
  lq, ld = config.data.query_max_length, config.data.doc_max_length
  if sources.candidates(config) == "pairs":
    n = 1 + config.negatives.per_query
    shapes = {"pair_ids": ((b, n, ld), jnp.int32), "pair_mask": ((b, n, ld), jnp.int32),
              "pair_types": ((b, n, ld), jnp.int32), "valid": ((b, n), jnp.bool_), "labels": ((b, n), jnp.float32)}
  else:
    c = b * (1 + config.negatives.per_query) if config.data.kind != "pretrain" else b
    shapes = {"query_ids": ((b, lq), jnp.int32), "query_mask": ((b, lq), jnp.int32),
              "doc_ids": ((c, ld), jnp.int32), "doc_mask": ((c, ld), jnp.int32), "valid": ((b, c), jnp.bool_)}
    if distill.enabled(config.distill):  # the teacher's scores of each query's own candidates (distill.Distiller)
      n = config.negatives.per_query
      shapes["teacher_doc"] = ((b, 1 + n), jnp.float32)
      for name, k in distill.piece_counts(config.distill, ld).items():
        shapes[f"teacher_{name}_pos"] = ((b, k), jnp.float32)
        shapes[f"teacher_{name}_neg"] = ((b, n, k), jnp.float32)
  return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for k, (shape, dtype) in shapes.items()}


# Hardware facts of GPUs that XLA's GPU compiler needs to compile for one without it (deviceless, from a CPU
# host), from NVIDIA's published specifications: streaming multiprocessors, HBM bandwidth and size, L2,
# shared memory per SM and the most a block may opt into, boost clock, compute capability.
GPU_TARGETS = {
    "h100": dict(name="NVIDIA H100 80GB HBM3", sms=132, bandwidth=3.35e12, memory=85_520_809_984,
                 l2=52_428_800, shared_per_sm=233_472, shared_per_block_optin=232_448, clock_ghz=1.98,
                 compute_capability=(9, 0)),
    "h200": dict(name="NVIDIA H200 141GB HBM3e", sms=132, bandwidth=4.8e12, memory=151_397_597_184,
                 l2=52_428_800, shared_per_sm=233_472, shared_per_block_optin=232_448, clock_ghz=1.98,
                 compute_capability=(9, 0)),
}


# Compiling for a GPU without one, XLA cannot autotune: its Triton GEMM fusions then take untuned tile sizes,
# and for some of BERT-base's gradient matmuls it finds none and fails. Matmuls go to cuBLAS instead, as
# autotuning chose for BERT-base's on an H200 (docs/performance.md, `compiled`).
DEVICELESS_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def gpu_target_config(name: str) -> str:
  """XLA's GpuTargetConfigProto (text format) for a GPU of GPU_TARGETS."""
  g = GPU_TARGETS[name]
  major, minor = g["compute_capability"]
  return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {g["shared_per_sm"]}
  threads_per_core_limit: 2048
  core_count: {g["sms"]}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(g["bandwidth"])}
  l2_cache_size: {g["l2"]}
  clock_rate_ghz: {g["clock_ghz"]}
  device_memory_size: {g["memory"]}
  shared_memory_per_block_optin: {g["shared_per_block_optin"]}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 patch: 0 }}
device_description_str: "{g["name"]}"
"""


def gpu_target(topology: str) -> tuple[str, int] | None:
  """(GPU of GPU_TARGETS, GPUs on the host) of a topology name "h100" or "h200:8" (eight on one host); None
  for any other name (a TPU slice)."""
  name, _, count = topology.partition(":")
  if name not in GPU_TARGETS:
    return None
  if count and not (count.isdigit() and int(count) >= 1):
    raise ValueError(f"--topology {topology}: the GPUs of one host come after the colon, e.g. {name}:8")
  return name, int(count or 1)


def gpu_target_devices(name: str, count: int = 1) -> list:
  """`count` GPUs of GPU_TARGETS on one host, for compiling for them on a host without them; needs jax's CUDA
  plugin (pip install 'jax[cuda12]'), which compiles without a GPU when JAX_SKIP_CUDA_CONSTRAINTS_CHECK is set."""
  import os  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  if name not in GPU_TARGETS:
    raise ValueError(f"unknown GPU target {name!r}; known: {', '.join(sorted(GPU_TARGETS))}")
  # Without a GPU the plugin's start-up check of the CUDA driver fails and jax drops the plugin.
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  try:
    # The CUDA topology is slices x hosts a slice x GPUs a host.
    return list(topologies.get_topology_desc(topology_name=name, platform="cuda", topology=f"1x1x{count}",
                                             target_config=gpu_target_config(name)).devices)
  except Exception as e:  # pylint: disable=broad-except  (the plugin absent: say what it takes)
    raise ValueError(f"GPU target {name}: no CUDA topology description ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''}); compiling for a GPU from this host needs "
                     "jax's CUDA plugin (pip install 'jax[cuda12]'; no GPU needed)") from None


def topology_devices(name: str) -> list:
  """The devices of a named TPU slice ("v5e:2x2", "v4:2x2x1", "v5p:2x2x2"), for ahead-of-time compilation on a
  host without TPUs, as MaxText's train_compile does; needs libtpu installed (pip install 'jax[tpu]')."""
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    return list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
  except Exception as e:  # pylint: disable=broad-except  (libtpu absent or an unknown name: say which)
    raise ValueError(f"--topology {name}: no TPU topology description ({type(e).__name__}: "
                     f"{str(e).splitlines()[0] if str(e) else ''}); it needs libtpu (pip install 'jax[tpu]') and a "
                     "name such as v5e:2x2 or v4:2x2x1") from None


def size_step(config: ml_collections.ConfigDict, topology: str | None = None,
              corpus_rows: int = MSMARCO_PASSAGES) -> dict:
  """Compiles the step of `config` for its mesh; returns the per-device figures (module docstring).

  With `topology` (a TPU slice name, or a GPU of GPU_TARGETS: "h100", or "h100:8" for eight on one host) the
  mesh is built from that slice's devices (the host's GPUs) and the step compiled for them ahead of time, with
  that platform's defaults (model.dtype auto = bfloat16, fused attention). `corpus_rows`: the rows of ADORE /
  LTRe's fixed corpus (other steps have none)."""
  if topology is None:
    return _size_step(config, None, corpus_rows)
  options = None
  gpu = gpu_target(topology)
  if gpu:
    devices, platform = gpu_target_devices(*gpu), "gpu"
    kind, options = GPU_TARGETS[gpu[0]]["name"], DEVICELESS_GPU_OPTIONS
  else:
    devices, platform = topology_devices(topology), "tpu"
    kind = devices[0].device_kind
  with parallel.compiling_for(platform):
    return {**_size_step(config, devices, corpus_rows, options), "topology": topology, "device_kind": kind}


@dataclasses.dataclass
class AbstractModel:
  """A config's model, optimizer and train state on its mesh as sharded ShapeDtypeStructs: what compiling
  any of its programs on abstract values starts from (nothing is allocated)."""
  mesh: Any
  model: Any
  tx: Any
  abstract: step_lib.TrainState
  shardings: Any


def abstract_model(config: ml_collections.ConfigDict, devices=None) -> AbstractModel:
  mesh = parallel.make_mesh(config.mesh.shape, devices=devices)
  model = build_lib.build(config.model, config.data).model
  tx = optimizers.make_optimizer(config.optimizer, config.num_train_steps, config.model.train_towers,
                                 optimizers.uses_lora(config.model))
  abstract, shardings = step_lib.abstract_train_state(model, tx, config, mesh, parallel.rules_for(config.mesh.rules))
  return AbstractModel(mesh, model, tx, abstract, shardings)


@dataclasses.dataclass
class CompiledStep:
  """The configured train step compiled on abstract values, with what it was compiled for."""
  compiled: Any
  mesh: Any
  abstract: step_lib.TrainState
  batch: dict
  # Corpus steps (ADORE / LTRe): the abstract (rows, bias) on the devices, None when the host serves the
  # candidates; the corpus's rows and width, and where its candidates come from (CORPUS_RETRIEVAL).
  corpus: Any = None
  corpus_rows: int | None = None
  corpus_dim: int | None = None
  retrieval: str | None = None


def compile_step(config: ml_collections.ConfigDict, devices=None, compiler_options: dict | None = None,
                 corpus_rows: int = MSMARCO_PASSAGES) -> CompiledStep:
  """Compiles the step of `config` for its mesh over `devices` (default: this host's) on abstract values;
  corpus candidates (ADORE / LTRe) against a corpus of `corpus_rows` rows, retrieved as the config says."""
  sources.check(config)
  candidates = sources.candidates(config)
  if pretrain_batches.is_masked_lm(config):
    raise ValueError("--compile-only sizes token-batch and corpus steps; masked-LM pretraining is not covered yet")
  if candidates == "corpus":
    return compile_corpus_step(config, devices, corpus_rows, corpus_retrieval(config), compiler_options)
  setup = abstract_model(config, devices)
  parallel.check_batch_size(config.batch_size, setup.mesh)
  step = step_lib.make_train_step(setup.model, setup.tx, config, setup.mesh, candidates)
  batch = abstract_batch(config, parallel.batch_sharding(setup.mesh))
  compiled = step_lib.jit_step(step, setup.shardings, setup.mesh).lower(setup.abstract, batch).compile(
      compiler_options)
  return CompiledStep(compiled, setup.mesh, setup.abstract, batch)


# Where a corpus step's candidates come from: "in_step" (the JAX top-k inside the step, the matrix on the
# devices), "host" (Faiss between steps: the batch carries the candidates' and positives' vectors, the matrix
# stays on the host), "given" (candidate rows in the batch, vectors gathered from the matrix on the devices:
# what the benchmarks time to tell the retrieval's share of a step; the trainer never runs it).
CORPUS_RETRIEVAL = ("in_step", "host", "given")


def corpus_retrieval(config: ml_collections.ConfigDict) -> str:
  """The trainer's choice for `config` (jdr.negatives.sources: the JAX back-end retrieves in the step unless
  the candidates are fixed before training, which, like Faiss, serves them from the host)."""
  return "in_step" if retrieved.settings(config.negatives.retrieval).in_step else "host"


def compile_corpus_step(config: ml_collections.ConfigDict, devices, corpus_rows: int, retrieval: str,
                        compiler_options: dict | None = None, positives: int = 1) -> CompiledStep:
  """ADORE / LTRe's step (the query tower against a fixed corpus of `corpus_rows` rows, its document tower
  never run) compiled on abstract values; `retrieval` is one of CORPUS_RETRIEVAL. `positives` is the batch's
  positive_rows width P (the most positives of a training query; each column beyond the first adds B x D
  float32 of positive vectors with host retrieval). The corpus, when on the devices, is CompiledStep.corpus."""
  from jdr.retrieval import topk  # pylint: disable=g-import-not-at-top
  if retrieval not in CORPUS_RETRIEVAL:
    raise ValueError(f"retrieval must be one of {CORPUS_RETRIEVAL}, got {retrieval!r}")
  setup = abstract_model(config, devices)
  mesh = setup.mesh
  parallel.check_batch_size(config.batch_size, mesh)
  batch_sharding = parallel.batch_sharding(mesh)
  settings = retrieved.settings(config.negatives.retrieval)
  b, length, n = config.batch_size, config.data.query_max_length, settings.top_n
  shapes = {"query_ids": ((b, length), jnp.int32), "query_mask": ((b, length), jnp.int32),
            "positive_rows": ((b, positives), jnp.int32)}
  dim = int(jax.eval_shape(step_lib.make_step_query_vectors(setup.model),
                           setup.abstract, jax.ShapeDtypeStruct((b, length), jnp.int32),
                           jax.ShapeDtypeStruct((b, length), jnp.int32)).shape[-1])
  if retrieval != "in_step":
    shapes["cand_rows"] = ((b, n), jnp.int32)
  if retrieval == "host":
    shapes["cand_vectors"] = ((b, n, dim), jnp.float32)
    shapes["positive_vectors"] = ((b, positives, dim), jnp.float32)
  batch = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding) for k, (shape, dtype) in shapes.items()}
  step = step_lib.make_train_step(setup.model, setup.tx, config, mesh, "corpus", retrieval == "in_step")
  if retrieval == "host":
    compiled = step_lib.jit_step(step, setup.shardings, mesh).lower(setup.abstract, batch).compile(
        compiler_options)
    return CompiledStep(compiled, mesh, setup.abstract, batch, corpus=None, corpus_rows=corpus_rows,
                        corpus_dim=dim, retrieval=retrieval)
  corpus, bias = topk.abstract_corpus(corpus_rows, dim, mesh, settings.corpus_dtype)
  rows_sharding, bias_sharding = topk.row_shardings(mesh)
  jitted = step_lib.jit(step, in_shardings=(setup.shardings, batch_sharding, rows_sharding, bias_sharding),
                        out_shardings=(setup.shardings, parallel.replicated(mesh)), donate_argnums=(0,))
  compiled = jitted.lower(setup.abstract, batch, corpus, bias).compile(compiler_options)
  return CompiledStep(compiled, mesh, setup.abstract, batch, corpus=(corpus, bias), corpus_rows=corpus_rows,
                      corpus_dim=dim, retrieval=retrieval)


def _size_step(config: ml_collections.ConfigDict, devices, corpus_rows: int = MSMARCO_PASSAGES,
               compiler_options: dict | None = None) -> dict:
  step = compile_step(config, devices, compiler_options, corpus_rows=corpus_rows)
  compiled, mesh, abstract, batch = step.compiled, step.mesh, step.abstract, step.batch
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  devices = int(np.prod(list(mesh.shape.values())))
  # XLA's GPU compiler gives no cost analysis without a GPU: None, not a zero that reads as a figure.
  flops = float(cost["flops"]) if cost and "flops" in cost else None
  return {
      "mesh": dict(mesh.shape), "rules": config.mesh.rules, "devices": devices, "batch_size": config.batch_size,
      "query_length": config.data.query_max_length, "doc_length": config.data.doc_max_length,
      "parameters": int(sum(np.prod(x.shape) for x in jax.tree.leaves(abstract.params))),
      "params_bytes_per_device": per_device_bytes(abstract.params),
      "optimizer_bytes_per_device": per_device_bytes(abstract.opt_state),
      **_adapter_figures(abstract.params),
      "batch_bytes_per_device": per_device_bytes(batch),
      "argument_bytes": int(memory.argument_size_in_bytes), "output_bytes": int(memory.output_size_in_bytes),
      "temp_bytes": int(memory.temp_size_in_bytes), "alias_bytes": int(memory.alias_size_in_bytes),
      "total_bytes_per_device": int(memory.argument_size_in_bytes + memory.output_size_in_bytes
                                    + memory.temp_size_in_bytes - memory.alias_size_in_bytes),
      # XLA's cost analysis of the SPMD-partitioned module: what one device executes, replicated work (a
      # data-parallel optimizer update) included, so the sum over devices exceeds the model's own count.
      "flops_per_device": flops, "flops_all_devices": flops * devices if flops is not None else None,
      # XLA counts a loop's body once: gradient caching's chunk loops then report one chunk of each pass.
      "flops_cover": "one chunk per gradient-caching loop" if config.grad_cache.chunk_size else "the step",
      **_corpus_figures(step),
  }


def _adapter_figures(params) -> dict:
  """LoRA's adapters (inside the params figures): their count and bytes per device; {} without LoRA."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  adapters = [x for path, x in flat if any(getattr(k, "key", None) in decoder.LORA_PARAMS for k in path)]
  if not adapters:
    return {}
  return {"adapter_parameters": int(sum(np.prod(x.shape) for x in adapters)),
          "adapter_bytes_per_device": per_device_bytes(adapters)}


def _corpus_figures(step: CompiledStep) -> dict:
  """A corpus step's matrix: its row shard per device (inside argument_bytes when on the devices) and what
  the host holds instead with Faiss (the float32 encoding, memory-mapped)."""
  if step.retrieval is None:
    return {}
  on_devices = per_device_bytes(step.corpus) if step.corpus is not None else 0
  return {"corpus_rows": step.corpus_rows, "corpus_dim": step.corpus_dim, "retrieval": step.retrieval,
          "corpus_dtype": str(jax.tree.leaves(step.corpus)[0].dtype) if step.corpus is not None else None,
          "corpus_bytes_per_device": on_devices,
          "corpus_host_bytes": 0 if step.corpus is not None else step.corpus_rows * step.corpus_dim * 4}


def report(sizes: dict, file=None) -> None:
  file = file or sys.stdout
  mib = lambda b: f"{b / 2**20:,.1f} MiB"
  on = f" of {sizes['topology']} ({sizes['device_kind']})" if sizes.get("topology") else ""
  print(f"mesh {sizes['mesh']}{on} ({sizes['rules']}), batch {sizes['batch_size']}, {sizes['parameters']:,} parameters; "
        f"per device: params {mib(sizes['params_bytes_per_device'])}"
        + (f" (LoRA adapters {mib(sizes['adapter_bytes_per_device'])}, {sizes['adapter_parameters']:,} parameters)"
           if "adapter_bytes_per_device" in sizes else "") + ", optimizer "
        f"{mib(sizes['optimizer_bytes_per_device'])}, activations and other temporaries {mib(sizes['temp_bytes'])}, "
        f"step total {mib(sizes['total_bytes_per_device'])}; " + (
            f"{sizes['flops_per_device'] / 1e12:.3f} TFLOP per device per step"
            + ("" if sizes.get("flops_cover", "the step") == "the step" else
               f" ({sizes['flops_cover']}: XLA counts a loop's body once)")
            if sizes["flops_per_device"] is not None else "FLOPs not reported by this compiler"),
        file=file)
  if sizes.get("retrieval"):
    where = (f"on the devices, {sizes['corpus_dtype']}: {mib(sizes['corpus_bytes_per_device'])} per device, inside "
             "the step total" if sizes["retrieval"] != "host" else
             f"on the host (Faiss, float32, memory-mapped): {sizes['corpus_host_bytes'] / 2**30:,.2f} GiB; none on "
             "the devices")
    print(f"corpus {sizes['corpus_rows']:,} x {sizes['corpus_dim']}, candidates {sizes['retrieval']}, {where}",
          file=file)
  print(json.dumps(sizes), file=file)
