"""FGD's global-consistent granularity embeddings (Eq. 7) and its token windows."""

import numpy as np
import pytest


def _hf(kind):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  common = dict(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                max_position_embeddings=64)
  if kind == "bert":
    model = transformers.BertModel(transformers.BertConfig(attn_implementation="eager", **common),
                                   add_pooling_layer=False)
  else:
    model = transformers.RobertaModel(transformers.RobertaConfig(pad_token_id=1, attn_implementation="eager",
                                                                 **common), add_pooling_layer=False)
  return model.eval()


def _tower(tmp_path, kind, **tower_args):
  import jax  # pylint: disable=g-import-not-at-top
  from jdr.models import hf  # pylint: disable=g-import-not-at-top
  from jdr.models.towers import Tower, TowerConfig  # pylint: disable=g-import-not-at-top
  reference = _hf(kind)
  reference.save_pretrained(tmp_path / kind)
  cfg, encoder_params = hf.load_hf(tmp_path / kind)
  tower = Tower(TowerConfig(encoder=cfg, pooling="cls", **tower_args))
  ids = np.ones((1, 4), np.int32)
  params = jax.device_get(tower.init(jax.random.PRNGKey(0), ids, ids)["params"])
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  params = {**nn.unbox(params), "encoder": encoder_params}
  return reference, tower, params


def _spans(tower, params, ids, mask, span, pooling="attention"):
  from jdr.retrieval import span_embeddings  # pylint: disable=g-import-not-at-top
  return tower.apply({"params": params}, ids, mask, span, pooling=pooling, method=span_embeddings.document_and_span_vectors)


def _batch(kind):
  rng = np.random.default_rng(3)
  ids = rng.integers(3, 90, (3, 14))
  lengths = np.array([14, 10, 6])
  mask = (np.arange(14)[None, :] < lengths[:, None]).astype(np.int32)
  ids = np.where(mask > 0, ids, 1 if kind == "roberta" else 0)
  return ids.astype(np.int32), mask


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "roberta"])
@pytest.mark.parametrize("head", [{}, {"projection_dim": 8, "normalize": True}])
def test_whole_document_span_is_exactly_the_cls_vector(tmp_path, kind, head):
  """Eq. 7 over the whole document is the identity: the [CLS] vector, to float32 rounding (the span path is
  another compiled contraction, so a last bit may differ)."""
  _, tower, params = _tower(tmp_path, kind, **head)
  ids, mask = _batch(kind)
  full = mask[:, None, :].astype(np.float32)  # one span: every real token, [CLS] included
  vectors, spans = _spans(tower, params, ids, mask, full)
  np.testing.assert_allclose(np.asarray(spans[:, 0]), np.asarray(vectors), rtol=0, atol=5e-7)
  plain = tower.apply({"params": params}, ids, mask)
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(vectors))  # asking for spans changes nothing
  half = (mask * (np.arange(14) < 5))[:, None, :].astype(np.float32)
  _, part = _spans(tower, params, ids, mask, half)
  assert np.abs(np.asarray(part[:, 0]) - np.asarray(vectors)).max() > 1e-3  # a part is not the whole


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_span_embedding_against_hugging_face_layers(tmp_path, kind):
  """Eq. 7 for windows of 4 tokens, recomputed from transformers' own last layer: [CLS]'s attention
  probabilities over the span's value vectors, then that layer's output dense, residual, norms and MLP."""
  import torch  # pylint: disable=g-import-not-at-top
  from jdr.data import granularity  # pylint: disable=g-import-not-at-top
  reference, tower, params = _tower(tmp_path, kind)
  ids, mask = _batch(kind)
  span_mask, valid = granularity.windows(mask, 4)
  _, spans = _spans(tower, params, ids, mask, span_mask)
  with torch.no_grad():
    out = reference(input_ids=torch.from_numpy(ids.astype(np.int64)),
                    attention_mask=torch.from_numpy(mask.astype(np.int64)), output_hidden_states=True,
                    output_attentions=True)
    last = reference.encoder.layer[-1]
    h_prev = out.hidden_states[-2]  # the last layer's input
    probs = out.attentions[-1][:, :, 0, :]  # [B, N, L]: [CLS]'s attention in the last layer
    values = last.attention.self.value(h_prev).view(3, 14, 4, 8)  # [B, L, N, D]
    ctx = torch.einsum("bnk,bsk,bknd->bsnd", probs, torch.from_numpy(span_mask), values).reshape(3, -1, 32)
    h = last.attention.output.LayerNorm(last.attention.output.dense(ctx) + h_prev[:, None, 0])
    expected = last.output.LayerNorm(last.output.dense(last.intermediate(h)) + h).numpy()
  got = np.asarray(spans)
  np.testing.assert_allclose(got[valid], expected[valid], rtol=1e-4, atol=1e-4)


def test_windows_cover_every_token_but_cls_once():
  from jdr.data import granularity  # pylint: disable=g-import-not-at-top
  mask = (np.arange(300)[None, :] < np.array([[300], [200], [65], [1]])).astype(np.int32)
  for size in (64, 128):
    span, valid = granularity.windows(mask, size)
    assert span.shape == (4, -(-299 // size), 300)
    counts = span.sum(axis=1)  # windows holding each token
    np.testing.assert_array_equal(counts[:, 0], 0)  # [CLS] is in none
    np.testing.assert_array_equal(counts[:, 1:], mask[:, 1:])  # every other real token in exactly one
    for row, n in enumerate([300, 200, 65, 1]):
      assert valid[row].sum() == -(-(n - 1) // size)
      for s in np.flatnonzero(valid[row]):  # windows are consecutive runs of `size` (the last may be short)
        tokens = np.flatnonzero(span[row, s])
        assert tokens[0] == 1 + s * size and np.all(np.diff(tokens) == 1) and len(tokens) <= size
  with pytest.raises(ValueError, match="size"):
    granularity.windows(mask, 0)


def test_mean_pooled_pieces_are_the_mean_of_their_token_vectors(tmp_path):
  """FGD's "FG pooling" ablation: a piece is the mean of its tokens' last-layer vectors (then the head)."""
  from jdr.data import granularity  # pylint: disable=g-import-not-at-top
  _, tower, params = _tower(tmp_path, "bert")
  ids, mask = _batch("bert")
  span, valid = granularity.windows(mask, 4)
  _, pieces = _spans(tower, params, ids, mask, span, "mean")
  hidden = np.asarray(tower.apply({"params": params}, ids, mask, token_vectors=True))
  for r in range(3):
    for s in np.flatnonzero(valid[r]):
      np.testing.assert_allclose(np.asarray(pieces)[r, s], hidden[r, span[r, s] > 0].mean(0), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("span_pooling", ["attention", "mean"])
def test_pieces_past_the_end_keep_gradients_finite(tmp_path, span_pooling):
  """A window past a short document's end is empty: mean pooling makes it a zero vector, and the normalizing
  head must give it a finite gradient (x / max(norm, eps) gave NaN, which stopped an FGD run at step 2)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jdr.data import granularity  # pylint: disable=g-import-not-at-top
  _, tower, params = _tower(tmp_path, "bert", normalize=True)
  ids, mask = _batch("bert")
  span, valid = granularity.windows(mask, 4)
  assert not valid.all()  # the short rows do have empty windows

  def loss(p):
    doc, pieces = _spans(tower, p, ids, mask, span, span_pooling)
    return jnp.sum(doc) + jnp.sum(pieces * jnp.asarray(valid, jnp.float32)[..., None])

  grads = jax.grad(loss)(params)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree_util.tree_leaves(grads))
