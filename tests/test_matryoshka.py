"""Matryoshka (loss.matryoshka_dims): the loss summed over prefixes, checked against a float64 transcription of
Kusupati et al.'s Eq. 1; equal with and without gradient caching; served by `jdr.encode --dim` as
sentence-transformers' truncate_dim serves the export."""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from conftest import write_tiny_beir
from jdr.models.bert import EncoderConfig
from jdr.models.towers import Tower, TowerConfig, TwoTower
from jdr.runtime import defaults
from jdr.training import gradcache
from jdr.training import losses
from jdr.training import step as step_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _config(dims="", weights="", **loss):
  c = defaults.get_config()
  c.loss.matryoshka_dims, c.loss.matryoshka_weights = dims, weights
  c.loss.update(loss)
  return c


def _unit(x):
  return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _nll64(q, d, valid, temperature):
  """Float64 in-batch softmax NLL, column b the positive of row b, mean over rows."""
  s = (q @ d.T) / temperature
  s = np.where(valid, s, -np.inf)
  s = s - s.max(axis=1, keepdims=True)
  log_p = s - np.log(np.exp(s).sum(axis=1, keepdims=True))
  return -np.mean(log_p[np.arange(len(q)), np.arange(len(q))])


@pytest.mark.parametrize("normalize", [True, False], ids=["cosine", "dot"])
def test_matryoshka_softmax_equals_float64_sum_over_prefixes(normalize):
  rnd = np.random.default_rng(0)
  q, d = rnd.normal(size=(4, 12)), rnd.normal(size=(9, 12))
  if normalize:
    q, d = _unit(q), _unit(d)
  valid = rnd.random((4, 9)) > 0.2
  valid[np.arange(4), np.arange(4)] = True
  dims, weights = (12, 8, 3), (1.0, 0.5, 2.0)
  objective = step_lib.tokens_objective(_config("3,12,8", "2,1,0.5", temperature=0.05), (normalize, normalize))
  loss, aux = jax.jit(objective)(jnp.float32(q), jnp.float32(d), {"valid": jnp.asarray(valid)})
  prefix = (lambda x, m: _unit(x[:, :m])) if normalize else (lambda x, m: x[:, :m])
  per_dim = {m: _nll64(prefix(q, m), prefix(d, m), valid, 0.05) for m in dims}
  want = sum(w * per_dim[m] for m, w in zip(dims, weights))
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  for m in dims:
    np.testing.assert_allclose(float(aux[f"loss/dim_{m}"]), per_dim[m], rtol=2e-5)
  # Without dims the objective is the full width alone, with no per-dim keys.
  plain, plain_aux = step_lib.tokens_objective(_config(temperature=0.05))(
      jnp.float32(q), jnp.float32(d), {"valid": jnp.asarray(valid)})
  np.testing.assert_allclose(float(plain), _nll64(q, d, valid, 0.05), rtol=2e-5)
  assert not [k for k in plain_aux if k.startswith("loss/dim_")]


def test_matryoshka_ranknet_with_pair_weights_sums_over_prefixes():
  """The ranking losses take the same prefixes: RankNet with per-pair weights, float64."""
  rnd = np.random.default_rng(1)
  q, d = rnd.normal(size=(3, 6)), rnd.normal(size=(6, 6))
  weights = rnd.random((3, 6))
  batch = {"valid": jnp.ones((3, 6), bool), "weights": jnp.float32(weights)}
  loss, _ = step_lib.tokens_objective(_config("6,2", name="ranknet"))(jnp.float32(q), jnp.float32(d), batch)

  def ranknet64(q, d):
    s = q @ d.T
    pos = s[np.arange(3), np.arange(3)][:, None]
    neg = ~np.eye(3, 6, dtype=bool)
    per = np.log1p(np.exp(s - pos)) * weights
    return np.mean(np.where(neg, per, 0).sum(1) / neg.sum(1))
  np.testing.assert_allclose(float(loss), ranknet64(q, d) + ranknet64(q[:, :2], d[:, :2]), rtol=2e-5)


def test_matryoshka_margin_mse_distillation_takes_each_prefix():
  """A distillation term (MarginMSE on the query's own candidates) is summed over the prefixes too."""
  rnd = np.random.default_rng(2)
  b, per = 2, 2
  q, d = _unit(rnd.normal(size=(b, 8))), _unit(rnd.normal(size=(b + b * per, 8)))
  teacher = rnd.normal(size=(b, 1 + per))
  c = _config("8,4", temperature=0.1)
  c.distill.teacher, c.distill.margin_mse, c.distill.document, c.distill.granularities = "mined", True, False, ""
  c.distill.contrastive_weight = 0.0
  batch = {"valid": jnp.ones((b, b + b * per), bool), "teacher_doc": jnp.float32(teacher)}
  loss, aux = step_lib.tokens_objective(c, (True, True))(jnp.float32(q), jnp.float32(d), batch)

  def margin64(q, d):
    own = np.concatenate([np.arange(b)[:, None], b + np.arange(b)[:, None] * per + np.arange(per)[None]], 1)
    s = np.take_along_axis(q @ d.T, own, axis=1) / 0.1
    return np.mean(np.mean(((s[:, :1] - s[:, 1:]) - (teacher[:, :1] - teacher[:, 1:])) ** 2, axis=1))
  want = margin64(q, d) + margin64(_unit(q[:, :4]), _unit(d[:, :4]))
  np.testing.assert_allclose(float(loss), want, rtol=2e-5)
  np.testing.assert_allclose(float(aux["loss/dim_4"]), margin64(_unit(q[:, :4]), _unit(d[:, :4])), rtol=2e-5)


TINY = EncoderConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                     max_position_embeddings=16)


@pytest.mark.slow
def test_matryoshka_under_gradient_caching_equals_the_whole_batch():
  model = TwoTower(TowerConfig(TINY, pooling="mean", normalize=True), TowerConfig(TINY, pooling="mean",
                                                                                  normalize=True))
  rnd = np.random.default_rng(3)
  ids = lambda n, length: jnp.asarray(rnd.integers(1, 50, (n, length)), jnp.int32)
  batch = {"query_ids": ids(4, 6), "query_mask": jnp.ones((4, 6), jnp.int32), "doc_ids": ids(8, 8),
           "doc_mask": jnp.ones((8, 8), jnp.int32), "valid": jnp.ones((4, 8), bool)}
  params = model.init(jax.random.PRNGKey(0), batch["query_ids"][:1], batch["query_mask"][:1],
                      batch["doc_ids"][:1], batch["doc_mask"][:1])["params"]
  objective = step_lib.tokens_objective(_config("16,8,4", temperature=0.05), step_lib.normalizes(model))
  args = (gradcache.per_row_encoder(model, "encode_query"), gradcache.per_row_encoder(model, "encode_doc"),
          lambda q, d: objective(q, d, batch))
  want = jax.jit(functools.partial(gradcache.plain_value_and_grad, *args))(params, batch, jax.random.PRNGKey(1))
  got = jax.jit(functools.partial(gradcache.cached_value_and_grad, *args, chunk_size=3))(
      params, batch, jax.random.PRNGKey(1))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert set(got[1]) >= {"loss/dim_16", "loss/dim_8", "loss/dim_4"}
  for g, w in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
    np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * max(1.0, float(np.abs(w).max())))


@pytest.mark.parametrize("dims,weights,match", [
    ("64,x", "", "positive integers"), ("0,8", "", "positive integers"), ("8,8", "", "twice"),
    ("8,4", "1", "one finite weight"), ("8,4", "0,0", "not all 0"), ("8,4", "1,nan", "one finite weight"),
    ("", "1", "without loss.matryoshka_dims")])
def test_bad_matryoshka_settings_are_refused(dims, weights, match):
  with pytest.raises(ValueError, match=match):
    losses.matryoshka_dims(_config(dims, weights).loss)


def test_a_dim_wider_than_the_towers_is_refused():
  with pytest.raises(ValueError, match=r"\[512\] wider than the towers' 384"):
    losses.matryoshka_record(_config("512,64").loss, 384)
  assert losses.matryoshka_record(_config("64,384").loss, 384) == [384, 64]


def test_a_truncated_tower_serves_the_renormalized_prefix():
  cfg = TowerConfig(TINY, pooling="mean", normalize=True)
  ids = jnp.asarray(np.random.default_rng(4).integers(1, 50, (3, 7)), jnp.int32)
  mask = jnp.ones_like(ids)
  params = Tower(cfg).init(jax.random.PRNGKey(0), ids, mask)["params"]
  full = np.asarray(Tower(cfg).apply({"params": params}, ids, mask))
  short = np.asarray(Tower(cfg.replace(truncate_dim=5)).apply({"params": params}, ids, mask))
  np.testing.assert_allclose(short, _unit(full[:, :5]), rtol=1e-5, atol=1e-6)
  assert cfg.replace(truncate_dim=5).dim == 5
  with pytest.raises(ValueError, match="truncate_dim must be between 1 and the tower's 16"):
    cfg.replace(truncate_dim=17)


@pytest.mark.slow
def test_trained_matryoshka_model_serves_its_dims_in_jdr_and_sentence_transformers(tmp_path):
  """Train a tiny model with dims 64,16; the workdir and its export record them; `jdr.encode --dim 16` gives
  what SentenceTransformer(export, truncate_dim=16) gives (cosine: re-normalized); a width it was not trained
  at is refused; `jdr.retrieve` embeds its queries at the index's width."""
  from jdr import encode, export, retrieve  # pylint: disable=g-import-not-at-top
  from jdr.data import formats, text as text_lib  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encoder_runtime, encodings  # pylint: disable=g-import-not-at-top
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data")
  config = config_files.load_config_file(str(ROOT / "configs" / "demo.py:tiny"))
  config_files.apply_overrides(config, [f"data.dataset={data}", "num_train_steps=2", "batch_size=4",
                                        "data.eval_split=", "data.query_max_length=16", "data.doc_max_length=32",
                                        "model.normalize=1", "loss.matryoshka_dims=64,16", "data.eval_split=test",
                                        "eval_before_training=False"])
  results = trainer.train_and_evaluate(config, tmp_path / "w")
  assert {"ndcg@10", "dim16/ndcg@10"} <= set(results["after"])  # each narrower width scored on the full corpus
  assert "dim64/ndcg@10" not in results["after"]
  assert json.loads((tmp_path / "w" / "model.json").read_text())["matryoshka_dims"] == [64, 16]
  out = export.export(tmp_path / "w", tmp_path / "export")
  assert json.loads((out / "config_sentence_transformers.json").read_text())["matryoshka_dims"] == [64, 16]

  corpus = formats.read_corpus(data / "corpus.jsonl")
  texts = [text_lib.doc_text(doc) for doc in corpus.values()][:5]
  ours = encoder_runtime.encode_texts(encoder_runtime.load_runtime(str(out), dim=16), texts)
  assert ours.shape == (5, 16)
  full = encoder_runtime.encode_texts(encoder_runtime.load_runtime(str(out)), texts)
  np.testing.assert_allclose(ours, _unit(full[:, :16]), atol=1e-5)
  sentence_transformers = pytest.importorskip("sentence_transformers")
  st = sentence_transformers.SentenceTransformer(str(out), device="cpu", truncate_dim=16)
  np.testing.assert_allclose(ours, _unit(st.encode(texts)), atol=1e-5)
  # The sentence-transformers directory alone, read as a published model, knows the widths too.
  import shutil  # pylint: disable=g-import-not-at-top
  hf_only = shutil.copytree(out, tmp_path / "hf-only", ignore=shutil.ignore_patterns("jdr_model.json", "params"))
  published = encoder_runtime.load_runtime(str(hf_only), dim=16)
  np.testing.assert_allclose(encoder_runtime.encode_texts(published, texts), ours, atol=1e-5)
  for model in (out, tmp_path / "w", hf_only):
    with pytest.raises(ValueError, match="not a width it was trained at"):
      encoder_runtime.load_runtime(str(model), dim=32)

  encode.main(["--model", str(out), "--corpus", str(data), "--out", str(tmp_path / "emb"), "--dim", "16"])
  assert encodings.read_meta(tmp_path / "emb")["dim"] == 16
  retrieve.main(["--index", str(tmp_path / "emb"), "--queries", str(data), "--run", str(tmp_path / "run.trec"),
                 "--top-k", "3"])
  assert (tmp_path / "run.trec").read_text().strip()
  with pytest.raises(SystemExit):  # queries at 64 dims against 16-dim documents: one line, exit 2
    retrieve.main(["--index", str(tmp_path / "emb"), "--queries", str(data), "--run", str(tmp_path / "r2"),
                   "--dim", "64"])


def test_cross_encoder_refuses_matryoshka():
  c = _config("8")
  with pytest.raises(ValueError, match="cross-encoder"):
    step_lib.make_spec(None, None, c, None, "pairs", False)
