"""Sizing a job before it runs: `python -m jdr.train --config ... --compile-only`.

Lowers and compiles the configured train step for the configured mesh, on abstract values (no data is read,
no weights are loaded, nothing is allocated), and reports per device: the bytes of the parameters and of the
optimizer state (from their shardings), the step's compiled memory (XLA's memory analysis: arguments,
outputs, temporaries, i.e. activations and gradients) and the FLOPs each device executes per step (XLA's
cost analysis of the partitioned module). Token batches (in-batch, sampled negatives, pretraining pairs); ADORE's corpus batches also need the
corpus, whose size `corpus_matrix_bytes` gives.
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

from jdr import optimizers
from jdr import parallel
from jdr import step as step_lib
from jdr.data import pretrain_batches
from jdr.models import build as build_lib
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


def gpu_target_devices(name: str) -> list:
  """One device of a GPU of GPU_TARGETS, for compiling for it on a host without it; needs jax's CUDA plugin
  (pip install 'jax[cuda12]'), which compiles without a GPU when JAX_SKIP_CUDA_CONSTRAINTS_CHECK is set."""
  import os  # pylint: disable=g-import-not-at-top
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  if name not in GPU_TARGETS:
    raise ValueError(f"unknown GPU target {name!r}; known: {', '.join(sorted(GPU_TARGETS))}")
  # Without a GPU the plugin's start-up check of the CUDA driver fails and jax drops the plugin.
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  try:
    return list(topologies.get_topology_desc(topology_name=name, platform="cuda", topology="1x1x1",
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


def size_step(config: ml_collections.ConfigDict, topology: str | None = None) -> dict:
  """Compiles the step of `config` for its mesh; returns the per-device figures (module docstring).

  With `topology` (a TPU slice name, or a GPU of GPU_TARGETS) the mesh is built from that slice's devices (the
  GPU's one) and the step compiled for them ahead of time, with that platform's defaults (model.dtype auto =
  bfloat16, fused attention)."""
  if topology is None:
    return _size_step(config, None)
  if topology in GPU_TARGETS:
    devices, platform = gpu_target_devices(topology), "gpu"
    kind = GPU_TARGETS[topology]["name"]
  else:
    devices, platform = topology_devices(topology), "tpu"
    kind = devices[0].device_kind
  with parallel.compiling_for(platform):
    return {**_size_step(config, devices), "topology": topology, "device_kind": kind}


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
  tx = optimizers.make_optimizer(config.optimizer, config.num_train_steps, config.model.train_towers)
  abstract, shardings = step_lib.abstract_train_state(model, tx, config, mesh, parallel.rules_for(config.mesh.rules))
  return AbstractModel(mesh, model, tx, abstract, shardings)


@dataclasses.dataclass
class CompiledStep:
  """The configured train step compiled on abstract values, with what it was compiled for."""
  compiled: Any
  mesh: Any
  abstract: step_lib.TrainState
  batch: dict


def compile_step(config: ml_collections.ConfigDict, devices=None, compiler_options: dict | None = None
                 ) -> CompiledStep:
  """Compiles the step of `config` for its mesh over `devices` (default: this host's) on abstract values."""
  sources.check(config)
  candidates = sources.candidates(config)
  if candidates == "corpus" or pretrain_batches.is_masked_lm(config):
    raise ValueError("--compile-only sizes token-batch steps; ADORE / LTRe corpus batches and masked-LM are not "
                     "covered yet (their corpus matrix: jdr.sizing.corpus_matrix_bytes)")
  setup = abstract_model(config, devices)
  parallel.check_batch_size(config.batch_size, setup.mesh)
  step = step_lib.make_train_step(setup.model, setup.tx, config, setup.mesh, candidates)
  batch = abstract_batch(config, parallel.batch_sharding(setup.mesh))
  compiled = step_lib.jit_step(step, setup.shardings, setup.mesh).lower(setup.abstract, batch).compile(
      compiler_options)
  return CompiledStep(compiled, setup.mesh, setup.abstract, batch)


def _size_step(config: ml_collections.ConfigDict, devices) -> dict:
  step = compile_step(config, devices)
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
      "batch_bytes_per_device": per_device_bytes(batch),
      "argument_bytes": int(memory.argument_size_in_bytes), "output_bytes": int(memory.output_size_in_bytes),
      "temp_bytes": int(memory.temp_size_in_bytes), "alias_bytes": int(memory.alias_size_in_bytes),
      "total_bytes_per_device": int(memory.argument_size_in_bytes + memory.output_size_in_bytes
                                    + memory.temp_size_in_bytes - memory.alias_size_in_bytes),
      # XLA's cost analysis of the SPMD-partitioned module: what one device executes, replicated work (a
      # data-parallel optimizer update) included, so the sum over devices exceeds the model's own count.
      "flops_per_device": flops, "flops_all_devices": flops * devices if flops is not None else None,
  }


def report(sizes: dict, file=None) -> None:
  file = file or sys.stdout
  mib = lambda b: f"{b / 2**20:,.1f} MiB"
  on = f" of {sizes['topology']} ({sizes['device_kind']})" if sizes.get("topology") else ""
  print(f"mesh {sizes['mesh']}{on} ({sizes['rules']}), batch {sizes['batch_size']}, {sizes['parameters']:,} parameters; "
        f"per device: params {mib(sizes['params_bytes_per_device'])}, optimizer "
        f"{mib(sizes['optimizer_bytes_per_device'])}, activations and other temporaries {mib(sizes['temp_bytes'])}, "
        f"step total {mib(sizes['total_bytes_per_device'])}; " + (
            f"{sizes['flops_per_device'] / 1e12:.3f} TFLOP per device per step"
            if sizes["flops_per_device"] is not None else "FLOPs not reported by this compiler"),
        file=file)
  print(json.dumps(sizes), file=file)
