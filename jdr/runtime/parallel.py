"""The device mesh, logical-axis sharding rules, multi-host start-up and global batches.

One mesh with axes ("data", "fsdp", "model") serves every scale: a single CPU is a 1x1x1 mesh, eight
GPUs are 8x1x1 for data parallelism, and a pod adds fsdp/model axes. Models name their parameter axes
("vocab", "embed", "mlp", "heads", "kv"); a rule table maps those names to mesh axes, so changing the
parallelism edits the rules, never the model.
"""

import contextlib
import os
import threading
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "model")
# The batch is split over every axis that holds a data-parallel replica of the step.
BATCH_AXES = ("data", "fsdp")

# Rule presets: logical parameter axis -> mesh axis (None = replicated). Activations' batch axis is
# always ("data", "fsdp").
RULES = {
    # Data parallel: parameters replicated, batch split.
    "dp": (("batch", BATCH_AXES),),
    # Fully sharded data parallel (ZeRO-3 style): each parameter's embed axis split over "fsdp".
    "fsdp": (("batch", BATCH_AXES), ("embed", "fsdp")),
    # Tensor parallel (Megatron style): attention heads and the MLP's hidden axis split over "model".
    "tp": (("batch", BATCH_AXES), ("heads", "model"), ("mlp", "model"), ("vocab", "model")),
    "fsdp_tp": (("batch", BATCH_AXES), ("embed", "fsdp"), ("heads", "model"), ("mlp", "model"),
                ("vocab", "model")),
}


@contextlib.contextmanager
def _scoped(state: threading.local, value):
  """Sets `state.value` while the block runs (traces read it), restoring what was there before."""
  previous = getattr(state, "value", None)
  state.value = value
  try:
    yield
  finally:
    state.value = previous


_TARGET = threading.local()


def platform() -> str:
  """The platform the code being traced will run on: jax's default backend, or the one `compiling_for` names
  (ahead-of-time compilation for a TPU slice from a CPU host). Platform-dependent defaults (bfloat16 compute,
  fused attention) ask this, not jax.default_backend()."""
  return getattr(_TARGET, "value", None) or jax.default_backend()


def compiling_for(target: str):
  """Traces inside take `target` ("tpu", "gpu", "cpu") as their platform (see `platform`)."""
  return _scoped(_TARGET, target)


_ACTIVATIONS = threading.local()


def activations_on(mesh: Mesh):
  """While a step is traced: the towers keep their activations split by rows over the mesh's batch axes
  (`constrain_rows`). Explicit NamedShardings, since a global mesh cannot be set inside jit."""
  return _scoped(_ACTIVATIONS, mesh)


def activation_mesh() -> Mesh | None:
  """The mesh set by `activations_on` while a step is traced, else None."""
  return getattr(_ACTIVATIONS, "value", None)


_ROWS_VMAPPED = threading.local()


def rows_vmapped():
  """While traced inside: the towers see one row at a time under `jax.vmap(..., spmd_axis_name=BATCH_AXES)`
  (gradient caching's per-row encoders, XLA-partitioned), so `constrain_rows` pins the vmapped rows instead.
  Without it XLA may split a chunk's activations by width after the FSDP-split weights, every device holding
  every row of the chunk."""
  return _scoped(_ROWS_VMAPPED, True)


def constrain_rows(x: jax.Array) -> jax.Array:
  """x [rows, ...] with the batch sharding inside `activations_on` (a no-op elsewhere, and for row counts
  the batch axes do not divide, such as gradient caching's single rows outside `rows_vmapped`)."""
  mesh = activation_mesh()
  if mesh is None:
    return x
  if getattr(_ROWS_VMAPPED, "value", None):
    # One row of a vmap whose spmd_axis_name is BATCH_AXES: "replicated" here is the rows split over them.
    return jax.lax.with_sharding_constraint(x, replicated(mesh))
  if x.shape[0] % data_parallel_size(mesh):
    return x
  return jax.lax.with_sharding_constraint(x, batch_sharding(mesh))


def initialize_distributed() -> None:
  """Joins a multi-host job when the launcher set the coordinator variables; a no-op otherwise.

  TPU pods and SLURM are detected by jax itself; JDR_COORDINATOR / JDR_NUM_PROCESSES /
  JDR_PROCESS_ID start any other launcher's processes (several on one machine included).
  """
  # Nothing here may touch a jax backend (not even jax.process_count()) before initialize().
  if getattr(initialize_distributed, "_done", False):
    return
  if "JDR_COORDINATOR" in os.environ:
    jax.distributed.initialize(
        coordinator_address=os.environ["JDR_COORDINATOR"],
        num_processes=int(os.environ["JDR_NUM_PROCESSES"]),
        process_id=int(os.environ["JDR_PROCESS_ID"]))
  elif any(k in os.environ for k in ("SLURM_JOB_ID", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")):
    jax.distributed.initialize()
  initialize_distributed._done = True  # pytype: disable=attribute-error


def usable_cores() -> int:
  """The CPU cores this process may run on (its affinity mask, where the platform has one)."""
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# mesh.cpu_devices=-1 splits a CPU host into at most this many devices, one per core.
MAX_AUTO_CPU_DEVICES = 8


def auto_cpu_devices(batch_size: int, chunk_size: int = 0, replica_bytes: int | None = None) -> int:
  """What mesh.cpu_devices=-1 (the default) asks `use_cpu_devices` for: one XLA device per core this process
  may use, at most MAX_AUTO_CPU_DEVICES, the most that split the batch (and each gradient-caching chunk), and
  only as many as a quarter of the host's memory holds copies of the training state (`replica_bytes` each: the
  parameters, their gradients and the optimizer's moments; None, not known: one device). 0 (JAX's one device)
  where that is one, and where the count is fixed already: XLA_FLAGS' --xla_force_host_platform_device_count
  (the local launcher's), an earlier jax_num_cpu_devices, or a backend that has started.

  Why one per core: on 2-core CPUs MiniLM's step ran 10-13% faster and the un-cached pretraining step 1.3-1.6x
  as fast on two devices as on one (docs/performance.md, `train-step` and `pretrain`). On an accelerator host
  the mesh takes the accelerators, and the CPU devices go unused."""
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  if ("xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
      or jax.config.jax_num_cpu_devices > 0 or xla_bridge.backends_are_initialized()):
    return 0
  limit = min(usable_cores(), MAX_AUTO_CPU_DEVICES) if replica_bytes is not None else 1
  memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  while limit > 1 and (limit - 1) * replica_bytes > memory // 4:
    limit -= 1
  count = devices_that_split(limit, batch_size, chunk_size)
  return count if count > 1 else 0


def devices_that_split(limit: int, batch_size: int, chunk_size: int = 0) -> int:
  """The most devices, up to `limit`, that split the batch and each gradient-caching chunk evenly (at least 1)."""
  return max(n for n in range(1, max(1, limit) + 1) if not batch_size % n and not (chunk_size or 0) % n)


def use_cpu_devices(count: int) -> None:
  """Splits this host's CPU into `count` XLA devices (config mesh.cpu_devices); 0 keeps JAX's one device.

  With mesh.shape (-1, 1, 1) the batch is then split over the host's cores as over any devices. Why: XLA's CPU
  runtime runs one program's graph with a core idle much of the time, while two programs keep both busy, so on
  a 2-core CPU two devices train faster than one (docs/performance.md, `train-step`, "Two CPU devices"). It only
  adds CPU devices: on a GPU or TPU host the mesh still takes the accelerators. JAX fixes the count when its
  first backend starts, so this must come before anything runs on JAX (the trainer calls it first).
  """
  if count <= 0:
    return
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError as e:  # a backend has started already
    have = len(jax.devices("cpu"))
    if have != count:
      raise ValueError(f"mesh.cpu_devices={count}: JAX already runs in this process with {have} CPU device(s); "
                       "set it for a fresh process (python -m jdr.train ... --config.mesh.cpu_devices=N)") from e


def make_mesh(shape: Sequence[int] = (-1, 1, 1), devices: Sequence[Any] | None = None) -> Mesh:
  """A ("data", "fsdp", "model") mesh; one -1 entry takes all the remaining devices."""
  devices = list(devices if devices is not None else jax.devices())
  shape = list(shape)
  if len(shape) != len(MESH_AXES):
    raise ValueError(f"mesh shape {shape} must have {len(MESH_AXES)} entries for axes {MESH_AXES}")
  if shape.count(-1) > 1:
    raise ValueError(f"mesh shape {shape}: at most one -1")
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if len(devices) % known:
      raise ValueError(f"mesh shape {shape} does not divide the {len(devices)} devices")
    shape[shape.index(-1)] = len(devices) // known
  needed = int(np.prod(shape))
  if needed > len(devices) or (needed < len(devices) and jax.process_count() > 1):
    raise ValueError(f"mesh shape {tuple(shape)} needs {needed} devices, but {len(devices)} are present")
  # A smaller mesh on one host takes the first devices: (1, 1, 1) is the single-device reference run.
  devices = devices[:needed]
  # Auto axes: shardings are given explicitly at the jit boundary and XLA propagates the rest.
  return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def rules_for(preset: str | Sequence[Sequence[Any]]) -> tuple:
  """A rule table from a preset name or an explicit ((logical, mesh_axis), ...) list."""
  if isinstance(preset, str):
    if preset not in RULES:
      raise ValueError(f"unknown sharding rules {preset!r}; choose one of {sorted(RULES)} "
                       "or give ((logical_axis, mesh_axis), ...)")
    return RULES[preset]
  return tuple((name, tuple(axis) if isinstance(axis, list) else axis) for name, axis in preset)


def shards_params_over_batch(rules: tuple) -> bool:
  """Whether a rule table splits some parameter axis over a data-parallel mesh axis (FSDP)."""
  for logical, axis in rules:
    axes = axis if isinstance(axis, tuple) else (axis,)
    if logical != "batch" and any(a in BATCH_AXES for a in axes):
      return True
  return False


def tree_shardings(abstract_tree: Any, mesh: Mesh, rules: tuple) -> Any:
  """NamedShardings for a pytree whose leaves may be nn.LogicallyPartitioned boxes (others: replicated).

  Works on optimizer states too: optax copies the boxes into its moments, and a box holding optax's
  MaskedNode (a frozen parameter) stays a leafless MaskedNode, so the result matches the unboxed tree.
  """
  def sharding(leaf):
    if isinstance(leaf, nn.LogicallyPartitioned):
      if not jax.tree.leaves(leaf.value):
        return leaf.value
      return NamedSharding(mesh, nn.logical_to_mesh_axes(leaf.names, rules))
    return NamedSharding(mesh, P())

  return jax.tree.map(sharding, abstract_tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (example) axis split over the data-parallel axes, the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def data_parallel_size(mesh: Mesh) -> int:
  return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def global_batch(local_batch: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles each host's slice of the batch into global arrays sharded over the batch axes.

  Every host passes only its own rows (global_batch_size / process_count of them); on one host this
  is a plain device_put with the batch sharding.
  """
  sharding = batch_sharding(mesh)
  return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local_batch.items()}


def check_batch_size(global_batch_size: int, mesh: Mesh) -> None:
  """Refuses, before any step runs, a batch that does not split evenly over devices and hosts."""
  n = data_parallel_size(mesh)
  if global_batch_size % n:
    raise ValueError(f"batch_size={global_batch_size} is not divisible by the {n} data-parallel "
                     f"devices of the mesh {dict(mesh.shape)}; use a multiple of {n}")
  if global_batch_size % jax.process_count():
    raise ValueError(f"batch_size={global_batch_size} is not divisible by the "
                     f"{jax.process_count()} processes")


def raise_if_any_host_failed(error: BaseException | None, what: str) -> None:
  """Every host learns whether any host failed `what`, and all raise together: a host that raised alone
  would leave the others waiting in their next collective for ever. One host: raises `error` if any."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    failed = np.asarray(multihost_utils.process_allgather(np.int32(error is not None))).ravel()
    if error is None and failed.any():
      raise ValueError(f"host(s) {np.flatnonzero(failed).tolist()} failed {what}; their logs say why")
  if error is not None:
    raise error
