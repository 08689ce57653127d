"""Attention with dropout in one pass over the keys: Pallas kernels (Triton on GPUs), forward and backward.

Why jdr has its own: attention dropout needs the probabilities, so with dropout on (training) the towers fell
back to einsums that write the [B, N, L, L] logits, probabilities and mask to memory and read them back in the
backward pass, while cuDNN's fused kernel, which keeps them on chip, draws its dropout from a seed fixed at
compile time plus a counter kept in the process: a resumed run, gradient caching's second forward and a
sharded step would each see other masks. These kernels draw the mask from `jdr.models.dropout`'s keyed hash of
each probability's index in [B, N, L, L], the same bits the einsum path's Dropout draws from the same key: the
two paths drop the same probabilities, and a resumed run, gradient caching's second forward and each shard of a
sharded step redraw exactly the masks of the run, the forward and the one device they stand for.

The forward is FlashAttention's online softmax (Dao et al. 2022) over blocks of keys, skipping the blocks past
each row's length (texts are padded on the right, so a key mask is a length); it keeps each query's
log-sum-exp for the backward, which recomputes the probabilities block by block: one kernel per key block
accumulates dK and dV, one per query block dQ. Dropout scales the kept probabilities by 1 / (1 - rate) after
the softmax, as the einsum path does, so the softmax normalizer is over all keys.

Runs compiled on GPUs and in Pallas' interpreter elsewhere (the CPU tests check it against the einsum path).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jdr.models.dropout import drop_threshold, hash_bits, key_words

# Finite, so a masked logit minus a row maximum is never inf - inf.
_MASKED = -1e30
_MAX_BLOCK = 64


class _Static(NamedTuple):
  scale: float
  rate: float
  seq_len: int  # L before padding: the hash indexes [B, N, L, L] as the einsum path's mask does
  total_heads: int  # N over all shards (heads split over a mesh axis index the global array)
  block: int
  interpret: bool


def _keep(meta_ref, b, n, rows, cols, st: _Static):
  """The einsum path's keep mask for rows x cols of head (b, n): hash of ((b N + n) L + row) L + col."""
  u32 = jnp.uint32
  bn = (b.astype(u32) + meta_ref[2]) * u32(st.total_heads) + n.astype(u32) + meta_ref[3]
  index = (bn * u32(st.seq_len) + rows.astype(u32)) * u32(st.seq_len) + cols.astype(u32)
  return hash_bits(index, meta_ref[0], meta_ref[1]) >= u32(drop_threshold(st.rate))


def _dot(a, b):
  return plgpu.dot(a, b).astype(jnp.float32)


def _forward_kernel(meta_ref, lengths_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, st: _Static):
  b, n, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_q, head_dim = q_ref.shape
  length = lengths_ref[b]
  q = q_ref[...]
  rows = i * block_q + jnp.arange(block_q, dtype=jnp.int32)[:, None]

  def body(j, carry):
    acc, m, l = carry
    keys = pl.ds(j * st.block, st.block)
    k, v = k_ref[keys, :], v_ref[keys, :]
    s = _dot(q, k.T) * st.scale
    cols = j * st.block + jnp.arange(st.block, dtype=jnp.int32)[None, :]
    s = jnp.where(cols < length, s, _MASKED)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    if st.rate > 0.0:
      p = jnp.where(_keep(meta_ref, b, n, rows, cols, st), p, 0.0)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_new, l

  init = (jnp.zeros((block_q, head_dim), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
          jnp.zeros((block_q,), jnp.float32))
  acc, m, l = jax.lax.fori_loop(0, pl.cdiv(length, st.block), body, init)
  o_ref[...] = (acc / (l * (1.0 - st.rate))[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def _dkdv_kernel(meta_ref, lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                 st: _Static):
  b, n, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_k, head_dim = k_ref.shape
  length = lengths_ref[b]
  k, v = k_ref[...], v_ref[...]
  # Key-major: every product here is [keys, queries] (P transposed), so dV += P^T dO and dK += dS^T Q take their
  # left operand as it is in registers. Computed query-major and transposed, those two made ptxas serialize the
  # kernel's wgmma instructions on Hopper at 64-wide heads (warning C7515); the test suite compiles it for an
  # H200 where jax's CUDA plugin is installed and checks that ptxas has no such warning.
  cols = j * block_k + jnp.arange(block_k, dtype=jnp.int32)[:, None]
  valid = cols < length

  def body(i, carry):
    dk, dv = carry
    rows_at = pl.ds(i * st.block, st.block)
    q, do = q_ref[rows_at, :], do_ref[rows_at, :]
    lse, delta = lse_ref[rows_at], delta_ref[rows_at]
    p_t = jnp.where(valid, jnp.exp(_dot(k, q.T) * st.scale - lse[None, :]), 0.0)
    dp_t = _dot(v, do.T)
    if st.rate > 0.0:
      rows = i * st.block + jnp.arange(st.block, dtype=jnp.int32)[None, :]
      keep = _keep(meta_ref, b, n, rows, cols, st)
      dropped_t = jnp.where(keep, p_t, 0.0) / (1.0 - st.rate)
      dp_t = jnp.where(keep, dp_t, 0.0) / (1.0 - st.rate)
    else:
      dropped_t = p_t
    dv = dv + _dot(dropped_t.astype(do.dtype), do)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = dk + _dot(ds_t.astype(q.dtype), q)
    return dk, dv

  # A key block wholly past the row's length gets no gradient (its keys were masked out).
  # Both branches int32, as the loop's start: Python ints here made Triton's loop bounds of two integer types,
  # which its verifier refuses ('scf.for' ... have same type) when the module is compiled for a GPU.
  blocks = jnp.where(j * block_k < length, jnp.int32(q_ref.shape[0] // st.block), jnp.int32(0))
  zeros = jnp.zeros((block_k, head_dim), jnp.float32)
  dk, dv = jax.lax.fori_loop(0, blocks, body, (zeros, zeros))
  dk_ref[...] = (dk * st.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(meta_ref, lengths_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, st: _Static):
  b, n, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  block_q, head_dim = q_ref.shape
  length = lengths_ref[b]
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  rows = i * block_q + jnp.arange(block_q, dtype=jnp.int32)[:, None]

  def body(j, dq):
    keys = pl.ds(j * st.block, st.block)
    k, v = k_ref[keys, :], v_ref[keys, :]
    cols = j * st.block + jnp.arange(st.block, dtype=jnp.int32)[None, :]
    p = jnp.where(cols < length, jnp.exp(_dot(q, k.T) * st.scale - lse[:, None]), 0.0)
    dp = _dot(do, v.T)
    if st.rate > 0.0:
      dp = jnp.where(_keep(meta_ref, b, n, rows, cols, st), dp, 0.0) / (1.0 - st.rate)
    ds = p * (dp - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  dq = jax.lax.fori_loop(0, pl.cdiv(length, st.block), body, jnp.zeros((block_q, head_dim), jnp.float32))
  dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)


def _specs(st: _Static, shape):
  """BlockSpecs over [B, Lp, N, D] arrays (jdr's projection layout, no transposes) and [B, N, Lp] rows."""
  _, padded_len, _, head_dim = shape
  whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
  block = pl.BlockSpec((None, st.block, None, head_dim), lambda b, n, i: (b, i, n, 0))
  sequence = pl.BlockSpec((None, padded_len, None, head_dim), lambda b, n, i: (b, 0, n, 0))
  row_block = pl.BlockSpec((None, None, st.block), lambda b, n, i: (b, n, i))
  row_all = pl.BlockSpec((None, None, padded_len), lambda b, n, i: (b, n, 0))
  return whole, block, sequence, row_block, row_all


def _call(kernel, st: _Static, grid, in_specs, out_specs, outs, *args):
  """One pallas_call; `outs` are (shape, dtype) pairs."""
  # Triton's CompilerParams also choose the lowering: since jax 0.9 a pallas_call without them goes to Mosaic
  # GPU on GPUs, and these kernels are written (plgpu.dot) and tested (the CUDA lowering test) for Triton.
  return pl.pallas_call(
      functools.partial(kernel, st=st), grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in outs],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2), interpret=st.interpret)(*args)


def _forward(st: _Static, q, k, v, lengths, meta):
  batch, padded_len, heads, head_dim = q.shape
  whole, block, sequence, row_block, _ = _specs(st, q.shape)
  grid = (batch, heads, padded_len // st.block)
  return _call(_forward_kernel, st, grid, [whole(meta), whole(lengths), block, sequence, sequence],
               [block, row_block],
               [(q.shape, q.dtype), ((batch, heads, padded_len), jnp.float32)], meta, lengths, q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st: _Static, q, k, v, lengths, meta):
  return _forward(st, q, k, v, lengths, meta)[0]


def _attention_fwd(st: _Static, q, k, v, lengths, meta):
  o, lse = _forward(st, q, k, v, lengths, meta)
  return o, (q, k, v, lengths, meta, o, lse)


def _attention_bwd(st: _Static, residuals, do):
  q, k, v, lengths, meta, o, lse = residuals
  batch, padded_len, heads, _ = q.shape
  # dO . O per query row: the softmax backward's row term (dropout included, since O is the dropped output).
  delta = jnp.einsum("blnd,blnd->bnl", do.astype(jnp.float32), o.astype(jnp.float32))
  whole, block, sequence, row_block, row_all = _specs(st, q.shape)
  grid = (batch, heads, padded_len // st.block)
  head = [whole(meta), whole(lengths)]
  dk, dv = _call(_dkdv_kernel, st, grid, head + [sequence, block, block, sequence, row_all, row_all],
                 [block, block], [(k.shape, k.dtype), (v.shape, v.dtype)],
                 meta, lengths, q, k, v, do, lse, delta)
  (dq,) = _call(_dq_kernel, st, grid, head + [block, sequence, sequence, block, row_block, row_block], [block],
                [(q.shape, q.dtype)], meta, lengths, q, k, v, do, lse, delta)
  return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def _next_power_of_2(x: int) -> int:
  return 1 << max(0, x - 1).bit_length()


def flash_attention(q, k, v, key_mask, *, scale: float, rate: float = 0.0, key: jax.Array | None = None,
                    batch_offset=0, head_offset=0, total_heads: int | None = None,
                    interpret: bool | None = None) -> jax.Array:
  """Softmax attention over q, k, v [B, L, N, D] with keys masked by `key_mask` [B, L] (a prefix per row).

  With `rate` > 0 the probabilities are dropped as `jdr.models.dropout.Dropout(rate)` drops the einsum path's
  [B, N, L, L] probabilities under `key`; `batch_offset`, `head_offset` and `total_heads` place this block of
  rows and heads in the global array when it is one shard of it. A row with no key at all attends to its first
  (its output is padding). `interpret` defaults to Pallas' interpreter off GPUs.
  """
  if rate > 0.0 and key is None:
    raise ValueError("attention dropout needs a key")
  if not 0.0 <= rate < 1.0:
    raise ValueError(f"attention dropout rate must be in [0, 1), got {rate}")
  batch, seq_len, heads, head_dim = q.shape
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  st = _Static(scale=float(scale), rate=float(rate), seq_len=seq_len, total_heads=total_heads or heads,
               block=min(_MAX_BLOCK, max(16, _next_power_of_2(seq_len))), interpret=interpret)
  # Triton's blocks are powers of two: the sequence pads to whole blocks (padded keys are past every length,
  # padded queries are sliced off), the head size to a power of two (zero features change no dot product).
  padded_len = -(-seq_len // st.block) * st.block
  padded_dim = max(16, _next_power_of_2(head_dim))
  pad = ((0, 0), (0, padded_len - seq_len), (0, 0), (0, padded_dim - head_dim))
  q, k, v = (jnp.pad(t, pad) for t in (q, k, v))
  lengths = jnp.clip(jnp.sum(key_mask, axis=-1, dtype=jnp.int32), 1, seq_len)
  lengths = jnp.pad(lengths, (0, _next_power_of_2(batch) - batch))
  words = key_words(key) if key is not None else jnp.zeros((2,), jnp.uint32)
  offsets = jnp.stack([jnp.asarray(batch_offset).astype(jnp.uint32), jnp.asarray(head_offset).astype(jnp.uint32)])
  meta = jnp.concatenate([words, offsets])
  out = _attention(st, q, k, v, lengths, meta)
  return out[:, :seq_len, :, :head_dim]


def flash_attention_on_mesh(mesh, batch_axes: tuple[str, ...], head_axis: str | None, q, k, v, key_mask, *,
                            scale: float, rate: float = 0.0, key: jax.Array | None = None,
                            interpret: bool | None = None) -> jax.Array:
  """`flash_attention` with q, k, v [B, L, N, D] split by rows over `batch_axes` (and by heads over `head_axis`).

  A Pallas call is one opaque kernel to XLA's partitioner, which would gather every shard onto each device, so
  each device runs it on its own rows and heads; the offsets place them in the global [B, N, L, L], so every
  shard drops what one device would.
  """
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  heads = q.shape[2]
  spec = P(batch_axes, None, head_axis, None)

  def local(q, k, v, key_mask, key):
    batch_offset = jax.lax.axis_index(batch_axes) * q.shape[0]
    head_offset = jax.lax.axis_index(head_axis) * q.shape[2] if head_axis else 0
    return flash_attention(q, k, v, key_mask, scale=scale, rate=rate, key=key, batch_offset=batch_offset,
                           head_offset=head_offset, total_heads=heads, interpret=interpret)

  if key is None:
    key = jnp.zeros((2,), jnp.uint32)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, P(batch_axes, None), P()), out_specs=spec,
                       check_vma=False)(q, k, v, key_mask, key)
