"""Dense mining as arrays: the exact top-n on either back-end against brute-force numpy, STAR's positives
dropped from the mined rows, and the pools the samplers hold as rows."""

import collections

import ml_collections
import numpy as np
import pytest

from jdr.retrieval import host_search  # pylint: disable=g-import-not-at-top

from jdr.negatives import retrieved
from jdr.negatives import sampled
from jdr.negatives import sources
from jdr.runtime import defaults


def brute_force(doc_emb, queries, n):
  scores = queries.astype(np.float64) @ doc_emb.astype(np.float64).T
  order = np.argsort(-scores, axis=1, kind="stable")[:, :n]
  return order, np.take_along_axis(scores, order, axis=1)


@pytest.mark.parametrize("backend", ["faiss", "jax"])
def test_exact_top_rows_equals_brute_force(backend):
  rng = np.random.default_rng(0)
  doc_emb = rng.normal(size=(300, 16)).astype(np.float32)
  queries = rng.normal(size=(37, 16)).astype(np.float32)
  rows, scores = host_search.exact_top_rows(doc_emb, queries, 20, backend, "float32", batch=8)
  expected_rows, expected_scores = brute_force(doc_emb, queries, 20)
  assert rows.dtype == np.int32 and scores.dtype == np.float32 and rows.shape == (37, 20)
  np.testing.assert_array_equal(rows, expected_rows)
  np.testing.assert_allclose(scores, expected_scores, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["faiss", "jax"])
def test_exact_top_rows_pads_a_short_corpus(backend):
  rng = np.random.default_rng(1)
  doc_emb = rng.normal(size=(5, 8)).astype(np.float32)
  queries = rng.normal(size=(3, 8)).astype(np.float32)
  rows, scores = host_search.exact_top_rows(doc_emb, queries, 7, backend, "float32")
  np.testing.assert_array_equal(rows[:, :5], brute_force(doc_emb, queries, 5)[0])
  assert (rows[:, 5:] == -1).all() and np.isneginf(scores[:, 5:]).all()


def test_exact_top_rows_reads_a_memory_mapped_matrix(tmp_path):
  """Faiss searches the map where it lies: the result is the in-memory matrix's."""
  rng = np.random.default_rng(2)
  doc_emb = rng.normal(size=(200, 12)).astype(np.float32)
  np.save(tmp_path / "emb.npy", doc_emb)
  mapped = np.load(tmp_path / "emb.npy", mmap_mode="r")
  queries = rng.normal(size=(9, 12)).astype(np.float32)
  np.testing.assert_array_equal(host_search.exact_top_rows(mapped, queries, 10, "faiss")[0],
                                brute_force(doc_emb, queries, 10)[0])


def test_unknown_mining_backend_is_refused():
  with pytest.raises(ValueError, match="mining backend"):
    host_search.mining_backend("gpu")
  assert host_search.mining_backend("auto") == "faiss"  # this host has no accelerator


def test_drop_rows_keeps_rank_order_without_the_excluded():
  rng = np.random.default_rng(3)
  rows = np.stack([rng.permutation(50)[:30] for _ in range(40)]).astype(np.int32)
  rows[5, 25:] = -1  # a short pool
  excluded = np.full((40, 3), -1, np.int32)
  for q in range(40):
    excluded[q, :q % 4] = rng.choice(rows[q][rows[q] >= 0], size=q % 4, replace=False)
  got = sampled.drop_rows(rows, excluded, 20)
  for q in range(40):
    expected = [int(r) for r in rows[q] if r >= 0 and r not in set(excluded[q][excluded[q] >= 0])][:20]
    assert got[q].tolist() == expected + [-1] * (20 - len(expected))


def test_row_pools_sample_from_their_rows_only():
  corpus = [f"d{i}" for i in range(100)]
  qrels = {"a": {"d1": 1}, "b": {"d2": 1}}
  rows = np.array([[1, 10, 11, 12, -1], [20, 21, 22, 23, 24]], np.int32)
  pools = sampled.RowPools(rows, ["a", "b"], qrels, corpus)
  assert pools.pool("a") == ["d1", "d10", "d11", "d12"]
  rng = np.random.default_rng(0)
  seen = collections.Counter()
  for _ in range(50):
    negatives = pools.sample(["a", "b"], ["d1", "d2"], rng, 3)
    assert set(negatives[0]) <= {"d10", "d11", "d12"} and len(set(negatives[0])) == 3
    assert set(negatives[1]) <= {"d20", "d21", "d22", "d23", "d24"}
    seen.update(negatives[1])
  assert len(seen) == 5
  np.testing.assert_array_equal(pools.rows_of(["b", "zzz"]), [[20, 21, 22, 23, 24], [-1] * 5])
  # A pool one short of n is topped up with a random document, and counted.
  pools.sample(["a"], ["d1"], rng, 4)
  assert pools.stats()["fallback_negatives"] == 1


class _FixedEncoder:
  """An encoder whose vectors are given: the miner's wiring without a model."""

  def __init__(self, doc_emb, query_emb, qids):
    self.doc_emb, self.query_emb, self.qids = doc_emb, query_emb, qids
    self.query_max_length, self.doc_max_length = 8, 8

  def corpus(self, params, progress=False, shards_dir=None):
    return self.doc_emb

  def queries(self, params, qids):
    return self.query_emb[[self.qids.index(q) for q in qids]]


def test_dense_static_pools_are_the_top_minus_positives(tmp_path):
  """STAR's static negatives: the top (top_n + extra) of the starting towers, positives dropped, the
  first top_n kept, as rows; what the sampler draws from and what the diagnostics compare."""
  rng = np.random.default_rng(4)
  corpus = {f"d{i}": None for i in range(120)}
  qids = [f"q{i}" for i in range(15)]
  doc_emb = rng.normal(size=(120, 8)).astype(np.float32)
  query_emb = rng.normal(size=(15, 8)).astype(np.float32)
  top, _ = brute_force(doc_emb, query_emb, 14)
  # Each query's positives: two of its own top 14 and one far down the list.
  qrels = {q: {f"d{top[i, 1]}": 1, f"d{top[i, 6]}": 1, f"d{top[i, 0] if i % 2 else 119}": 0}
           for i, q in enumerate(qids)}
  data = type("Data", (), {"corpus": corpus, "train_qrels": qrels, "queries": {q: q for q in qids}})()
  group = ml_collections.ConfigDict({"top_n": 10, "extra": 4, "query_length": 0, "backend": "faiss",
                                     "corpus_dtype": "float32"})
  out = sources.SOURCES["dense_static"].build(group, sources.Run.of(defaults.get_config()), sources.Build(
      data, tmp_path, _FixedEncoder(doc_emb, query_emb, qids)))
  got = out.pools_in_use(qids)
  for i in range(15):
    positives = {top[i, 1], top[i, 6]}
    expected = [int(r) for r in top[i] if r not in positives][:10]
    assert got[i].tolist() == expected, i
  assert list((tmp_path / "cache").glob("dense_static-top14-*.npy")), "the mined rows are cached"


def test_dense_static_mines_at_its_own_query_length(tmp_path):
  """DRhard's prepare_hardneg.py encodes queries at 32 tokens where STAR trains at 24
  (`negatives.dense_static.query_length`): the miner reads that length, the trainer's encoder keeps its own and its
  tokenized queries, and the mined rows are cached under the length they were mined at."""

  class Recording(_FixedEncoder):
    def queries(self, params, qids):
      self.seen.append((self.query_max_length, dict(self._query_tokens)))
      return super().queries(params, qids)

  rng = np.random.default_rng(5)
  qids = [f"q{i}" for i in range(6)]
  encoder = Recording(rng.normal(size=(30, 4)).astype(np.float32), rng.normal(size=(6, 4)).astype(np.float32), qids)
  encoder.query_max_length, encoder._query_tokens, encoder.seen = 24, {"q0": "24 tokens"}, []
  data = type("Data", (), {"corpus": {f"d{i}": None for i in range(30)}, "train_qrels": {q: {"d0": 1} for q in qids},
                           "queries": {q: q for q in qids}})()
  for length in (32, 0):
    group = ml_collections.ConfigDict({"top_n": 5, "extra": 0, "backend": "faiss", "corpus_dtype": "float32",
                                       "query_length": length})
    sources.SOURCES["dense_static"].build(group, sources.Run.of(defaults.get_config()),
                                          sources.Build(data, tmp_path, encoder))
  assert encoder.seen == [(32, {}), (24, {"q0": "24 tokens"})]
  assert encoder.query_max_length == 24 and encoder._query_tokens == {"q0": "24 tokens"}
  assert len(list((tmp_path / "cache").glob("dense_static-top5-*.npy"))) == 2


@pytest.mark.parametrize("rule", ["append", "replace_last"])
def test_host_vectors_serve_every_missing_positive_rule(rule):
  """The step's candidates' vectors from the batch (host retrieval) equal a lookup in the whole matrix."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(6)
  matrix = rng.normal(size=(60, 4)).astype(np.float32)
  cand_rows = np.stack([rng.permutation(60)[:8] for _ in range(5)]).astype(np.int32)
  positive_rows = np.full((5, 3), -1, np.int32)
  positive_rows[:, 0] = rng.integers(0, 60, size=5)
  positive_rows[1, 1] = cand_rows[1, 3]  # a retrieved positive
  positive_rows[2, :2] = cand_rows[2, :2]
  vectors = host_search.HostVectors(matrix=matrix)
  rows, _, _ = retrieved.candidates(jnp.asarray(cand_rows), jnp.asarray(positive_rows), rule)
  got = retrieved.vectors_of(rows, jnp.asarray(cand_rows), jnp.asarray(vectors(cand_rows)),
                             jnp.asarray(positive_rows), jnp.asarray(vectors(positive_rows)))
  rows = np.asarray(rows)
  expected = np.where((rows >= 0)[..., None], matrix[np.maximum(rows, 0)], 0.0)
  np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.slow
def test_compressed_host_index_decodes_what_it_searches():
  """A compressed index keeps codes, not a decoded matrix: the vectors it hands out are its reconstruction
  (sa_decode of sa_encode), and its search finds the rows faiss's own index finds."""
  rng = np.random.default_rng(7)
  emb = rng.normal(size=(3000, 16)).astype(np.float32)
  index = host_search.HostIndex(emb, "OPQ4,IVF1,PQ4", seed=0, train_size=2000)
  assert index.vectors.matrix is None and index.vectors.codes.shape == (3000, index.vectors.codes.shape[1])
  rows = rng.integers(-1, 3000, size=(4, 6))
  got = index.vectors(rows)
  assert not got[rows < 0].any()
  retriever, decoded = host_search.reconstruct(emb, "OPQ4,IVF1,PQ4", train_size=2000)
  np.testing.assert_allclose(got[rows >= 0], decoded[rows[rows >= 0]], rtol=1e-6, atol=1e-6)
  queries = rng.normal(size=(5, 16)).astype(np.float32)
  _, ids = retriever.search(queries, 10)
  np.testing.assert_array_equal(index.search(queries, 10), np.array(ids, dtype=np.int64))


def test_the_evaluator_searches_adores_device_matrix_and_the_mapped_one_alike(tmp_path):
  """A frozen document tower's evaluation searches the matrix the step placed (no second placement) and,
  for the other factories, the vectors where they lie: both give numpy's exact top k."""
  import types  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from jdr.evaluation import periodic  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(8)
  emb = rng.normal(size=(400, 8)).astype(np.float32)
  np.save(tmp_path / "emb.npy", emb)
  mapped = np.load(tmp_path / "emb.npy", mmap_mode="r")
  queries = rng.normal(size=(7, 8)).astype(np.float32)
  mesh = jax.make_mesh((1,), ("docs",))
  placed = retrieved.put_corpus(mapped, [str(i) for i in range(400)], mesh, "float32")
  config = ml_collections.ConfigDict({"seed": 0, "eval": {"backend": "jax", "corpus_dtype": "float32"}})
  me = types.SimpleNamespace(_fixed_corpus=placed, _fixed_search={}, mesh=mesh, config=config, _fixed={},
                             doc_tower_frozen=True)
  expected_rows, expected_scores = brute_force(emb, queries, 12)
  for fixed in (placed, None):  # the step's device copy, then the mapped file by faiss.knn
    me.fixed_corpus = fixed
    for first in (True, False):
      rows, scores = periodic.Evaluator.search_factory(me, "Flat", mapped, queries, 12, first)
      np.testing.assert_array_equal(rows, expected_rows)
      np.testing.assert_allclose(scores, expected_scores, rtol=1e-5, atol=1e-5)
