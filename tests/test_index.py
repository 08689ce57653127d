"""jdr.retrieval.index: Faiss and JAX retrievers against brute-force numpy, persistence, compressed indexes."""

import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import cpu_devices_env
from jdr.retrieval import index

pytest.importorskip("faiss")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _unit(rng, n, dim):
  x = rng.standard_normal((n, dim))
  return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _structured(rng, n, dim, rank=16):
  """Unit vectors near a low-rank subspace, like real embeddings: quantizers have structure to find
  (isotropic noise would make any PQ look useless)."""
  x = rng.standard_normal((n, rank)) @ rng.standard_normal((rank, dim)) + 0.5 * rng.standard_normal((n, dim))
  return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def assert_exact_topk(scores, ids, queries, docs, doc_ids, k, tol=1e-5):
  """Float64 brute force: the scores are the true top-k scores and each id is the document having that
  score. With continuous random data ties are (nearly) impossible, so the id lists must match exactly
  except for swaps of documents whose true scores are within tol."""
  full = queries.astype(np.float64) @ docs.astype(np.float64).T
  order = np.argsort(-full, axis=1, kind="stable")[:, :k]
  ref_scores = np.take_along_axis(full, order, axis=1)
  assert scores.dtype == np.float32 and scores.shape == (len(queries), k)
  np.testing.assert_allclose(scores, ref_scores, atol=tol)
  position = {d: i for i, d in enumerate(doc_ids)}
  exact = 0
  for q, (row_ids, ref_rows) in enumerate(zip(ids, order)):
    assert len(row_ids) == k and len(set(row_ids)) == k
    got = np.array([full[q, position[d]] for d in row_ids])
    np.testing.assert_allclose(got, ref_scores[q], atol=tol)
    exact += row_ids == [doc_ids[j] for j in ref_rows]
  assert exact >= len(queries) - 1, f"only {exact}/{len(queries)} id lists identical"


@pytest.fixture
def data():
  rng = np.random.default_rng(0)
  docs = _unit(rng, 2500, 32)
  queries = _unit(rng, 40, 32)
  doc_ids = [f"doc-{i}" for i in range(len(docs))]
  return docs, queries, doc_ids


@pytest.mark.parametrize("kind", ["faiss", "jax"])
def test_exact_backends_match_numpy(kind, data):
  docs, queries, doc_ids = data
  retriever = index.make_retriever(kind, 32)
  # Several adds, and a search between them, as when encoding a corpus shard by shard.
  retriever.add(docs[:1000], doc_ids[:1000])
  scores, ids = retriever.search(queries, 100)
  assert_exact_topk(scores, ids, queries, docs[:1000], doc_ids[:1000], 100)
  retriever.add(docs[1000:], doc_ids[1000:])
  assert len(retriever) == len(docs)
  scores, ids = retriever.search(queries, 100)
  assert_exact_topk(scores, ids, queries, docs, doc_ids, 100)
  assert retriever.bytes_per_doc() == pytest.approx(32 * 4, rel=0.01)


_SHARDED_CHECK = textwrap.dedent("""
    import sys
    import jax
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    sys.path.insert(0, sys.argv[2])
    from jdr.retrieval import index
    from test_index import _unit, assert_exact_topk

    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(1)
    # 1003 rows: not a multiple of 8, so the last device holds padding rows.
    docs, queries = _unit(rng, 1003, 24), _unit(rng, 37, 24)
    doc_ids = [f"d{i}" for i in range(len(docs))]
    # The default 1-D mesh, and a 2-D training-style mesh from jax.make_mesh (Explicit axis types).
    meshes = [None, jax.make_mesh((2, 4), ("data", "model"))]
    for mesh in meshes:
      retriever = index.JaxRetriever(24, mesh=mesh, query_chunk=16)
      retriever.add(docs[:500], doc_ids[:500])
      retriever.search(queries, 10)
      retriever.add(docs[500:], doc_ids[500:])
      # k = 200 exceeds the 128 rows each device holds: every device's candidates enter the merge.
      for k in (1, 100, 200):
        scores, ids = retriever.search(queries, k)
        assert_exact_topk(scores, ids, queries, docs, doc_ids, k)
      assert len(retriever._emb.sharding.device_set) == 8
      # Rows are padded to a multiple of devices x block rows (8 x 128): 128 a device.
      assert {s.data.shape for s in retriever._emb.addressable_shards} == {(128, 24)}
    print("sharded ok")
""")


@pytest.mark.slow
def test_jax_retriever_sharded_over_8_cpu_devices():
  # The device count is fixed when jax initialises, so the check runs in a fresh interpreter.
  env = cpu_devices_env(8, JAX_PLATFORMS="cpu")
  result = subprocess.run(
      [sys.executable, "-c", _SHARDED_CHECK, str(ROOT), str(ROOT / "tests")],
      env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "sharded ok" in result.stdout


@pytest.mark.parametrize("kind,kwargs", [("faiss", {}), ("faiss", {"factory": "HNSW32"}), ("jax", {})])
def test_save_load_roundtrip(tmp_path, data, kind, kwargs):
  docs, queries, doc_ids = data
  retriever = index.make_retriever(kind, 32, **kwargs)
  retriever.add(docs, doc_ids)
  scores, ids = retriever.search(queries, 20)
  retriever.save(tmp_path / "idx")
  loaded = index.load_retriever(tmp_path / "idx")
  assert type(loaded) is type(retriever) and len(loaded) == len(docs)
  loaded_scores, loaded_ids = loaded.search(queries, 20)
  np.testing.assert_array_equal(loaded_scores, scores)
  assert loaded_ids == ids
  assert loaded.bytes_per_doc() == retriever.bytes_per_doc()
  # A loaded index keeps growing.
  loaded.add(docs[:3] * 0.5, ["extra-1", "extra-2", "extra-3"])
  assert len(loaded) == len(docs) + 3


@pytest.mark.slow
def test_opq_pq_is_small_and_close_to_flat(tmp_path):
  rng = np.random.default_rng(2)
  docs, queries = _structured(rng, 2000, 64), _structured(rng, 100, 64)
  doc_ids = [str(i) for i in range(len(docs))]
  flat = index.FaissRetriever(64)
  flat.add(docs, doc_ids)
  pq = index.FaissRetriever(64, "OPQ16,IVF1,PQ16")  # Trained on the added vectors.
  pq.add(docs, doc_ids)
  _, flat_ids = flat.search(queries, 10)
  _, pq_ids = pq.search(queries, 10)
  recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(pq_ids, flat_ids)])
  print(f"OPQ16,IVF1,PQ16 dim 64: {pq.bytes_per_doc():.2f} bytes/doc (flat {flat.bytes_per_doc():.0f}), "
        f"recall@10 vs flat {recall:.3f}; fixed overhead {pq.memory_bytes() - 2000 * pq.bytes_per_doc():.0f} B")
  # 16 one-byte codes + the 8-byte id IVF keeps per vector; the rotation and codebooks are fixed cost.
  assert pq.bytes_per_doc() == pytest.approx(24, abs=0.5)
  assert flat.bytes_per_doc() == 256
  assert recall >= 0.6
  pq.save(tmp_path / "pq")
  loaded = index.load_retriever(tmp_path / "pq")
  assert loaded.bytes_per_doc() == pq.bytes_per_doc()
  assert loaded.search(queries, 10)[1] == pq_ids


def test_hnsw32(data):
  docs, queries, doc_ids = data
  flat = index.FaissRetriever(32)
  flat.add(docs, doc_ids)
  hnsw = index.FaissRetriever(32, "HNSW32", search_params="efSearch=64")
  hnsw.add(docs, doc_ids)
  _, flat_ids = flat.search(queries, 10)
  scores, hnsw_ids = hnsw.search(queries, 10)
  recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(hnsw_ids, flat_ids)])
  print(f"HNSW32 dim 32: {hnsw.bytes_per_doc():.1f} bytes/doc, recall@10 vs flat {recall:.3f}")
  assert recall >= 0.9
  assert np.all(np.diff(scores, axis=1) <= 0)
  # Vectors plus the graph's links.
  assert hnsw.bytes_per_doc() > 32 * 4


def test_l2_metric_ranks_nearest_first():
  rng = np.random.default_rng(3)
  docs, queries = rng.standard_normal((300, 8)).astype(np.float32), rng.standard_normal((5, 8)).astype(np.float32)
  retriever = index.FaissRetriever(8, metric="l2")
  retriever.add(docs, [str(i) for i in range(300)])
  scores, ids = retriever.search(queries, 5)
  dist = ((queries[:, None, :] - docs[None]) ** 2).sum(-1)
  assert [[int(i) for i in row] for row in ids] == np.argsort(dist, axis=1)[:, :5].tolist()
  np.testing.assert_allclose(scores, -np.sort(dist, axis=1)[:, :5], rtol=1e-4)


@pytest.mark.parametrize("kind", ["faiss", "jax"])
def test_k_beyond_corpus_and_to_run(kind):
  retriever = index.make_retriever(kind, 4)
  retriever.add(np.eye(4, dtype=np.float32)[:3], ["a", "b", "c"])
  scores, ids = retriever.search(np.array([[0, 1, 0.5, 0]], np.float32), 10)
  assert scores.shape == (1, 3) and ids == [["b", "c", "a"]]
  assert index.to_run(["q"], scores, ids) == {"q": {"b": 1.0, "c": 0.5, "a": 0.0}}


@pytest.mark.parametrize("kind", ["faiss", "jax"])
def test_input_errors(kind, tmp_path):
  retriever = index.make_retriever(kind, 4)
  with pytest.raises(ValueError, match="empty index"):
    retriever.search(np.zeros((1, 4), np.float32), 1)
  with pytest.raises(ValueError, match=r"shape \[n, 4\]"):
    retriever.add(np.zeros((2, 5), np.float32), ["a", "b"])
  with pytest.raises(ValueError, match="2 embeddings but 1 ids"):
    retriever.add(np.zeros((2, 4), np.float32), ["a"])
  with pytest.raises(ValueError, match="single-line"):
    retriever.add(np.zeros((1, 4), np.float32), ["a\nb"])
  with pytest.raises(FileNotFoundError, match="meta.json"):
    index.load_retriever(tmp_path)


def test_unknown_kind():
  with pytest.raises(ValueError, match="valid: faiss, jax"):
    index.make_retriever("annoy", 4)


def test_jax_bfloat16_storage_halves_memory(data):
  docs, queries, doc_ids = data
  exact = index.JaxRetriever(32)
  exact.add(docs, doc_ids)
  half = index.JaxRetriever(32, dtype="bfloat16")
  half.add(docs, doc_ids)
  assert half.bytes_per_doc() == 32 * 2 and exact.bytes_per_doc() == 32 * 4
  _, exact_ids = exact.search(queries, 10)
  scores, half_ids = half.search(queries, 10)
  assert scores.dtype == np.float32
  recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(half_ids, exact_ids)])
  assert recall >= 0.9


def test_jax_approximate_top_k_finds_its_recall_target(data):
  """recall_target < 1 takes jax.lax.approx_max_k for each device's top k: against brute-force numpy it must
  find at least the target's share of the true top 10 (exact on this CPU, approximate on a TPU)."""
  docs, queries, doc_ids = data
  approx = index.JaxRetriever(32, recall_target=0.9)
  approx.add(docs, doc_ids)
  _, ids = approx.search(queries, 10)
  truth = np.argsort(-(queries @ docs.T), axis=1)[:, :10]
  recall = np.mean([len(set(a) & {doc_ids[j] for j in t}) / 10 for a, t in zip(ids, truth)])
  assert recall >= 0.9
  with pytest.raises(ValueError, match="recall_target"):
    index.JaxRetriever(32, recall_target=0.0)
