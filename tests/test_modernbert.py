"""jdr.models.modernbert against transformers' PyTorch ModernBertModel on tiny random models.

Every parameter is perturbed (biases and norms away from their initial zeros and ones) and the local window
is 4 tokens (2 each side) on sequences of up to 16, so a wrong window, rope base, layer pattern, gate order or
bias would show. Run with -s for the figures.
"""

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jdr.models import hf  # noqa: E402
from jdr.models import modernbert  # noqa: E402

LENGTHS = (16, 11, 5, 1)


def _tiny(biases: bool, every: int, **extra) -> "transformers.ModernBertModel":
  config = transformers.ModernBertConfig(
      vocab_size=99, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=40,
      max_position_embeddings=64, local_attention=4, global_attn_every_n_layers=every, pad_token_id=0,
      bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, norm_bias=biases,
      attention_bias=biases, mlp_bias=biases, attn_implementation="eager", **extra)
  torch.manual_seed(0)
  model = transformers.ModernBertModel(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return model


# biases, global every n layers, rope bases away from the defaults (both must be read from config.json)
CASES = {"biases": (True, 3, dict(global_rope_theta=1000.0, local_rope_theta=300.0)),
         "no_biases": (False, 2, {})}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
  biases, every, extra = CASES[request.param]
  model = _tiny(biases, every, **extra)
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(path)
  cfg = modernbert.ModernBertConfig.from_hf(json.loads((path / "config.json").read_text()))
  params = modernbert.params_from_state_dict(cfg, hf.read_state_dict(path), str(path))
  return request.param, model, path, cfg, params


def _batch():
  rng = np.random.default_rng(0)
  ids = rng.integers(3, 99, size=(len(LENGTHS), max(LENGTHS)))
  mask = (np.arange(max(LENGTHS))[None, :] < np.asarray(LENGTHS)[:, None]).astype(np.int32)
  return np.where(mask, ids, 0), mask


def _reference(model, ids, mask):
  with torch.no_grad():
    return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()


def _ours(cfg, params, ids, mask, **kwargs):
  return np.asarray(modernbert.ModernBertEncoder(cfg).apply({"params": params}, ids, mask, **kwargs))


def _real(x, mask):
  return x[mask.astype(bool)]


def test_config_reads_the_checkpoint(case):
  name, model, _, cfg, _ = case
  assert cfg.resolved_layer_types == tuple(model.config.layer_types)
  assert "sliding_attention" in cfg.resolved_layer_types and cfg.local_attention == 4
  assert cfg.global_rope_theta == model.config.rope_parameters["full_attention"]["rope_theta"]
  assert cfg.local_rope_theta == model.config.rope_parameters["sliding_attention"]["rope_theta"]
  assert cfg.norm_bias == cfg.attention_bias == cfg.mlp_bias == (name == "biases")


def test_hidden_states_match_transformers(case):
  name, model, _, cfg, params = case
  ids, mask = _batch()
  diff = float(np.abs(_real(_ours(cfg, params, ids, mask), mask) - _real(_reference(model, ids, mask), mask)).max())
  print(f"modernbert ({name}) float32 hidden states vs transformers, real tokens: max abs diff {diff:.2e}")
  assert diff < 1e-5


def test_rows_alone_match_the_padded_batch(case):
  name, _, _, cfg, params = case
  ids, mask = _batch()
  batch = _ours(cfg, params, ids, mask)
  diff = 0.0
  for row, length in enumerate(LENGTHS):
    alone = _ours(cfg, params, ids[row:row + 1, :length], mask[row:row + 1, :length])
    diff = max(diff, float(np.abs(alone[0] - batch[row, :length]).max()))
  print(f"modernbert ({name}) rows alone vs in the padded batch: max abs diff {diff:.2e}")
  assert diff < 1e-5


def test_names_round_trip_exactly(case):
  _, _, path, cfg, params = case
  tensors = hf.read_state_dict(path)
  back = {e.hf_name: e.to_hf(_at(params, e.path)) for e in modernbert.hf_table(cfg)}
  assert set(back) == set(tensors)
  for name, value in back.items():
    assert value.shape == tensors[name].shape and np.array_equal(value, tensors[name]), name
  again = modernbert.params_from_state_dict(cfg, back)
  assert jax.tree.all(jax.tree.map(np.array_equal, again, params))
  # The table's Flax side is exactly the module's param tree (names, shapes).
  shapes = jax.eval_shape(lambda: modernbert.ModernBertEncoder(cfg).init(
      jax.random.key(0), jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)))["params"]
  shapes = jax.tree.map(lambda x: x.shape, nn.unbox(shapes))
  assert shapes == jax.tree.map(lambda x: x.shape, params)


def _at(tree, path):
  for part in path:
    tree = tree[part]
  return tree


def test_export_loads_in_transformers(case, tmp_path):
  from safetensors.numpy import save_file
  name, model, _, cfg, params = case
  tensors = {e.hf_name: np.ascontiguousarray(e.to_hf(_at(params, e.path))) for e in modernbert.hf_table(cfg)}
  (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  loaded = transformers.AutoModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
  assert type(loaded).__name__ == "ModernBertModel"
  assert loaded.config.layer_types == model.config.layer_types
  assert loaded.config.rope_parameters == model.config.rope_parameters
  ids, mask = _batch()
  diff = float(np.abs(_real(_reference(loaded, ids, mask), mask) - _real(_reference(model, ids, mask), mask)).max())
  print(f"modernbert ({name}) exported by jdr, read by transformers: max abs diff {diff:.2e}")
  assert diff < 1e-5
  # And jdr reads its own export as the same config.
  assert modernbert.ModernBertConfig.from_hf(json.loads((tmp_path / "config.json").read_text())) == cfg


def test_bfloat16_compute(case):
  name, model, _, cfg, params = case
  ids, mask = _batch()
  half = cfg.replace(dtype="bfloat16")
  out = _ours(half, params, ids, mask)
  assert out.dtype == np.float32
  diff = float(np.abs(_real(out, mask) - _real(_reference(model, ids, mask), mask)).max())
  print(f"modernbert ({name}) bfloat16 compute vs transformers float32: max abs diff {diff:.2e}")
  assert diff < 5e-2
  served = _ours(half, modernbert.serving_params(params, half), ids, mask)
  assert np.array_equal(served, out)
  assert modernbert.serving_params(params, cfg) is params


def test_gradient_with_dropout_and_remat(case):
  name, _, _, cfg, params = case
  ids, mask = _batch()
  params = jax.tree.map(jnp.asarray, params)

  def loss(p, c, deterministic, key=None):
    out = modernbert.ModernBertEncoder(c).apply({"params": p}, ids, mask, deterministic=deterministic,
                                                rngs={"dropout": key} if key is not None else None)
    return jnp.sum(jnp.where(mask[..., None], out, 0.0) ** 2)

  dropped = cfg.replace(hidden_dropout=0.1, attention_dropout=0.1)
  key = jax.random.key(1)
  grads = jax.grad(loss)(params, dropped, False, key)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
  plain = jax.grad(loss)(params, cfg, True)
  assert not jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b)), grads, plain))
  # remat recomputes the same layers: the same gradient, dropout masks included.
  remat = jax.grad(loss)(params, dropped.replace(remat=True), False, key)
  diff = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(remat)))
  print(f"modernbert ({name}) gradient with dropout, remat vs not: max abs diff {diff:.2e}")
  assert diff < 1e-5


def test_logical_axes_are_the_rule_tables():
  cfg = modernbert.ModernBertConfig(vocab_size=99, hidden_size=32, num_layers=2, num_heads=4,
                                    intermediate_size=40, norm_bias=True, attention_bias=True, mlp_bias=True)
  boxed = jax.eval_shape(lambda: modernbert.ModernBertEncoder(cfg).init(
      jax.random.key(0), jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)))["params"]
  specs = jax.tree.leaves(nn.get_partition_spec(boxed), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  used = {axis for spec in specs for axis in spec if axis is not None}
  assert used == {"vocab", "embed", "mlp", "heads", "kv"}


def test_config_json_variants_and_refusals():
  base = dict(model_type="modernbert", vocab_size=99, hidden_size=32, num_hidden_layers=4,
              num_attention_heads=4, intermediate_size=40)
  # transformers 4's keys: global/local_rope_theta and the every-n pattern, no layer_types.
  legacy = modernbert.ModernBertConfig.from_hf(dict(base, global_rope_theta=1e5, local_rope_theta=5e3,
                                                    global_attn_every_n_layers=2))
  assert (legacy.global_rope_theta, legacy.local_rope_theta) == (1e5, 5e3)
  assert legacy.resolved_layer_types == ("full_attention", "sliding_attention") * 2
  odd = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
  assert modernbert.ModernBertConfig.from_hf(dict(base, layer_types=odd)).resolved_layer_types == tuple(odd)
  # One dropout for the MLP and the embeddings where config.json has one, so model.dropout sets both.
  same = modernbert.ModernBertConfig.from_hf(dict(base, mlp_dropout=0.1, embedding_dropout=0.1))
  assert same.embedding_dropout is None and same.replace(hidden_dropout=0.2).resolved_embedding_dropout == 0.2
  assert modernbert.ModernBertConfig.from_hf(dict(base, mlp_dropout=0.1)).resolved_embedding_dropout == 0.0
  saved = modernbert.ModernBertConfig.from_saved(
      {**dataclasses.asdict(legacy.replace(attention="flash")), "layer_types": list(odd)})
  assert saved.attention == "auto" and saved.layer_types == tuple(odd)
  with pytest.raises(ValueError, match="rope"):
    modernbert.ModernBertConfig.from_hf(dict(base, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
  with pytest.raises(ValueError, match="hidden_activation"):
    modernbert.ModernBertConfig.from_hf(dict(base, hidden_activation="quick_gelu"))
  with pytest.raises(ValueError, match="layer_types"):
    modernbert.ModernBertConfig.from_hf(dict(base, layer_types=odd[:3]))
  with pytest.raises(ValueError, match="not ModernBERT"):
    modernbert.ModernBertConfig.from_hf(dict(base, model_type="bert"))
  cfg = modernbert.ModernBertConfig.from_hf(base)
  with pytest.raises(ValueError, match="BERT-family"):
    modernbert.ModernBertEncoder(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32),
                                           jnp.ones((1, 4), jnp.int32), first_token_attention=True)
  with pytest.raises(hf.HFWeightsError, match="missing tensor: final_norm.weight"):
    modernbert.params_from_state_dict(cfg, {})
