"""Corpus vectors kept by document side: a hit is bitwise a fresh encode, and anything that changes the vectors
(the document tower's weights, the length, the batching, the corpus) is a new entry."""

import time

import jax
import numpy as np
import pytest

from conftest import write_tiny_beir
from jdr.runtime import config_files
from jdr.retrieval import corpus_cache
from jdr.runtime import defaults
from jdr.retrieval import tower_encoder
from jdr.training import trainer
from jdr.data import pairs
from jdr.models import build


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """Separate query and document towers, so one can move without the other."""
  directory = tmp_path_factory.mktemp("cache")
  config = defaults.get_config()
  config_files.apply_overrides(config, ["model.init_from=", "model.fresh=tiny", "model.pooling=mean",
                                        "model.shared=False", f"data.dataset={write_tiny_beir(directory / 'd')}"])
  built = build.build(config.model, config.data)
  data = pairs.load(config.data, directory / "w")
  params = jax.device_get(trainer.initial_params(built.model, built, config, jax.random.PRNGKey(0), None))
  return built, data, params


def _encoder(tiny, cache_dir, **kwargs):
  built, data, _ = tiny
  settings = dict(query_max_length=16, doc_max_length=32, tokens_per_batch=96) | kwargs
  return tower_encoder.TowerEncoder(built.model, built.tokenizer, data, cache_dir=str(cache_dir), **settings)


def _no_encoding(*args, **kwargs):
  raise AssertionError("encoded, where the cache holds these vectors")


@pytest.mark.slow
def test_a_cached_corpus_is_a_fresh_encode_and_follows_the_document_side(tiny, tmp_path, monkeypatch, capsys):
  _, _, params = tiny
  reference = _encoder(tiny, "").corpus(params)  # no cache
  cache = tmp_path / "vectors"
  np.testing.assert_array_equal(_encoder(tiny, cache).corpus(params), reference)
  assert len(list(cache.glob("*.npy"))) == 1

  again = _encoder(tiny, cache)  # another run: a new encoder, the same document side
  monkeypatch.setattr(again, "_encode_corpus", _no_encoding)
  np.testing.assert_array_equal(again.corpus(params), reference)
  assert f"read from {cache}/" in capsys.readouterr().err
  query_moved = dict(params, query_tower=jax.tree.map(lambda w: w + 1.0, params["query_tower"]))
  np.testing.assert_array_equal(again.corpus(query_moved), reference)  # the query tower is not in the name

  # One ulp on one document weight, another length, another batching: each its own entry.
  leaves, treedef = jax.tree.flatten(params["doc_tower"])
  leaves[0] = np.nextafter(leaves[0], np.inf, dtype=leaves[0].dtype)
  doc_moved = dict(params, doc_tower=jax.tree.unflatten(treedef, leaves))
  _encoder(tiny, cache).corpus(doc_moved)
  _encoder(tiny, cache, doc_max_length=24).corpus(params)
  batched = _encoder(tiny, cache, tokens_per_batch=64)
  np.testing.assert_allclose(batched.corpus(params), reference, rtol=1e-5, atol=1e-6)
  assert len(list(cache.glob("*.npy"))) == 4


def test_the_cache_keeps_the_entries_used_last(tmp_path):
  cache = corpus_cache.CorpusCache(tmp_path, kept=2)
  a, b, c = (np.full((2, 3), i, np.float32) for i in range(3))
  cache.put("a", a)
  time.sleep(0.02)  # mtimes in order on any file system's clock
  cache.put("b", b)
  time.sleep(0.02)
  np.testing.assert_array_equal(cache.get("a"), a)  # read: now the last to go
  time.sleep(0.02)
  cache.put("c", c)
  assert cache.get("b") is None and sorted(p.stem for p in tmp_path.glob("*.npy")) == ["a", "c"]
  (tmp_path / "c.npy").write_bytes(b"\x93NUMPY")  # cut short: a miss, not an error
  assert cache.get("c") is None


def test_the_cache_is_a_local_folder():
  with pytest.raises(ValueError, match="eval.corpus_cache=gs://bucket/vectors: the corpus cache is a local folder"):
    corpus_cache.CorpusCache("gs://bucket/vectors")


def test_an_entry_is_named_by_the_document_side_and_everything_else_that_made_it():
  """Names alone: the same document weights under a shared tower or a document tower are one side; another
  tower setting (pooling) or another corpus is another entry."""
  doc = {"encoder": {"w": np.arange(6.0)}}
  separate = {"query_tower": {"encoder": {"w": np.ones(6)}}, "doc_tower": doc}
  shared = {"tower": {"encoder": {"w": np.arange(6.0)}}}
  weights = corpus_cache.weights_digest(corpus_cache.doc_side(separate))
  assert corpus_cache.weights_digest(corpus_cache.doc_side(shared)) == weights
  tokens = corpus_cache.tokens_digest([np.array([101, 7, 102]), np.array([101, 102])])
  name = dict(doc_weights=weights, tower="TowerConfig(pooling='mean')", tokens=tokens, batching="256 None 1")
  assert corpus_cache.entry_name(**name) == corpus_cache.entry_name(**dict(name))
  assert corpus_cache.entry_name(**name | {"tower": "TowerConfig(pooling='cls')"}) != corpus_cache.entry_name(**name)
  other_corpus = corpus_cache.tokens_digest([np.array([101, 7]), np.array([102, 101, 102])])  # same ids, cut apart
  assert corpus_cache.entry_name(**name | {"tokens": other_corpus}) != corpus_cache.entry_name(**name)
