"""ModernBERT in Flax linen, numerically matching transformers' PyTorch `ModernBertModel`.

What sets it apart from BERT: pre-LayerNorm blocks (the first block's attention norm is the identity, the
embeddings' norm stands in for it), rotary positions instead of a position table (one base for global layers,
another for local ones), local attention on most layers (a token sees the tokens within local_attention // 2
of it) with global attention every few layers, a GeGLU MLP, optional biases (none in the released models) and a
final LayerNorm. Texts are right-padded: positions are 0..L-1, the padding masked out of every key.

Parameters carry the logical axes of jdr's rule table ("vocab", "embed", "mlp", "heads", "kv"), so the mesh rules
shard it as they shard BERT. Mixed precision as jdr.models.bert: float32 parameters, matmuls in the compute
dtype, softmax, rotary tables and LayerNorm statistics in float32, the output float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jdr.models import bert
from jdr.models import weight_names as names
from jdr.models.dropout import Dropout
from jdr.runtime import parallel

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
LAYER_TYPES = ("full_attention", "sliding_attention")
_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "swish")
# Keys of a layer type's rope_parameters that jdr reads; any other (scaling factors...) changes the rotation.
_ROPE_KEYS = ("rope_type", "type", "rope_theta")


def _every_nth_global(num_layers: int, every: int) -> tuple[str, ...]:
  # transformers' pattern for configs that predate layer_types: layer 0 global, then every n-th.
  return tuple("sliding_attention" if i % every else "full_attention" for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class ModernBertConfig:
  """Architecture of a ModernBERT encoder; defaults are ModernBERT-base's."""
  model_type: str = "modernbert"
  vocab_size: int = 50368
  hidden_size: int = 768
  num_layers: int = 22
  num_heads: int = 12
  intermediate_size: int = 1152
  max_position_embeddings: int = 8192
  layer_norm_eps: float = 1e-5
  norm_bias: bool = False
  attention_bias: bool = False
  mlp_bias: bool = False
  local_attention: int = 128  # the whole window: local_attention // 2 tokens each side
  global_attn_every_n_layers: int = 3
  # Per layer, full_attention | sliding_attention, where a checkpoint's differ from every n-th global;
  # () = the every-n pattern (kept empty so that replace(num_layers=...) still describes a model).
  layer_types: tuple[str, ...] = ()
  global_rope_theta: float = 160000.0
  local_rope_theta: float = 10000.0
  pad_token_id: int = 50283
  hidden_act: str = "gelu"  # transformers' hidden_activation; "gelu" is the exact (erf) GELU
  hidden_dropout: float = 0.0  # the MLP's dropout (transformers' mlp_dropout)
  attention_dropout: float = 0.0  # on the probabilities and on the attention output, as transformers drops
  # None = hidden_dropout, so a run's model.dropout (which sets hidden_dropout) reaches the embeddings too.
  embedding_dropout: float | None = None
  type_vocab_size: int = 0  # no token types; kept so code that reads EncoderConfig's field reads this one
  dtype: str = "float32"
  remat: bool = False
  attention: str = "auto"  # accepted as EncoderConfig's is; attention here is always jdr's einsums

  def __post_init__(self):
    object.__setattr__(self, "layer_types", tuple(self.layer_types or ()))
    if self.model_type != "modernbert":
      raise ValueError(f"ModernBertConfig's model_type is 'modernbert', got {self.model_type!r}")
    if self.layer_types and (len(self.layer_types) != self.num_layers
                             or set(self.layer_types) - set(LAYER_TYPES)):
      raise ValueError(f"layer_types must name {LAYER_TYPES[0]} or {LAYER_TYPES[1]} for each of the "
                       f"{self.num_layers} layers, got {self.layer_types}")
    if self.global_attn_every_n_layers < 1:
      raise ValueError(f"global_attn_every_n_layers must be >= 1, got {self.global_attn_every_n_layers}")
    if self.hidden_size % self.num_heads or self.head_dim % 2:
      raise ValueError(f"hidden_size {self.hidden_size} must be num_heads {self.num_heads} heads of an even "
                       "size (rotary positions rotate pairs)")
    if self.hidden_act not in _ACTIVATIONS:
      raise ValueError(f"hidden_act {self.hidden_act!r} unsupported; expected one of {_ACTIVATIONS}")
    if self.type_vocab_size:
      raise ValueError("ModernBERT has no token-type table: type_vocab_size must be 0")
    if self.dtype not in _DTYPES:
      raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {self.dtype!r}")
    if self.attention not in bert.ATTENTION_KINDS:
      raise ValueError(f"attention must be one of {bert.ATTENTION_KINDS}, got {self.attention!r}")

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def compute_dtype(self) -> Any:
    return _DTYPES[self.dtype]

  @property
  def max_length(self) -> int:
    return self.max_position_embeddings

  @property
  def resolved_layer_types(self) -> tuple[str, ...]:
    return self.layer_types or _every_nth_global(self.num_layers, self.global_attn_every_n_layers)

  @property
  def resolved_embedding_dropout(self) -> float:
    return self.hidden_dropout if self.embedding_dropout is None else self.embedding_dropout

  def replace(self, **changes) -> ModernBertConfig:
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_saved(cls, d: dict[str, Any]) -> ModernBertConfig:
    """The encoder a saved description names; how the saving run computed attention is not part of it."""
    return cls(**{**d, "layer_types": tuple(d.get("layer_types") or ()), "attention": "auto"})

  @classmethod
  def from_hf(cls, config: dict[str, Any], **overrides) -> ModernBertConfig:
    """A config from a transformers `config.json` dict (transformers 4's keys or 5's); `overrides` set
    jdr-only fields (dtype...). Refuses what this module does not compute."""
    if config.get("model_type", "modernbert") != "modernbert":
      raise ValueError(f"model_type {config.get('model_type')!r} is not ModernBERT")
    layers = config["num_hidden_layers"]
    every = config.get("global_attn_every_n_layers") or 3
    layer_types = tuple(config.get("layer_types") or ())
    if layer_types == _every_nth_global(layers, every):
      layer_types = ()
    if config.get("rope_scaling"):
      raise ValueError(f"ModernBERT rope_scaling {config['rope_scaling']} is not one jdr implements")
    # transformers 5 writes {"full_attention": {...}, "sliding_attention": {...}}; 4 wrote global_rope_theta
    # and local_rope_theta, which 5 still reads when rope_parameters lacks a theta.
    rope = config.get("rope_parameters") or {}
    if rope and not set(rope) <= set(LAYER_TYPES):
      raise ValueError(f"ModernBERT rope_parameters {rope} are not per layer type ({', '.join(LAYER_TYPES)})")
    thetas = {}
    for kind, legacy, default in (("full_attention", "global_rope_theta", 160000.0),
                                  ("sliding_attention", "local_rope_theta", 10000.0)):
      params = rope.get(kind) or {}
      rope_type = params.get("rope_type", params.get("type", "default"))
      extra = {k: v for k, v in params.items() if k not in _ROPE_KEYS and v not in (None, 1.0)}
      if rope_type != "default" or extra:
        raise ValueError(f"ModernBERT rope_parameters for {kind} layers {params}: jdr implements plain "
                         "rotary positions only (rope_type default, no scaling)")
      thetas[kind] = float(params.get("rope_theta") or config.get(legacy) or default)
    if config.get("hidden_activation", "gelu") not in _ACTIVATIONS:
      raise ValueError(f"ModernBERT hidden_activation {config['hidden_activation']!r} unsupported; jdr "
                       f"computes {', '.join(_ACTIVATIONS)}")
    mlp_dropout = config.get("mlp_dropout", 0.0)
    embedding_dropout = config.get("embedding_dropout", 0.0)
    fields = dict(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"], num_layers=layers,
        num_heads=config["num_attention_heads"], intermediate_size=config["intermediate_size"],
        max_position_embeddings=config.get("max_position_embeddings", 8192),
        layer_norm_eps=config.get("norm_eps", 1e-5), norm_bias=config.get("norm_bias", False),
        attention_bias=config.get("attention_bias", False), mlp_bias=config.get("mlp_bias", False),
        local_attention=config.get("local_attention", 128), global_attn_every_n_layers=every,
        layer_types=layer_types, global_rope_theta=thetas["full_attention"],
        local_rope_theta=thetas["sliding_attention"],
        pad_token_id=config.get("pad_token_id") if config.get("pad_token_id") is not None else 0,
        hidden_act=config.get("hidden_activation", "gelu"), hidden_dropout=mlp_dropout,
        attention_dropout=config.get("attention_dropout", 0.0),
        embedding_dropout=None if embedding_dropout == mlp_dropout else embedding_dropout)
    fields.update(overrides)
    return cls(**fields)

  def to_hf(self) -> dict[str, Any]:
    """The transformers `config.json` dict (jdr-only fields dropped). Both transformers 5's keys
    (layer_types, rope_parameters) and 4's (global/local_rope_theta, global_attn_every_n_layers) are
    written, so either version reads the same model."""
    types = self.resolved_layer_types
    config = {
        "architectures": ["ModernBertModel"], "model_type": "modernbert", "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads, "intermediate_size": self.intermediate_size,
        "max_position_embeddings": self.max_position_embeddings, "norm_eps": self.layer_norm_eps,
        "norm_bias": self.norm_bias, "attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias,
        "local_attention": self.local_attention, "layer_types": list(types),
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": self.global_rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": self.local_rope_theta}},
        "global_rope_theta": self.global_rope_theta, "local_rope_theta": self.local_rope_theta,
        "pad_token_id": self.pad_token_id, "hidden_activation": self.hidden_act,
        "mlp_dropout": self.hidden_dropout, "attention_dropout": self.attention_dropout,
        "embedding_dropout": self.resolved_embedding_dropout, "initializer_range": 0.02,
    }
    # transformers 4 knows only the every-n pattern: written where it is that pattern.
    if types == _every_nth_global(self.num_layers, self.global_attn_every_n_layers):
      config["global_attn_every_n_layers"] = self.global_attn_every_n_layers
    return config


def _init(axes, init=None):
  return nn.with_logical_partitioning(init or nn.initializers.normal(stddev=0.02), axes)


class _Linear(nn.Module):
  """A kernel [*in, *out] (logical axes `axes`) with an optional bias, as one 2-D matmul in the compute dtype
  (bert.Dense's product, without the bias ModernBERT's released models do not have)."""
  config: ModernBertConfig
  features: tuple[int, ...]
  axes: tuple[str | None, ...]
  use_bias: bool
  contracted: int = 1

  @nn.compact
  def __call__(self, x):
    width = int(np.prod(self.features))
    kernel = self.param("kernel", _init(self.axes), (*x.shape[-self.contracted:], *self.features), jnp.float32)
    dtype = self.config.compute_dtype
    flat = x.reshape(*x.shape[:-self.contracted], -1).astype(dtype)
    y = jnp.dot(flat, kernel.reshape(-1, width).astype(dtype))
    if self.use_bias:
      bias = self.param("bias", _init(self.axes[-len(self.features):], nn.initializers.zeros_init()),
                        self.features, jnp.float32)
      y = bert.add_bias(y, bias.reshape(width))
    return y.reshape(*y.shape[:-1], *self.features)


def _norm(cfg: ModernBertConfig, name: str, deterministic: bool) -> nn.LayerNorm:
  # Statistics in float32 whatever the compute dtype; the variance form per call as bert._layer_norm's
  # (the one-pass form while training, whose backward keeps less).
  return nn.LayerNorm(epsilon=cfg.layer_norm_eps, use_bias=cfg.norm_bias, dtype=cfg.compute_dtype,
                      param_dtype=jnp.float32, use_fast_variance=not deterministic,
                      scale_init=_init(("embed",), nn.initializers.ones_init()),
                      bias_init=_init(("embed",), nn.initializers.zeros_init()), name=name)


def _activation(name: str):
  if name == "gelu":
    return bert.exact_gelu
  if name in ("gelu_new", "gelu_pytorch_tanh"):
    return lambda x: jax.nn.gelu(x, approximate=True)
  return jax.nn.relu if name == "relu" else jax.nn.silu


def rotary(length: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
  """float32 cos, sin [L, D] of positions 0..L-1, in transformers' layout (the frequencies twice, end to end)
  and its float32 arithmetic; numpy constants, so no step recomputes them."""
  inv_freq = np.float32(1.0) / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                                      / np.float32(head_dim)))
  freqs = np.arange(length, dtype=np.float32)[:, None] * inv_freq[None, :]
  emb = np.concatenate([freqs, freqs], axis=-1)
  return np.cos(emb), np.sin(emb)


def _rotate(x, cos, sin):
  """x [B, L, N, D] rotated in float32 and rounded back to its dtype, as transformers rotates q and k."""
  x32 = x.astype(jnp.float32)
  half = x32.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos[None, :, None, :] + rotated * sin[None, :, None, :]).astype(x.dtype)


class Layer(nn.Module):
  """One pre-LayerNorm block: [norm] -> attention (global or local) -> add; norm -> GeGLU MLP -> add."""
  config: ModernBertConfig
  index: int

  @nn.compact
  def __call__(self, x, key_mask, deterministic: bool):
    # `deterministic` is positional: nn.remat marks it static by position.
    cfg = self.config
    n, d, m, length = cfg.num_heads, cfg.head_dim, cfg.intermediate_size, x.shape[1]
    local = cfg.resolved_layer_types[self.index] == "sliding_attention"
    h = _norm(cfg, "attn_norm", deterministic)(x) if self.index else x
    # [B, L, 3, N, D]: transformers' fused projection, split with no transpose; the (3, N) layout keeps a
    # tensor-parallel shard's q, k and v heads on the same device.
    qkv = _Linear(cfg, (3, n, d), ("embed", None, "heads", "kv"), cfg.attention_bias, name="Wqkv")(h)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    cos, sin = rotary(length, d, cfg.local_rope_theta if local else cfg.global_rope_theta)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    q = q * jnp.asarray(d ** -0.5, q.dtype)  # cheaper on [B, L, N, D] than on the [B, N, L, L] logits
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))  # [B, N, L, D], plain batched products
    allowed = key_mask[:, None, None, :]
    if local:
      positions = np.arange(length)
      allowed = allowed & (np.abs(positions[:, None] - positions[None, :]) <= cfg.local_attention // 2)
    dropout = Dropout(cfg.attention_dropout)
    drop = not deterministic and cfg.attention_dropout > 0.0
    ctx = bert.einsum_attention(q, k, v.astype(cfg.compute_dtype), allowed,
                                (lambda w: dropout(w, deterministic)) if drop else None)
    ctx = jnp.swapaxes(ctx, 1, 2)
    attn = _Linear(cfg, (cfg.hidden_size,), ("heads", "kv", "embed"), cfg.attention_bias, contracted=2,
                   name="Wo")(ctx)
    x = x + Dropout(cfg.attention_dropout)(attn, deterministic)  # transformers' out_drop
    h = _norm(cfg, "mlp_norm", deterministic)(x)
    # [B, L, 2, M]: input and gate side by side per MLP unit, so an "mlp"-sharded kernel splits both alike.
    wi = _Linear(cfg, (2, m), ("embed", None, "mlp"), cfg.mlp_bias, name="Wi")(h)
    gated = _activation(cfg.hidden_act)(wi[..., 0, :]) * wi[..., 1, :]
    gated = Dropout(cfg.hidden_dropout)(gated, deterministic)
    return x + _Linear(cfg, (cfg.hidden_size,), ("mlp", "embed"), cfg.mlp_bias, name="mlp_Wo")(gated)


class ModernBertEncoder(nn.Module):
  """Token ids [B, L] (right-padded) -> final-normed hidden states [B, L, H] in float32.

  Params: {"word_embeddings", "embeddings_norm", "layer_0" ... "layer_{n-1}", "final_norm"}. Dropout draws
  from the "dropout" rng stream when `deterministic=False`.
  """
  config: ModernBertConfig

  @nn.compact
  def __call__(self, input_ids, attention_mask, token_type_ids=None, *, deterministic: bool = True,
               first_token_attention: bool = False):
    del token_type_ids  # ModernBERT has none
    cfg = self.config
    if first_token_attention:
      raise ValueError("FGD's first-token attention needs a BERT-family encoder (bert, roberta, distilbert), "
                       "not ModernBERT")
    if input_ids.shape[1] > cfg.max_length:
      raise ValueError(f"sequence length {input_ids.shape[1]} exceeds the model's maximum {cfg.max_length}")
    word = self.param("word_embeddings", _init(("vocab", "embed")), (cfg.vocab_size, cfg.hidden_size),
                      jnp.float32)
    # Gathered in float32 and normed before the cast: bfloat16 never converts the whole vocabulary table.
    x = _norm(cfg, "embeddings_norm", deterministic)(jnp.take(word, input_ids, axis=0))
    x = parallel.constrain_rows(Dropout(cfg.resolved_embedding_dropout)(x, deterministic))
    key_mask = attention_mask.astype(bool)
    # Same param tree with or without remat.
    layer_cls = nn.remat(Layer, static_argnums=(3,)) if cfg.remat else Layer
    for i in range(cfg.num_layers):
      x = parallel.constrain_rows(layer_cls(cfg, i, name=f"layer_{i}")(x, key_mask, deterministic))
    return _norm(cfg, "final_norm", deterministic)(x).astype(jnp.float32)


# The layers' matmuls: _Linear keeps float32 kernels and biases and casts them at every call.
LAYER_MATMULS = ("Wqkv", "Wo", "Wi", "mlp_Wo")


def serving_params(params: dict, cfg: ModernBertConfig) -> dict:
  """Params with each layer's matmul kernels and biases already in the compute dtype: the same forward bit
  for bit, without the casts (as bert.serving_params). float32 models are returned as they are."""
  return bert.cast_layer_matmuls(params, cfg.compute_dtype, LAYER_MATMULS)


def hf_table(cfg: ModernBertConfig) -> list[names.Entry]:
  """ModernBertModel's state-dict names (no "model." prefix) <-> ModernBertEncoder params. Which norms and
  biases exist follows the config: layer 0 has no attn_norm; biases only where norm/attention/mlp_bias."""
  E = names.Entry
  h, n, d, m = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size

  def norm(hf: str, path: tuple[str, ...]) -> list[names.Entry]:
    out = [E(f"{hf}.weight", path + ("scale",), (h,), *names.SAME)]
    return out + ([E(f"{hf}.bias", path + ("bias",), (h,), *names.SAME)] if cfg.norm_bias else [])

  def linear(hf: str, path: tuple[str, ...], out_shape: tuple[int, ...], in_shape: tuple[int, ...], bias: bool):
    # torch [out, in] flat <-> Flax [*in, *out]; the split of `out` is transformers' view of it.
    o, i = int(np.prod(out_shape)), int(np.prod(in_shape))
    kernel = (lambda w: w.T.reshape(*in_shape, *out_shape), lambda k: k.reshape(i, o).T)
    entries = [E(f"{hf}.weight", path + ("kernel",), (o, i), *kernel)]
    if bias:
      entries.append(E(f"{hf}.bias", path + ("bias",), (o,), lambda b: b.reshape(out_shape),
                       lambda b: b.reshape(o)))
    return entries

  table = [E("embeddings.tok_embeddings.weight", ("word_embeddings",), (cfg.vocab_size, h), *names.SAME),
           *norm("embeddings.norm", ("embeddings_norm",))]
  for i in range(cfg.num_layers):
    hf, layer = f"layers.{i}", f"layer_{i}"
    if i:
      table += norm(f"{hf}.attn_norm", (layer, "attn_norm"))
    table += linear(f"{hf}.attn.Wqkv", (layer, "Wqkv"), (3, n, d), (h,), cfg.attention_bias)
    table += linear(f"{hf}.attn.Wo", (layer, "Wo"), (h,), (n, d), cfg.attention_bias)
    table += norm(f"{hf}.mlp_norm", (layer, "mlp_norm"))
    # Wi's rows are [input; gate] (transformers chunks them in two): [2, M] on the Flax side.
    table += linear(f"{hf}.mlp.Wi", (layer, "Wi"), (2, m), (h,), cfg.mlp_bias)
    table += linear(f"{hf}.mlp.Wo", (layer, "mlp_Wo"), (h,), (m,), cfg.mlp_bias)
  table += norm("final_norm", ("final_norm",))
  return table


def params_from_state_dict(cfg: ModernBertConfig, tensors: dict[str, np.ndarray],
                           source: str = "state dict") -> dict[str, Any]:
  """ModernBertModel tensors (already without "model." and heads) -> ModernBertEncoder params (float32
  numpy); every missing, unexpected or mis-shaped tensor reported at once by `names.HFWeightsError`."""
  return names.params_from_table(hf_table(cfg), tensors, source, family="modernbert")
