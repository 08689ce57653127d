"""Decoder LLM encoders (jdr.models.decoder): Llama, Mistral, Qwen2 and Qwen3 against transformers' PyTorch
models, right and left padded, from plain, sharded, bfloat16 and causal-LM checkpoints, and back.

transformers is called with position_ids = cumsum(mask) - 1 (clipped at 0), the positions a retrieval tower
uses so that a row's vectors do not depend on its padding. `pytest -s` prints the max abs differences."""

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jdr.models import decoder
from jdr.models import hf
from jdr.models.decoder import DecoderConfig, DecoderEncoder
from jdr.runtime import parallel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=99, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=40)
# One tiny model per family, each with what sets it apart: Llama with biases on attention and MLP, Llama with
# Llama 3.1's rope scaling (an original context of 64 positions puts its 4 frequencies in all three of the
# scaling's bands: kept, smoothed, divided), Mistral with a head_dim of its own and a sliding window shorter
# than the texts, Qwen2's q/k/v biases (and its sliding window on the layers from max_window_layers on),
# Qwen3's q/k norms and head_dim.
CASES = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=2, attention_bias=True, mlp_bias=True)),
    "llama3-rope": ("LlamaConfig", dict(num_hidden_layers=3, rope_theta=10000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, head_dim=16, sliding_window=3)),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=3)),
    "qwen2-window": ("Qwen2Config", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=3,
                                         max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2, head_dim=16)),
}
LENGTHS = (10, 6, 3, 8)  # mixed lengths, one row full
ATOL = 1e-5


def hf_config(case: str, **changes):
  class_name, kwargs = CASES[case]
  return getattr(transformers, class_name)(**{**TINY, **kwargs, **changes})


def perturbed(model, seed: int = 0):
  """Every parameter moved off its init (norms off 1, biases off 0), so every tensor matters."""
  torch.manual_seed(seed)
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return model.eval()


def torch_model(case: str, **changes):
  config = hf_config(case, **changes)
  config._attn_implementation = "eager"  # transformers' reference attention
  return perturbed(transformers.AutoModel.from_config(config))


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request, tmp_path_factory):
  """(case, torch model, checkpoint dir, DecoderConfig, params read from the checkpoint)."""
  model = torch_model(request.param)
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(path)
  cfg = DecoderConfig.from_hf(json.loads((path / "config.json").read_text()))
  params = decoder.params_from_state_dict(cfg, hf.read_state_dict(path), str(path))
  return request.param, model, path, cfg, params


def batch(side: str, lengths=LENGTHS, seed: int = 0):
  """ids, mask [rows, max(lengths)]: the same tokens per row on either side, padding (id 0) on the other."""
  rng = np.random.default_rng(seed)
  longest = max(lengths)
  tokens = rng.integers(1, TINY["vocab_size"], size=(len(lengths), longest))
  ids, mask = np.zeros_like(tokens), np.zeros_like(tokens)
  for row, n in enumerate(lengths):
    span = slice(0, n) if side == "right" else slice(longest - n, longest)
    ids[row, span], mask[row, span] = tokens[row, :n], 1
  return ids, mask


def mask_positions(mask) -> np.ndarray:
  return np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def torch_hidden(model, ids, mask) -> np.ndarray:
  with torch.no_grad():
    out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                position_ids=torch.tensor(mask_positions(mask)))
  return out.last_hidden_state.float().numpy()


def encode(cfg, params, ids, mask, **kwargs) -> np.ndarray:
  return np.asarray(DecoderEncoder(cfg).apply({"params": params}, jnp.asarray(ids), jnp.asarray(mask), **kwargs))


def last_token(hidden, mask) -> np.ndarray:
  last = np.array([np.flatnonzero(row).max() for row in mask])
  return hidden[np.arange(len(mask)), last]


def token_diff(a, b, mask) -> float:
  return float(np.abs(np.asarray(a) - np.asarray(b))[np.asarray(mask).astype(bool)].max())


# ---------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("side", ["right", "left"])
def test_hidden_states_and_last_token_match_transformers(tiny, side):
  case, model, _, cfg, params = tiny
  ids, mask = batch(side)
  ref = torch_hidden(model, ids, mask)
  out = encode(cfg, params, ids, mask)
  assert out.dtype == np.float32 and out.shape == ref.shape
  hidden_diff = token_diff(out, ref, mask)
  pooled = np.asarray(decoder.last_token_pool(jnp.asarray(out), jnp.asarray(mask)))
  pooled_diff = float(np.abs(pooled - last_token(ref, mask)).max())
  print(f"\n{case:12s} {side:5s} padding: hidden max abs diff {hidden_diff:.2e}, last-token {pooled_diff:.2e}")
  assert hidden_diff < ATOL and pooled_diff < ATOL


def test_rope_frequencies_are_transformers(tiny):
  _, model, _, cfg, _ = tiny
  np.testing.assert_allclose(decoder.rope_frequencies(cfg), model.rotary_emb.inv_freq.numpy(), rtol=1e-6)


def test_a_row_alone_is_the_same_row_in_a_padded_batch(tiny):
  _, _, _, cfg, params = tiny
  batches = {side: batch(side) for side in ("right", "left")}
  outs = {side: encode(cfg, params, *batches[side]) for side in batches}
  for row, n in enumerate(LENGTHS):
    ids = batches["right"][0][row:row + 1, :n]
    alone = encode(cfg, params, ids, np.ones_like(ids))[0]
    right = outs["right"][row, :n]
    left = outs["left"][row, max(LENGTHS) - n:]
    assert np.abs(alone - right).max() < ATOL and np.abs(alone - left).max() < ATOL
    for side, mask in (("right", batches["right"][1]), ("left", batches["left"][1])):
      pooled = np.asarray(decoder.last_token_pool(jnp.asarray(outs[side]), jnp.asarray(mask)))[row]
      assert np.abs(pooled - alone[-1]).max() < ATOL


def test_fused_attention_and_remat_compute_the_same(tiny):
  _, _, _, cfg, params = tiny
  for side in ("right", "left"):
    ids, mask = batch(side)
    ref = encode(cfg, params, ids, mask)
    for changes in (dict(attention="einsum"), dict(attention="fused"), dict(remat=True)):
      out = encode(cfg.replace(**changes), params, ids, mask)
      # Padding positions too: a NaN there would reach real tokens through their zero attention weights.
      assert np.isfinite(out).all(), changes
      # Float32 rounding apart (a few ulps of outputs near 3): on a CPU the einsum attention normalizes its
      # weights after their product with the values, the fused one before.
      assert token_diff(out, ref, mask) < 2e-6, changes


def test_the_cases_exercise_what_they_claim(tiny):
  case, _, _, cfg, params = tiny
  ids, mask = batch("left")
  if case in ("mistral", "qwen2-window"):  # the window is shorter than the texts: without it, other vectors
    assert cfg.sliding_window == 3 and cfg.max_window_layers == (1 if case == "qwen2-window" else 0)
    assert token_diff(encode(cfg.replace(sliding_window=None, max_window_layers=0), params, ids, mask),
                      encode(cfg, params, ids, mask), mask) > 1e-3
  if case == "llama3-rope":  # the highest frequency kept, the next smoothed, the two lowest divided by 8
    plain = decoder.rope_frequencies(cfg.replace(rope_type="default"))
    ratio = plain / decoder.rope_frequencies(cfg)
    np.testing.assert_allclose(ratio[[0, 2, 3]], [1.0, 8.0, 8.0], rtol=1e-6)
    assert 1.0 < ratio[1] < 8.0
  assert (cfg.num_kv_heads, cfg.num_heads) == (2, 4)


def test_jitted_gradients_with_and_without_remat_agree(tiny):
  _, _, _, cfg, params = tiny
  ids, mask = batch("right")

  def loss(p, c):
    hidden = DecoderEncoder(c).apply({"params": p}, ids, mask, deterministic=False,
                                     rngs={"dropout": jax.random.key(0)})
    return jnp.sum(decoder.last_token_pool(hidden, jnp.asarray(mask)) ** 2)

  grads = [jax.jit(jax.grad(loss), static_argnums=1)(params, cfg.replace(remat=remat)) for remat in (False, True)]
  # Recomputed activations are the same math in another XLA fusion; float32 sums may round differently.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), *grads)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads[0]))


# ---------------------------------------------------------------------------------------------- checkpoints


def test_sharded_checkpoint_reads_the_same(tiny, tmp_path):
  _, model, path, cfg, params = tiny
  model.save_pretrained(tmp_path, max_shard_size="20KB")
  assert (tmp_path / "model.safetensors.index.json").exists()
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
  sharded = hf.read_state_dict(tmp_path)
  assert sharded.keys() == hf.read_state_dict(path).keys()
  got = decoder.params_from_state_dict(cfg, sharded)
  jax.tree.map(np.testing.assert_array_equal, got, params)


def test_params_back_to_transformers_names_exactly(tiny):
  _, model, path, cfg, params = tiny
  tensors = hf.read_state_dict(path)
  back = decoder.state_dict_from_params(cfg, params)
  assert back.keys() == tensors.keys() == {e.hf_name for e in decoder.hf_table(cfg)}
  for name, value in tensors.items():
    assert back[name].shape == value.shape and np.array_equal(back[name], value), name
  # The table's shapes are the module's: a freshly initialised encoder has the same tree.
  init = DecoderEncoder(cfg).init(jax.random.key(0), np.zeros((1, 4), np.int32), np.ones((1, 4), np.int32))
  assert jax.tree.map(np.shape, nn.unbox(init["params"])) == jax.tree.map(np.shape, params)


def test_export_loads_in_transformers_with_equal_hidden_states(tiny, tmp_path):
  from safetensors.numpy import save_file
  _, model, _, cfg, params = tiny
  (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
  save_file(decoder.state_dict_from_params(cfg, params), str(tmp_path / "model.safetensors"),
            metadata={"format": "pt"})
  loaded, info = transformers.AutoModel.from_pretrained(tmp_path, output_loading_info=True,
                                                        attn_implementation="eager")
  assert type(loaded) is type(model)
  assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
  assert DecoderConfig.from_hf(cfg.to_hf()) == cfg
  assert DecoderConfig.from_hf(loaded.config.to_dict()) == cfg
  for side in ("right", "left"):
    ids, mask = batch(side, seed=1)
    assert token_diff(torch_hidden(loaded.eval(), ids, mask), encode(cfg, params, ids, mask), mask) < ATOL


@pytest.mark.parametrize("case", ["llama3-rope", "qwen2", "qwen3"])
def test_bfloat16_checkpoint_stays_bfloat16(case, tmp_path):
  model = torch_model(case).to(torch.bfloat16)
  model.save_pretrained(tmp_path)
  tensors = hf.read_state_dict(tmp_path)
  assert {v.dtype for v in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
  cfg = DecoderConfig.from_hf(json.loads((tmp_path / "config.json").read_text()), param_dtype="bfloat16")
  params = decoder.params_from_state_dict(cfg, tensors)
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {np.dtype(ml_dtypes.bfloat16)}
  back = decoder.state_dict_from_params(cfg, params, dtype=ml_dtypes.bfloat16)
  assert all(np.array_equal(back[k].view(np.uint16), v.view(np.uint16)) for k, v in tensors.items())
  init = DecoderEncoder(cfg).init(jax.random.key(0), np.zeros((1, 4), np.int32), np.ones((1, 4), np.int32))
  assert {leaf.dtype for leaf in jax.tree.leaves(nn.unbox(init))} == {jnp.dtype(jnp.bfloat16)}
  # bfloat16 weights computed in float32: transformers' float32 model of the same (bfloat16-rounded) weights,
  # loaded afresh (model.to(bfloat16) also rounded its rotary frequencies, a buffer).
  reference = transformers.AutoModel.from_pretrained(tmp_path, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
  float32 = DecoderConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
  as_float32 = decoder.params_from_state_dict(float32, tensors)
  for side in ("right", "left"):
    ids, mask = batch(side)
    ref = torch_hidden(reference, ids, mask)
    assert token_diff(encode(cfg, params, ids, mask), ref, mask) < ATOL
    assert token_diff(encode(float32, as_float32, ids, mask), ref, mask) < ATOL
    # bfloat16 compute: same vectors to bfloat16's precision, and serving_params changes nothing.
    half = cfg.replace(dtype="bfloat16")
    out = encode(half, params, ids, mask)
    assert out.dtype == np.float32
    print(f"\n{case:12s} {side:5s} padding, bfloat16 compute: max abs diff {token_diff(out, ref, mask):.2e}")
    assert token_diff(out, ref, mask) < 0.1
    assert np.array_equal(encode(half, decoder.serving_params(params, half), ids, mask), out)
    half32 = float32.replace(dtype="bfloat16")
    assert np.array_equal(encode(half32, decoder.serving_params(as_float32, half32), ids, mask),
                          encode(half32, as_float32, ids, mask))


@pytest.mark.parametrize("case,tied", [("llama", False), ("qwen3", True)])
def test_causal_lm_checkpoint_reads_its_base_model(case, tied, tmp_path):
  config = hf_config(case, tie_word_embeddings=tied)
  config._attn_implementation = "eager"
  lm = perturbed(transformers.AutoModelForCausalLM.from_config(config))
  lm.save_pretrained(tmp_path)
  tensors = hf.read_state_dict(tmp_path)
  assert all(name.startswith(("model.", "lm_head.")) for name in tensors)
  assert ("lm_head.weight" in tensors) != tied  # a tied head is not saved
  cfg = DecoderConfig.from_hf(json.loads((tmp_path / "config.json").read_text()))
  assert cfg.tie_word_embeddings == tied and cfg.to_hf()["tie_word_embeddings"] == tied
  params = decoder.params_from_state_dict(cfg, tensors)
  ids, mask = batch("left")
  assert token_diff(encode(cfg, params, ids, mask), torch_hidden(lm.model, ids, mask), mask) < ATOL


# ---------------------------------------------------------------------------------------------- errors


def test_weights_that_do_not_fit_are_all_listed(tiny):
  _, _, path, cfg, _ = tiny
  tensors = dict(hf.read_state_dict(path))
  del tensors["layers.0.mlp.up_proj.weight"]
  tensors["layers.0.self_attn.extra.weight"] = np.zeros(3, np.float32)
  tensors["norm.weight"] = np.zeros(5, np.float32)
  with pytest.raises(hf.HFWeightsError) as err:
    decoder.params_from_state_dict(cfg, tensors, "ckpt")
  assert err.value.missing == ["layers.0.mlp.up_proj.weight"]
  assert err.value.unexpected == ["layers.0.self_attn.extra.weight"]
  assert err.value.mismatched == [("norm.weight", (5,), (cfg.hidden_size,))]


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn", "longrope"])
def test_unsupported_rope_types_are_refused_by_name(rope_type):
  config = hf_config("llama").to_dict()
  config["rope_parameters"] = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
  with pytest.raises(ValueError, match=rope_type):
    DecoderConfig.from_hf(config)
  with pytest.raises(ValueError, match=rope_type):
    DecoderConfig(model_type="llama", rope_type=rope_type)


def test_older_rope_scaling_keys_read_the_same():
  old = {**TINY, "model_type": "llama", "num_hidden_layers": 2, "rope_theta": 500000.0,
         "rope_scaling": {"type": "linear", "factor": 4.0}}
  cfg = DecoderConfig.from_hf(old)
  assert (cfg.rope_type, cfg.rope_theta, cfg.rope_factor) == ("linear", 500000.0, 4.0)
  model = transformers.AutoModel.from_config(transformers.LlamaConfig(**{k: v for k, v in old.items()
                                                                         if k != "model_type"}))
  np.testing.assert_allclose(decoder.rope_frequencies(cfg), model.rotary_emb.inv_freq.numpy(), rtol=1e-6)


def test_what_a_decoder_cannot_do_is_refused(tiny):
  _, _, _, cfg, params = tiny
  ids, mask = batch("right")
  with pytest.raises(ValueError, match="BERT-family"):
    encode(cfg, params, ids, mask, first_token_attention=True)
  with pytest.raises(ValueError, match="BERT-family"):
    DecoderEncoder(cfg).apply({"params": params}, None, None, method="last_block_tail")
  with pytest.raises(ValueError, match="causal"):
    cfg.replace(attention="flash")
  with pytest.raises(ValueError, match="model_type"):
    DecoderConfig.from_hf({"model_type": "gpt2"})


# ---------------------------------------------------------------------------------------------- config, axes


def test_saved_description_round_trips(tiny):
  _, _, _, cfg, _ = tiny
  cfg = cfg.replace(eos_token_id=(2, 7), dtype="bfloat16", remat=True, attention="einsum")
  saved = json.loads(json.dumps(dataclasses.asdict(cfg)))
  assert DecoderConfig.from_saved(saved) == cfg.replace(attention="auto")
  assert cfg.layer_norm_eps == cfg.rms_norm_eps and cfg.max_length == cfg.max_position_embeddings
  assert cfg.compute_dtype == jnp.bfloat16
  hash(cfg)  # a static argument of jitted functions


def test_logical_axes_shard_with_the_existing_rules(tiny):
  _, _, _, cfg, _ = tiny
  boxed = jax.eval_shape(lambda: DecoderEncoder(cfg).init(
      jax.random.key(0), jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)))["params"]
  names = jax.tree.map(lambda b: b.names, boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
  layer = names["layer_0"]
  assert names["embeddings"]["word_embeddings"] == ("vocab", "embed")
  assert layer["q_proj"]["kernel"] == layer["k_proj"]["kernel"] == ("embed", "heads", "kv")
  assert layer["o_proj"]["kernel"] == ("heads", "kv", "embed")
  assert layer["gate_proj"]["kernel"] == ("embed", "mlp") and layer["down_proj"]["kernel"] == ("mlp", "embed")
  used = {axis for leaf in jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple)) for axis in leaf}
  assert used <= {"vocab", "embed", "mlp", "heads", "kv"}
  mesh = parallel.make_mesh((1, 1, 1), jax.devices()[:1])
  for preset in parallel.RULES:
    parallel.tree_shardings(boxed, mesh, parallel.rules_for(preset))


def test_dropout_trains_and_stays_off_when_deterministic(tiny):
  _, _, _, cfg, params = tiny
  ids, mask = batch("left")
  noisy = cfg.replace(hidden_dropout=0.1, attention_dropout=0.1)
  ref = encode(cfg, params, ids, mask)
  assert token_diff(encode(noisy, params, ids, mask), ref, mask) < 1e-6
  out = DecoderEncoder(noisy).apply({"params": params}, ids, mask, deterministic=False,
                                    rngs={"dropout": jax.random.key(1)})
  assert np.isfinite(np.asarray(out)).all() and token_diff(out, ref, mask) > 1e-3
