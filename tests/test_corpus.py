"""jdr.retrieval.encoder_runtime, .encodings and .retrievers without a real model: encoding order, encoding directories, id checks, indexes and runs."""

import json
import types

import numpy as np
import pytest

from jdr.retrieval import encoder_runtime
from jdr.retrieval import encodings
from jdr.retrieval import retrievers
from jdr.data import formats


def _fake_runtime(max_length=16, dim=3):
  """A 'tower' whose embedding of a text is (length, sum of ids, first id): easy to check row by row."""
  def apply_fn(params, input_ids, attention_mask):
    del params
    ids = np.asarray(input_ids) * np.asarray(attention_mask)
    return np.stack([attention_mask.sum(1), ids.sum(1), ids[:, 0]], axis=1)[:, :dim].astype(np.float32)
  return encoder_runtime.EncoderRuntime(apply_fn, None, types.SimpleNamespace(pad_token_id=0), max_length, {})


def test_encode_tokens_keeps_the_input_order_across_length_buckets():
  rng = np.random.default_rng(0)
  token_ids = [rng.integers(1, 100, size=n) for n in rng.integers(1, 17, size=37)]
  emb = encoder_runtime.encode_tokens(_fake_runtime(), token_ids, tokens_per_batch=64)
  expected = np.array([[len(t), t.sum(), t[0]] for t in token_ids], np.float32)
  np.testing.assert_array_equal(emb, expected)
  with pytest.raises(ValueError, match="no texts"):
    encoder_runtime.encode_tokens(_fake_runtime(), [])


def test_encode_texts_tokenizes_while_encoding_and_keeps_the_input_order():
  """Texts tokenized in chunks by a background thread, batches sent as buckets fill: each text's own vector,
  in order, whatever batch it shared."""
  class Tokenizer:  # a text of n words is the ids 1..n (capped at truncation), like a fast tokenizer's call
    pad_token_id = 0

    def __call__(self, texts, truncation, max_length, **kwargs):
      return {"input_ids": [list(range(1, min(len(t.split()), max_length) + 1)) for t in texts]}

  runtime = _fake_runtime(max_length=64)
  runtime.tokenizer = Tokenizer()
  rng = np.random.default_rng(1)
  texts = [" ".join(["w"] * n) for n in rng.integers(1, 80, size=700)]  # over two chunks, some truncated
  emb = encoder_runtime.encode_texts(runtime, texts, tokens_per_batch=256)
  lengths = np.minimum([len(t.split()) for t in texts], 64)
  expected = np.array([[n, n * (n + 1) // 2, 1] for n in lengths], np.float32)
  np.testing.assert_array_equal(emb, expected)
  with pytest.raises(ValueError, match="no texts"):
    encoder_runtime.encode_texts(runtime, [])
  # The speed benchmarks compile ahead of timing every shape encode_texts and encode_tokens then use.
  from jdr.bench import encode_speed  # pylint: disable=g-import-not-at-top
  shapes, apply_fn = [], runtime.apply_fn
  runtime.apply_fn = lambda params, ids, mask: (shapes.append(ids.shape), apply_fn(params, ids, mask))[1]
  encode_speed.warm_up(runtime, list(lengths), 256)
  warmed = set(shapes)
  shapes.clear()
  encoder_runtime.encode_texts(runtime, texts, tokens_per_batch=256)
  streamed = set(shapes)
  shapes.clear()
  encoder_runtime.encode_tokens(runtime, [np.arange(1, n + 1) for n in lengths], tokens_per_batch=256)
  from_ids = set(shapes)
  assert streamed | from_ids <= warmed
  assert streamed - from_ids  # streaming uses a shape that planning all at once does not


def _write_encoding(enc_dir, ids, dim=4, seed=0):
  """What encode_corpus writes, with random vectors: two shards."""
  emb = np.random.default_rng(seed).standard_normal((len(ids), dim)).astype(np.float32)
  enc_dir.mkdir(parents=True)
  half = len(ids) // 2
  for shard, rows in enumerate((slice(0, half), slice(half, None))):
    np.save(enc_dir / f"emb-{shard:05d}.npy", emb[rows])
    (enc_dir / f"ids-{shard:05d}.txt").write_text("".join(i + "\n" for i in ids[rows]))
  (enc_dir / "meta.json").write_text(json.dumps({"num_docs": len(ids), "shard_size": half, "num_shards": 2,
                                                 "complete": True, "dim": dim}))
  return emb


def test_encoding_directories_raise_not_exit(tmp_path):
  with pytest.raises(FileNotFoundError, match="no meta.json"):
    encodings.read_meta(tmp_path / "absent")
  ids = [f"d{i}" for i in range(10)]
  emb = _write_encoding(tmp_path / "enc", ids)
  got, got_ids, meta = encodings.load_embeddings(tmp_path / "enc")
  np.testing.assert_array_equal(got, emb)
  assert got_ids == ids == encodings.read_ids(tmp_path / "enc") and meta["dim"] == 4
  (tmp_path / "enc" / "ids-00001.txt").write_text("d5\n")
  with pytest.raises(ValueError, match="corrupt"):
    encodings.load_embeddings(tmp_path / "enc")


def test_encode_corpus_refuses_an_empty_corpus(tmp_path):
  with pytest.raises(ValueError, match="empty"):
    encodings.encode_corpus(_fake_runtime(), {}, tmp_path / "enc")


def test_check_ids_match(tmp_path):
  ids = [f"d{i}" for i in range(10)]
  _write_encoding(tmp_path / "enc", ids)
  corpus = {i: formats.Doc(i, "", "text") for i in ids}
  encodings.check_ids_match(tmp_path / "enc", corpus, "data.dataset=c")
  encodings.check_ids_match(str(tmp_path / "enc"), ids, "data.dataset=c")
  encodings.check_ids_match(ids, iter(ids), "data.dataset=c")

  other = ids[:8] + ["x1", "x2"]
  with pytest.raises(ValueError) as err:
    encodings.check_ids_match(tmp_path / "enc", other, "data.dataset=/data/other")
  message = str(err.value)
  assert message.startswith(f"data.dataset=/data/other: the encoding in {tmp_path / 'enc'} (10 ids) "
                            "does not match the corpus (10 ids)")
  assert "2 only in the encoding ('d8', 'd9')" in message and "2 only in the corpus ('x1', 'x2')" in message

  with pytest.raises(ValueError, match=r"1 only in the corpus \('d10'\)"):
    encodings.check_ids_match(ids, ids + ["d10"], "c")
  many = [f"e{i}" for i in range(20)]
  with pytest.raises(ValueError, match=r"20 only in the corpus \('e0', 'e1', 'e2', 'e3', 'e4', \.\.\.\)"):
    encodings.check_ids_match(ids, ids + many, "c")

  swapped = ids[:3] + [ids[4], ids[3]] + ids[5:]
  with pytest.raises(ValueError, match=r"the same ids in another order, 2 rows differ \(row 3: 'd3' in the "
                                       r"encoding, 'd4' in the corpus, row 4: 'd4' in the encoding, 'd3'"):
    encodings.check_ids_match(tmp_path / "enc", swapped, "c")
  with pytest.raises(ValueError, match="repeats"):
    encodings.check_ids_match(ids, ids + ["d0"], "c")


@pytest.mark.parametrize("backend", ["faiss", "jax"])
def test_build_index_and_retrieve_run_against_numpy(backend):
  rng = np.random.default_rng(1)
  emb = rng.standard_normal((50, 8)).astype(np.float32)
  ids = [f"d{i}" for i in range(50)]
  queries = rng.standard_normal((5, 8)).astype(np.float32)
  qids = [f"q{i}" for i in range(5)]
  run = retrievers.retrieve_run(retrievers.build_index(emb, ids, backend), qids, queries, 7)
  assert list(run) == qids
  for qid, scores in zip(qids, queries @ emb.T):
    top = np.argsort(-scores)[:7]
    assert list(run[qid]) == [ids[i] for i in top]
    np.testing.assert_allclose(list(run[qid].values()), scores[top], rtol=1e-5, atol=1e-5)
  assert retrievers.retrieve_run(retrievers.build_index(emb, ids, backend), [], np.zeros((0, 8)), 3) == {}


def test_build_index_argument_errors():
  emb, ids = np.zeros((3, 4), np.float32), ["a", "b", "c"]
  with pytest.raises(ValueError, match="backend"):
    retrievers.build_index(emb, ids, "annoy")
  with pytest.raises(ValueError, match="exact"):
    retrievers.build_index(emb, ids, "jax", factory="HNSW32")
  with pytest.raises(ValueError, match="3 embeddings but 4 ids"):
    retrievers.build_index(emb, ids + ["d"])
  retriever = retrievers.build_index(emb, ids)
  with pytest.raises(ValueError, match="2 query ids for 1"):
    retrievers.retrieve_run(retriever, ["q1", "q2"], np.zeros((1, 4), np.float32), 2)


def test_load_index_saves_and_reuses_a_faiss_index(tmp_path):
  ids = [f"d{i}" for i in range(10)]
  emb = _write_encoding(tmp_path / "enc", ids)
  built = retrievers.load_index(tmp_path / "enc", "faiss", "Flat", save=True)
  assert (tmp_path / "enc" / "index-faiss-Flat").is_dir()
  reused = retrievers.load_index(tmp_path / "enc", "faiss", "Flat")
  assert len(reused) == len(built) == 10
  run = retrievers.retrieve_run(reused, ["q"], emb[:1], 1)
  assert list(run["q"]) == [ids[int(np.argmax(emb @ emb[0]))]]


@pytest.mark.slow
def test_maxp_scores_a_document_by_its_best_passage(tmp_path):
  """jdr.encode --passages 4 then jdr.retrieve: every document is ranked by the max over its passage vectors
  (brute force over the encoding's rows), and FirstP is the first passage alone."""
  import json  # pylint: disable=g-import-not-at-top
  from jdr import encode, retrieve  # pylint: disable=g-import-not-at-top
  from jdr.data import formats  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  words = [f"w{i}" for i in range(300)]
  corpus = {f"d{i}": formats.Doc(f"d{i}", "", " ".join(rng.choice(words, size=int(rng.integers(5, 60)))))
            for i in range(30)}
  queries = {f"q{i}": " ".join(rng.choice(words, size=4)) for i in range(6)}
  formats.write_beir(tmp_path / "beir", corpus, queries, {q: {"d0": 1} for q in queries})
  for passages in (1, 4):
    out = tmp_path / f"enc{passages}"
    encode.main(["--model", "minilm", "--corpus", str(tmp_path / "beir"), "--out", str(out), "--max-length", "16",
                 "--passages", str(passages), "--shard-size", "7"])
    retrieve.main(["--index", str(out), "--queries", str(tmp_path / "beir"), "--run", str(tmp_path / "r.trec"),
                   "--top-k", "10", "--max-length", "16"])
    emb, ids, meta = encodings.load_embeddings(out)
    runtime = encoder_runtime.load_runtime("minilm", max_length=16)
    q_emb = encoder_runtime.encode_texts(runtime, list(queries.values()))
    rows_per_doc = {d: ids.count(d) for d in corpus}
    assert max(rows_per_doc.values()) == passages and meta["num_docs"] == 30
    if passages == 4:  # windows of 14 content tokens, at most 4 per document
      content = {d: len(runtime.tokenizer(corpus[d].text, add_special_tokens=False)["input_ids"]) for d in corpus}
      assert rows_per_doc == {d: min(4, -(-content[d] // 14)) for d in corpus}
      assert len(set(rows_per_doc.values())) > 1
    run = formats.read_run(tmp_path / "r.trec")
    for qi, q in enumerate(queries):
      scores = emb @ q_emb[qi]
      best = {d: max(scores[r] for r in range(len(ids)) if ids[r] == d) for d in corpus}
      expected = sorted(best, key=lambda d: -best[d])[:10]
      assert list(run[q]) == expected
      np.testing.assert_allclose([run[q][d] for d in expected], [best[d] for d in expected], rtol=1e-5)
    assert json.loads((out / "meta.json").read_text()).get("passages", 1) == passages


@pytest.mark.slow
def test_eq16_ensemble_from_stored_pieces(tmp_path):
  """jdr.encode --pieces stores each document's window vectors (Eq. 7, the same as the tower's own span
  output); jdr.retrieve --ensemble-gamma ranks by s(q, d) + gamma x sum of the best window per level."""
  from jdr import encode, retrieve  # pylint: disable=g-import-not-at-top
  from jdr.data import granularity
  from jdr.retrieval import encoder_runtime  # pylint: disable=g-import-not-at-top
  from jdr.retrieval import encodings  # pylint: disable=g-import-not-at-top
  from jdr.data import formats, text  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(1)
  words = [f"w{i}" for i in range(200)]
  corpus = {f"d{i}": formats.Doc(f"d{i}", "", " ".join(rng.choice(words, size=int(rng.integers(3, 30)))))
            for i in range(12)}
  queries = {f"q{i}": " ".join(rng.choice(words, size=3)) for i in range(4)}
  formats.write_beir(tmp_path / "beir", corpus, queries, {q: {"d0": 1} for q in queries})
  out = tmp_path / "enc"
  encode.main(["--model", "minilm", "--pooling", "cls", "--corpus", str(tmp_path / "beir"), "--out", str(out),
               "--max-length", "24", "--pieces", "passage:8,sentence:4"])
  emb, ids, _ = encodings.load_embeddings(out)
  pieces = encodings.load_pieces(out)
  runtime = encoder_runtime.load_runtime("minilm", pooling="cls", max_length=24)
  # --dtype's default, auto, is float32 on a CPU (bfloat16 on accelerators), and is recorded resolved.
  assert runtime.info["dtype"] == "float32"
  assert json.loads((out / "meta.json").read_text())["dtype"] == "float32"
  tokens = text.tokenize(runtime.tokenizer, [text.doc_text(corpus[d]) for d in ids], 24)
  # The stored vectors are the tower's span outputs for the student's windows; the doc vectors its [CLS].
  plain = encoder_runtime.encode_tokens(runtime, tokens)
  np.testing.assert_allclose(emb, plain, rtol=1e-4, atol=1e-5)
  ids3 = np.zeros((1, 24), np.int32)
  ids3[0, :len(tokens[3])] = tokens[3]
  mask3 = (np.arange(24) < len(tokens[3])).astype(np.int32)[None]
  span, valid = granularity.windows(mask3, 8)
  _, direct = runtime.apply_spans(runtime.params, ids3, mask3, span)
  np.testing.assert_allclose(pieces["passage"][3][valid[0]], np.asarray(direct)[0][valid[0]], rtol=1e-4, atol=1e-5)
  assert np.isnan(pieces["passage"][3][~valid[0]]).all()
  q_emb = encoder_runtime.encode_texts(encoder_runtime.load_runtime("minilm", pooling="cls", max_length=24),
                                  list(queries.values()))
  for gamma in (0.0, 0.3):
    retrieve.main(["--index", str(out), "--queries", str(tmp_path / "beir"), "--run", str(tmp_path / "r.trec"),
                   "--top-k", "5", "--max-length", "24", "--pooling", "cls", "--ensemble-gamma", str(gamma),
                   "--ensemble-depth", "12"])
    run = formats.read_run(tmp_path / "r.trec")
    for qi, q in enumerate(queries):
      best = lambda v: np.nanmax(np.where(np.isnan(v), -np.inf, v))
      total = {d: float(emb[r] @ q_emb[qi]) + gamma * sum(best(pieces[l][r] @ q_emb[qi]) for l in pieces)
               for r, d in enumerate(ids)}
      expected = sorted(total, key=lambda d: -total[d])[:5]
      assert list(run[q]) == expected
      np.testing.assert_allclose([run[q][d] for d in expected], [total[d] for d in expected], rtol=1e-4, atol=1e-5)


def test_gather_host_parts_in_blocks_on_one_host():
  """The block-by-block gather reassembles the rows whatever the block size (one host: its own part)."""
  part = np.random.default_rng(0).standard_normal((37, 5)).astype(np.float32)
  for block_bytes in (4 * 5 * 8, 4 * 5 * 37, 1 << 28, 1):
    np.testing.assert_array_equal(encoder_runtime.gather_host_parts(part, 5, block_bytes), part)
  assert encoder_runtime.gather_host_parts(None, 5).shape == (0, 5)
