"""An encoding's shards as one matrix without concatenation, against the concatenated numpy array."""

import jax
import numpy as np
import pytest

from jdr.retrieval import index as index_lib
from jdr.retrieval import sharded_rows
from jdr.retrieval import topk
from jdr.retrieval import host_search


def shards(tmp_path, sizes=(7, 0, 13, 5), dim=4, seed=0):
  rng = np.random.default_rng(seed)
  parts = [rng.normal(size=(n, dim)).astype(np.float32) for n in sizes]
  mapped = []
  for i, part in enumerate(parts):
    np.save(tmp_path / f"emb-{i}.npy", part)
    mapped.append(np.load(tmp_path / f"emb-{i}.npy", mmap_mode="r"))
  return sharded_rows.ShardedRows(mapped), np.concatenate(parts)


def test_indexing_equals_the_concatenation(tmp_path):
  rows, whole = shards(tmp_path)
  assert rows.shape == whole.shape and len(rows) == 25 and rows.dtype == np.float32
  for key in (slice(None), slice(3, 9), slice(7, 20), slice(20, 100), slice(5, 5), slice(0, 25, 3)):
    np.testing.assert_array_equal(rows[key], whole[key])
  picked = np.array([[24, 0, 7], [8, 8, 19]])
  np.testing.assert_array_equal(rows[picked], whole[picked])
  np.testing.assert_array_equal(rows[[-1, 3]], whole[[-1, 3]])
  np.testing.assert_array_equal(rows[12], whole[12])
  np.testing.assert_array_equal(rows[3:9, 1], whole[3:9, 1])
  np.testing.assert_array_equal(np.asarray(rows), whole)
  with pytest.raises(IndexError):
    rows[[25]]  # pylint: disable=pointless-statement
  assert isinstance(rows[0:5], np.memmap), "a slice within one shard is a view of its map"


@pytest.mark.parametrize("backend", ["faiss", "jax"])
def test_search_over_shards_equals_search_over_the_whole(tmp_path, backend):
  rows, whole = shards(tmp_path, sizes=(40, 1, 33, 26), dim=8, seed=1)
  queries = np.random.default_rng(2).normal(size=(6, 8)).astype(np.float32)
  got_rows, got_scores = host_search.exact_top_rows(rows, queries, 15, backend, "float32")
  want_rows, want_scores = host_search.exact_top_rows(whole, queries, 15, backend, "float32")
  np.testing.assert_array_equal(got_rows, want_rows)
  np.testing.assert_allclose(got_scores, want_scores, rtol=1e-6)


def test_ties_across_shards_go_to_the_earlier_row(tmp_path):
  """Every document the same vector: the top 15 are rows 0-14, as one search of the whole matrix ranks them,
  however the shards' results are merged."""
  vector = np.random.default_rng(5).normal(size=(1, 8)).astype(np.float32)
  mapped = []
  for i, n in enumerate((4, 1, 7, 9)):
    np.save(tmp_path / f"same-{i}.npy", np.repeat(vector, n, axis=0))
    mapped.append(np.load(tmp_path / f"same-{i}.npy", mmap_mode="r"))
  rows, same = sharded_rows.ShardedRows(mapped), np.repeat(vector, 21, axis=0)
  queries = np.random.default_rng(6).normal(size=(3, 8)).astype(np.float32)
  got_rows, _ = host_search.exact_top_rows(rows, queries, 15, "faiss", "float32")
  want_rows, _ = host_search.exact_top_rows(same, queries, 15, "faiss", "float32")
  np.testing.assert_array_equal(got_rows, want_rows)
  np.testing.assert_array_equal(got_rows, np.tile(np.arange(15), (3, 1)))


def test_placed_and_indexed_without_a_copy_equal_the_whole(tmp_path, monkeypatch):
  rows, whole = shards(tmp_path, sizes=(300, 2, 211), dim=8, seed=3)
  monkeypatch.setattr(topk, "PUT_CHUNK_BYTES", 4 * 8 * 50)  # chunks that straddle shard boundaries
  mesh = jax.make_mesh((1,), ("docs",))
  np.testing.assert_array_equal(np.asarray(topk.put_corpus(rows, mesh, "float32").rows)[:513], whole)
  queries = np.random.default_rng(4).normal(size=(3, 8)).astype(np.float32)
  ids = [str(i) for i in range(513)]
  for kind in ("faiss", "jax"):
    sharded = index_lib.make_retriever(kind, 8)
    sharded.add(rows, ids)
    plain = index_lib.make_retriever(kind, 8)
    plain.add(whole, ids)
    assert sharded.search(queries, 9)[1] == plain.search(queries, 9)[1]
  np.testing.assert_array_equal(host_search.HostVectors(matrix=rows)(np.array([[512, -1], [0, 301]])),
                                np.stack([[whole[512], np.zeros(8)], [whole[0], whole[301]]]))


def test_shards_of_another_width_are_refused():
  with pytest.raises(ValueError, match="one width and dtype"):
    sharded_rows.ShardedRows([np.zeros((2, 3), np.float32), np.zeros((2, 4), np.float32)])
