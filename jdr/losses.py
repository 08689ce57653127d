"""Contrastive and pairwise ranking losses over a batch score matrix.

Every function takes `scores` [B, C] (query b against candidate document c) and `valid` [B, C] (may
document c serve as a candidate for query b) and returns per-example losses [B]; the caller averages
(and gives padding rows weight 0). The target (positive) of row b is column b, which the batch layout
guarantees is valid (the losses treat it as valid regardless); see `jdr.negatives.candidate_mask` for how
`valid` is built.

Conventions shared by all losses:
- Scores are upcast to float32 before any exp/log so bfloat16 encoders do not lose the loss in rounding;
  the gradient comes back in the input's dtype.
- Invalid columns are removed with `jnp.where`, never by multiplying a mask into a value that may be
  inf or NaN, so their gradient is exactly zero and never NaN.
- Pairwise losses (ranknet, hinge) average over the row's valid negatives. A row with no valid negative
  (e.g. a padding row, or in-batch training with B == 1) has loss 0 and zero gradient.

The papers' forms: RankNet is log(1 + exp(s_neg - s_pos)) (LTRe Eq. 1, STAR Eq. 14); LambdaRank and
ADORE's LambdaLoss multiply each pair by |delta M| (LTRe Eq. 2, ADORE Eq. 15) and STAR weights its
in-batch "random" pairs by alpha (Eq. 13): both are the `weights` argument of `ranknet`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _target_mask(shape: tuple[int, ...]) -> Array:
  """Bool [B, C], True at (b, b): the positive of row b."""
  b, c = shape
  if c < b:
    raise ValueError(f"scores has {c} columns for {b} rows; column b must be row b's positive (C >= B)")
  return jnp.arange(c)[None, :] == jnp.arange(b)[:, None]


def _prepare(scores: Array, valid: Array) -> tuple[Array, Array, Array, Array, Array]:
  """Returns float32 scores, valid, target and valid-negative masks, and the target scores [B, 1]."""
  if scores.ndim != 2 or scores.shape != valid.shape:
    raise ValueError(f"scores {scores.shape} and valid {valid.shape} must both be [B, C]")
  target = _target_mask(scores.shape)
  # The target counts as valid even if a caller's mask forgot it, so the loss stays finite.
  valid = jnp.logical_or(valid.astype(bool), target)
  # Zeroing invalid columns up front (a select, whose gradient there is exactly 0) keeps an inf or NaN
  # score in a padding column from turning into a NaN gradient through the later arithmetic.
  scores = jnp.where(valid, scores.astype(jnp.float32), 0.0)
  negative = jnp.logical_and(valid, jnp.logical_not(target))
  positive = jnp.sum(jnp.where(target, scores, 0.0), axis=1, keepdims=True)
  return scores, valid, target, negative, positive


def _pairwise_mean(per_pair: Array, negative: Array, weights: Array | None) -> Array:
  """Weighted sum of per-pair losses over valid negatives, divided by their count (0 when none)."""
  if weights is not None:
    if weights.shape != per_pair.shape:
      raise ValueError(f"weights {weights.shape} must match scores {per_pair.shape}")
    per_pair = per_pair * weights.astype(jnp.float32)
  # The where (not a multiply) keeps inf/NaN from invalid columns out of the value and the gradient.
  total = jnp.sum(jnp.where(negative, per_pair, 0.0), axis=1)
  count = jnp.sum(negative, axis=1)
  return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)


def softmax_nll(scores: Array, valid: Array, *, temperature: float = 1.0) -> Array:
  """Negative log-likelihood of the target under a softmax over the valid columns.

  The DPR / ANCE / in-batch loss: -log(exp(s_bb / t) / sum_{c valid} exp(s_bc / t)). Scores are divided
  by `temperature` first (t < 1 sharpens, as for cosine-similarity towers).
  """
  scores, valid, target, _, _ = _prepare(scores, valid)
  logits = jnp.where(valid, scores / temperature, -jnp.inf)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  # Select with where rather than multiply by the one-hot: the invalid columns hold -inf.
  return -jnp.sum(jnp.where(target, log_probs, 0.0), axis=1)


def ranknet(scores: Array, valid: Array, *, weights: Array | None = None) -> Array:
  """RankNet: mean over valid negatives of w_bc * log(1 + exp(s_bc - s_bb)).

  `weights` [B, C] scales each (positive, negative) pair: |delta metric| for LambdaRank / ADORE, alpha on
  the in-batch random part for STAR. The divisor is the number of valid negatives, not the weight sum,
  so weights change the relative importance of pairs without renormalizing them away. Rows with no
  valid negative give 0.
  """
  scores, _, _, negative, positive = _prepare(scores, valid)
  # softplus(x) = log(1 + e^x), computed without overflow for large x.
  return _pairwise_mean(jax.nn.softplus(scores - positive), negative, weights)


def hinge(scores: Array, valid: Array, *, margin: float = 1.0, weights: Array | None = None) -> Array:
  """Pairwise hinge: mean over valid negatives of w_bc * max(0, margin - (s_bb - s_bc)).

  Weights and the rows-without-negatives rule are as in `ranknet`.
  """
  scores, _, _, negative, positive = _prepare(scores, valid)
  return _pairwise_mean(jax.nn.relu(margin - (positive - scores)), negative, weights)


def bce(scores: Array, valid: Array) -> Array:
  """Pointwise sigmoid cross-entropy, averaged over the row's valid columns.

  The target column has label 1, valid negatives label 0; each (query, doc) pair is an independent binary
  example, as in pointwise cross-encoder training. A row with only its target valid still gets the
  positive's loss softplus(-s_bb), so padding rows must be weighted 0 by the caller.
  """
  scores, valid, target, _, _ = _prepare(scores, valid)
  # -log sigmoid(s) = softplus(-s) for label 1; -log(1 - sigmoid(s)) = softplus(s) for label 0.
  per_pair = jnp.where(target, jax.nn.softplus(-scores), jax.nn.softplus(scores))
  total = jnp.sum(jnp.where(valid, per_pair, 0.0), axis=1)
  return total / jnp.maximum(jnp.sum(valid, axis=1), 1)


def hardest_negative_mask(scores: Array, valid: Array) -> Array:
  """Bool [B, C]: column b plus row b's single highest-scored valid negative (NCE Neg).

  The selection is a discrete choice made under stop_gradient; the loss then differentiates only through
  the kept scores. Rows without a valid negative keep only their target. Ties go to the lowest column.
  Use as `softmax_nll(scores, hardest_negative_mask(scores, valid))`.
  """
  scores, _, target, negative, _ = _prepare(jax.lax.stop_gradient(scores), valid)
  masked = jnp.where(negative, scores, -jnp.inf)
  hardest = jnp.argmax(masked, axis=1)
  chosen = jnp.arange(scores.shape[1])[None, :] == hardest[:, None]
  has_negative = jnp.any(negative, axis=1, keepdims=True)
  return jnp.logical_or(target, jnp.logical_and(chosen, has_negative))
