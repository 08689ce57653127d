"""Contrastive and pairwise ranking losses over a batch score matrix.

Every function takes `scores` [B, C] (query b against candidate document c) and `valid` [B, C] (may
document c serve as a candidate for query b) and returns per-example losses [B]; the caller averages
(and gives padding rows weight 0). Two ways to say which documents are relevant:

- `labels=None` (in-batch layouts): the target (positive) of row b is column b, which the batch layout
  guarantees is valid (the losses treat it as valid regardless); see `jdr.negatives.candidate_mask` for
  how `valid` is built. This path is O(B * C) and is what in-batch training with a large C uses.
- `labels` [B, C] float relevance (hard-negative layouts: ADORE / LTRe re-rank a query's retrieved top
  C, where several positives may sit anywhere): label > 0 on a valid column is a positive. Only valid
  columns count; labels on invalid columns are ignored. Pairwise losses build [B, C, C] pair tensors
  here (B = 32, C = 200 is 1.3M pairs), so keep C to the retrieved depth, not the whole batch.
  `labels = eye(B, C)` gives the same results as `labels=None` when `valid` holds the diagonal.

Conventions shared by all losses:
- Scores are upcast to float32 before any exp/log so bfloat16 encoders do not lose the loss in rounding;
  the gradient comes back in the input's dtype.
- Invalid columns are removed with `jnp.where`, never by multiplying a mask into a value that may be
  inf or NaN, so their gradient is exactly zero and never NaN.
- Pairwise losses (ranknet, hinge, lambdarank) average over the row's pairs (i, j) of valid columns with
  labels[i] > labels[j] (with `labels=None`: the target against each valid negative). A row without such
  a pair (a padding row, in-batch training with B == 1, a query with no positive among its candidates)
  has loss 0 and zero gradient; so does softmax_nll for a row without a positive.

The papers' forms: RankNet is log(1 + exp(s_neg - s_pos)) (LTRe Eq. 1, STAR Eq. 14); LambdaRank and
ADORE's LambdaLoss multiply each pair by |delta M| (LTRe Eq. 2, ADORE Eq. 15: `lambdarank`, whose
weights come from `lambda_weights`) and STAR weights its in-batch "random" pairs by alpha (Eq. 13): both
are the `weights` argument of `ranknet`, [B, C] (on the pair's lower-labelled document) or [B, C, C]
(per pair). |delta M| has two readings (`LAMBDA_DELTAS`): "exact", the change of M when the two documents
swap places in the ranking by the current scores, and "positions", the authors' code (DRhard
adore/train.py `metric_weights`, JPQ run_train.py `compute_loss`): |1/p_i - 1/p_j| with p the 1-based
position in the candidate list as given and 1/p taken as 0 beyond K, for every (relevant, irrelevant) pair,
whatever the other relevant documents. The two agree for one relevant document in a list sorted by score;
with several, the exact change is never larger and often smaller, since only the first relevant one
counts for MRR.
"""

from __future__ import annotations

import re
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import ml_collections

Array = jax.Array


def _target_mask(shape: tuple[int, ...]) -> Array:
  """Bool [B, C], True at (b, b): the positive of row b."""
  b, c = shape
  if c < b:
    raise ValueError(f"scores has {c} columns for {b} rows; column b must be row b's positive (C >= B)")
  return jnp.arange(c)[None, :] == jnp.arange(b)[:, None]


def _check_shapes(scores: Array, valid: Array) -> None:
  if scores.ndim != 2 or scores.shape != valid.shape:
    raise ValueError(f"scores {scores.shape} and valid {valid.shape} must both be [B, C]")


def _prepare(scores: Array, valid: Array) -> tuple[Array, Array, Array, Array, Array]:
  """Returns float32 scores, valid, target and valid-negative masks, and the target scores [B, 1]."""
  _check_shapes(scores, valid)
  target = _target_mask(scores.shape)
  # The target counts as valid even if a caller's mask forgot it, so the loss stays finite.
  valid = jnp.logical_or(valid.astype(bool), target)
  # Zeroing invalid columns up front (a select, whose gradient there is exactly 0) keeps an inf or NaN
  # score in a padding column from turning into a NaN gradient through the later arithmetic.
  scores = jnp.where(valid, scores.astype(jnp.float32), 0.0)
  negative = jnp.logical_and(valid, jnp.logical_not(target))
  positive = jnp.sum(jnp.where(target, scores, 0.0), axis=1, keepdims=True)
  return scores, valid, target, negative, positive


def _prepare_labelled(scores: Array, valid: Array, labels: Array) -> tuple[Array, Array, Array]:
  """Returns float32 scores and labels, both 0 on invalid columns, and valid as bool."""
  _check_shapes(scores, valid)
  if labels.shape != scores.shape:
    raise ValueError(f"labels {labels.shape} must match scores {scores.shape}")
  valid = valid.astype(bool)
  scores = jnp.where(valid, scores.astype(jnp.float32), 0.0)
  labels = jnp.where(valid, labels.astype(jnp.float32), 0.0)
  return scores, valid, labels


def _identity_labels(scores: Array, valid: Array) -> tuple[Array, Array]:
  """The `labels=None` layout spelled out: (valid with the target forced in, float eye labels)."""
  _check_shapes(scores, valid)
  target = _target_mask(scores.shape)
  return jnp.logical_or(valid.astype(bool), target), target.astype(jnp.float32)


def _pairwise_mean(per_pair: Array, negative: Array, weights: Array | None) -> Array:
  """Weighted sum of per-pair losses over valid negatives, divided by their count (0 when none)."""
  if weights is not None:
    b, c = per_pair.shape
    if weights.shape == (b, c, c):
      # Row b's pairs are (b, j): its slice of a per-pair weight tensor is weights[b, b, :].
      weights = weights[jnp.arange(b), jnp.arange(b)]
    if weights.shape != per_pair.shape:
      raise ValueError(f"weights {weights.shape} must be [B, C] or [B, C, C] for scores {per_pair.shape}")
    per_pair = per_pair * jnp.where(negative, weights.astype(jnp.float32), 0.0)
  # The where (not a multiply) keeps inf/NaN from invalid columns out of the value and the gradient.
  total = jnp.sum(jnp.where(negative, per_pair, 0.0), axis=1)
  count = jnp.sum(negative, axis=1)
  return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)


def _label_pairs(valid: Array, labels: Array) -> Array:
  """Bool [B, C, C], True at (b, i, j) when i and j are valid and labels[b, i] > labels[b, j]."""
  both = jnp.logical_and(valid[:, :, None], valid[:, None, :])
  return jnp.logical_and(both, labels[:, :, None] > labels[:, None, :])


def _labelled_pairwise_mean(pair_loss: Callable[[Array, Array], Array], scores: Array, valid: Array,
                            labels: Array, weights: Array | None) -> Array:
  """Mean of w_bij * pair_loss(s_bi, s_bj) over the row's pairs with labels[i] > labels[j]."""
  scores, valid, labels = _prepare_labelled(scores, valid, labels)
  pairs = _label_pairs(valid, labels)
  per_pair = pair_loss(scores[:, :, None], scores[:, None, :])
  if weights is not None:
    b, c = scores.shape
    if weights.shape == (b, c):
      weights = weights[:, None, :]  # on the pair's lower-labelled document j
    elif weights.shape != (b, c, c):
      raise ValueError(f"weights {weights.shape} must be [B, C] or [B, C, C] for scores {scores.shape}")
    per_pair = per_pair * jnp.where(pairs, weights.astype(jnp.float32), 0.0)
  total = jnp.sum(jnp.where(pairs, per_pair, 0.0), axis=(1, 2))
  count = jnp.sum(pairs, axis=(1, 2))
  return jnp.where(count > 0, total / jnp.maximum(count, 1), 0.0)


def _ranknet_pair(s_hi: Array, s_lo: Array) -> Array:
  # softplus(x) = log(1 + e^x), computed without overflow for large x.
  return jax.nn.softplus(s_lo - s_hi)


def softmax_nll(scores: Array, valid: Array, *, temperature: float = 1.0,
                labels: Array | None = None) -> Array:
  """Cross-entropy of the positives' distribution against a softmax over the valid columns.

  The DPR / ANCE / in-batch loss: -log(exp(s_bb / t) / sum_{c valid} exp(s_bc / t)). Scores are divided
  by `temperature` first (t < 1 sharpens, as for cosine-similarity towers). With `labels`, the target
  distribution is the row's positive labels (label > 0, valid) normalized to sum 1, and the loss is
  -sum_c p_c log softmax(s / t)_c; a row without a positive gives 0 and zero gradient.
  """
  if labels is None:
    scores, valid, target, _, _ = _prepare(scores, valid)
    logits = jnp.where(valid, scores / temperature, -jnp.inf)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    # Select with where rather than multiply by the one-hot: the invalid columns hold -inf.
    return -jnp.sum(jnp.where(target, log_probs, 0.0), axis=1)
  scores, valid, labels = _prepare_labelled(scores, valid, labels)
  positive = jnp.logical_and(valid, labels > 0)
  mass = jnp.where(positive, labels, 0.0)
  total = jnp.sum(mass, axis=1, keepdims=True)
  target = mass / jnp.where(total > 0, total, 1.0)
  logits = jnp.where(valid, scores / temperature, -jnp.inf)
  # A row with no valid column would be all -inf, whose softmax (and its backward pass) is NaN.
  logits = jnp.where(jnp.any(valid, axis=1, keepdims=True), logits, 0.0)
  log_probs = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.sum(jnp.where(positive, target * log_probs, 0.0), axis=1)


def ranknet(scores: Array, valid: Array, *, weights: Array | None = None,
            labels: Array | None = None) -> Array:
  """RankNet: mean over the row's pairs of w * log(1 + exp(s_lower - s_higher)).

  Pairs are (target, valid negative) with `labels=None`, else every (i, j) of valid columns with
  labels[i] > labels[j]. `weights` scales each pair: [B, C] on the pair's lower-labelled document (STAR's
  alpha on the in-batch random part), or [B, C, C] per pair (i, j) (|delta M| for LambdaRank / ADORE; see
  `lambdarank`). The divisor is the number of pairs, not the weight sum, so weights change the relative
  importance of pairs without renormalizing them away. Rows without a pair give 0.
  """
  if labels is not None:
    return _labelled_pairwise_mean(_ranknet_pair, scores, valid, labels, weights)
  scores, _, _, negative, positive = _prepare(scores, valid)
  return _pairwise_mean(_ranknet_pair(positive, scores), negative, weights)


def hinge(scores: Array, valid: Array, *, margin: float = 1.0, weights: Array | None = None,
          labels: Array | None = None) -> Array:
  """Pairwise hinge: mean over the row's pairs of w * max(0, margin - (s_higher - s_lower)).

  Pairs, weights and the rows-without-pairs rule are as in `ranknet`.
  """
  pair_loss = lambda s_hi, s_lo: jax.nn.relu(margin - (s_hi - s_lo))
  if labels is not None:
    return _labelled_pairwise_mean(pair_loss, scores, valid, labels, weights)
  scores, _, _, negative, positive = _prepare(scores, valid)
  return _pairwise_mean(pair_loss(positive, scores), negative, weights)


def bce(scores: Array, valid: Array, *, labels: Array | None = None) -> Array:
  """Pointwise sigmoid cross-entropy, averaged over the row's valid columns.

  Positives (the target column, or with `labels` every valid column with label > 0) have label 1, the
  other valid columns label 0; each (query, doc) pair is an independent binary example, as in pointwise
  cross-encoder training. A row with only its target valid still gets the positive's loss
  softplus(-s_bb), so padding rows must be weighted 0 by the caller (with `labels`, a row with no valid
  column gives 0).
  """
  if labels is None:
    scores, valid, positive, _, _ = _prepare(scores, valid)
  else:
    scores, valid, labels = _prepare_labelled(scores, valid, labels)
    positive = labels > 0
  # -log sigmoid(s) = softplus(-s) for label 1; -log(1 - sigmoid(s)) = softplus(s) for label 0.
  per_pair = jnp.where(positive, jax.nn.softplus(-scores), jax.nn.softplus(scores))
  total = jnp.sum(jnp.where(valid, per_pair, 0.0), axis=1)
  return total / jnp.maximum(jnp.sum(valid, axis=1), 1)


def _parse_metric(metric: str) -> tuple[str, float]:
  """"mrr@10" -> ("mrr", 10.0); a bare "ndcg" has no cutoff (inf)."""
  match = re.fullmatch(r"(mrr|ndcg)(?:@([1-9][0-9]*))?", metric)
  if match is None:
    raise ValueError(f"metric must be mrr@K or ndcg@K (K a positive integer, or no @K for no cutoff); "
                     f"got {metric!r}")
  return match.group(1), float(match.group(2)) if match.group(2) else float("inf")


def _ranks(scores: Array, valid: Array) -> Array:
  """Float32 [B, C] 1-based positions in the descending order of valid scores (ties: lower column first).

  Invalid columns sort after every valid one whatever they hold, even when a valid score is -inf.
  """
  b, c = scores.shape
  columns = jnp.broadcast_to(jnp.arange(c), (b, c))
  # The invalid flag is the primary key and the stable sort keeps column order within ties.
  _, _, order = jax.lax.sort((jnp.logical_not(valid).astype(jnp.int32), -scores, columns), dimension=1,
                             num_keys=2, is_stable=True)
  return (jnp.argsort(order, axis=1) + 1).astype(jnp.float32)


def _mrr_swap_delta(ranks: Array, relevant: Array, k: float) -> Array:
  """|delta RR@k| [B, C, C] for swapping the positions of documents i and j.

  Only a swap of a relevant and an irrelevant document can move the first relevant rank: the relevant
  one lands at the other's rank, so the new first is min(that rank, first relevant rank without it),
  and the latter is the first or, for the first itself, the second smallest relevant rank.
  """
  rel_ranks = jnp.where(relevant, ranks, jnp.inf)
  first = jnp.min(rel_ranks, axis=1, keepdims=True)
  # Valid ranks are distinct, so exactly one column holds `first` (none when the row has no relevant).
  second = jnp.min(jnp.where(rel_ranks == first, jnp.inf, rel_ranks), axis=1, keepdims=True)
  first_without = jnp.where(rel_ranks == first, second, first)  # [B, C]
  rel_i, rel_j = relevant[:, :, None], relevant[:, None, :]
  new_first = jnp.where(
      jnp.logical_and(rel_i, jnp.logical_not(rel_j)),
      jnp.minimum(ranks[:, None, :], first_without[:, :, None]),
      jnp.where(jnp.logical_and(rel_j, jnp.logical_not(rel_i)),
                jnp.minimum(ranks[:, :, None], first_without[:, None, :]), first[:, :, None]))
  reciprocal = lambda r: jnp.where(r <= k, 1.0 / r, 0.0)
  return jnp.abs(reciprocal(new_first) - reciprocal(first[:, :, None]))


def _ndcg_swap_delta(ranks: Array, labels: Array, valid: Array, k: float) -> Array:
  """|delta NDCG@k| [B, C, C] = |g_i - g_j| |d(r_i) - d(r_j)| / IDCG@k, 0 for a row with IDCG 0."""
  discount = lambda r: jnp.where(r <= k, 1.0 / jnp.log2(1.0 + r), 0.0)
  gains = jnp.where(valid, jnp.exp2(labels) - 1.0, 0.0)
  # The ideal ranking sorts the valid columns' gains; invalid ones go last and add nothing.
  ideal = -jnp.sort(jnp.where(valid, -gains, jnp.inf), axis=1)
  ideal = jnp.where(jnp.isfinite(ideal), ideal, 0.0)
  positions = jnp.arange(1, gains.shape[1] + 1, dtype=jnp.float32)
  idcg = jnp.sum(ideal * discount(positions), axis=1)[:, None, None]
  discounts = discount(ranks)
  delta = (jnp.abs(gains[:, :, None] - gains[:, None, :])
           * jnp.abs(discounts[:, :, None] - discounts[:, None, :]))
  return jnp.where(idcg > 0, delta / jnp.where(idcg > 0, idcg, 1.0), 0.0)


# loss.lambda_delta: how |delta M| of a pair is read (see the module docstring)
LAMBDA_DELTAS = ("positions", "exact")


def _check_delta(delta: str, metric: str) -> None:
  if delta not in LAMBDA_DELTAS:
    raise ValueError(f"lambda_delta must be one of {', '.join(LAMBDA_DELTAS)}; got {delta!r}")
  # The authors' position weights are reciprocal ranks; they wrote no NDCG form, and a discount by list
  # position would be jdr's invention, so NDCG keeps the exact swap.
  if delta == "positions" and _parse_metric(metric)[0] != "mrr":
    raise ValueError(f"lambda_delta='positions' is the authors' MRR weight |1/p_i - 1/p_j|; {metric!r} needs "
                     "lambda_delta='exact'")


def _position_delta(c: int, k: float) -> Array:
  """Float32 [1, C, C]: |1/p_i - 1/p_j| for list positions p = 1..C, 1/p read as 0 beyond k."""
  positions = jnp.arange(1, c + 1, dtype=jnp.float32)
  reciprocal = jnp.where(positions <= k, 1.0 / positions, 0.0)
  return jnp.abs(reciprocal[:, None] - reciprocal[None, :])[None]


def lambda_weights(scores: Array, labels: Array, valid: Array, metric: str, delta: str = "exact") -> Array:
  """Float32 [B, C, C]: |delta M(i, j)|, the change of row b's metric M when documents i and j swap.

  Nonzero only for pairs of valid columns with labels[i] > labels[j]. `metric` is "mrr@K" (reciprocal
  rank of the first document with label > 0, 0 beyond K) or "ndcg@K" (gain 2^label - 1, discount
  1 / log2(1 + rank) for rank <= K, IDCG@K from the row's own valid labels; a row with IDCG 0 gets 0). Any
  K >= 1; without "@K" the whole list counts. Note 2^label - 1 is the LambdaRank gain, not trec_eval's
  gain = grade used by `jdr.evaluation.metrics` (they agree on binary labels).

  `delta` "exact": the ranking is the descending order of `scores` over valid columns (ties: lower column
  first), under stop_gradient, and the weight is M's exact change. "positions" (mrr only): the ranking is
  the column order itself, p = column + 1 (invalid columns keep their places), and the weight is
  |1/p_i - 1/p_j| (1/p = 0 beyond K); `scores` are not read.
  """
  _check_delta(delta, metric)
  name, k = _parse_metric(metric)
  scores, labels = jax.lax.stop_gradient(scores), jax.lax.stop_gradient(labels)
  scores, valid, labels = _prepare_labelled(scores, valid, labels)
  if delta == "positions":
    return jnp.where(_label_pairs(valid, labels), _position_delta(scores.shape[1], k), 0.0)
  ranks = _ranks(scores, valid)
  if name == "mrr":
    delta_m = _mrr_swap_delta(ranks, jnp.logical_and(valid, labels > 0), k)
  else:
    delta_m = _ndcg_swap_delta(ranks, labels, valid, k)
  return jnp.where(_label_pairs(valid, labels), delta_m, 0.0)


def lambdarank(scores: Array, valid: Array, *, labels: Array | None, metric: str,
               weights: Array | None = None, delta: str = "exact") -> Array:
  """LambdaRank / ADORE's LambdaLoss: `ranknet` with each pair weighted by |delta metric| (LTRe Eq. 2,
  ADORE Eq. 15), e.g. metric="mrr@10"; `delta` as in `lambda_weights`.

  `labels=None` is the in-batch layout (column b is row b's positive), which has no list order, so only
  delta="exact" takes it. Optional `weights` ([B, C] or [B, C, C], as in `ranknet`) multiply the lambda
  weights. The divisor is the number of pairs, as in `ranknet` and in both authors' codes (DRhard divides
  by its pair count, JPQ takes the mean over relevant x irrelevant), so pairs whose weight is 0 (both
  beyond K) dilute the mean rather than being dropped.
  """
  if labels is None:
    if delta != "exact":
      raise ValueError(f"lambda_delta={delta!r} reads positions in a candidate list; the in-batch layout "
                       "(labels=None) has none: use lambda_delta='exact'")
    valid, labels = _identity_labels(scores, valid)
  lam = lambda_weights(scores, labels, valid, metric, delta)
  if weights is not None:
    b, c = scores.shape
    if weights.shape == (b, c):
      weights = weights[:, None, :]
    elif weights.shape != (b, c, c):
      raise ValueError(f"weights {weights.shape} must be [B, C] or [B, C, C] for scores {scores.shape}")
    lam = lam * weights.astype(jnp.float32)
  return ranknet(scores, valid, labels=labels, weights=lam)


def distillation_kl(student: Array, teacher: Array, valid: Array, *, temperature: float = 1.0) -> Array:
  """KL(p_teacher || p_student) per row [...]: both distributions a softmax over the valid columns of the last
  axis of scores / temperature (FGD Eq. 5 and 12; RocketQAv2's direction: the teacher's distribution is the
  target, so the student is pulled to where the teacher puts mass). A row with fewer than two valid columns
  carries no distribution and gives 0."""
  valid = valid.astype(bool)
  usable = jnp.sum(valid, axis=-1, keepdims=True) >= 2
  mask = valid & usable
  # Rows without a distribution are filled with zeros first: an all -inf row's softmax is NaN.
  def log_softmax(x):
    x = jnp.where(mask, x / temperature, -jnp.inf)
    return jax.nn.log_softmax(jnp.where(usable, x, 0.0), axis=-1)
  log_s, log_t = log_softmax(student), log_softmax(jax.lax.stop_gradient(teacher))
  terms = jnp.where(mask, jnp.exp(log_t) * (log_t - log_s), 0.0)
  return jnp.sum(terms, axis=-1)


def margin_mse(student: Array, teacher: Array, valid: Array) -> Array:
  """MarginMSE (Hofstaetter et al., 2020, Eq. 1) per row [...]: the mean over the row's valid negatives j >= 1
  of ((s_0 - s_j) - (t_0 - t_j))^2, column 0 the positive; the student learns the teacher's margins, not its
  scale. A row whose positive or every negative is invalid gives 0."""
  valid = valid.astype(bool)
  student = student.astype(jnp.float32)
  teacher = jax.lax.stop_gradient(teacher.astype(jnp.float32))
  pairs = valid[..., 1:] & valid[..., :1]
  s_margin = student[..., :1] - student[..., 1:]
  t_margin = jnp.where(pairs, teacher[..., :1] - teacher[..., 1:], 0.0)
  err = jnp.where(pairs, s_margin - t_margin, 0.0)
  return jnp.sum(err * err, axis=-1) / jnp.maximum(jnp.sum(pairs, axis=-1), 1)


def granular_distillation(student: Array, teacher: Array, valid: Array, *, temperature: float = 1.0) -> Array:
  """FGD's local-aligned distillation at one granularity (Eq. 12), per query [B]: the mean over the
  positive document's pieces k (those with a distribution) of KL(p_teacher || p_student), each piece's
  distribution over itself (column 0) and its negative pieces (Eq. 14-15).

  student, teacher: scores [B, K, 1 + n] (teacher scores as given: fixed, no gradient); valid [B, K, 1 + n]
  (False for padding pieces and missing negatives). Sum it over the granularities for L_fkd (Eq. 12-13).
  """
  kl = distillation_kl(student, teacher, valid, temperature=temperature)  # [B, K]
  has = jnp.sum(valid.astype(bool), axis=-1) >= 2
  count = jnp.sum(has, axis=-1)
  return jnp.sum(jnp.where(has, kl, 0.0), axis=-1) / jnp.maximum(count, 1)


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


def matryoshka_dims(loss_cfg: ml_collections.ConfigDict) -> tuple[tuple[int, float], ...]:
  """(dim, weight) pairs of `loss.matryoshka_dims` / `loss.matryoshka_weights`, widest first; () when off.

  Refused here, before any data is read: a dim that is not a positive integer, a dim listed twice, weights
  that are not one finite non-negative number per dim, or all weights 0."""
  dims_text, weights_text = str(loss_cfg.get("matryoshka_dims", "")), str(loss_cfg.get("matryoshka_weights", ""))
  parts = [p.strip() for p in dims_text.split(",") if p.strip()]
  if not parts:
    if weights_text.strip():
      raise ValueError("loss.matryoshka_weights is set without loss.matryoshka_dims")
    return ()
  if not all(p.isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f"loss.matryoshka_dims={dims_text!r}: a comma-separated list of positive integers, "
                     "e.g. \"384,256,128,64\"")
  dims = [int(p) for p in parts]
  if len(set(dims)) != len(dims):
    raise ValueError(f"loss.matryoshka_dims={dims_text!r} lists a dim twice")
  weights = [1.0] * len(dims)
  if weights_text.strip():
    try:
      weights = [float(w) for w in weights_text.split(",")]
    except ValueError:
      raise ValueError(f"loss.matryoshka_weights={weights_text!r}: numbers, one per dim") from None
    if len(weights) != len(dims) or not all(0.0 <= w < float("inf") for w in weights) or not any(weights):
      raise ValueError(f"loss.matryoshka_weights={weights_text!r}: one finite weight >= 0 per dim of "
                       f"loss.matryoshka_dims ({len(dims)}), not all 0")
  return tuple(sorted(zip(dims, weights), key=lambda p: -p[0]))


def matryoshka_record(loss_cfg: ml_collections.ConfigDict, width: int) -> list[int]:
  """The Matryoshka dims a model trained under `loss_cfg` serves, widest first, as its description records
  them ([] when off); a dim wider than the towers' `width` is refused before any data is read."""
  dims = [dim for dim, _ in matryoshka_dims(loss_cfg)]
  wide = [dim for dim in dims if dim > width]
  if wide:
    raise ValueError(f"loss.matryoshka_dims: {wide} wider than the towers' {width}-dim vectors")
  return dims


def matryoshka_prefix(x: Array, dim: int, normalize: bool) -> Array:
  """The first `dim` dimensions of vectors [..., D], L2-normalized again when the tower normalizes: what a
  tower truncated to `dim` serves (jdr.models.towers.TowerConfig.truncate_dim). A dim wider than D is an
  error, not a silent full-width loss."""
  if dim > x.shape[-1]:
    raise ValueError(f"loss.matryoshka_dims: {dim} is wider than the towers' {x.shape[-1]}-dim vectors")
  if dim == x.shape[-1]:
    return x
  x = x[..., :dim]
  if not normalize:
    return x
  # Same eps as the towers' l2_normalize (torch.nn.functional.normalize's).
  norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True))
  return (x / jnp.maximum(norm, 1e-12)).astype(x.dtype)


def matryoshka_sum(dims: tuple[tuple[int, float], ...], loss_at: Callable[[int | None], tuple[Array, dict]]):
  """sum_m w_m * loss_at(m) over `matryoshka_dims`' pairs (Kusupati et al. 2022, Eq. 1; sentence-transformers'
  MatryoshkaLoss), `loss_at(None)` alone without them. The aux of the widest dim is kept, with each dim's
  unweighted loss as "loss/dim_<m>"."""
  if not dims:
    return loss_at(None)
  total, aux = 0.0, None
  for dim, weight in dims:
    value, dim_aux = loss_at(dim)
    aux = dim_aux if aux is None else aux
    aux[f"loss/dim_{dim}"] = value
    total = total + weight * value
  return total, aux


def _softmax_nll_of(cfg):
  temperature = cfg.temperature
  return lambda s, v, labels, weights: softmax_nll(s, v, temperature=temperature, labels=labels)


def _ranknet_of(cfg):
  # The temperature scales the pairwise differences too: with L2-normalized towers the scores are
  # cosines in [-1, 1], where log(1 + e^(s- - s+)) is nearly flat without it.
  t = cfg.temperature
  return lambda s, v, labels, weights: ranknet(s / t, v, weights=weights, labels=labels)


def _lambdarank_of(cfg):
  metric, delta = cfg.lambda_metric, cfg.lambda_delta
  _parse_metric(metric)  # a typo fails here, not at the first step
  _check_delta(delta, metric)
  t = cfg.temperature
  return lambda s, v, labels, weights: lambdarank(s / t, v, labels=labels, metric=metric, weights=weights,
                                                  delta=delta)


def _hinge_of(cfg):
  margin = cfg.margin
  return lambda s, v, labels, weights: hinge(s, v, margin=margin, weights=weights, labels=labels)


def _bce_of(cfg):
  return lambda s, v, labels, weights: bce(s, v, labels=labels)


# loss.name -> (factory of (scores, valid, labels, weights) -> per-example losses, takes per-pair weights)
LOSSES = {"softmax_nll": (_softmax_nll_of, False), "ranknet": (_ranknet_of, True),
          "lambdarank": (_lambdarank_of, True), "hinge": (_hinge_of, True), "bce": (_bce_of, False)}
LOSS_NAMES = tuple(LOSSES)


def make_loss(loss_cfg: ml_collections.ConfigDict) -> Callable[[Array, Mapping[str, Array]], Array]:
  """The config's loss as a function (scores [B, C], batch) -> per-example losses [B].

  `loss_cfg.name` picks the loss; it reads `temperature` (softmax_nll, ranknet, lambdarank: scores are
  divided by it), `margin` (hinge) or `lambda_metric` and `lambda_delta` (lambdarank, e.g. "mrr@10" and
  "positions"; refused together here when they do not go together). The function takes
  `batch["valid"]`, and `batch["labels"]` and `batch["weights"]` when present (no labels: column b is
  row b's positive). A batch carrying weights for a loss that takes none (softmax_nll, bce) is an
  error, not silently dropped.
  """
  name = loss_cfg.name
  if name not in LOSSES:
    raise ValueError(f"loss.name must be one of {', '.join(LOSS_NAMES)}; got {name!r}")
  factory, takes_weights = LOSSES[name]
  loss = factory(loss_cfg)

  def loss_of_batch(scores: Array, batch: Mapping[str, Array]) -> Array:
    weights = batch.get("weights")
    if weights is not None and not takes_weights:
      raise ValueError(f"loss {name!r} takes no per-pair weights, but the batch has 'weights'")
    return loss(scores, batch["valid"], batch.get("labels"), weights)

  return loss_of_batch
