"""The optimizer a config builds: schedule shape, what weight decay touches, AdamW and LAMB."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from jdr import optimizers


def _cfg(name="adamw", **kw):
  c = ml_collections.ConfigDict(dict(name=name, learning_rate=1e-3, warmup_steps=10, weight_decay=0.1,
                                     b1=0.9, b2=0.999, eps=1e-8, grad_clip_norm=1.0))
  c.update(kw)
  return c


def test_warmup_then_linear_decay():
  schedule = optimizers.learning_rate_schedule(1.0, 10, 110)
  assert float(schedule(0)) == 0.0
  assert float(schedule(5)) == pytest.approx(0.5)
  assert float(schedule(10)) == pytest.approx(1.0)
  assert float(schedule(60)) == pytest.approx(0.5)
  assert float(schedule(110)) == pytest.approx(0.0)


def test_weight_decay_skips_biases_and_layer_norm():
  params = {"dense": {"kernel": jnp.ones((3, 4)), "bias": jnp.ones((4,))}, "norm": {"scale": jnp.ones((4,))}}
  mask = optimizers.decay_mask(params)
  assert mask == {"dense": {"kernel": True, "bias": False}, "norm": {"scale": False}}


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_zero_gradient_update_is_pure_weight_decay(name):
  """With zero gradients only decoupled weight decay moves the weights, and only the decayed ones."""
  params = {"kernel": jnp.full((2, 2), 2.0), "bias": jnp.full((2,), 2.0)}
  tx = optimizers.make_optimizer(_cfg(name, warmup_steps=0), total_steps=100)
  state = tx.init(params)
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
  assert np.all(np.asarray(updates["bias"]) == 0)
  assert np.all(np.asarray(updates["kernel"]) < 0)


def test_unknown_optimizer_is_an_error():
  with pytest.raises(ValueError, match="adamw' or 'lamb"):
    optimizers.make_optimizer(_cfg("sgd"), total_steps=10)


def test_query_only_training_needs_separate_towers():
  with pytest.raises(ValueError, match="separate towers"):
    optimizers.trainable_labels({"tower": {"w": jnp.ones(2)}}, "query")
  labels = optimizers.trainable_labels({"query_tower": {"w": jnp.ones(2)}, "doc_tower": {"w": jnp.ones(2)}},
                                       "query")
  assert labels == {"query_tower": {"w": "train"}, "doc_tower": {"w": "freeze"}}
