"""LoRA on decoder towers: an untrained adapter is the base model, merging is exact, and a train step moves
the adapters only, with optimizer moments for them alone; remat and gradient caching give the same step."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from jdr.models import decoder
from jdr.models.towers import TowerConfig, TwoTower
from jdr.runtime import defaults
from jdr.training import gradcache
from jdr.training import optimizers
from jdr.training import step as step_lib

CFG = decoder.DecoderConfig(vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=48, lora_rank=4, lora_alpha=8.0)
IDS = jnp.array([[1, 5, 7, 9, 0, 0], [3, 4, 5, 6, 8, 2]])
MASK = jnp.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])


def without_adapters(params):
  return {name: ({proj: {k: v for k, v in sub.items() if k not in decoder.LORA_PARAMS}
                  for proj, sub in layer.items()} if name.startswith("layer_") else layer)
          for name, layer in params.items()}


def random_adapters(params, seed=1):
  """params with every lora_b drawn at random (training's zero start would hide the adapters)."""
  key = jax.random.PRNGKey(seed)
  out = jax.tree.map(lambda x: x, params)
  for name, layer in out.items():
    if name.startswith("layer_"):
      for sub in layer.values():
        if "lora_b" in sub:
          key, k = jax.random.split(key)
          sub["lora_b"] = 0.1 * jax.random.normal(k, sub["lora_b"].shape)
  return out


@pytest.fixture(scope="module")
def params():
  return nn.unbox(decoder.DecoderEncoder(CFG).init(jax.random.PRNGKey(0), IDS, MASK)["params"])


def test_adapters_sit_on_the_targets_only(params):
  layer = params["layer_0"]
  assert layer["o_proj"]["lora_a"].shape == (4, 8, 4) and layer["o_proj"]["lora_b"].shape == (4, 32)
  assert layer["q_proj"]["lora_a"].shape == (32, 4) and layer["q_proj"]["lora_b"].shape == (4, 4, 8)
  only_qv = decoder.DecoderEncoder(CFG.replace(lora_targets="q_proj,v_proj"))
  layer = nn.unbox(only_qv.init(jax.random.PRNGKey(0), IDS, MASK)["params"])["layer_0"]
  assert {p for p, sub in layer.items() if "lora_a" in sub} == {"q_proj", "v_proj"}
  assert all(np.all(np.asarray(sub["lora_b"]) == 0) for sub in layer.values() if "lora_b" in sub)


def test_zero_adapters_are_the_dense_model(params):
  got = decoder.DecoderEncoder(CFG).apply({"params": params}, IDS, MASK)
  want = decoder.DecoderEncoder(CFG.replace(lora_rank=0)).apply({"params": without_adapters(params)}, IDS, MASK)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_merged_equals_adapters(params):
  trained = random_adapters(params)
  got = decoder.DecoderEncoder(CFG).apply({"params": trained}, IDS, MASK)
  merged, cfg = decoder.merged(jax.tree.map(np.asarray, trained), CFG)
  assert cfg.lora_rank == 0 and "lora_a" not in merged["layer_1"]["down_proj"]
  want = decoder.DecoderEncoder(cfg).apply({"params": merged}, IDS, MASK)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
  dense = decoder.DecoderEncoder(cfg).apply({"params": without_adapters(params)}, IDS, MASK)
  assert np.max(np.abs(np.asarray(got) - np.asarray(dense))) > 1e-2  # the adapters do change the model


def test_adapter_is_the_papers_low_rank_update(params):
  """x W + (alpha / r) x A B, float64, for one projection (Hu et al. 2022's h = W0 x + B A x, scaled)."""
  trained = random_adapters(params)
  sub = trained["layer_0"]["gate_proj"]
  dense = decoder.Dense(CFG, 48, ("embed", "mlp"), name="gate_proj")
  x = jax.random.normal(jax.random.PRNGKey(3), (5, 32))
  got = dense.apply({"params": sub}, x)
  w, a, b = (np.asarray(sub[k], np.float64) for k in ("kernel", "lora_a", "lora_b"))
  want = np.asarray(x, np.float64) @ w + (CFG.lora_alpha / CFG.lora_rank) * (np.asarray(x, np.float64) @ a @ b)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)


def test_bad_settings_are_refused():
  with pytest.raises(ValueError, match="lora_targets"):
    CFG.replace(lora_targets="q_proj,attn")
  with pytest.raises(ValueError, match="lora_dropout"):
    CFG.replace(lora_dropout=1.0)


def two_tower_config(**model):
  c = defaults.get_config()
  c.model.lora_rank = 4
  c.model.lora_alpha = 8.0
  c.model.lora_dropout = 0.1
  c.data.query_max_length, c.data.doc_max_length = 6, 6
  c.batch_size = 2
  c.negatives.in_batch = True
  c.optimizer.learning_rate = 1e-2
  c.optimizer.warmup_steps = 0
  c.num_train_steps = 10
  for k, v in model.items():
    c.model[k] = v
  return c


def make(config, remat=False):
  enc = CFG.replace(lora_dropout=config.model.lora_dropout, remat=remat)
  tower = TowerConfig(encoder=enc, pooling="last", normalize=True, projection_dim=8)
  model = TwoTower(query=tower, doc=tower, shared=True)
  tx = optimizers.make_optimizer(config.optimizer, config.num_train_steps, "both", lora=True)
  params = nn.unbox(model.init(jax.random.PRNGKey(0), IDS, MASK, IDS, MASK)["params"])
  params = {"tower": {**params["tower"], "encoder": random_adapters(params["tower"]["encoder"])}}
  state = step_lib.TrainState(step=jnp.int32(0), params=params, opt_state=tx.init(params),
                              rng=jax.random.PRNGKey(1))
  batch = {"query_ids": IDS, "query_mask": MASK, "doc_ids": IDS[::-1], "doc_mask": MASK[::-1],
           "valid": jnp.ones((2, 2), bool)}
  return model, tx, state, batch


def leaves_by_label(tree, labels):
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  label_of = dict(jax.tree_util.tree_flatten_with_path(labels)[0])
  return {lab: [p for p, _ in flat if label_of[p] == lab] for lab in ("train", "freeze")}


def test_step_moves_adapters_and_head_only():
  config = two_tower_config()
  model, tx, state, batch = make(config)
  step = jax.jit(step_lib.make_train_step(model, tx, config))
  new, metrics = step(state, batch)
  new, metrics = step(new, batch)
  assert np.isfinite(float(metrics["loss"]))
  labels = optimizers.trainable_labels(state.params, "both", lora=True)
  before = dict(jax.tree_util.tree_flatten_with_path(state.params)[0])
  after = dict(jax.tree_util.tree_flatten_with_path(new.params)[0])
  groups = leaves_by_label(state.params, labels)
  assert groups["train"] and groups["freeze"]
  for path in groups["freeze"]:
    np.testing.assert_array_equal(np.asarray(after[path]), np.asarray(before[path]), err_msg=str(path))
  moved = [p for p in groups["train"] if not np.array_equal(np.asarray(after[p]), np.asarray(before[p]))]
  assert len(moved) == len(groups["train"])  # every adapter and the head
  names = {str(k.key) for p in groups["train"] for k in p if hasattr(k, "key")}
  assert "kernel" in names and "lora_a" in names  # the head's kernel, the adapters
  assert all("projection" in str(p) or "lora_" in str(p) for p in groups["train"])


def test_frozen_base_gets_no_optimizer_moments():
  config = two_tower_config()
  _, tx, state, _ = make(config)
  moments = sum(x.size for x in jax.tree.leaves(state.opt_state) if hasattr(x, "size"))
  trained = sum(x.size for x, lab in zip(jax.tree.leaves(state.params),
                                          jax.tree.leaves(optimizers.trainable_labels(state.params, "both", True)))
                if lab == "train")
  total = sum(x.size for x in jax.tree.leaves(state.params))
  assert trained < total / 2
  assert moments <= 2 * trained + 8  # Adam's mu and nu of the trained leaves, plus counters


def test_frozen_params_get_no_gradient():
  config = two_tower_config()
  model, _, state, batch = make(config)
  score = step_lib.tokens_scorer(model, config)
  trained, frozen = optimizers.split_frozen(state.params, "both", True)
  grads = jax.grad(lambda p: score(gradcache.merged(p, frozen), batch, step_lib.step_rngs(state))[0])(trained)
  assert grads["tower"]["encoder"]["layer_0"]["q_proj"]["kernel"] is None  # never differentiated
  grads = optimizers.with_zero_gradients(grads, frozen)
  kernel = grads["tower"]["encoder"]["layer_0"]["q_proj"]["kernel"]
  assert not np.any(np.asarray(kernel))
  assert np.any(np.asarray(grads["tower"]["encoder"]["layer_0"]["q_proj"]["lora_b"]))


@pytest.mark.parametrize("variant", ["remat", "grad_cache"])
def test_remat_and_grad_cache_give_the_same_step(variant):
  config = two_tower_config(lora_dropout=0.0, dropout=0.0)
  model, tx, state, batch = make(config)
  want, _ = jax.jit(step_lib.make_train_step(model, tx, config))(state, batch)
  if variant == "remat":
    model, tx, state, batch = make(config, remat=True)
  else:
    config.grad_cache.chunk_size = 1
  got, _ = jax.jit(step_lib.make_train_step(model, tx, config))(state, batch)
  for g, w in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5)


@pytest.mark.long
def test_sharded_lora_runs_equal_one_device(tmp_path):
  """A tiny Llama with LoRA, 6 steps through jdr.train on 8 simulated CPU devices (data parallel, fully sharded,
  tensor parallel) matches the 1-device run, and its frozen base stays exactly as it started."""
  import json, os, pathlib, subprocess, sys, textwrap  # pylint: disable=g-import-not-at-top,multiple-imports
  from conftest import cpu_devices_env, write_tiny_beir  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(__file__).resolve().parents[1]
  data = write_tiny_beir(tmp_path / "data")
  overrides = ["model.init_from=", "model.fresh=llama-tiny", "model.pooling=last", "model.lora_rank=4",
               "model.lora_alpha=8.0", "model.lora_dropout=0.1", "model.dropout=0.0", "optimizer.learning_rate=1e-3",
               "optimizer.warmup_steps=0", "optimizer.eps=1e-4", "batch_size=8", "log_every=1", "data.query_max_length=16",
               "data.doc_max_length=32", f"data.dataset={data}", "data.eval_split=", "num_train_steps=6",
               "checkpoint_every=100"]
  script = textwrap.dedent(f"""
      import json, numpy as np, jax
      from jdr.training import trainer
      from jdr.runtime import config_files
      runs = {{"single": ["mesh.shape=(1,1,1)"], "data_parallel": ["mesh.shape=(8,1,1)", "mesh.rules=dp"],
               "fully_sharded": ["mesh.shape=(2,4,1)", "mesh.rules=fsdp"],
               "tensor_parallel": ["mesh.shape=(4,1,2)", "mesh.rules=tp"],
               "single_grad_cache": ["mesh.shape=(1,1,1)", "grad_cache.chunk_size=4"],
               "fully_sharded_grad_cache": ["mesh.shape=(2,4,1)", "mesh.rules=fsdp", "grad_cache.chunk_size=8"]}}
      for name, extra in runs.items():
        config = config_files.load_config_file("{root / 'configs' / 'demo.py'}")
        config_files.apply_overrides(config, {overrides!r} + extra)
        state = trainer.train_and_evaluate(config, "{tmp_path}/" + name)["state"]
        flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
        np.savez("{tmp_path}/" + name + ".npz", **{{jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}})
  """)
  env = cpu_devices_env(8)
  env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900,
                        cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-4000:]
  losses = lambda name: [r["train/loss"] for r in map(json.loads, (tmp_path / name / "metrics.jsonl")
                                                      .read_text().splitlines()) if "train/loss" in r]
  single = np.load(tmp_path / "single.npz")
  assert len(losses("single")) == 6
  adapters = [k for k in single.files if "lora_b" in k]
  assert adapters and all(np.any(single[k]) for k in adapters)  # the adapters trained away from zero
  # Adam's eps above the default: an adapter gradient near 0 would otherwise turn summation-order noise between
  # the meshes into whole steps of either sign (m / sqrt(v) is +-1 for any tiny gradient).
  # Gradient caching draws its dropout per row (jdr.training.gradcache), so it is compared with its own single
  # device run; under fsdp its chunk loops stay XLA-partitioned (no device holds the whole base). Data-parallel
  # gradient caching is not run again here: tests/test_pretrain_train.py and tests/test_gradcache.py shard it.
  for name, reference in (("data_parallel", "single"), ("fully_sharded", "single"), ("tensor_parallel", "single"),
                          ("fully_sharded_grad_cache", "single_grad_cache")):
    sharded, want = np.load(tmp_path / f"{name}.npz"), np.load(tmp_path / f"{reference}.npz")
    np.testing.assert_allclose(losses(name), losses(reference), rtol=3e-5, atol=1e-5, err_msg=name)
    for key in want.files:
      np.testing.assert_allclose(sharded[key], want[key], rtol=1e-4, atol=2e-5, err_msg=f"{name} {key}")


def test_peft_loads_the_adapters_and_transformers_the_merged_model(params, tmp_path):
  """The adapters written in PEFT's layout load onto transformers' LlamaModel of the base weights and give jdr's
  hidden states; the merged weights load as a plain LlamaModel and give them too."""
  import json  # pylint: disable=g-import-not-at-top
  peft = pytest.importorskip("peft")
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  trained = jax.tree.map(np.asarray, random_adapters(params))
  want = np.asarray(decoder.DecoderEncoder(CFG).apply({"params": trained}, IDS, MASK))
  base = CFG.replace(lora_rank=0)
  hf_config = transformers.LlamaConfig(**{k: v for k, v in base.to_hf().items() if k != "architectures"})
  mask = torch.tensor(np.asarray(MASK))
  position_ids = torch.clamp(mask.cumsum(-1) - 1, min=0)

  def hidden(model):
    with torch.no_grad():
      out = model(input_ids=torch.tensor(np.asarray(IDS)), attention_mask=mask, position_ids=position_ids)
    return out.last_hidden_state.numpy()

  def load(state):
    model = transformers.LlamaModel(hf_config).eval()
    missing, unexpected = model.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model

  merged = load(decoder.state_dict_from_params(CFG, trained))
  real = np.asarray(MASK, bool)
  np.testing.assert_allclose(hidden(merged)[real], want[real], atol=1e-5)
  adapter_dir = tmp_path / "adapter"
  adapter_dir.mkdir()
  (adapter_dir / "adapter_config.json").write_text(json.dumps(decoder.peft_config(CFG, str(tmp_path / "base"))))
  save_file(decoder.peft_state_dict(trained, CFG), str(adapter_dir / "adapter_model.safetensors"))
  plain = load(decoder.state_dict_from_params(base, without_adapters(trained)))
  with_adapters = peft.PeftModel.from_pretrained(plain, str(adapter_dir)).eval()
  np.testing.assert_allclose(hidden(with_adapters)[real], want[real], atol=1e-5)


def test_param_dtype_keeps_a_frozen_base_in_bfloat16(tmp_path):
  """model.param_dtype=auto: a base LoRA freezes is stored bfloat16 when the run computes in bfloat16 (a fresh
  decoder, and a float32 Hugging Face checkpoint read straight into it); adapters stay float32; a trained
  decoder, or a float32 run, stays float32; bfloat16 asked of a BERT-family tower is refused."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  hf_cfg = transformers.LlamaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=48)
  transformers.LlamaModel(hf_cfg).save_pretrained(tmp_path / "llama")

  def stored(init_from="", **model):
    c = two_tower_config(init_from=init_from, fresh="llama-tiny", tokenizer=str(build_lib.hf.minilm_path()),
                         **model)
    built = build_lib.build(c.model, c.data)
    params = trainer.initial_params(built.model, built, c, jax.random.PRNGKey(0), None)
    q_proj = params["tower"]["encoder"]["layer_0"]["q_proj"]
    return built.model.query.encoder.param_dtype, q_proj["kernel"].dtype, q_proj.get("lora_a", q_proj["kernel"]).dtype

  bf16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
  assert stored(dtype="bfloat16") == ("bfloat16", bf16, f32)
  assert stored(str(tmp_path / "llama"), dtype="bfloat16") == ("bfloat16", bf16, f32)
  assert stored(dtype="float32") == ("float32", f32, f32)
  assert stored(dtype="bfloat16", lora_rank=0) == ("float32", f32, f32)
  assert stored(dtype="float32", param_dtype="bfloat16") == ("bfloat16", bf16, f32)
  with pytest.raises(ValueError, match="param_dtype=bfloat16 stores a decoder tower's weights"):
    c = two_tower_config(init_from="", fresh="tiny", lora_rank=0, param_dtype="bfloat16")
    build_lib.build(c.model, c.data)
  with pytest.raises(ValueError, match="param_dtype must be"):
    c = two_tower_config(init_from="", fresh="llama-tiny", param_dtype="float16")
    build_lib.build(c.model, c.data)


@pytest.mark.slow
def test_a_jdr_model_restarted_with_other_adapters_starts_from_its_merged_weights(tmp_path):
  """A LoRA run's workdir as model.init_from of a run with another rank: the saved adapters are folded into the
  kernels (the merged model, to float32 rounding) and the new run's adapters start fresh; the same when the
  shared tower is split into two (model.shared=False)."""
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  from jdr.models import build as build_lib  # pylint: disable=g-import-not-at-top
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data")
  config = defaults.get_config()
  config_files.apply_overrides(config, [
      "model.init_from=", "model.fresh=llama-tiny", "model.lora_rank=4", "model.lora_alpha=8.0",
      "model.dropout=0.0", "optimizer.learning_rate=1e-2", "optimizer.warmup_steps=0", "batch_size=4",
      "data.query_max_length=8", "data.doc_max_length=16", f"data.dataset={data}", "data.eval_split=",
      "num_train_steps=3", "eval_before_training=False"])
  trainer.train_and_evaluate(config, tmp_path / "lora4")
  model, params, _, _ = build_lib.load_jdr_model(tmp_path / "lora4")
  want, _ = decoder.merged(jax.tree.map(np.asarray, params["tower"]["encoder"]), model.query.encoder)
  assert np.any(np.asarray(params["tower"]["encoder"]["layer_0"]["q_proj"]["lora_b"]))  # it did train
  for shared in (True, False):
    config.model.init_from, config.model.lora_rank, config.model.shared = str(tmp_path / "lora4"), 8, shared
    built = build_lib.build(config.model, config.data)
    assert built.params is None and set(built.tower_params) == {"query", "doc"}
    for side in ("query", "doc"):
      got = built.tower_params[side]["encoder"]
      assert "lora_a" not in got["layer_0"]["q_proj"]
      for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6)
    fresh = trainer.initial_params(built.model, built, config, jax.random.PRNGKey(0), None)
    tower = fresh["tower"] if shared else fresh["query_tower"]
    assert tower["encoder"]["layer_0"]["q_proj"]["lora_a"].shape[-1] == 8
    assert not np.any(np.asarray(tower["encoder"]["layer_0"]["q_proj"]["lora_b"]))
