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
  local_attention: int = 128
  layer_types: tuple[str, ...] = ()  # per layer, full_attention | sliding_attention; () = every third global
  global_rope_theta: float = 160000.0
  local_rope_theta: float = 10000.0
  pad_token_id: int = 50283
  hidden_act: str = "gelu"
  hidden_dropout: float = 0.0  # the MLP's dropout (transformers' mlp_dropout)
  attention_dropout: float = 0.0
  embedding_dropout: float = 0.0
  type_vocab_size: int = 0
  dtype: str = "float32"
  remat: bool = False
  attention: str = "auto"  # accepted as EncoderConfig's is; attention here is always jdr's einsums

  def __post_init__(self):
    if not self.layer_types:
      object.__setattr__(self, "layer_types", tuple(
          "sliding_attention" if i % 3 else "full_attention" for i in range(self.num_layers)))
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
      raise ValueError(f"layer_types must name {LAYER_TYPES[0]} or {LAYER_TYPES[1]} for each of the "
                       f"{self.num_layers} layers, got {self.layer_types}")
    if self.hidden_size % self.num_heads:
      raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
    if self.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu"):
      raise ValueError(f"hidden_act {self.hidden_act!r} unsupported")
    if self.dtype not in _DTYPES:
      raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {self.dtype!r}")

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def compute_dtype(self) -> Any:
    return _DTYPES[self.dtype]

  @property
  def max_length(self) -> int:
    return self.max_position_embeddings

  def replace(self, **changes) -> ModernBertConfig:
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_saved(cls, d: dict[str, Any]) -> ModernBertConfig:
    return cls(**{**d, "layer_types": tuple(d.get("layer_types") or ()), "attention": "auto"})

  @classmethod
  def from_hf(cls, config: dict[str, Any], **overrides) -> ModernBertConfig:
    layers = config["num_hidden_layers"]
    every = config.get("global_attn_every_n_layers", 3)
    layer_types = config.get("layer_types") or [
        "sliding_attention" if i % every else "full_attention" for i in range(layers)]
    rope = config.get("rope_parameters") or {}
    thetas = {}
    for kind, legacy, default in (("full_attention", "global_rope_theta", 160000.0),
                                  ("sliding_attention", "local_rope_theta", 10000.0)):
      params = rope.get(kind) or {}
      if params.get("rope_type", "default") != "default":
        raise ValueError(f"ModernBERT rope_type {params['rope_type']!r} for {kind} layers is not one jdr "
                         "implements (default only)")
      thetas[kind] = float(params.get("rope_theta", config.get(legacy, default)))
    if config.get("rope_scaling"):
      raise ValueError(f"ModernBERT rope_scaling {config['rope_scaling']} is not one jdr implements")
    fields = dict(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"], num_layers=layers,
        num_heads=config["num_attention_heads"], intermediate_size=config["intermediate_size"],
        max_position_embeddings=config.get("max_position_embeddings", 8192),
        layer_norm_eps=config.get("norm_eps", 1e-5), norm_bias=config.get("norm_bias", False),
        attention_bias=config.get("attention_bias", False), mlp_bias=config.get("mlp_bias", False),
        local_attention=config.get("local_attention", 128), layer_types=tuple(layer_types),
        global_rope_theta=thetas["full_attention"], local_rope_theta=thetas["sliding_attention"],
        pad_token_id=config.get("pad_token_id") if config.get("pad_token_id") is not None else 0,
        hidden_act=config.get("hidden_activation", "gelu"), hidden_dropout=config.get("mlp_dropout", 0.0),
        attention_dropout=config.get("attention_dropout", 0.0),
        embedding_dropout=config.get("embedding_dropout", 0.0))
    fields.update(overrides)
    return cls(**fields)

  def to_hf(self) -> dict[str, Any]:
    return {"architectures": ["ModernBertModel"], "model_type": "modernbert", "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings, "norm_eps": self.layer_norm_eps,
            "norm_bias": self.norm_bias, "attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias,
            "local_attention": self.local_attention, "layer_types": list(self.layer_types),
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": self.global_rope_theta},
                                "sliding_attention": {"rope_type": "default",
                                                      "rope_theta": self.local_rope_theta}},
            "pad_token_id": self.pad_token_id, "hidden_activation": self.hidden_act,
            "mlp_dropout": self.hidden_dropout, "attention_dropout": self.attention_dropout,
            "embedding_dropout": self.embedding_dropout, "initializer_range": 0.02}


def _init(axes, init=None):
  return nn.with_logical_partitioning(init or nn.initializers.normal(stddev=0.02), axes)


class _Linear(nn.Module):
  """A kernel [*in, *out] (logical axes `axes`) with an optional bias, one 2-D matmul in the compute dtype."""
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


def _norm(cfg: ModernBertConfig, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=cfg.layer_norm_eps, use_bias=cfg.norm_bias, dtype=cfg.compute_dtype,
                      param_dtype=jnp.float32, use_fast_variance=False,
                      scale_init=_init(("embed",), nn.initializers.ones_init()),
                      bias_init=_init(("embed",), nn.initializers.zeros_init()), name=name)


def _activation(name: str):
  if name == "gelu":
    return bert.exact_gelu
  if name in ("gelu_new", "gelu_pytorch_tanh"):
    return lambda x: jax.nn.gelu(x, approximate=True)
  return jax.nn.silu if name == "silu" else jax.nn.relu


def rotary(length: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """cos, sin [L, D] of positions 0..L-1 (transformers' layout: the frequencies twice, end to end)."""
  inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
  freqs = np.arange(length, dtype=np.float32)[:, None] * inv_freq[None, :]
  emb = np.concatenate([freqs, freqs], axis=-1)
  return jnp.asarray(np.cos(emb)), jnp.asarray(np.sin(emb))


def _rotate(x, cos, sin):
  """x [B, L, N, D] rotated, in float32 (as transformers rotates q and k)."""
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
    cfg = self.config
    n, d = cfg.num_heads, cfg.head_dim
    local = cfg.layer_types[self.index] == "sliding_attention"
    h = _norm(cfg, "attn_norm")(x) if self.index else x
    qkv = _Linear(cfg, (3, n, d), ("embed", None, "heads", "kv"), cfg.attention_bias, name="Wqkv")(h)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    cos, sin = rotary(x.shape[1], d, cfg.local_rope_theta if local else cfg.global_rope_theta)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))  # [B, N, L, D]
    logits = jnp.einsum("bnqd,bnkd->bnqk", q, k, preferred_element_type=jnp.float32) * d ** -0.5
    allowed = key_mask[:, None, None, :]
    if local:
      positions = jnp.arange(x.shape[1])
      allowed = allowed & (jnp.abs(positions[:, None] - positions[None, :]) <= cfg.local_attention // 2)
    probs = jax.nn.softmax(jnp.where(allowed, logits, jnp.finfo(jnp.float32).min), axis=-1)
    probs = Dropout(cfg.attention_dropout)(probs, deterministic)
    ctx = jnp.swapaxes(jnp.einsum("bnqk,bnkd->bnqd", probs.astype(cfg.compute_dtype), v), 1, 2)
    x = x + _Linear(cfg, (cfg.hidden_size,), ("heads", "kv", "embed"), cfg.attention_bias, contracted=2,
                    name="Wo")(ctx)
    h = _norm(cfg, "mlp_norm")(x)
    wi = _Linear(cfg, (2 * cfg.intermediate_size,), ("embed", "mlp"), cfg.mlp_bias, name="Wi")(h)
    gated = _activation(cfg.hidden_act)(wi[..., :cfg.intermediate_size]) * wi[..., cfg.intermediate_size:]
    gated = Dropout(cfg.hidden_dropout)(gated, deterministic)
    return x + _Linear(cfg, (cfg.hidden_size,), ("mlp", "embed"), cfg.mlp_bias, name="mlp_Wo")(gated)


class ModernBertEncoder(nn.Module):
  """Token ids [B, L] (right-padded) -> final-normed hidden states [B, L, H] in float32."""
  config: ModernBertConfig

  @nn.compact
  def __call__(self, input_ids, attention_mask, token_type_ids=None, *, deterministic: bool = True,
               first_token_attention: bool = False):
    del token_type_ids  # ModernBERT has none
    cfg = self.config
    if first_token_attention:
      raise ValueError("FGD's first-token attention needs a BERT-family encoder, not ModernBERT")
    word = self.param("word_embeddings", _init(("vocab", "embed")), (cfg.vocab_size, cfg.hidden_size),
                      jnp.float32)
    x = _norm(cfg, "embeddings_norm")(jnp.take(word, input_ids, axis=0))
    x = Dropout(cfg.embedding_dropout)(x, deterministic)
    key_mask = attention_mask.astype(bool)
    layer_cls = nn.remat(Layer, static_argnums=(3,)) if cfg.remat else Layer
    for i in range(cfg.num_layers):
      x = parallel.constrain_rows(layer_cls(cfg, i, name=f"layer_{i}")(x, key_mask, deterministic))
    return _norm(cfg, "final_norm")(x).astype(jnp.float32)


LAYER_MATMULS = ("Wqkv", "Wo", "Wi", "mlp_Wo")


def serving_params(params: dict, cfg: ModernBertConfig) -> dict:
  """Params with each layer's matmul weights already in the compute dtype (the same forward, fewer casts)."""
  dtype = cfg.compute_dtype
  if dtype == jnp.float32:
    return params
  cast = lambda tree: jax.tree.map(lambda x: x.astype(dtype), tree)
  return {name: ({part: cast(sub) if part in LAYER_MATMULS else sub for part, sub in layer.items()}
                 if name.startswith("layer_") else layer) for name, layer in params.items()}


def hf_table(cfg: ModernBertConfig) -> list[names.Entry]:
  """ModernBertModel's state dict names (no "model." prefix) <-> ModernBertEncoder params."""
  E = names.Entry
  h, n, d, m = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size

  def norm(hf: str, path: tuple[str, ...]) -> list[names.Entry]:
    out = [E(f"{hf}.weight", path + ("scale",), (h,), *names.SAME)]
    return out + ([E(f"{hf}.bias", path + ("bias",), (h,), *names.SAME)] if cfg.norm_bias else [])

  def linear(hf: str, path: tuple[str, ...], out_shape: tuple[int, ...], in_shape: tuple[int, ...], bias: bool):
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
    table += linear(f"{hf}.mlp.Wi", (layer, "Wi"), (2 * m,), (h,), cfg.mlp_bias)
    table += linear(f"{hf}.mlp.Wo", (layer, "mlp_Wo"), (h,), (m,), cfg.mlp_bias)
  table += norm("final_norm", ("final_norm",))
  return table
