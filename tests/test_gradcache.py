"""Gradient caching equals jax.value_and_grad of the whole batch, with the same per-row dropout keys.

Every function here is compiled with the CPU backend's LLVM optimizations off (O0): it computes the same
thing, and compiling a dropout-heavy model takes a third of the time.
"""

import functools
import textwrap

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import run_on_cpu_devices
from flax import linen as nn

from jdr.training import gradcache
from jdr.training import losses
from jdr.models.bert import EncoderConfig
from jdr.models.towers import TowerConfig, TwoTower

# Dropout stays on (the EncoderConfig default 0.1): equal masks in both passes is what is under test.
TINY = EncoderConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                     max_position_embeddings=16)
LQ, LD = 6, 10
O0 = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def setup(shared: bool, num_queries: int, seed: int = 0):
  """(encode_query, encode_doc, loss_of_embeddings, params, batch, rng) for a tiny random TwoTower."""
  if shared:
    model = TwoTower(TowerConfig(TINY), TowerConfig(TINY), shared=True)
  else:
    model = TwoTower(TowerConfig(TINY, pooling="mean", projection_dim=8),
                     TowerConfig(TINY, pooling="cls", projection_dim=8), shared=False)
  rnd = np.random.default_rng(seed)
  b, c = num_queries, 2 * num_queries  # each query: its positive (column b) and a hard negative (B + b)

  def tokens(n, length):
    ids = rnd.integers(1, TINY.vocab_size, (n, length)).astype(np.int32)
    lengths = rnd.integers(2, length + 1, n)
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int32)
    return jnp.asarray(ids * mask), jnp.asarray(mask)

  q_ids, q_mask = tokens(b, LQ)
  d_ids, d_mask = tokens(c, LD)
  batch = {"query_ids": q_ids, "query_mask": q_mask, "doc_ids": d_ids, "doc_mask": d_mask}
  params = nn.unbox(model.init(jax.random.PRNGKey(seed), q_ids[:1], q_mask[:1], d_ids[:1], d_mask[:1]))
  params = params["params"]
  loss_of = losses.make_loss(ml_collections.ConfigDict({"name": "softmax_nll", "temperature": 1.0}))
  valid = jnp.ones((b, c), bool)

  def loss_of_embeddings(q, d):
    scores = q @ d.T
    accuracy = jnp.mean(jnp.argmax(scores, axis=1) == jnp.arange(b))
    return jnp.mean(loss_of(scores, {"valid": valid})), {"accuracy": accuracy, "mean_score": jnp.mean(scores)}

  return (gradcache.per_row_encoder(model, "encode_query"), gradcache.per_row_encoder(model, "encode_doc"),
          loss_of_embeddings, params, batch,
          # Both key kinds: raw uint32[2] (the trainer's) for shared towers, a typed key for separate ones.
          jax.random.PRNGKey(seed + 1) if shared else jax.random.key(seed + 1))


def assert_close(got, want, err_msg=""):
  # float32: rtol 1e-5, and atol 1e-6 of the leaf's largest entry (at least 1e-6). The two sides add the
  # same terms in another order, so an entry near zero in a leaf of large entries (an embedding row of a
  # rare token beside one of a frequent one) may differ by a few ulps of the large ones.
  want = np.asarray(want)
  atol = 1e-6 * max(1.0, float(np.abs(want).max(initial=0.0)))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol, err_msg=err_msg)


def assert_same(got, want):
  loss, aux, grads = got
  want_loss, want_aux, want_grads = want
  assert_close(loss, want_loss)
  jax.tree.map(assert_close, aux, want_aux)
  assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want_grads)):
    assert_close(g, w, err_msg=jax.tree_util.keystr(path))


B = 5  # not a multiple of 2: chunk_size 2 pads the last query chunk


@pytest.fixture(scope="module", params=[True, False], ids=["shared", "separate"])
def case(request):
  enc_q, enc_d, loss_fn, params, batch, rng = setup(request.param, B)
  reference = jax.jit(functools.partial(gradcache.plain_value_and_grad, enc_q, enc_d, loss_fn),
                      compiler_options=O0)(params, batch, rng)
  return (enc_q, enc_d, loss_fn, params, batch, rng), reference


@pytest.mark.slow
@pytest.mark.parametrize("chunk_size", [1, 2, 2 * B], ids=["chunk1", "chunk2", "full"])
def test_cached_equals_value_and_grad(case, chunk_size):
  (enc_q, enc_d, loss_fn, params, batch, rng), reference = case
  cached = jax.jit(functools.partial(gradcache.cached_value_and_grad, enc_q, enc_d, loss_fn,
                                     chunk_size=chunk_size), compiler_options=O0)(params, batch, rng)
  assert_same(cached, reference)
  # Every leaf of both towers gets a gradient (shared: one tree; separate: query and doc trees).
  assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(cached[2]))


@pytest.mark.slow
def test_reference_uses_dropout_and_row_keys():
  """The oracle is meaningful: dropout is on, and a row's embedding depends on its own key only."""
  enc_q, enc_d, loss_fn, params, batch, rng = setup(True, 4)
  model = TwoTower(TowerConfig(TINY), TowerConfig(TINY), shared=True)
  clean = gradcache.per_row_encoder(model, "encode_query", deterministic=True)

  @functools.partial(jax.jit, compiler_options=O0)
  def encodings(params, ids, mask):
    keys, _ = gradcache.batch_row_keys(rng, 4, 8)
    return (enc_q(params, ids, mask, keys), enc_q(params, ids[2:], mask[2:], keys[2:]),
            clean(params, ids, mask, keys))

  q, again, deterministic = encodings(params, batch["query_ids"], batch["query_mask"])
  np.testing.assert_allclose(again, q[2:], rtol=1e-5, atol=1e-6)
  assert not np.allclose(deterministic, q, atol=1e-3)


def test_bad_chunk_size():
  enc_q, enc_d, loss_fn, params, batch, rng = setup(True, 2)
  for bad in (0, -1, 2.0, None):
    with pytest.raises(ValueError, match="chunk_size"):
      gradcache.cached_value_and_grad(enc_q, enc_d, loss_fn, params, batch, rng, chunk_size=bad)


@pytest.mark.slow
def test_program_does_not_grow_with_chunks():
  sizes = {}
  for b in (4, 16):  # 2 and 8 chunks of 2 rows
    enc_q, enc_d, loss_fn, params, batch, rng = setup(True, b)
    fn = functools.partial(gradcache.cached_value_and_grad, enc_q, enc_d, loss_fn, chunk_size=2)
    sizes[b] = len(jax.jit(fn).lower(params, batch, rng).as_text())
  assert sizes[16] < 1.05 * sizes[4], sizes


@pytest.mark.slow
def test_caching_lowers_compiled_memory():
  model = TwoTower(TowerConfig(TINY), TowerConfig(TINY), shared=True)
  plain = gradcache.step_bytes(model, 32, query_len=LQ, doc_len=LD, compiler_options=O0)
  cached = gradcache.step_bytes(model, 32, query_len=LQ, doc_len=LD, chunk_size=4, compiler_options=O0)
  assert cached["temp"] < plain["temp"] / 2, (cached, plain)


def test_largest_batch_search(monkeypatch):
  probes = []

  def fake_step_bytes(model, batch_size, **kwargs):
    probes.append(batch_size)
    return {"total": 100 * batch_size}

  monkeypatch.setattr(gradcache, "step_bytes", fake_step_bytes)
  assert gradcache.largest_batch(None, 4000, query_len=1, doc_len=1, chunk_size=8) == (40, {"total": 4000})
  assert probes == [8, 16, 32, 64, 48, 40]
  assert gradcache.largest_batch(None, 4000, query_len=1, doc_len=1, start=8, max_batch=16)[0] == 16
  assert gradcache.largest_batch(None, 700, query_len=1, doc_len=1, start=8) == (0, None)


@pytest.mark.long
def test_sharded_over_eight_devices_equals_one_device():
  """A batch sharded over a ("data",) mesh of 8 CPU devices gives the single-device result, with and
  without `mesh=` (shard_map); with it, no all-reduce runs inside a chunk loop."""
  script = textwrap.dedent("""
      import functools, re
      import jax
      from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
      from test_gradcache import O0, setup, assert_same
      from jdr.training import gradcache
      assert jax.device_count() == 8, jax.devices()
      mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
      rows, repl = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())

      def loop_bodies_with_all_reduce(hlo):
        bodies = set(re.findall(r"body=%([^,\\s]+)", hlo))
        found, name = set(), None
        for line in hlo.splitlines():
          header = re.match(r"(?:ENTRY )?%(\\S+) ", line)
          if header and line.rstrip().endswith("{"):
            name = header.group(1)
          elif name in bodies and " all-reduce(" in line:
            found.add(name)
        return found

      # Separate towers, 8 + 16 rows in chunks of 8 (one row per device per chunk): jit's partitioning of the
      # plain loops, then the shard_map loops of mesh=.
      enc_q, enc_d, loss_fn, params, batch, rng = setup(False, 8)
      fn = functools.partial(gradcache.cached_value_and_grad, enc_q, enc_d, loss_fn, chunk_size=8)
      single = jax.jit(fn, compiler_options=O0)(params, batch, rng)
      sharded_batch = jax.device_put(batch, rows)
      assert len(sharded_batch["doc_ids"].sharding.device_set) == 8
      for step in (fn, functools.partial(fn, mesh=mesh)):
        compiled = jax.jit(step, in_shardings=(repl, rows, repl), out_shardings=repl).lower(
            params, sharded_batch, rng).compile(O0)
        assert_same(compiled(params, sharded_batch, rng), single)
      hlo = compiled.as_text()
      assert " all-reduce(" in hlo and " while(" in hlo
      assert not loop_bodies_with_all_reduce(hlo), loop_bodies_with_all_reduce(hlo)
      try:
        gradcache.cached_value_and_grad(enc_q, enc_d, loss_fn, params, batch, rng, chunk_size=4, mesh=mesh)
        raise AssertionError("chunk_size 4 on 8 shards must be refused")
      except ValueError as e:
        assert "chunk_size = 4" in str(e), e
      print("OK")
  """)
  run_on_cpu_devices(script)
