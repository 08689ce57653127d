"""Encoder and tower behaviour on tiny random models (HF parity lives in test_hf.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdr.models.bert import Dense, Encoder, EncoderConfig, heads_projection, roberta_position_ids
from jdr.models.towers import Tower, TowerConfig, TwoTower, l2_normalize, pool

TINY = EncoderConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                     max_position_embeddings=24)
AXES = {"vocab", "embed", "mlp", "heads", "kv", "position", "type", None}


def batch(pad_id=0, length=9):
  rng = np.random.default_rng(0)
  ids = rng.integers(3, TINY.vocab_size, size=(3, length)).astype(np.int32)
  mask = np.ones_like(ids)
  for row, n in ((1, 5), (2, 2)):
    ids[row, n:], mask[row, n:] = pad_id, 0
  return ids, mask


@pytest.fixture(scope="module")
def encoder_params():
  ids, mask = batch()
  return nn.unbox(Encoder(TINY).init(jax.random.key(0), ids, mask)["params"])


@pytest.mark.slow
def test_params_carry_logical_axes():
  ids, mask = batch()
  boxed = Encoder(TINY).init(jax.random.key(0), ids, mask)["params"]
  leaves = jax.tree_util.tree_leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  assert leaves and all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
  for leaf in leaves:
    assert len(leaf.names) == leaf.value.ndim and set(leaf.names) <= AXES
    assert leaf.value.dtype == jnp.float32
  layer = nn.unbox(boxed)["layer_0"]
  assert layer["query"]["kernel"].shape == (32, 4, 8)
  assert layer["attention_output"]["kernel"].shape == (4, 8, 32)


def test_padding_does_not_change_real_tokens(encoder_params):
  # Extra padding columns must not leak into real positions (mask) or shift positions (RoBERTa offsets).
  for cfg, pad in ((TINY, 0), (TINY.replace(model_type="roberta", pad_token_id=1), 1)):
    ids, mask = batch(pad)
    short = Encoder(cfg).apply({"params": encoder_params}, ids, mask)
    longer_ids = np.pad(ids, ((0, 0), (0, 4)), constant_values=pad)
    longer = Encoder(cfg).apply({"params": encoder_params}, longer_ids, np.pad(mask, ((0, 0), (0, 4))))
    valid = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(longer)[:, :9][valid], np.asarray(short)[valid], atol=1e-5)


def test_roberta_positions_follow_fairseq():
  ids = jnp.array([[0, 5, 6, 2, 1, 1], [0, 7, 2, 1, 1, 1]])
  np.testing.assert_array_equal(roberta_position_ids(ids, 1), [[2, 3, 4, 5, 1, 1], [2, 3, 4, 1, 1, 1]])


def test_token_types_default_to_segment_zero(encoder_params):
  ids, mask = batch()
  enc = Encoder(TINY)
  default = enc.apply({"params": encoder_params}, ids, mask)
  zeros = enc.apply({"params": encoder_params}, ids, mask, np.zeros_like(ids))
  ones = enc.apply({"params": encoder_params}, ids, mask, np.ones_like(ids))
  np.testing.assert_allclose(default, zeros, atol=1e-6)
  assert np.abs(np.asarray(ones - zeros)).max() > 1e-3


def test_dropout_only_when_not_deterministic(encoder_params):
  ids, mask = batch()
  enc, variables = Encoder(TINY), {"params": encoder_params}
  a = enc.apply(variables, ids, mask)
  b = enc.apply(variables, ids, mask, deterministic=True, rngs={"dropout": jax.random.key(1)})
  np.testing.assert_array_equal(a, b)
  c = enc.apply(variables, ids, mask, deterministic=False, rngs={"dropout": jax.random.key(1)})
  c2 = enc.apply(variables, ids, mask, deterministic=False, rngs={"dropout": jax.random.key(1)})
  d = enc.apply(variables, ids, mask, deterministic=False, rngs={"dropout": jax.random.key(2)})
  np.testing.assert_array_equal(c, c2)
  assert np.abs(np.asarray(c - a)).max() > 1e-3 and np.abs(np.asarray(c - d)).max() > 1e-3


@pytest.mark.slow
def test_remat_gives_identical_outputs_and_grads(encoder_params):
  ids, mask = batch()

  # A random readout: sum(out ** 2) would be constant after the final LayerNorm and have no gradient.
  readout = jax.random.normal(jax.random.key(4), (3, 9, 32))

  def loss(params, cfg):
    out = Encoder(cfg).apply({"params": params}, ids, mask, deterministic=False,
                             rngs={"dropout": jax.random.key(3)})
    return jnp.sum(out * readout)

  np.testing.assert_array_equal(Encoder(TINY).apply({"params": encoder_params}, ids, mask),
                                Encoder(TINY.replace(remat=True)).apply({"params": encoder_params}, ids, mask))
  # Gradients on one layer: compiling backward passes dominates this file's runtime.
  plain, remat = TINY.replace(num_layers=1), TINY.replace(num_layers=1, remat=True)
  params = {k: v for k, v in encoder_params.items() if k != "layer_1"}
  grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  l1, g1 = grad(params, plain)
  l2, g2 = grad(params, remat)
  np.testing.assert_allclose(l1, l2, rtol=1e-6)
  # Recomputation changes XLA's fusion and summation order, so gradients agree to float32 rounding only.
  # (Key biases have an exactly-zero true gradient, so compare against the largest gradient overall.)
  scale = max(np.abs(np.asarray(x)).max() for x in jax.tree_util.tree_leaves(g1))
  for x, y in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2)):
    assert np.abs(np.asarray(x - y)).max() <= 1e-5 * scale


@pytest.mark.slow
def test_bfloat16_compute_float32_io(encoder_params):
  ids, mask = batch()
  f32 = Encoder(TINY).apply({"params": encoder_params}, ids, mask)
  bf16 = Encoder(TINY.replace(dtype="bfloat16")).apply({"params": encoder_params}, ids, mask)
  assert bf16.dtype == jnp.float32
  assert np.abs(np.asarray(bf16 - f32)).max() < 0.1  # post-LN activations are O(1); bf16 keeps ~3 digits


def test_config_hf_round_trip_and_validation():
  for cfg in (TINY, TINY.replace(model_type="roberta", pad_token_id=1, type_vocab_size=1)):
    assert EncoderConfig.from_hf(cfg.to_hf()) == cfg
  assert EncoderConfig.from_hf(TINY.to_hf(), dtype="bfloat16").dtype == "bfloat16"
  with pytest.raises(ValueError, match="unsupported Hugging Face model_type"):
    EncoderConfig.from_hf(dict(TINY.to_hf(), model_type="gpt2"))
  with pytest.raises(ValueError, match="relative_key"):
    EncoderConfig.from_hf(dict(TINY.to_hf(), position_embedding_type="relative_key"))
  with pytest.raises(ValueError, match="multiple"):
    TINY.replace(num_heads=5)


def test_too_long_sequence_is_an_error(encoder_params):
  ids = np.ones((1, 25), np.int32)
  with pytest.raises(ValueError, match="exceeds"):
    Encoder(TINY).apply({"params": encoder_params}, ids, ids)


# ------------------------------------------------------------------------------------------------ towers


def numpy_pool(hidden, mask, how):
  if how == "cls":
    return hidden[:, 0]
  out = []
  for h, m in zip(hidden, mask.astype(bool)):
    out.append(h[m].mean(0) if how == "mean" else h[m].max(0))
  return np.stack(out)


@pytest.mark.parametrize("how", ["cls", "mean", "max"])
def test_pooling_matches_numpy(how):
  rng = np.random.default_rng(1)
  hidden = rng.normal(size=(4, 6, 5)).astype(np.float32)
  mask = np.array([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
  np.testing.assert_allclose(pool(jnp.asarray(hidden), jnp.asarray(mask), how), numpy_pool(hidden, mask, how),
                             rtol=1e-6, atol=1e-6)


def test_empty_rows_pool_to_zero_not_nan():
  out = pool(jnp.ones((1, 3, 2)), jnp.zeros((1, 3)), "mean")
  np.testing.assert_array_equal(out, 0)
  np.testing.assert_array_equal(l2_normalize(jnp.zeros((1, 4))), 0)


@pytest.mark.parametrize("how", ["cls", "mean", "max"])
def test_tower_pools_encoder_output(encoder_params, how):
  ids, mask = batch()
  hidden = np.asarray(Encoder(TINY).apply({"params": encoder_params}, ids, mask))
  out = Tower(TowerConfig(encoder=TINY, pooling=how)).apply({"params": {"encoder": encoder_params}}, ids, mask)
  np.testing.assert_allclose(out, numpy_pool(hidden, mask, how), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("remat", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_first_token_only_is_the_whole_encoders_first_position(encoder_params, remat):
  """The last layer computed at the first position alone gives what the whole encoder gives there: without
  dropout, and with it (the same masks: a different key would move the output by far more than rounding),
  its output and every parameter's gradient."""
  ids, mask = batch()
  cfg = TINY.replace(remat=remat, attention_dropout=0.2)

  def first(params, only, key):
    rngs = {} if key is None else {"dropout": jax.random.key(key)}
    out = Encoder(cfg).apply({"params": params}, ids, mask, deterministic=key is None,
                             first_token_only=only, rngs=rngs)
    assert out.shape == ((3, 1, 32) if only else (3, 9, 32))
    return out[:, :1]

  readout = jax.random.normal(jax.random.key(4), (3, 1, 32))
  for key in (None, 3):
    whole, alone = first(encoder_params, False, key), first(encoder_params, True, key)
    np.testing.assert_allclose(alone, whole, rtol=0, atol=1e-6)
    grads = [jax.grad(lambda p, only=only: jnp.sum(first(p, only, key) * readout))(encoder_params)
             for only in (False, True)]
    scale = max(np.abs(np.asarray(g)).max() for g in jax.tree.leaves(grads[0]))
    for g_whole, g_alone in zip(*map(jax.tree.leaves, grads)):
      assert np.abs(np.asarray(g_whole - g_alone)).max() <= 1e-5 * scale
  assert np.abs(np.asarray(first(encoder_params, True, 3) - first(encoder_params, True, 5))).max() > 1e-2


def test_dropout_bits_of_a_corner_are_the_whole_arrays_there():
  from jdr.models.dropout import dropout_bits  # pylint: disable=g-import-not-at-top
  key = jax.random.key(2)
  whole = np.asarray(dropout_bits(key, (2, 3, 6, 6)))
  np.testing.assert_array_equal(np.asarray(dropout_bits(key, (2, 3, 1, 6), whole=(2, 3, 6, 6))), whole[:, :, :1])
  np.testing.assert_array_equal(np.asarray(dropout_bits(key, (2, 1, 2, 4), whole=(2, 3, 6, 6))),
                                whole[:, :1, :2, :4])
  with pytest.raises(ValueError, match="not a part of it"):
    dropout_bits(key, (2, 4), whole=(2, 3))


def test_cls_towers_and_the_cross_encoder_run_the_last_layer_at_the_first_position_only():
  """[CLS] pooling (and the cross-encoder's head) read the first position alone: the compiled forward drops
  the last layer's query, output and MLP matmuls at every other position."""
  from jdr.models.cross import CrossEncoder  # pylint: disable=g-import-not-at-top
  ids, mask = batch(length=16)
  e, f = TINY.hidden_size, TINY.intermediate_size
  skipped = 2 * 3 * 15 * (2 * e * e + 2 * e * f)  # rows x other positions x (query, output, MLP) multiply-adds

  def flops(module, params):
    compiled = jax.jit(lambda p: module.apply({"params": p}, ids, mask)).lower(params).compile()
    analysis = compiled.cost_analysis()
    return (analysis[0] if isinstance(analysis, list) else analysis)["flops"]

  towers = {how: Tower(TowerConfig(encoder=TINY, pooling=how)) for how in ("cls", "mean")}
  params = nn.unbox(towers["mean"].init(jax.random.key(0), ids, mask)["params"])
  assert flops(towers["mean"], params) - flops(towers["cls"], params) >= 0.9 * skipped
  cross = CrossEncoder(TINY)
  cross_params = nn.unbox(cross.init(jax.random.key(0), ids, mask)["params"])
  assert flops(towers["mean"], params) - flops(cross, cross_params) >= 0.9 * skipped


def test_projection_head_and_normalization():
  ids, mask = batch()
  cfg = TowerConfig(encoder=TINY, pooling="mean", projection_dim=7)
  params = nn.unbox(Tower(cfg).init(jax.random.key(0), ids, mask)["params"])
  assert set(params) == {"encoder", "projection", "projection_norm"}
  assert params["projection"]["kernel"].shape == (32, 7) and params["projection_norm"]["scale"].shape == (7,)
  assert cfg.dim == 7
  out = np.asarray(Tower(cfg).apply({"params": params}, ids, mask))
  assert out.shape == (3, 7)
  # LayerNorm at init (scale 1, bias 0): each row has zero mean and unit variance.
  np.testing.assert_allclose(out.mean(-1), 0, atol=1e-5)
  np.testing.assert_allclose(out.var(-1), 1, atol=1e-3)
  normed = np.asarray(Tower(cfg.replace(normalize=True)).apply({"params": params}, ids, mask))
  np.testing.assert_allclose(np.linalg.norm(normed, axis=-1), 1, atol=1e-6)
  np.testing.assert_allclose(normed, out / np.linalg.norm(out, axis=-1, keepdims=True), atol=1e-6)


def test_tower_dropout_only_when_not_deterministic(encoder_params):
  ids, mask = batch()
  tower, variables = Tower(TowerConfig(encoder=TINY)), {"params": {"encoder": encoder_params}}
  a = tower.apply(variables, ids, mask)
  np.testing.assert_array_equal(a, tower.apply(variables, ids, mask, rngs={"dropout": jax.random.key(0)}))
  b = tower.apply(variables, ids, mask, deterministic=False, rngs={"dropout": jax.random.key(0)})
  assert np.abs(np.asarray(a - b)).max() > 1e-3


def test_bow_mlp_matches_manual_computation():
  ids, mask = batch()
  cfg = TowerConfig(kind="bow_mlp", pooling="mean", vocab_size=50, bow_embed_dim=12, bow_hidden=10, bow_dim=6)
  params = nn.unbox(Tower(cfg).init(jax.random.key(0), ids, mask)["params"])
  assert set(params) == {"bow"} and set(params["bow"]) == {"embeddings", "hidden", "output"}
  out = np.asarray(Tower(cfg).apply({"params": params}, ids, mask))
  p = jax.tree_util.tree_map(np.asarray, params["bow"])
  avg = numpy_pool(p["embeddings"][ids], mask, "mean")
  hidden = np.tanh(avg @ p["hidden"]["kernel"] + p["hidden"]["bias"])
  expected = np.tanh(hidden @ p["output"]["kernel"] + p["output"]["bias"])
  assert out.shape == (3, 6) and cfg.dim == 6
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="not 'cls'"):
    TowerConfig(kind="bow_mlp", vocab_size=50)


def test_two_tower_shared_and_separate_params():
  ids, mask = batch()
  cfg = TowerConfig(encoder=TINY, pooling="mean", normalize=True)
  shared = TwoTower(cfg, cfg, shared=True)
  params = nn.unbox(shared.init(jax.random.key(0), ids, mask, ids, mask)["params"])
  assert set(params) == {"tower"}
  q = shared.apply({"params": params}, ids, mask, method="encode_query")
  d = shared.apply({"params": params}, ids, mask, method="encode_doc")
  np.testing.assert_array_equal(q, d)
  both = shared.apply({"params": params}, ids, mask, ids, mask)
  np.testing.assert_array_equal(both[0], q)

  separate = TwoTower(cfg, cfg.replace(projection_dim=16), shared=False)
  params = nn.unbox(separate.init(jax.random.key(0), ids, mask, ids, mask)["params"])
  assert set(params) == {"query_tower", "doc_tower"}
  assert "projection" in params["doc_tower"] and "projection" not in params["query_tower"]
  q = separate.apply({"params": params}, ids, mask, method="encode_query")
  d = separate.apply({"params": params}, ids, mask, method="encode_doc")
  assert q.shape == (3, 32) and d.shape == (3, 16)

  with pytest.raises(ValueError, match="identical"):
    TwoTower(cfg, cfg.replace(pooling="cls"), shared=True).init(jax.random.key(0), ids, mask, ids, mask)


def test_dropout_keeps_the_rate_and_the_expectation():
  """jdr's hashed-bits dropout: the drop fraction is the rate (to sampling error over 4M draws: an 8-bit
  threshold, 0.1016 for 0.1, would fail), kept values are scaled by 1 / (1 - rate), the same key gives the
  same mask and deterministic mode is the identity."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jdr.models.dropout import Dropout  # pylint: disable=g-import-not-at-top
  x = jnp.ones((1024, 4099), jnp.float32)
  layer = Dropout(0.1)
  y = np.asarray(layer.apply({}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)}))
  dropped = float(np.mean(y == 0))
  assert abs(dropped - 0.1) < 5e-4, dropped
  np.testing.assert_allclose(y[y != 0], 1 / 0.9, rtol=1e-6)
  again = np.asarray(layer.apply({}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(0)}))
  np.testing.assert_array_equal(y, again)
  other = np.asarray(layer.apply({}, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)}))
  assert np.mean((y == 0) == (other == 0)) < 0.9  # a different key, a different mask
  np.testing.assert_array_equal(np.asarray(layer.apply({}, x, deterministic=True)), np.asarray(x))


def test_dropout_bits_look_independent_and_follow_each_rows_key():
  """The keyed-hash masks: neighbours along every axis are dropped together at rate^2 (as independent draws
  would be), each 4-bit nibble is uniform, and under vmap a row's mask is the one its own key gives alone."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jdr.models.dropout import dropout_bits  # pylint: disable=g-import-not-at-top
  bits = np.asarray(dropout_bits(jax.random.key(7), (64, 12, 64, 64)))
  dropped = bits < np.uint32(round(0.1 * 2**32))
  n = dropped.size
  for axis in range(4):
    a, b = np.take(dropped, range(dropped.shape[axis] - 1), axis), np.take(dropped, range(1, dropped.shape[axis]), axis)
    both = float(np.mean(a & b))
    assert abs(both - 0.01) < 4 * np.sqrt(0.01 * 0.99 / a.size), (axis, both)
  for shift in range(0, 32, 4):
    counts = np.bincount(((bits >> shift) & 15).reshape(-1), minlength=16)
    chi2 = float(np.sum((counts - n / 16) ** 2 / (n / 16)))
    assert chi2 < 50, (shift, chi2)  # 15 degrees of freedom: p ~ 1e-5
  keys = jax.random.split(jax.random.key(1), 4)
  rows = jax.vmap(lambda k: dropout_bits(k, (8, 16)))(keys)
  for i in range(4):
    np.testing.assert_array_equal(np.asarray(rows[i]), np.asarray(dropout_bits(keys[i], (8, 16))))
  assert len({np.asarray(r).tobytes() for r in rows}) == 4
  # A raw uint32 key (jax.random.PRNGKey) and its typed form draw the same bits.
  np.testing.assert_array_equal(np.asarray(dropout_bits(jax.random.PRNGKey(3), (5, 7))),
                                np.asarray(dropout_bits(jax.random.wrap_key_data(jax.random.PRNGKey(3)), (5, 7))))
  assert jnp.asarray(dropout_bits(jax.random.key(0), (3,))).dtype == jnp.uint32


def test_model_dtype_auto_is_float32_on_cpu_and_bad_names_are_refused():
  """model.dtype=auto (the default) computes in bfloat16 only where the backend is an accelerator."""
  from jdr.models import build  # pylint: disable=g-import-not-at-top
  assert jax.default_backend() == "cpu"
  assert build.compute_dtype("auto") == "float32"
  assert build.compute_dtype("bfloat16") == "bfloat16"
  with pytest.raises(ValueError, match="model.dtype"):
    build.compute_dtype("float16")


def test_attention_dropout_follows_model_dropout_unless_set():
  """model.attention_dropout (-1: model.dropout) reaches the encoders; hidden dropout stays model.dropout."""
  from jdr.runtime import defaults  # pylint: disable=g-import-not-at-top
  from jdr.models import build  # pylint: disable=g-import-not-at-top
  config = defaults.get_config()
  config.model.init_from, config.model.fresh, config.model.pooling = "", "tiny", "mean"
  encoder = lambda: build.build(config.model, config.data).model.query.encoder
  assert (encoder().hidden_dropout, encoder().attention_dropout) == (0.1, 0.1)
  config.model.attention_dropout = 0.0
  assert (encoder().hidden_dropout, encoder().attention_dropout) == (0.1, 0.0)
  config.model.dropout = 0.2
  assert (encoder().hidden_dropout, encoder().attention_dropout) == (0.2, 0.0)


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_fused_attention_equals_the_einsum_attention(model_type):
  """jax.nn.dot_product_attention (what model.attention=auto takes on accelerators, here forced on the CPU)
  gives the einsum path's token vectors, padding included; a training forward with attention dropout keeps
  the einsum path (it needs the probabilities)."""
  cfg = TINY.replace(model_type=model_type, pad_token_id=1 if model_type == "roberta" else 0)
  rng = np.random.default_rng(0)
  ids = rng.integers(3, 50, (3, 9)).astype(np.int32)
  mask = (np.arange(9)[None, :] < np.array([[9], [5], [2]])).astype(np.int32)
  ids = np.where(mask > 0, ids, cfg.pad_token_id).astype(np.int32)
  einsum, fused = Encoder(cfg.replace(attention="einsum")), Encoder(cfg.replace(attention="fused"))
  params = einsum.init(jax.random.PRNGKey(0), ids, mask)
  a = np.asarray(einsum.apply(params, ids, mask))
  b = np.asarray(fused.apply(params, ids, mask))
  valid = mask > 0
  np.testing.assert_allclose(b[valid], a[valid], rtol=1e-5, atol=1e-5)
  train = lambda m: np.asarray(m.apply(params, ids, mask, deterministic=False,
                                       rngs={"dropout": jax.random.PRNGKey(3)}))
  np.testing.assert_array_equal(train(fused), train(einsum))
  with pytest.raises(ValueError, match="attention"):
    cfg.replace(attention="cudnn")


def test_exact_gelu_in_half_precision_is_the_rounded_float64_gelu():
  """bfloat16 GELU (erf in float32, rounded once): within one bfloat16 step of the float64 GELU (plus 1e-6 in
  the far negative tail, where 1 + erf cancels in float32, as in PyTorch), equal to PyTorch's bfloat16 GELU
  above -3 (below, float32 erfs a ulp apart can round to neighbouring bfloat16 values)."""
  import math  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  from jdr.models.bert import exact_gelu  # pylint: disable=g-import-not-at-top
  x = np.concatenate([np.linspace(-12, 12, 20001), np.random.default_rng(0).normal(0, 3, 20000)])
  x16 = jnp.asarray(x, jnp.bfloat16)
  ours = np.asarray(exact_gelu(x16).astype(jnp.float32), np.float64)
  xs = np.asarray(x16.astype(jnp.float32), np.float64)
  exact = np.array([0.5 * v * math.erfc(-v / math.sqrt(2)) for v in xs])
  step = np.abs(np.asarray(jnp.asarray(exact, jnp.bfloat16).astype(jnp.float32), np.float64)) * 2.0 ** -7
  assert np.all(np.abs(ours - exact) <= step + 1e-6), np.max(np.abs(ours - exact) - step)
  theirs = torch.nn.functional.gelu(torch.tensor(xs, dtype=torch.bfloat16)).float().numpy()
  body = xs > -3
  np.testing.assert_array_equal(ours[body], theirs[body])


def test_exact_gelu_and_its_gradient_in_float32_are_the_float64_gelu():
  """float32 GELU and its written-out derivative against float64 transcriptions of 0.5 x erfc(-x / sqrt 2) and
  Phi(x) + x phi(x): within float32 rounding of the value (plus 1.5e-6 in the far negative tail, where 1 + erf
  cancels, as in PyTorch's float32 GELU), and within PyTorch's own float32 error of the gradient."""
  import math  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  from jdr.models.bert import exact_gelu  # pylint: disable=g-import-not-at-top
  x = np.concatenate([np.linspace(-12, 12, 20001), np.random.default_rng(1).normal(0, 3, 20000)]).astype(np.float32)
  xs = x.astype(np.float64)
  value = np.array([0.5 * v * math.erfc(-v / math.sqrt(2)) for v in xs])
  slope = np.array([0.5 * math.erfc(-v / math.sqrt(2)) + v * math.exp(-0.5 * v * v) / math.sqrt(2 * math.pi)
                    for v in xs])
  ours = np.asarray(exact_gelu(jnp.asarray(x)), np.float64)
  ours_slope = np.asarray(jax.grad(lambda t: jnp.sum(exact_gelu(t)))(jnp.asarray(x)), np.float64)
  tx = torch.tensor(x, requires_grad=True)
  torch.nn.functional.gelu(tx).sum().backward()
  theirs_slope = tx.grad.double().numpy()
  assert np.all(np.abs(ours - value) <= 2.0 ** -23 * np.abs(value) * 4 + 1.5e-6)
  slope_error = np.abs(ours_slope - slope)
  assert np.all(slope_error <= 2.0 ** -23 * np.abs(slope) * 8 + 1.5e-6), np.max(slope_error)
  # No worse than PyTorch's float32 derivative: the same formula in float32.
  assert np.max(slope_error) <= 2 * np.max(np.abs(theirs_slope - slope)) + 1e-7


def _dense_general(cfg, features, names, axis=-1):
  out_names = names[-len(features):] if isinstance(features, tuple) else names[-1:]
  init = lambda names, init=None: nn.with_logical_partitioning(init or nn.initializers.normal(0.02), names)
  return nn.DenseGeneral(features, axis=axis, dtype=cfg.compute_dtype, param_dtype=jnp.float32,
                         kernel_init=init(names), bias_init=init(out_names, nn.initializers.zeros_init()))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layer", ["query_key_value", "intermediate", "attention_output"])
def test_dense_is_dense_general(dtype, layer):
  """Each of a layer's matmuls: the query / key / value projection (features heads x head_dim), the
  intermediate and output ones, and the attention output (contracting heads x head_dim) have
  nn.DenseGeneral's parameters (names, shapes, logical axes, initial values) and outputs, each computed as
  one 2-D matmul."""
  cfg = TINY.replace(dtype=dtype)
  heads = (cfg.num_heads, cfg.head_dim)
  if layer == "query_key_value":
    names, features, axis, shape = ("embed", "heads", "kv"), heads, -1, (3, 5, cfg.hidden_size)
    ours = heads_projection(cfg)
  elif layer == "intermediate":
    names, features, axis, shape = ("embed", "mlp"), 24, -1, (3, 5, cfg.hidden_size)
    ours = Dense(cfg, features, names)
  else:
    names, features, axis, shape = ("heads", "kv", "embed"), 24, (-2, -1), (3, 5, *heads)
    ours = Dense(cfg, features, names, contracted=2)
  x = jax.random.normal(jax.random.PRNGKey(1), shape)
  reference = _dense_general(cfg, features, names, axis=axis)
  key = jax.random.PRNGKey(2)
  ours_params, reference_params = ours.init(key, x), reference.init(key, x)
  is_box = lambda a: isinstance(a, nn.Partitioned)
  assert jax.tree.map(lambda a: (a.value.shape, a.names), ours_params, is_leaf=is_box) \
      == jax.tree.map(lambda a: (a.value.shape, a.names), reference_params, is_leaf=is_box)
  np.testing.assert_array_equal(nn.unbox(ours_params)["params"]["kernel"],
                                nn.unbox(reference_params)["params"]["kernel"])
  # A bias that is not zero, so adding it is checked too.
  params = jax.tree.map(lambda a: a + 0.1 * jnp.arange(a.size, dtype=a.dtype).reshape(a.shape) / a.size,
                        nn.unbox(reference_params))
  got, want = ours.apply(params, x), reference.apply(params, x)
  out_shape = (3, 5, *heads) if layer == "query_key_value" else (3, 5, 24)
  assert got.shape == want.shape == out_shape and got.dtype == want.dtype == jnp.dtype(cfg.compute_dtype)
  # The same values to rounding: the 2-D matmul and DenseGeneral's are differently shaped compiled programs,
  # whose float32 sums can differ in the last bit, and such a difference can carry a bfloat16 rounding to
  # the neighbouring value (one bfloat16 step).
  if dtype == "bfloat16":
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-7, atol=1e-6)
  else:
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("module", ["dense", "heads"])
def test_half_precision_bias_gradients_are_summed_in_float32(module):
  """A bias's gradient is the sum of its output's cotangent over every token; bfloat16 keeps 8 bits, so
  summed in bfloat16 over 16,384 tokens it is about 2% off (DenseGeneral's: 1.7-1.9% here). jdr's layers
  sum in float32: against the float64 sum of the same bfloat16 cotangent, within float32 rounding."""
  cfg = TINY.replace(dtype="bfloat16")
  layer = Dense(cfg, 16, ("embed", "mlp")) if module == "dense" else heads_projection(cfg)
  x = jax.random.normal(jax.random.PRNGKey(1), (64, 256, cfg.hidden_size))
  params = nn.unbox(layer.init(jax.random.PRNGKey(2), x))["params"]
  out_shape = jax.eval_shape(lambda p: layer.apply({"params": p}, x), params).shape
  # Cotangents with a mean, as real ones have: the running sum grows far past each term.
  cotangent = (jax.random.normal(jax.random.PRNGKey(3), out_shape) + 0.5).astype(jnp.bfloat16)

  def loss(bias):
    y = layer.apply({"params": {**params, "bias": bias}}, x)
    return jnp.sum(y.astype(jnp.float32) * cotangent.astype(jnp.float32))

  got = np.asarray(jax.jit(jax.grad(loss))(params["bias"]), np.float64).reshape(-1)
  exact = np.asarray(cotangent, np.float64).reshape(-1, got.size).sum(axis=0)
  scale = np.abs(np.asarray(cotangent, np.float64)).reshape(-1, got.size).sum(axis=0)
  assert np.max(np.abs(got - exact) / scale) < 1e-5, np.max(np.abs(got - exact) / scale)


@pytest.mark.parametrize("attention", ["einsum", "flash"])
def test_half_precision_encoder_sums_no_gradient_in_half_precision(attention):
  """Every reduction in a bfloat16 encoder's backward (biases, LayerNorms, embeddings, softmax) accumulates
  in float32."""
  cfg = TINY.replace(dtype="bfloat16", attention=attention)
  ids, mask = batch()
  model = Encoder(cfg)
  params = nn.unbox(model.init(jax.random.key(0), ids, mask)["params"])

  def loss(p):
    return jnp.sum(model.apply({"params": p}, ids, mask, deterministic=False,
                               rngs={"dropout": jax.random.key(1)}))

  reductions = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "reduce_sum":
        reductions.append(eqn.invars[0].aval.dtype)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(jax.grad(loss))(params).jaxpr)
  assert reductions and all(d != jnp.bfloat16 for d in reductions), reductions


def _cast_leaves(tree) -> dict:
  return {"/".join(str(getattr(k, "key", k)) for k in path): leaf.dtype
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_serving_params_give_the_same_vectors_bit_for_bit(model_type):
  """Encoding casts the layers' matmul weights once (towers.serving_params) instead of in every forward;
  the layers cast exactly those, so every tower kind encodes the same bits, and only those are cast."""
  from jdr.models import towers  # pylint: disable=g-import-not-at-top
  enc = TINY.replace(dtype="bfloat16", model_type=model_type, pad_token_id=1 if model_type == "roberta" else 0)
  ids, mask = batch(pad_id=enc.pad_token_id)
  kinds = [TowerConfig(encoder=enc, pooling="mean"), TowerConfig(encoder=enc, pooling="cls", projection_dim=7),
           TowerConfig(kind="bow_mlp", pooling="max", vocab_size=50, bow_embed_dim=12, bow_hidden=10, bow_dim=6)]
  for cfg in kinds:
    for module in (Tower(cfg), TwoTower(cfg, cfg, shared=True), TwoTower(kinds[0], cfg, shared=False)):
      args = (ids, mask) if isinstance(module, Tower) else (ids, mask, ids, mask)
      params = nn.unbox(module.init(jax.random.key(1), *args)["params"])
      # Every weight off the bfloat16 grid (LayerNorm starts at exactly 1 and 0): a wrong cast shows.
      leaves, tree = jax.tree.flatten(params)
      noise = [jax.random.normal(jax.random.key(i), x.shape) * 0.01 for i, x in enumerate(leaves)]
      params = jax.tree.unflatten(tree, [x + n for x, n in zip(leaves, noise)])
      serving = towers.serving_params(params, module)
      before, after = _cast_leaves(params), _cast_leaves(serving)
      changed = {k for k in before if before[k] != after[k]}
      assert all(after[k] == jnp.bfloat16 for k in changed)
      assert all("/layer_" in k and k.rsplit("/", 2)[-2] in ("query", "key", "value", "attention_output",
                                                              "intermediate", "output") for k in changed)
      if cfg.kind == "transformer":
        assert len(changed) == 2 * 6 * enc.num_layers * (1 if isinstance(module, Tower) or module.shared else 2)
      methods = ["__call__"] if isinstance(module, Tower) else ["encode_query", "encode_doc"]
      for method in methods:
        run = jax.jit(lambda p, m=method: module.apply({"params": p}, ids, mask, method=m))
        np.testing.assert_array_equal(np.asarray(run(serving)), np.asarray(run(params)))
  f32 = TowerConfig(encoder=TINY)
  params = nn.unbox(Tower(f32).init(jax.random.key(1), ids, mask)["params"])
  assert _cast_leaves(towers.serving_params(params, Tower(f32))) == _cast_leaves(params)  # float32: no cast


@pytest.mark.parametrize("layout", ["bnld", "blnd"])
def test_attention_logits_round_their_cotangent_in_half_precision(layout):
  """The einsum attention's logits: float32 out; in bfloat16 the backward rounds the cotangent to bfloat16
  before the dQ and dK products (as FlashAttention rounds dS), checked against float64 products of the rounded
  cotangent; float32 keeps autodiff's own backward. With the heads behind the positions ("blnd") the same,
  laid out so."""
  from jdr.models import bert  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  q32, k32 = (rng.standard_normal((2, 3, 5, 8)).astype(np.float32) for _ in range(2))  # [B, N, L, D]
  g = jnp.asarray(rng.standard_normal((2, 3, 5, 7))[..., :5].astype(np.float32))
  plain = lambda q, k: jnp.einsum("bnqd,bnkd->bnqk", q, k, preferred_element_type=jnp.float32)
  laid = (lambda t: jnp.swapaxes(t, 1, 2)) if layout == "blnd" else (lambda t: t)
  logits_of = lambda q, k: bert.attention_logits(q, k, layout)
  q, k = jnp.asarray(q32, jnp.bfloat16), jnp.asarray(k32, jnp.bfloat16)
  logits, vjp = jax.vjp(logits_of, laid(q), laid(k))
  assert logits.dtype == jnp.float32
  np.testing.assert_array_equal(logits, plain(q, k))
  dq, dk = (laid(t) for t in vjp(g))
  assert dq.dtype == dk.dtype == jnp.bfloat16
  f64 = lambda x: np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)
  rounded = f64(g.astype(jnp.bfloat16))
  np.testing.assert_allclose(f64(dq), np.einsum("bnqk,bnkd->bnqd", rounded, f64(k)), rtol=2**-8, atol=1e-6)
  np.testing.assert_allclose(f64(dk), np.einsum("bnqk,bnqd->bnkd", rounded, f64(q)), rtol=2**-8, atol=1e-6)
  # float32: the same backward as the plain einsum's
  got = jax.vjp(logits_of, laid(q32), laid(k32))[1](g)
  for got, want in zip(got, jax.vjp(plain, q32, k32)[1](g)):
    np.testing.assert_array_equal(laid(got), want)


def test_softmax_weighted_values_normalized_after_the_product_are_the_float64_attention():
  """The CPU's attention core (`softmax_weighted_values`: exp(logits - max) times the values, divided by the
  row sums after the product) against float64 softmax(logits) @ values, with masked keys at float32's min, a
  row with every key masked (uniform, as the softmax gives), a fixed per-element dropout applied to the
  probabilities, and the gradients of the logits and values against float64 central differences of the
  transcription."""
  from jdr.models.bert import softmax_weighted_values  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 3, (2, 3, 5, 7))
  logits[0, 0, :, 4:] = np.finfo(np.float32).min
  logits[1, 2, 3, :] = np.finfo(np.float32).min
  values = rng.normal(0, 1, (2, 3, 7, 4))
  keep = rng.random(logits.shape) > 0.3
  dropout64 = lambda w: np.where(keep, w / 0.7, 0.0)

  def oracle(logits, values):
    shifted = np.exp(logits - logits.max(-1, keepdims=True))
    return dropout64(shifted / shifted.sum(-1, keepdims=True)) @ values

  dropout = lambda w: jnp.where(keep, w / jnp.float32(0.7), 0.0)
  ours = softmax_weighted_values(jnp.asarray(logits, jnp.float32), jnp.asarray(values, jnp.float32), dropout)
  np.testing.assert_allclose(np.asarray(ours, np.float64), oracle(logits, values), rtol=1e-5, atol=1e-6)
  # Gradients of sum(out * w) against float64 central differences.
  w = rng.normal(0, 1, (2, 3, 5, 4))
  f = lambda l, v: jnp.sum(softmax_weighted_values(l, v, dropout) * w)
  gl, gv = jax.grad(f, argnums=(0, 1))(jnp.asarray(logits, jnp.float32), jnp.asarray(values, jnp.float32))
  exp_v = np.zeros_like(values)
  for index in [(0, 1, 2, 3), (1, 2, 6, 0), (0, 0, 3, 1)]:
    e = np.zeros_like(values)
    e[index] = 1e-6
    exp_v[index] = (np.sum(oracle(logits, values + e) * w) - np.sum(oracle(logits, values - e) * w)) / 2e-6
    assert abs(float(gv[index]) - exp_v[index]) < 1e-4
  for index in [(0, 1, 2, 3), (1, 0, 4, 6), (0, 0, 1, 2)]:
    e = np.zeros_like(logits)
    e[index] = 1e-6
    expected = (np.sum(oracle(logits + e, values) * w) - np.sum(oracle(logits - e, values) * w)) / 2e-6
    assert abs(float(gl[index]) - expected) < 1e-4
  assert np.all(np.asarray(gl)[0, 0, :, 4:] == 0)  # masked keys get no gradient
  # The first query's probabilities come from the same computation, which they leave unchanged.
  both, first = softmax_weighted_values(jnp.asarray(logits, jnp.float32), jnp.asarray(values, jnp.float32),
                                        dropout, first_row=True)
  np.testing.assert_array_equal(np.asarray(both), np.asarray(ours))
  shifted = np.exp(logits - logits.max(-1, keepdims=True))
  np.testing.assert_allclose(np.asarray(first, np.float64),
                             dropout64(shifted / shifted.sum(-1, keepdims=True))[..., 0, :], rtol=1e-5, atol=1e-7)
  # bfloat16 values: the product accumulates in float32 and is rounded once, in the values' dtype.
  half = softmax_weighted_values(jnp.asarray(logits, jnp.float32), jnp.asarray(values, jnp.bfloat16), dropout)
  assert half.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(half, np.float64), oracle(logits, values), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("layout", ["bnld", "blnd"])
def test_cpu_attention_a_query_block_at_a_time_is_the_float64_attention(monkeypatch, layout):
  """`einsum_attention` on a CPU runs rows of 314 keys and more 32 queries at a time (a loop over blocks, the
  last padded): against float64 softmax(scaled q k^T, masked) @ v for a key mask and a per-query [L, L] mask,
  with the first query's probabilities; its outputs and gradients against the same call computed with all
  queries at once; with dropout it keeps them all at once. With the heads behind the positions ("blnd", the
  projections' own layout) the same, laid out so."""
  from jdr.models import bert  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  b, h, length, d = 2, 3, 330, 8
  q, k, v = (rng.normal(0, 1, (b, h, length, d)) for _ in range(3))
  key_mask = np.arange(length)[None, :] < np.array([length, 250])[:, None]
  local = key_mask[:, None, :] & (np.abs(np.arange(length)[:, None] - np.arange(length)[None, :]) <= 16)
  assert bert.cpu_query_blocks(length, length) == 11  # the last block: 10 queries and 22 of padding
  assert bert.cpu_query_blocks(256, 256) is None

  def oracle(allowed):
    # A row with every key masked is uniform, as float32 min in the softmax gives.
    q_, k_, v_ = (laid(t) for t in (q, k, v))  # [B, N, L, D] whatever the layout
    logits = np.where(allowed, np.einsum("bnqd,bnkd->bnqk", q_, k_) * 0.5, np.finfo(np.float32).min)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    probs = weights / weights.sum(-1, keepdims=True)
    return laid(probs @ v_), probs[:, :, 0, :]

  laid = (lambda t: np.swapaxes(t, 1, 2)) if layout == "blnd" else (lambda t: t)
  q, k, v = (laid(t) for t in (q, k, v))
  f32 = lambda t: jnp.asarray(t, jnp.float32)
  for allowed in (key_mask[:, None, None, :], local[:, None]):
    # A fresh function for each trace: jax caches a traced function's program.
    run = lambda: lambda *qkv: bert.einsum_attention(*qkv, jnp.asarray(allowed), first_row=True, logit_scale=0.5,
                                                     layout=layout)
    w = f32(rng.normal(0, 1, laid(np.zeros((b, h, length, d))).shape))
    grad = lambda: jax.grad(lambda *qkv: jnp.sum(run()(*qkv)[0] * w), argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
    assert "scan" in str(jax.make_jaxpr(run())(f32(q), f32(k), f32(v)))
    out, first = run()(f32(q), f32(k), f32(v))
    assert out.shape == laid(np.zeros((b, h, length, d))).shape and first.shape == (b, h, length)
    want_out, want_first = oracle(allowed)
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(first, np.float64), want_first, rtol=1e-5, atol=1e-7)
    grads = grad()
    with monkeypatch.context() as m:
      m.setattr(bert, "CPU_HEAD_LOGITS_TO_SPLIT", 1 << 40)
      assert "scan" not in str(jax.make_jaxpr(run())(f32(q), f32(k), f32(v)))
      whole_out, whole_first = run()(f32(q), f32(k), f32(v))
      whole_grads = grad()
    # [B, L, N, D] operands reach XLA's dots in another layout, blocks and all at once each their own: float32
    # rounding apart.
    np.testing.assert_allclose(np.asarray(out), np.asarray(whole_out), rtol=1e-6,
                               atol=1e-7 if layout == "bnld" else 1e-6)
    np.testing.assert_allclose(np.asarray(first), np.asarray(whole_first), rtol=1e-6, atol=1e-9)
    for got, want in zip(grads, whole_grads):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  dropped = lambda *qkv: bert.einsum_attention(*qkv, jnp.asarray(key_mask[:, None, None, :]), lambda w: w * 0.5,
                                               layout=layout)
  assert "scan" not in str(jax.make_jaxpr(dropped)(f32(q), f32(k), f32(v)))


@pytest.mark.slow
def test_cpu_attention_blocks_leave_a_split_batch_and_split_heads_split():
  """On a mesh of CPU devices the query blocks' loop runs on each device's own rows and heads: the compiled
  program gathers nothing, where a loop over rows or heads would."""
  from conftest import run_on_cpu_devices  # pylint: disable=g-import-not-at-top
  run_on_cpu_devices("""
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jdr.models import bert
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("rows", "heads"))
q = jax.ShapeDtypeStruct((4, 4, 512, 8), jnp.float32, sharding=NamedSharding(mesh, P("rows", "heads")))
m = jax.ShapeDtypeStruct((4, 1, 1, 512), jnp.bool_, sharding=NamedSharding(mesh, P("rows")))
f = jax.jit(lambda q, m: bert.einsum_attention(q, q, q, m), out_shardings=NamedSharding(mesh, P("rows", "heads")))
assert "scan" in str(jax.make_jaxpr(lambda q, m: bert.einsum_attention(q, q, q, m))(q, m))
text = f.lower(q, m).compile().as_text()
assert not any(c in text for c in ("all-gather", "all-to-all", "collective-permute", "all-reduce")), text
print("OK")
""", devices=4)
