"""Exact gradient caching (Gao et al. 2021): a contrastive batch far larger than fits in memory at once.

The loss of a two-tower retriever couples every query with every document only through the embeddings,
so its gradient factors: dL/dparams = sum over rows of (dL/dembedding_row) . (d embedding_row / dparams).
`cached_value_and_grad` computes it in three passes:

  1. encode all queries and documents chunk by chunk, keeping no activations (forward only);
  2. take the loss and its gradient with respect to the [B, D] and [C, D] embeddings (cheap: no encoder);
  3. re-run each chunk's forward under `jax.vjp` and pull that chunk's embedding gradient back into the
     parameters, summing over chunks.

Passes 1 and 3 are `lax.map` / `lax.scan` over chunks, so the compiled program does not grow with the
number of chunks and the peak holds one chunk's activations (plus the embeddings and one gradient
accumulator), at the price of running the encoders' forward twice.

Dropout keys, the one choice that makes this exact. Flax's `nn.Dropout` draws one mask for the whole
array it is given, so encoding a batch in chunks would draw different masks than encoding it at once.
Here every row gets its own key, derived from its position in the batch and nothing else:

    query_rng, doc_rng = jax.random.split(rng)
    key of query row i = jax.random.fold_in(query_rng, i); key of document row j = fold_in(doc_rng, j)

and the encoders take one key per row (`per_row_encoder` makes such an encoder from a `TwoTower`, by
vmapping the model over single rows). A row's dropout mask then depends on (rng, side, row index) only, so
every chunking, the un-chunked `plain_value_and_grad` reference, and any sharding of the batch over
devices draw the same masks. The masks are not the ones today's trainer draws (one key for the whole
batch): switching a run to gradient caching changes its dropout noise, not its distribution. A trainer
that offers both should use `plain_value_and_grad` as its un-chunked path, so both draw the same masks.

Data parallelism. `chunk_size` is the number of rows encoded at once over all devices. Without a mesh,
chunks are strided, not contiguous: chunk k holds rows k, k + n, k + 2n, ... (n chunks), so with the batch
sharded over the data axis and chunk_size a multiple of the device count every chunk takes chunk_size /
devices rows from each device's own shard (contiguous chunks would sit on one device at a time). XLA then
partitions the loops itself, exactly, but all-reduces the parameter gradient inside the backward loop,
once per chunk. Pass `mesh` (and `batch_axes`) to run both loops under `shard_map` instead: every device
loops over its own rows, sums its gradient locally and all-reduces once, as Gao et al.'s DDP code does.

A batch not divisible by chunk_size is padded up to whole chunks with copies of its last row (and key);
the padded rows' embedding gradients are exactly zero, so they add nothing to the parameter gradient
(copies of a real row rather than all-padding rows, so no padded row can produce NaN whose zero-cotangent
product would still be NaN). Prefer divisible sizes: padding is wasted compute.

Frozen parameters (a LoRA decoder's base, ADORE's document tower) are passed apart as `frozen`: the tree
of the trained ones has None where a frozen one sits, and `frozen` the reverse. Only the trained ones are
differentiated and accumulated, so a 7B base costs no gradient accumulator and no weight-gradient matmuls.
Under `shard_map` every argument is whole on every device; a trainer whose parameters are sharded over a batch
axis (FSDP) passes no mesh, so the loops stay XLA-partitioned and no device ever holds the whole model.

Shared and separate towers need nothing special: the encoders take the whole parameter tree, the vjp of
a query chunk is zero on a separate document tower's leaves (and vice versa), and both scans add into
one accumulator. A frozen tower is an encoder that returns `jax.lax.stop_gradient(...)`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

Array = jax.Array
# encode(params, ids [n, L], mask [n, L], keys [n] per-row dropout keys) -> embeddings [n, D]
Encoder = Callable[[Any, Array, Array, Array], Array]
# loss_of_embeddings(q [B, D], d [C, D]) -> (scalar loss, aux pytree)
LossOfEmbeddings = Callable[[Array, Array], tuple[Array, Any]]


def row_keys(rng: Array, n: int) -> Array:
  """Per-row keys [n]: row i gets fold_in(rng, i), independent of n and of any chunking."""
  return jax.vmap(lambda i: jax.random.fold_in(rng, i))(jnp.arange(n, dtype=jnp.uint32))


def batch_row_keys(rng: Array, num_queries: int, num_docs: int) -> tuple[Array, Array]:
  """(query keys [B], document keys [C]) as used by both `cached_value_and_grad` and the reference."""
  query_rng, doc_rng = jax.random.split(rng)
  return row_keys(query_rng, num_queries), row_keys(doc_rng, num_docs)


def per_row_encoder(model, method: str | Callable, *, deterministic: bool = False,
                    spmd_axis_name: tuple[str, ...] | None = None) -> Encoder:
  """An encoder (params, ids, mask, keys) -> [n, D] for a flax module, one dropout key per row.

  `model.apply` runs vmapped over single rows, so row i's dropout masks come from keys[i] alone; vmap
  batches the rows' matmuls back together (the params are not vmapped). Only the dropout bits are drawn
  per row (the same number of bits, from n keys instead of one).
  `method` is e.g. "encode_query" or "encode_doc" of a `jdr.models.towers.TwoTower`. `spmd_axis_name`: the
  mesh axes the rows are split over, for sharding constraints inside (`jdr.runtime.parallel.rows_vmapped`).
  """
  def encode(params, ids, mask, keys):
    def one(row_ids, row_mask, key):
      rngs = {} if deterministic else {"dropout": key}
      out = model.apply({"params": params}, row_ids[None], row_mask[None], deterministic=deterministic,
                        rngs=rngs, method=method)
      return out[0]
    return jax.vmap(one, spmd_axis_name=spmd_axis_name)(ids, mask, keys)
  return encode


def plain_value_and_grad(encode_query: Encoder, encode_doc: Encoder, loss_of_embeddings: LossOfEmbeddings,
                         params: Any, batch: dict[str, Array], rng: Array) -> tuple[Array, Any, Any]:
  """The un-chunked reference: jax.value_and_grad over the whole batch, same per-row dropout keys.

  `batch` holds "query_ids", "query_mask" [B, Lq] and "doc_ids", "doc_mask" [C, Ld]. Returns
  (loss, aux, grads) exactly as `cached_value_and_grad` does.
  """
  q_keys, d_keys = batch_row_keys(rng, batch["query_ids"].shape[0], batch["doc_ids"].shape[0])

  def loss_fn(p):
    q = encode_query(p, batch["query_ids"], batch["query_mask"], q_keys)
    d = encode_doc(p, batch["doc_ids"], batch["doc_mask"], d_keys)
    return loss_of_embeddings(q, d)

  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  return loss, aux, grads


def merged(params: Any, frozen: Any) -> Any:
  """The whole parameter tree from the trained part (None where a parameter is frozen) and the frozen part
  (None where one trains); `frozen` None: `params` is the whole tree."""
  if frozen is None:
    return params
  return jax.tree.map(lambda p, f: f if p is None else p, params, frozen, is_leaf=lambda x: x is None)


def _to_chunks(x: Array, chunk_size: int) -> Array:
  """[N, ...] -> [n, chunk_size, ...], strided (chunk k = rows k, k+n, ...), padded with the last row."""
  num = x.shape[0]
  n = math.ceil(num / chunk_size)
  pad = n * chunk_size - num
  if pad:
    # Static gather indices (not jnp.pad) so typed key arrays pad the same way as ids.
    x = x[np.concatenate([np.arange(num), np.full(pad, num - 1)])]
  return jnp.swapaxes(x.reshape((chunk_size, n) + x.shape[1:]), 0, 1)


def _from_chunks(x: Array, num: int) -> Array:
  """Inverse of `_to_chunks`: [n, chunk_size, ...] -> [num, ...]."""
  x = jnp.swapaxes(x, 0, 1)
  return x.reshape((-1,) + x.shape[2:])[:num]


def _zero_pad_chunks(g: Array, chunk_size: int) -> Array:
  """Embedding gradients [N, D] into chunks, padded rows getting exactly zero."""
  num = g.shape[0]
  pad = math.ceil(num / chunk_size) * chunk_size - num
  if pad:
    g = jnp.concatenate([g, jnp.zeros((pad,) + g.shape[1:], g.dtype)])
  return _to_chunks(g, chunk_size)


def _encode_no_grad(encode: Encoder, params, ids, mask, keys, chunk_size: int) -> Array:
  """`params` is the whole tree here (`merged`)."""
  chunks = (_to_chunks(ids, chunk_size), _to_chunks(mask, chunk_size), _to_chunks(keys, chunk_size))
  params = jax.lax.stop_gradient(params)
  out = jax.lax.map(lambda c: encode(params, *c), chunks)
  return _from_chunks(out, ids.shape[0])


def _backprop_chunks(encode: Encoder, params, frozen, ids, mask, keys, emb_grad, chunk_size: int, acc):
  """acc + sum over chunks of vjp(encode chunk)(chunk's embedding gradient) with respect to the trained
  `params`, one chunk live at a time."""
  xs = (_to_chunks(ids, chunk_size), _to_chunks(mask, chunk_size), _to_chunks(keys, chunk_size),
        _zero_pad_chunks(emb_grad, chunk_size))

  def body(total, chunk):
    c_ids, c_mask, c_keys, c_grad = chunk
    emb, pull = jax.vjp(lambda p: encode(merged(p, frozen), c_ids, c_mask, c_keys), params)
    (g,) = pull(c_grad.astype(emb.dtype))
    return jax.tree.map(jnp.add, total, g), None

  acc, _ = jax.lax.scan(body, acc, xs)
  return acc


def cached_value_and_grad(encode_query: Encoder, encode_doc: Encoder, loss_of_embeddings: LossOfEmbeddings,
                          params: Any, batch: dict[str, Array], rng: Array, *, chunk_size: int,
                          mesh: Mesh | None = None, batch_axes: tuple[str, ...] = ("data",),
                          frozen: Any = None) -> tuple[Array, Any, Any]:
  """(loss, aux, grads) equal to `plain_value_and_grad` (the un-chunked value_and_grad), in chunks.

  encode_query / encode_doc: (params, ids [n, L], mask [n, L], keys [n]) -> [n, D], one dropout key per
    row (see `per_row_encoder`); they must treat rows independently (no batch statistics), as towers do.
  loss_of_embeddings: (q [B, D], d [C, D]) -> (scalar, aux); close over any other batch fields (valid,
    labels, weights) there.
  batch: "query_ids", "query_mask" [B, Lq] and "doc_ids", "doc_mask" [C, Ld]; C need not equal B.
  rng: one key (raw uint32[2] or typed); row keys follow from it as the module docstring says.
  chunk_size: rows encoded at once over all devices (a static int >= 1), for queries and documents alike;
    a size that does not divide B or C pads the last chunk (module docstring). chunk_size >= B: one chunk.
  mesh, batch_axes: data parallelism. Without a mesh the chunk loops are ordinary jit code and XLA
    partitions them; that is exact, but XLA all-reduces the parameter gradient inside the backward loop,
    once per chunk. With the mesh, the two chunk loops run under `shard_map` over `batch_axes` (e.g.
    `jdr.runtime.parallel.BATCH_AXES`): each device loops over chunks of its own rows, keeps a local gradient sum
    and all-reduces it once. There B, C and chunk_size must be multiples of the number of batch shards
    (chunk_size / shards rows per device per chunk); other mesh axes stay automatic. Every parameter is
    whole on every device there, so parameters sharded over a batch axis (FSDP) want no mesh.
  frozen: parameters not to differentiate, with None where `params` has one (module docstring); the
    encoders get both merged, the gradients have None where `frozen` has a value.
  Pure and jit-able; call it inside the jitted step.
  """
  if not isinstance(chunk_size, (int, np.integer)) or isinstance(chunk_size, bool) or chunk_size < 1:
    raise ValueError(f"chunk_size must be a positive int (rows encoded at once); got {chunk_size!r}")
  q_ids, q_mask, d_ids, d_mask = (batch[k] for k in ("query_ids", "query_mask", "doc_ids", "doc_mask"))
  num_q, num_d = q_ids.shape[0], d_ids.shape[0]
  q_keys, d_keys = batch_row_keys(rng, num_q, num_d)
  q_chunk, d_chunk = min(chunk_size, num_q), min(chunk_size, num_d)
  shards = 1
  if mesh is not None:
    batch_axes = tuple(batch_axes)
    shards = int(np.prod([mesh.shape[a] for a in batch_axes]))
    for what, size in (("queries", num_q), ("documents", num_d), ("chunk_size", chunk_size)):
      if size % shards:
        raise ValueError(f"gradient caching over mesh axes {batch_axes} ({shards} shards): {what} = {size} "
                         f"is not a multiple of {shards}")
  q_local, d_local = q_chunk // shards, d_chunk // shards

  def encode_all(params, frozen, q_ids, q_mask, q_keys, d_ids, d_mask, d_keys):
    whole = merged(params, frozen)
    return (_encode_no_grad(encode_query, whole, q_ids, q_mask, q_keys, q_local),
            _encode_no_grad(encode_doc, whole, d_ids, d_mask, d_keys, d_local))

  def backprop_all(params, frozen, q_ids, q_mask, q_keys, q_grad, d_ids, d_mask, d_keys, d_grad):
    if mesh is not None:
      # Varying params: their vjp is then this device's sum, not an all-reduce per chunk (shard_map
      # transposes the implicit broadcast of invariant params into a psum).
      params = jax.lax.pcast(params, batch_axes, to="varying")
    grads = jax.tree.map(jnp.zeros_like, params)
    grads = _backprop_chunks(encode_query, params, frozen, q_ids, q_mask, q_keys, q_grad, q_local, grads)
    grads = _backprop_chunks(encode_doc, params, frozen, d_ids, d_mask, d_keys, d_grad, d_local, grads)
    return grads if mesh is None else jax.lax.psum(grads, batch_axes)

  if mesh is not None:
    rows = P(batch_axes)
    encode_all = jax.shard_map(encode_all, mesh=mesh, in_specs=(P(), P()) + (rows,) * 6,
                               out_specs=(rows, rows), axis_names=set(batch_axes))
    backprop_all = jax.shard_map(backprop_all, mesh=mesh, in_specs=(P(), P()) + (rows,) * 8, out_specs=P(),
                                 axis_names=set(batch_axes))

  # 1. Embeddings of the whole batch, no activations kept.
  q, d = encode_all(params, frozen, q_ids, q_mask, q_keys, d_ids, d_mask, d_keys)
  # 2. The loss and its gradient with respect to the embeddings: the "cache".
  (loss, aux), (q_grad, d_grad) = jax.value_and_grad(loss_of_embeddings, argnums=(0, 1), has_aux=True)(q, d)
  # 3. Each chunk's forward again, under vjp, its cached gradient pulled back into the params.
  grads = backprop_all(params, frozen, q_ids, q_mask, q_keys, q_grad, d_ids, d_mask, d_keys, d_grad)
  return loss, aux, grads


# ---------------------------------------------------------------- memory measurement

def in_batch_softmax_loss(q: Array, d: Array) -> tuple[Array, dict]:
  """Softmax NLL of query b against all documents, document b positive (C >= B); for measurements."""
  scores = (q @ d.T).astype(jnp.float32)
  log_probs = jax.nn.log_softmax(scores, axis=-1)
  b = q.shape[0]
  return -jnp.mean(log_probs[jnp.arange(b), jnp.arange(b)]), {}


def step_bytes(model, batch_size: int, *, query_len: int, doc_len: int, chunk_size: int | None = None,
               docs_per_query: int = 1, loss_of_embeddings: LossOfEmbeddings = in_batch_softmax_loss,
               compiler_options: dict | None = None) -> dict:
  """Compiled memory of one (loss, grads) computation for a `TwoTower`, from XLA's memory analysis.

  Nothing is allocated: params and batch are abstract. chunk_size None is the un-chunked
  `plain_value_and_grad`. Returns {"temp", "argument", "output", "alias", "total"} in bytes, total =
  argument + output + temp - alias (params and grads are in argument and output). `compiler_options` go to
  XLA's compile (tests lower the CPU backend's optimization level to compile faster).
  """
  from flax import linen as nn  # here: the rest of the module needs no flax

  ones_q = jnp.ones((1, query_len), jnp.int32)
  ones_d = jnp.ones((1, doc_len), jnp.int32)
  params = jax.eval_shape(lambda r: nn.unbox(model.init(r, ones_q, ones_q, ones_d, ones_d)["params"]),
                          jax.random.PRNGKey(0))
  num_docs = batch_size * docs_per_query
  batch = {"query_ids": jax.ShapeDtypeStruct((batch_size, query_len), jnp.int32),
           "query_mask": jax.ShapeDtypeStruct((batch_size, query_len), jnp.int32),
           "doc_ids": jax.ShapeDtypeStruct((num_docs, doc_len), jnp.int32),
           "doc_mask": jax.ShapeDtypeStruct((num_docs, doc_len), jnp.int32)}
  rng = jax.ShapeDtypeStruct((2,), jnp.uint32)
  enc_q, enc_d = per_row_encoder(model, "encode_query"), per_row_encoder(model, "encode_doc")
  if chunk_size is None:
    fn = functools.partial(plain_value_and_grad, enc_q, enc_d, loss_of_embeddings)
  else:
    fn = functools.partial(cached_value_and_grad, enc_q, enc_d, loss_of_embeddings, chunk_size=chunk_size)
  stats = jax.jit(fn).lower(params, batch, rng).compile(compiler_options).memory_analysis()
  out = {"temp": stats.temp_size_in_bytes, "argument": stats.argument_size_in_bytes,
         "output": stats.output_size_in_bytes, "alias": stats.alias_size_in_bytes}
  out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
  return out


def largest_batch(model, budget_bytes: int, *, query_len: int, doc_len: int, chunk_size: int | None = None,
                  start: int | None = None, max_batch: int = 1 << 16, docs_per_query: int = 1,
                  key: str = "total", verbose: bool = False,
                  compiler_options: dict | None = None) -> tuple[int, dict | None]:
  """The largest batch size whose `step_bytes(...)[key]` fits `budget_bytes`, and its measurement.

  Doubles from `start` (default: chunk_size, or 8 un-chunked) until a size does not fit or passes
  `max_batch`, then bisects in multiples of `start`. Each probe is one XLA compile (seconds to a minute
  for a full-size BERT), so keep max_batch sensible. Returns (0, None) when even `start` does not fit.
  Compile for the device that will train (the analysis is the backend's buffer assignment): e.g.

      from jdr.models.bert import EncoderConfig
      from jdr.models.towers import TowerConfig, TwoTower
      tower = TowerConfig(EncoderConfig())
      model = TwoTower(tower, tower, shared=True)
      for chunk in (None, 32):
        print(chunk, largest_batch(model, 16 << 30, query_len=32, doc_len=128, chunk_size=chunk))
  """
  step = start or chunk_size or 8
  measure = functools.partial(step_bytes, model, query_len=query_len, doc_len=doc_len,
                              chunk_size=chunk_size, docs_per_query=docs_per_query,
                              compiler_options=compiler_options)

  def fits(b):
    m = measure(b)
    if verbose:
      print(f"batch {b}: {m[key] / 2**20:.1f} MiB {'fits' if m[key] <= budget_bytes else 'over'}")
    return m if m[key] <= budget_bytes else None

  best, best_m = 0, None
  b = step
  while b <= max_batch:
    m = fits(b)
    if m is None:
      break
    best, best_m = b, m
    b *= 2
  hi = min(b, max_batch + step)  # first size known (or assumed) not to fit
  lo = best
  while hi - lo > step:
    mid = (lo + hi) // 2 // step * step
    if mid <= lo:
      break
    m = fits(mid)
    if m is None:
      hi = mid
    else:
      lo, best, best_m = mid, mid, m
  return best, best_m


def _main(argv=None):
  """`python -m jdr.training.gradcache [--budget_mib 4 --chunk_sizes none,4 ...]`: largest batch per chunk size.

  The defaults are a tiny BERT on a tiny budget (a demonstration that compiles in seconds); pass
  bert-base sizes (--hidden 768 --layers 12 --heads 12 --intermediate 3072 --vocab 30522) on the machine
  that will train, whose backend's memory analysis is the one that counts.
  """
  import argparse

  from jdr.models.bert import EncoderConfig
  from jdr.models.towers import TowerConfig, TwoTower

  parser = argparse.ArgumentParser(description=_main.__doc__.splitlines()[0])
  parser.add_argument("--budget_mib", type=float, default=4.0)
  parser.add_argument("--chunk_sizes", default="none,4", help="comma list; 'none' = no caching")
  parser.add_argument("--query_len", type=int, default=16)
  parser.add_argument("--doc_len", type=int, default=32)
  parser.add_argument("--max_batch", type=int, default=256)
  parser.add_argument("--hidden", type=int, default=32)
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--intermediate", type=int, default=64)
  parser.add_argument("--vocab", type=int, default=100)
  parser.add_argument("--dtype", default="float32")
  args = parser.parse_args(argv)
  encoder = EncoderConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
                          num_heads=args.heads, intermediate_size=args.intermediate, dtype=args.dtype,
                          max_position_embeddings=max(512, args.query_len, args.doc_len))
  model = TwoTower(TowerConfig(encoder), TowerConfig(encoder), shared=True)
  for text in args.chunk_sizes.split(","):
    chunk = None if text.strip().lower() == "none" else int(text)
    best, stats = largest_batch(model, int(args.budget_mib * 2**20), query_len=args.query_len,
                                doc_len=args.doc_len, chunk_size=chunk, max_batch=args.max_batch,
                                verbose=True)
    total = f"{stats['total'] / 2**20:.1f} MiB" if stats else "-"
    print(f"chunk_size={chunk}: largest batch {best} ({total}) on {jax.devices()[0].platform}")


if __name__ == "__main__":
  _main()
