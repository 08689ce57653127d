"""jdr.losses against slow numpy loops (float64) written straight from the papers' equations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdr import losses

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
