"""jdr's Pallas attention (run in Pallas' interpreter on the CPU) against plain dense attention and the einsum
path: same outputs and gradients, the same dropout mask, padding, vmapped rows and a sharded mesh; on a GPU
(`pytest tests/test_flash_attention.py -m gpu`, skipped elsewhere) the Triton kernel against the einsum path."""

import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_on_cpu_devices

from jdr.models.bert import Encoder, EncoderConfig
from jdr.models.dropout import dropout_bits, drop_threshold
from jdr.models.flash_attention import flash_attention

TINY = EncoderConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                     max_position_embeddings=24, attention_dropout=0.3)


def dense_attention(q, k, v, key_mask, scale, rate, key):
  """Softmax over masked logits, the [B, N, L, L] probabilities dropped by `dropout_bits`, written out whole."""
  logits = jnp.einsum("bqnd,bknd->bnqk", q, k) * scale
  logits = jnp.where(key_mask[:, None, None, :], logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  if rate:
    keep = dropout_bits(key, probs.shape) >= jnp.uint32(drop_threshold(rate))
    probs = jnp.where(keep, probs / (1.0 - rate), 0.0)
  return jnp.einsum("bnqk,bknd->bqnd", probs, v)


@pytest.mark.slow
@pytest.mark.parametrize("rate", [0.0, 0.3])
@pytest.mark.parametrize("length, heads, dim, lengths", [
    (40, 2, 24, (40, 17, 1)),  # one 64-token block, padded inside; heads of 24 padded to 32
    (150, 1, 16, (150, 70, 64, 1)),  # three blocks: the softmax rescaled across them, blocks past a length skipped
])
def test_outputs_and_gradients_equal_dense_attention(rate, length, heads, dim, lengths):
  """Rows of several real lengths: outputs and the gradients of q, k and v equal the dense computation with
  the same mask."""
  batch = len(lengths)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(batch, length, heads, dim)), jnp.float32) for _ in range(3))
  key_mask = jnp.asarray(np.arange(length)[None] < np.array(lengths)[:, None])
  key = jax.random.key(3)
  ours = lambda q, k, v: flash_attention(q, k, v, key_mask, scale=dim ** -0.5, rate=rate, key=key)
  dense = lambda q, k, v: dense_attention(q, k, v, key_mask, dim ** -0.5, rate, key)
  np.testing.assert_allclose(ours(q, k, v), dense(q, k, v), rtol=1e-5, atol=2e-6)
  loss = lambda f: lambda *qkv: jnp.sum(jnp.sin(f(*qkv)) * jnp.arange(dim))
  for got, want in zip(jax.grad(loss(ours), (0, 1, 2))(q, k, v), jax.grad(loss(dense), (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
  if rate:  # the mask matters: another key gives other outputs
    other = flash_attention(q, k, v, key_mask, scale=dim ** -0.5, rate=rate, key=jax.random.key(4))
    assert float(jnp.max(jnp.abs(other - ours(q, k, v)))) > 0.1


def test_bad_rates_and_missing_keys_are_refused():
  q = jnp.zeros((1, 4, 1, 16))
  mask = jnp.ones((1, 4), bool)
  with pytest.raises(ValueError, match="needs a key"):
    flash_attention(q, q, q, mask, scale=1.0, rate=0.1)
  with pytest.raises(ValueError, match=r"\[0, 1\)"):
    flash_attention(q, q, q, mask, scale=1.0, rate=1.0, key=jax.random.key(0))


def encoder_inputs():
  rng = np.random.default_rng(0)
  ids = rng.integers(3, 50, (4, 9)).astype(np.int32)
  mask = (np.arange(9)[None, :] < np.array([[9], [5], [2], [7]])).astype(np.int32)
  return np.where(mask > 0, ids, 0).astype(np.int32), mask


@pytest.mark.slow
def test_encoder_with_flash_attention_equals_the_einsum_encoder():
  """model.attention=flash: the same token vectors and parameter gradients as the einsum path, in evaluation
  and in training with attention dropout (the same probabilities dropped, and the hidden dropouts keep their
  keys), and per row under vmap with each row's key, as gradient caching runs the towers."""
  ids, mask = encoder_inputs()
  einsum, flash = Encoder(TINY.replace(attention="einsum")), Encoder(TINY.replace(attention="flash"))
  params = einsum.init(jax.random.key(0), ids, mask)
  for deterministic in (True, False):
    apply = lambda model, p: model.apply(p, ids, mask, deterministic=deterministic,
                                         rngs={"dropout": jax.random.key(3)})
    np.testing.assert_allclose(apply(flash, params), apply(einsum, params), rtol=1e-5, atol=1e-5)
    grads = [jax.grad(lambda p, m=m: jnp.sum(jnp.sin(apply(m, p))))(params) for m in (flash, einsum)]
    for got, want in zip(*(jax.tree.leaves(g) for g in grads)):
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(5), i))(jnp.arange(4, dtype=jnp.uint32))
  rows = lambda m: jax.vmap(lambda i, s, r: m.apply(params, i[None], s[None], deterministic=False,
                                                    rngs={"dropout": r})[0])(ids, mask, keys)
  np.testing.assert_allclose(rows(flash), rows(einsum), rtol=1e-5, atol=1e-5)


def flash_agreement(encoder, rows: int = 4, length: int = 256, seed: int = 0) -> dict:
  """Whether jdr's flash kernel computes what the einsum path does, on this platform. A training forward
  (attention dropout on, rows of varied lengths) in `encoder`'s dtype with each attention: its token vectors,
  parameter gradients and attention parameters' gradients, each as a relative error against the einsum path
  in float32 (highest matmul precision), same weights and dropout keys. The CPU test below runs the kernel in
  Pallas' interpreter; on a GPU (the `gpu` test) it runs as Triton. It agrees when each error is within twice the einsum
  path's own in that dtype: in bfloat16 both are rounding, where the kernel drawing another dropout mask,
  attending to one padded key or scaling its logits by 1.05 made the attention gradients' error several times
  the einsum path's (on the interpreter; the tests check the first two; the figures: docs/performance.md,
  `device`)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  ids = rng.integers(5, encoder.vocab_size, (rows, length)).astype(np.int32)
  lengths = np.maximum(1, (length * np.linspace(1.0, 0.1, rows)).astype(int))
  mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)
  real = jnp.asarray(mask, jnp.float32)[..., None]
  reference = encoder.replace(attention="einsum", dtype="float32")
  params = nn.unbox(Encoder(reference).init(jax.random.key(seed), ids, mask))
  names = lambda path: [getattr(k, "key", None) for k in path]
  # Query and key weights at N(0, 1 / width) instead of BERT's N(0, 0.02): logits of unit spread, so attention
  # is far from uniform and a wrong scale, mask or block shows.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x * (encoder.hidden_size ** -0.5 / 0.02)
      if names(path)[-1] == "kernel" and ({"query", "key"} & set(names(path))) else x, params)

  def vectors_and_gradients(config):
    model = Encoder(config)

    def loss(p):
      out = model.apply(p, ids, mask, deterministic=False, rngs={"dropout": jax.random.key(seed + 1)}) * real
      return jnp.sum(jnp.sin(out)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    part = lambda keep: np.concatenate([np.asarray(g, np.float64).ravel() for path, g in flat if keep(path)])
    # Attention's own parameters get their gradients only through the kernel: a wrong probability or mask
    # shows there first (with random weights attention is a small part of the token vectors).
    attention = lambda path: bool({"query", "key", "value"} & set(names(path)))
    return np.asarray(out, np.float64), part(lambda _: True), part(attention)

  with jax.default_matmul_precision("highest"):
    want = vectors_and_gradients(reference)
  errors = {}
  for attention in ("einsum", "flash"):
    got = vectors_and_gradients(encoder.replace(attention=attention))
    errors[attention] = [float(np.linalg.norm(g - w) / np.linalg.norm(w)) for g, w in zip(got, want)]
  return {"rows": rows, "length": length, "layers": encoder.num_layers, "dtype": encoder.dtype,
          "attention_dropout": encoder.attention_dropout,
          "vectors_error": {a: round(e[0], 6) for a, e in errors.items()},
          "gradients_error": {a: round(e[1], 6) for a, e in errors.items()},
          "attention_gradients_error": {a: round(e[2], 6) for a, e in errors.items()},
          "agrees": all(f <= 2 * e + 1e-6 for f, e in zip(errors["flash"], errors["einsum"]))}


@pytest.mark.slow
def test_agreement_check_passes_the_kernel_and_fails_other_masks(monkeypatch):
  """The agreement check, run here on the interpreter: in bfloat16 the kernel is as close to the float32
  einsum path as the bfloat16 einsum path is; the kernel drawing its dropout from another key, or attending
  to a padded key, is not."""
  from jdr.models import bert  # pylint: disable=g-import-not-at-top
  cfg = TINY.replace(dtype="bfloat16", attention_dropout=0.1, max_position_embeddings=80)
  result = flash_agreement(cfg, rows=4, length=70)  # two blocks of 64 keys, rows of 70 to 7 tokens
  assert result["agrees"] and 0 < result["gradients_error"]["flash"] < 0.02, result
  kernel = bert.flash_attention
  wrong = {"another dropout key": lambda q, k, v, mask, scale, rate, key: kernel(
               q, k, v, mask, scale, rate, None if key is None else jax.random.fold_in(key, 1)),
           "a padded key attended": lambda q, k, v, mask, scale, rate, key: kernel(
               q, k, v, jnp.asarray(mask).at[:, -1].set(True), scale, rate, key)}
  for what, attention in wrong.items():
    monkeypatch.setattr(bert, "flash_attention", attention)
    result = flash_agreement(cfg, rows=4, length=70)
    assert not result["agrees"], (what, result)


@pytest.mark.gpu
def test_the_triton_kernel_agrees_with_the_einsum_path_on_the_gpu():
  """On the card, where the kernel runs as Triton (the CPU tests run it interpreted): two layers of BERT-base's
  shape (every layer runs the same kernels) in bfloat16 at 256 tokens, attention dropout 0.1 as the train
  step draws it; token vectors, gradients and the attention weights' gradients each within twice the
  bfloat16 einsum path's error against a float32 one. `python -m jdr.bench device --sections flash` times
  the same kernel."""
  assert jax.default_backend() == "gpu"
  result = flash_agreement(EncoderConfig(num_layers=2, dtype="bfloat16", attention_dropout=0.1), length=256)
  assert result["agrees"], result


def test_kernels_lower_to_triton_for_gpus(monkeypatch):
  """The forward and both backward kernels lower to Triton for CUDA from this CPU host (bfloat16, BERT-base's
  64-wide heads, 256 and 100 tokens), and each Triton module passes MLIR's verifier, which the GPU compiler
  runs first (a loop with bounds of two integer types once failed there), so the GPU path is not first
  compiled on a GPU. The verifier is called on the module Pallas' Triton lowering returns (jax internals)."""
  from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top
  verified = []
  lower = lowering.lower_jaxpr_to_triton_module

  def lower_and_verify(*args, **kwargs):
    result = lower(*args, **kwargs)
    try:
      verified.append(result.module.operation.verify())
    except Exception as e:  # pylint: disable=broad-except  (MLIR raises with the verifier's message)
      verified.append(str(e)[:500])
    return result

  monkeypatch.setattr(lowering, "lower_jaxpr_to_triton_module", lower_and_verify)

  def loss(q, k, v, mask, key):
    out = flash_attention(q, k, v, mask, scale=0.125, rate=0.1, key=key, interpret=False)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  for length in (256, 100):
    args = [jax.ShapeDtypeStruct((2, length, 12, 64), jnp.bfloat16)] * 3 + [
        jax.ShapeDtypeStruct((2, length), jnp.bool_), jax.ShapeDtypeStruct((2,), jnp.uint32)]
    exported = jax.export.export(
        jax.jit(jax.grad(loss, (0, 1, 2))), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    names = re.findall(r'name = "(\w+)"', exported.mlir_module())
    assert sorted(set(names)) == ["_dkdv_kernel", "_dq_kernel", "_forward_kernel"], names
  assert verified == [True] * 6, verified


@pytest.mark.parametrize("length,head_dim", [(256, 64), (256, 32), (32, 64)])
def test_kernels_compile_for_an_h200_on_tensor_cores_without_ptxas_warnings(tmp_path, length, head_dim):
  """Compiled for an NVIDIA H200 (from this host, through jax's CUDA plugin), the forward and both backward
  kernels, dropout on, use tensor cores and ptxas warns of nothing: the dK/dV kernel computed query-major had
  its wgmma instructions serialized (C7515) at 64-wide heads."""
  from jdr.runtime import parallel  # pylint: disable=g-import-not-at-top
  from jdr.training import sizing
  from jdr.bench import compiled_kernels  # pylint: disable=g-import-not-at-top
  try:
    (device,) = sizing.gpu_target_devices("h200")
  except ValueError as e:
    pytest.skip(str(e))
  if compiled_kernels.find_ptxas() is None:
    pytest.skip("no ptxas (the CUDA plugin's nvidia-cuda-nvcc has one)")

  def loss(q, k, v, mask, key):
    out = flash_attention(q, k, v, mask, scale=0.125, rate=0.1, key=key, interpret=False)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  on = jax.sharding.SingleDeviceSharding(device)
  qkv = jax.ShapeDtypeStruct((8, length, 4, head_dim), jnp.bfloat16, sharding=on)
  args = [qkv] * 3 + [jax.ShapeDtypeStruct((8, length), jnp.int32, sharding=on),
                      jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=on)]
  # The suite's XLA_FLAGS lower the backend's optimization level (conftest.py); ptxas's register allocation
  # at that level is not the one a GPU run gets, so the default level (3) is asked for here.
  with parallel.compiling_for("gpu"):
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(*args).compile(
        {"xla_dump_to": str(tmp_path), "xla_backend_optimization_level": 3})
  kernels = compiled_kernels.triton_kernel_report(
      str(tmp_path), compiled_kernels.triton_kernel_names(compiled.as_text()))
  assert sorted(k["name"] for k in kernels) == ["_dkdv_kernel", "_dq_kernel", "_forward_kernel"], kernels
  for k in kernels:
    assert k["tensor_cores"] != "none" and k["registers"] is not None, k
    assert k["spill_bytes"] == 0 and k["warnings"] == [], k


@pytest.mark.long
def test_sharded_flash_attention_equals_one_device():
  """On 8 CPU devices as a (data 4, model 2) mesh, the towers traced under the step's mesh run the kernel per
  shard (rows and heads): token vectors and gradients equal one device's, dropout included. Inside a
  shard_map of the caller's, the layer runs the einsums."""
  script = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np
      from test_flash_attention import TINY, encoder_inputs
      from jdr.runtime import parallel
      from jdr.models.bert import Encoder
      assert jax.device_count() == 8, jax.devices()
      ids, mask = encoder_inputs()
      model = Encoder(TINY.replace(attention="flash"))
      params = model.init(jax.random.key(0), ids, mask)
      def loss(p, ids, mask):
        out = model.apply(p, ids, mask, deterministic=False, rngs={"dropout": jax.random.key(3)})
        return jnp.sum(jnp.sin(out)), out
      single = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, ids, mask)
      mesh = parallel.make_mesh((4, 1, 2))
      rows = parallel.batch_sharding(mesh)
      def traced(p, ids, mask):
        with parallel.activations_on(mesh):
          return jax.value_and_grad(loss, has_aux=True)(p, ids, mask)
      from jdr.models import flash_attention as kernel
      head_axes, on_mesh = [], kernel.flash_attention_on_mesh
      def counted(mesh, batch_axes, head_axis, *args, **kwargs):
        head_axes.append(head_axis)
        return on_mesh(mesh, batch_axes, head_axis, *args, **kwargs)
      kernel.flash_attention_on_mesh = counted
      sharded = jax.jit(traced)(params, jax.device_put(ids, rows), jax.device_put(mask, rows))
      assert head_axes == ["model", "model"], head_axes  # each layer split by rows and heads
      for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
      # Inside a shard_map of its own (gradient caching's loops over a mesh) the layer takes the einsums.
      from jax.sharding import PartitionSpec as P
      einsum = Encoder(TINY.replace(attention="einsum"))
      def per_device(m):
        body = lambda ids, mask: m.apply(params, ids, mask, deterministic=False,
                                          rngs={"dropout": jax.random.key(3)})
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(parallel.BATCH_AXES),) * 2,
                                     out_specs=P(parallel.BATCH_AXES), axis_names=set(parallel.BATCH_AXES)))(
            jax.device_put(ids, rows), jax.device_put(mask, rows))
      np.testing.assert_array_equal(np.asarray(per_device(model)), np.asarray(per_device(einsum)))
      print("OK")
  """)
  run_on_cpu_devices(script)


def test_a_saved_model_loads_with_the_platforms_attention():
  """How the saving run computed attention is not part of the model: a description that says flash (a model
  trained with it) loads with auto, two towers and cross-encoders alike."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  from jdr.models import build  # pylint: disable=g-import-not-at-top
  from jdr.models.towers import TowerConfig, TwoTower  # pylint: disable=g-import-not-at-top
  tower = TowerConfig(encoder=TINY.replace(attention="flash"), pooling="mean")
  description = json.loads(json.dumps(build.describe(TwoTower(query=tower, doc=tower, shared=True), "tok", 8, 8)))
  assert description["query"]["encoder"]["attention"] == "flash"
  loaded = build.from_description(description)
  assert loaded.query.encoder.attention == loaded.doc.encoder.attention == "auto"
  cross = build.from_description({"architecture": "cross_encoder",
                                  "encoder": dataclasses.asdict(TINY.replace(attention="flash"))})
  assert cross.config.attention == "auto"
