"""The exact sharded top-k (jdr.retrieval.topk) against brute-force numpy: the same rows, ties to the lower row."""

import json
import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import cpu_devices_env
from jdr.retrieval import topk

ROOT = pathlib.Path(__file__).resolve().parents[1]


def brute_force(queries: np.ndarray, docs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
  """(scores, rows) of numpy's top k per query, ordered by score, then by the lower row."""
  scores = queries.astype(np.float64) @ docs.astype(np.float64).T
  rows = np.stack([np.lexsort((np.arange(len(docs)), -s))[:k] for s in scores])
  return np.take_along_axis(scores, rows, axis=1), rows


def tied_data(seed: int, n: int, dim: int = 8, queries: int = 9):
  """Small-integer vectors: float32 dot products are exact, and many scores tie."""
  rng = np.random.default_rng(seed)
  return (rng.integers(-2, 3, size=(n, dim)).astype(np.float32),
          rng.integers(-2, 3, size=(queries, dim)).astype(np.float32))


# (documents, block rows, k): N a multiple of the block or not, k above a block, k above the rows a device
# holds, blocks fewer than k (the one-pass path), a block of one row.
CASES = [(1003, 16, 50), (1024, 128, 5), (5003, 64, 200), (777, 8, 300), (300, 128, 7), (130, 1, 20),
         (40, 16, 40)]

_CHECK = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    sys.path.insert(0, sys.argv[1])
    sys.path.insert(0, sys.argv[2])
    from jdr.retrieval import topk
    from test_topk import CASES, tied_data
    topk.PUT_CHUNK_BYTES = 4 * 8 * 37  # 37 rows a chunk: every shard filled in several pieces
    out = {"devices": jax.device_count(), "cases": []}
    meshes = [jax.make_mesh((jax.device_count(),), ("docs",))]
    if jax.device_count() == 8:
      meshes.append(jax.make_mesh((2, 2, 2), ("data", "fsdp", "model")))
    for mesh in meshes:
      for seed, (n, block, k) in enumerate(CASES):
        docs, queries = tied_data(seed, n)
        corpus = topk.put_corpus(docs, mesh, "float32", block)
        values, rows = topk.search_fn(corpus, k, mesh)(queries)
        picked = jax.jit(lambda r, p: topk.gather_rows(r, p, mesh))(corpus.rows, rows)
        out["cases"].append({"rows": np.asarray(rows).tolist(), "values": np.asarray(values).tolist(),
                             "picked_ok": bool(np.array_equal(np.asarray(picked), docs[np.asarray(rows)])),
                             "padded": corpus.padded_rows})
    print(json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 8])
def test_sharded_top_k_equals_brute_force(devices):
  env = cpu_devices_env(devices, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", _CHECK, str(ROOT), str(ROOT / "tests")], env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  out = json.loads(result.stdout.splitlines()[-1])
  assert out["devices"] == devices
  expected_cases = CASES * (2 if devices == 8 else 1)
  assert len(out["cases"]) == len(expected_cases)
  for seed, ((n, block, k), got) in enumerate(zip(expected_cases, out["cases"])):
    docs, queries = tied_data(seed % len(CASES), n)
    want_scores, want_rows = brute_force(queries, docs, min(k, n))
    assert got["padded"] % (devices * block) == 0 and got["padded"] >= n
    np.testing.assert_array_equal(np.array(got["rows"]), want_rows, err_msg=f"N={n} block={block} k={k}")
    np.testing.assert_array_equal(np.array(got["values"]), want_scores)
    assert got["picked_ok"]


def test_block_top_k_on_scores_with_ties_and_infinities():
  rng = np.random.default_rng(3)
  scores = rng.integers(0, 4, size=(5, 1000)).astype(np.float32)
  scores[:, 990:] = -np.inf  # padding never wins while real rows remain
  for block in (7, 128, 1000):
    for k in (1, 33, 990):
      values, columns = topk.block_top_k(jnp.asarray(scores), k, block)
      want = np.stack([np.lexsort((np.arange(1000), -s))[:k] for s in scores])
      np.testing.assert_array_equal(np.asarray(columns), want)
      np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(scores, want, 1))


def test_storage_dtypes_and_int8_recall():
  rng = np.random.default_rng(0)
  docs = rng.normal(size=(4000, 64)).astype(np.float32)
  docs /= np.linalg.norm(docs, axis=1, keepdims=True)
  queries = docs[rng.choice(4000, 16, replace=False)] + 0.3 * rng.normal(size=(16, 64)).astype(np.float32)
  mesh = jax.make_mesh((1,), ("docs",))
  _, exact = brute_force(queries, docs, 200)
  values, scale = topk.quantize_int8(docs)
  assert values.dtype == np.int8 and scale.shape == (4000, 1)
  # Symmetric rounding: each coordinate within half a step of its row's scale.
  assert np.all(np.abs(values * scale - docs) <= scale / 2 + 1e-7)
  recalls = {}
  for dtype in ("float32", "bfloat16", "int8"):
    corpus = topk.put_corpus(docs, mesh, dtype)
    scores, rows = topk.search_fn(corpus, 200, mesh)(queries)
    assert scores.dtype == jnp.float32
    recalls[dtype] = np.mean([len(set(a) & set(b)) / 200 for a, b in zip(np.asarray(rows), exact)])
    picked = jax.jit(lambda r, p: topk.gather_rows(r, p, mesh))(corpus.rows, rows)
    assert picked.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(picked), docs[np.asarray(rows)], atol=0.02)
  assert recalls["float32"] == 1.0
  assert recalls["bfloat16"] > 0.95 and recalls["int8"] > 0.9, recalls
  assert topk.storage_bytes_per_row(64, "int8") < topk.storage_bytes_per_row(64, "bfloat16")


def test_dtype_defaults_follow_the_platform():
  assert topk.resolve_dtype("auto", "cpu") == "float32"
  assert topk.resolve_dtype("auto", "gpu") == "bfloat16"
  assert topk.resolve_dtype("auto", "tpu") == "bfloat16"
  assert topk.resolve_dtype("int8", "gpu") == "int8"
  with pytest.raises(ValueError, match="float32, bfloat16, int8"):
    topk.resolve_dtype("float16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_abstract_corpus_is_what_put_corpus_places(dtype):
  """The corpus compiled against without data (sizing, jdr.bench compiled) has the shapes, dtypes and
  shardings of the one put_corpus places."""
  from jdr.runtime import parallel  # pylint: disable=g-import-not-at-top
  mesh = parallel.make_mesh((1, 1, 1))
  placed = topk.put_corpus(np.ones((300, 8), np.float32), mesh, dtype, block_rows=64)
  rows, bias = topk.abstract_corpus(300, 8, mesh, dtype, block_rows=64)
  describe = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), tree)  # noqa: E731
  assert describe((rows, bias)) == describe((placed.rows, placed.bias))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_placing_in_chunks_stores_every_row(monkeypatch, dtype):
  """A corpus placed a few rows at a time holds exactly the rows placed whole: the values stored (as the
  dtype rounds them), zeros in the padding, from a memory-mapped matrix as from an array."""
  rng = np.random.default_rng(5)
  docs = rng.normal(size=(301, 8)).astype(np.float32)
  mesh = jax.make_mesh((1,), ("docs",))
  whole = topk.put_corpus(docs, mesh, dtype, block_rows=16)
  monkeypatch.setattr(topk, "PUT_CHUNK_BYTES", 4 * 8 * 10)
  chunked = topk.put_corpus(docs, mesh, dtype, block_rows=16)
  for a, b in zip(jax.tree.leaves(whole.rows), jax.tree.leaves(chunked.rows)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  stored = np.asarray(topk.dequantize(chunked.rows))
  np.testing.assert_allclose(stored[:301], docs, atol={"float32": 0, "bfloat16": 0.02, "int8": 0.03}[dtype])
  assert not stored[301:].any() and chunked.padded_rows == 304
