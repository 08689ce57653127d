"""The optimizer a config builds: schedule shape, what weight decay touches, AdamW and LAMB.

The LAMB tests hold `lamb` to a float64 numpy transcription of the authors' rule (`authors_lamb`), written
from the rules that jdr/training/optimizers.py's docstring quotes from DRhard's / ANCE's lamb.py, not from jdr's code.
"""

import math
import pathlib
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from conftest import run_on_cpu_devices
from jdr.training import optimizers


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


@pytest.mark.parametrize("name", ["adamw", "lamb", "optax_lamb"])
def test_zero_gradient_update_is_pure_weight_decay(name):
  """With zero gradients only decoupled weight decay moves the weights, and only the decayed ones."""
  params = {"kernel": jnp.full((2, 2), 2.0), "bias": jnp.full((2,), 2.0)}
  tx = optimizers.make_optimizer(_cfg(name, warmup_steps=0), total_steps=100)
  state = tx.init(params)
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), state, params)
  assert np.all(np.asarray(updates["bias"]) == 0)
  assert np.all(np.asarray(updates["kernel"]) < 0)


def test_unknown_optimizer_is_an_error():
  with pytest.raises(ValueError, match="one of 'adamw', 'lamb', 'optax_lamb', got 'sgd'"):
    optimizers.make_optimizer(_cfg("sgd"), total_steps=10)


def test_query_only_training_needs_separate_towers():
  with pytest.raises(ValueError, match="separate towers"):
    optimizers.trainable_labels({"tower": {"w": jnp.ones(2)}}, "query")
  labels = optimizers.trainable_labels({"query_tower": {"w": jnp.ones(2)}, "doc_tower": {"w": jnp.ones(2)}},
                                       "query")
  assert labels == {"query_tower": {"w": "train"}, "doc_tower": {"w": "freeze"}}


# ------------------------------------------------------------------------------------------------ LAMB


def authors_lamb(params, grads, lrs, *, b1, b2, eps, weight_decay, decayed, max_weight_norm=10.0,
                 debias=False, clip_norm=0.0):
  """float64 oracle, per tensor: m, v moving averages (not debiased); step = m / (sqrt(v) + eps), plus
  weight_decay * w on decayed tensors; ratio = min(||w||, 10) / ||step||, 1 if either norm is 0;
  w -= lr * ratio * step. `clip_norm` clips the gradients' global norm first; `max_weight_norm=inf` and
  `debias=True` are the variants that the tests show `lamb` is not. Returns the weights after each step."""
  w = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in w.items()}
  v = {k: np.zeros_like(x) for k, x in w.items()}
  history = []
  for t, (g, lr) in enumerate(zip(grads, lrs), start=1):
    g = {k: np.asarray(x, np.float64) for k, x in g.items()}
    if clip_norm:
      total = np.sqrt(sum(np.sum(x ** 2) for x in g.values()))
      g = {k: x * min(1.0, clip_norm / total) for k, x in g.items()}
    for k in w:
      m[k] = b1 * m[k] + (1 - b1) * g[k]
      v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
      m_used, v_used = (m[k] / (1 - b1 ** t), v[k] / (1 - b2 ** t)) if debias else (m[k], v[k])
      step = m_used / (np.sqrt(v_used) + eps)
      if decayed[k]:
        step = step + weight_decay * w[k]
      weight_norm, step_norm = min(np.linalg.norm(w[k]), max_weight_norm), np.linalg.norm(step)
      ratio = 1.0 if weight_norm == 0 or step_norm == 0 else weight_norm / step_norm
      w[k] = w[k] - lr * ratio * step
    history.append({k: x.copy() for k, x in w.items()})
  return history


def warmup_then_decay(peak, warmup, total, steps):
  """The learning rate of each of the first `steps` updates (update t uses the schedule at t)."""
  return [peak * t / warmup if t < warmup else peak * (total - t) / (total - warmup) for t in range(steps)]


def lamb_params(seed=0):
  """A matrix of norm well above 10 (the clamp binds), one well below, and biases either side of 10."""
  rng = np.random.default_rng(seed)
  params = {"big": rng.normal(0, 3.0, (8, 6)), "small": rng.normal(0, 0.1, (5, 4)),
            "bias": rng.normal(0, 0.1, (6,)), "big_bias": rng.normal(0, 6.0, (6,))}
  assert np.linalg.norm(params["big"]) > 15 and np.linalg.norm(params["small"]) < 2
  assert np.linalg.norm(params["bias"]) < 2 and np.linalg.norm(params["big_bias"]) > 12
  return {k: v.astype(np.float32) for k, v in params.items()}


def run_jdr(tx, params, grads):
  """The weights after each step of `tx` (jitted, as the trainer runs it)."""
  @jax.jit
  def update(p, state, g):
    updates, state = tx.update(g, state, p)
    return optax.apply_updates(p, updates), state

  p, state, history = jax.tree.map(jnp.asarray, params), tx.init(params), []
  for g in grads:
    p, state = update(p, state, jax.tree.map(jnp.asarray, g))
    history.append(jax.tree.map(np.asarray, p))
  return history


def assert_close(ours, oracle, rtol=2e-5, atol=1e-6):
  for step, (a, b) in enumerate(zip(ours, oracle)):
    for k in b:
      np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=atol, err_msg=f"step {step + 1}, {k}")


def max_gap(a, b, key):
  return max(np.max(np.abs(x[key] - y[key])) for x, y in zip(a, b))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("grad_scale", [1.0, 1e-6])
def test_lamb_is_the_authors_rule(weight_decay, grad_scale):
  """Six steps through make_optimizer's schedule against the oracle. Gradients near eps (grad_scale 1e-6,
  eps 1e-6) make eps's place and the missing debiasing show even without weight decay."""
  steps, peak, warmup, total = 6, 0.05, 3, 10
  params = lamb_params()
  rng = np.random.default_rng(1)
  grads = [{k: (grad_scale * rng.normal(size=v.shape)).astype(np.float32) for k, v in params.items()}
           for _ in range(steps)]
  cfg = _cfg("lamb", learning_rate=peak, warmup_steps=warmup, weight_decay=weight_decay, eps=1e-6,
             grad_clip_norm=0.0)
  ours = run_jdr(optimizers.make_optimizer(cfg, total_steps=total), params, grads)
  hyper = dict(b1=0.9, b2=0.999, eps=1e-6, weight_decay=weight_decay,
               decayed={"big": True, "small": True, "bias": False, "big_bias": False})
  lrs = warmup_then_decay(peak, warmup, total, steps)
  oracle = authors_lamb(params, grads, lrs, **hyper)
  assert_close(ours, oracle)
  # The data exercise each rule: without the clamp the big tensors (only they) would move further, and
  # debiased moments would move the weights elsewhere.
  unclamped = authors_lamb(params, grads, lrs, **hyper, max_weight_norm=np.inf)
  for k in ("big", "big_bias"):
    assert max_gap(unclamped, oracle, k) > 1e-3, k
  for k in ("small", "bias"):
    assert max_gap(unclamped, oracle, k) == 0, k
  if weight_decay or grad_scale < 1:
    assert max_gap(authors_lamb(params, grads, lrs, **hyper, debias=True), oracle, "small") > 1e-4


def test_lamb_steps_where_a_norm_is_zero():
  """A zero weight takes the plain Adam step (ratio 1); a zero gradient with no decay leaves a weight as it
  is; nothing becomes NaN."""
  params = {"zero_matrix": np.zeros((3, 4), np.float32), "zero_bias": np.zeros((4,), np.float32),
            "still": np.full((4,), 2.0, np.float32)}
  grads = [{"zero_matrix": np.full((3, 4), g, np.float32), "zero_bias": np.zeros((4,), np.float32),
            "still": np.zeros((4,), np.float32)} for g in (0.0, 0.5, -0.2)]
  cfg = _cfg("lamb", learning_rate=0.01, warmup_steps=0, weight_decay=0.1, eps=1e-6, grad_clip_norm=0.0)
  ours = run_jdr(optimizers.make_optimizer(cfg, total_steps=100), params, grads)
  oracle = authors_lamb(params, grads, warmup_then_decay(0.01, 0, 100, 3), b1=0.9, b2=0.999, eps=1e-6,
                        weight_decay=0.1, decayed={"zero_matrix": True, "zero_bias": False, "still": False})
  assert all(np.all(np.isfinite(a[k])) for a in ours for k in a)
  assert_close(ours, oracle)
  assert np.all(ours[0]["zero_matrix"] == 0) and np.all(ours[1]["zero_matrix"] != 0)
  assert np.all(ours[-1]["zero_bias"] == 0) and np.all(ours[-1]["still"] == 2.0)


def test_lamb_in_query_only_training_with_clipping():
  """make_optimizer's full chain: global-norm clipping, then LAMB, on the query tower only; the doc tower
  stays where it is."""
  params = {"query_tower": lamb_params(2), "doc_tower": lamb_params(3)}
  rng = np.random.default_rng(4)
  grads = [jax.tree.map(lambda v: rng.normal(size=v.shape).astype(np.float32), params) for _ in range(4)]
  cfg = _cfg("lamb", learning_rate=0.02, warmup_steps=2, weight_decay=0.05, grad_clip_norm=1.0)
  ours = run_jdr(optimizers.make_optimizer(cfg, total_steps=8, train_towers="query"), params, grads)
  oracle = authors_lamb(params["query_tower"], [g["query_tower"] for g in grads],
                        warmup_then_decay(0.02, 2, 8, 4), b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.05,
                        decayed={"big": True, "small": True, "bias": False, "big_bias": False}, clip_norm=1.0)
  assert_close([p["query_tower"] for p in ours], oracle)
  for p in ours:
    for k, v in p["doc_tower"].items():
      np.testing.assert_array_equal(v, params["doc_tower"][k])


def test_optax_lamb_is_optax():
  params = lamb_params()
  rng = np.random.default_rng(5)
  grads = [{k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()} for _ in range(3)]
  cfg = _cfg("optax_lamb", learning_rate=0.05, warmup_steps=1, weight_decay=0.1, grad_clip_norm=0.0)
  ours = run_jdr(optimizers.make_optimizer(cfg, total_steps=10), params, grads)
  theirs = run_jdr(optax.lamb(optax.join_schedules([optax.linear_schedule(0.0, 0.05, 1),
                                                    optax.linear_schedule(0.05, 0.0, 9)], [1]),
                              b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1,
                              mask=lambda p: {k: v.ndim > 1 for k, v in p.items()}),
                   params, grads)
  assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
  # And it is not the authors' LAMB: the big matrix's norm is above the clamp.
  cfg.name = "lamb"
  assert max_gap(ours, run_jdr(optimizers.make_optimizer(cfg, total_steps=10), params, grads), "big") > 1e-3


def test_lamb_state_takes_the_params_boxes_and_checkpoints(tmp_path):
  """The trainer shards the optimizer state by the logical axes it finds in `tx.init` of boxed params, and
  orbax saves and restores it like any other pytree."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  boxed = {"dense": {"kernel": nn.LogicallyPartitioned(jnp.ones((4, 2)), ("embed", "mlp")),
                     "bias": nn.LogicallyPartitioned(jnp.ones((2,)), ("mlp",))}}
  tx = optimizers.make_optimizer(_cfg("lamb"), total_steps=10)
  abstract = jax.eval_shape(tx.init, boxed)
  boxes = [x for x in jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
           if isinstance(x, nn.LogicallyPartitioned)]
  assert sorted(b.names for b in boxes) == [("embed", "mlp")] * 2 + [("mlp",)] * 2  # mu and nu
  params = nn.unbox(boxed)
  state = tx.init(params)
  assert jax.tree.structure(nn.unbox(abstract)) == jax.tree.structure(state)
  _, state = tx.update(jax.tree.map(lambda p: jnp.full_like(p, 0.3), params), state, params)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "state", state)
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(tmp_path / "state", jax.tree.map(ocp.utils.to_shape_dtype_struct, state))
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(a, b)
  assert np.any(np.asarray(jax.tree.leaves(restored)[0]) != 0)


def test_lamb_on_fsdp_sharded_params():
  """On two devices with the matrix split over "fsdp" (parallel.tree_shardings of the boxed state), the
  jitted, donated update gives one device's weights: the norms are over whole tensors, not shards."""
  script = textwrap.dedent("""
      import flax.linen as nn, jax, jax.numpy as jnp, ml_collections, numpy as np, optax
      from jdr.training import optimizers
      from jdr.runtime import parallel
      cfg = ml_collections.ConfigDict(dict(name="lamb", learning_rate=0.05, warmup_steps=0, weight_decay=0.1,
                                           b1=0.9, b2=0.999, eps=1e-6, grad_clip_norm=1.0))
      tx = optimizers.make_optimizer(cfg, total_steps=10)
      rng = np.random.default_rng(0)
      boxed = {"kernel": nn.LogicallyPartitioned(jnp.asarray(rng.normal(0, 3, (8, 4)), jnp.float32),
                                                 ("embed", "mlp")),
               "bias": nn.LogicallyPartitioned(jnp.asarray(rng.normal(0, 6, (4,)), jnp.float32), ("mlp",))}
      params = nn.unbox(boxed)
      grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params)
               for _ in range(3)]

      def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

      mesh = parallel.make_mesh((1, 2, 1))
      rules = parallel.rules_for("fsdp")
      p_sh = parallel.tree_shardings(boxed, mesh, rules)
      s_sh = parallel.tree_shardings(jax.eval_shape(tx.init, boxed), mesh, rules)
      assert p_sh["kernel"].spec[0] == "fsdp", p_sh
      sharded = jax.jit(step, in_shardings=(p_sh, s_sh, p_sh), out_shardings=(p_sh, s_sh), donate_argnums=(0, 1))
      # From host copies: donation must not delete the buffers that the one-device run reads.
      p = jax.device_put(jax.tree.map(np.asarray, params), p_sh)
      s = jax.jit(tx.init, out_shardings=s_sh)(params)
      p1, s1 = params, tx.init(params)
      for g in grads:
        p, s = sharded(p, s, g)
        p1, s1 = jax.jit(step)(p1, s1, g)
      assert len(p["kernel"].sharding.device_set) == 2
      for k in params:
        np.testing.assert_allclose(np.asarray(p[k]), np.asarray(p1[k]), rtol=1e-6, atol=1e-7)
      assert np.abs(np.asarray(p1["kernel"]) - np.asarray(params["kernel"])).max() > 1e-3
      print("OK")
  """)
  run_on_cpu_devices(script, devices=2)


def hf_linear_schedule_with_warmup(step, warmup, total):
  """transformers' get_linear_schedule_with_warmup, which all three authors' trainers call: the multiple of the
  peak rate at `step`."""
  if step < warmup:
    return step / max(1, warmup)
  return max(0.0, (total - step) / max(1, total - warmup))


MSMARCO_TRAIN_QUERIES = 502_939  # qrels.train.tsv's queries: the datasets' lengths the authors' totals count


@pytest.mark.parametrize("recipe,authors_total,about", [
    # DRhard star/train.py: the Trainer's ceil(100 epochs x ceil(queries / 256) batches), stopped near 50k by hand
    ("star.py", math.ceil(100 * math.ceil(MSMARCO_TRAIN_QUERIES / 256)), 0.75),
    # ANCE run_ann.py: --single_warmup schedules over max_steps, 1M by default; the paper reports 600k
    ("ance.py", 1_000_000, 0.40),
    # DRhard adore/train.py: t_total = len(train_dataloader) // accumulation * 6 epochs; jdr stops at 60k
    ("adore.py", math.ceil(MSMARCO_TRAIN_QUERIES / 32) * 6, 0.37),
])
def test_recipe_schedules_at_the_papers_stop_are_the_authors(recipe, authors_total, about):
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  root = pathlib.Path(__file__).resolve().parents[1] / "configs"
  c = config_files.load_config_file(str(root / recipe))
  total = optimizers.schedule_steps(c.optimizer, c.num_train_steps)
  schedule = optimizers.learning_rate_schedule(c.optimizer.learning_rate, c.optimizer.warmup_steps, total)
  for step in (c.optimizer.warmup_steps // 2, c.optimizer.warmup_steps, c.num_train_steps // 2, c.num_train_steps):
    expected = hf_linear_schedule_with_warmup(step, c.optimizer.warmup_steps, authors_total)
    assert float(schedule(step)) / c.optimizer.learning_rate == pytest.approx(expected, rel=1e-5), step
  assert float(schedule(c.num_train_steps)) / c.optimizer.learning_rate == pytest.approx(about, abs=0.005)
  # The scaled-down run keeps its own short schedule: the rate reaches 0 at its last step.
  local = config_files.load_config_file(f"{root / recipe}:runlocal")
  steps = optimizers.schedule_steps(local.optimizer, local.num_train_steps)
  assert steps == local.num_train_steps
  assert float(optimizers.learning_rate_schedule(local.optimizer.learning_rate, local.optimizer.warmup_steps,
                                                 steps)(steps)) == 0.0


def test_a_schedule_shorter_than_the_run_is_refused():
  with pytest.raises(ValueError, match="schedule_steps=50 is below num_train_steps=100"):
    optimizers.make_optimizer(_cfg(schedule_steps=50), total_steps=100)
  assert optimizers.schedule_steps(_cfg(schedule_steps=1000), 100) == 1000
  assert optimizers.schedule_steps(_cfg(schedule_steps=0), 100) == optimizers.schedule_steps(_cfg(), 100) == 100
