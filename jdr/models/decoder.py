"""Decoder LLMs as retrieval encoders: Llama, Mistral, Qwen2 and Qwen3 in Flax linen, numerically matching
transformers' PyTorch LlamaModel / MistralModel / Qwen2Model / Qwen3Model.

The four are one architecture with flags, as transformers defines them:

  llama    pre-RMSNorm blocks, rotary positions ("default", "linear" or "llama3" frequencies), grouped-query
           attention, SwiGLU MLP; optional biases on q/k/v/o (`attention_bias`) and on the MLP (`mlp_bias`)
  mistral  Llama without biases, with an optional sliding window over the keys of every layer
  qwen2    Llama with biases on q/k/v (not o); a sliding window on layers >= max_window_layers if asked
  qwen3    Llama with RMSNorm on each head of q and k before the rotation (`qk_norm`); `attention_bias`
           as Llama's; an explicit head_dim (128 unless config.json says)

A retrieval tower reads every row on its own: the attention is causal plus the padding mask, and the rotary
positions of a row count its real tokens (cumsum(mask) - 1, 0 on left padding), so a text's vectors are the
same padded on the right, padded on the left, or alone. That is what transformers computes when given
`position_ids=(mask.cumsum(-1) - 1).clamp(min=0)` (without position_ids it numbers a left-padded row's tokens
from its first pad). The sliding window counts positions in the array, as transformers' mask does; a row's
real tokens are contiguous, so that is the same as counting them.

Param tree: {"embeddings": {"word_embeddings"}, "layer_0": {"input_layernorm", "q_proj", "k_proj", "v_proj",
["q_norm", "k_norm",] "o_proj", "post_attention_layernorm", "gate_proj", "up_proj", "down_proj"}, ...,
"norm": {"scale"}}. Projections into heads are [H, heads, head_dim] kernels as in jdr.models.bert; logical axes
"vocab", "embed", "mlp", "heads" (query heads and key/value heads alike), "kv" (head_dim), so the rule tables
of jdr.runtime.parallel shard it unchanged (tensor parallelism needs the model axis to divide num_kv_heads).

LoRA (Hu et al. 2022, as PEFT computes it): with `lora_rank` r > 0, each projection named in `lora_targets`
gains "lora_a" [inputs..., r] and "lora_b" [r, outputs...] beside its kernel, and computes
x W + (alpha / r) * dropout(x) A B. A starts as PEFT's Kaiming-uniform draw and B at zero, so an untrained
adapter is the base model exactly. The adapters are stored in float32 whatever `param_dtype` is (they are
what trains); `jdr.training.optimizers` freezes everything else of the encoder. `merged` folds them into the
kernels, `peft_state_dict` writes them as a PEFT adapter of the base model.

Mixed precision: `param_dtype` (float32, or bfloat16 to keep a bfloat16 checkpoint so) is how parameters are
stored; `dtype` is the compute dtype of the matmuls and the residual stream. RMSNorm statistics, rotary
angles and their products, attention logits and softmax are float32; the output is float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jdr.models import bert
from jdr.models import weight_names
from jdr.models.dropout import Dropout
from jdr.runtime import parallel

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_TYPES = ("default", "linear", "llama3")
ATTENTION_KINDS = ("auto", "einsum", "fused")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_HF_CLASSES = {"llama": "LlamaModel", "mistral": "MistralModel", "qwen2": "Qwen2Model", "qwen3": "Qwen3Model"}
# transformers' config-class defaults, for a config.json that leaves a key out (save_pretrained writes them all).
_HF_DEFAULTS = {
    "llama": dict(vocab_size=32000, max_position_embeddings=2048, num_key_value_heads=None, head_dim=None,
                  bos_token_id=1, eos_token_id=2),
    "mistral": dict(vocab_size=32000, max_position_embeddings=4096 * 32, num_key_value_heads=8, head_dim=None,
                    bos_token_id=1, eos_token_id=2, sliding_window=4096),
    "qwen2": dict(vocab_size=151936, max_position_embeddings=32768, num_key_value_heads=32, head_dim=None,
                  bos_token_id=None, eos_token_id=None, sliding_window=4096, max_window_layers=28),
    "qwen3": dict(vocab_size=151936, max_position_embeddings=32768, num_key_value_heads=32, head_dim=128,
                  bos_token_id=None, eos_token_id=None, sliding_window=4096, max_window_layers=28),
}
# Matmuls of a layer: the parameters serving_params casts to the compute dtype.
LAYER_MATMULS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_PARAMS = ("lora_a", "lora_b")
# Names of a transformers checkpoint that are not the base model's: a causal LM's head (tied or not), the heads
# of transformers' task models, and the rotary buffer that Llama-1/2-era checkpoints saved.
IGNORED_HEADS = ("lm_head.", "score.", "classifier.", "qa_outputs.")
BASE_PREFIXES = ("model.",)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  """Architecture of a Llama-family decoder used as an encoder. Defaults are transformers' LlamaConfig()."""
  model_type: str = "llama"  # "llama" | "mistral" | "qwen2" | "qwen3"
  vocab_size: int = 32000
  hidden_size: int = 4096
  num_layers: int = 32
  num_heads: int = 32
  num_kv_heads: int | None = None  # None: num_heads (no grouping)
  head_dim: int | None = None  # None: hidden_size // num_heads
  intermediate_size: int = 11008
  max_position_embeddings: int = 2048
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  # Rotary frequencies: "default"; "linear" (every frequency / rope_factor); "llama3" (Llama 3.1's: low
  # frequencies / rope_factor, high ones kept, a smooth ramp between, set by the three fields after it).
  rope_type: str = "default"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_position_embeddings: int | None = None  # llama3; None: max_position_embeddings
  attention_bias: bool = False  # biases on q, k, v (Qwen2 always; Llama / Qwen3 with config.attention_bias)
  attention_output_bias: bool = False  # a bias on o (Llama / Qwen3 with config.attention_bias)
  mlp_bias: bool = False  # Llama's config.mlp_bias
  qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
  sliding_window: int | None = None  # keys at most this many positions back (the query's own included)
  max_window_layers: int = 0  # layers from this index on use the sliding window (Mistral: 0, all)
  pad_token_id: int | None = None
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  tie_word_embeddings: bool = False  # the LM head is the embedding table (only config.json cares)
  hidden_act: str = "silu"
  dtype: str = "float32"  # compute dtype: "float32" | "bfloat16"
  param_dtype: str = "float32"  # how parameters are stored: "float32" | "bfloat16"
  remat: bool = False  # recompute each layer's activations in the backward pass
  # "auto": jdr's einsum attention on CPUs and where attention dropout is drawn, else
  # jax.nn.dot_product_attention (XLA's, with the causal and padding mask); "einsum" / "fused" force one.
  # jdr's flash kernel has no causal mask: "flash" is refused.
  attention: str = "auto"
  hidden_dropout: float = 0.0  # jdr-only: on each block's attention and MLP outputs (transformers has none)
  attention_dropout: float = 0.0
  type_vocab_size: int = 0  # no token types: token_type_ids are ignored
  lora_rank: int = 0  # > 0: LoRA adapters of this rank on the `lora_targets` projections
  lora_alpha: float = 16.0  # the adapters' output is scaled by lora_alpha / lora_rank (PEFT's scaling)
  lora_dropout: float = 0.0  # dropout on the adapters' input (PEFT's lora_dropout)
  lora_targets: tuple[str, ...] = LAYER_MATMULS  # which of a layer's projections carry adapters

  def __post_init__(self):
    if self.model_type not in MODEL_TYPES:
      raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
    if self.num_kv_heads is None:
      object.__setattr__(self, "num_kv_heads", self.num_heads)
    if self.head_dim is None:
      if self.hidden_size % self.num_heads:
        raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}: "
                         "give head_dim")
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if isinstance(self.eos_token_id, list):  # config.json and saved descriptions hold lists
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
    if isinstance(self.lora_targets, (list, str)):  # saved descriptions hold lists; a config, "q_proj,v_proj"
      targets = self.lora_targets.split(",") if isinstance(self.lora_targets, str) else self.lora_targets
      object.__setattr__(self, "lora_targets", tuple(t.strip() for t in targets if t.strip()))
    if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
      raise ValueError(f"lora_rank must be an int >= 0 (0 = no adapters), got {self.lora_rank!r}")
    unknown = [t for t in self.lora_targets if t not in LAYER_MATMULS]
    if unknown:
      raise ValueError(f"lora_targets {unknown} are not projections of a decoder layer: choose from "
                       f"{', '.join(LAYER_MATMULS)}")
    if self.lora_rank and not self.lora_targets:
      raise ValueError(f"lora_rank={self.lora_rank} needs at least one projection in lora_targets")
    if not 0.0 <= self.lora_dropout < 1.0:
      raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim {self.head_dim} is odd: rotary positions rotate pairs of dimensions")
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"rope_type {self.rope_type!r} is not supported by jdr's decoder encoders: "
                       f"supported are {', '.join(ROPE_TYPES)}")
    if self.rope_type != "default" and not self.rope_factor > 0:
      raise ValueError(f"rope_factor must be positive, got {self.rope_factor}")
    if self.rope_type == "llama3":
      if self.rope_high_freq_factor == self.rope_low_freq_factor:
        raise ValueError("llama3 rope needs rope_high_freq_factor != rope_low_freq_factor")
      if self.rope_original_max_position_embeddings is None:
        object.__setattr__(self, "rope_original_max_position_embeddings", self.max_position_embeddings)
    if self.hidden_act != "silu":
      raise ValueError(f"hidden_act {self.hidden_act!r} unsupported: Llama-family MLPs are SwiGLU ('silu')")
    if self.dtype not in _DTYPES:
      raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {self.dtype!r}")
    if self.param_dtype not in _DTYPES:
      raise ValueError(f"param_dtype must be one of {tuple(_DTYPES)}, got {self.param_dtype!r}")
    if self.attention == "flash":
      raise ValueError("model.attention=flash: jdr's flash kernel has no causal mask, which decoder encoders "
                       f"need; use one of {ATTENTION_KINDS}")
    if self.attention not in ATTENTION_KINDS:
      raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
    if self.type_vocab_size:
      raise ValueError("decoder encoders have no token-type table: type_vocab_size must be 0")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
    # What transformers' classes can express, so that to_hf() is always the same model.
    kind = self.model_type
    if self.qk_norm != (kind == "qwen3"):
      raise ValueError(f"qk_norm is Qwen3's, and always Qwen3's (model_type {kind!r}, qk_norm={self.qk_norm})")
    if kind == "qwen2" and not (self.attention_bias and not self.attention_output_bias):
      raise ValueError("Qwen2 has biases on q, k, v and none on o: attention_bias=True, "
                       "attention_output_bias=False")
    if kind == "mistral" and (self.attention_bias or self.attention_output_bias):
      raise ValueError("Mistral has no attention biases")
    if kind in ("llama", "qwen3") and self.attention_bias != self.attention_output_bias:
      raise ValueError(f"{kind}'s attention_bias puts biases on q, k, v and o alike")
    if self.mlp_bias and kind != "llama":
      raise ValueError("mlp_bias is Llama's only")
    if self.sliding_window is not None and kind == "llama":
      raise ValueError("Llama has no sliding window (Mistral and Qwen2/3 do)")
    if kind == "mistral" and self.max_window_layers:
      raise ValueError("Mistral's sliding window is on every layer: max_window_layers must be 0")

  @property
  def compute_dtype(self) -> Any:
    return _DTYPES[self.dtype]

  @property
  def parameter_dtype(self) -> Any:
    return _DTYPES[self.param_dtype]

  @property
  def layer_norm_eps(self) -> float:
    return self.rms_norm_eps

  @property
  def max_length(self) -> int:
    """Longest sequence the model was configured for (rotary positions have no table to run out of)."""
    return self.max_position_embeddings

  @property
  def num_kv_groups(self) -> int:
    return self.num_heads // self.num_kv_heads

  def layer_window(self, i: int) -> int | None:
    """The sliding window of layer i, None for full (causal) attention."""
    return self.sliding_window if i >= self.max_window_layers else None

  def replace(self, **changes) -> DecoderConfig:
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_saved(cls, d: dict[str, Any]) -> DecoderConfig:
    """The encoder a saved model's description names (how the saving run computed attention is not part of
    the model: a loaded model takes the platform's default)."""
    return cls(**{**d, "attention": "auto"})

  @classmethod
  def from_hf(cls, config: dict[str, Any], **overrides) -> DecoderConfig:
    """Builds a config from a transformers `config.json` dict; `overrides` set jdr-only fields (dtype...)."""
    kind = config.get("model_type")
    if kind not in MODEL_TYPES:
      raise ValueError(f"unsupported Hugging Face model_type {kind!r} for a decoder encoder: jdr reads "
                       f"{', '.join(MODEL_TYPES)}")
    defaults = _HF_DEFAULTS[kind]
    get = lambda key: config.get(key, defaults.get(key))
    heads = config["num_attention_heads"]
    layers = config["num_hidden_layers"]
    fields = dict(
        model_type=kind,
        vocab_size=get("vocab_size"),
        hidden_size=config["hidden_size"],
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"],
        max_position_embeddings=get("max_position_embeddings"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        pad_token_id=config.get("pad_token_id"),
        bos_token_id=get("bos_token_id"),
        eos_token_id=get("eos_token_id"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        hidden_act=config.get("hidden_act", "silu"),
        attention_dropout=float(config.get("attention_dropout") or 0.0),
        qk_norm=kind == "qwen3",
    )
    fields.update(_rope_from_hf(config, fields["max_position_embeddings"]))
    if kind == "qwen2":
      fields.update(attention_bias=True, attention_output_bias=False)
    elif kind in ("llama", "qwen3"):
      bias = bool(config.get("attention_bias", False))
      fields.update(attention_bias=bias, attention_output_bias=bias)
    if kind == "llama":
      fields["mlp_bias"] = bool(config.get("mlp_bias", False))
    if kind == "mistral":
      fields["sliding_window"] = get("sliding_window")
    elif kind in ("qwen2", "qwen3"):
      fields.update(_qwen_window_from_hf(config, layers, defaults))
    fields.update(overrides)
    return cls(**fields)

  def to_hf(self) -> dict[str, Any]:
    """The transformers `config.json` dict for this architecture (jdr-only fields are dropped)."""
    rope = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
    if self.rope_type in ("linear", "llama3"):
      rope["factor"] = self.rope_factor
    if self.rope_type == "llama3":
      rope.update(low_freq_factor=self.rope_low_freq_factor, high_freq_factor=self.rope_high_freq_factor,
                  original_max_position_embeddings=self.rope_original_max_position_embeddings)
    eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
    config = {
        "architectures": [_HF_CLASSES[self.model_type]],
        "model_type": self.model_type,
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": self.hidden_act,
        "max_position_embeddings": self.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": self.rms_norm_eps,
        "rope_parameters": rope,
        "attention_dropout": self.attention_dropout,
        "pad_token_id": self.pad_token_id,
        "bos_token_id": self.bos_token_id,
        "eos_token_id": eos,
        "tie_word_embeddings": self.tie_word_embeddings,
        "use_cache": True,
    }
    if self.model_type in ("llama", "qwen3"):
      config["attention_bias"] = self.attention_bias
    if self.model_type == "llama":
      config["mlp_bias"] = self.mlp_bias
    if self.model_type == "mistral":
      config["sliding_window"] = self.sliding_window  # written even when None: Mistral's default is 4096
    if self.model_type in ("qwen2", "qwen3"):
      config.update(
          use_sliding_window=self.sliding_window is not None,
          sliding_window=self.sliding_window,
          max_window_layers=self.max_window_layers,
          layer_types=["sliding_attention" if self.layer_window(i) else "full_attention"
                       for i in range(self.num_layers)])
    return config


def _rope_from_hf(config: dict[str, Any], max_positions: int) -> dict[str, Any]:
  """DecoderConfig's rope fields from config.json: transformers 5's `rope_parameters`, or the older top-level
  `rope_theta` with `rope_scaling` ({"type" or "rope_type": ..., "factor": ...})."""
  params = config.get("rope_parameters") or config.get("rope_scaling") or {}
  if any(isinstance(v, dict) for v in params.values()):
    raise ValueError(f"rope parameters per layer type ({sorted(params)}) are not supported by jdr's decoder "
                     "encoders")
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"rope_type {rope_type!r} is not supported by jdr's decoder encoders: supported are "
                     f"{', '.join(ROPE_TYPES)}")
  partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
  if partial is not None and float(partial) != 1.0:
    raise ValueError(f"partial_rotary_factor {partial} is not supported by jdr's decoder encoders (only 1.0)")
  fields = dict(rope_type=rope_type, rope_theta=float(params.get("rope_theta", config.get("rope_theta", 10000.0))))
  if rope_type in ("linear", "llama3"):
    fields["rope_factor"] = float(params["factor"])
  if rope_type == "llama3":
    # transformers gives a top-level original_max_position_embeddings priority over the rope dict's.
    original = config.get("original_max_position_embeddings",
                          params.get("original_max_position_embeddings", max_positions))
    fields.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                  rope_high_freq_factor=float(params["high_freq_factor"]),
                  rope_original_max_position_embeddings=int(original))
  return fields


def _qwen_window_from_hf(config: dict[str, Any], layers: int, defaults: dict[str, Any]) -> dict[str, Any]:
  """Qwen2/Qwen3's sliding window: on only with use_sliding_window, then on the layers config.layer_types
  names (by default those from max_window_layers on), which jdr expresses as max_window_layers."""
  window = config.get("sliding_window", defaults["sliding_window"]) if config.get("use_sliding_window") else None
  if window is None:
    return dict(sliding_window=None, max_window_layers=0)
  first = config.get("max_window_layers", defaults["max_window_layers"])
  types = config.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                        for i in range(layers)]
  sliding = [t == "sliding_attention" for t in types]
  first = sliding.index(True) if any(sliding) else layers
  if not all(sliding[first:]):
    raise ValueError(f"layer_types {types}: jdr's decoder encoders take a sliding window on the layers from one "
                     "index on (max_window_layers), not this pattern")
  if first == layers:  # no layer slides: transformers builds only the full causal mask
    return dict(sliding_window=None, max_window_layers=0)
  return dict(sliding_window=int(window), max_window_layers=first)


# ---------------------------------------------------------------------------------------------- rotary


def rope_frequencies(cfg: DecoderConfig) -> np.ndarray:
  """The float32 inverse frequencies [head_dim / 2], transcribed from transformers' rope initialisers
  (LlamaRotaryEmbedding.compute_default_rope_parameters, _compute_linear_scaling_rope_parameters,
  _compute_llama3_parameters) in the same float32 operations."""
  dim = cfg.head_dim
  f32 = np.float32
  exponents = np.arange(0, dim, 2).astype(f32) / f32(dim)
  inv_freq = (f32(1.0) / (f32(cfg.rope_theta) ** exponents)).astype(f32)
  if cfg.rope_type == "linear":
    return (inv_freq / f32(cfg.rope_factor)).astype(f32)
  if cfg.rope_type == "llama3":
    factor, low, high = f32(cfg.rope_factor), f32(cfg.rope_low_freq_factor), f32(cfg.rope_high_freq_factor)
    old_context = f32(cfg.rope_original_max_position_embeddings)
    low_freq_wavelen = cfg.rope_original_max_position_embeddings / cfg.rope_low_freq_factor
    high_freq_wavelen = cfg.rope_original_max_position_embeddings / cfg.rope_high_freq_factor
    wavelen = (f32(2 * math.pi) / inv_freq).astype(f32)
    scaled = np.where(wavelen > f32(low_freq_wavelen), inv_freq / factor, inv_freq).astype(f32)
    smooth = ((old_context / wavelen - low) / (high - low)).astype(f32)
    smoothed = ((f32(1) - smooth) * scaled / factor + smooth * scaled).astype(f32)
    medium = ~(wavelen < f32(high_freq_wavelen)) & ~(wavelen > f32(low_freq_wavelen))
    return np.where(medium, smoothed, scaled).astype(f32)
  return inv_freq


def position_ids(attention_mask: jax.Array) -> jax.Array:
  """Each token's position among its row's real tokens: cumsum(mask) - 1, clipped at 0 (left padding's pads)."""
  return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=1) - 1, 0)


def rotary_tables(cfg: DecoderConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """float32 cos and sin [B, L, head_dim] of integer positions [B, L] (transformers' concatenated halves)."""
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_frequencies(cfg))
  angles = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(angles), jnp.sin(angles)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """x [B, L, heads, D] rotated by position (cos, sin [B, L, D]) in float32, rounded once to x's dtype."""
  x32 = x.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
  return (x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]).astype(x.dtype)


# ---------------------------------------------------------------------------------------------- modules


def _init(names: tuple[str | None, ...], init=None):
  # transformers' initialiser for these models: N(0, initializer_range=0.02) for every matrix and table.
  return nn.with_logical_partitioning(init or nn.initializers.normal(stddev=0.02), names)


class Dense(nn.Module):
  """A torch Linear over the trailing `contracted` axes of x into `features` (jdr.models.bert.Dense's layout
  and product), the bias optional, parameters stored in the config's param_dtype; with LoRA on this projection
  (its name in config.lora_targets), plus the adapters' low-rank product (the module docstring)."""
  config: DecoderConfig
  features: int | tuple[int, ...]
  names: tuple[str, ...]  # the kernel's logical axes; the bias takes the features'
  use_bias: bool = False
  contracted: int = 1

  @nn.compact
  def __call__(self, x, deterministic: bool = True):
    cfg = self.config
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    width = math.prod(features)
    inputs = x.shape[-self.contracted:]
    kernel = self.param("kernel", _init(self.names), (*inputs, *features), cfg.parameter_dtype)
    xc, kernel = nn.dtypes.promote_dtype(x, kernel, dtype=cfg.compute_dtype)
    flat = xc.reshape(*xc.shape[:-self.contracted], -1)
    y = jnp.dot(flat, kernel.reshape(-1, width))
    if self.use_bias:
      bias = self.param("bias", _init(self.names[-len(features):], nn.initializers.zeros_init()), features,
                        cfg.parameter_dtype)
      y = bert.add_bias(y, bias.reshape(width))
    if cfg.lora_rank and self.name in cfg.lora_targets:
      y = y + self.adapter(flat, inputs, features, deterministic)
    return y.reshape(*y.shape[:-1], *features)

  def adapter(self, flat, inputs: tuple[int, ...], features: tuple[int, ...], deterministic: bool):
    """(alpha / r) * dropout(x) A B, [..., width] in the compute dtype, from x flattened to [..., inputs]."""
    cfg = self.config
    r = cfg.lora_rank
    fan_in = math.prod(inputs)
    # PEFT's lora_A: torch's Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    bound = 1.0 / math.sqrt(fan_in)
    a_init = lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -bound, bound)
    a = self.param("lora_a", _init((*self.names[:self.contracted], None), a_init), (*inputs, r), jnp.float32)
    b = self.param("lora_b", _init((None, *self.names[self.contracted:]), nn.initializers.zeros_init()),
                   (r, *features), jnp.float32)
    h = Dropout(cfg.lora_dropout, name="lora_dropout")(flat, deterministic)
    h = jnp.dot(h, a.reshape(fan_in, r).astype(cfg.compute_dtype))
    h = jnp.dot(h, b.reshape(r, -1).astype(cfg.compute_dtype))
    return (h * (cfg.lora_alpha / r)).astype(cfg.compute_dtype)


class RMSNorm(nn.Module):
  """transformers' LlamaRMSNorm over the last axis: statistics in float32, the scale applied in float32 and
  the product rounded once to x's dtype."""
  config: DecoderConfig
  axis_name: str = "embed"

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", _init((self.axis_name,), nn.initializers.ones_init()), (x.shape[-1],),
                       self.config.parameter_dtype)
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    normed = x32 * jax.lax.rsqrt(variance + self.config.rms_norm_eps)
    return (scale.astype(jnp.float32) * normed).astype(x.dtype)


def attention_mask_matrix(key_mask: jax.Array, window: int | None) -> jax.Array:
  """[B, L, L] booleans: query i reads key j when j is a real token, j <= i, and (with a window) i - j < window."""
  length = key_mask.shape[1]
  q = jnp.arange(length)[:, None]
  k = jnp.arange(length)[None, :]
  allowed = k <= q
  if window is not None:
    allowed = allowed & (q - k < window)
  return key_mask[:, None, :] & allowed[None]


class DecoderLayer(nn.Module):
  """One pre-RMSNorm block: x + attention(norm(x)), then + SwiGLU MLP(norm(.)), as LlamaDecoderLayer."""
  config: DecoderConfig
  window: int | None = None  # this layer's sliding window

  def setup(self):
    cfg = self.config
    n, kv, d, h, m = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    self.input_layernorm = RMSNorm(cfg)
    # Key/value heads take the query heads' logical axis: tensor parallelism splits both over "model".
    self.q_proj = Dense(cfg, (n, d), ("embed", "heads", "kv"), cfg.attention_bias)
    self.k_proj = Dense(cfg, (kv, d), ("embed", "heads", "kv"), cfg.attention_bias)
    self.v_proj = Dense(cfg, (kv, d), ("embed", "heads", "kv"), cfg.attention_bias)
    if cfg.qk_norm:
      self.q_norm = RMSNorm(cfg, "kv")
      self.k_norm = RMSNorm(cfg, "kv")
    self.o_proj = Dense(cfg, h, ("heads", "kv", "embed"), cfg.attention_output_bias, contracted=2)
    self.post_attention_layernorm = RMSNorm(cfg)
    self.gate_proj = Dense(cfg, m, ("embed", "mlp"), cfg.mlp_bias)
    self.up_proj = Dense(cfg, m, ("embed", "mlp"), cfg.mlp_bias)
    self.down_proj = Dense(cfg, h, ("mlp", "embed"), cfg.mlp_bias)
    self.attention_dropout = Dropout(cfg.attention_dropout)
    self.attention_output_dropout = Dropout(cfg.hidden_dropout)
    self.mlp_dropout = Dropout(cfg.hidden_dropout)

  def __call__(self, x, cos, sin, key_mask, deterministic: bool):
    # `deterministic` is positional: nn.remat marks it static by position.
    cfg = self.config
    h = self.input_layernorm(x)
    q, k, v = (self.q_proj(h, deterministic), self.k_proj(h, deterministic),
               self.v_proj(h, deterministic))  # [B, L, heads, D]
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    ctx = self.attend(q, k, v, attention_mask_matrix(key_mask, self.window), deterministic)
    x = x + self.attention_output_dropout(self.o_proj(ctx, deterministic), deterministic)
    h = self.post_attention_layernorm(x)
    y = self.down_proj(jax.nn.silu(self.gate_proj(h, deterministic)) * self.up_proj(h, deterministic),
                       deterministic)
    return x + self.mlp_dropout(y, deterministic)

  def attend(self, q, k, v, allowed, deterministic: bool):
    """Grouped-query attention of q [B, L, N, D] over k, v [B, L, K, D] where `allowed` [B, L, L]: [B, L, N, D]
    in the compute dtype. Query head n reads key/value head n // (N / K), as transformers' repeat_kv."""
    cfg = self.config
    scale = cfg.head_dim ** -0.5
    drop = not deterministic and cfg.attention_dropout > 0.0
    if not drop and (cfg.attention == "fused" or (cfg.attention == "auto" and parallel.platform() != "cpu")):
      ctx = jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None], scale=scale, implementation="xla")
      return ctx.astype(cfg.compute_dtype)
    b, length, n, d = q.shape
    groups = cfg.num_kv_groups
    # [B, K, G*L, D] queries against [B, K, L, D] keys: one batched product per key/value head, no repeat.
    qg = q.reshape(b, length, cfg.num_kv_heads, groups, d).transpose(0, 2, 3, 1, 4)
    qg = qg.reshape(b, cfg.num_kv_heads, groups * length, d)
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    # [B, K, G*L, L] weights against each key/value head's [B, K, L, D] values, then [B, L, K, G, D]; query row
    # g * L + i is position i's.
    ctx = bert.einsum_attention(qg, kt, vt.astype(cfg.compute_dtype), jnp.tile(allowed, (1, groups, 1))[:, None],
                                (lambda w: self.attention_dropout(w, deterministic)) if drop else None,
                                logit_scale=scale)
    ctx = ctx.reshape(b, cfg.num_kv_heads, groups, length, d).transpose(0, 3, 1, 2, 4)
    return ctx.reshape(b, length, n, d)


class Embeddings(nn.Module):
  """The token table alone (positions are rotary, inside attention)."""
  config: DecoderConfig

  @nn.compact
  def __call__(self, input_ids):
    cfg = self.config
    table = self.param("word_embeddings", _init(("vocab", "embed")), (cfg.vocab_size, cfg.hidden_size),
                       cfg.parameter_dtype)
    return jnp.take(table, input_ids, axis=0).astype(cfg.compute_dtype)


class DecoderEncoder(nn.Module):
  """Llama / Mistral / Qwen2 / Qwen3 base model as an encoder: token ids -> final-RMSNormed hidden states
  [B, L, H] in float32, causal attention within each row's real tokens (right or left padding)."""
  config: DecoderConfig

  def setup(self):
    cfg = self.config
    self.embeddings = Embeddings(cfg)
    # Same param tree with or without remat. Arguments: self 0, x 1, cos 2, sin 3, key_mask 4, deterministic 5.
    layer_cls = nn.remat(DecoderLayer, static_argnums=(5,)) if cfg.remat else DecoderLayer
    self.layers = [layer_cls(cfg, cfg.layer_window(i), name=f"layer_{i}") for i in range(cfg.num_layers)]
    self.norm = RMSNorm(cfg)

  def __call__(self, input_ids, attention_mask, token_type_ids=None, *, deterministic: bool = True,
               first_token_attention: bool = False):
    del token_type_ids  # no token types
    if first_token_attention:
      raise ValueError("first_token_attention (FGD's span pooling) needs a BERT-family encoder: a decoder's "
                       "first token attends to itself only")
    key_mask = attention_mask.astype(bool)
    cos, sin = rotary_tables(self.config, position_ids(key_mask))
    constrain = parallel.constrain_rows
    x = constrain(self.embeddings(input_ids))
    for layer in self.layers:
      x = constrain(layer(x, cos, sin, key_mask, deterministic))
    return self.norm(x).astype(jnp.float32)

  def last_block_tail(self, context, residual, deterministic: bool = True):
    """jdr.models.bert.Encoder's hook for FGD's span pooling, which decoder encoders do not support."""
    del context, residual, deterministic
    raise ValueError("FGD's span pooling (first_token_attention) needs a BERT-family encoder, not a "
                     f"{self.config.model_type} decoder")


def last_token_pool(hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
  """[B, H]: each row's hidden state at its last real token (the highest position its mask holds), so right
  and left padding pool the same token. A row with no real token gives its position 0."""
  positions = jnp.arange(attention_mask.shape[1])
  last = jnp.max(jnp.where(attention_mask.astype(bool), positions[None, :], 0), axis=1)
  return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]


def serving_params(params: dict, cfg: DecoderConfig) -> dict:
  """params with each layer's matmul kernels and biases already in the compute dtype (the layers cast exactly
  these at every call, so a forward gives the same result bit for bit; see jdr.models.bert.serving_params).
  Embedding table and RMSNorm scales stay as stored. float32 compute returns params as they are."""
  return bert.cast_layer_matmuls(params, cfg.compute_dtype, LAYER_MATMULS)


# ---------------------------------------------------------------------------------------------- names


def hf_table(cfg: DecoderConfig) -> list:
  """`jdr.models.weight_names.Entry` per tensor of transformers' LlamaModel / MistralModel / Qwen2Model /
  Qwen3Model state dict (no "model." prefix: a *ForCausalLM's names less it; its lm_head is not the encoder's)."""
  from jdr.models import weight_names as names  # pylint: disable=g-import-not-at-top
  E = names.Entry
  h, n, kv, d, m = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
  table = [E("embed_tokens.weight", ("embeddings", "word_embeddings"), (cfg.vocab_size, h), *names.SAME)]
  for i in range(cfg.num_layers):
    hf, layer = f"layers.{i}", f"layer_{i}"
    attn, mlp = f"{hf}.self_attn", f"{hf}.mlp"
    table.append(E(f"{hf}.input_layernorm.weight", (layer, "input_layernorm", "scale"), (h,), *names.SAME))
    for proj, heads in (("q_proj", n), ("k_proj", kv), ("v_proj", kv)):
      table.append(E(f"{attn}.{proj}.weight", (layer, proj, "kernel"), (heads * d, h), *names.to_heads(h, heads, d)))
      if cfg.attention_bias:
        table.append(E(f"{attn}.{proj}.bias", (layer, proj, "bias"), (heads * d,), *names.heads_bias(heads, d)))
    if cfg.qk_norm:
      table += [E(f"{attn}.q_norm.weight", (layer, "q_norm", "scale"), (d,), *names.SAME),
                E(f"{attn}.k_norm.weight", (layer, "k_norm", "scale"), (d,), *names.SAME)]
    table.append(E(f"{attn}.o_proj.weight", (layer, "o_proj", "kernel"), (h, n * d), *names.from_heads(h, n, d)))
    if cfg.attention_output_bias:
      table.append(E(f"{attn}.o_proj.bias", (layer, "o_proj", "bias"), (h,), *names.SAME))
    table.append(E(f"{hf}.post_attention_layernorm.weight", (layer, "post_attention_layernorm", "scale"), (h,),
                   *names.SAME))
    for proj, shape in (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m))):
      table.append(E(f"{mlp}.{proj}.weight", (layer, proj, "kernel"), shape, *names.LINEAR))
      if cfg.mlp_bias:
        table.append(E(f"{mlp}.{proj}.bias", (layer, proj, "bias"), (shape[0],), *names.SAME))
  table.append(E("norm.weight", ("norm", "scale"), (h,), *names.SAME))
  return table


def strip(tensors: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[str]]:
  """The base model's tensors of a checkpoint: "model." dropped (a *ForCausalLM's, or a task model's), the LM
  and task heads and old rotary buffers skipped; returns (tensors, duplicate names)."""
  out, duplicates = {}, []
  for name, value in tensors.items():
    key = name
    for prefix in BASE_PREFIXES:
      if key.startswith(prefix):
        key = key[len(prefix):]
        break
    if key.startswith(IGNORED_HEADS) or key.endswith("rotary_emb.inv_freq"):
      continue
    if key in out:
      duplicates.append(name)
    out[key] = value
  return out, duplicates


def params_from_state_dict(cfg: DecoderConfig, tensors: dict[str, np.ndarray], source: str = "state dict",
                           family: str | None = None) -> dict[str, Any]:
  """transformers-named tensors (a base model's or a causal LM's) -> the DecoderEncoder param tree as numpy
  arrays in cfg.param_dtype (bfloat16 tensors stay bfloat16 when it is "bfloat16"). Raises
  jdr.models.weight_names.HFWeightsError listing every missing, unexpected and mis-shaped tensor."""
  tensors, duplicates = strip(tensors)
  return weight_names.params_from_table(hf_table(cfg), tensors, source, duplicates=duplicates,
                                        family=family or cfg.model_type, dtype=np.dtype(cfg.parameter_dtype))


def state_dict_from_params(cfg: DecoderConfig, params: dict[str, Any], dtype=np.float32) -> dict[str, np.ndarray]:
  """The reverse of params_from_state_dict: DecoderEncoder params -> the base model's transformers-named tensors
  (float32 unless `dtype` says), as transformers.AutoModel loads them; LoRA adapters are merged in (`merged`)."""
  params = nn.unbox(params)
  if set(params) == {"params"}:
    params = params["params"]
  params, cfg = merged(params, cfg)
  return weight_names.tensors_from_table(hf_table(cfg), params, dtype=dtype)


# ---------------------------------------------------------------------------------------------- LoRA


def _lora_modules(cfg: DecoderConfig):
  """(layer param name, projection, transformers module path) of every adapter the config puts on."""
  for i in range(cfg.num_layers):
    for proj in cfg.lora_targets:
      block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
      yield f"layer_{i}", proj, f"layers.{i}.{block}.{proj}"


def lora_delta(kernel_shape: tuple[int, ...], a: np.ndarray, b: np.ndarray, scaling: float) -> np.ndarray:
  """scaling * A B as a float32 kernel of `kernel_shape` ([inputs..., outputs...]): what the adapter adds."""
  a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
  rank = a32.shape[-1]
  return (scaling * (a32.reshape(-1, rank) @ b32.reshape(rank, -1))).reshape(kernel_shape)


def merged(params: dict[str, Any], cfg: DecoderConfig) -> tuple[dict[str, Any], DecoderConfig]:
  """(DecoderEncoder params with every adapter folded into its kernel, kernel += (alpha / r) A B in float32
  rounded once to the kernel's dtype, and the config without LoRA): the plain model PEFT's merge_and_unload
  gives. A config without LoRA returns both as they are."""
  if not cfg.lora_rank:
    return params, cfg
  params = nn.unbox(params)
  out = {name: dict(sub) if name.startswith("layer_") else sub for name, sub in params.items()}
  scaling = cfg.lora_alpha / cfg.lora_rank
  for layer, proj, _ in _lora_modules(cfg):
    sub = dict(out[layer][proj])
    kernel = np.asarray(sub["kernel"])
    delta = lora_delta(kernel.shape, sub.pop("lora_a"), sub.pop("lora_b"), scaling)
    sub["kernel"] = (kernel.astype(np.float32) + delta).astype(kernel.dtype)
    out[layer][proj] = sub
  return out, cfg.replace(lora_rank=0)


def without_adapters(params: dict[str, Any]) -> dict[str, Any]:
  """The params with every adapter leaf removed, not merged: the frozen base the adapters apply to."""
  if not hasattr(params, "items"):
    return params
  return {name: without_adapters(sub) for name, sub in params.items() if name not in LORA_PARAMS}


PEFT_PREFIX = "base_model.model."  # PEFT's names for adapters of a base model (transformers' AutoModel)


def peft_state_dict(params: dict[str, Any], cfg: DecoderConfig) -> dict[str, np.ndarray]:
  """The adapters as PEFT saves them (adapter_model.safetensors) for a LoRA over the base model: lora_A
  [r, in_features] and lora_B [out_features, r] per projection, float32, torch's flattening of the heads."""
  params = nn.unbox(params)
  out = {}
  for layer, proj, module in _lora_modules(cfg):
    sub = params[layer][proj]
    a, b = np.asarray(sub["lora_a"], np.float32), np.asarray(sub["lora_b"], np.float32)
    out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, cfg.lora_rank).T)
    out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b.reshape(cfg.lora_rank, -1).T)
  return out


def peft_config(cfg: DecoderConfig, base_model: str) -> dict[str, Any]:
  """adapter_config.json of `peft_state_dict`'s adapters, over the base model at `base_model`."""
  return {"peft_type": "LORA", "task_type": "FEATURE_EXTRACTION", "base_model_name_or_path": base_model,
          "r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "lora_dropout": cfg.lora_dropout,
          "target_modules": list(cfg.lora_targets), "bias": "none", "fan_in_fan_out": False,
          "inference_mode": True, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
          "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}
