"""model.encode_chunk_rows: the train step's towers encoding a batch a few rows at a time (jax.lax.map)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jdr.runtime import defaults
from jdr.retrieval import span_embeddings
from jdr.training import step
from jdr.models.bert import EncoderConfig
from jdr.models.towers import TowerConfig, TwoTower


def _model(dropout: float, pooling: str = "mean") -> TwoTower:
  tower = TowerConfig(EncoderConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                                    hidden_dropout=dropout, attention_dropout=dropout), pooling=pooling)
  return TwoTower(tower, tower)


def _batch(queries: int = 4, per_query: int = 1):
  rng = np.random.default_rng(0)
  docs = queries * (1 + per_query)
  return {"query_ids": rng.integers(1, 50, (queries, 6)).astype(np.int32),
          "query_mask": (np.arange(6)[None, :] < rng.integers(2, 7, (queries, 1))).astype(np.int32),
          "doc_ids": rng.integers(1, 50, (docs, 11)).astype(np.int32),
          "doc_mask": (np.arange(11)[None, :] < rng.integers(3, 12, (docs, 1))).astype(np.int32),
          "valid": np.ones((queries, docs), bool)}


def _step(model, params, batch, chunk_rows: int):
  config = defaults.get_config()
  config.model.encode_chunk_rows = chunk_rows
  tx = optax.adamw(1e-3)
  state = step.TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params), rng=jax.random.PRNGKey(1))
  new_state, metrics = jax.jit(step.make_train_step(model, tx, config))(state, batch)
  return float(metrics["loss"]), jax.tree.leaves(new_state.params)


@pytest.mark.slow
def test_chunked_step_equals_whole_batch_without_dropout():
  """Without dropout the chunks change nothing but the order of float sums: same loss, same update."""
  model, batch = _model(0.0), _batch()
  params = model.init(jax.random.PRNGKey(0), batch["query_ids"], batch["query_mask"], batch["doc_ids"],
                      batch["doc_mask"])["params"]
  loss, new = _step(model, params, batch, 0)
  chunked_loss, chunked_new = _step(model, params, batch, 2)
  np.testing.assert_allclose(chunked_loss, loss, rtol=1e-6)
  for a, b in zip(chunked_new, new):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_chunks_keep_row_order_and_draw_per_chunk_keys():
  """Rows come back in their order; chunk k of n holds rows k, k+n, ... and draws from fold_in(rng, k)."""
  rows = jnp.arange(12.0)[:, None]
  seen = []

  def encode(arrays, key):
    seen.append(arrays.shape)
    return arrays + jax.random.uniform(key, ()) * 0, arrays[:, 0] * 0 + jax.random.uniform(key, ())

  rng = jax.random.PRNGKey(3)
  same, draws = step.encode_in_chunks(encode, rows, rng, 4)
  np.testing.assert_array_equal(same, rows)  # order kept
  assert seen[-1] == (4, 1)  # the mapped body saw 4 rows
  n = 3
  for row in range(12):
    np.testing.assert_allclose(draws[row], jax.random.uniform(jax.random.fold_in(rng, row % n), ()))
  # 0 or at least all rows: one call on everything, with rng itself.
  for chunk_rows in (0, 12, 20):
    _, whole = step.encode_in_chunks(encode, rows, rng, chunk_rows)
    np.testing.assert_allclose(whole, jax.random.uniform(rng, ()))
  # A size that does not divide the rows is refused, not quietly run as one chunk.
  with pytest.raises(ValueError, match="chunks of 5 rows do not divide the 12 rows"):
    step.encode_in_chunks(encode, rows, rng, 5)


def test_chunked_spans_equal_whole():
  """FGD's document pass (vectors and Eq. 7 span vectors, a tuple) comes back whole and in order."""
  model, batch = _model(0.0, pooling="cls"), _batch()
  params = model.init(jax.random.PRNGKey(0), batch["query_ids"], batch["query_mask"], batch["doc_ids"],
                      batch["doc_mask"])["params"]
  spans = span_embeddings.span_masks(jnp.asarray(batch["doc_mask"]), [("passage", 4), ("sentence", 2)])

  def encode(a, key):
    del key
    return model.apply({"params": params}, *a, method=span_embeddings.two_tower_document_spans())

  whole = encode((batch["doc_ids"], batch["doc_mask"], spans), None)
  chunked = jax.jit(lambda a: step.encode_in_chunks(encode, a, jax.random.PRNGKey(0), 2))(
      (batch["doc_ids"], batch["doc_mask"], spans))
  for a, b in zip(jax.tree.leaves(chunked), jax.tree.leaves(whole)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_dropout_chunks_train_and_match_the_step_query_vectors():
  """With dropout each chunk draws its own masks (the loss moves off the whole-batch one), and the host's
  copy of the step's query vectors (ADORE's host retrieval) follows the same chunks."""
  model, batch = _model(0.1), _batch()
  params = model.init(jax.random.PRNGKey(0), batch["query_ids"], batch["query_mask"], batch["doc_ids"],
                      batch["doc_mask"])["params"]
  whole, _ = _step(model, params, batch, 0)
  chunked, _ = _step(model, params, batch, 2)
  assert np.isfinite(chunked) and chunked != whole
  tx = optax.sgd(0.0)
  state = step.TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params), rng=jax.random.PRNGKey(1))
  vectors = step.make_step_query_vectors(model, 2)(state, batch["query_ids"], batch["query_mask"])
  expected = step.encode_in_chunks(
      lambda a, key: model.apply({"params": params}, *a, deterministic=False, rngs={"dropout": key},
                                 method=TwoTower.encode_query),
      (batch["query_ids"], batch["query_mask"]), step.step_rngs(state)[0], 2)
  np.testing.assert_allclose(vectors, expected, rtol=1e-6)


def test_chunk_rows_and_gradient_caching_refused_together():
  config = defaults.get_config()
  config.model.encode_chunk_rows = 2
  config.grad_cache.chunk_size = 4
  with pytest.raises(ValueError, match="encode_chunk_rows"):
    step.check_grad_cache(config)
  config.grad_cache.chunk_size = 0
  config.model.encode_chunk_rows = -1
  with pytest.raises(ValueError, match="encode_chunk_rows"):
    step.check_grad_cache(config)


def test_chunk_rows_must_divide_the_batch():
  """Checked with the config, before anything is built: every row count the step encodes is a multiple of
  batch_size, so a divisor of it chunks them all."""
  config = defaults.get_config()
  config.batch_size = 32
  for rows in (1, 4, 32):
    config.model.encode_chunk_rows = rows
    step.check_grad_cache(config)
  for rows in (5, 12, 64):
    config.model.encode_chunk_rows = rows
    with pytest.raises(ValueError, match=f"model.encode_chunk_rows={rows} must divide batch_size=32"):
      step.check_grad_cache(config)
