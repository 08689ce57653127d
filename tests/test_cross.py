"""The cross-encoder against Hugging Face's sequence classifiers with the same weights, both directions."""

import numpy as np
import pytest


def _hf_model(kind: str):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  common = dict(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64, num_labels=1)
  if kind == "bert":
    model = transformers.BertForSequenceClassification(transformers.BertConfig(type_vocab_size=2, **common))
  else:
    model = transformers.RobertaForSequenceClassification(transformers.RobertaConfig(
        type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2, **common))
  with torch.no_grad():  # non-zero biases everywhere, so a dropped or transposed tensor shows
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return model.eval()


def _inputs(kind: str):
  rng = np.random.default_rng(1)
  ids = rng.integers(3, 120, (3, 12))
  lengths = np.array([12, 9, 5])
  mask = (np.arange(12)[None, :] < lengths[:, None]).astype(np.int64)
  ids = np.where(mask > 0, ids, 1 if kind == "roberta" else 0)
  types = ((np.arange(12)[None, :] >= 4) & (mask > 0)).astype(np.int64) if kind == "bert" else None
  return ids, mask, types


def _hf_logits(model, ids, mask, types):
  import torch  # pylint: disable=g-import-not-at-top
  kwargs = {"token_type_ids": torch.from_numpy(types)} if types is not None else {}
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), **kwargs).logits[:, 0].numpy()


def _jdr_logits(model, params, ids, mask, types):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return np.asarray(model.apply({"params": params}, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32),
                                None if types is None else jnp.asarray(types, jnp.int32)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_logits_equal_hugging_face_sequence_classifier(tmp_path, kind):
  import transformers  # pylint: disable=g-import-not-at-top
  from jdr.models import cross  # pylint: disable=g-import-not-at-top
  reference = _hf_model(kind)
  reference.save_pretrained(tmp_path / "hf")
  model, params, _ = cross.load_cross_encoder(tmp_path / "hf", with_tokenizer=False)
  ids, mask, types = _inputs(kind)
  expected = _hf_logits(reference, ids, mask, types)
  np.testing.assert_allclose(_jdr_logits(model, params, ids, mask, types), expected, rtol=1e-4, atol=1e-4)
  # Export and read back with transformers: the same logits again.
  cross.export_cross_encoder(model.config, params, tmp_path / "out")
  back = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "out")).eval()
  np.testing.assert_allclose(_hf_logits(back, ids, mask, types), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_plain_encoder_gets_a_fresh_head(capsys):
  from jdr.models import cross  # pylint: disable=g-import-not-at-top
  model, params, tokenizer = cross.load_cross_encoder("minilm")
  assert "random weights" in capsys.readouterr().err
  assert params["classifier"]["kernel"].shape == (384, 1)
  pair = tokenizer(["what is dense retrieval"], ["Dense retrieval ranks documents by embeddings."],
                   return_tensors="np")
  logits = _jdr_logits(model, params, pair["input_ids"], pair["attention_mask"], pair["token_type_ids"])
  assert logits.shape == (1,) and np.isfinite(logits).all()


@pytest.mark.slow
def test_rerank_orders_the_head_by_the_hugging_face_logits_and_keeps_the_tail(tmp_path):
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  from jdr import rerank  # pylint: disable=g-import-not-at-top
  from jdr.data import formats, text  # pylint: disable=g-import-not-at-top
  from jdr.models import hf  # pylint: disable=g-import-not-at-top
  torch.manual_seed(0)
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf.minilm_path()))
  reference = transformers.BertForSequenceClassification(transformers.BertConfig(
      vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      intermediate_size=64, num_labels=1)).eval()
  reference.save_pretrained(tmp_path / "ce")
  tokenizer.save_pretrained(tmp_path / "ce")
  beir = write_tiny_beir(tmp_path / "beir")
  corpus, queries = formats.read_corpus(beir), formats.read_queries(beir / "queries.jsonl")
  doc_ids = list(corpus)
  rng = np.random.default_rng(0)
  run = {q: {d: float(s) for d, s in zip(rng.permutation(doc_ids)[:12], np.arange(12, 0, -1))}
         for q in list(queries)[:4]}
  formats.write_run(tmp_path / "first.trec", run)
  rerank.main(["--model", str(tmp_path / "ce"), "--queries", str(beir), "--corpus", str(beir), "--run",
               str(tmp_path / "first.trec"), "--depth", "5", "--out", str(tmp_path / "re.trec"),
               "--max-length", "64", "--batch-size", "4"])
  out = formats.read_run(tmp_path / "re.trec")
  for q, docs in run.items():
    first = list(docs)
    pair = tokenizer([queries[q]] * 5, [text.doc_text(corpus[d]) for d in first[:5]], truncation="only_second",
                     max_length=64, padding=True, return_tensors="pt")
    with torch.no_grad():
      logits = reference(**pair).logits[:, 0].numpy()
    expected_head = [first[i] for i in np.argsort(-logits, kind="stable")]
    got = list(out[q])
    assert got[:5] == expected_head and got[5:] == first[5:]
    np.testing.assert_allclose([out[q][d] for d in expected_head], np.sort(logits)[::-1], rtol=1e-4, atol=1e-4)


def test_rerank_names_a_run_document_missing_from_the_corpus(tmp_path, capsys):
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  from jdr import rerank  # pylint: disable=g-import-not-at-top
  from jdr.data import formats  # pylint: disable=g-import-not-at-top
  beir = write_tiny_beir(tmp_path / "beir")
  q = next(iter(formats.read_queries(beir / "queries.jsonl")))
  formats.write_run(tmp_path / "r.trec", {q: {"no-such-doc": 1.0}})
  with pytest.raises(SystemExit) as e:
    rerank.main(["--model", "minilm", "--queries", str(beir), "--corpus", str(beir), "--run",
                 str(tmp_path / "r.trec"), "--out", str(tmp_path / "o.trec")])
  assert e.value.code == 2 and "r.trec" in capsys.readouterr().err


CROSS = ["model.architecture=cross_encoder", "model.init_from=", "model.fresh=tiny", "negatives.source=bm25",
         "negatives.per_query=3", "negatives.in_batch=False", "batch_size=4", "data.query_max_length=12",
         "data.doc_max_length=48", "optimizer.warmup_steps=1", "optimizer.learning_rate=1e-3", "log_every=1",
         "eval.rerank_depth=5", "eval.top_k=10", "eval.rerank_batch_size=8", "eval.diagnostic_queries=0"]


def _cross_config(data, extra=()):
  from jdr.runtime import config_files  # pylint: disable=g-import-not-at-top
  from jdr.runtime import defaults
  config = defaults.get_config()
  config_files.apply_overrides(config, CROSS + [f"data.dataset={data}", *extra])
  return config


def test_pairs_batches_join_each_query_with_its_own_candidates(tmp_path):
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  from jdr import negatives  # pylint: disable=g-import-not-at-top
  from jdr.data import batch as batch_lib, pairs, text  # pylint: disable=g-import-not-at-top
  from jdr.models import build  # pylint: disable=g-import-not-at-top
  config = _cross_config(write_tiny_beir(tmp_path / "beir"))
  data = pairs.load(config.data, tmp_path)
  tokenizer = build.build(config.model, config.data).tokenizer
  sampler = negatives.RandomNegatives(list(data.corpus), data.train_qrels)
  make = lambda i, n: pairs.Batches(data, tokenizer, batch_size=4, query_max_length=12, doc_max_length=48,
                                    negative_source=sampler, negatives_per_query=3, in_batch=False, seed=1,
                                    process_index=i, process_count=n, candidates="pairs")
  whole = make(0, 1)
  for step in range(3):
    b = whole.local(step)
    assert batch_lib.check(b) == "pairs" and b["pair_ids"].shape == (4, 4, 48)
    qids, doc_ids, valid = whole.global_layout(step)
    for r in range(4):
      cols = [r] + [4 + r * 3 + j for j in range(3)]
      for c, col in enumerate(cols):
        ids, types = text.pair_tokens(tokenizer, data.queries[qids[r]], text.doc_text(data.corpus[doc_ids[col]]),
                                      48, 12)
        np.testing.assert_array_equal(b["pair_ids"][r, c, :len(ids)], ids)
        assert b["pair_mask"][r, c].sum() == len(ids) and b["pair_types"][r, c, :len(ids)].tolist() == types
      np.testing.assert_array_equal(b["valid"][r], valid[r, cols])
      assert b["labels"][r].tolist() == [1, 0, 0, 0]
    halves = [make(i, 2).local(step) for i in range(2)]
    for k in b:
      np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), b[k])
  ids, _ = text.pair_tokens(tokenizer, "word " * 40, "doc " * 100, 48, 12)
  assert len(ids) == 48 and ids.count(tokenizer.sep_token_id) == 2 and ids.index(tokenizer.sep_token_id) == 11


@pytest.mark.slow
def test_cross_encoder_trains_evaluates_by_reranking_and_exports(tmp_path):
  import transformers  # pylint: disable=g-import-not-at-top
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  from jdr import export  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer
  from jdr.models import build, cross  # pylint: disable=g-import-not-at-top
  result = trainer.train_and_evaluate(_cross_config(write_tiny_beir(tmp_path / "beir"), ["num_train_steps=3"]),
                                    tmp_path / "w")
  assert set(result["after"]) >= {"ndcg@10", "mrr@10", "recall@100"} and "before" in result
  model, params, _, description = build.load_jdr_model(tmp_path / "w")
  assert isinstance(model, cross.CrossEncoder) and description["architecture"] == "cross_encoder"
  out = export.export(tmp_path / "w", tmp_path / "x")
  reference = transformers.AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
  ids = np.array([[2, 5, 7, 3, 9, 9, 3, 0]])
  mask = (ids > 0).astype(np.int64)
  types = np.array([[0, 0, 0, 0, 1, 1, 1, 0]])
  import torch  # pylint: disable=g-import-not-at-top
  with torch.no_grad():
    expected = reference(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                         token_type_ids=torch.from_numpy(types)).logits[:, 0].numpy()
  got = model.apply({"params": params}, ids.astype(np.int32), mask.astype(np.int32), types.astype(np.int32))
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4)


def test_cross_encoder_refuses_in_batch_negatives(tmp_path):
  from conftest import write_tiny_beir  # pylint: disable=g-import-not-at-top
  from jdr.training import trainer  # pylint: disable=g-import-not-at-top
  config = _cross_config(write_tiny_beir(tmp_path / "beir"), ["negatives.in_batch=True"])
  with pytest.raises(ValueError, match="in_batch=False"):
    trainer.train_and_evaluate(config, tmp_path / "w")
