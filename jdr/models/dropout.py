"""Dropout whose masks are a keyed hash of each element's index, so any kernel can redraw them.

The attention kernel in `jdr.models.flash_attention` computes the same bits for its tiles from the same key,
so the fused and the einsum attention drop the same probabilities.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp


def _mix32(h: jax.Array) -> jax.Array:
  # A 32-bit bijective finalizer with full avalanche (the "lowbias32" constants of Wellons' hash-prospector).
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x846CA68B)
  return h ^ (h >> 16)


def key_words(key: jax.Array) -> jax.Array:
  """The two uint32 words of a dropout key that the hash folds in (a raw uint32 key array works too)."""
  data = jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
  data = data.astype(jnp.uint32).reshape(-1)
  return jnp.stack([data[0], data[1 % data.size]])


def hash_bits(index: jax.Array, word0: jax.Array, word1: jax.Array) -> jax.Array:
  """32 random bits for each uint32 flat index under a key's two words (elementwise, so kernels can call it)."""
  h = _mix32(index * jnp.uint32(0x9E3779B9) ^ word0)
  return _mix32(h ^ word1)


def drop_threshold(rate: float) -> int:
  """Bits at or above this keep their element: the rate is exact to 2^-32."""
  return round(rate * 2**32)


def dropout_bits(key: jax.Array, shape: tuple[int, ...], whole: tuple[int, ...] | None = None) -> jax.Array:
  """32 random bits per element of `shape`: a counter-based hash of the element's flat index under the key.

  `whole`: the array of `shape` is the leading corner (index 0 up along every axis) of an array of this
  shape, and each element draws the bits it draws there: a layer that computes only the first position of
  each row (`jdr.models.bert.Layer`'s `first_token_only`) drops what the whole layer would.

  Each element's bits depend only on (key, its index in the whole array), so a sharded array draws the same
  mask as one device (the index comes from per-axis iotas, which XLA partitions), and under vmap each row's
  key gives that row its own mask. Two rounds of a full-avalanche mixer with the key's two words folded in
  between cost ~12 integer ops an element, where threefry's 20 rounds gave 16 bits for ~40, so the masks take
  a fraction of threefry's time (docs/performance.md, `train-step`, "Dropout masks").
  """
  whole = tuple(shape) if whole is None else tuple(whole)
  if len(whole) != len(shape) or any(s > w for s, w in zip(shape, whole)):
    raise ValueError(f"dropout over {tuple(shape)} as the corner of {whole}: not a part of it")
  words = key_words(key)
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
    stride *= whole[axis]
  return hash_bits(index, words[0], words[1])


class Dropout(nn.Module):
  """Inverted dropout whose masks come from `dropout_bits` (a keyed hash, not threefry).

  flax's nn.Dropout draws a float32 uniform per element, one threefry evaluation each; on a CPU those masks
  were a large part of a MiniLM training step, even after packing two 16-bit draws per threefry word
  (docs/performance-history.md, the train step's section). The hash keeps the rate exact to 2^-32. Same rng
  stream ("dropout") and the same per-call key as nn.Dropout, so gradient caching's per-row keys still hold.
  Arrays of 2^32 elements or more (where a 32-bit index would repeat) draw from threefry instead.
  """
  rate: float

  @nn.compact
  def __call__(self, x, deterministic: bool, whole: tuple[int, ...] | None = None):
    """`whole`: x is the leading corner of an array of this shape, and drops what that array would there
    (`dropout_bits`)."""
    if deterministic or self.rate == 0.0:
      return x
    if self.rate >= 1.0:
      return jnp.zeros_like(x)
    key = self.make_rng("dropout")
    if math.prod(whole or x.shape) < 2**32:
      keep = dropout_bits(key, x.shape, whole) >= jnp.uint32(drop_threshold(self.rate))
    elif whole is None:
      keep = jax.random.bernoulli(key, 1.0 - self.rate, x.shape)
    else:
      keep = jax.random.bernoulli(key, 1.0 - self.rate, whole)[tuple(slice(0, n) for n in x.shape)]
    return jnp.where(keep, x / jnp.asarray(1.0 - self.rate, x.dtype), jnp.zeros((), x.dtype))

  def rng_key(self) -> jax.Array:
    """The key `__call__` would draw its mask from, for a kernel that applies this dropout itself."""
    return self.make_rng("dropout")
