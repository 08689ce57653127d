"""Guided in-batch false-negative masking (negatives.guide.model): the mask against a brute-force transcription of
GISTEmbed's rule, in the step ("self") and on the host (a frozen bi-encoder or cross-encoder)."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import write_tiny_beir
from jdr.runtime import defaults
from jdr.training import guide
from jdr.training import step as step_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def brute_force(scores, valid, margin):
  """Row by row, column by column: a valid column other than the row's positive is dropped when its guide
  score exceeds the positive's minus the margin."""
  kept, count = valid.copy(), 0
  for b in range(scores.shape[0]):
    for c in range(scores.shape[1]):
      if c != b and valid[b, c] and scores[b, c] > scores[b, b] - margin:
        kept[b, c] = False
        count += 1
  return kept, count


@pytest.mark.parametrize("margin", [0.0, 0.3, -0.2])
def test_mask_equals_brute_force(margin):
  rnd = np.random.default_rng(0)
  scores = rnd.normal(size=(6, 14)).astype(np.float32)
  scores[2, 9] = scores[2, 2] - margin  # a tie with the threshold is kept (strictly above is masked)
  valid = rnd.random((6, 14)) > 0.3
  want, want_count = brute_force(scores, valid, margin)
  kept, count = guide.masked_numpy(scores, valid, margin)
  np.testing.assert_array_equal(kept, want)
  assert count == want_count > 0
  kept_jax, count_jax = jax.jit(guide.masked, static_argnums=2)(jnp.asarray(scores), jnp.asarray(valid), margin)
  np.testing.assert_array_equal(np.asarray(kept_jax), want)
  assert int(count_jax) == want_count


def test_self_guide_in_the_step_is_the_loss_over_the_masked_columns():
  rnd = np.random.default_rng(1)
  q, d = rnd.normal(size=(4, 8)).astype(np.float32), rnd.normal(size=(8, 8)).astype(np.float32)
  valid = np.ones((4, 8), bool)
  c = defaults.get_config()
  c.negatives.guide.model, c.negatives.guide.margin = "self", 0.1
  loss, aux = step_lib.tokens_objective(c)(jnp.asarray(q), jnp.asarray(d), {"valid": jnp.asarray(valid)})
  kept, count = brute_force(q @ d.T, valid, 0.1)
  assert int(aux["masked_by_guide"]) == count > 0
  want, _ = step_lib.tokens_objective(defaults.get_config())(jnp.asarray(q), jnp.asarray(d),
                                                               {"valid": jnp.asarray(kept)})
  np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
  # The guide's choice is not differentiated: the gradient is the masked loss's.
  grad = jax.grad(lambda x: step_lib.tokens_objective(c)(x, jnp.asarray(d), {"valid": jnp.asarray(valid)})[0])(
      jnp.asarray(q))
  grad_want = jax.grad(lambda x: step_lib.tokens_objective(defaults.get_config())(
      x, jnp.asarray(d), {"valid": jnp.asarray(kept)})[0])(jnp.asarray(q))
  np.testing.assert_allclose(grad, grad_want, rtol=1e-5, atol=1e-7)


def test_bad_guide_settings_are_refused():
  c = defaults.get_config()
  c.negatives.guide.model, c.negatives.guide.margin = "self", float("nan")
  with pytest.raises(ValueError, match="guide.margin"):
    guide.check(c.negatives.guide, "tokens", "two_tower")
  c.negatives.guide.margin = 0.0
  with pytest.raises(ValueError, match="two towers' token batches"):
    guide.check(c.negatives.guide, "corpus", "two_tower")
  with pytest.raises(ValueError, match="two towers' token batches"):
    guide.check(c.negatives.guide, "tokens", "cross_encoder")


@pytest.fixture(scope="module")
def bi_encoder(tmp_path_factory):
  """A random 2-layer BERT as a Hugging Face directory with the MiniLM tokenizer: a guide bi-encoder."""
  import transformers  # pylint: disable=g-import-not-at-top
  from jdr.models import hf  # pylint: disable=g-import-not-at-top
  from jdr.models.bert import Encoder, EncoderConfig  # pylint: disable=g-import-not-at-top
  path = tmp_path_factory.mktemp("guide-bert")
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf.minilm_path()))
  cfg = EncoderConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2,
                      intermediate_size=64)
  params = Encoder(cfg).init(jax.random.PRNGKey(3), jnp.ones((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32))
  hf.export_hf(cfg, jax.device_get(params["params"]), path, tokenizer=tokenizer)
  return path


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
  """A random 1-layer BERT sequence classifier with the MiniLM tokenizer: a guide cross-encoder."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from jdr.models import hf  # pylint: disable=g-import-not-at-top
  path = tmp_path_factory.mktemp("guide-cross")
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf.minilm_path()))
  torch.manual_seed(0)
  model = transformers.BertForSequenceClassification(transformers.BertConfig(
      vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
      intermediate_size=64, num_labels=1))
  model.save_pretrained(path)
  tokenizer.save_pretrained(path)
  return path


def _train(tmp_path, guide_path, margin=0.0):
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  data = write_tiny_beir(tmp_path / "data")
  config = config_files.load_config_file(str(ROOT / "configs" / "demo.py:tiny"))
  config_files.apply_overrides(config, [f"data.dataset={data}", "num_train_steps=2", "batch_size=8",
                                        "data.eval_split=", "data.query_max_length=16", "data.doc_max_length=32",
                                        f"negatives.guide.model={guide_path}", f"negatives.guide.margin={margin}",
                                        "log_every=1"])
  trainer.train_and_evaluate(config, tmp_path / "w")
  lines = [json.loads(x) for x in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  return config, data, [x for x in lines if "train/loss" in x]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bi_encoder", "cross_encoder"])
def test_host_guide_masks_what_its_scores_say(tmp_path, request, kind):
  """A frozen guide's mask of a batch equals the brute-force rule on the guide's own scores (a bi-encoder's
  dot products by encoder_runtime, a cross-encoder's logits by its scorer), and training logs the count."""
  from jdr.data import pairs, text as text_lib  # pylint: disable=g-import-not-at-top
  from jdr.models import cross  # pylint: disable=g-import-not-at-top
  from jdr.evaluation import reranking  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
  model_dir = request.getfixturevalue(kind)
  # A margin large enough that a random guide masks something in every batch.
  config, data_dir, logged = _train(tmp_path, model_dir, margin=5.0)
  # Step 1's line counts the batches of steps 1 and 2 (the next batch is built while a step runs): 8 rows x 7
  # negatives each.
  assert len(logged) == 2 and logged[0]["train/masked_by_guide"] == 56

  data = pairs.load(config.data, tmp_path / "w2")
  host = guide.HostGuide(config.negatives.guide, data, config.data.query_max_length, config.data.doc_max_length)
  qids = sorted(data.train_qrels)[:4]
  doc_ids = [next(iter(data.train_qrels[q])) for q in qids] + sorted(data.corpus)[:3]
  valid = np.ones((4, 7), bool)
  queries = [data.queries[q] for q in qids]
  docs = [text_lib.doc_text(data.corpus[d]) for d in doc_ids]
  if kind == "bi_encoder":
    # At the guide's lengths, so the batches are the guide's: a random guide's scores lie within 1e-4 of each
    # other, where a last bit moved by another batch shape would move the mask.
    load = lambda side, length: encoder_runtime.load_runtime(str(model_dir), side=side, max_length=length)
    q = encoder_runtime.encode_texts(load("query", config.data.query_max_length), queries)
    d = encoder_runtime.encode_texts(load("doc", config.data.doc_max_length), docs)
    scores = q @ d.T
  else:
    model, params, tokenizer = cross.load_cross_encoder(model_dir)
    score = reranking.make_scorer(model, params, tokenizer, max_length=51)
    scores = score([(qt, dt) for qt in queries for dt in docs]).reshape(4, 7)
  np.testing.assert_allclose(host.scores(qids, doc_ids, valid), scores, rtol=1e-4, atol=1e-5)
  # masked when s - s_pos > -margin: a margin at minus the median gap masks about half the negatives
  margin = -float(np.median(scores - scores[np.arange(4), np.arange(4)][:, None]))
  host.margin = margin
  batch = host.complete({"valid": valid[1:3]}, (qids, doc_ids, valid), (1, 3))
  want, count = brute_force(scores, valid, margin)
  np.testing.assert_array_equal(batch["valid"], want[1:3])
  assert host.log_scalars() == {"masked_by_guide": count}
