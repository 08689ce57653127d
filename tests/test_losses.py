"""jdr.training.losses against slow numpy loops (float64) written straight from the papers' equations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdr.training import losses

B, N_NEG = 4, 2
C = B * (1 + N_NEG)


def _batch(seed, b=B, c=C):
  """Random scores and a random valid mask with the target always valid and one row without negatives."""
  rng = np.random.default_rng(seed)
  scores = rng.normal(size=(b, c)) * 2.0
  valid = rng.random((b, c)) < 0.6
  valid[np.arange(b), np.arange(b)] = True
  valid[b - 1] = False
  valid[b - 1, b - 1] = True
  return scores, valid


def _softplus(x):
  return np.log1p(np.exp(-abs(x))) + max(x, 0.0)


# Loop references: one (query, candidate) at a time, as the equations read.

def ref_softmax_nll(scores, valid, temperature=1.0):
  out = np.zeros(len(scores))
  for b in range(len(scores)):
    denom = sum(np.exp(scores[b, c] / temperature) for c in range(scores.shape[1]) if valid[b, c])
    out[b] = -np.log(np.exp(scores[b, b] / temperature) / denom)
  return out


def _ref_pairwise(pair_loss, scores, valid, weights):
  out = np.zeros(len(scores))
  for b in range(len(scores)):
    terms = [(1.0 if weights is None else weights[b, c]) * pair_loss(scores[b, b], scores[b, c])
             for c in range(scores.shape[1]) if valid[b, c] and c != b]
    out[b] = sum(terms) / len(terms) if terms else 0.0
  return out


def ref_ranknet(scores, valid, weights=None):
  # LTRe Eq. 1 / STAR Eq. 14: log(1 + e^{f(q, d-) - f(q, d+)}).
  return _ref_pairwise(lambda pos, neg: np.log(1.0 + np.exp(neg - pos)), scores, valid, weights)


def ref_hinge(scores, valid, margin=1.0, weights=None):
  return _ref_pairwise(lambda pos, neg: max(0.0, margin - (pos - neg)), scores, valid, weights)


def ref_bce(scores, valid):
  out = np.zeros(len(scores))
  for b in range(len(scores)):
    terms = []
    for c in range(scores.shape[1]):
      if valid[b, c]:
        p = 1.0 / (1.0 + np.exp(-scores[b, c]))
        terms.append(-np.log(p) if c == b else -np.log(1.0 - p))
    out[b] = np.mean(terms)
  return out


def _numeric_grad(fn, scores, eps=1e-6):
  """Central differences of sum(fn(scores)) in float64."""
  grad = np.zeros_like(scores)
  for idx in np.ndindex(scores.shape):
    up, down = scores.copy(), scores.copy()
    up[idx] += eps
    down[idx] -= eps
    grad[idx] = (fn(up).sum() - fn(down).sum()) / (2 * eps)
  return grad


def _cases():
  rng = np.random.default_rng(7)
  weights = rng.uniform(0.0, 2.0, size=(B, C))
  return {
      "softmax_nll": (losses.softmax_nll, ref_softmax_nll, {}),
      "softmax_nll_t": (lambda s, v: losses.softmax_nll(s, v, temperature=0.05),
                        lambda s, v: ref_softmax_nll(s, v, 0.05), {}),
      "ranknet": (losses.ranknet, ref_ranknet, {}),
      "ranknet_weighted": (lambda s, v: losses.ranknet(s, v, weights=jnp.asarray(weights, jnp.float32)),
                           lambda s, v: ref_ranknet(s, v, weights), {}),
      "hinge": (lambda s, v: losses.hinge(s, v, margin=0.5), lambda s, v: ref_hinge(s, v, 0.5), {}),
      "hinge_weighted": (lambda s, v: losses.hinge(s, v, weights=jnp.asarray(weights, jnp.float32)),
                         lambda s, v: ref_hinge(s, v, 1.0, weights), {}),
      "bce": (losses.bce, ref_bce, {}),
  }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_value_and_gradient_match_reference(name, seed):
  fn, ref, _ = CASES[name]
  scores, valid = _batch(seed)
  got = jax.jit(fn)(jnp.asarray(scores, jnp.float32), jnp.asarray(valid))
  assert got.shape == (B,) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), ref(scores, valid), rtol=1e-5, atol=1e-5)

  grad = jax.jit(jax.grad(lambda s: fn(s, jnp.asarray(valid)).sum()))(jnp.asarray(scores, jnp.float32))
  expected = _numeric_grad(lambda s: ref(s, valid), scores)
  np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-4, atol=1e-5)
  # Invalid columns (the reference does not read them) get exactly zero gradient.
  assert np.all(np.asarray(grad)[~valid] == 0.0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_invalid_columns_holding_inf_or_nan_are_ignored(name):
  fn, ref, _ = CASES[name]
  scores, valid = _batch(3)
  poisoned = scores.copy()
  poisoned[~valid] = np.where(np.arange((~valid).sum()) % 2, np.inf, np.nan)
  s = jnp.asarray(poisoned, jnp.float32)
  got, grad = jax.value_and_grad(lambda x: fn(x, jnp.asarray(valid)).sum())(s)
  np.testing.assert_allclose(float(got), ref(scores, valid).sum(), rtol=1e-5)
  assert np.all(np.isfinite(np.asarray(grad)))
  assert np.all(np.asarray(grad)[~valid] == 0.0)


def test_pairwise_rows_without_negatives_are_zero():
  scores, valid = _batch(0)
  s, v = jnp.asarray(scores, jnp.float32), jnp.asarray(valid)
  for fn in (losses.ranknet, losses.hinge):
    assert float(fn(s, v)[B - 1]) == 0.0
    grad = jax.grad(lambda x: fn(x, v)[B - 1])(s)
    assert np.all(np.asarray(grad) == 0.0)
  # Softmax over the target alone is certain: -log 1 = 0.
  assert abs(float(losses.softmax_nll(s, v)[B - 1])) < 1e-6


def test_temperature_divides_scores():
  scores, valid = _batch(4)
  s, v = jnp.asarray(scores, jnp.float32), jnp.asarray(valid)
  np.testing.assert_allclose(losses.softmax_nll(s, v, temperature=0.1), losses.softmax_nll(s / 0.1, v),
                             rtol=1e-5)
  # Lower temperature sharpens: a row whose target already wins gets a smaller loss.
  easy = s.at[0, 0].set(10.0)
  assert losses.softmax_nll(easy, v, temperature=0.5)[0] < losses.softmax_nll(easy, v, temperature=2.0)[0]


def test_ranknet_unit_weights_and_star_alpha():
  scores, valid = _batch(5)
  s, v = jnp.asarray(scores, jnp.float32), jnp.asarray(valid)
  np.testing.assert_allclose(losses.ranknet(s, v, weights=jnp.ones((B, C))), losses.ranknet(s, v), rtol=1e-6)
  # STAR (Eq. 13): alpha * L_random + L_static, with the other rows' docs as the random part. Each pair
  # keeps its own weight and the divisor stays the pair count.
  alpha = 0.1
  own = np.zeros((B, C), bool)
  for b in range(B):
    own[b, B + b * N_NEG:B + (b + 1) * N_NEG] = True
  weights = np.where(own, 1.0, alpha)
  got = losses.ranknet(s, v, weights=jnp.asarray(weights))
  np.testing.assert_allclose(got, ref_ranknet(scores, valid, weights), rtol=1e-5, atol=1e-6)


def test_ranknet_is_stable_for_large_margins():
  s = jnp.asarray([[200.0, -200.0], [-200.0, 200.0]])
  v = jnp.ones((2, 2), bool)
  out = losses.ranknet(s, v)
  np.testing.assert_allclose(out, [0.0, 0.0], atol=1e-6)
  out = losses.ranknet(-s, v)
  np.testing.assert_allclose(out, [400.0, 400.0], rtol=1e-6)
  assert np.all(np.isfinite(jax.grad(lambda x: losses.ranknet(x, v).sum())(-s)))


def _ref_hardest(scores, valid):
  keep = np.zeros_like(valid)
  for b in range(len(scores)):
    keep[b, b] = True
    negs = [c for c in range(scores.shape[1]) if valid[b, c] and c != b]
    if negs:
      keep[b, max(negs, key=lambda c: scores[b, c])] = True
  return keep


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_hardest_negative_mask_picks_argmax_valid_negative(seed):
  scores, valid = _batch(seed)
  # Make an invalid column the row maximum, so a mask that ignored `valid` would pick it.
  scores[0, ~valid[0]] = 100.0
  mask = jax.jit(losses.hardest_negative_mask)(jnp.asarray(scores, jnp.float32), jnp.asarray(valid))
  assert mask.dtype == jnp.bool_
  np.testing.assert_array_equal(np.asarray(mask), _ref_hardest(scores, valid))


def test_hardest_negative_selection_is_not_differentiated():
  scores, valid = _batch(1)
  s, v = jnp.asarray(scores, jnp.float32), jnp.asarray(valid)
  fixed = jnp.asarray(_ref_hardest(scores, valid))
  nce = lambda x: losses.softmax_nll(x, losses.hardest_negative_mask(x, v)).sum()
  grad = jax.grad(nce)(s)
  np.testing.assert_allclose(grad, jax.grad(lambda x: losses.softmax_nll(x, fixed).sum())(s), rtol=1e-6)
  # Only the target and the kept negative receive gradient.
  assert np.all(np.asarray(grad)[~np.asarray(fixed)] == 0.0)
  # Perturbing the scores moves no part of the mask.
  _, tangent = jax.jvp(lambda x: losses.hardest_negative_mask(x, v).astype(jnp.float32), (s,),
                       (jnp.ones_like(s),))
  assert np.all(np.asarray(tangent) == 0.0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bfloat16_scores(name):
  fn, ref, _ = CASES[name]
  scores, valid = _batch(6)
  s16 = jnp.asarray(scores, jnp.bfloat16)
  got = jax.jit(fn)(s16, jnp.asarray(valid))
  assert got.dtype == jnp.float32
  # The loss is computed in float32 from the bf16-rounded scores.
  np.testing.assert_allclose(got, ref(np.asarray(s16, np.float64), valid), rtol=1e-5, atol=1e-5)
  grad = jax.grad(lambda x: fn(x, jnp.asarray(valid)).sum())(s16)
  assert grad.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(grad, np.float32)))
  mask = losses.hardest_negative_mask(s16, jnp.asarray(valid))
  np.testing.assert_array_equal(mask, _ref_hardest(np.asarray(s16, np.float64), valid))


def test_target_counts_as_valid_and_shapes_are_checked():
  scores, valid = _batch(2)
  s = jnp.asarray(scores, jnp.float32)
  forgot = valid.copy()
  forgot[np.arange(B), np.arange(B)] = False
  np.testing.assert_allclose(losses.softmax_nll(s, jnp.asarray(forgot)), losses.softmax_nll(s, jnp.asarray(valid)))
  with pytest.raises(ValueError, match="C >= B"):
    losses.softmax_nll(jnp.zeros((3, 2)), jnp.ones((3, 2), bool))
  with pytest.raises(ValueError, match=r"\[B, C\]"):
    losses.ranknet(jnp.zeros((2, 4)), jnp.ones((2, 3), bool))


# --- Labelled losses (hard-negative layouts: several positives anywhere, graded labels) ---

def _labelled_batch(seed, b=4, c=9, graded=False):
  """Scores, valid and labels with several positives per row, invalid positives, a row without a
  positive and a row without a valid column. Graded labels are 0-3 except in row 1, which is binary."""
  rng = np.random.default_rng(seed)
  scores = rng.normal(size=(b, c)) * 2.0
  valid = rng.random((b, c)) < 0.75
  high = 4 if graded else 2
  labels = np.where(rng.random((b, c)) < 0.4, rng.integers(1, high, (b, c)), 0).astype(np.float64)
  labels[0, :3] = [1.0, 2.0 if graded else 1.0, 1.0]
  labels[1] = labels[1] > 0
  labels[1, -3:] = 1.0  # several positives, one of them invalid
  valid[1, -3:] = [True, True, False]
  valid[0, :3] = True
  labels[b - 2] = 0.0
  valid[b - 1] = False
  return scores, valid, labels


def ref_softmax_nll_labels(scores, valid, labels, temperature=1.0):
  out = np.zeros(len(scores))
  for b in range(len(scores)):
    cols = [c for c in range(scores.shape[1]) if valid[b, c]]
    mass = sum(labels[b, c] for c in cols if labels[b, c] > 0)
    if mass == 0:
      continue
    log_z = np.log(sum(np.exp(scores[b, c] / temperature) for c in cols))
    out[b] = -sum(labels[b, c] / mass * (scores[b, c] / temperature - log_z)
                  for c in cols if labels[b, c] > 0)
  return out


def _ref_pairwise_labels(pair_loss, scores, valid, labels, weights):
  """Pairs (i, j) of valid columns with labels[i] > labels[j]; [B, C] weights on j, [B, C, C] on (i, j)."""
  out = np.zeros(len(scores))
  cols = range(scores.shape[1])
  for b in range(len(scores)):
    terms = []
    for i in cols:
      for j in cols:
        if valid[b, i] and valid[b, j] and labels[b, i] > labels[b, j]:
          w = 1.0 if weights is None else (weights[b, j] if weights.ndim == 2 else weights[b, i, j])
          terms.append(w * pair_loss(scores[b, i], scores[b, j]))
    out[b] = sum(terms) / len(terms) if terms else 0.0
  return out


def ref_ranknet_labels(scores, valid, labels, weights=None):
  return _ref_pairwise_labels(lambda hi, lo: np.log(1.0 + np.exp(lo - hi)), scores, valid, labels, weights)


def ref_hinge_labels(scores, valid, labels, margin=1.0, weights=None):
  return _ref_pairwise_labels(lambda hi, lo: max(0.0, margin - (hi - lo)), scores, valid, labels, weights)


def ref_bce_labels(scores, valid, labels):
  out = np.zeros(len(scores))
  for b in range(len(scores)):
    terms = []
    for c in range(scores.shape[1]):
      if valid[b, c]:
        p = 1.0 / (1.0 + np.exp(-scores[b, c]))
        terms.append(-np.log(p) if labels[b, c] > 0 else -np.log(1.0 - p))
    out[b] = np.mean(terms) if terms else 0.0
  return out


def _labelled_cases(b=4, c=9):
  rng = np.random.default_rng(11)
  w2 = rng.uniform(0.0, 2.0, size=(b, c))
  w3 = rng.uniform(0.0, 2.0, size=(b, c, c))
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  return {
      "softmax_nll": (lambda s, v, y: losses.softmax_nll(s, v, labels=y),
                      lambda s, v, y: ref_softmax_nll_labels(s, v, y)),
      "softmax_nll_t": (lambda s, v, y: losses.softmax_nll(s, v, labels=y, temperature=0.2),
                        lambda s, v, y: ref_softmax_nll_labels(s, v, y, 0.2)),
      "ranknet": (lambda s, v, y: losses.ranknet(s, v, labels=y), ref_ranknet_labels),
      "ranknet_w2": (lambda s, v, y: losses.ranknet(s, v, labels=y, weights=f32(w2)),
                     lambda s, v, y: ref_ranknet_labels(s, v, y, w2)),
      "ranknet_w3": (lambda s, v, y: losses.ranknet(s, v, labels=y, weights=f32(w3)),
                     lambda s, v, y: ref_ranknet_labels(s, v, y, w3)),
      "hinge": (lambda s, v, y: losses.hinge(s, v, labels=y, margin=0.7),
                lambda s, v, y: ref_hinge_labels(s, v, y, 0.7)),
      "hinge_w2": (lambda s, v, y: losses.hinge(s, v, labels=y, weights=f32(w2)),
                   lambda s, v, y: ref_hinge_labels(s, v, y, 1.0, w2)),
      "hinge_w3": (lambda s, v, y: losses.hinge(s, v, labels=y, weights=f32(w3)),
                   lambda s, v, y: ref_hinge_labels(s, v, y, 1.0, w3)),
      "bce": (lambda s, v, y: losses.bce(s, v, labels=y), ref_bce_labels),
  }


LABELLED = _labelled_cases()


@pytest.mark.parametrize("name", sorted(LABELLED))
def test_labelled_value_and_gradient_match_reference(name):
  fn, ref = LABELLED[name]
  scores, valid, labels = _labelled_batch(22, graded=True)
  v, y = jnp.asarray(valid), jnp.asarray(labels, jnp.float32)
  got = jax.jit(fn)(jnp.asarray(scores, jnp.float32), v, y)
  assert got.shape == (4,) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), ref(scores, valid, labels), rtol=1e-5, atol=1e-5)
  # The row without a positive (and, for pairwise losses, without pairs) and the row without a valid
  # column give 0; the latter has no gradient.
  assert float(got[3]) == 0.0
  if not name.startswith("bce"):
    assert float(got[2]) == 0.0

  grad = jax.jit(jax.grad(lambda s: fn(s, v, y).sum()))(jnp.asarray(scores, jnp.float32))
  expected = _numeric_grad(lambda s: ref(s, valid, labels), scores)
  np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-4, atol=1e-5)
  assert np.all(np.asarray(grad)[~valid] == 0.0)


@pytest.mark.parametrize("name", sorted(LABELLED))
def test_labelled_invalid_columns_holding_inf_or_nan_are_ignored(name):
  fn, ref = LABELLED[name]
  scores, valid, labels = _labelled_batch(5, graded=True)
  poisoned, poisoned_labels = scores.copy(), labels.copy()
  poisoned[~valid] = np.resize([np.inf, np.nan, -np.inf], (~valid).sum())
  poisoned_labels[~valid] = np.nan
  got, grad = jax.value_and_grad(lambda x: fn(x, jnp.asarray(valid), jnp.asarray(poisoned_labels)).sum())(
      jnp.asarray(poisoned, jnp.float32))
  np.testing.assert_allclose(float(got), ref(scores, valid, labels).sum(), rtol=1e-5)
  assert np.all(np.isfinite(np.asarray(grad)))
  assert np.all(np.asarray(grad)[~valid] == 0.0)


def test_labelled_losses_take_bfloat16_scores():
  scores, valid, labels = _labelled_batch(22, graded=True)
  s16, v, y = jnp.asarray(scores, jnp.bfloat16), jnp.asarray(valid), jnp.asarray(labels, jnp.float32)
  rounded = np.asarray(s16, np.float64)
  for name in ("softmax_nll", "ranknet_w3", "bce"):
    fn, ref = LABELLED[name]
    got = fn(s16, v, y)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref(rounded, valid, labels), rtol=1e-5, atol=1e-5)
  grad = jax.grad(lambda x: losses.lambdarank(x, v, labels=y, metric="ndcg@5").sum())(s16)
  assert grad.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(grad, np.float32)))


@pytest.mark.slow
def test_identity_labels_give_todays_results():
  scores, valid = _batch(8)
  s, v = jnp.asarray(scores, jnp.float32), jnp.asarray(valid)
  eye = jnp.eye(B, C, dtype=jnp.float32)
  w2 = jnp.asarray(np.random.default_rng(1).uniform(0.0, 2.0, size=(B, C)), jnp.float32)
  calls = {
      "softmax_nll": lambda x, **kw: losses.softmax_nll(x, v, temperature=0.3, **kw),
      "ranknet": lambda x, **kw: losses.ranknet(x, v, **kw),
      "ranknet_weighted": lambda x, **kw: losses.ranknet(x, v, weights=w2, **kw),
      "hinge": lambda x, **kw: losses.hinge(x, v, margin=0.5, **kw),
      "hinge_weighted": lambda x, **kw: losses.hinge(x, v, weights=w2, **kw),
      "bce": lambda x, **kw: losses.bce(x, v, **kw),
  }
  for name, call in calls.items():
    today, labelled = call(s), call(s, labels=eye)
    np.testing.assert_allclose(labelled, today, rtol=1e-6, atol=1e-7, err_msg=name)
    grad_today = jax.grad(lambda x: call(x).sum())(s)
    grad_labelled = jax.grad(lambda x: call(x, labels=eye).sum())(s)
    np.testing.assert_allclose(grad_labelled, grad_today, rtol=1e-6, atol=1e-7, err_msg=name)
  # The softmax and pointwise paths make the same float operations: equal to the bit.
  np.testing.assert_array_equal(calls["softmax_nll"](s, labels=eye), calls["softmax_nll"](s))
  np.testing.assert_array_equal(calls["bce"](s, labels=eye), calls["bce"](s))


def test_per_pair_weights_without_labels_are_the_target_rows_slice():
  scores, valid = _batch(9)
  s, v = jnp.asarray(scores, jnp.float32), jnp.asarray(valid)
  w3 = np.random.default_rng(2).uniform(0.0, 2.0, size=(B, C, C))
  eye = jnp.eye(B, C, dtype=jnp.float32)
  for fn in (losses.ranknet, losses.hinge):
    got = fn(s, v, weights=jnp.asarray(w3, jnp.float32))
    np.testing.assert_allclose(got, fn(s, v, weights=jnp.asarray(w3, jnp.float32), labels=eye), rtol=1e-6)
    np.testing.assert_allclose(got, fn(s, v, weights=jnp.asarray(w3[np.arange(B), np.arange(B)])), rtol=1e-6)
  with pytest.raises(ValueError, match=r"\[B, C, C\]"):
    losses.ranknet(s, v, weights=jnp.ones((B, C, C + 1)))
  with pytest.raises(ValueError, match=r"\[B, C, C\]"):
    losses.hinge(s, v, labels=eye, weights=jnp.ones((B, 1)))
  with pytest.raises(ValueError, match="labels"):
    losses.bce(s, v, labels=jnp.ones((B, C + 1)))


def test_labelled_losses_allow_fewer_columns_than_rows():
  # ADORE re-ranks each query's own retrieved list: C is the depth, unrelated to B.
  scores, valid, labels = _labelled_batch(3, b=6, c=4)
  got = losses.ranknet(jnp.asarray(scores, jnp.float32), jnp.asarray(valid), labels=jnp.asarray(labels))
  np.testing.assert_allclose(got, ref_ranknet_labels(scores, valid, labels), rtol=1e-5, atol=1e-6)


def test_labelled_losses_against_optax_and_rax():
  scores, valid, labels = _labelled_batch(13, graded=True)
  s, v, y = jnp.asarray(scores, jnp.float32), jnp.asarray(valid), jnp.asarray(labels, jnp.float32)
  import optax
  # optax's ranking softmax is -sum y_c log softmax(s)_c with the labels as given: normalize them first.
  target = jnp.where(v & (y > 0), y, 0.0)
  target = target / jnp.maximum(target.sum(axis=1, keepdims=True), 1e-30)
  expected = optax.losses.ranking_softmax_loss(s / 0.5, target, where=v, reduce_fn=None)
  np.testing.assert_allclose(losses.softmax_nll(s, v, labels=y, temperature=0.5), expected, rtol=1e-5,
                             atol=1e-6)
  per_doc = optax.losses.sigmoid_binary_cross_entropy(s, (y > 0).astype(jnp.float32))
  expected = jnp.where(v, per_doc, 0.0).sum(axis=1) / jnp.maximum(v.sum(axis=1), 1)
  np.testing.assert_allclose(losses.bce(s, v, labels=y), expected, rtol=1e-5, atol=1e-6)

  rax = pytest.importorskip("rax")
  per_row = lambda loss, **kw: jax.jit(jax.vmap(
      lambda a, b, c: loss(a, b, where=c, reduce_fn=jnp.mean, **kw)))(s, y, v)
  np.testing.assert_allclose(losses.ranknet(s, v, labels=y), per_row(rax.pairwise_logistic_loss), rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(losses.hinge(s, v, labels=y), per_row(rax.pairwise_hinge_loss), rtol=1e-5,
                             atol=1e-6)
  # rax's NDCG lambda weights are |delta NDCG@K| times the list size.
  lam = lambda a, b, where, **_: (rax.dcg_lambdaweight(a, b, where=where, topn=10, normalize=True)
                                  / a.shape[-1])
  np.testing.assert_allclose(losses.lambdarank(s, v, labels=y, metric="ndcg@10"),
                             per_row(rax.pairwise_logistic_loss, lambdaweight_fn=lam), rtol=1e-5, atol=1e-7)


# --- LambdaRank weights against swap-and-recompute ---

def _ref_ranking(scores, valid):
  return sorted((c for c in range(len(scores)) if valid[c]), key=lambda c: (-scores[c], c))


def _ref_mrr(ranking, labels, k):
  for rank, doc in enumerate(ranking[:k], 1):
    if labels[doc] > 0:
      return 1.0 / rank
  return 0.0


def _ref_dcg(gains_in_order, k):
  return sum((2.0 ** g - 1.0) / np.log2(1.0 + rank) for rank, g in enumerate(gains_in_order[:k], 1))


def ref_lambda_weights(scores, labels, valid, metric):
  """Rank the valid docs, swap docs i and j in the ranking, recompute the metric: |difference|."""
  name, _, k = metric.partition("@")
  k = int(k) if k else None
  out = np.zeros(scores.shape + scores.shape[-1:])
  for b in range(len(scores)):
    ranking = _ref_ranking(scores[b], valid[b])
    if name == "mrr":
      metric_of = lambda r: _ref_mrr(r, labels[b], k)
    else:
      idcg = _ref_dcg(sorted((labels[b, d] for d in ranking), reverse=True), k)
      metric_of = lambda r: _ref_dcg([labels[b, d] for d in r], k) / idcg if idcg > 0 else 0.0
    before = metric_of(ranking)
    position = {doc: p for p, doc in enumerate(ranking)}
    for i in ranking:
      for j in ranking:
        if labels[b, i] > labels[b, j]:
          swapped = list(ranking)
          swapped[position[i]], swapped[position[j]] = j, i
          out[b, i, j] = abs(metric_of(swapped) - before)
  return out


def _ranking_batch(seed, c, graded, ties=False):
  """Three rows of c columns: several positives (graded 1-3 or binary), ~15% invalid columns holding
  inf/NaN/huge scores, and a last row without any positive."""
  rng = np.random.default_rng(seed)
  scores = rng.integers(0, 4, size=(3, c)).astype(np.float64) if ties else rng.normal(size=(3, c))
  scores = scores.astype(np.float32).astype(np.float64)
  valid = rng.random((3, c)) >= 0.15
  relevant = rng.random((3, c)) < min(0.5, 6.0 / c)
  labels = np.where(relevant, rng.integers(1, 4, (3, c)) if graded else 1, 0).astype(np.float64)
  labels[0, rng.choice(c, 3, replace=False)] = 1.0  # at least a few positives, some maybe invalid
  labels[2] = 0.0
  poisoned = scores.copy()
  poisoned[~valid] = rng.choice([np.inf, np.nan, 1e30, -np.inf], size=(~valid).sum())
  return scores, poisoned, valid, labels


@pytest.mark.parametrize("metric, c", [("mrr@10", 30), ("mrr@10", 250), ("ndcg@10", 30), ("ndcg@10", 250),
                                       ("mrr@1", 117), ("ndcg@3", 117), ("mrr", 61), ("ndcg@1000", 250)])
def test_lambda_weights_equal_swap_and_recompute(metric, c):
  scores, poisoned, valid, labels = _ranking_batch(c + len(metric), c, graded=metric.startswith("ndcg"))
  assert all(len(np.unique(row[v])) == v.sum() for row, v in zip(scores, valid))  # no ties
  fn = jax.jit(losses.lambda_weights, static_argnames="metric")
  got = fn(jnp.asarray(poisoned, jnp.float32), jnp.asarray(labels, jnp.float32), jnp.asarray(valid),
           metric=metric)
  assert got.shape == (3, c, c) and got.dtype == jnp.float32
  expected = ref_lambda_weights(scores, labels, valid, metric)
  assert expected[:2].max() > 0  # the test exercises swaps that move the metric
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("metric", ["mrr@5", "ndcg@5"])
def test_lambda_weights_break_ties_by_lower_column(metric):
  scores, poisoned, valid, labels = _ranking_batch(4, 40, graded=metric.startswith("ndcg"), ties=True)
  fn = jax.jit(losses.lambda_weights, static_argnames="metric")
  got = fn(jnp.asarray(poisoned, jnp.float32), jnp.asarray(labels, jnp.float32), jnp.asarray(valid),
           metric=metric)
  np.testing.assert_allclose(np.asarray(got), ref_lambda_weights(scores, labels, valid, metric), rtol=1e-5,
                             atol=1e-7)


def test_lambda_weights_match_rax_ndcg():
  rax = pytest.importorskip("rax")
  scores, _, valid, labels = _ranking_batch(17, 60, graded=True)
  s, y, v = jnp.asarray(scores, jnp.float32), jnp.asarray(labels, jnp.float32), jnp.asarray(valid)
  expected = jax.jit(lambda a, b, c: rax.dcg_lambdaweight(a, b, where=c, topn=10, normalize=True))(s, y, v)
  expected = np.asarray(expected).reshape(3, 60, 60) / 60
  pairs = valid[:, :, None] & valid[:, None, :] & (labels[:, :, None] > labels[:, None, :])
  got = jax.jit(losses.lambda_weights, static_argnames="metric")(s, y, v, metric="ndcg@10")
  np.testing.assert_allclose(got, np.where(pairs, expected, 0.0),
                             rtol=1e-5, atol=1e-7)


def test_lambda_weights_reject_unknown_metrics():
  s, v = jnp.zeros((2, 3)), jnp.ones((2, 3), bool)
  for metric in ("map@10", "mrr@0", "ndcg@", "MRR@10"):
    with pytest.raises(ValueError, match="mrr@K or ndcg@K"):
      losses.lambda_weights(s, jnp.ones((2, 3)), v, metric)


def test_lambdarank_is_ranknet_weighted_by_delta_metric_without_differentiating_it():
  scores, valid, labels = _labelled_batch(30, graded=True)
  s, v, y = jnp.asarray(scores, jnp.float32), jnp.asarray(valid), jnp.asarray(labels, jnp.float32)
  delta = ref_lambda_weights(scores, labels, valid, "ndcg@5")
  w2 = np.random.default_rng(3).uniform(0.5, 2.0, size=(4, 9))
  for weights, pair_weights in ((None, delta), (w2, delta * w2[:, None, :])):
    got = losses.lambdarank(s, v, labels=y, metric="ndcg@5",
                            weights=None if weights is None else jnp.asarray(weights, jnp.float32))
    np.testing.assert_allclose(got, ref_ranknet_labels(scores, valid, labels, pair_weights), rtol=1e-5,
                               atol=1e-7)
  # The weights are constants of the step: the gradient is ranknet's with those weights held fixed.
  fixed = jnp.asarray(delta, jnp.float32)
  grad = jax.grad(lambda x: losses.lambdarank(x, v, labels=y, metric="ndcg@5").sum())(s)
  np.testing.assert_allclose(grad, jax.grad(lambda x: losses.ranknet(x, v, labels=y, weights=fixed).sum())(s),
                             rtol=1e-5, atol=1e-7)
  # MRR weights: only (relevant, irrelevant) swaps that move the first relevant doc count.
  got = losses.lambdarank(s, v, labels=y, metric="mrr@10", weights=jnp.asarray(delta, jnp.float32))
  mrr = ref_lambda_weights(scores, labels, valid, "mrr@10")
  np.testing.assert_allclose(got, ref_ranknet_labels(scores, valid, labels, mrr * delta), rtol=1e-5,
                             atol=1e-7)


def test_lambdarank_in_batch_layout_and_poisoned_columns():
  scores, valid = _batch(10)
  poisoned = scores.copy()
  poisoned[~valid] = np.nan
  poisoned[0, ~valid[0]] = np.inf
  s, v = jnp.asarray(poisoned, jnp.float32), jnp.asarray(valid)
  eye = np.eye(B, C)
  got, grad = jax.value_and_grad(lambda x: losses.lambdarank(x, v, labels=None, metric="mrr@3").sum())(s)
  valid_eye = valid | eye.astype(bool)
  expected = ref_ranknet_labels(scores, valid_eye, eye, ref_lambda_weights(scores, eye, valid_eye, "mrr@3"))
  np.testing.assert_allclose(float(got), expected.sum(), rtol=1e-5)
  assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[~valid] == 0.0)


# --- LambdaRank weights by list position (DRhard / JPQ) ---

def ref_position_weights(labels, valid, k):
  """The authors' weight: 1/p for list positions p = 1, 2, ... (0 beyond k), |1/p_i - 1/p_j| on every pair
  of valid columns with labels[i] > labels[j], whatever the scores."""
  b, c = labels.shape
  reciprocal = [1.0 / p if p <= k else 0.0 for p in range(1, c + 1)]
  out = np.zeros((b, c, c))
  for row in range(b):
    for i in range(c):
      for j in range(c):
        if valid[row, i] and valid[row, j] and labels[row, i] > labels[row, j]:
          out[row, i, j] = abs(reciprocal[i] - reciprocal[j])
  return out


@pytest.mark.parametrize("k, c", [(10, 30), (10, 203), (200, 203), (3, 12)])
def test_position_weights_are_the_authors_metric_weights(k, c):
  """Several positives anywhere, invalid columns holding inf/NaN, ties: the weight reads positions only."""
  scores, poisoned, valid, labels = _ranking_batch(k + c, c, graded=False, ties=True)
  labels[1, -3:] = 1.0  # positives beyond a cut of 200 (appended after a top 200)
  valid[1, -3:] = True
  fn = jax.jit(losses.lambda_weights, static_argnames=("metric", "delta"))
  got = fn(jnp.asarray(poisoned, jnp.float32), jnp.asarray(labels, jnp.float32), jnp.asarray(valid),
           metric=f"mrr@{k}", delta="positions")
  expected = ref_position_weights(labels, valid, k)
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-8)
  # Against the exact swap on a list in score order: never larger, smaller where several positives are.
  in_order = np.tile(-np.arange(c, dtype=np.float64), (3, 1))
  every = np.ones_like(valid)
  exact = ref_lambda_weights(in_order, labels, every, f"mrr@{k}")
  by_position = ref_position_weights(labels, every, k)
  assert np.all(exact <= by_position + 1e-12) and np.any(exact < by_position - 1e-3)


def test_lambdarank_by_positions_is_the_authors_pair_mean():
  """Per query: sum over (relevant, irrelevant) pairs of |1/p_r - 1/p_u| log(1 + e^(s_u - s_r)) divided by
  the number of pairs, weight-0 pairs (both beyond the cut) counted; gradient by finite differences."""
  scores, _, valid, labels = _ranking_batch(5, 25, graded=False)
  k = 4
  lam = ref_position_weights(labels, valid, k)

  def ref(x):
    total = 0.0
    for b in range(3):
      pairs = [(i, j) for i in range(25) for j in range(25)
               if valid[b, i] and valid[b, j] and labels[b, i] > labels[b, j]]
      if pairs:
        total += sum(lam[b, i, j] * np.logaddexp(0.0, x[b, j] - x[b, i]) for i, j in pairs) / len(pairs)
    return total

  s, v, y = jnp.asarray(scores, jnp.float32), jnp.asarray(valid), jnp.asarray(labels, jnp.float32)
  fn = lambda x: losses.lambdarank(x, v, labels=y, metric=f"mrr@{k}", delta="positions").sum()
  got, grad = jax.value_and_grad(fn)(s)
  np.testing.assert_allclose(float(got), ref(scores), rtol=1e-5)
  eps = 1e-6
  for b, col in [(0, 0), (0, 3), (1, 2), (1, 20)]:
    up, down = scores.copy(), scores.copy()
    up[b, col] += eps
    down[b, col] -= eps
    np.testing.assert_allclose(float(grad[b, col]), (ref(up) - ref(down)) / (2 * eps), rtol=1e-3, atol=1e-7)


def test_position_weights_refuse_what_has_no_list_order_or_no_authors_form():
  s, v, y = jnp.zeros((2, 3)), jnp.ones((2, 3), bool), jnp.eye(2, 3)
  with pytest.raises(ValueError, match="ndcg@10.*lambda_delta='exact'"):
    losses.lambda_weights(s, y, v, "ndcg@10", "positions")
  with pytest.raises(ValueError, match="in-batch layout"):
    losses.lambdarank(s, v, labels=None, metric="mrr@10", delta="positions")
  with pytest.raises(ValueError, match="positions, exact"):
    losses.lambda_weights(s, y, v, "mrr@10", "swap")


# --- make_loss ---

def _config(name, **overrides):
  import ml_collections
  fields = dict(name=name, temperature=0.5, margin=0.3, lambda_metric="mrr@10", lambda_delta="exact")
  fields.update(overrides)
  return ml_collections.ConfigDict(fields)


def test_make_loss_builds_each_loss_from_config():
  scores, valid, labels = _labelled_batch(40, b=4, c=9, graded=True)
  s, v, y = jnp.asarray(scores, jnp.float32), jnp.asarray(valid), jnp.asarray(labels, jnp.float32)
  w = jnp.asarray(np.random.default_rng(4).uniform(0.0, 2.0, size=(4, 9)), jnp.float32)
  direct = {
      "softmax_nll": lambda **kw: losses.softmax_nll(s, v, temperature=0.5, **kw),
      # The temperature divides the scores of the pairwise losses too (their differences, for cosines).
      "ranknet": lambda **kw: losses.ranknet(s / 0.5, v, **kw),
      "lambdarank": lambda labels=None, **kw: losses.lambdarank(s / 0.5, v, labels=labels, metric="mrr@10",
                                                                **kw),
      "hinge": lambda **kw: losses.hinge(s, v, margin=0.3, **kw),
      "bce": lambda **kw: losses.bce(s, v, **kw),
  }
  assert sorted(direct) == sorted(losses.LOSS_NAMES)
  for name, call in direct.items():
    fn = losses.make_loss(_config(name))
    same = lambda got, expected: np.testing.assert_allclose(got, expected, rtol=1e-6, err_msg=name)
    same(fn(s, {"valid": v}), call())
    same(fn(s, {"valid": v, "labels": y}), call(labels=y))
    if name in ("ranknet", "lambdarank", "hinge"):
      same(fn(s, {"valid": v, "labels": y, "weights": w}), call(labels=y, weights=w))
    else:
      with pytest.raises(ValueError, match="weights"):
        fn(s, {"valid": v, "weights": w})
  # The batch is a pytree argument: the loss jits with it.
  jitted = jax.jit(losses.make_loss(_config("lambdarank")))
  np.testing.assert_allclose(jitted(s, {"valid": v, "labels": y, "weights": w}),
                             direct["lambdarank"](labels=y, weights=w), rtol=1e-6)


def test_make_loss_rejects_unknown_names_and_metrics():
  with pytest.raises(ValueError, match="softmax_nll, ranknet, lambdarank, hinge, bce"):
    losses.make_loss(_config("listnet"))
  with pytest.raises(ValueError, match="mrr@K or ndcg@K"):
    losses.make_loss(_config("lambdarank", lambda_metric="ndcg10"))
  # Refused when the step is built, not at its first trace.
  with pytest.raises(ValueError, match="lambda_delta='exact'"):
    losses.make_loss(_config("lambdarank", lambda_metric="ndcg@10", lambda_delta="positions"))
  with pytest.raises(ValueError, match="positions, exact"):
    losses.make_loss(_config("lambdarank", lambda_delta="swap"))


def test_make_loss_reads_lambda_delta():
  scores, valid, labels = _labelled_batch(41, b=4, c=9)
  s, v, y = jnp.asarray(scores, jnp.float32), jnp.asarray(valid), jnp.asarray(labels, jnp.float32)
  fn = losses.make_loss(_config("lambdarank", lambda_delta="positions"))
  expected = losses.lambdarank(s / 0.5, v, labels=y, metric="mrr@10", delta="positions")
  np.testing.assert_allclose(fn(s, {"valid": v, "labels": y}), expected, rtol=1e-6)
  exact = losses.lambdarank(s / 0.5, v, labels=y, metric="mrr@10", delta="exact")
  assert not np.allclose(expected, exact)


def _np_kl_row(s, t, v, temperature):
  idx = np.flatnonzero(v)
  if len(idx) < 2:
    return 0.0
  def softmax(x):
    x = x[idx] / temperature
    e = np.exp(x - x.max())
    return e / e.sum()
  ps, pt = softmax(s), softmax(t)
  return float(np.sum(pt * (np.log(pt) - np.log(ps))))


@pytest.mark.parametrize("temperature", [1.0, 0.3])
def test_granular_distillation_against_loops(temperature):
  """FGD's Eq. 12 at one granularity: the mean over a query's pieces of KL(teacher || student), from loops."""
  from jdr.training import losses  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(7)
  b, k, n = 4, 5, 6
  student, teacher = rng.normal(size=(b, k, n)) * 3, rng.normal(size=(b, k, n)) * 3
  valid = rng.random((b, k, n)) < 0.7
  valid[0, 0] = False  # a padding piece
  valid[1, :, 1:] = False  # a query whose pieces have no negatives: nothing to distil
  got = np.asarray(losses.granular_distillation(student.astype(np.float32), teacher.astype(np.float32), valid,
                                                temperature=temperature))
  for q in range(b):
    rows = [_np_kl_row(student[q, p], teacher[q, p], valid[q, p], temperature) for p in range(k)
            if valid[q, p].sum() >= 2]
    expected = np.mean(rows) if rows else 0.0
    np.testing.assert_allclose(got[q], expected, rtol=1e-5, atol=1e-6)
  assert got[1] == 0.0


def test_distillation_kl_gradient_moves_the_student_only():
  import jax  # pylint: disable=g-import-not-at-top
  from jdr.training import losses  # pylint: disable=g-import-not-at-top
  s = np.array([[1.0, 0.0, -1.0]], np.float32)
  t = np.array([[-1.0, 0.0, 2.0]], np.float32)
  v = np.ones((1, 3), bool)
  gs, gt = jax.grad(lambda a, b: losses.distillation_kl(a, b, v).sum(), argnums=(0, 1))(s, t)
  assert np.all(np.asarray(gt) == 0)  # the teacher is a fixed target
  # d KL / d s = softmax(s) - softmax(t): the student is pulled towards the teacher's mass.
  ps, pt = np.exp(s) / np.exp(s).sum(), np.exp(t) / np.exp(t).sum()
  np.testing.assert_allclose(np.asarray(gs), ps - pt, rtol=1e-5, atol=1e-6)
  assert float(losses.distillation_kl(t, t, v).sum()) == pytest.approx(0.0, abs=1e-6)


def test_margin_mse_against_loops_and_its_gradient():
  """MarginMSE (Hofstaetter et al. 2020): mean over a row's valid negatives of ((s+ - s-) - (t+ - t-))^2, in
  float64 loops; rows without a valid positive or negative give 0; the teacher gets no gradient."""
  import jax  # pylint: disable=g-import-not-at-top
  from jdr.training import losses  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(11)
  b, n = 6, 5
  student, teacher = rng.normal(size=(b, n)) * 2, rng.normal(size=(b, n)) * 4
  valid = rng.random((b, n)) < 0.7
  valid[:, 0] = True
  valid[1, 0] = False  # no positive: nothing to compare
  valid[2, 1:] = False  # no negative
  teacher[3, 2] = np.nan  # a missing teacher score on an invalid column must not leak
  valid[3, 2] = False
  got = np.asarray(losses.margin_mse(student.astype(np.float32), teacher.astype(np.float32), valid))
  grad_s, grad_t = jax.grad(lambda s, t: losses.margin_mse(s, t, valid).sum(), argnums=(0, 1))(
      student.astype(np.float32), np.nan_to_num(teacher).astype(np.float32))
  for q in range(b):
    errs = [(student[q, 0] - student[q, j]) - (teacher[q, 0] - teacher[q, j]) for j in range(1, n)
            if valid[q, 0] and valid[q, j]]
    np.testing.assert_allclose(got[q], np.mean(np.square(errs)) if errs else 0.0, rtol=1e-5, atol=1e-6)
    # d/ds_0 = mean of 2 err; d/ds_j = -2 err_j / count.
    want = np.zeros(n)
    js = [j for j in range(1, n) if valid[q, 0] and valid[q, j]]
    for j in js:
      e = (student[q, 0] - student[q, j]) - (teacher[q, 0] - teacher[q, j])
      want[0] += 2 * e / len(js)
      want[j] -= 2 * e / len(js)
    np.testing.assert_allclose(np.asarray(grad_s)[q], want, rtol=1e-4, atol=1e-5)
  assert got[1] == 0.0 and got[2] == 0.0 and np.all(np.asarray(grad_t) == 0)
