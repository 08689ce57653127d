"""FGD's span embeddings (Zhou et al., fine-grained distillation for long documents): the token windows of
every level as masks inside the step, and the pieces' vectors from the document's own forward pass (Eq. 7).

The encoder knows nothing of spans: it hands out its last layer's attention from the first token and finishes
that block on whatever attention output it is given (jdr.models.bert.FirstTokenAttention, Layer.tail); the
pooling over a span is here.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp


def span_masks(doc_mask, level_sizes: Sequence[tuple[str, int]]):
  """In-step jnp version of jdr.data.granularity.windows for every level, concatenated: [C, sum K, L] (float32)."""
  length = doc_mask.shape[1]
  position = jnp.arange(length)
  out = []
  for _, size in level_sizes:
    count = max(1, -(-(length - 1) // size))
    which = jnp.where(position >= 1, (position - 1) // size, -1)
    member = which[None, :] == jnp.arange(count)[:, None]  # [K, L]
    out.append((member[None] & doc_mask.astype(bool)[:, None, :]).astype(jnp.float32))
  return jnp.concatenate(out, axis=1)


def document_and_span_vectors(tower, input_ids, attention_mask, span_mask, *, deterministic: bool = True,
                              pooling: str = "attention"):
  """Document vectors [B, D] and span vectors [B, S, D] of `span_mask` [B, S, L] (token i in span s) from one
  forward of `tower`, a bound jdr.models.towers.Tower (run it through `apply(..., method=)`).

  pooling="attention": FGD's global-consistent granularity embeddings (Zhou et al., Eq. 7): for each span,
  [CLS]'s last-layer attention output restricted to the span's tokens (its attention probabilities as they
  are, not renormalized), then the rest of that block and the tower's head as [CLS] gets them. It is the
  same contraction as [CLS]'s own attention output, so the whole sequence as one span gives the document
  vector to the last bit. pooling="mean": the mean of the span's token vectors through the head (the paper's
  "FG pooling" ablation)."""
  from jdr.models import towers  # pylint: disable=g-import-not-at-top
  cfg = tower.config
  if cfg.kind != "transformer":
    raise ValueError("span embeddings need a transformer tower (the BoW-MLP tower has no tokens to pool)")
  if pooling == "mean":
    hidden = tower(input_ids, attention_mask, deterministic=deterministic, token_vectors=True)
    weights = span_mask.astype(hidden.dtype)
    spans = jnp.einsum("bsl,blh->bsh", weights, hidden) / jnp.maximum(weights.sum(-1, keepdims=True), 1.0)
    return tower.head(towers.pool(hidden, attention_mask, cfg.pooling)), tower.head(spans)
  if pooling != "attention":
    raise ValueError(f"span pooling must be 'attention' or 'mean', got {pooling!r}")
  if cfg.pooling != "cls":
    raise ValueError(f"span embeddings (Eq. 7) pool with [CLS]'s attention: the tower's pooling must be cls, "
                     f"not {cfg.pooling}")
  vectors, attention = tower(input_ids, attention_mask, deterministic=deterministic, first_token_attention=True)
  probs = attention.probabilities  # [B, N, L]
  weights = probs[:, :, None, :] * span_mask[:, None, :, :].astype(probs.dtype)  # [B, N, S, L]
  context = jnp.swapaxes(jnp.einsum("bnqk,bnkd->bnqd", weights.astype(attention.values.dtype), attention.values),
                         1, 2)  # [B, S, N, D]
  return vectors, tower.through_last_block(context, attention.residual[:, None, :], deterministic)


def two_tower_document_spans(pooling: str = "attention"):
  """`document_and_span_vectors` of a TwoTower's document tower, as an `apply(..., method=)` function:
  (module, input_ids, attention_mask, span_mask, deterministic=) -> (vectors, span vectors)."""
  def method(two_tower, input_ids, attention_mask, span_mask, *, deterministic: bool = True):
    return document_and_span_vectors(two_tower.tower_of("doc"), input_ids, attention_mask, span_mask,
                                     deterministic=deterministic, pooling=pooling)
  return method
