"""Exact top-k inner products over a corpus matrix sharded by rows: the one search every JAX caller uses.

ADORE / LTRe retrieving inside the jitted step, dense-static and ANCE mining, the trainer's evaluation and
`jdr.retrieve --backend jax` (through `index.JaxRetriever`) all call `sharded_top_k` here.

Why two passes: a single `lax.top_k` over a [queries, 8.8M] score matrix is a sort-like pass that runs far
below memory speed on accelerators (on an H200, many times the time of reading the bf16 matrix once:
docs/performance.md, `device`, "The exact top-k"). The search instead reduces each block of `block_rows`
consecutive rows to its maximum score, takes the top k blocks, and runs the final top-k over the k * block_rows
scores of those blocks only. It is exact: a row in the true top k lies in one of the k blocks with the highest
maxima (each better block contributes a row that outranks it). Ties go to the lower row everywhere:
`lax.top_k` keeps the lower index first, the winning blocks are put back in row order before the second pass,
and the devices' candidates are merged in row order.

Storage: float32, bfloat16 (half the bytes, the default on accelerators) or int8 with one float32 scale per
row (a quarter; the accelerator counterpart of a compressed index, approximate). Scores accumulate in
float32 whatever the storage. An int8 corpus is a `QuantizedRows` pair whose scale is stored as [N, 1], so one
row sharding fits both of its arrays.

Row padding (to a multiple of devices x block_rows) carries a -inf bias, so a padding row never wins.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jdr.runtime import parallel

DTYPES = ("auto", "float32", "bfloat16", "int8")
DEFAULT_BLOCK_ROWS = 128


class QuantizedRows(NamedTuple):
  """An int8 corpus: row i is approximately values[i] * scale[i]."""
  values: jax.Array  # int8 [N, D]
  scale: jax.Array   # float32 [N, 1]


def resolve_dtype(dtype: str, platform: str | None = None) -> str:
  """"auto" is bfloat16 on GPUs and TPUs (memory speed is the limit there) and float32 on CPUs (exact)."""
  if dtype not in DTYPES:
    raise ValueError(f"corpus dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
  if dtype != "auto":
    return dtype
  platform = platform or jax.default_backend()
  return "float32" if platform == "cpu" else "bfloat16"


def quantize_int8(matrix):
  """(int8 [N, D], float32 scale [N, 1]) with row i ~ values[i] * scale[i]: symmetric, one scale per row.
  numpy in, numpy out; a jax array in (also under jit), jax arrays out."""
  xp = jnp if isinstance(matrix, jax.Array) else np
  matrix = xp.asarray(matrix, xp.float32)
  peak = xp.max(xp.abs(matrix), axis=1, keepdims=True)
  scale = xp.where(peak > 0, peak / 127.0, 1.0).astype(xp.float32)
  values = xp.clip(xp.rint(matrix / scale), -127, 127).astype(xp.int8)
  return values, scale


def dequantize(corpus) -> jax.Array:
  """Float32 rows of a stored corpus (any storage dtype)."""
  if isinstance(corpus, QuantizedRows):
    return corpus.values.astype(jnp.float32) * corpus.scale
  return corpus.astype(jnp.float32)


def storage_bytes_per_row(dim: int, dtype: str) -> int:
  return {"float32": 4 * dim, "bfloat16": 2 * dim, "int8": dim + 4}[dtype]


# ------------------------------------------------------------------------------------------------ placement


@dataclasses.dataclass
class ShardedCorpus:
  """A corpus matrix on a mesh: `rows` (an array, or QuantizedRows) [N_pad, D] and `bias` [N_pad] (0 for
  documents, -inf for padding), both sharded by rows over every axis of the mesh."""
  rows: object
  bias: jax.Array
  num_docs: int
  dtype: str
  block_rows: int

  @property
  def padded_rows(self) -> int:
    return int(self.bias.shape[0])


def row_shardings(mesh) -> tuple[NamedSharding, NamedSharding]:
  """(the rows' sharding, the bias's sharding): rows split over all the mesh's axes."""
  axes = tuple(mesh.axis_names)
  return NamedSharding(mesh, P(axes, None)), NamedSharding(mesh, P(axes))


def padded_size(num_docs: int, devices: int, block_rows: int) -> int:
  unit = devices * block_rows
  return max(unit, -(-num_docs // unit) * unit)


PUT_CHUNK_BYTES = 256 << 20  # host memory a placement holds at once, whatever the corpus size


def put_corpus(matrix: np.ndarray, mesh, dtype: str = "auto",
               block_rows: int = DEFAULT_BLOCK_ROWS) -> ShardedCorpus:
  """Places a host [N, D] matrix on the mesh, each device copying only its own rows (so every host of a
  multi-host job may pass the same full matrix). Rows are padded to a multiple of devices x block_rows.

  The host side holds one chunk of rows at a time (`PUT_CHUNK_BYTES`, converted to the storage dtype there),
  never a device's whole shard: at MS MARCO's size a shard is gigabytes, and `matrix` is typically a
  memory-mapped encoding that should stay on disk. Each device's rows are filled in place (a donated update
  of a zero buffer), so the device holds one copy too."""
  dtype = resolve_dtype(dtype, mesh.devices.flat[0].platform)
  if block_rows < 1:
    raise ValueError(f"block_rows must be positive, got {block_rows}")
  n, dim = matrix.shape
  padded = padded_size(n, int(mesh.devices.size), block_rows)
  rows_sharding, bias_sharding = row_shardings(mesh)
  chunk = max(1, PUT_CHUNK_BYTES // max(1, 4 * dim))

  def placed(convert, store_dtype, width):
    """A [padded, width] array sharded as rows_sharding, row r = convert(matrix[r]) (zeros past n)."""
    shape = (padded, width)
    shards = []
    for device, index in rows_sharding.addressable_devices_indices_map(shape).items():
      start = index[0].start or 0
      stop = padded if index[0].stop is None else index[0].stop
      buffer = _zeros((stop - start, width), store_dtype, device)
      for lo in range(start, min(stop, n), chunk):
        hi = min(stop, n, lo + chunk)
        part = jax.device_put(convert(np.asarray(matrix[lo:hi], np.float32)).astype(store_dtype), device)
        buffer = _fill(buffer, part, lo - start)
      shards.append(buffer)
    return jax.make_array_from_single_device_arrays(shape, rows_sharding, shards)

  if dtype == "int8":  # one scale per row: quantizing a chunk is quantizing its rows
    rows = QuantizedRows(placed(lambda x: quantize_int8(x)[0], np.int8, dim),
                         placed(lambda x: quantize_int8(x)[1], np.float32, 1))
  else:
    store = jnp.bfloat16 if dtype == "bfloat16" else np.float32
    rows = placed(lambda x: x, store, dim)
  bias = np.where(np.arange(padded) < n, 0.0, -np.inf).astype(np.float32)
  device_bias = jax.make_array_from_callback(bias.shape, bias_sharding, lambda index: bias[index])
  return ShardedCorpus(rows, device_bias, n, dtype, block_rows)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _zeros_jit(shape, dtype, device_name):  # pylint: disable=unused-argument  (one cache entry a device)
  return jnp.zeros(shape, dtype)


def _zeros(shape, dtype, device) -> jax.Array:
  """Zeros made on the device itself: a host-side zeros array would be the shard-sized copy avoided here."""
  with jax.default_device(device):
    return _zeros_jit(tuple(shape), jnp.dtype(dtype), str(device))


@functools.partial(jax.jit, donate_argnums=(0,))
def _fill(buffer: jax.Array, part: jax.Array, at) -> jax.Array:
  return jax.lax.dynamic_update_slice(buffer, part, (at, 0))


def abstract_corpus(num_docs: int, dim: int, mesh, dtype: str = "auto",
                    block_rows: int = DEFAULT_BLOCK_ROWS) -> tuple[Any, jax.ShapeDtypeStruct]:
  """(rows, bias) of a corpus as put_corpus would place it, as sharded ShapeDtypeStructs: for compiling a
  search or a step over a corpus that is never created (sizing, the compiled-kernels benchmark)."""
  dtype = resolve_dtype(dtype, mesh.devices.flat[0].platform)
  padded = padded_size(num_docs, int(mesh.devices.size), block_rows)
  rows_sharding, bias_sharding = row_shardings(mesh)
  struct = lambda shape, dt, sh: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # pylint: disable=unnecessary-lambda-assignment
  if dtype == "int8":
    rows = QuantizedRows(struct((padded, dim), jnp.int8, rows_sharding), struct((padded, 1), jnp.float32, rows_sharding))
  else:
    rows = struct((padded, dim), jnp.bfloat16 if dtype == "bfloat16" else jnp.float32, rows_sharding)
  return rows, struct((padded,), jnp.float32, bias_sharding)


# ------------------------------------------------------------------------------------------------ search


def scores(queries: jax.Array, rows, precision=None) -> jax.Array:
  """float32 [B, N] inner products of queries [B, D] with stored rows (any storage dtype)."""
  if isinstance(rows, QuantizedRows):
    # int8 widens to the queries' compute type inside the matmul; the row scale applies to the result.
    compute = jnp.float32 if parallel.platform() == "cpu" else jnp.bfloat16
    raw = jnp.dot(queries.astype(compute), rows.values.astype(compute).T, precision=precision,
                  preferred_element_type=jnp.float32)
    return raw * rows.scale[:, 0][None, :]
  if precision is None and rows.dtype == jnp.float32:
    # TF32 / bf16 passes on GPUs and TPUs would reorder near-ties of a float32 corpus.
    precision = jax.lax.Precision.HIGHEST
  return jnp.dot(queries.astype(rows.dtype), rows.T, precision=precision, preferred_element_type=jnp.float32)


def block_top_k(scores_: jax.Array, k: int, block_rows: int = DEFAULT_BLOCK_ROWS,
                recall_target: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """(values, columns) of the top k of each row of float32 scores [B, N], best first, ties to the lower column.

  Exact two-pass search (top k blocks by their maximum, then top k over those blocks' entries) when it saves
  work, one `lax.top_k` otherwise. recall_target < 1 takes `lax.approx_max_k` instead (fast on TPUs, where it
  finds at least that share of the true top k; exact elsewhere).
  """
  b, n = scores_.shape
  k = min(k, n)
  if recall_target < 1.0:
    return jax.lax.approx_max_k(scores_, k, recall_target=recall_target)
  num_blocks = -(-n // block_rows)
  if num_blocks <= k:  # the k best blocks would be all of them
    return jax.lax.top_k(scores_, k)
  if n % block_rows:  # callers pad the corpus so this is rare: -inf columns never win
    scores_ = jnp.pad(scores_, ((0, 0), (0, num_blocks * block_rows - n)), constant_values=-jnp.inf)
  blocks = scores_.reshape(b, num_blocks, block_rows)
  _, best = jax.lax.top_k(jnp.max(blocks, axis=2), k)
  best = jnp.sort(best, axis=1)  # back to row order, so equal scores keep the lower row first
  picked = jax.vmap(lambda x, i: x[i])(blocks, best).reshape(b, k * block_rows)
  columns = (best[:, :, None] * block_rows + jnp.arange(block_rows)[None, None, :]).reshape(b, k * block_rows)
  values, where = jax.lax.top_k(picked, k)
  return values, jnp.take_along_axis(columns, where, axis=1)


def sharded_top_k(queries: jax.Array, rows, bias: jax.Array, k: int, mesh,
                  block_rows: int = DEFAULT_BLOCK_ROWS, recall_target: float = 1.0,
                  precision=None) -> tuple[jax.Array, jax.Array]:
  """(scores float32 [B, k], rows int32 [B, k]) of the top k of queries [B, D] over the row-sharded corpus.

  Each device searches its own rows (`block_top_k`); one all-gather of k candidates per device and a last
  top-k merge them, in device order, so ties still go to the lower row. No device holds the [B, N] scores
  of another. Callable inside jit (the ADORE step) or jitted alone (`search_fn`).
  """
  axes = tuple(mesh.axis_names)
  rows_per_device = bias.shape[0] // int(mesh.devices.size)
  k = min(k, bias.shape[0])
  k_local = min(k, rows_per_device)

  def local(q, stored, b):
    s = scores(q, stored, precision) + b[None, :]
    values, columns = block_top_k(s, k_local, block_rows, recall_target)
    columns = columns + jax.lax.axis_index(axes) * b.shape[0]
    values = jax.lax.all_gather(values, axes, axis=1, tiled=True)
    columns = jax.lax.all_gather(columns, axes, axis=1, tiled=True)
    values, where = jax.lax.top_k(values, k)
    return values, jnp.take_along_axis(columns, where, axis=1)

  stored_spec = jax.tree.map(lambda _: P(axes, None), rows)
  return jax.shard_map(local, mesh=mesh, in_specs=(P(), stored_spec, P(axes)), out_specs=(P(), P()),
                       check_vma=False)(queries, rows, bias)


def search_fn(corpus: ShardedCorpus, k: int, mesh, recall_target: float = 1.0, precision=None):
  """A jitted (queries [B, D]) -> (scores, rows) over a placed corpus, for callers outside a step."""
  fn = jax.jit(lambda q, rows, bias: sharded_top_k(q, rows, bias, k, mesh, corpus.block_rows, recall_target,
                                                   precision))
  return lambda q: fn(q, corpus.rows, corpus.bias)


def gather_rows(rows, picked: jax.Array, mesh) -> jax.Array:
  """float32 corpus[picked] for picked rows of any shape (-1 gives zeros), the corpus sharded by rows.

  Each device looks up the rows it holds and contributes zeros for the rest; one psum assembles the result,
  exact because one device holds each row. No device gathers the whole matrix.
  """
  axes = tuple(mesh.axis_names)

  def local(stored, r):
    count = jax.tree.leaves(stored)[0].shape[0]
    local_rows = r - jax.lax.axis_index(axes) * count
    mine = (r >= 0) & (local_rows >= 0) & (local_rows < count)
    clipped = jnp.clip(local_rows, 0, count - 1)
    looked_up = dequantize(jax.tree.map(lambda x: jnp.take(x, clipped, axis=0), stored))
    return jax.lax.psum(jnp.where(mine[..., None], looked_up, 0.0), axes)

  stored_spec = jax.tree.map(lambda _: P(axes, None), rows)
  return jax.shard_map(local, mesh=mesh, in_specs=(stored_spec, P()), out_specs=P(),
                       check_vma=False)(rows, picked)
