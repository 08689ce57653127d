"""Towers: an encoder plus pooling, an optional projection head and optional L2 normalisation.

A tower maps token ids to one vector per text. `TwoTower` pairs a query tower and a document tower that
either share one set of weights (DPR-style tied / ANCE) or keep their own (ADORE trains only the query side).

Param trees (the `params` collection):
  Tower:    {"encoder": encoder params} or {"bow": ...}, plus {"projection"[, "projection_norm"]} with a head.
  TwoTower: shared -> {"tower": Tower params}; separate -> {"query_tower": ..., "doc_tower": ...}.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jdr.models import architectures
from jdr.models.bert import EncoderConfig

POOLINGS = ("cls", "mean", "max", "last")
HEAD_ACTIVATIONS = ("identity", "tanh")


@dataclasses.dataclass(frozen=True)
class TowerConfig:
  """One tower. `kind="transformer"` needs `encoder`; `kind="bow_mlp"` needs `vocab_size`.

  projection_dim: None for no head; an int adds Dense(projection_dim), then `projection_activation`, then
    LayerNorm when `projection_norm`, on the pooled vector. jdr's head and ANCE / DRhard's `embeddingHead` +
    `norm` are Dense + LayerNorm (ANCE's LayerNorm is torch's default, eps 1e-5: `projection_norm_eps`;
    None means the encoder's); a sentence-transformers Dense layer is Dense + tanh (or identity) with no
    norm; DPR's `encode_proj` is a bare Dense.
  BoW-MLP (Chang et al. 2020's shallow baseline): a bag of token embeddings (`bow_embed_dim` wide) averaged
    over the unpadded tokens, then two tanh Dense layers (`bow_hidden`, then `bow_dim` = the output width).
    It pools with "mean" (the paper) or "max", never "cls".
  """
  encoder: Any = None  # an encoder config of jdr.models.architectures
  kind: str = "transformer"  # "transformer" | "bow_mlp"
  pooling: str = "cls"  # "cls" | "mean" | "max"
  projection_dim: int | None = None
  projection_activation: str = "identity"
  projection_bias: bool = True
  projection_norm: bool = True
  projection_norm_eps: float | None = None
  normalize: bool = False
  # Serving a Matryoshka model at a smaller width: only the first truncate_dim dimensions are kept (before
  # normalizing), as sentence-transformers' truncate_dim; training sums its loss over prefixes instead.
  truncate_dim: int | None = None
  vocab_size: int | None = None  # bow_mlp only (transformers take it from `encoder`).
  bow_embed_dim: int = 512
  bow_hidden: int = 512
  bow_dim: int = 512

  def __post_init__(self):
    if self.pooling not in POOLINGS:
      raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
    if self.kind == "transformer":
      if self.encoder is None:
        raise ValueError("a transformer tower needs an EncoderConfig (TowerConfig.encoder)")
    elif self.kind == "bow_mlp":
      if self.vocab_size is None:
        raise ValueError("a bow_mlp tower needs vocab_size")
      if self.pooling in ("cls", "last"):
        raise ValueError(f"a bow_mlp tower pools with 'mean' (as Chang et al. 2020) or 'max', not {self.pooling!r}")
    else:
      raise ValueError(f"kind must be 'transformer' or 'bow_mlp', got {self.kind!r}")
    if self.projection_activation not in HEAD_ACTIVATIONS:
      raise ValueError(f"projection_activation must be one of {HEAD_ACTIVATIONS}, got "
                       f"{self.projection_activation!r}")
    if self.projection_dim is not None and self.projection_dim <= 0:
      raise ValueError(f"projection_dim must be positive or None, got {self.projection_dim}")
    if self.truncate_dim is not None and not 0 < self.truncate_dim <= self.replace(truncate_dim=None).dim:
      raise ValueError(f"truncate_dim must be between 1 and the tower's {self.replace(truncate_dim=None).dim} "
                       f"dimensions, got {self.truncate_dim}")

  @property
  def dim(self) -> int:
    """Width of the tower's output vectors."""
    if self.truncate_dim is not None:
      return self.truncate_dim
    if self.projection_dim is not None:
      return self.projection_dim
    return self.bow_dim if self.kind == "bow_mlp" else self.encoder.hidden_size

  def replace(self, **changes) -> TowerConfig:
    return dataclasses.replace(self, **changes)


def truncated(tower: TowerConfig, dim: int, trained: Sequence[int], model: str) -> TowerConfig:
  """`tower` (a TowerConfig) serving its first `dim` dimensions. Where the model records the widths it was
  trained at (`trained`), another is refused: the prefix of a vector trained whole is not an embedding of
  that width."""
  full = tower.replace(truncate_dim=None).dim
  if not 0 < dim <= full:
    raise ValueError(f"{model}: --dim {dim}: the model's vectors have {full} dimensions")
  if trained and dim not in (*trained, full):
    raise ValueError(f"{model}: --dim {dim} is not a width it was trained at (loss.matryoshka_dims: "
                     f"{', '.join(map(str, trained))}; or the full {full})")
  return tower.replace(truncate_dim=None if dim == full else dim)


def pool(hidden: jax.Array, mask: jax.Array, how: str) -> jax.Array:
  """Pools token vectors [B, L, H] into [B, H] over the tokens where `mask` is true."""
  if how == "cls":
    return hidden[:, 0]
  if how == "mean":
    # The masked sum as a matrix product with a second, all-zero row of weights ([B, 2, L] x [B, L, H]).
    # XLA rewrites a matrix-vector product, or jnp.sum over L, into a reduction over L; on GPUs that
    # reduction asks for L as the fastest-varying dimension of its input, and XLA gave that layout to every
    # layer's residual stream, transposing [tokens, hidden] twice a layer with no residual add fused into its
    # matmul (BERT-base compiled for an NVIDIA H200: docs/performance-history.md, "Compiled for the H200, change
    # by change"). The unused zero row keeps a matrix product, whose operand cuBLAS reads in the encoder's own
    # layout.
    weights = mask.astype(hidden.dtype)
    weights = jnp.stack([weights, jnp.zeros_like(weights)], axis=1)
    total = jnp.einsum("bkl,blh->bkh", weights, hidden, preferred_element_type=jnp.float32)[:, 0]
    # sentence-transformers' mean: clamp the count so an all-padding row gives zeros, not NaN.
    count = jnp.maximum(jnp.sum(mask.astype(jnp.float32), axis=1, keepdims=True), 1e-9)
    return (total / count).astype(hidden.dtype)
  if how == "last":
    # The last real token (a decoder's EOS, RepLLaMA / E5-Mistral), right or left padded: the highest
    # position the mask holds.
    positions = jnp.arange(mask.shape[1])
    last = jnp.max(jnp.where(mask.astype(bool), positions[None, :], 0), axis=1)
    return jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
  mask = mask.astype(bool)[..., None]
  if how == "max":
    return jnp.max(jnp.where(mask, hidden, jnp.finfo(hidden.dtype).min), axis=1)
  raise ValueError(f"unknown pooling {how!r}")


def l2_normalize(x: jax.Array, eps: float = 1e-12) -> jax.Array:
  # Same eps as torch.nn.functional.normalize, so zero vectors stay zero instead of NaN. Through the squared
  # norm rather than the norm: the norm's gradient at a zero vector is 0/0, and a zero vector does occur (a
  # mean-pooled span past a document's end), where x / max(norm, eps) trained to NaN at the second step.
  return x * jax.lax.rsqrt(jnp.maximum(jnp.sum(x * x, axis=-1, keepdims=True), eps * eps))


class BowMLP(nn.Module):
  """Bag-of-words token embeddings -> masked pooling -> two tanh Dense layers (Chang et al. 2020)."""
  config: TowerConfig

  @nn.compact
  def __call__(self, input_ids, attention_mask, *, deterministic: bool = True):
    del deterministic  # no dropout in the paper's baseline
    cfg = self.config
    init = nn.initializers.normal(stddev=0.02)
    table = self.param("embeddings", nn.with_logical_partitioning(init, ("vocab", "embed")),
                       (cfg.vocab_size, cfg.bow_embed_dim), jnp.float32)
    x = pool(jnp.take(table, input_ids, axis=0), attention_mask, cfg.pooling)
    for name, width, axes in (("hidden", cfg.bow_hidden, ("embed", "mlp")),
                              ("output", cfg.bow_dim, ("mlp", "embed"))):
      x = nn.tanh(nn.Dense(
          width, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), axes),
          bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), axes[1:]), name=name)(x))
    return x


def serving_params(params: dict, module: "Tower | TwoTower") -> dict:
  """`params` of a Tower or TwoTower for forwards that only read them: each transformer tower's encoder
  matmul weights already in its compute dtype (`jdr.models.bert.serving_params`), the same results bit for
  bit. Used where a corpus or queries are encoded, not where weights train or are saved."""
  def tower(p: dict, cfg: TowerConfig) -> dict:
    return ({**p, "encoder": architectures.serving_params(p["encoder"], cfg.encoder)}
            if cfg.kind == "transformer" else p)
  if isinstance(module, Tower):
    return tower(params, module.config)
  if module.shared:
    return {**params, "tower": tower(params["tower"], module.query)}
  return {**params, "query_tower": tower(params["query_tower"], module.query),
          "doc_tower": tower(params["doc_tower"], module.doc)}


class Tower(nn.Module):
  """Token ids -> one float32 vector per text, [B, config.dim]."""
  config: TowerConfig

  def setup(self):
    cfg = self.config
    if cfg.kind == "bow_mlp":
      self.bow = BowMLP(cfg, name="bow")
    else:
      self.encoder = architectures.module(cfg.encoder)(cfg.encoder, name="encoder")
    if cfg.projection_dim is not None:
      # The head is tiny: it stays float32 and replicated (its output axis has no logical name).
      self.projection = nn.Dense(
          cfg.projection_dim, use_bias=cfg.projection_bias,
          kernel_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("embed", None)),
          bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,)), name="projection")
    if cfg.projection_dim is not None and cfg.projection_norm:
      eps = cfg.projection_norm_eps or (cfg.encoder.layer_norm_eps if cfg.encoder is not None else 1e-5)
      self.projection_norm = nn.LayerNorm(
          epsilon=eps, scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), (None,)),
          bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,)), name="projection_norm")

  def __call__(self, input_ids, attention_mask, token_type_ids=None, *, deterministic: bool = True,
               token_vectors: bool = False, first_token_attention: bool = False):
    """`token_vectors=True` returns the encoder's [B, L, H] output instead (the masked-LM baseline's input).
    `first_token_attention=True` returns (vectors, the last layer's jdr.models.bert.FirstTokenAttention), for
    callers that pool that attention their own way and finish with `through_last_block`."""
    cfg = self.config
    if cfg.kind == "bow_mlp":
      if token_vectors or first_token_attention:
        raise ValueError("the BoW-MLP tower has no token vectors or attention (the masked-LM loss and FGD "
                         "need a transformer tower)")
      return self.head(self.bow(input_ids, attention_mask, deterministic=deterministic))
    # [CLS] pooling reads the first position alone: a BERT-family encoder's last layer computes nothing else.
    first_only = (cfg.pooling == "cls" and not token_vectors
                  and architectures.computes_first_position_alone(cfg.encoder))
    hidden = self.encoder(input_ids, attention_mask, token_type_ids, deterministic=deterministic,
                          first_token_attention=first_token_attention,
                          **({"first_token_only": True} if first_only else {}))
    if first_token_attention:
      hidden, attention = hidden
      return self.head(pool(hidden, attention_mask, cfg.pooling)), attention
    if token_vectors:
      return hidden
    return self.head(pool(hidden, attention_mask, cfg.pooling))

  def head(self, x):
    """Pooled [..., H] -> vectors [..., D]: projection (+ LayerNorm) and normalization."""
    cfg = self.config
    if cfg.projection_dim is not None:
      x = self.projection(x)
      if cfg.projection_activation == "tanh":
        x = jnp.tanh(x)
      if cfg.projection_norm:
        x = self.projection_norm(x)
    if cfg.truncate_dim is not None:
      x = x[..., :cfg.truncate_dim]
    if self.config.normalize:
      x = l2_normalize(x)
    return x.astype(jnp.float32)

  def through_last_block(self, context, residual, deterministic: bool = True):
    """Vectors [..., D] of positions whose last-layer attention output is `context` [..., N, D_head] and
    whose input to that layer is `residual` [..., H]: the rest of the last block, then the head."""
    return self.head(self.encoder.last_block_tail(context, residual, deterministic))


class MLMHead(nn.Module):
  """BERT's masked-LM head: Dense(H) + activation + LayerNorm, then logits over the vocabulary through the
  word embedding table (tied, as BERT) plus a bias. Training-only: it is not part of a retrieval model."""
  config: EncoderConfig

  @nn.compact
  def __call__(self, hidden, word_embeddings):
    cfg = self.config
    x = nn.Dense(cfg.hidden_size, kernel_init=nn.with_logical_partitioning(
        nn.initializers.normal(0.02), ("embed", None)),
                 bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,)), name="transform")(hidden)
    x = nn.gelu(x, approximate=False)
    x = nn.LayerNorm(epsilon=cfg.layer_norm_eps,
                     scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), (None,)),
                     bias_init=nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,)), name="norm")(x)
    bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("vocab",)),
                      (cfg.vocab_size,), jnp.float32)
    return jnp.einsum("...h,vh->...v", x, word_embeddings) + bias


class TwoTower(nn.Module):
  """A query tower and a document tower; `shared=True` ties them to one set of weights.

  Use `apply(..., method="encode_query")` / `method="encode_doc"` to encode one side; `__call__` encodes
  both (and is what `init` should run so both sides get params). `mlm_head=True` (masked-LM pretraining of
  a shared transformer tower) adds the params "mlm_head" and the method `mlm_logits`; readers of a trained
  model (jdr.models.saved.load) drop that head, so it never reaches retrieval or fine-tuning.
  """
  query: TowerConfig
  doc: TowerConfig
  shared: bool = True
  mlm_head: bool = False

  def setup(self):
    if self.shared:
      if self.query != self.doc:
        raise ValueError("shared towers need identical query and doc TowerConfigs "
                         f"(got query={self.query} doc={self.doc})")
      self.tower = Tower(self.query)
    else:
      self.query_tower = Tower(self.query)
      self.doc_tower = Tower(self.doc)
    if self.mlm_head:
      if not self.shared or self.query.kind != "transformer":
        raise ValueError("mlm_head needs one shared transformer tower (model.shared=True, "
                         "model.tower=transformer)")
      self.lm_head = MLMHead(self.query.encoder)

  def mlm_logits(self, input_ids, attention_mask, positions, *, deterministic: bool = True):
    """Vocabulary logits [B, P, V] at the token positions [B, P] of the (masked) input [B, L]."""
    hidden = self.tower(input_ids, attention_mask, deterministic=deterministic, token_vectors=True)
    picked = jnp.take_along_axis(hidden, positions[:, :, None], axis=1)
    word = self.tower.variables["params"]["encoder"]["embeddings"]["word_embeddings"]
    return self.lm_head(picked, nn.unbox(word))

  def encode_query(self, input_ids, attention_mask, token_type_ids=None, *, deterministic: bool = True):
    return self.tower_of("query")(input_ids, attention_mask, token_type_ids, deterministic=deterministic)

  def encode_doc(self, input_ids, attention_mask, token_type_ids=None, *, deterministic: bool = True):
    return self.tower_of("doc")(input_ids, attention_mask, token_type_ids, deterministic=deterministic)

  def tower_of(self, side: str) -> Tower:
    """The query ("query") or document ("doc") tower, for a function applied with `apply(..., method=)`."""
    if side not in ("query", "doc"):
      raise ValueError(f"side must be 'query' or 'doc', got {side!r}")
    if self.shared:
      return self.tower
    return self.query_tower if side == "query" else self.doc_tower

  def __call__(self, query_ids, query_mask, doc_ids, doc_mask, *, deterministic: bool = True):
    """Returns (query vectors [Bq, D], doc vectors [Bd, D])."""
    out = (self.encode_query(query_ids, query_mask, deterministic=deterministic),
           self.encode_doc(doc_ids, doc_mask, deterministic=deterministic))
    if self.mlm_head and self.is_initializing():
      self.mlm_logits(doc_ids, doc_mask, jnp.zeros((doc_ids.shape[0], 1), jnp.int32))
    return out
