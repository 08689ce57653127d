"""BERT and RoBERTa encoders in Flax linen, numerically matching Hugging Face's PyTorch models.

The module tree mirrors Hugging Face's layer by layer (`embeddings`, `layer_0` ... `layer_{n-1}`) so that
`jdr.models.hf` converts weights with a flat name table and no model surgery. Every parameter carries
logical axis names ("vocab", "embed", "mlp", "heads", "kv", "position", "type") through
`nn.with_logical_partitioning`: sharding is decided by a rule table in `jdr.runtime.parallel`, never here.

Mixed precision: parameters are always float32; `EncoderConfig.dtype` is the compute dtype of matmuls and the
residual stream. Attention logits, softmax and LayerNorm statistics stay in float32 and the encoder's output
is cast back to float32, so bfloat16 changes speed and memory, not the interface.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jdr.runtime import parallel
from jdr.models.dropout import Dropout

# Hugging Face model_type values whose checkpoints use RoBERTa's embeddings (padding-offset positions).
_ROBERTA_TYPES = ("roberta", "xlm-roberta", "camembert")
_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
ATTENTION_KINDS = ("auto", "einsum", "fused", "flash")
MODEL_TYPES = ("bert", "roberta", "distilbert")


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
  """Architecture of a BERT-style encoder. Defaults are bert-base-uncased."""
  model_type: str = "bert"  # "bert" | "roberta" | "distilbert" (BERT's blocks, no token types)
  vocab_size: int = 30522
  hidden_size: int = 768
  num_layers: int = 12
  num_heads: int = 12
  intermediate_size: int = 3072
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  pad_token_id: int = 0
  hidden_dropout: float = 0.1
  attention_dropout: float = 0.1
  hidden_act: str = "gelu"  # "gelu" is the exact (erf) GELU, as in Hugging Face.
  dtype: str = "float32"  # compute dtype: "float32" | "bfloat16"; params are float32 regardless.
  remat: bool = False  # recompute each layer's activations in the backward pass (saves memory).
  # "auto": jax.nn.dot_product_attention (cuDNN's fused kernel where the platform has one) on accelerators
  # when no attention dropout is drawn, else jdr's own einsum attention; "einsum" / "fused" force one;
  # "flash": jdr's Pallas kernel (jdr.models.flash_attention), dropout included (interpreted off GPUs).
  attention: str = "auto"

  def __post_init__(self):
    if self.model_type not in MODEL_TYPES:
      raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
    if (self.type_vocab_size == 0) != (self.model_type == "distilbert"):
      raise ValueError("type_vocab_size 0 (no token-type table) is DistilBERT's, and only DistilBERT's")
    if self.hidden_size % self.num_heads:
      raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
    if self.hidden_act not in _ACTIVATIONS:
      raise ValueError(f"hidden_act {self.hidden_act!r} unsupported; expected one of {_ACTIVATIONS}")
    if self.dtype not in _DTYPES:
      raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {self.dtype!r}")
    if self.attention not in ATTENTION_KINDS:
      raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def compute_dtype(self) -> Any:
    return _DTYPES[self.dtype]

  @property
  def max_length(self) -> int:
    """Longest sequence the position table supports (RoBERTa spends pad_token_id + 1 slots on the offset)."""
    if self.model_type == "roberta":
      return self.max_position_embeddings - self.pad_token_id - 1
    return self.max_position_embeddings

  @classmethod
  def from_saved(cls, d: dict[str, Any]) -> EncoderConfig:
    """The encoder a saved model's description names. How the saving run computed attention is not part of
    the model: a loaded model takes the platform's default (a run that trains it sets its own)."""
    return cls(**{**d, "attention": "auto"})

  def replace(self, **changes) -> EncoderConfig:
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_hf(cls, config: dict[str, Any], **overrides) -> EncoderConfig:
    """Builds a config from a transformers `config.json` dict; `overrides` set jdr-only fields (dtype...)."""
    model_type = config.get("model_type", "bert")
    if model_type in _ROBERTA_TYPES:
      model_type = "roberta"
    elif model_type == "dpr":
      model_type = "bert"
    elif model_type != "bert":  # DPR's encoders are BERT with DPR's names (jdr.models.published)
      raise ValueError(f"unsupported Hugging Face model_type {model_type!r} for a BERT-style encoder")
    position_type = config.get("position_embedding_type", "absolute")
    if position_type != "absolute":
      raise ValueError(f"position_embedding_type {position_type!r} unsupported: only 'absolute'")
    if config.get("is_decoder") or config.get("add_cross_attention"):
      raise ValueError("decoder / cross-attention BERT configs are not encoders")
    fields = dict(
        model_type=model_type,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        max_position_embeddings=config["max_position_embeddings"],
        type_vocab_size=config.get("type_vocab_size", 2),
        layer_norm_eps=config.get("layer_norm_eps", 1e-12),
        pad_token_id=config.get("pad_token_id") if config.get("pad_token_id") is not None else 0,
        hidden_dropout=config.get("hidden_dropout_prob", 0.1),
        attention_dropout=config.get("attention_probs_dropout_prob", 0.1),
        hidden_act=config.get("hidden_act", "gelu"),
    )
    fields.update(overrides)
    return cls(**fields)

  def to_hf(self) -> dict[str, Any]:
    """The transformers `config.json` dict for this architecture (jdr-only fields are dropped)."""
    arch = "RobertaModel" if self.model_type == "roberta" else "BertModel"
    config = {
        "architectures": [arch],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "intermediate_size": self.intermediate_size,
        "hidden_act": self.hidden_act,
        "hidden_dropout_prob": self.hidden_dropout,
        "attention_probs_dropout_prob": self.attention_dropout,
        "max_position_embeddings": self.max_position_embeddings,
        "type_vocab_size": self.type_vocab_size,
        "initializer_range": 0.02,
        "layer_norm_eps": self.layer_norm_eps,
        "pad_token_id": self.pad_token_id,
        "position_embedding_type": "absolute",
    }
    if self.model_type == "roberta":
      # RoBERTa's special-token ids sit next to the pad id (<s>=0, <pad>=1, </s>=2).
      config.update(bos_token_id=0, eos_token_id=2)
    return config


def _init(names: tuple[str | None, ...], init=None):
  # BERT's initialiser: N(0, 0.02) for every matrix and table.
  return nn.with_logical_partitioning(init or nn.initializers.normal(stddev=0.02), names)


def add_bias(y: jax.Array, bias: jax.Array) -> jax.Array:
  """y + bias over y's last axis, in y's dtype; in bfloat16 the bias's gradient is summed in float32.

  Autodiff transposes `y + bias.astype(y.dtype)` into a sum of the bfloat16 cotangent over every token in
  bfloat16: compiled for an NVIDIA H200, BERT-base's train step summed each layer's six bias gradients over
  32,768 document tokens in bfloat16 reductions, visibly off at that size (the tests measure it; the figures:
  docs/performance-history.md, "Compiled for the H200, change by change"). Here the bfloat16 cotangent is
  summed in float32, as PyTorch's autocast does.
  """
  if y.dtype == jnp.bfloat16 and bias.dtype == jnp.float32:
    return _add_bias_bfloat16(y, bias)
  return y + bias.astype(y.dtype)


@jax.custom_vjp
def _add_bias_bfloat16(y, bias):
  return y + bias.astype(y.dtype)


def _add_bias_bfloat16_fwd(y, bias):
  return _add_bias_bfloat16(y, bias), None


def _add_bias_bfloat16_bwd(_, grad):
  # bfloat16 is float32's upper half: widening the bits is the exact conversion. grad.astype(float32) is
  # the same values, but XLA (excess precision allowed, its default) cancels it against the float32 ->
  # bfloat16 cast that made grad, so the sum read the unrounded float32 cotangent, which it then wrote to
  # memory instead of fusing, adding traffic to the H200 flash train step. The widened bits it keeps, and
  # still fuses most sums where they were: far less traffic added (docs/performance-history.md, "Compiled for
  # the H200, change by change").
  bits = jax.lax.bitcast_convert_type(grad, jnp.uint16).astype(jnp.uint32) << 16
  widened = jax.lax.bitcast_convert_type(bits, jnp.float32)
  return grad, jnp.sum(widened, axis=tuple(range(grad.ndim - 1)))


_add_bias_bfloat16.defvjp(_add_bias_bfloat16_fwd, _add_bias_bfloat16_bwd)


class Dense(nn.Module):
  """nn.DenseGeneral(features, axis=(-contracted, ..., -1))'s parameters (kernel [*contracted axes, *features],
  bias [*features]: same names, shapes, initial values and logical axes) and product, computed as one 2-D
  matmul over the flattened axes with the bias added to its [..., prod(features)] result by `add_bias`.

  Why not DenseGeneral itself: it sums its bias's gradient in the compute dtype, and with features (N, D) (the
  query, key and value projections) it adds the bias to the [B, L, N, D] product, which XLA's GPU compiler
  does not recognize as a matmul bias: it materialized the broadcast bias ([tokens, 768] per projection) and
  ran the matmul on top of it. Added to the flat product, the bias goes into cuBLAS's epilogue (seen in the
  optimized HLO of BERT-base compiled for an NVIDIA H200), and the heads come out by a free reshape.
  """
  config: EncoderConfig
  features: int | tuple[int, ...]
  names: tuple[str, ...]  # the kernel's logical axes; the bias takes the features'
  contracted: int = 1  # how many trailing axes of the input the product contracts

  @nn.compact
  def __call__(self, x):
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    width = math.prod(features)
    kernel = self.param("kernel", _init(self.names), (*x.shape[-self.contracted:], *features), jnp.float32)
    bias = self.param("bias", _init(self.names[-len(features):], nn.initializers.zeros_init()), features,
                      jnp.float32)
    x, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=self.config.compute_dtype)
    flat = x.reshape(*x.shape[:-self.contracted], -1)
    y = jnp.dot(flat, kernel.reshape(-1, width), preferred_element_type=_dot_result_dtype(flat.dtype))
    y = add_bias(y.astype(flat.dtype), bias.reshape(width))
    return y.reshape(*y.shape[:-1], *features)


def _dot_result_dtype(dtype):
  """The result type a matmul of `dtype` operands asks XLA for: on a CPU, bfloat16 products are asked for in
  float32 (then rounded), the only form XLA's CPU dots run on the bfloat16 instructions (AVX512-BF16, AMX);
  a bfloat16 result took the float32 path at half the rate (docs/performance.md, `encode`). Elsewhere the
  operands' own."""
  return jnp.float32 if dtype == jnp.bfloat16 and parallel.platform() == "cpu" else None


def heads_projection(cfg: EncoderConfig, name: str | None = None) -> Dense:
  """The query, key or value projection: [B, L, E] -> [B, L, N, D]."""
  return Dense(cfg, (cfg.num_heads, cfg.head_dim), ("embed", "heads", "kv"), name=name)


# Where the heads sit in attention's queries, keys and values: "bnld" ([B, N, L, D]) or "blnd" ([B, L, N, D], as
# the projections give them); the einsum subscripts of each product in each.
_QKV = {"bnld": "bnqd", "blnd": "bqnd"}
_KV = {"bnld": "bnkd", "blnd": "bknd"}


def attention_logits(q: jax.Array, k: jax.Array, layout: str = "bnld") -> jax.Array:
  """float32 [B, N, Lq, Lk] logits of queries and keys laid out as `layout` says ([B, N, L, D] or [B, L, N, D]).

  In half precision the backward rounds the logits' cotangent to the inputs' dtype before the two products
  that give dQ and dK, as FlashAttention's backward (and jdr's flash kernel) rounds dS: autodiff would carry
  it in float32, writing and reading [B, N, L, L] float32 arrays for float32 products with float32 results
  (what that cost BERT-base's train step compiled for an NVIDIA H200: docs/performance-history.md, "Compiled
  for the H200, change by change"). float32 inputs keep autodiff's own backward, bit for bit.
  """
  if q.dtype == jnp.float32:
    return jnp.einsum(f"{_QKV[layout]},{_KV[layout]}->bnqk", q, k, preferred_element_type=jnp.float32)
  return _half_precision_logits(q, k, layout)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _half_precision_logits(q, k, layout):
  return jnp.einsum(f"{_QKV[layout]},{_KV[layout]}->bnqk", q, k, preferred_element_type=jnp.float32)


def _half_precision_logits_fwd(q, k, layout):
  return _half_precision_logits(q, k, layout), (q, k)


def _half_precision_logits_bwd(layout, residuals, grad):
  q, k = residuals
  grad = grad.astype(q.dtype)
  # Half-precision products accumulate in float32 and round once.
  return (jnp.einsum(f"bnqk,{_KV[layout]}->{_QKV[layout]}", grad, k),
          jnp.einsum(f"bnqk,{_QKV[layout]}->{_KV[layout]}", grad, q))


_half_precision_logits.defvjp(_half_precision_logits_fwd, _half_precision_logits_bwd)


def softmax_weighted_values(logits: jax.Array, values: jax.Array, dropout=lambda w: w, first_row: bool = False,
                            layout: str | None = None):
  """softmax(logits) over the last axis, through `dropout`, times `values` ([..., Lq, Lk] float32 logits,
  [..., Lk, D] values -> [..., Lq, D] in the values' dtype; with `layout` "bnld" or "blnd", [B, N, Lq, Lk]
  logits and values laid out so, and the result laid out as the values); `first_row=True` returns (that, the
  first query's probabilities [..., Lk] after dropout), from the same computation, so asking for them changes
  nothing.

  On a CPU the product is normalized after it: exp(logits - row max) multiplies the values and the [Lq, D]
  product is divided by the row sums, instead of dividing the [Lq, Lk] weights, one pass over the weights
  fewer each way. The row max only keeps exp in range (the result does not depend on it), so no gradient
  flows through it; dropout, a per-element scaling, commutes with the division. MiniLM's attention over
  4 x 256 tokens took 5.3 ms instead of 8.5 forward and 18.7 instead of 34.5 forward and backward
  (docs/performance-history.md, "The training step on an AVX-512 CPU"). Elsewhere the probabilities are
  formed first, the form the accelerators' figures were measured with.
  """
  # The product's rows come out heads first ([B, N, Lq, D]) and move to the values' layout after the division.
  product = "...qk,...kd->...qd" if layout is None else f"bnqk,{_KV[layout]}->bnqd"
  laid_out = (lambda t: jnp.swapaxes(t, 1, 2)) if layout == "blnd" else (lambda t: t)
  if parallel.platform() != "cpu":
    probs = dropout(jax.nn.softmax(logits, axis=-1))
    out = laid_out(jnp.einsum(product, probs.astype(values.dtype), values))
    return (out, probs[..., 0, :]) if first_row else out
  peak = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  weights = jnp.exp(logits - peak)
  total = jnp.sum(weights, axis=-1, keepdims=True)
  weights = dropout(weights)
  weighted = jnp.einsum(product, weights.astype(values.dtype), values, preferred_element_type=jnp.float32)
  out = laid_out((weighted / total).astype(values.dtype))
  return (out, weights[..., 0, :] / total[..., 0, :]) if first_row else out


# On a CPU, attention whose per-head logits reach this size runs its queries a block at a time
# (`einsum_attention`).
CPU_HEAD_LOGITS_TO_SPLIT = 384 * 1024  # bytes of one head's float32 [Lq, Lk] logits: L = 314 and longer
CPU_QUERY_BLOCK = 32  # query rows a block


def cpu_query_blocks(lq: int, lk: int) -> int | None:
  """How many blocks of CPU_QUERY_BLOCK queries `einsum_attention` runs one after another on a CPU (the last
  one padded); None (all queries at once) where one head's float32 logits stay under CPU_HEAD_LOGITS_TO_SPLIT."""
  if lq * lk * 4 < CPU_HEAD_LOGITS_TO_SPLIT:
    return None
  return -(-lq // CPU_QUERY_BLOCK)


def einsum_attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, dropout=None,
                     first_row: bool = False, logit_scale: float | None = None, layout: str = "bnld"):
  """Attention of q [B, H, Lq, D] over k, v [B, H, Lk, D] where `allowed` (boolean, broadcastable to [B, 1, Lq,
  Lk]) is True: [B, H, Lq, D] in v's dtype, or (that, the first query's probabilities [B, H, Lk]) with
  `first_row`. With `layout="blnd"` q, k, v and the result are [B, L, H, D] instead. `dropout` (a function of
  the weights) is applied to the attention weights; None draws none. The logits are float32
  (`attention_logits`), times `logit_scale` where given; masked keys get exactly zero weight (a boolean mask,
  not an additive bias).

  On a CPU, without dropout, long rows run their queries 32 at a time (`cpu_query_blocks`), every row and
  head in each block: the [B, H, L, L] logits of all queries at once go through memory between the products
  and the exp, where a block's stay in cache. MiniLM's attention alone (two calls at once, one per core of a
  2-core AVX-512 CPU, as encoding runs) took 8.9 ms instead of 13.2 over 2 x 512 tokens and 19.9 instead of
  64.9 over 1 x 1024; over 4 x 256 4.7 against 5.0, where the whole model ran the same either way, so rows
  that short keep all queries at once (docs/performance-history.md, "Encoding on an AVX-512 CPU"). Blocks of
  queries, not of rows or heads: a mesh splits rows and heads, and a loop over a split axis would gather it
  on every device. Each query computes what it computed with all of them (laid out as [B, L, H, D], to float32
  rounding). Dropout draws its mask from a Flax module, which a loop cannot call.
  """
  def core(q, allowed):
    logits = attention_logits(q, k, layout)
    if logit_scale is not None:
      logits = logits * logit_scale
    logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
    return softmax_weighted_values(logits, v, dropout or (lambda w: w), first_row=first_row, layout=layout)

  axis = 2 if layout == "bnld" else 1  # q's and the result's positions
  lq = q.shape[axis]
  blocks = cpu_query_blocks(lq, k.shape[axis]) if dropout is None and parallel.platform() == "cpu" else None
  if blocks is None or blocks == 1:
    return core(q, allowed)
  pad = blocks * CPU_QUERY_BLOCK - lq  # padded queries are computed and dropped

  def to_blocks(t, axis):  # [blocks, ..., CPU_QUERY_BLOCK, ...]: `axis` split in two, the blocks first
    widths = [(0, pad) if i == axis else (0, 0) for i in range(t.ndim)]
    t = jnp.pad(t, widths).reshape(t.shape[:axis] + (blocks, CPU_QUERY_BLOCK) + t.shape[axis + 1:])
    return jnp.moveaxis(t, axis, 0)

  if allowed.ndim == 4 and allowed.shape[2] > 1:  # a mask per query: its rows go with their block
    out = jax.lax.map(lambda xs: core(*xs), (to_blocks(q, axis), to_blocks(allowed, 2)))
  else:
    out = jax.lax.map(lambda qb: core(qb, allowed), to_blocks(q, axis))
  ctx = jnp.moveaxis(out[0] if first_row else out, 0, axis)
  ctx = ctx.reshape(ctx.shape[:axis] + (blocks * CPU_QUERY_BLOCK,) + ctx.shape[axis + 2:])
  ctx = jax.lax.slice_in_dim(ctx, 0, lq, axis=axis)
  return (ctx, out[1][0]) if first_row else ctx


def _layer_norm(cfg: EncoderConfig, name: str | None, deterministic: bool, **module_args) -> nn.LayerNorm:
  # Flax computes the statistics in float32 even for bfloat16 inputs; `dtype` is only the output dtype.
  # The variance: a forward that trains keeps Flax's one-pass E[x^2] - E[x]^2, whose backward needs only x;
  # the variance of x - mean (PyTorch's) made a BERT-base train step keep every LayerNorm's float32 x - mean,
  # more traffic (compiled for an NVIDIA H200). A deterministic forward (encoding, evaluation) takes the
  # variance of x - mean, which XLA's GPU compiler computes with the normalization in one kernel instead of
  # two (the figures of both: docs/performance-history.md, "Compiled for the H200, change by change").
  return nn.LayerNorm(
      epsilon=cfg.layer_norm_eps, dtype=cfg.compute_dtype, param_dtype=jnp.float32,
      use_fast_variance=not deterministic,
      scale_init=_init(("embed",), nn.initializers.ones_init()),
      bias_init=_init(("embed",), nn.initializers.zeros_init()), name=name, **module_args)


def exact_gelu(x: jax.Array) -> jax.Array:
  """GELU with the Gaussian CDF from erf, computed in float32 (half-precision inputs rounded once), with its
  derivative written out.

  jax.nn.gelu's exact form goes through erfc, whose float32 kernel computes two branches and an exp: on an
  NVIDIA H200 its fusion over BERT-base's [tokens, 3072] MLP activations ran at several times the time of
  reading and writing them, the largest non-matmul kernel of the forward (docs/performance-history.md, "The
  H200 runs, run to run"), and on a CPU its two largest fusions were the largest non-matmul kernels of MiniLM's
  training step (docs/performance-history.md, "The training step on an AVX-512 CPU"). The erf form is what
  PyTorch computes (in float32 for bfloat16 tensors), so Hugging Face parity holds as before. The backward,
  Phi(x) + x phi(x), reads only x.
  """
  return _erf_gelu(x.astype(jnp.float32)).astype(x.dtype)


_SQRT_HALF = 0.7071067811865476  # 1 / sqrt(2)
_INV_SQRT_2PI = 0.3989422804014327  # 1 / sqrt(2 pi)


@jax.custom_vjp
def _erf_gelu(x: jax.Array) -> jax.Array:
  return 0.5 * x * (1.0 + jax.lax.erf(x * _SQRT_HALF))


def _erf_gelu_fwd(x):
  return _erf_gelu(x), x


def _erf_gelu_bwd(x, grad):
  cdf = 0.5 * (1.0 + jax.lax.erf(x * _SQRT_HALF))
  return (grad * (cdf + x * jnp.exp(-0.5 * x * x) * _INV_SQRT_2PI),)


_erf_gelu.defvjp(_erf_gelu_fwd, _erf_gelu_bwd)


def _activation(name: str):
  if name == "gelu":
    return exact_gelu
  if name in ("gelu_new", "gelu_pytorch_tanh"):
    return lambda x: jax.nn.gelu(x, approximate=True)
  return jax.nn.relu


def roberta_position_ids(input_ids: jax.Array, pad_token_id: int) -> jax.Array:
  """RoBERTa (fairseq) positions: pad tokens get pad_token_id, real tokens pad_token_id + 1, + 2, ..."""
  not_pad = (input_ids != pad_token_id).astype(jnp.int32)
  return jnp.cumsum(not_pad, axis=1) * not_pad + pad_token_id


class Embeddings(nn.Module):
  """Word + position + token-type embeddings, LayerNorm, dropout."""
  config: EncoderConfig

  @nn.compact
  def __call__(self, input_ids, token_type_ids, *, deterministic: bool):
    cfg = self.config
    length = input_ids.shape[1]
    if length > cfg.max_length:
      raise ValueError(f"sequence length {length} exceeds the model's maximum {cfg.max_length}")
    h = cfg.hidden_size
    # Tables are gathered in float32 and summed before the cast, so bfloat16 mode only rounds once and
    # never converts the whole vocabulary table.
    word = self.param("word_embeddings", _init(("vocab", "embed")), (cfg.vocab_size, h), jnp.float32)
    position = self.param(
        "position_embeddings", _init(("position", "embed")), (cfg.max_position_embeddings, h), jnp.float32)
    x = jnp.take(word, input_ids, axis=0)
    if cfg.model_type == "roberta":
      x = x + jnp.take(position, roberta_position_ids(input_ids, cfg.pad_token_id), axis=0)
    else:
      # BERT positions are 0..L-1 for every row: a slice, not a gather.
      x = x + position[None, :length]
    if cfg.type_vocab_size:  # DistilBERT has no token types
      token_type = self.param("token_type_embeddings", _init(("type", "embed")), (cfg.type_vocab_size, h),
                              jnp.float32)
      if token_type_ids is None:
        x = x + token_type[0]  # Hugging Face's default: all segment 0.
      else:
        x = x + jnp.take(token_type, token_type_ids, axis=0)
    x = _layer_norm(cfg, "norm", deterministic)(x)
    return Dropout(cfg.hidden_dropout)(x, deterministic=deterministic)


def fused_attention(q, k, v, key_mask, scale: float):
  """jax.nn.dot_product_attention over [B, L, N, D] (its own layout), keys given by their lengths.

  jdr's key masks are prefixes (texts are padded on the right), so each row's length says what its mask
  says; lengths are also what cuDNN's fused kernel takes (it refuses a broadcast [B, 1, 1, L] mask), and
  jax's default implementation never picks cuDNN by itself, so GPUs ask for it by name. A row with no
  token at all (a padding row, whose output nothing reads) attends to its first key rather than to none.
  """
  lengths = jnp.maximum(jnp.sum(key_mask, axis=-1, dtype=jnp.int32), 1)
  cudnn = parallel.platform() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] <= 128
  return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, scale=scale,
                                      implementation="cudnn" if cudnn else "xla")


def flash_attention(q, k, v, key_mask, scale: float, rate: float, key):
  """jdr's Pallas attention over [B, L, N, D], split over the mesh the step traces under (if any)."""
  # Imported here: Pallas' Triton module is needed only by the runs that ask for this kernel.
  from jdr.models import flash_attention as flash_kernel  # pylint: disable=g-import-not-at-top
  if parallel.platform() == "tpu":
    raise ValueError("model.attention=flash is a Triton kernel (GPUs; interpreted on CPUs): TPUs take auto")
  interpret = parallel.platform() != "gpu"
  mesh = parallel.activation_mesh()
  if mesh is not None:
    rows = parallel.data_parallel_size(mesh)
    heads = mesh.shape["model"] if q.shape[2] % mesh.shape["model"] == 0 else 1
    if (rows > 1 or heads > 1) and q.shape[0] % rows == 0:
      return flash_kernel.flash_attention_on_mesh(mesh, parallel.BATCH_AXES, "model" if heads > 1 else None,
                                                  q, k, v, key_mask, scale=scale, rate=rate, key=key,
                                                  interpret=interpret)
  return flash_kernel.flash_attention(q, k, v, key_mask, scale=scale, rate=rate, key=key, interpret=interpret)


class FirstTokenAttention(NamedTuple):
  """What a block's attention gives its first token, for a caller that pools it its own way (FGD's Eq. 7 in
  jdr.retrieval.span_embeddings): the first token's attention probabilities [B, N, L] (after attention
  dropout), the values [B, N, L, D] they weight, in the compute dtype, and the first token's input to the
  block [B, H], the residual its attention output is added to."""
  probabilities: jax.Array
  values: jax.Array
  residual: jax.Array


class Norm(nn.Module):
  """nn.LayerNorm's parameters (`scale`, `bias`: same names, shapes, initial values and logical axes) with the
  variance form chosen at each call (`_layer_norm`), so one norm built in `setup` serves training and
  deterministic forwards alike."""
  config: EncoderConfig

  @nn.compact
  def __call__(self, x, deterministic: bool):
    features = (x.shape[-1],)
    scale = self.param("scale", _init(("embed",), nn.initializers.ones_init()), features, jnp.float32)
    bias = self.param("bias", _init(("embed",), nn.initializers.zeros_init()), features, jnp.float32)
    norm = _layer_norm(self.config, None, deterministic, parent=None)
    return norm.apply({"params": {"scale": scale, "bias": bias}}, x)


class Layer(nn.Module):
  """One post-LayerNorm transformer block: self-attention, add & norm, GELU MLP, add & norm.

  `first_token_attention=True` also returns the first token's attention (`FirstTokenAttention`), and `tail`
  runs the rest of the block (output projection, norms, MLP) on any attention output: together they let a
  caller pool the first token's attention its own way and finish the block as the first token does.

  `first_token_only=True` computes the block's output at the first position only, [B, 1, H]: every key and
  value, but one query, one attention row and one position through the rest of the block, with the dropout
  masks the whole block draws there. A [CLS]-pooled tower's last block reads nothing else (`Encoder`).
  """
  config: EncoderConfig

  def setup(self):
    cfg = self.config
    # [B, L, E] -> [B, L, N, D]: heads come out of the projection with no transpose (its reshape is free).
    self.query = heads_projection(cfg, "query")
    self.key = heads_projection(cfg, "key")
    self.value = heads_projection(cfg, "value")
    self.attention_output = Dense(cfg, cfg.hidden_size, ("heads", "kv", "embed"), contracted=2,
                                  name="attention_output")
    self.attention_norm = Norm(cfg, name="attention_norm")
    self.intermediate = Dense(cfg, cfg.intermediate_size, ("embed", "mlp"), name="intermediate")
    self.output = Dense(cfg, cfg.hidden_size, ("mlp", "embed"), name="output")
    self.output_norm = Norm(cfg, name="output_norm")
    # Dropout masks are keyed by the module's path: these are the names the layer's dropouts have always had,
    # so training draws the same masks as before they were named here.
    self.attention_dropout = Dropout(cfg.attention_dropout, name="Dropout_0")
    self.attention_output_dropout = Dropout(cfg.hidden_dropout, name="Dropout_1")
    self.output_dropout = Dropout(cfg.hidden_dropout, name="Dropout_2")

  def __call__(self, x, key_mask, deterministic: bool, first_token_attention: bool = False,
               first_token_only: bool = False):
    # `deterministic`, `first_token_attention` and `first_token_only` are positional: nn.remat marks them
    # static by position.
    cfg = self.config
    length = x.shape[1]
    # `first_token_only`: one query, so one [1, L] row of logits a head, on the einsums on every platform.
    rows = x[:, :1] if first_token_only else x
    q, k, v = self.query(rows), self.key(x), self.value(x)
    # The first token's attention needs the probabilities: they stay on einsums. Attention dropout needs a
    # kernel that draws it (jdr's flash kernel), else the einsums too.
    drop = not deterministic and cfg.attention_dropout > 0.0
    no_probs_needed = not first_token_attention and not drop
    fused = not first_token_only and no_probs_needed and (cfg.attention == "fused" or (
        cfg.attention == "auto" and parallel.platform() != "cpu"))
    # Inside a shard_map that checks each value's manual axes (gradient caching's chunk loops over a mesh)
    # a Pallas call's operands would all have to vary alike, which its interpreter cannot do: the einsums
    # run there, with the same masks.
    if (not first_token_attention and not first_token_only and cfg.attention == "flash"
        and not jax.sharding.get_abstract_mesh().manual_axes):
      ctx = flash_attention(q, k, v, key_mask, cfg.head_dim ** -0.5, cfg.attention_dropout if drop else 0.0,
                            self.attention_dropout.rng_key() if drop else None).astype(cfg.compute_dtype)
    elif fused:
      ctx = fused_attention(q, k, v, key_mask, cfg.head_dim ** -0.5).astype(cfg.compute_dtype)
    else:
      # Scaling q ([B, L, N, D]) is cheaper than scaling the [B, N, L, L] logits.
      q = q * jnp.asarray(cfg.head_dim ** -0.5, q.dtype)
      # Encoding in half precision on a CPU, rows under the query blocks' length: the einsums take the
      # projections' [B, L, N, D] as they are and XLA lays out their operands. Heads swapped ahead of positions
      # beforehand made XLA's CPU compiler widen the logits' bfloat16 operands to float32: MiniLM's bfloat16
      # forward is 6% faster so. In float32 the vectors were bitwise the same and no faster (with query blocks
      # 4% slower, the cross-encoder's first position 1.5%), so float32, training and the accelerators keep
      # the heads ahead (docs/performance-history.md, "Encoding on an AVX-512 CPU").
      layout = "blnd" if (parallel.platform() == "cpu" and deterministic and q.dtype != jnp.float32
                          and cpu_query_blocks(rows.shape[1], length) is None) else "bnld"
      if layout == "bnld":
        q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))
      # The weights of the first query alone draw the bits of the whole [B, N, L, L] weights' first row, as
      # the flash kernel's tiles do.
      dropout = lambda w: self.attention_dropout(w, deterministic, whole=(*w.shape[:-2], length, length))
      ctx = einsum_attention(q, k, v, key_mask[:, None, None, :], dropout if drop else None,
                             first_row=first_token_attention, layout=layout)
      if first_token_attention:
        ctx, first_probs = ctx
      if layout == "bnld":
        ctx = jnp.swapaxes(ctx, 1, 2)
    out = self.tail(ctx, rows, deterministic, length=length)
    if not first_token_attention:
      return out
    return out, FirstTokenAttention(first_probs, v if layout == "bnld" else jnp.swapaxes(v, 1, 2), x[:, 0, :])

  def tail(self, context, residual, deterministic: bool, length: int | None = None):
    """The block after attention, on heads' outputs `context` [..., N, D] with their block inputs `residual`
    [..., H]: output projection, dropout, add & norm, MLP, dropout, add & norm. `length`: these are the first
    positions of rows this long, and draw the dropout masks the whole rows draw there."""
    whole = None if length is None else (*residual.shape[:-2], length, residual.shape[-1])
    attn = self.attention_output_dropout(self.attention_output(context), deterministic, whole=whole)
    h = self.attention_norm(residual + attn, deterministic)
    y = self.output(_activation(self.config.hidden_act)(self.intermediate(h)))
    y = self.output_dropout(y, deterministic, whole=whole)
    return self.output_norm(h + y, deterministic)


# The layer's matmuls: Dense keeps float32 kernels and biases and casts them to the
# compute dtype at every call.
LAYER_MATMULS = ("query", "key", "value", "attention_output", "intermediate", "output")


def serving_params(params: dict, cfg: EncoderConfig) -> dict:
  """An Encoder's params with each layer's matmul kernels and biases already in the compute dtype.

  The layers cast exactly these at every call, so a forward gives the same result bit for bit; what a
  forward that only reads the weights (encoding a corpus, evaluation) saves is the casts themselves: BERT-base
  in bfloat16 compiled for an NVIDIA H200, one [256, 256] batch, where each cast was a kernel of its own
  (docs/performance-history.md, "Compiled for the H200, change by change"). Embedding tables and LayerNorm
  parameters stay float32, as the layers read them. float32 models are returned as they are.
  """
  return cast_layer_matmuls(params, cfg.compute_dtype, LAYER_MATMULS)


def cast_layer_matmuls(params: dict, dtype, matmuls: tuple[str, ...]) -> dict:
  """params with the `matmuls` of each `layer_i` in `dtype` (every architecture's serving_params); float32
  returns params as they are."""
  if dtype == jnp.float32:
    return params
  cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)
  return {name: ({part: cast(sub) if part in matmuls else sub for part, sub in layer.items()}
                 if name.startswith("layer_") else layer)
          for name, layer in params.items()}


class Encoder(nn.Module):
  """BERT / RoBERTa encoder: token ids -> contextual token vectors [B, L, H] in float32.

  Params: {"embeddings": {...}, "layer_0": {...}, ...}. Dropout draws from the "dropout" rng stream when
  `deterministic=False`.
  """
  config: EncoderConfig

  def setup(self):
    cfg = self.config
    self.embeddings = Embeddings(cfg, name="embeddings")
    # Same param tree with or without remat, so checkpoints and HF conversion do not care.
    layer_cls = nn.remat(Layer, static_argnums=(3, 4, 5)) if cfg.remat else Layer
    self.layers = [layer_cls(cfg, name=f"layer_{i}") for i in range(cfg.num_layers)]

  def __call__(self, input_ids, attention_mask, token_type_ids=None, *, deterministic: bool = True,
               first_token_attention: bool = False, first_token_only: bool = False):
    """`first_token_attention=True` also returns the last layer's `FirstTokenAttention`: (hidden, attention).
    `first_token_only=True` returns the first position's output only, [B, 1, H], its last layer computed
    there alone (`Layer`): what [CLS] pooling reads, for about 10/12 of one layer's matmuls fewer."""
    key_mask = attention_mask.astype(bool)
    # Activations stay split by rows (the "batch" logical axis) through every layer. A no-op unless the
    # caller traces under parallel.activations_on (the train step does, on its mesh): with fsdp's
    # embed-sharded weights XLA otherwise re-split the activations along their width.
    constrain = parallel.constrain_rows
    x = constrain(self.embeddings(input_ids, token_type_ids, deterministic=deterministic))
    for i, layer in enumerate(self.layers):
      if first_token_attention and i == len(self.layers) - 1:
        x, attention = layer(x, key_mask, deterministic, True, first_token_only)
        return x.astype(jnp.float32), attention
      last = first_token_only and i == len(self.layers) - 1
      x = constrain(layer(x, key_mask, deterministic, False, last))
    return x.astype(jnp.float32)

  def last_block_tail(self, context, residual, deterministic: bool = True):
    """The last layer's `Layer.tail` in float32: what the encoder outputs at a position whose last-layer
    attention output is `context` [..., N, D] and whose input to that layer is `residual` [..., H]."""
    return self.layers[-1].tail(context, residual, deterministic).astype(jnp.float32)


def hf_table(cfg: EncoderConfig) -> list:
  """The name/shape/layout correspondence between a BertModel / RobertaModel state dict and Encoder params
  (`jdr.models.weight_names.Entry` each). DistilBERT's names are in jdr.models.distilbert."""
  from jdr.models import weight_names as names  # pylint: disable=g-import-not-at-top
  E = names.Entry
  h, n, d, m = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size

  def norm(hf: str, path: tuple[str, ...]) -> list:
    return [E(f"{hf}.weight", path + ("scale",), (h,), *names.SAME), E(f"{hf}.bias", path + ("bias",), (h,), *names.SAME)]

  emb = "embeddings"
  table = [
      E(f"{emb}.word_embeddings.weight", (emb, "word_embeddings"), (cfg.vocab_size, h), *names.SAME),
      E(f"{emb}.position_embeddings.weight", (emb, "position_embeddings"), (cfg.max_position_embeddings, h),
        *names.SAME),
      E(f"{emb}.token_type_embeddings.weight", (emb, "token_type_embeddings"), (cfg.type_vocab_size, h),
        *names.SAME),
      *norm(f"{emb}.LayerNorm", (emb, "norm")),
  ]
  for i in range(cfg.num_layers):
    hf, layer = f"encoder.layer.{i}", f"layer_{i}"
    for qkv in ("query", "key", "value"):
      table += [E(f"{hf}.attention.self.{qkv}.weight", (layer, qkv, "kernel"), (h, h), *names.to_heads(h, n, d)),
                E(f"{hf}.attention.self.{qkv}.bias", (layer, qkv, "bias"), (h,), *names.heads_bias(n, d))]
    table += [
        E(f"{hf}.attention.output.dense.weight", (layer, "attention_output", "kernel"), (h, h),
          *names.from_heads(h, n, d)),
        E(f"{hf}.attention.output.dense.bias", (layer, "attention_output", "bias"), (h,), *names.SAME),
        *norm(f"{hf}.attention.output.LayerNorm", (layer, "attention_norm")),
        E(f"{hf}.intermediate.dense.weight", (layer, "intermediate", "kernel"), (m, h), *names.LINEAR),
        E(f"{hf}.intermediate.dense.bias", (layer, "intermediate", "bias"), (m,), *names.SAME),
        E(f"{hf}.output.dense.weight", (layer, "output", "kernel"), (h, m), *names.LINEAR),
        E(f"{hf}.output.dense.bias", (layer, "output", "bias"), (h,), *names.SAME),
        *norm(f"{hf}.output.LayerNorm", (layer, "output_norm")),
    ]
  return table
